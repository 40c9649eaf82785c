"""The cost of each fix against `none`, on the same mixed workload, measured side by side.

    python bench/fixes.py                        # writes bench/results/fixes-cpu.json
    python bench/fixes.py --requests 8 --rounds 1 --out /tmp/f.json   # smoke

Every configuration runs on the corrected pool (2,048 tokens) so that each fix can start and every
prompt fits: the workload is the ordinary traffic the fixes must not slow down (several tenants,
prompts of 100-600 tokens, 8 clients at once). Rounds alternate the configurations so that noise
on a shared machine hits them alike; the spread between one configuration's rounds is recorded
as the noise each cost is read against. Also: the cost of scrubbing freed pages per page size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minigrid_engine.config import corrected_preset
from minigrid_engine.fixes import FIXES
from minigrid_engine.handle import Engine
from minigrid_engine.model import ModelConfig
from minigrid_engine.pool import KVPool, PoolConfig

sys.path.insert(0, str(Path(__file__).parent))
from serve import TENANTS, workload


def scrub_cost(page_sizes: list[int], tokens: int = 4096, repeats: int = 20) -> list[dict[str, float]]:
    """Microseconds to zero one freed token's K/V, by page size (release of a `tokens` request)."""
    rows = []
    for page in page_sizes:
        pool = KVPool(PoolConfig(tokens, page), ModelConfig(), "bench", scrub_on_free=True)
        plain = KVPool(PoolConfig(tokens, page), ModelConfig(), "bench")
        times = {"scrub": [], "plain": []}
        for _ in range(repeats):
            for name, p in (("scrub", pool), ("plain", plain)):
                p.reserve("r", "t", tokens)
                t0 = time.perf_counter()
                p.release("r")
                times[name].append(time.perf_counter() - t0)
        s, n = min(times["scrub"]), min(times["plain"])
        rows.append(
            {
                "page_size": page,
                "release_us_per_token_scrub": round(1e6 * s / tokens, 4),
                "release_us_per_token_plain": round(1e6 * n / tokens, 4),
                "scrub_over_plain": round(s / n, 1),
            }
        )
    return rows


def spread(values: list[float]) -> float:
    """How far a configuration's rounds lie apart, relative to their median."""
    return (max(values) - min(values)) / statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fixes-cpu.json")
    a = p.parse_args(argv)
    configs = ["none", *[f for f in FIXES], "all"]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for rnd in range(a.rounds):
        for c in configs:
            with Engine.start(corrected_preset(tenants=TENANTS), fixes=c) as eng:
                workload(eng, 4, 4, seed=99)  # warm
                runs[c].append(workload(eng, a.requests, a.clients, seed=rnd))
            print(
                f"round {rnd + 1}/{a.rounds} {c}: {runs[c][-1]['completion_tokens_per_s']} tok/s", flush=True
            )
    spreads: dict[str, list[float]] = {"throughput": [], "ttft_p50": []}
    base_tps = statistics.median(r["completion_tokens_per_s"] for r in runs["none"])
    base_ttft = statistics.median(r["ttft_p50_ms"] for r in runs["none"])
    table = []
    print(f"\n{'fix':24} {'tok/s':>8} {'throughput':>11} {'TTFT p50':>9} {'TTFT ratio':>11}")
    for c in configs:
        tps_rounds = [r["completion_tokens_per_s"] for r in runs[c]]
        ttft_rounds = [r["ttft_p50_ms"] for r in runs[c]]
        tps, ttft = statistics.median(tps_rounds), statistics.median(ttft_rounds)
        row = {
            "fixes": c,
            "completion_tokens_per_s": tps,
            "throughput_vs_none": round(tps / base_tps, 3),
            "ttft_p50_ms": ttft,
            "ttft_vs_none": round(ttft / base_ttft, 3),
            "completion_tokens_per_s_rounds": tps_rounds,
            "ttft_p50_ms_rounds": ttft_rounds,
        }
        if a.rounds > 1:
            spreads["throughput"].append(spread(tps_rounds))
            spreads["ttft_p50"].append(spread(ttft_rounds))
        table.append(row)
        print(
            f"{c:24} {tps:8.1f} {row['throughput_vs_none']:10.3f}x {ttft:8.1f}ms {row['ttft_vs_none']:10.3f}x"
        )
    # The noise: how far one configuration's rounds lie apart (range / median), the median over
    # configurations. A fix's cost is only readable against it; None with a single round.
    noise = {k: round(statistics.median(v), 3) if v else None for k, v in spreads.items()}
    if a.rounds > 1:
        print(
            f"noise (spread of one configuration's {a.rounds} rounds, median over configurations): "
            f"throughput {noise['throughput']:.1%}, TTFT p50 {noise['ttft_p50']:.1%}"
        )
    scrub = scrub_cost([16, 32, 64, 128, 256, 512])
    print("\nscrub-on-free, release of a 4,096-token request:")
    for r in scrub:
        print(
            f"  page {r['page_size']:>4}: {r['release_us_per_token_scrub']:.4f} us/token "
            f"({r['scrub_over_plain']}x a release without scrubbing)"
        )
    result = {
        "benchmark": "cost of each fix vs none (corrected pool 2,048, mixed workload, CPU)",
        "rounds": a.rounds,
        "requests": a.requests,
        "clients": a.clients,
        "table": table,
        "noise": noise,
        "scrub_by_page_size": scrub,
        "torch_threads": torch.get_num_threads(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
