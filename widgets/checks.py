"""Exercise checkers: `check_*(answer)` runs a learner's answer on cases of its own (other
numbers than the notebook's), and says what is wrong in the incident's terms, never a bare
`AssertionError`. Every verdict is also kept in `VERDICTS`, which a notebook writes to its
papermill result file so CI can assert that the reference answer passes and the stub does not.

The reference answers live in `labs/.solutions/` (hidden in JupyterLab's file browser; see
`labs/INSTRUCTOR.md`); `solution(name)` loads one for an instructor's run.
"""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minigrid_engine.errors import counted

SOLUTIONS = Path(__file__).resolve().parents[1] / "labs" / ".solutions" / "solutions.py"


@dataclass(frozen=True)
class Verdict:
    exercise: str
    ok: bool
    message: str

    def _repr_html_(self) -> str:
        colour, mark = ("#1B7F3B", "✔ correct") if self.ok else ("#B3261E", "✘ not yet")
        return f"<div style='color:{colour}'><b>{mark}</b> ({self.exercise}): {self.message}</div>"

    def __repr__(self) -> str:
        return f"{'correct' if self.ok else 'not yet'} ({self.exercise}): {self.message}"


VERDICTS: dict[str, bool] = {}


def _verdict(exercise: str, ok: bool, message: str) -> Verdict:
    VERDICTS[exercise] = ok
    return Verdict(exercise, ok, message)


def _run(exercise: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, Verdict | None]:
    if not callable(fn):
        return None, _verdict(exercise, False, f"expected a function, got {fn!r}")
    try:
        got = fn(*args)
    except Exception as exc:  # the learner's bug, shown as a message
        return None, _verdict(exercise, False, f"your function raised {type(exc).__name__}: {exc}")
    if got is None:  # the stub as given (`...`), or a path with no `return`: no exercise's answer
        said = "your function returned None: is the `...` still there, or does a path end without `return`?"
        return None, _verdict(exercise, False, said)
    return got, None


def solution(name: str) -> Any:
    """The reference answer `name` (for instructors, and CI's run of the notebooks)."""
    spec = importlib.util.spec_from_file_location("minigrid_lab_solutions", SOLUTIONS)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no solutions at {SOLUTIONS}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# -- 01 welcome ------------------------------------------------------------------------------
