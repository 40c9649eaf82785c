"""The Triton kernels equal the torch paged attention, and the incident reads the same through them.

On a machine without CUDA the kernels run under Triton's interpreter (`kernels` sets
TRITON_INTERPRET=1 before Triton is imported), which runs every program of the grid in Python:
shapes and grids stay small here. With CUDA the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# through the module: it sets TRITON_INTERPRET before Triton is imported (not after)
kernels = pytest.importorskip("minigrid_engine.kernels")

from minigrid_engine import attention  # noqa: E402
from minigrid_engine.config import corrected_preset  # noqa: E402
from minigrid_engine.engine import Engine  # noqa: E402
from minigrid_engine.handle import Engine as Served  # noqa: E402
from minigrid_engine.inprocess import InProcessCluster  # noqa: E402
from minigrid_engine.model import load_model  # noqa: E402
from minigrid_engine.pool import PoolConfig  # noqa: E402
from minigrid_engine.records import record_prompt  # noqa: E402
from minigrid_engine.runner import DecodeItem, ModelRunner, sample  # noqa: E402

CODE = re.compile(r"\b[A-Z0-9]{6,10}\b")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGES = [1, 3, 4, 16, 64, 100, 128]  # powers of two and not
TILES = [None, kernels.Tiles(block_n=16, block_m=16)]  # the default, and many small steps
# bench/gpu.sh lowers it: on a GPU nearly every random shape is a new compile (a second or more)
EXAMPLES_SCALE = float(os.environ.get("MINIGRID_KERNEL_EXAMPLES_SCALE", "1"))


def examples(n: int) -> int:
    return max(3, round(n * EXAMPLES_SCALE))


@pytest.fixture(scope="module")
def model():
    return load_model(device=DEVICE)


def _paged(lens: list[int], page: int, kv_heads: int, d: int, gen: torch.Generator):
    """Random caches; each request reads random distinct pages through a padded block table."""
    n_pages = sum(-(-n // page) for n in lens) + 2
    k_cache = torch.randn(n_pages, page, kv_heads, d, generator=gen)
    v_cache = torch.randn(n_pages, page, kv_heads, d, generator=gen)
    free = torch.randperm(n_pages, generator=gen).tolist()
    tables = []
    for n in lens:
        need = -(-n // page)
        tables.append(free[:need])
        free = free[need:]
    width = max(len(t) for t in tables)
    # padding entries point at some other page: the kernel must never read them
    table = torch.tensor([t + [free[0] if free else 0] * (width - len(t)) for t in tables])
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)


@settings(max_examples=examples(30), deadline=None)
@given(
    lens=st.lists(st.integers(1, 150), min_size=1, max_size=3),
    page=st.sampled_from(PAGES),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 32]),
    splits=st.sampled_from([1, 2, 3]),
    tiles=st.sampled_from(TILES),
    seed=st.integers(0, 2**16),
)
def test_decode_kernel_matches_torch(lens, page, kv_heads, group, d, splits, tiles, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = _paged(lens, page, kv_heads, d, gen)
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    ref = attention.paged_decode_attention(q, k_cache, v_cache, table, seq_lens)
    run = kernels.decode(q, k_cache, v_cache, table, seq_lens, num_splits=splits, tiles=tiles, record=True)
    torch.testing.assert_close(run.out, ref, atol=1e-5, rtol=1e-5)
    # the kernel read exactly the request's pages, in block-table order, and no padding entry
    assert run.pages_read is not None
    for b, n in enumerate(lens):
        blocks = -(-n // page)
        for h in range(kv_heads):
            assert run.pages_read[b, h, :blocks].tolist() == table[b, :blocks].tolist()
            assert (run.pages_read[b, h, blocks:] == -1).all()


@settings(max_examples=examples(20), deadline=None)
@given(
    lens=st.lists(st.integers(1, 100), min_size=1, max_size=3),
    page=st.sampled_from(PAGES),
    splits=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_owner_check_kernel_flags_what_foreign_pages_flags(lens, page, splits, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = _paged(lens, page, 2, 16, gen)
    q = torch.randn(len(lens), 4, 16, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    # one writer per page, and now and then a slot written by another: the flag is per slot read
    n_pages = k_cache.shape[0]
    slot_tags = torch.randint(0, 3, (n_pages, 1), generator=gen).expand(n_pages, page).clone()
    odd = torch.rand(n_pages, page, generator=gen) < 2 / page
    slot_tags[odd] = torch.randint(0, 3, (int(odd.sum()),), generator=gen)
    slot_tags = slot_tags.to(DEVICE)
    reader_tags = torch.randint(0, 3, (len(lens),), generator=gen).to(DEVICE)
    out, foreign = kernels.paged_decode_attention_checked(
        q, k_cache, v_cache, table, seq_lens, slot_tags, reader_tags, num_splits=splits
    )
    expected = attention.foreign_pages(slot_tags, reader_tags, table, seq_lens, page)
    assert foreign.dtype == torch.bool and torch.equal(foreign, expected)
    ref = attention.paged_decode_attention(q, k_cache, v_cache, table, seq_lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=examples(25), deadline=None)
@given(
    n=st.integers(1, 150),
    start_frac=st.floats(0, 0.9),
    page=st.sampled_from(PAGES),
    group=st.sampled_from([1, 2, 3, 4]),
    tiles=st.sampled_from(TILES),
    seed=st.integers(0, 2**16),
)
def test_prefill_and_write_kernels_match_torch(n, start_frac, page, group, tiles, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    kh, d = 2, 32
    keys, vals = torch.randn(n, kh, d, generator=gen), torch.randn(n, kh, d, generator=gen)
    n_pages = -(-n // page) + 3
    table = torch.randperm(n_pages, generator=gen)[: -(-n // page)]
    k_cache = torch.randn(n_pages, page, kh, d, generator=gen) * 10
    v_cache = torch.randn(n_pages, page, kh, d, generator=gen) * 10
    keys, vals, table, k_cache, v_cache = (t.to(DEVICE) for t in (keys, vals, table, k_cache, v_cache))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = attention.slot_ids(table, torch.arange(n, device=DEVICE), page)
    kernels.write_kv(k_cache, v_cache, slots, keys, vals)
    attention.write_kv(k_ref, v_ref, slots, keys, vals)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # and no other slot moved
    start = int(start_frac * n)
    q = torch.randn(n - start, kh * group, d, generator=gen).to(DEVICE)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, table, start, tiles=tiles)
    ref = attention.paged_prefill_attention(q, k_ref, v_ref, table, start)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_write_kv_of_a_row_wider_than_one_program() -> None:
    """5 kv heads x 96 dims = 480 columns: two column chunks, the second masked at its tail."""
    gen = torch.Generator().manual_seed(3)
    n, page, kh, d = 21, 8, 5, 96
    assert kh * d > kernels.WRITE_COLUMNS
    k_cache = torch.randn(6, page, kh, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(6, page, kh, d, generator=gen).to(DEVICE)
    keys, vals = (
        torch.randn(n, kh, d, generator=gen).to(DEVICE),
        torch.randn(n, kh, d, generator=gen).to(DEVICE),
    )
    slots = attention.slot_ids(torch.tensor([4, 1, 3], device=DEVICE), torch.arange(n, device=DEVICE), page)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.write_kv(k_cache, v_cache, slots, keys, vals)
    attention.write_kv(k_ref, v_ref, slots, keys, vals)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


HALF = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]  # numpy has no bf16


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, table = _paged([40, 7], 16, 2, 32, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([40, 7], device=DEVICE)
    ref = attention.paged_decode_attention(q, k_cache, v_cache, table, seq_lens)
    half = [t.to(dtype) for t in (q, k_cache, v_cache)]
    out = kernels.paged_decode_attention(half[0], half[1], half[2], table, seq_lens, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    prefill = kernels.paged_prefill_attention(
        half[0][:1].expand(5, 4, 32).contiguous(), half[1], half[2], table[0], 35
    )
    expected = attention.paged_prefill_attention(q[:1].expand(5, 4, 32), k_cache, v_cache, table[0], 35)
    torch.testing.assert_close(prefill.float(), expected, atol=3e-2, rtol=3e-2)


def test_largest_page_and_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table = _paged([300], 4096, 1, 8, gen)
    q = torch.randn(1, 2, 8, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([300], device=DEVICE)
    torch.testing.assert_close(
        kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens),
        attention.paged_decode_attention(q, k_cache, v_cache, table, seq_lens),
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="not fit"):
        kernels.paged_decode_attention(
            torch.randn(1, 2, 16, device=DEVICE), k_cache, v_cache, table, seq_lens
        )
    with pytest.raises(ValueError, match="need 1 pages, block table has 0"):
        kernels.paged_prefill_attention(q, k_cache, v_cache, table[0, :0], 0)


def test_a_length_past_its_block_table_row_is_refused_and_never_read() -> None:
    """A length longer than its row would read the next request's block table: the cross-request
    read this lab is about. Host-side lengths are refused with the numbers; on a GPU, where that
    check would cost a sync, the kernel stops its walk at the row's end, as the torch gather does."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, table = _paged([20, 20], 16, 1, 8, gen)  # rows of 2 blocks of 16 tokens
    q = torch.randn(2, 2, 8, generator=gen).to(DEVICE)
    for bad, numbers in (([33, 20], "from 20 to 33"), ([0, 20], "from 0 to 20")):
        with pytest.raises(ValueError, match=f"seq_lens run {numbers} tokens: each must be 1 to 32"):
            kernels.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(bad))
    with pytest.raises(ValueError, match=r"must be \[2, max_blocks\] and \[2\]"):
        kernels.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([20]))
    if DEVICE == "cuda":  # no host check there: the bound is the kernel's own
        lens = torch.tensor([33, 20], device=DEVICE)
        full = torch.tensor([32, 20], device=DEVICE)
        torch.testing.assert_close(
            kernels.paged_decode_attention(q, k_cache, v_cache, table, lens),
            kernels.paged_decode_attention(q, k_cache, v_cache, table, full),
        )


