"""How readable the leak is: what a stubbed request's answer copies from the pages it was handed.

    python bench/leak_text.py                          # the shipped weights; bench/results/leak-text.json
    python bench/leak_text.py --weights runs/a.pt runs/b.pt   # several weights, the same trials each
    python bench/leak_text.py --trials 2 --out /tmp/l.json    # smoke

For each shape of secret (`records.shaped_prompt`: the records the model was trained on, and
letters, code and chat transcripts it never saw), each trial runs the incident on the in-process
cluster (the worker processes' own schedulers, `--fixes none`, the scaled numbers): alice sends two
prompts of that shape, then bob one longer than the prefill pool, of a random shape. bob's answer
is read from alice's stale pages. Two counts per shape:

- readable: the answer holds 12 or more characters in a row of alice's text that bob's own prompt
  does not hold (a template both tenants' letters share is not counted), text a learner can read
  as hers (the canary harness calls 24 a leak on its own);
- secret: the answer holds 6 or more characters of one of alice's secret values (a code, a
  password, an API key), the probe's rule for a canary cut short.

Every weights file gets the same prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from minigrid_engine.canary import longest_shared_run
from minigrid_engine.config import incident_preset
from minigrid_engine.inprocess import InProcessCluster
from minigrid_engine.model import default_weights_path, load_model
from minigrid_engine.records import SHAPES, shaped_prompt

ALL_SHAPES = ("records", *SHAPES)
READABLE = 12  # characters in a row of the victim's text
SECRET_PIECE = 6  # characters of one of her secret values


def leak_runs(weights: Path, shape: str, trials: int, max_tokens: int, seed: int) -> list[dict[str, object]]:
    """One row per trial: bob's answer, its longest run of alice's text that his prompt does not
    hold, and the pieces of her secrets it holds."""
    model = load_model(weights)
    cfg = incident_preset()
    rows = []
    for t in range(trials):
        rng = random.Random(seed * 100_003 + t)
        cluster = InProcessCluster(cfg, model)
        victim_len = int(cfg.prefill_pool_tokens * 0.9) - max_tokens
        secrets: list[str] = []
        prompts = [shaped_prompt("alice", shape, victim_len, rng, secrets) for _ in range(2)]
        for p in prompts:  # at once, as in the lab: two requests' pages side by side
            cluster.submit("alice", p, max_tokens=max_tokens)
        cluster.run()
        bob_len = cfg.context_length - max_tokens - rng.randint(0, 200)  # past the pool, within the context
        bob = shaped_prompt("bob", rng.choice(ALL_SHAPES), bob_len, rng)
        text = cluster.text(cluster.complete("bob", bob, max_tokens=max_tokens))
        pieces = {v[i : i + SECRET_PIECE] for v in secrets for i in range(len(v) - SECRET_PIECE + 1)}
        held = sorted(x for x in pieces if x in text and x not in bob)
        run = longest_shared_run(text, "\x00".join(prompts), exclude=bob)
        rows.append({"answer": text, "run": run, "secret_pieces": held})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, nargs="+", default=[default_weights_path()])
    p.add_argument("--shapes", nargs="+", choices=ALL_SHAPES, default=list(ALL_SHAPES))
    p.add_argument("--trials", type=int, default=20, help="incidents per shape and weights (20)")
    p.add_argument("--max-tokens", type=int, default=40, help="bob's answer length (40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/leak-text.json"))
    a = p.parse_args(argv)
    if a.trials < 1:
        p.error(f"--trials {a.trials} must be at least 1")
    missing = [str(w) for w in a.weights if not w.is_file()]
    if missing:
        p.error(f"no weights file at {', '.join(missing)}")
    t0 = time.time()
    results: dict[str, dict[str, object]] = {}
    for weights in a.weights:
        per_shape: dict[str, object] = {}
        for shape in a.shapes:
            rows = leak_runs(weights, shape, a.trials, a.max_tokens, a.seed)
            runs = [int(r["run"]) for r in rows]  # type: ignore[call-overload]
            readable = sum(r >= READABLE for r in runs)
            secret = sum(bool(r["secret_pieces"]) for r in rows)
            per_shape[shape] = {
                "readable": readable,
                "secret": secret,
                "trials": len(runs),
                "median_run": statistics.median(runs),
                "runs": runs,
                "example": max(rows, key=lambda r: int(r["run"]))["answer"],  # type: ignore[call-overload]
            }
            print(
                f"{weights.name:>18}  {shape:>8}: {readable:2d}/{len(runs)} answers hold >= {READABLE} "
                f"characters of alice's text in a row (median run {statistics.median(runs)}), "
                f"{secret:2d}/{len(runs)} a piece of one of her secrets",
                flush=True,
            )
        results[str(weights)] = per_shape
    report = {
        "readable_run": READABLE,
        "secret_piece": SECRET_PIECE,
        "trials": a.trials,
        "max_tokens": a.max_tokens,
        "seed": a.seed,
        "seconds": round(time.time() - t0, 1),
        "weights": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
