"""The Triton paged-attention kernels on the device: correct first, then how fast, against peers.

    python bench/kernels.py --out bench/results/gpu          # on a CUDA machine (bench/gpu.sh)
    python bench/kernels.py --cpu-smoke --out /tmp/k         # tiny shapes under the interpreter

Writes ``kernels-<device>.json`` into the folder given. In order:

1. correctness on the device: each kernel against the torch reference (`attention.py`) in float32
   and half precision, the owner-check flags against `attention.foreign_pages`, and the model's
   greedy tokens with ``--attention triton`` against ``--attention torch``;
2. decode attention for batch 1, 8, 64 x context 1k, 8k, 32k at a realistic head configuration
   (32 query heads, 8 kv heads, head_dim 128, float16, pages of 64 tokens: a Llama-3-8B-like
   layer), with time and achieved bandwidth = bytes of K/V read / time, against the chip's peak
   (the data sheet's HBM peak for the chip found, H200: 4.8 TB/s, H100 SXM: 3.35 TB/s; and what a
   plain device-to-device copy achieves on it, measured first). Each row holds the Triton kernel
   (best of a small tile sweep), the owner-check variant and its overhead, torch SDPA over the
   same K/V stored contiguously, and FlashInfer's paged batch decode when it can be imported;
3. the engine end to end: decode tokens/s of the shipped model through `ModelRunner` with
   attention torch and triton (bench/decode.py's paged path).

Without CUDA (or with --cpu-smoke) every section runs at toy sizes, timed with perf_counter: it
checks that the script and its JSON still work, not the numbers.

The JSON ends with `goals`: the issue's two bars at batch 64 x context 8k (at least 80% of the
HBM peak; within 1.2x of FlashInfer's time), each met, missed, or not measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/decode.py, run as a script
if "--cpu-smoke" in sys.argv:  # CPU tensors even on a GPU machine: the interpreter, before triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.nn import functional as F

from minigrid_engine import attention, kernels  # kernels first sets TRITON_INTERPRET when CPU-only
from minigrid_engine.model import load_model
from minigrid_engine.records import record_prompt

# Nominal HBM bandwidth from the vendors' data sheets, by a pattern of torch.cuda.get_device_name():
# the first match wins. "\bH200" leaves GH200 out (its HBM3 and HBM3e versions differ); a chip not
# listed is compared with the copy bandwidth measured on it, or with --peak-gbps.
HBM_PEAKS_GBPS: tuple[tuple[str, float], ...] = (
    (r"\bH200\b", 4800.0),
    (r"\bH100 NVL\b", 3900.0),
    (r"\bH100 PCIe\b", 2000.0),
    (r"\bH100\b", 3350.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"\bA100-SXM4-80GB\b", 2039.0),
    (r"\bA100 80GB PCIe\b", 1935.0),
    (r"\bA100\b", 1555.0),  # the 40 GB parts
)
GOAL_SHAPE = (64, 8192)  # batch x context where the issue sets its bars
GOAL_FRACTION_OF_PEAK = 0.8
GOAL_VS_FLASHINFER = 1.2


@dataclass(frozen=True)
class Shapes:
    """One benchmark's sizes."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    tiles: tuple[kernels.Tiles, ...]  # the decode kernel's sweep
    engine_batches: tuple[int, ...]
    engine_prompt_len: int
    engine_steps: int


GPU = Shapes(
    batches=(1, 8, 64),
    contexts=(1024, 8192, 32768),
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    page_size=64,
    dtype="float16",
    tiles=tuple(kernels.Tiles(n, 64, w) for n in (32, 64, 128) for w in (4, 8)),
    engine_batches=(1, 8, 32),
    engine_prompt_len=512,
    engine_steps=64,
)
CPU_SMOKE = Shapes(
    batches=(1, 2),
    contexts=(100,),
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    page_size=16,
    dtype="float32",
    tiles=(kernels.Tiles(256, 128), kernels.Tiles(32, 32)),
    engine_batches=(2,),
    engine_prompt_len=48,
    engine_steps=3,
)