PROMPTS = ["ALICE card QZ7K2M9P; ALICE card QZ7K2M9P; ALICE card", "hello world. hello world. hello"]


def test_greedy_completions_are_identical_with_triton_and_torch(model) -> None:
    prompts = PROMPTS
    texts = {}
    for backend in ("torch", "triton"):
        pool = PoolConfig(512, 16)
        engine = Engine(model=model, pool=pool, context_length=256, device=DEVICE, attention=backend)
        done = engine.generate("t", prompts, max_tokens=12)  # ragged batch of two, three pages each
        texts[backend] = [(c.token_ids, c.text) for c in done]
        engine.pool.check_integrity()
    assert texts["triton"] == texts["torch"]
    assert texts["torch"][0][1].startswith(" QZ7K2M9P")  # the model copied its own card


def test_seeded_sampling_runs_on_the_device_and_repeats(model) -> None:
    """Sampling draws on the CPU from a CPU generator, whatever device made the logits (on CUDA a
    CPU generator given CUDA probabilities would raise); the same seed, the same tokens."""
    for backend in ("torch", "triton"):
        engine = Engine(
            model=model, pool=PoolConfig(512, 16), context_length=256, device=DEVICE, attention=backend
        )
        runs = []
        for seed in (2**40 + 3, 2**40 + 3, 1, 2, 3):
            req = engine.submit("t", PROMPTS[1], max_tokens=8, temperature=2.0, seed=seed)
            engine.run()
            runs.append(req.output_ids)
        assert len(runs[0]) == 8 and runs[0] == runs[1], (backend, runs)
        assert len({tuple(r) for r in runs}) > 2, (backend, runs)  # other seeds draw otherwise
        engine.pool.check_integrity()


