"""The protocol model check: the incident is the shortest counterexample; the fixes close it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from minigrid_engine.fixes import Fixes
from minigrid_engine.protocol import (
    COMBINED,
    INCIDENT,
    LATE_TRANSFER,
    check_protocol,
    fix_table,
    make_scenario,
    parse_requests,
)
from minigrid_engine.request import TRANSITIONS

FIXED = replace(Fixes.all(), capacity_check=False)  # capacity-check alone refuses to start


def test_none_counterexample_is_the_incident() -> None:
    r = check_protocol(INCIDENT, Fixes.none())
    assert r.violation is not None and r.violation_kind == "stale-read"
    actions = [s.action for s in r.violation]
    assert "stub" in actions
    stub = next(s for s in r.violation if s.action == "stub")
    assert stub.request == "bob-2" and "pending 400" in stub.text
    send = [s for s in r.violation if s.action == "send" and s.request == "bob-2"]
    assert send and "sends 1 page(s)" in send[0].text and "Success" in send[0].text
    last = r.violation[-1]
    assert last.action == "read" and last.request == "bob-2" and "alice-1" in last.text
    assert len(r.violation) == 18  # BFS: no shorter trace reaches a stale read


def test_all_fixes_hold() -> None:
    assert check_protocol(INCIDENT, Fixes.all()).refused_to_start
    short_decode = replace(INCIDENT, prefill_pages=4, decode_pages=3, context_pages=4)
    assert check_protocol(short_decode, Fixes.all()).refused_to_start  # every pool, as the engine does
    for sc in (INCIDENT, LATE_TRANSFER, COMBINED):
        r = check_protocol(sc, FIXED)
        assert r.safe and r.complete, r.format()
    assert check_protocol(LATE_TRANSFER, FIXED).states_explored > 1000


@pytest.mark.parametrize(
    ("scenario", "safe"),
    [
        (
            INCIDENT,
            {
                "reject-before-transfer",
                "coverage-check",
                "kv-checksum",
                "scrub-on-free",
                "owner-check",
                "all-but-capacity-check",
            },
        ),
        (LATE_TRANSFER, {"owner-check", "deferred-release", "all", "all-but-capacity-check"}),
    ],
)
def test_fix_table(scenario, safe) -> None:
    table = fix_table(scenario)
    got = {name for name, r in table.items() if r.safe and not r.refused_to_start}
    assert got == safe


def test_model_edges_are_engine_edges() -> None:
    for sc in (INCIDENT, LATE_TRANSFER):
        for fixes in (Fixes.none(), FIXED):
            r = check_protocol(sc, fixes)
            assert r.edges
            for old, new in r.edges:
                assert new in TRANSITIONS[old], (old, new)


def test_a_safe_verdict_with_an_unguarded_stub_says_it_holds_for_these_requests_only() -> None:
    """dora's one page, freed last, is the page the stub overwrites: no stale read with these
    requests, though nothing but the pool's order stops one (dora:2 shows it)."""
    lucky = make_scenario(
        INCIDENT, requests=parse_requests("dora:1,eli:4"), prefill_pages=3, decode_pages=6, context_pages=4
    )
    r = check_protocol(lucky, Fixes.none())
    assert r.safe and r.stubbed_unguarded == ("eli-2",), r.format()
    assert "eli-2 took the stub path" in r.format() and "holds for these requests only" in r.format()
    assert r.to_dict()["stubbed_unguarded"] == ["eli-2"]
    unlucky = replace(lucky, requests=parse_requests("dora:2,eli:4"))
    assert check_protocol(unlucky, Fixes.none()).violation_kind == "stale-read"
    guarded = check_protocol(lucky, replace(Fixes.none(), owner_check=True))
    assert guarded.safe and not guarded.stubbed_unguarded and "note:" not in guarded.format()


def test_the_search_bound_gives_no_verdict_one_state_short() -> None:
    whole = check_protocol(INCIDENT, FIXED)
    n = whole.states_explored
    assert whole.complete and whole.safe
    exact = check_protocol(replace(INCIDENT, max_states=n), FIXED)
    assert exact.complete and exact.safe and exact.states_explored == n
    short = check_protocol(replace(INCIDENT, max_states=n - 1), FIXED)
    assert not short.complete and not short.safe and short.verdict != "safe"


def test_the_state_invariant_catches_a_page_lost_or_held_twice() -> None:
    from minigrid_engine.protocol import Protocol

    model = Protocol(INCIDENT, Fixes.none())
    w = model.initial()
    assert model.double_owner(w) is None
    lost = replace(w, dfree=w.dfree[1:])  # a page neither free nor held
    assert model.double_owner(lost) == f"decode: {len(w.dfree) - 1} free + 0 held != {len(w.dfree)} pages"
    page = w.pfree[-1]
    twice = replace(w, pblock=((page,), *w.pblock[1:]))  # in a block table and still free
    assert "prefill page" in (model.double_owner(twice) or "")


def test_an_unguarded_stub_is_noted_only_under_a_safe_verdict() -> None:
    leak = check_protocol(INCIDENT, Fixes.none())
    assert leak.violation is not None and leak.stubbed_unguarded == ()


def test_coverage_check_catches_the_smallest_stub_of_two_pages() -> None:
    """A stub of a 2-page prompt writes 1 page of 2: one short is still short."""
    sc = make_scenario(
        INCIDENT,
        requests=parse_requests("alice:1,carol:1,bob:2"),
        prefill_pages=1,
        decode_pages=3,
        context_pages=2,
    )
    leak = check_protocol(sc, Fixes.none())
    assert leak.violation_kind == "stale-read" and leak.violation is not None
    fixed = check_protocol(sc, replace(Fixes.none(), coverage_check=True))
    assert fixed.safe and fixed.complete