# -- timing --------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: the median of triton.testing.do_bench on a GPU (CUDA events, L2
    flushed before each call, so K/V comes from HBM), the best of two perf_counter calls on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def nominal_peak_gbps(device_name: str) -> float | None:
    """The data sheet's HBM bandwidth of a chip, by its name; None for one not in the table."""
    for pattern, gbps in HBM_PEAKS_GBPS:
        if re.search(pattern, device_name):
            return gbps
    return None


def copy_gbps(device: torch.device) -> float:
    """What the memory achieves on the simplest stream: a device-to-device copy of 1 GiB (64 MiB
    on CPU), bytes read + bytes written / time."""
    n = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return round(2 * n / (ms * 1e-3) / 1e9, 1)


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's bars at GOAL_SHAPE, from the rows measured: met (True / False) or None."""
    row = next((r for r in rows if (r["batch"], r["context"]) == GOAL_SHAPE and "triton_ms" in r), None)
    fraction = row.get("triton_fraction_of_peak") if row else None
    ratio = None
    if row and row.get("flashinfer_ms"):
        ratio = round(row["triton_ms"] / row["flashinfer_ms"], 3)
    return {
        "shape": {"batch": GOAL_SHAPE[0], "context": GOAL_SHAPE[1]},
        "fraction_of_peak": fraction,
        "fraction_of_peak_goal": GOAL_FRACTION_OF_PEAK,
        "fraction_of_peak_met": None if fraction is None else fraction >= GOAL_FRACTION_OF_PEAK,
        "time_vs_flashinfer": ratio,
        "time_vs_flashinfer_goal": GOAL_VS_FLASHINFER,
        "time_vs_flashinfer_met": None if ratio is None else ratio <= GOAL_VS_FLASHINFER,
    }


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


# -- 1. correctness ------------------------------------------------------------------------------
def _paged_case(
    lens: list[int], page: int, kv_heads: int, group: int, d: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(sum(lens) + page)
    n_blocks = [-(-n // page) for n in lens]
    n_pages = sum(n_blocks) + 2
    perm = torch.randperm(n_pages, generator=gen).tolist()
    tables, at = [], 0
    for nb in n_blocks:
        tables.append(perm[at : at + nb])
        at += nb
    width = max(n_blocks)
    table = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables], device=device)
    k = torch.randn(n_pages, page, kv_heads, d, generator=gen).to(device, dtype)
    v = torch.randn(n_pages, page, kv_heads, d, generator=gen).to(device, dtype)
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen).to(device, dtype)
    return {"q": q, "k": k, "v": v, "table": table, "lens": torch.tensor(lens, device=device)}


