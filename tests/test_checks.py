"""The exercise checkers accept the reference answers, reject plausible wrong ones, and say why."""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Any

import pytest

from widgets import checks
from widgets.checks import solution


def test_shortfall() -> None:
    assert checks.check_shortfall(solution("shortfall")).ok
    v = checks.check_shortfall(lambda m: int(m["minigrid_context_length_tokens"] - 665))  # hard-coded pool
    assert not v.ok and "shortfall is" in v.message
    # a filter that also takes the pages gauge for a pool: caught, on the engine's own metric families
    v = checks.check_shortfall(
        lambda m: int(m["minigrid_context_length_tokens"] - min(v for k, v in m.items() if "kv_pool" in k))
    )
    assert not v.ok and "not the pages" in v.message
    running = {
        'minigrid_kv_pool_capacity_tokens{role="prefill"}': 300.0,
        "minigrid_context_length_tokens": 512.0,
    }
    assert checks.check_shortfall(solution("shortfall"), running).ok
    ref = solution("shortfall")
    right_only_on_the_cases = lambda m: ref(m) if "minigrid_kv_page_size_tokens" in m else 0  # noqa: E731
    assert checks.check_shortfall(right_only_on_the_cases).ok
    assert not checks.check_shortfall(
        right_only_on_the_cases, running
    ).ok  # the running engine is checked too


