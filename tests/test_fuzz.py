"""Isolation fuzzing: with every fix no tenant reads another's pages; without, the campaign finds it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from cli_run import minigrid

from minigrid_engine.canary import CanaryHarness
from minigrid_engine.config import incident_preset
from minigrid_engine.fuzz import (
    ROLES,
    Campaign,
    FuzzConfig,
    FuzzReport,
    Outcome,
    Shot,
    expected_status,
    fuzz,
    plan,
    replay,
)


def ev(kind: str, request: str | None, tenant: str | None, pages: list[int], seq: int = 0) -> dict[str, Any]:
    return {"seq": seq, "kind": kind, "request": request, "tenant": tenant, "pages": pages, "detail": {}}


def test_replay_flags_a_read_of_another_requests_page() -> None:
    events = [
        ev("reserve", "alice-1", "alice", [0, 1]),
        ev("write", "alice-1", "alice", [0, 1]),
        ev("read", "alice-1", "alice", [0, 1]),
        ev("release", "alice-1", "alice", [0, 1]),
        ev("reserve", "bob-2", "bob", [0, 1]),
        ev("write", "bob-2", "bob", [0]),  # the stub's one page
        ev("read", "bob-2", "bob", [0, 1]),
        ev("read", "bob-2", "bob", [0, 1]),  # the next step reads it again: counted once
        ev("release", "bob-2", "bob", [0, 1]),
    ]
    r = replay(events)
    assert r.foreign_reads == {("bob-2", 1, "alice-1")}
    assert r.foreign_tenant_reads == {("bob-2", 1): "alice"}
    assert not r.double_owned and not r.still_held


def test_replay_own_and_scrubbed_pages_are_not_foreign() -> None:
    events = [
        ev("write", "alice-1", "alice", [3]),
        ev("scrub", None, None, [3]),
        ev("write", "alice-2", "alice", [4]),
        ev("read", "bob-3", "bob", [3]),  # zeros: wrong, but nobody's data
        ev("read", "alice-2", "alice", [4]),
    ]
    assert not replay(events).foreign_reads


def test_replay_flags_double_ownership_and_foreign_release() -> None:
    events = [
        ev("reserve", "alice-1", "alice", [5]),
        ev("reserve", "bob-2", "bob", [5]),
        ev("release", "carol-3", "carol", [5]),
        ev("reserve", "dave-4", "dave", [6]),
    ]
    r = replay(events)
    assert len(r.double_owned) == 2 and "page 5 reserved by bob-2 while alice-1 holds it" in r.double_owned
    assert r.still_held == {6: "dave-4"}


def test_the_plan_straddles_pages_the_prefill_pool_and_the_context() -> None:
    cfg = incident_preset()
    harness = CanaryHarness(0)
    shots = plan(cfg, FuzzConfig(requests=300, seed=3), ["alice", "bob", "carol"], harness)
    assert shots == plan(cfg, FuzzConfig(requests=300, seed=3), ["alice", "bob", "carol"], CanaryHarness(0))
    lengths = [s.prompt_tokens for s in shots]
    over_context = [s for s in shots if s.prompt_tokens + s.max_tokens > cfg.context_length]
    over_pool = [s for s in shots if s not in over_context and s.prompt_tokens > cfg.prefill_pool_tokens]
    assert len(over_context) > 20 and len(over_pool) > 40 and sum(n <= 665 for n in lengths) > 60
    assert {127, 128, 129} & set(lengths) and {664, 665, 666} & set(lengths)
    assert any(s.abort_after_s is not None for s in shots)
    assert {s.tenant for s in shots} == {"alice", "bob", "carol"}
    for s in shots:  # every prompt is its tenant's, and any record in it carries a canary
        assert s.prompt in harness.prompts[s.tenant]
        assert s.prompt_tokens < 24 or any(c in s.prompt for c in harness.canaries[s.tenant])
    assert expected_status(over_context[0], cfg) == (400, "context_length_exceeded")
    assert expected_status(over_pool[0], cfg) is None  # the faulty engine decides
    assert expected_status(over_pool[0], cfg.with_(fixes="reject-before-transfer")) == (
        400,
        "context_length_exceeded",
    )


def test_minigrid_fuzz_with_every_fix_finds_nothing() -> None:
    """`--fixes all` runs on the corrected pool (capacity-check refuses the incident's numbers)."""
    args = [
        "fuzz",
        "--requests",
        "60",
        "--seed",
        "1",
        "--fixes",
        "all",
        "--concurrency",
        "6",
        "--abort-rate",
        "0.2",
        "--json",
    ]
    proc = minigrid(*args, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["isolated"] and rep["numbers"]["prefill_pool_tokens"] == 2048
    assert rep["requests"] == 60 and rep["ok"] > 20 and rep["rejected"] > 5 and rep["aborted"] >= 1
    assert rep["leaked_responses"] == rep["foreign_pages"] == rep["double_owned"] == rep["errors"] == 0
    assert rep["pages_in_use"] == {"prefill": 0, "decode": 0}
    assert rep["integrity"] == {"prefill": "ok", "decode": "ok"}
    assert rep["unexpected"] == [] and rep["trace_complete"]


def test_fuzz_without_fixes_finds_the_leak() -> None:
    """The same campaign on the incident's engine: 200s for prompts over the pool, read from others."""
    rep = fuzz(incident_preset(), FuzzConfig(requests=60, seed=1, concurrency=6, abort_rate=0.15))
    print(rep.table())
    assert not rep.isolated
    assert rep.oversized_accepted > 5  # 200 instead of 400
    assert rep.leaked_responses >= 3 and rep.foreign_tenant_pages >= 3, rep.table()
    # The bookkeeping itself is sound: the bug is in what decode reads, not in who holds what.
    assert rep.double_owned == 0 and rep.pages_in_use == {"prefill": 0, "decode": 0}
    assert rep.integrity == {"prefill": "ok", "decode": "ok"}
    assert rep.unexpected == []  # over the context: still a 400
    saved = json.loads(rep.to_json())  # what `minigrid fuzz --json` prints: the leaks by pair
    assert saved["leaks"] == dict(rep.leaks) and sum(saved["leaks"].values()) >= rep.leaked_responses


def test_reject_before_transfer_refuses_every_prompt_over_the_pool() -> None:
    cfg = incident_preset(fixes="reject-before-transfer")
    rep = fuzz(cfg, FuzzConfig(requests=40, seed=2, concurrency=6, abort_rate=0.0))
    # every prompt over 665 tokens got 400 context_length_exceeded (or `unexpected` says which not)
    assert rep.unexpected == [] and rep.oversized_accepted == 0
    assert rep.isolated, rep.table()
    assert rep.rejected > 10 and rep.ok > 10


@pytest.mark.parametrize(
    "harm",
    [
        {"leaked_responses": 1},
        {"foreign_pages": 1},
        {"double_owned": 1},
        {"pages_in_use": {"prefill": 0, "decode": 1}},
        {"integrity": {"prefill": "ok", "decode": "page 3 held by a and b"}},
    ],
    ids=["leak", "foreign page", "double owned", "a page still held", "integrity"],
)
def test_isolation_fails_on_any_one_harm(harm: dict[str, object]) -> None:
    clean = {"pages_in_use": {"prefill": 0, "decode": 0}, "integrity": {"prefill": "ok", "decode": "ok"}}
    assert FuzzReport("all", {}, **clean).isolated  # type: ignore[arg-type]
    assert not FuzzReport("all", {}, **{**clean, **harm}).isolated  # type: ignore[arg-type]


def test_the_judge_counts_each_kind_of_answer_and_names_what_the_fixes_do_not_allow() -> None:
    cfg = incident_preset()  # context 1,024, prefill pool 665, every fix
    campaign = Campaign(SimpleNamespace(admin_key="sk-admin"), cfg, FuzzConfig())  # type: ignore[arg-type]
    short, long = Shot(0, "alice", "a" * 100, 8, None), Shot(1, "bob", "b" * 700, 8, None)
    outcomes = [
        Outcome(short, 200, text="fine"),
        Outcome(short, None),  # the client hung up first
        Outcome(short, 0, "ConnectError"),  # no answer at all: the engine's failure
        Outcome(short, 503, "engine_down"),
        Outcome(long, 400, "context_length_exceeded"),
    ]
    whole = {role: {"ok": True} for role in ROLES}
    rep = campaign._judge(outcomes, {"prefill": 0, "decode": 0}, whole)
    assert (rep.requests, rep.ok, rep.aborted, rep.errors, rep.rejected) == (5, 1, 1, 2, 1)
    assert rep.unexpected == [
        "request 0 (100 + 8 tokens): expected 200, got 0 ConnectError",
        "request 0 (100 + 8 tokens): expected 200, got 503 engine_down",
    ]
    assert rep.isolated and rep.leaked_responses == 0 and rep.oversized_accepted == 0
    stubbed = campaign._judge([Outcome(long, 200, text="?")], {"prefill": 0, "decode": 0}, whole)
    assert stubbed.oversized_accepted == 1  # over the prefill pool, yet 200: the incident's symptom
