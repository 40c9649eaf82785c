"""Reference answers to the lab exercises (instructors: see labs/INSTRUCTOR.md).

`widgets.checks.solution(name)` loads one; the notebooks do so when run with
`reveal_solutions=True`, which is how CI checks that every checker accepts its answer.
"""

import re
import zlib
from datetime import date


def shortfall(metrics):  # 01
    context = metrics["minigrid_context_length_tokens"]
    pools = [v for k, v in metrics.items() if k.startswith("minigrid_kv_pool_capacity_tokens")]
    return int(max(0, context - min(pools)))


def slot(position, block_table, page_size):  # 02
    return block_table[position // page_size], position % page_size


def pages_sent(trace, request):  # 03
    written = sum(
        len(e["pages"]) for e in trace["prefill"] if e["kind"] == "write" and e["request"] == request
    )
    reserved = sum(
        len(e["pages"]) for e in trace["decode"] if e["kind"] == "reserve" and e["request"] == request
    )
    return written, reserved


def audit(pools, context_length):  # 04
    return all(tokens >= context_length for tokens in pools.values())


def foreign_codes(answer, victim_prompts):  # 05
    theirs = {c for p in victim_prompts for c in re.findall(r"\b([A-Z0-9]{6,10});", p)}
    return {c for c in re.findall(r"\b[A-Z0-9]{6,10}\b", answer) if c in theirs}


def affected(pages_read_rows, tenant):  # 06
    return any(r["last_writer_tenant"] not in (None, tenant) for r in pages_read_rows)


def client_sees(fixes):  # 07-09: what bob's client sees on the incident's numbers, any set of fixes
    """The first fix on bob's request's path decides: startup, admission, the transfer's done
    message and the read (each an error), then memory (scrubbed pages: a clean 200)."""
    from minigrid_engine.fixes import parse_fixes

    on = set(parse_fixes(fixes).names())
    if "capacity-check" in on:  # the 665-token pool is shorter than the 1,024-token context
        return "no engine"
    if "reject-before-transfer" in on:
        return "400"
    if on & {"coverage-check", "kv-checksum", "owner-check"}:
        return "error"
    if "scrub-on-free" in on:
        return "200 clean"
    return "200 leak"  # none, or deferred-release alone: nothing failed for it to guard


OVERSIZED_PREDICTION = "200"  # 04: not the error the team assumed


def checksum(pages, checksums):  # 08
    return [i for i, p in enumerate(pages) if i >= len(checksums) or zlib.adler32(p) != checksums[i]]


def owner_check(block_table, last_writer, reader):  # 09
    return [p for p in block_table if last_writer.get(p) != reader]


def catcher(case):  # 10: a refusal (400) is not a leak; foreign content or an impossible TTFT is
    return not case["foreign_canaries"] and not case["too_fast"]


def possibly_affected(requests):  # 11
    start, end = date(2026, 8, 27), date(2026, 9, 9)
    return [
        r["id"]
        for r in requests
        if start <= date.fromisoformat(r["date"]) <= end and r["prompt_tokens"] > 681_280
    ]


def program_pages(block_table, seq_len, page_size):  # 12
    return block_table[: -(-seq_len // page_size)]


# 13: a prompt over a 3-page pool, after another tenant's request
counterexample_bounds = {
    "requests": "carol:3,dave:4",
    "prefill_pages": 3,
    "decode_pages": 4,
    "context_pages": 4,
}


late_transfer_prediction = {  # 13: only the fixes at the late write or at the read hold
    "capacity-check": "leak",
    "reject-before-transfer": "leak",
    "coverage-check": "leak",
    "kv-checksum": "leak",
    "scrub-on-free": "leak",
    "owner-check": "safe",
    "deferred-release": "safe",
}