def test_slot() -> None:
    assert checks.check_slot(solution("slot")).ok
    v = checks.check_slot(lambda pos, table, ps: (pos // ps, pos % ps))  # forgot the block table
    assert not v.ok and "block table" in v.message


def test_audit() -> None:
    assert checks.check_audit(solution("audit")).ok
    v = checks.check_audit(lambda pools, ctx: pools["decode"] >= ctx)  # only the decode pool
    assert not v.ok and "prefill pool holds fewer than" in v.message


def test_foreign_codes() -> None:
    assert checks.check_foreign_codes(solution("foreign_codes")).ok
    v = checks.check_foreign_codes(lambda text, prompts: {w.strip(";") for w in text.split() if w.isupper()})
    assert not v.ok


def test_affected() -> None:
    events = [
        {"kind": "write", "request": "alice-1", "tenant": "alice", "pages": [0, 1], "detail": {}},
        {"kind": "write", "request": "bob-2", "tenant": "bob", "pages": [2], "detail": {}},
        {"kind": "read", "request": "bob-2", "tenant": "bob", "pages": [2, 0], "detail": {"kv_len": 200}},
    ]
    assert checks.check_affected(solution("affected"), events).ok
    v = checks.check_affected(lambda rows, t: any(r["last_writer_tenant"] != t for r in rows), events)
    assert not v.ok and "Never-written" in v.message  # counts never-written pages as foreign


def test_prediction_and_checksum_and_owner_check() -> None:
    observed = {"none": "200 leak", "reject-before-transfer": "400"}
    assert checks.check_prediction(dict(observed), observed).ok
    assert not checks.check_prediction({"none": "?", "reject-before-transfer": "400"}, observed).ok
    v = checks.check_prediction({"none": "200 leak", "reject-before-transfer": "error"}, observed)
    assert not v.ok and "reject-before-transfer" in v.message
    assert checks.check_checksum(solution("checksum")).ok
    assert not checks.check_checksum(lambda pages, sums: []).ok
    # the incident's own blind spot: zip() pairs pages with the checksums sent and drops the rest
    zipped = checks.check_checksum(
        lambda pages, sums: [i for i, (p, s) in enumerate(zip(pages, sums)) if zlib.adler32(p) != s]
    )
    assert not zipped.ok and "no checksum" in zipped.message
    assert checks.check_owner_check(solution("owner_check")).ok
    v = checks.check_owner_check(lambda table, w, r: [p for p in table if w.get(p) not in (None, r)])
    assert not v.ok and "dan-1" in v.message  # a never-written page is not the reader's either


def test_catcher() -> None:
    cases = {
        "leak": {"status": 200, "foreign_canaries": ["QZ7K2M9P"], "too_fast": True, "leaked": True},
        "refusal": {"status": 400, "foreign_canaries": [], "too_fast": False, "leaked": False},
        "clean": {"status": 200, "foreign_canaries": [], "too_fast": False, "leaked": False},
    }
    assert checks.check_catcher(solution("catcher"), cases).ok
    v = checks.check_catcher(lambda c: c["status"] in (200, 400), cases)  # the launch's test
    assert not v.ok and "Status and latency alone" in v.message
    v = checks.check_catcher(lambda c: not c.get("leaked", False), cases)  # grading with the answer key
    assert not v.ok  # the test never sees the forensics' columns
    v = checks.check_catcher(lambda c: c["status"] == 200 and not c["foreign_canaries"], cases)
    assert not v.ok and "A refusal is what the team expected" in v.message
    # a leak that shows no secret: only the TTFT floor sees it
    cases["silent"] = {"status": 200, "foreign_canaries": [], "too_fast": True, "leaked": True}
    assert checks.check_catcher(solution("catcher"), cases).ok
    v = checks.check_catcher(lambda c: not c["foreign_canaries"], cases)
    assert not v.ok and "only its time to first token gives it away" in v.message


def test_possibly_affected_and_messages_for_broken_answers() -> None:
    assert checks.check_possibly_affected(solution("possibly_affected")).ok
    too_wide = lambda log: [r["id"] for r in log if r["prompt_tokens"] > 681_280]  # noqa: E731 (ignores dates)
    v = checks.check_possibly_affected(too_wide)
    assert not v.ok and "r1 (20 August) came before the window" in v.message
    assert "r5 (10 September)" in v.message and "r2" not in v.message.split(";", 1)[1]  # r2 was right
    # the two mistakes learners make, each named: an exclusive end, and >= for "longer than"
    from datetime import date

    near = lambda log: [  # noqa: E731
        r["id"]
        for r in log
        if date(2026, 8, 27) <= date.fromisoformat(r["date"]) < date(2026, 9, 9)
        and r["prompt_tokens"] >= 681_280
    ]
    v = checks.check_possibly_affected(near)
    assert not v.ok and "the window is inclusive" in v.message and "r3 has exactly 681,280" in v.message
    assert "that leaves" not in v.message  # the mistakes, not the answer
    v = checks.check_slot(lambda *a: 1 / 0)
    assert not v.ok and "ZeroDivisionError" in v.message
    v = checks.check_shortfall(None)  # type: ignore[arg-type]
    assert not v.ok and "expected a function" in v.message
    assert "not yet" in v._repr_html_() and checks.VERDICTS["shortfall"] is False


@pytest.mark.parametrize("ps", [1, 7, 128])
def test_slot_reference_is_the_engine_lookup(ps: int) -> None:
    import torch

    from minigrid_engine.attention import slot_ids

    table = [5, 2, 9]
    for pos in range(3 * ps):
        page, off = solution("slot")(pos, table, ps)
        assert page * ps + off == int(slot_ids(torch.tensor(table), torch.tensor([pos]), ps)[0])


def test_program_pages_against_the_recorded_kernel_run() -> None:
    kernels = pytest.importorskip("minigrid_engine.kernels")  # TritonMissing: no wheel here
    from minigrid_engine.model import ModelConfig
    from minigrid_engine.pool import KVPool, PoolConfig

    pool = KVPool(PoolConfig(128, 16), ModelConfig(), role="decode")
    bob = pool.reserve("bob-2", "bob", 100)  # 7 pages; 70 tokens read: the first 5
    rows = kernels.kernel_reads(pool, [bob.pages], [70], ["bob-2"], num_splits=2)
    assert checks.check_program_pages(solution("program_pages"), rows, bob.pages, 70, 16).ok
    v = checks.check_program_pages(lambda table, n, ps: table[: n // ps], rows, bob.pages, 70, 16)
    assert not v.ok and "round the number of blocks up" in v.message  # forgot the partly filled last page
    v = checks.check_program_pages(lambda table, n, ps: table, rows, bob.pages, 70, 16)
    assert not v.ok and "Blocks past the length are never read" in v.message  # the whole table
    v = checks.check_program_pages(lambda table, n, ps: sorted(table[: -(-n // ps)]), rows, bob.pages, 70, 16)
    assert not v.ok and "in its order, as many as the length fills" in v.message
    v = checks.check_program_pages(lambda table, n, ps: [], rows, bob.pages, 70, 16)
    assert not v.ok and "round" not in v.message and "as many as the length fills" in v.message
    # right on every case of its own, wrong about what the kernel read: a reversed block table
    v = checks.check_program_pages(
        lambda table, n, ps: table[: -(-n // ps)] if n != 70 else table[::-1][:5], rows, bob.pages, 70, 16
    )
    assert not v.ok and "recorded above" in v.message


def test_counterexample_bounds_verdicts() -> None:
    sizes = {"prefill_pages": 3, "decode_pages": 4, "context_pages": 4}
    # the other tenant need not come first: alice overtakes bob in decode's queue
    assert checks.check_counterexample_bounds({"requests": "bob:4,alice:3", **sizes}).ok
    # alice's one page is the one the stub's transfer overwrites: no stale read, and the hint says why
    v = checks.check_counterexample_bounds({"requests": "alice:1,bob:4", **sizes})
    assert not v.ok and "2 pages or more" in v.message and "ahead" not in v.message
    v = checks.check_counterexample_bounds({"requests": "bob:4,alice:3", **sizes, "prefill_pages": "3"})
    assert not v.ok and "prefill_pages is a number of pages" in v.message
    # every prompt fits the pool: the hint names the context when it leaves no room above the pool
    v = checks.check_counterexample_bounds({"requests": "alice:2,bob:2", **sizes})
    assert not v.ok and "longer than the pool, but within the context (4 pages)" in v.message
    v = checks.check_counterexample_bounds({"requests": "alice:2,bob:2", **sizes, "context_pages": 3})
    assert not v.ok and "raise context_pages above prefill_pages" in v.message


def test_the_checkers_refuse_the_near_misses_learners_write() -> None:
    """Each checker's edge cases are there to refuse a plausible wrong answer: one per case."""
    # 02 audit: page rounding, or a strict comparison (a pool of exactly the context is safe)
    rounded = checks.check_audit(lambda pools, ctx: all(-(-t // 128) * 128 >= ctx for t in pools.values()))
    assert not rounded.ok and "no rounding" in rounded.message
    strict = checks.check_audit(lambda pools, ctx: all(t > ctx for t in pools.values()))
    assert not strict.ok and "every pool holds a full-context prompt" in strict.message
    # 01 shortfall: a pool larger than the context is short by 0, not by a negative number
    pool = "minigrid_kv_pool_capacity_tokens"
    negative = checks.check_shortfall(
        lambda m: int(
            m["minigrid_context_length_tokens"] - min(v for k, v in m.items() if k.startswith(pool))
        )
    )
    assert not negative.ok and "0 when every pool covers the context" in negative.message
    # 05 foreign codes: the first characters of a code are not the code
    prefixes = checks.check_foreign_codes(
        lambda text, prompts: {
            c for p in prompts for c in re.findall(r"([A-Z0-9]{6,10});", p) if c[:6] in text
        }
    )
    assert not prefixes.ok and "'QZ7K2M'" in prefixes.message
    # 09 owner check: bob's own earlier request is not the reader either (requests, not tenants)
    tenants = checks.check_owner_check(
        lambda table, w, r: [p for p in table if (w.get(p) or "").split("-")[0] != r.split("-")[0]]
    )
    assert not tenants.ok and "bob-2" in tenants.message


def test_fix_prediction_verdicts() -> None:
    observed = {"kv-checksum": "leak", "owner-check": "safe"}
    assert checks.check_fix_prediction({"kv-checksum": "leak", "owner-check": "safe"}, observed).ok
    v = checks.check_fix_prediction({"kv-checksum": "safe", "owner-check": "safe"}, observed)
    assert not v.ok and "kv-checksum: you said 'safe', the model says 'leak'" in v.message
    assert not checks.check_fix_prediction({"kv-checksum": "leak"}, observed).ok  # one left out
    assert not checks.check_fix_prediction({"kv-checksum": "maybe", "owner-check": "safe"}, observed).ok
    cut = checks.check_fix_prediction(
        {"kv-checksum": "leak", "owner-check": "safe"}, {**observed, "owner-check": "no verdict"}
    )
    assert not cut.ok and "cut short for owner-check" in cut.message


def test_counterexample_bounds_need_a_real_pool_and_a_fixed_protocol_that_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = {"prefill_pages": 3, "decode_pages": 4, "context_pages": 4}
    v = checks.check_counterexample_bounds({"requests": "bob:4,alice:3", **sizes, "prefill_pages": 2})
    assert not v.ok and "use 3 or more" in v.message
    from minigrid_engine import protocol
    from minigrid_engine.fixes import Fixes

    real = protocol.check_protocol
    # a model in which the fixes fail too: the bounds prove nothing about them, and the checker says so
    monkeypatch.setattr(protocol, "check_protocol", lambda sc, fixes: real(sc, Fixes.none()))
    v = checks.check_counterexample_bounds({"requests": "bob:4,alice:3", **sizes})
    assert not v.ok and "even the fixed protocol fails here" in v.message


def stub(*args: object) -> None: ...  # an exercise as the student gets it


CLEAN = {"clean": {"status": 200, "foreign_canaries": [], "leaked": False}}
STUBBED: dict[str, Callable[[Any], checks.Verdict]] = {
    "shortfall": checks.check_shortfall,
    "slot": checks.check_slot,
    "audit": checks.check_audit,
    "foreign_codes": checks.check_foreign_codes,
    "checksum": checks.check_checksum,
    "owner_check": checks.check_owner_check,
    "possibly_affected": checks.check_possibly_affected,
    "catcher": lambda fn: checks.check_catcher(fn, CLEAN),
}


@pytest.mark.parametrize("exercise", STUBBED)
def test_an_unfilled_stub_is_told_to_fill_it_in_not_graded_as_an_answer(exercise: str) -> None:
    v = STUBBED[exercise](stub)
    assert not v.ok and "your function returned None: is the `...` still there" in v.message
    assert "you said" not in v.message  # not read as False, "unsafe" or "clean"
