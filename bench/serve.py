"""The disaggregated engine end to end: cold start, throughput, the stub's TTFT, memory.

    python bench/serve.py                       # writes bench/results/serve-cpu.json
    python bench/serve.py --requests 8 --out /tmp/s.json   # smoke

- cold start: `Engine.start()` (three processes) until `/health` answers 200;
- a mixed workload: several tenants, prompts of 100-600 tokens, 8 clients at once;
- the incident's one visible symptom: TTFT of the stubbed oversized prompt (faulty engine, pool
  665) against a real prefill of the same length (corrected pool 2,048), as a ratio;
- peak RSS of router + prefill + decode together, sampled during the run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from minigrid_engine.config import corrected_preset, incident_preset
from minigrid_engine.handle import Engine
from minigrid_engine.records import record_prompt

TENANTS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol", "dave": "sk-dave"}


class RssSampler(threading.Thread):
    """Peak of the summed RSS of a process and its children."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            time.sleep(0.05)


def cold_start(cfg, runs: int) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        eng = Engine.start(cfg)
        times.append(time.perf_counter() - t0)
        eng.stop()
    return times


def workload(eng: Engine, n: int, clients: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        tenant = list(TENANTS)[i % len(TENANTS)]
        jobs.append(
            (tenant, record_prompt(tenant, rng.randint(100, 600), rng, rng.randint(3, 8)), rng.randint(8, 48))
        )
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda j: eng.complete(j[0], j[1], max_tokens=j[2]), jobs))
    wall = time.perf_counter() - t0
    assert all(r.ok for r in replies), [r.error for r in replies if not r.ok][:3]
    ttfts = sorted(r.ttft_s or 0 for r in replies)
    return {
        "requests": n,
        "clients": clients,
        "wall_s": round(wall, 3),
        "requests_per_s": round(n / wall, 2),
        "completion_tokens_per_s": round(sum(r.completion_tokens or 0 for r in replies) / wall, 1),
        "prompt_tokens_per_s": round(sum(r.prompt_tokens or 0 for r in replies) / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1),
    }


def stub_ttft(length: int, rounds: int, seed: int) -> dict[str, float]:
    """TTFT of an oversized prompt (stubbed, faulty engine) vs the same prompt really prefilled."""
    rng = random.Random(seed)
    prompt = record_prompt("bob", length, rng, 10)
    out: dict[str, list[float]] = {"stub": [], "real": []}
    faulty = Engine.start(incident_preset(fixes="none"))
    fixed = Engine.start(corrected_preset(fixes="none"))  # pool 2,048: a real prefill of `length`
    try:
        for eng in (faulty, fixed):  # warm both
            eng.complete("bob", prompt, max_tokens=2)
        for _ in range(rounds):  # alternate so machine noise hits both alike
            out["stub"].append(faulty.complete("bob", prompt, max_tokens=2).ttft_s or 0)
            out["real"].append(fixed.complete("bob", prompt, max_tokens=2).ttft_s or 0)
    finally:
        faulty.stop()
        fixed.stop()
    stub, real = statistics.median(out["stub"]), statistics.median(out["real"])
    return {
        "prompt_tokens": length,
        "stub_ttft_ms": round(1000 * stub, 2),
        "real_prefill_ttft_ms": round(1000 * real, 2),
        "real_over_stub": round(real / stub, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--cold-starts", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve-cpu.json")
    a = p.parse_args(argv)
    cfg = incident_preset(tenants=TENANTS)
    starts = cold_start(cfg, a.cold_starts)
    print(f"cold start to /health 200: median {statistics.median(starts):.2f} s over {len(starts)}")
    eng = Engine.start(cfg)
    assert eng.proc is not None
    sampler = RssSampler(eng.proc.pid)
    sampler.start()
    try:
        mixed = workload(eng, a.requests, a.clients, seed=0)
    finally:
        sampler.stop.set()
        sampler.join()
        eng.stop()
    print(f"mixed workload: {mixed}")
    symptom = stub_ttft(1000, a.rounds, seed=1)
    print(
        f"TTFT, 1000-token prompt: stub {symptom['stub_ttft_ms']} ms, real prefill "
        f"{symptom['real_prefill_ttft_ms']} ms: a real prefill takes {symptom['real_over_stub']}x longer"
    )
    peak = round(sampler.peak / 2**20, 1)
    print(f"peak RSS of router + prefill + decode: {peak} MiB")
    result = {
        "benchmark": "disaggregated engine end to end (CPU, 3 processes)",
        "cold_start_s": {
            "median": round(statistics.median(starts), 3),
            "runs": [round(t, 3) for t in starts],
        },
        "mixed_workload": mixed,
        "stub_ttft": symptom,
        "peak_rss_all_processes_mib": peak,
        "cpu_count": psutil.cpu_count(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