def correctness(device: torch.device, smoke: bool) -> dict[str, Any]:
    """Max abs error of each kernel against the torch reference (in float32), and the verdicts."""
    checks: list[dict[str, Any]] = []
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
    cases = [([5, 70, 131], 16, 2, 2, 32), ([1, 200], 100, 1, 4, 64)]
    if not smoke:
        cases += [([3000, 17, 1024], 64, 8, 4, 128), ([4097, 1], 128, 8, 4, 128), ([900], 1, 2, 2, 32)]
    for lens, page, kvh, group, d in cases:
        for dtype in dtypes:
            c = _paged_case(lens, page, kvh, group, d, dtype, device)
            f32 = {name: c[name].float() for name in ("q", "k", "v")}
            ref = attention.paged_decode_attention(f32["q"], f32["k"], f32["v"], c["table"], c["lens"])
            row: dict[str, Any] = {"lens": lens, "page_size": page, "dtype": str(dtype).split(".")[1]}
            for splits in (1, 4):
                out = kernels.paged_decode_attention(
                    c["q"], c["k"], c["v"], c["table"], c["lens"], num_splits=splits
                )
                row[f"decode_splits{splits}_max_err"] = float((out.float() - ref).abs().max())
            tags = torch.randint(0, 3, tuple(c["k"].shape[:2]), device=device)  # a writer per slot
            reader = torch.randint(0, 3, (len(lens),), device=device)
            _, foreign = kernels.paged_decode_attention_checked(
                c["q"], c["k"], c["v"], c["table"], c["lens"], tags, reader
            )
            expected = attention.foreign_pages(tags, reader, c["table"], c["lens"], page)
            row["owner_check_flags_equal"] = bool(torch.equal(foreign, expected))
            n = lens[-1]
            start = n // 3
            q = c["q"][-1:].expand(n - start, -1, -1).contiguous()
            pref = kernels.paged_prefill_attention(q, c["k"], c["v"], c["table"][-1], start)
            pref_ref = attention.paged_prefill_attention(q.float(), f32["k"], f32["v"], c["table"][-1], start)
            row["prefill_max_err"] = float((pref.float() - pref_ref).abs().max())
            errs = [value for key, value in row.items() if key.endswith("_max_err")]
            row["ok"] = row["owner_check_flags_equal"] and max(errs) <= tol[dtype]
            checks.append(row)
    greedy = greedy_agreement(device, smoke)
    return {
        "checks": checks,
        "model_greedy": greedy,
        "ok": all(r["ok"] for r in checks) and greedy["identical"],
    }


def greedy_agreement(device: torch.device, smoke: bool) -> dict[str, Any]:
    """The shipped model's greedy tokens through both backends (float32 pool, as the engine runs)."""
    from decode import run_paged  # bench/decode.py

    model = load_model(device=device)
    rng = random.Random(0)
    n_prompts, length, steps = (2, 40, 4) if smoke else (8, 300, 32)
    prompts = [list(record_prompt(f"t{i}", length + 7 * i, rng, 6).encode()) for i in range(n_prompts)]
    _, torch_out = run_paged(model, prompts, steps, 16, "torch")
    _, triton_out = run_paged(model, prompts, steps, 16, "triton")
    same = sum(a == b for a, b in zip(torch_out, triton_out))
    return {"prompts": n_prompts, "steps": steps, "identical_prompts": same, "identical": same == n_prompts}


# -- 2. decode attention: time and bandwidth ------------------------------------------------------
def kv_bytes(batch: int, context: int, s: Shapes, elem: int) -> int:
    """Bytes the decode step must read: every request's K and V, once."""
    return 2 * batch * context * s.n_kv_heads * s.head_dim * elem


