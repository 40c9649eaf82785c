"""30 simulated students against one workshop engine on this CPU machine.

    python bench/workshop.py                  # 30 students, 60 s; writes bench/results/workshop-cpu.json
    python bench/workshop.py --students 10 --seconds 20

Starts `minigrid serve --workshop N` (the room's defaults: incident numbers, fixes none), then
each student is a thread with its own key and its own HTTP client: think (exponential, mean
--think seconds), send a prompt, repeat. Prompt lengths mix what a class sends: short questions,
records that fill half the prefill pool, and a few oversized prompts (the leak lab). Reports
latency and TTFT percentiles, errors and requests/s, measured, over the whole run.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from minigrid_engine.workshop import load_keys, oversized_prompt, secret_prompt

MIX = (("short", 0.5, (32, 160), 24), ("records", 0.4, (300, 600), 24), ("oversized", 0.1, (976, 976), 48))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] * 1000, 1)


def student(name: str, key: str, url: str, until: float, think_s: float, seed: int, out: list[dict]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as c:
        time.sleep(rng.uniform(0, think_s))  # a class does not press enter at the same instant
        while time.time() < until:
            kind, _, (lo, hi), max_tokens = rng.choices(MIX, weights=[m[1] for m in MIX])[0]
            n = rng.randint(lo, hi)
            make = oversized_prompt if kind == "oversized" else secret_prompt
            text = make(name, n, rng.randint(0, 10**6))
            t0 = time.perf_counter()
            try:
                r = c.post("/v1/completions", json={"prompt": text, "max_tokens": max_tokens})
                status, body = r.status_code, r.json()
            except httpx.HTTPError as exc:
                status, body = 0, {"error": str(exc)}
            latency = time.perf_counter() - t0
            out.append(
                {
                    "student": name,
                    "kind": kind,
                    "prompt_tokens": n,
                    "status": status,
                    "latency_s": latency,
                    "ttft_s": body.get("minigrid", {}).get("ttft_s") if status == 200 else None,
                    "end": time.time(),
                }
            )
            time.sleep(rng.expovariate(1 / think_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--students", type=int, default=30)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--think", type=float, default=3.0, help="mean think time between requests (s)")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "workshop-cpu.json")
    a = p.parse_args(argv)
    d = Path(tempfile.mkdtemp(prefix="minigrid-workshop-"))
    keys, ready = d / "keys.csv", d / "ready"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "minigrid_engine.cli", "serve", "--workshop", str(a.students)),
            *("--keys-file", str(keys), "--port", "0", "--ready-file", str(ready)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(d / "serve.log").open("wb"),
    )
    try:
        while not (ready.exists() and ready.read_text().strip()):
            if proc.poll() is not None:
                print((d / "serve.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        url = ready.read_text().strip()
        room = load_keys(keys.with_suffix(".json"))
        out: list[dict] = []
        t0 = time.time()
        until = t0 + a.seconds
        threads = [
            threading.Thread(target=student, args=(n, k, url, until, a.think, i, out), daemon=True)
            for i, (n, k) in enumerate(room.students.items())
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(r["end"] for r in out) - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    ok = [r for r in out if r["status"] == 200]
    errors = [r for r in out if r["status"] not in (200,)]
    rows = {}
    for kind in ["all", *(m[0] for m in MIX)]:
        sel = [r for r in ok if kind == "all" or r["kind"] == kind]
        lat = [r["latency_s"] for r in sel]
        ttft = [r["ttft_s"] for r in sel if r["ttft_s"] is not None]
        rows[kind] = {
            "requests": len(sel),
            "latency_ms": {f"p{q}": pct(lat, q) for q in (50, 95, 99)},
            "ttft_ms": {f"p{q}": pct(ttft, q) for q in (50, 95, 99)},
        }
    report = {
        "students": a.students,
        "seconds": round(wall, 1),
        "think_s_mean": a.think,
        "requests": len(out),
        "ok": len(ok),
        "errors": len(errors),
        "error_statuses": dict(
            sorted({s: sum(r["status"] == s for r in errors) for s in {r["status"] for r in errors}}.items())
        ),
        "requests_per_s": round(len(out) / wall, 2),
        "by_kind": rows,
        "machine": "the project's 2-core CPU machine, shared",
        "engine": "minigrid serve --workshop N (incident preset, fixes none, decode max batch 32)",
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{a.students} students, {report['seconds']} s, think {a.think} s: {report['requests']} requests, "
        f"{report['requests_per_s']} req/s, {report['errors']} errors {report['error_statuses']}"
    )
    print(
        f"{'prompts':<10} {'n':>5} {'lat p50':>8} {'p95':>8} {'p99':>8} {'ttft p50':>9} {'p95':>8} {'p99':>8}"
    )
    for kind, r in rows.items():
        L, T = r["latency_ms"], r["ttft_ms"]
        print(
            f"{kind:<10} {r['requests']:>5} {L['p50']!s:>8} {L['p95']!s:>8} {L['p99']!s:>8} "
            f"{T['p50']!s:>9} {T['p95']!s:>8} {T['p99']!s:>8}"
        )
    print(f"(ms; written to {a.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
