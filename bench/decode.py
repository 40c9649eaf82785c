"""Decode through the paged KV cache against a contiguous-KV baseline, side by side in one run.

    python bench/decode.py                     # batch 1, 8, 32; writes bench/results/decode-cpu.json
    python bench/decode.py --batches 1 --steps 8 --prompt-len 64 --out /tmp/d.json   # smoke
    python bench/decode.py --attention triton   # the paged path through the Triton kernels
    python bench/decode.py --attention triton --against torch --batches 1 8 --steps 8 --prompt-len 256 \
        --out bench/results/decode-triton-cpu.json   # Triton's interpreter against the torch path

Both paths run the same model on the same prompts (ragged lengths) and greedy tokens. The paged
path is the engine's: `ModelRunner.decode` gathering K/V through block tables, writing trace
events. The baseline keeps each request's K/V in one contiguous tensor and calls torch SDPA over
it (with ``--against torch``: the paged path again, through torch instead of the kernels). The two
decode the same batch one step each in turn, so that noise on a shared machine hits both alike;
the ratio (the median over rounds of paged time / baseline time) is what to read.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from minigrid_engine.model import Transformer, load_model
from minigrid_engine.pool import KVPool, PoolConfig
from minigrid_engine.records import record_prompt
from minigrid_engine.runner import DecodeItem, ModelRunner


class ContiguousKV:
    """Baseline backend: per-request K/V in [B, max_len, KH, D] tensors, SDPA with a length mask."""

    def __init__(self, model: Transformer, batch: int, max_len: int) -> None:
        c = model.cfg
        shape = (c.n_layers, batch, max_len, c.n_kv_heads, c.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.positions = torch.zeros(batch, dtype=torch.long)
        self.max_len = max_len

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = q.shape[:2]
        rows = torch.arange(b)
        if t == 1:  # decode: write one slot per request, attend over its prefix
            self.k[layer, rows, self.positions] = k[:, 0]
            self.v[layer, rows, self.positions] = v[:, 0]
            length = int(self.positions.max()) + 1
            valid = torch.arange(length)[None, :] <= self.positions[:, None]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                self.k[layer, :, :length].transpose(1, 2),
                self.v[layer, :, :length].transpose(1, 2),
                attn_mask=valid[:, None, None, :],
                enable_gqa=True,
            )
            return out.transpose(1, 2)
        raise ValueError("the baseline is prefilled with prefill_one")

    def prefill_one(self, model: Transformer, row: int, ids: list[int]) -> int:
        """Prefill request `row` contiguously; returns its first token."""
        store = self

        class _One:
            def __call__(self, layer, q, k, v):  # type: ignore[no-untyped-def]
                store.k[layer, row, : k.shape[1]] = k[0]
                store.v[layer, row, : v.shape[1]] = v[0]
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
                ).transpose(1, 2)

        with torch.inference_mode():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], _One())
        self.positions[row] = len(ids)
        return int(logits[0, -1].argmax())


class PagedDecode:
    """The engine's path: a pool, block tables, `ModelRunner.decode` (trace events included)."""

    def __init__(
        self, model: Transformer, prompts: list[list[int]], steps: int, page: int, attention: str = "torch"
    ) -> None:
        total = sum(len(p) + steps for p in prompts)
        device = next(model.parameters()).device
        pool = KVPool(PoolConfig(total + page * len(prompts), page), model.cfg, "bench", device=device)
        self.runner = ModelRunner(model, pool, attention=attention)
        self.prompts, self.tables, self.outs = prompts, [], []
        for i, ids in enumerate(prompts):
            res = pool.reserve(f"r{i}", "bench", len(ids) + steps)
            self.tables.append(res.pages)
            self.outs.append([int(self.runner.prefill(f"r{i}", "bench", ids, res.pages).argmax())])

    def step(self) -> None:
        s = len(self.outs[0]) - 1
        items = [
            DecodeItem(f"r{i}", "bench", self.outs[i][-1], len(ids) + s, self.tables[i])
            for i, ids in enumerate(self.prompts)
        ]
        nxt = self.runner.decode(items).argmax(-1).tolist()  # .tolist() waits for the GPU too
        for o, t in zip(self.outs, nxt):
            o.append(t)


class ContiguousDecode:
    """The baseline: each request's K/V in one contiguous tensor, torch SDPA over it."""

    def __init__(self, model: Transformer, prompts: list[list[int]], steps: int) -> None:
        self.model = model
        self.kv = ContiguousKV(model, len(prompts), max(len(p) for p in prompts) + steps)
        self.outs = [[self.kv.prefill_one(model, i, ids)] for i, ids in enumerate(prompts)]

    @torch.inference_mode()
    def step(self) -> None:
        tokens = torch.tensor([[o[-1]] for o in self.outs])
        logits = self.model(tokens, self.kv.positions[:, None].clone(), self.kv)
        self.kv.positions += 1
        for o, t in zip(self.outs, logits[:, 0].argmax(-1).tolist()):
            o.append(t)