def decode_inputs(
    batch: int, context: int, s: Shapes, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k_cache, v_cache, block_tables, seq_lens: `batch` requests of `context` tokens each."""
    dtype = getattr(torch, s.dtype)
    page = s.page_size
    blocks = -(-context // page)
    n_pages = batch * blocks
    gen = torch.Generator(device=device).manual_seed(batch * 7 + context)
    k = torch.randn(n_pages, page, s.n_kv_heads, s.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(n_pages, page, s.n_kv_heads, s.head_dim, device=device, dtype=dtype, generator=gen)
    q = torch.randn(batch, s.n_heads, s.head_dim, device=device, dtype=dtype, generator=gen)
    # a shuffled pool: consecutive blocks of a request are not neighbours in memory
    table = torch.randperm(n_pages, device=device, generator=gen).view(batch, blocks)
    lens = torch.full((batch,), context, device=device, dtype=torch.long)
    return q, k, v, table, lens


def _gbps(batch: int, context: int, s: Shapes) -> Callable[[float], float]:
    nbytes = kv_bytes(batch, context, s, torch.tensor([], dtype=getattr(torch, s.dtype)).element_size())
    return lambda ms: round(nbytes / (ms * 1e-3) / 1e9, 1)


def decode_row(
    batch: int, context: int, s: Shapes, device: torch.device, peak_gbps: float, copy: float
) -> dict[str, Any]:
    """The Triton kernel (tile sweep), its owner-check variant and torch SDPA at one shape."""
    q, k, v, table, lens = decode_inputs(batch, context, s, device)
    page, blocks = s.page_size, table.shape[1]
    tags = torch.ones(k.shape[:2], dtype=torch.int64, device=device)  # the reader's own slots:
    reader = torch.ones(batch, dtype=torch.int64, device=device)  # the check runs, flags nothing
    elem = torch.tensor([], dtype=q.dtype).element_size()
    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes(batch, context, s, elem)}
    gbps = _gbps(batch, context, s)
    ref = kernels.paged_decode_attention(q, k, v, table, lens)
    sweep = []
    for tiles in s.tiles:
        try:
            ms = time_ms(
                lambda t=tiles: kernels.paged_decode_attention(q, k, v, table, lens, tiles=t), device
            )
            sweep.append({**asdict(tiles), "ms": round(ms, 4), "gbps": gbps(ms)})
        except Exception as exc:  # a tile too big for the chip is a data point, not a crash
            sweep.append({**asdict(tiles), "error": _err(exc)})
    timed = [t for t in sweep if "ms" in t]
    best = min(timed, key=lambda t: t["ms"])
    best_tiles = kernels.Tiles(best["block_n"], best["block_m"], best["num_warps"])
    splits = kernels.default_splits(batch, s.n_kv_heads, blocks, device)
    row.update(
        triton_ms=best["ms"],
        triton_gbps=best["gbps"],
        triton_fraction_of_peak=round(best["gbps"] / peak_gbps, 3),
        triton_fraction_of_copy=round(best["gbps"] / copy, 3),
        triton_best_tiles={"block_n": best["block_n"], "num_warps": best["num_warps"]},
        triton_splits=splits,
        triton_sweep=sweep,
    )

    def checked() -> object:
        return kernels.paged_decode_attention_checked(q, k, v, table, lens, tags, reader, tiles=best_tiles)

    ms = time_ms(checked, device)
    row.update(
        owner_check_ms=round(ms, 4),
        owner_check_gbps=gbps(ms),
        owner_check_overhead=round(ms / best["ms"] - 1, 3),
    )

    # torch SDPA over the same K/V laid out contiguously per request ([B, KH, L, D]), the bar
    # any paged kernel has to meet
    try:
        kc = k[table.reshape(-1)].view(batch, blocks * page, s.n_kv_heads, s.head_dim)[:, :context]
        vc = v[table.reshape(-1)].view(batch, blocks * page, s.n_kv_heads, s.head_dim)[:, :context]
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        q4 = q[:, :, None, :]
        sdpa_out = F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)[:, :, 0]
        ms = time_ms(lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True), device)
        row.update(
            torch_sdpa_ms=round(ms, 4),
            torch_sdpa_gbps=gbps(ms),
            torch_sdpa_max_diff=float((sdpa_out.float() - ref.float()).abs().max()),
        )
    except Exception as exc:
        row["torch_sdpa_error"] = _err(exc)
    return row


def flashinfer_version() -> str | None:
    try:
        return str(importlib.import_module("flashinfer").__version__)
    except Exception:
        return None


def flashinfer_decode(batch: int, context: int, s: Shapes, device: torch.device) -> dict[str, Any]:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper over the same pages (NHD = our layout).

    Run after every Triton row: FlashInfer may JIT-compile for minutes on first use.
    """
    if device.type != "cuda" or flashinfer_version() is None:
        return {}
    try:
        q, k, v, table, lens = decode_inputs(batch, context, s, device)
        ref = kernels.paged_decode_attention(q, k, v, table, lens)
        gbps = _gbps(batch, context, s)
        flashinfer = importlib.import_module("flashinfer")
        batch, blocks = table.shape
        page = s.page_size
        n_blocks = (lens + page - 1) // page
        indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(n_blocks, 0)
        valid = torch.arange(blocks, device=device)[None, :] < n_blocks[:, None]
        indices = table[valid].to(torch.int32)
        last_page_len = (lens - (n_blocks - 1) * page).to(torch.int32)
        workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)  # zeroed before first use
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        plan: dict[str, Any] = {"pos_encoding_mode": "NONE"}
        sizes = (indptr, indices, last_page_len, s.n_heads, s.n_kv_heads, s.head_dim, page)
        try:
            wrapper.plan(*sizes, q_data_type=q.dtype, kv_data_type=k.dtype, **plan)
        except TypeError:  # older FlashInfer: one data_type
            wrapper.plan(*sizes, data_type=q.dtype, **plan)
        out = wrapper.run(q, (k, v))
        ms = time_ms(lambda: wrapper.run(q, (k, v)), device)
        return {
            "flashinfer_ms": round(ms, 4),
            "flashinfer_gbps": gbps(ms),
            "flashinfer_max_diff": float((out.float() - ref.float()).abs().max()),
        }
    except Exception as exc:
        return {"flashinfer_error": _err(exc)}