def test_stale_block_table_leaks_through_the_triton_kernel_and_owner_check_flags_it(model) -> None:
    """tests/test_model.py's leak, every read through the kernels: bob decodes over alice's pages."""
    rng = random.Random(3)
    pool_cfg = PoolConfig(2048, 128)
    engine = Engine(model=model, pool=pool_cfg, context_length=1024, device=DEVICE, attention="triton")
    alice_prompt = record_prompt("alice", 640, rng, 9)
    [a] = engine.generate("alice", [alice_prompt], max_tokens=4)
    alice_codes = set(re.findall(r"ALICE [a-z]+ ([A-Z0-9]{6,10});", alice_prompt))

    pool = engine.pool
    runner = ModelRunner(model, pool, owner_check=True, attention="triton")
    bob = pool.reserve("bob-1", "bob", 640 + 32)  # alice's freed pages, in the same order
    logits = runner.prefill("bob-1", "bob", [0], bob.pages)  # a one-token stub: page 0 only
    out = [sample(logits, 0.0)]
    flagged = []
    for step in range(24):
        item = DecodeItem("bob-1", "bob", out[-1], 640 + step, bob.pages)
        out.append(sample(runner.decode([item])[0], 0.0))
        flagged.append(runner.violations.get("bob-1", []))
    text = engine.tokenizer.decode(out)
    assert set(CODE.findall(text)) & alice_codes, f"bob's answer {text!r} should hold alice's codes"
    # the kernel's owner-check saw it at every step: blocks 1-5 hold alice's slots, block 1 too
    # (the stub wrote its first slot only); block 6 never: bob writes each slot before he reads it
    assert all(f == bob.pages[0:5] for f in flagged), flagged
    assert {pool.pages[p].last_writer for p in bob.pages[1:5]} == {a.request_id}
    # the lab's view of the same read: each program's pages, their last writers, the flags
    reads = kernels.kernel_reads(pool, [bob.pages], [640 + 24], ["bob-1"])
    assert [r["page"] for r in reads if r["kv_head"] == 0] == bob.pages
    assert all(r["flagged"] == (r["last_writer"] == a.request_id) for r in reads)
    assert {r["program"] for r in reads} == {(0, 0, 0), (0, 1, 0)}
    pool.release("bob-1")
    pool.check_integrity()