def _engine_metrics(pools: dict[str, int], context: int, page_size: int = 128) -> dict[str, float]:
    """A pool size as `eng.metrics()` states it: every KV family, not only the capacity."""
    metrics: dict[str, float] = {"minigrid_context_length_tokens": float(context)}
    for role, tokens in pools.items():
        pages = -(-tokens // page_size)
        metrics |= {
            f'minigrid_kv_pool_capacity_tokens{{role="{role}"}}': float(tokens),
            f'minigrid_kv_pool_pages{{role="{role}"}}': float(pages),
            f'minigrid_kv_pages_in_use{{role="{role}"}}': 0.0,
            f'minigrid_worker_kv_pool_capacity_tokens{{role="{role}",worker="{role}-0"}}': float(tokens),
        }
    return metrics | {"minigrid_kv_page_size_tokens": float(page_size)}


def _pools(metrics: dict[str, float]) -> dict[str, int]:
    prefix = 'minigrid_kv_pool_capacity_tokens{role="'
    return {k[len(prefix) : -2]: int(v) for k, v in metrics.items() if k.startswith(prefix)}


def check_shortfall(
    fn: Callable[[dict[str, float]], int], metrics: dict[str, float] | None = None
) -> Verdict:
    """`fn(metrics)` -> how many tokens the smallest KV pool is short of the context (0 if none):
    on the running engine's `metrics` when given, then on other deployments' numbers."""
    cases = [
        ({"prefill": 665, "decode": 4096}, 1024),
        ({"prefill": 681280, "decode": 4_000_000}, 1048576),
        ({"prefill": 2048, "decode": 4096}, 1024),
        ({"prefill": 4096, "decode": 900}, 1024),
    ]
    every = [metrics] if metrics and _pools(metrics) else []
    every += [_engine_metrics(pools, context) for pools, context in cases]
    for case in every:
        pools, context = _pools(case), int(case["minigrid_context_length_tokens"])
        want = max(0, context - min(pools.values()))
        got, bad = _run("shortfall", fn, dict(case))
        if bad:
            return bad
        if got != want:
            return _verdict(
                "shortfall",
                False,
                f"for pools {pools} and a context of {context:,} tokens you said {got!r}; the smallest "
                f"pool is {min(pools.values()):,} tokens, so the shortfall is {want:,} "
                "(0 when every pool covers the context; the pools are the "
                "minigrid_kv_pool_capacity_tokens lines, not the pages or the per-worker lines).",
            )
    return _verdict(
        "shortfall", True, "the check reads the running engine's own numbers, as question 1 asks."
    )


# -- 02 paged KV cache -----------------------------------------------------------------------
def check_slot(fn: Callable[[int, list[int], int], tuple[int, int]]) -> Verdict:
    """`fn(position, block_table, page_size)` -> (page, offset) holding that token's K/V."""
    import random

    rng = random.Random(7)
    for _ in range(50):
        ps = rng.choice([1, 3, 16, 64, 128])
        table = rng.sample(range(200), rng.randint(1, 8))
        pos = rng.randrange(len(table) * ps)
        got, bad = _run("slot", fn, pos, table, ps)
        if bad:
            return bad
        want = (table[pos // ps], pos % ps)
        if _as_tuple(got) != want:
            return _verdict(
                "slot",
                False,
                f"token {pos} of block table {table} (page size {ps}) is in block {pos // ps}, which is "
                f"page {want[0]}, at offset {want[1]}; you said {got!r}. The block table maps blocks "
                "(position // page size) to pages; pages are not in order.",
            )
    return _verdict("slot", True, "that is the lookup the attention kernel makes for every token it reads.")


# -- 03 disaggregated serving ----------------------------------------------------------------
def check_pages_sent(
    fn: Callable[[dict[str, list[dict[str, Any]]], str], tuple[int, int]], trace: Any
) -> Verdict:
    """`fn(trace, request)` -> (pages prefill wrote, pages decode reserved) for `request`."""
    from widgets.timeline import request_spans

    spans = request_spans(trace)
    if not spans:
        return _verdict("pages_sent", False, "the trace holds no request yet: send one first.")
    for req, s in spans.items():
        got, bad = _run("pages_sent", fn, trace, req)
        if bad:
            return bad
        want = (s.prefill_pages_written, s.decode_pages_reserved)
        if _as_tuple(got) != want:
            return _verdict(
                "pages_sent",
                False,
                f"for {req} you said {got!r}; prefill wrote {want[0]} pages (its `write` events) and "
                f"decode reserved {want[1]} (decode's `reserve` events).",
            )
    return _verdict("pages_sent", True, f"right for all {len(spans)} requests of this trace.")


# -- 04 shrink the pool ----------------------------------------------------------------------
def check_audit(fn: Callable[[dict[str, int], int], bool]) -> Verdict:
    """`fn(pool_tokens_by_role, context_length)` -> True when the deployment is safe."""
    cases = [
        ({"prefill": 665, "decode": 4096}, 1024, False),
        ({"prefill": 2048, "decode": 4096}, 1024, True),
        ({"prefill": 4096, "decode": 512}, 1024, False),
        ({"prefill": 1024, "decode": 1024}, 1024, True),
        ({"prefill": 1023, "decode": 4096}, 1024, False),  # the longest prompt fits, a full context not
        ({"prefill": 1000, "decode": 4096}, 1024, False),  # 8 pages of 128 hold 1,024: tokens count
        ({"prefill": 681280, "decode": 2_000_000}, 1048576, False),
    ]
    for pools, context, want in cases:
        got, bad = _run("audit", fn, dict(pools), context)
        if bad:
            return bad
        if bool(got) != want:
            short = [r for r, t in pools.items() if t < context]
            why = (
                f"the {' and '.join(short)} pool holds fewer than {context:,} tokens"
                if short
                else "every pool holds a full-context prompt"
            )
            return _verdict(
                "audit",
                False,
                f"for pools {pools} and context {context:,} you said "
                f"{'safe' if got else 'unsafe'}, but {why}. The rule has no margin and no rounding: "
                "each pool's token capacity (not its pages) against the context itself.",
            )
    return _verdict("audit", True, "every role's pool must cover the context, prefill included.")


# -- 05 trigger the leak ---------------------------------------------------------------------
def check_foreign_codes(fn: Callable[[str, list[str]], set[str]]) -> Verdict:
    """`fn(answer, victim_prompts)` -> the victim's record codes (e.g. QZ7K2M9P) in the answer."""
    victim = [
        "ALICE card QZ7K2M9P; ALICE pin 4471AB22; ",
        "ALICE key ZZ81KQ0M; ALICE phone KV1DGJOC8E; ALICE vault 7TS3K1; ",
    ]
    cases = [  # the engine's codes are 6 to 10 characters
        (" card QZ7K2M9P; ALICE key ZZ81KQ0M;", {"QZ7K2M9P", "ZZ81KQ0M"}),
        ("BOB card QQQQ1111; BOB card", set()),
        (" phone KV1DGJOC8E; ALICE vault 7TS3K1; AL", {"KV1DGJOC8E", "7TS3K1"}),
        ("E pin 4471AB22; ALICE key ZZ81KQ0M", {"4471AB22", "ZZ81KQ0M"}),  # an answer ends anywhere
        ("QZ7K2M", set()),  # half a code is not a code
    ]
    for text, want in cases:
        got, bad = _run("foreign_codes", fn, text, victim)
        if bad:
            return bad
        if set(got or ()) != want:
            return _verdict(
                "foreign_codes",
                False,
                f"in the answer {text!r} the victim's codes are {sorted(want) or 'none'}; you found "
                f"{sorted(got or ()) or 'none'}. Only whole codes of a victim prompt count, wherever "
                "they stand: an answer can stop right after a code, before its ';'.",
            )
    return _verdict("foreign_codes", True, "that is a canary check: content, not status codes.")


# -- 06 forensics ----------------------------------------------------------------------------
def check_affected(
    fn: Callable[[list[dict[str, Any]], str], bool], decode_events: list[dict[str, Any]]
) -> Verdict:
    """`fn(pages_read_rows, tenant)` -> True when any page read was last written by another tenant."""
    from minigrid_engine.forensics import affected_responses, reads_by_request

    reads = reads_by_request(decode_events)
    affected = {a.request for a in affected_responses(decode_events)}
    tenant_of = {e["request"]: e["tenant"] for e in decode_events if e.get("request") and e.get("tenant")}
    synthetic: list[tuple[list[dict[str, Any]], str, bool]] = [
        ([{"page": 3, "last_writer_tenant": "bob"}, {"page": 4, "last_writer_tenant": None}], "bob", False),
        ([{"page": 3, "last_writer_tenant": "bob"}, {"page": 9, "last_writer_tenant": "carol"}], "bob", True),
    ]
    cases = [(rows, tenant_of.get(r, "?"), r in affected) for r, rows in reads.items()] + synthetic
    for rows, tenant, want in cases:
        got, bad = _run("affected", fn, rows, tenant)
        if bad:
            return bad
        if bool(got) != want:
            writers = sorted({str(r["last_writer_tenant"]) for r in rows})
            return _verdict(
                "affected",
                False,
                f"a response of {tenant} that read pages last written by {writers}: you said "
                f"{'affected' if got else 'clean'}. Never-written pages (None) and the tenant's own pages "
                "are not another customer's data.",
            )
    return _verdict("affected", True, f"agrees with the forensics on {len(cases)} responses.")


# -- 07-09 the fixes -------------------------------------------------------------------------
def check_prediction(
    predicted: dict[str, str],
    observed: dict[str, str],
    lesson: str = "each fix shows the client something different: that is the lesson.",
) -> Verdict:
    """Predicted client outcomes ('200 leak', '400', 'error', '200 clean', or 'no engine' where
    the engine refuses to start) against what ran."""
    if not predicted or any(v in (None, "", "?") for v in predicted.values()):
        return _verdict("prediction", False, f"fill in a prediction for {', '.join(observed)} first.")
    wrong = {f: (predicted.get(f), o) for f, o in observed.items() if predicted.get(f) != o}
    if wrong:
        parts = "; ".join(f"{f}: you said {p!r}, the engine gave {o!r}" for f, (p, o) in wrong.items())
        return _verdict("prediction", False, parts)
    return _verdict("prediction", True, lesson)


def check_checksum(fn: Callable[[list[bytes], list[int]], list[int]]) -> Verdict:
    """`fn(pages, checksums)` -> indices of pages whose Adler-32 differs from the one sent, or that
    have none (prefill sent fewer checksums than decode reserved pages)."""
    import random

    rng = random.Random(3)
    for n_bad, n_sent in ((0, 6), (1, 6), (3, 6), (0, 1), (1, 4)):
        pages = [bytes(rng.randrange(256) for _ in range(64)) for _ in range(6)]
        sums = [zlib.adler32(p) for p in pages][:n_sent]
        changed = sorted(rng.sample(range(n_sent), n_bad))
        for i in changed:
            pages[i] = pages[i][:10] + bytes([pages[i][10] ^ 0xFF]) + pages[i][11:]
        bad = changed + list(range(n_sent, 6))
        got, err = _run("checksum", fn, pages, sums)
        if err:
            return err
        if sorted(got or []) != bad:
            unsent = f"; pages {n_sent}..5 came with no checksum" if n_sent < 6 else ""
            return _verdict(
                "checksum",
                False,
                f"6 pages, {counted(n_sent, 'checksum')} sent: pages {changed or 'none'} "
                f"were changed after their checksums were taken{unsent}; you flagged "
                f"{sorted(got or []) or 'none'}, where {bad or 'none'} must be. Compare "
                "zlib.adler32(page) with the checksum sent, and a page without one is as bad as a mismatch.",
            )
    return _verdict("checksum", True, "decode verifies every reserved page before it batches the request.")


def check_owner_check(fn: Callable[[list[int], dict[int, str | None], str], list[int]]) -> Verdict:
    """`fn(block_table, last_writer, reader)` -> pages of the block table not last written by reader."""
    cases = [
        ([5, 9, 2], {5: "bob-4", 9: "alice-2", 2: "alice-1"}, "bob-4", [9, 2]),
        ([1, 2], {1: "carol-7", 2: "carol-7"}, "carol-7", []),
        ([7], {}, "dan-1", [7]),  # never written: not the reader's either
        ([4, 6], {4: "bob-4", 6: "bob-2"}, "bob-4", [6]),  # bob's own earlier request: not this one's
    ]
    for table, writers, reader, want in cases:
        got, bad = _run("owner_check", fn, table, dict(writers), reader)
        if bad:
            return bad
        if list(got or []) != want:
            return _verdict(
                "owner_check",
                False,
                f"{reader} about to read pages {table} last written by "
                f"{ {p: writers.get(p) for p in table} }: the pages it did not write itself are {want}, "
                f"you said {got!r} (the tag is the request, not the tenant: a page bob's earlier "
                "request wrote is stale for his next one).",
            )
    return _verdict("owner_check", True, "a check at every memory read, as Cloudflare's remaining work says.")


# -- 12 the kernel ---------------------------------------------------------------------------
def check_program_pages(
    fn: Callable[[list[int], int, int], list[int]],
    rows: list[dict[str, Any]],
    block_table: list[int],
    seq_len: int,
    page_size: int,
) -> Verdict:
    """`fn(block_table, seq_len, page_size)` -> the pages a decode program reads, in order; on
    cases of its own, then against `rows`, what the kernel recorded reading for that request."""
    import random

    rng = random.Random(11)
    cases = [(rng.sample(range(64), 6), rng.randint(1, 6 * ps), ps) for ps in (1, 16, 128) for _ in range(5)]
    for table, length, ps in cases:
        got, bad = _run("program_pages", fn, table, length, ps)
        if bad:
            return bad
        want = table[: -(-length // ps)]
        if list(got or []) != want:
            got_n = len(got) if isinstance(got, list | tuple) else None
            if got_n == length // ps and length % ps and list(got) == want[:got_n]:
                why = "A last page only partly filled is read too: round the number of blocks up."
            elif got_n is not None and got_n > len(want) and list(got)[: len(want)] == want:
                why = "Blocks past the length are never read."
            else:
                why = "A program reads the table's first blocks, in its order, as many as the length fills."
            return _verdict(
                "program_pages",
                False,
                f"block table {table}, {length} tokens, pages of {ps}: the kernel reads blocks 0.."
                f"{len(want) - 1}, pages {want}; you said {got!r}. {why}",
            )
    # and what the real kernel did, recorded under the interpreter: the splits of one kv head
    # share the blocks out, so together they read each block once
    first = rows[0]["request"] if rows else None
    by_block = {r["block"]: r["page"] for r in rows if r["kv_head"] == 0 and r["request"] == first}
    recorded = [by_block[b] for b in sorted(by_block)]
    if not recorded:
        return _verdict("program_pages", False, "the recorded kernel run read no page: run the cells above")
    got, bad = _run("program_pages", fn, list(block_table), seq_len, page_size)
    if bad:
        return bad
    if list(got or []) != recorded:
        return _verdict(
            "program_pages",
            False,
            f"the kernel, recorded above, read pages {recorded} of the block table {list(block_table)} "
            f"for {seq_len} tokens in pages of {page_size}; you said {got!r}.",
        )
    return _verdict("program_pages", True, "the kernel reads exactly the pages its block table names.")


# -- 10 catch it -----------------------------------------------------------------------------
FORENSICS_ONLY = ("leaked", "foreign_pages")  # the ground truth: graded with, never shown to the test


def check_catcher(fn: Callable[[Any], bool], replies: dict[str, Any]) -> Verdict:
    """`fn(case)` -> True when the response passes; it must fail every leaking case, pass the rest."""
    for name, case in replies.items():
        seen = {k: v for k, v in case.items() if k not in FORENSICS_ONLY}  # what a client sees
        got, bad = _run("catcher", fn, seen)
        if bad:
            return bad
        want = not case["leaked"]
        if bool(got) != want:
            if case["leaked"] and not case.get("foreign_canaries"):
                why = (
                    "This answer shows none of another tenant's canaries, yet it was computed from "
                    "their pages: only its time to first token gives it away (too_fast)."
                )
            elif case["leaked"]:
                why = "Status and latency alone let the leak through: look at the content."
            elif case["status"] != 200:
                why = "A refusal is what the team expected for a prompt over the pool: it must pass."
            else:
                why = "This answer is clean: a test that fails it would fail every launch."
            return _verdict(
                "catcher",
                False,
                f"case {name!r} (HTTP {case['status']}, {'leaked' if case['leaked'] else 'clean'}): "
                f"your test said {'pass' if got else 'fail'}. {why}",
            )
    return _verdict(
        "catcher", True, f"fails every leak and passes every clean answer ({len(replies)} cases)."
    )


# -- 11 postmortem ---------------------------------------------------------------------------
def check_possibly_affected(fn: Callable[[list[dict[str, Any]]], list[str]]) -> Verdict:
    """`fn(requests)` -> ids of a customer's requests that could be among the 155."""
    log = [
        {"id": "r1", "date": "2026-08-20", "prompt_tokens": 900_000},  # before the window
        {"id": "r2", "date": "2026-08-27", "prompt_tokens": 700_000},
        {"id": "r3", "date": "2026-09-01", "prompt_tokens": 681_280},  # not longer than the pool
        {"id": "r4", "date": "2026-09-09", "prompt_tokens": 1_000_000},
        {"id": "r5", "date": "2026-09-10", "prompt_tokens": 1_000_000},  # after the window
        {"id": "r6", "date": "2026-09-03", "prompt_tokens": 12_000},
        {"id": "r7", "date": "2026-09-05", "prompt_tokens": 681_281},  # one token past the pool
    ]
    # what a learner gets wrong about each request, said when it is
    left_out = {
        "r2": "r2 (27 August) is on the window's first day, which counts",
        "r4": "r4 (9 September) is on the window's last day, which counts: the window is inclusive",
        "r7": "r7 has 681,281 tokens: one token longer than the pool is enough",
    }
    let_in = {
        "r1": "r1 (20 August) came before the window opened",
        "r3": "r3 has exactly 681,280 tokens: it fits the pool, and every affected prompt was longer",
        "r5": "r5 (10 September) came after the window closed",
        "r6": "r6 has 12,000 tokens, far below the pool",
    }
    got, bad = _run("possibly_affected", fn, log)
    if bad:
        return bad
    said = sorted(map(str, got)) if isinstance(got, list | tuple | set) else None
    if said is None:
        return _verdict(
            "possibly_affected", False, f"return a list of ids, like ['r1']; you returned {got!r}"
        )
    wrong = [why for rid, why in left_out.items() if rid not in said]
    wrong += [why for rid, why in let_in.items() if rid in said]
    wrong += [f"{rid!r} is no id of the log" for rid in said if rid not in left_out | let_in]
    if wrong:
        return _verdict(
            "possibly_affected",
            False,
            f"you said {said}; the window is 27 August to 9 September 2026 and every affected prompt "
            f"was longer than 681,280 tokens (the pool). " + "; ".join(wrong) + ".",
        )
    return _verdict("possibly_affected", True, "question 4 answered from your own request log.")


# -- 13 model check --------------------------------------------------------------------------
def check_counterexample_bounds(bounds: dict[str, Any]) -> Verdict:
    """`bounds` (requests, prefill_pages, decode_pages, context_pages) -> a scenario of the
    learner's own, with a prefill pool of 3 pages or more, where the bug-compatible protocol leaks
    and the fixed one (every fix but capacity-check) holds."""
    from minigrid_engine.errors import ConfigError
    from minigrid_engine.fixes import Fixes
    from minigrid_engine.protocol import INCIDENT, check_protocol, make_scenario, parse_requests

    ex = "counterexample_bounds"
    if not isinstance(bounds, dict) or not bounds.get("requests"):
        return _verdict(ex, False, "give a dict with requests ('alice:2,bob:3'), prefill_pages, ...")
    for key in ("prefill_pages", "decode_pages", "context_pages"):
        value = bounds.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return _verdict(ex, False, f"{key} is a number of pages, a whole number: you gave {value!r}.")
    try:
        sc = make_scenario(
            INCIDENT,
            requests=parse_requests(str(bounds["requests"])),
            prefill_pages=bounds.get("prefill_pages"),
            decode_pages=bounds.get("decode_pages"),
            context_pages=bounds.get("context_pages"),
            max_states=200_000,
        )
    except ConfigError as exc:
        return _verdict(ex, False, f"the model refuses these bounds: {exc}")
    if sc.prefill_pages < 3:
        return _verdict(
            ex, False, f"a prefill pool of {sc.prefill_pages} pages is the notebook's: use 3 or more."
        )
    bug = check_protocol(sc, Fixes.none())
    if bug.violation is None:
        long = [r.name for r in sc.requests if r.pages > sc.prefill_pages]
        if not long and sc.context_pages <= sc.prefill_pages:
            hint = (
                f"the context ({sc.context_pages} pages) is no longer than the {sc.prefill_pages}-page "
                "prefill pool, so every valid prompt fits it and prefill never makes the one-token stub: "
                "raise context_pages above prefill_pages (the incident's gap), then make one prompt "
                "longer than the pool."
            )
        elif not long:
            hint = (
                f"every prompt fits the {sc.prefill_pages}-page prefill pool, so prefill never makes the "
                f"one-token stub: make one prompt longer than the pool, but within the context "
                f"({sc.context_pages} pages)."
            )
        elif len({r.tenant for r in sc.requests}) < 2:
            hint = "every request is one tenant's: a stale page is only a leak when another tenant wrote it."
        elif max(r.pages for r in sc.requests) > sc.decode_pages:
            hint = f"the decode pool ({sc.decode_pages} pages) cannot preallocate {long[0]}'s full length."
        else:
            hint = (
                f"{long[0]} takes the stub path, yet no read finds another tenant's page. The pool gives "
                f"the last page freed first, and the stub's one-page transfer overwrites the first page "
                f"{long[0]} gets: another tenant's request of 2 pages or more has to finish before "
                f"{long[0]} is preallocated (where it stands in the list does not matter: requests "
                "overtake each other in the queues)."
            )
        return _verdict(ex, False, f"no stale read in {bug.states_explored} states: {hint}")
    fixed = check_protocol(sc, replace(Fixes.all(), capacity_check=False))
    if not fixed.safe:
        return _verdict(
            ex, False, f"even the fixed protocol fails here: {fixed.violation_kind} (tell the instructor)"
        )
    return _verdict(
        ex,
        True,
        f"your bounds leak in {len(bug.violation)} steps ({bug.states_explored} states); the fixed "
        f"protocol holds in all {fixed.states_explored} states.",
    )


def check_fix_prediction(predicted: dict[str, str], observed: dict[str, str]) -> Verdict:
    """Predicted 'safe' or 'leak' per fix against the model check's verdicts ('safe', 'leak', or
    'no verdict' for a search cut short at max_states, which can neither confirm nor refute)."""
    ex = "fix_prediction"
    if not predicted or set(predicted.values()) - {"safe", "leak"} or set(observed) - set(predicted):
        return _verdict(ex, False, f"say 'safe' or 'leak' for each of: {', '.join(observed)}.")
    wrong = [
        f"{f}: you said {predicted[f]!r}, the model says {o!r}"
        for f, o in observed.items()
        if o != "no verdict" and predicted[f] != o
    ]
    if wrong:
        return _verdict(
            ex, False, "; ".join(wrong) + ". Step through the late-transfer trace: when is the write?"
        )
    open_ = [f for f, o in observed.items() if o == "no verdict"]
    if open_:
        return _verdict(
            ex,
            False,
            f"the search was cut short for {', '.join(open_)}: no verdict to check against. "
            "Raise max_states and run it again.",
        )
    return _verdict(ex, True, "only a fix that acts at the late write or at the read stops a late transfer.")


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, (tuple, list)) else value