# -- 3. the engine end to end --------------------------------------------------------------------
def engine_rows(s: Shapes, device: torch.device) -> list[dict[str, Any]]:
    """Decode tokens/s of the shipped model, paged, with each attention backend."""
    from decode import run_paged  # bench/decode.py

    model = load_model(device=device)
    rng = random.Random(0)
    rows = []
    for b in s.engine_batches:
        lens = [max(8, int(s.engine_prompt_len * rng.uniform(0.75, 1.25))) for _ in range(b)]
        prompts = [list(record_prompt(f"t{i}", n, rng, 6).encode()) for i, n in enumerate(lens)]
        row: dict[str, Any] = {"batch": b, "decode_steps": s.engine_steps, "page_size": 128}
        outs = {}
        for backend in ("torch", "triton"):
            run_paged(model, prompts, 2, 128, backend)  # warm-up: compile, allocate
            seconds, outs[backend] = run_paged(model, prompts, s.engine_steps, 128, backend)
            row[f"{backend}_tokens_per_s"] = round(b * s.engine_steps / seconds, 1)
        row["identical_tokens"] = outs["torch"] == outs["triton"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (created)")
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes (the default without CUDA)")
    p.add_argument(
        "--peak-gbps",
        type=float,
        help="HBM peak to compare with (default: the data sheet's for the chip, else the measured copy)",
    )
    p.add_argument("--batches", type=int, nargs="+", help="override the decode batches")
    p.add_argument("--contexts", type=int, nargs="+", help="override the decode contexts")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument(
        "--flashinfer-warmup",
        action="store_true",
        help="only JIT-compile FlashInfer's decode kernel (one small row) and exit: bench/gpu.sh "
        "runs it in the background while the tests run, so the main run finds it built",
    )
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    s = GPU if cuda else CPU_SMOKE
    if a.batches:
        s = replace(s, batches=tuple(a.batches))
    if a.contexts:
        s = replace(s, contexts=tuple(a.contexts))
    if a.flashinfer_warmup:  # FlashInfer's JIT cache is shared, and locked while it builds
        t0 = time.perf_counter()
        row = flashinfer_decode(1, 1024, s, device)
        print(f"flashinfer {flashinfer_version()} warm-up in {time.perf_counter() - t0:.0f} s: {row}")
        return 0 if "flashinfer_ms" in row else 1
    import triton

    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    copy = copy_gbps(device)
    nominal = nominal_peak_gbps(name) if cuda else None
    if a.peak_gbps is not None and a.peak_gbps <= 0:
        p.error(f"--peak-gbps {a.peak_gbps:g} must be a positive bandwidth in GB/s")
    peak = a.peak_gbps or nominal or copy
    source = "--peak-gbps" if a.peak_gbps else "data sheet" if nominal else "measured copy"
    print(f"{name}: peak {peak:,.0f} GB/s ({source}), device-to-device copy {copy:,.0f} GB/s", flush=True)
    result: dict[str, Any] = {
        "benchmark": "paged decode attention: Triton kernels vs torch SDPA (contiguous KV) vs FlashInfer",
        "mode": "gpu" if cuda else "cpu-smoke",
        "device": name,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flashinfer": flashinfer_version(),
            "cuda": torch.version.cuda,
        },
        "interpreted": kernels.interpreted(),
        # the peer as configured: its default decode path; its docs advise tensor cores from 4 query
        # heads per KV head (8 here), a second JIT build this run's budget leaves out
        "flashinfer_kernel": "BatchDecodeWithPagedKVCacheWrapper, NHD, use_tensor_cores=False",
        "peak_gbps": peak,
        "peak_source": source,
        "copy_gbps": copy,
        "shapes": {k: v for k, v in asdict(s).items() if k != "tiles"},
        "bandwidth_note": "bytes = K and V of every request read once / kernel time; peak = HBM peak; "
        "copy = (bytes read + written) / time of a 1 GiB device-to-device copy",
    }
    t0 = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"kernels-{'cuda' if cuda else 'cpu'}.json"

    def save() -> None:  # after every section: a run cut short keeps what it measured
        result["seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")

    result["correctness"] = correctness(device, smoke=not cuda)
    print(f"correctness ok: {result['correctness']['ok']}", flush=True)
    save()
    rows: list[dict[str, Any]] = []
    result["decode"] = rows
    for b in s.batches:
        for ctx in s.contexts:
            try:
                row = decode_row(b, ctx, s, device, peak, copy)
            except Exception as exc:
                traceback.print_exc()
                row = {"batch": b, "context": ctx, "error": _err(exc)}
            rows.append(row)
            print(
                f"batch {b:>3} context {ctx:>6}: triton {row.get('triton_ms')} ms "
                f"({row.get('triton_gbps')} GB/s), owner-check +{row.get('owner_check_overhead')}, "
                f"sdpa {row.get('torch_sdpa_ms')} ms ({row.get('torch_sdpa_gbps')} GB/s)",
                flush=True,
            )
            if cuda:
                torch.cuda.empty_cache()
            save()
    result["goals"] = goals(rows)  # the bandwidth verdict now, in case a later section is cut short
    save()
    if not a.skip_engine:
        result["engine"] = engine_rows(s, device)
        for row in result["engine"]:
            print(f"engine {row}", flush=True)
        save()
    tried: list[dict[str, Any]] = []
    for row in rows:  # the peer last: its first call may compile for minutes
        if "error" not in row:
            if len(tried) == 1 and "flashinfer_error" in tried[0]:  # its build or its API failed:
                row["flashinfer_error"] = "skipped: the first row failed"  # (a failed JIT reruns)
                continue
            row.update(flashinfer_decode(row["batch"], row["context"], s, device))
            tried.append(row)
            print(f"flashinfer batch {row['batch']} context {row['context']}: {row.get('flashinfer_ms')} ms")
            if cuda:
                torch.cuda.empty_cache()
            save()
    result["goals"] = g = goals(rows)
    save()
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    print(
        f"goals at batch {GOAL_SHAPE[0]} x context {GOAL_SHAPE[1]}: "
        f"{g['fraction_of_peak']} of peak (goal {GOAL_FRACTION_OF_PEAK}: "
        f"{verdict[g['fraction_of_peak_met']]}), "
        f"{g['time_vs_flashinfer']}x FlashInfer's time (goal {GOAL_VS_FLASHINFER}: "
        f"{verdict[g['time_vs_flashinfer_met']]})"
    )
    print(f"wrote {path}")
    return 0 if result["correctness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