def test_the_gpu_script_says_when_there_is_no_gpu(tmp_path: Path) -> None:
    """bench/gpu.sh, the one run a lent GPU machine gets, parses and stops with exit status 2 here."""
    if DEVICE == "cuda":
        pytest.skip("a GPU is visible: bench/gpu.sh would run in full")
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu.sh"
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path / "gpu")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device visible" in proc.stderr


def test_kernel_bench_runs_in_its_cpu_form(tmp_path: Path) -> None:
    """bench/kernels.py (what bench/gpu.sh runs on a GPU) at toy sizes: every section, every field."""
    script = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((tmp_path / "kernels-cpu.json").read_text())
    assert r["mode"] == "cpu-smoke" and r["interpreted"] and r["correctness"]["ok"]
    assert r["correctness"]["model_greedy"]["identical"]
    assert all(c["owner_check_flags_equal"] for c in r["correctness"]["checks"])
    for row in r["decode"]:
        for field in ("kv_bytes", "triton_ms", "triton_gbps", "triton_fraction_of_peak", "triton_sweep"):
            assert field in row, field
        assert {"owner_check_ms", "owner_check_overhead", "torch_sdpa_ms", "torch_sdpa_gbps"} <= set(row)
        assert row["torch_sdpa_max_diff"] < 1e-4
    assert [(row["batch"], row["context"]) for row in r["decode"]] == [(1, 100), (2, 100)]
    assert all(row["identical_tokens"] and row["triton_tokens_per_s"] > 0 for row in r["engine"])
    assert r["copy_gbps"] > 0 and r["peak_source"] == "measured copy" and r["peak_gbps"] == r["copy_gbps"]
    for row in r["decode"]:  # the interpreter is slow: a fraction this small rounds to 0 here
        assert row["triton_fraction_of_copy"] == round(row["triton_gbps"] / r["copy_gbps"], 3)
    assert r["goals"]["fraction_of_peak_met"] is None  # no batch 64 x 8k row at toy sizes
    assert "goals at batch 64 x context 8192" in proc.stdout and "not measured" in proc.stdout


def _bench_kernels():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_kernel_bench_knows_each_chips_peak_and_judges_the_goals() -> None:
    bench = _bench_kernels()
    peaks = {
        "NVIDIA H200": 4800.0,
        "NVIDIA H100 80GB HBM3": 3350.0,
        "NVIDIA H100 PCIe": 2000.0,
        "NVIDIA H100 NVL": 3900.0,
        "NVIDIA A100-SXM4-80GB": 2039.0,
        "NVIDIA A100-SXM4-40GB": 1555.0,
        "NVIDIA GH200 480GB": None,  # not the H200: its own HBM, compared with the measured copy
        "NVIDIA L4": None,
    }
    assert {name: bench.nominal_peak_gbps(name) for name in peaks} == peaks
    row = {"batch": 64, "context": 8192, "triton_ms": 1.1, "triton_fraction_of_peak": 0.83}
    other = {"batch": 8, "context": 8192, "triton_ms": 9.0, "triton_fraction_of_peak": 0.1}
    g = bench.goals([other, row])
    assert g["fraction_of_peak"] == 0.83 and g["fraction_of_peak_met"] is True
    assert g["time_vs_flashinfer"] is None and g["time_vs_flashinfer_met"] is None  # no FlashInfer
    g = bench.goals([{**row, "flashinfer_ms": 0.8, "triton_fraction_of_peak": 0.7}])
    assert g["time_vs_flashinfer"] == 1.375 and g["time_vs_flashinfer_met"] is False
    assert g["fraction_of_peak_met"] is False
    assert (
        bench.goals([{"batch": 64, "context": 8192, "error": "OutOfMemoryError"}])["fraction_of_peak"] is None
    )