def run_paged(
    model: Transformer, prompts: list[list[int]], steps: int, page: int, attention: str = "torch"
) -> tuple[float, list[list[int]]]:
    """Prefill then decode `steps` tokens for every prompt in one batch; (decode seconds, tokens)."""
    run = PagedDecode(model, prompts, steps, page, attention)
    t0 = time.perf_counter()
    for _ in range(steps):
        run.step()
    return time.perf_counter() - t0, run.outs


def run_side_by_side(
    model: Transformer,
    prompts: list[list[int]],
    steps: int,
    page: int,
    attention: str = "torch",
    against: str = "contiguous",
) -> tuple[float, float, bool, list[float]]:
    """Both paths decode the same batch, one step of each in turn (the order swapping every step),
    so that a burst of load on a shared machine lands on both alike. The baseline (`against`):
    contiguous K/V, or the paged path through torch.
    Returns (paged seconds, baseline seconds, identical tokens, each step's paged / baseline time)."""
    paged = PagedDecode(model, prompts, steps, page, attention)
    base: PagedDecode | ContiguousDecode = (
        ContiguousDecode(model, prompts, steps)
        if against == "contiguous"
        else PagedDecode(model, prompts, steps, page, "torch")
    )
    spent = {"paged": 0.0, "base": 0.0}
    ratios = []
    for s in range(steps):
        took = {}
        order: list[tuple[str, PagedDecode | ContiguousDecode]] = [("paged", paged), ("base", base)]
        for name, run in order if s % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            run.step()
            took[name] = time.perf_counter() - t0
            spent[name] += took[name]
        ratios.append(took["paged"] / took["base"])
    return spent["paged"], spent["base"], paged.outs == base.outs, ratios


def peak_rss_mib() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512, help="mean prompt length (ragged +-25%%)")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention", choices=["torch", "triton"], default="torch", help="paged path kernels")
    p.add_argument(
        "--against",
        choices=["contiguous", "torch"],
        default="contiguous",
        help="the baseline: contiguous K/V and SDPA, or the paged path through torch (for triton)",
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode-cpu.json")
    a = p.parse_args(argv)
    if a.against == "torch" and a.attention == "torch":
        p.error("--against torch compares --attention triton with the torch path: add --attention triton")
    base = "contiguous" if a.against == "contiguous" else "torch_paged"
    torch.manual_seed(0)
    model = load_model()
    rng = random.Random(0)
    rows = []
    head = "contig" if a.against == "contiguous" else "torch"
    print(
        f"{'batch':>5} {a.attention + ' tok/s':>12} {head + ' tok/s':>13} {'time ratio':>11} "
        f"{'by step':>8}  same tokens"
    )
    for b in a.batches:
        lens = [max(8, int(a.prompt_len * rng.uniform(0.75, 1.25))) for _ in range(b)]
        prompts = [list(record_prompt(f"t{i}", n, rng, 6).encode()) for i, n in enumerate(lens)]
        paged_t, base_t, step_ratios = [], [], []
        same = True
        for _ in range(a.rounds):
            tp, tc, same_tokens, ratios = run_side_by_side(
                model, prompts, a.steps, a.page_size, a.attention, a.against
            )
            paged_t.append(tp)
            base_t.append(tc)
            same &= same_tokens
            step_ratios += ratios
        tp, tc = min(paged_t), min(base_t)
        ratio = statistics.median(p / c for p, c in zip(paged_t, base_t))
        row = {
            "batch": b,
            "decode_steps": a.steps,
            "prompt_tokens": lens,
            "paged_tokens_per_s": round(b * a.steps / tp, 1),
            f"{base}_tokens_per_s": round(b * a.steps / tc, 1),
            f"paged_over_{base}_time": round(ratio, 3),
            # the same, step by step: a stall of the machine spoils one step, not a whole round
            f"paged_over_{base}_step_median": round(statistics.median(step_ratios), 3),
            "identical_tokens": same,
        }
        rows.append(row)
        print(
            f"{b:>5} {row['paged_tokens_per_s']:>12} {row[f'{base}_tokens_per_s']:>13} "
            f"{row[f'paged_over_{base}_time']:>10}x {row[f'paged_over_{base}_step_median']:>7}x  {same}"
        )
    result = {
        "benchmark": f"decode: paged KV cache ({a.attention}) vs "
        + ("contiguous KV (torch SDPA)" if a.against == "contiguous" else "the paged path through torch")
        + ", same model and batch",
        "against": a.against,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch_threads": torch.get_num_threads(),
        "page_size": a.page_size,
        "attention": a.attention,
        "rounds": a.rounds,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "rows": rows,
    }
    print(f"peak RSS {result['peak_rss_mib']} MiB")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