def test_both_disaggregated_roles_run_the_kernels(model) -> None:
    texts = {}
    for backend in ("torch", "triton"):  # pools on the model's device, as `--device` puts them
        cluster = InProcessCluster(corrected_preset(attention=backend, device=DEVICE), model)
        assert cluster.prefill.runner.ops.name == cluster.decode.runner.ops.name == backend
        result = cluster.complete("alice", PROMPTS[0], 8)
        assert result.status == 200
        texts[backend] = cluster.text(result)
    assert texts["triton"] == texts["torch"]


def test_minigrid_serve_attention_triton_answers_like_torch(model) -> None:
    """`--attention triton` through ServeConfig, the command line and both worker processes."""
    engine = Engine(model=model, pool=PoolConfig(512, 16), context_length=256, device=DEVICE)
    [expected] = engine.generate("alice", [PROMPTS[0]], max_tokens=8)
    with Served.start(corrected_preset(attention="triton", device=DEVICE)) as served:
        reply = served.complete("alice", PROMPTS[0], max_tokens=8)
    assert reply.status == 200 and reply.text == expected.text


COMPILE_FOR_H100 = """
import os
os.environ["TRITON_INTERPRET"] = "0"  # compile for real, for a GPU this machine need not have
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minigrid_engine import kernels as K

def signature(fn, pointers, floats, constexprs):
    def kind(n):
        return pointers.get(n) or ("fp32" if n in floats else "constexpr" if n in constexprs else "i32")
    return {n: kind(n) for n in fn.arg_names}

half = dict(Q="*fp16", KCache="*fp16", VCache="*fp16", BlockTables="*i64", SeqLens="*i64", PartOut="*fp32",
            PartLse="*fp32", SlotTags="*i64", ReaderTags="*i64", Foreign="*i8", PagesRead="*i64")
decode = dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, OWNER_CHECK=True, RECORD=True,
              PRECISION="tf32")
prefill = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=32, BLOCK_M=32, BLOCK_D=32, BLOCK_N=32, PRECISION="ieee")
full = dict(Q="*fp32", KCache="*fp32", VCache="*fp32", BlockTable="*i64", Out="*fp32")
jobs = [
    (K._decode_kernel, signature(K._decode_kernel, half, ["scale_log2"], decode), decode),
    (K._prefill_kernel, signature(K._prefill_kernel, full, ["scale_log2"], prefill), prefill),
]
for fn, sig, consts in jobs:
    compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
    assert "ld.global" in compiled.asm["ptx"]
    print(fn.fn.__name__, "compiled, shared memory", compiled.metadata.shared)
"""


def test_kernels_compile_for_a_gpu_not_only_the_interpreter() -> None:
    """The interpreter is lenient; Triton's real compiler (to PTX and a cubin for sm_90) is not."""
    ptxas = Path(kernels.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "_decode_kernel compiled" in proc.stdout and "_prefill_kernel compiled" in proc.stdout


def test_without_triton_the_kernels_say_why_in_one_line() -> None:
    """macOS, Windows, Python 3.10: Triton has no wheel there; lab 12 and --attention triton say
    so (the notebook shows a minigrid error as its one line), and nothing else needs it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "try:\n    import minigrid_engine.kernels\n"
        "except ImportError as e:\n    print(type(e).__name__, '|', e)\n"
        "from minigrid_engine.engine import Engine\n"  # the rest of the engine imports fine
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a fresh process has it
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("TritonMissing | Triton is not installed here"), proc.stdout
    assert "Linux with Python 3.11 or later" in proc.stdout and "Binder" in proc.stdout
