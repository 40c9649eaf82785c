"""Paged attention in Triton: the same reads as `minigrid_engine.attention`, one program at a time.

Four kernels, each a drop-in for the torch function of the same name in `attention.py` (same
arguments, same result), so `ModelRunner(..., attention="triton")` can switch:

- `write_kv`: store this step's K/V at flat slots (``page * page_size + offset``) of the pages;
- `paged_prefill_attention`: causal attention of a prompt chunk over keys read through its
  block table;
- `paged_decode_attention`: one query token per request. Each program (request x kv head x
  split) walks the request's tokens in block-table order, ``BLOCK_N`` at a time, finding each
  token's page in the block table, with an online softmax; with several splits per request a
  second kernel combines them (split-K, for long contexts on a GPU with many SMs);
- `paged_decode_attention_checked`: the decode kernel with the `owner-check` fix inside it: for
  every token it reads, it also reads that slot's last-writer tag through the same block table and
  flags the page when the tag is not the reader's (`attention.foreign_pages`, at the read).

`decode(..., record=True)` also returns the page each program read, and `kernel_reads(pool, ...)`
turns that into rows a notebook can show (page, last writer, flagged).

Cache layout, one layer: ``[n_pages, page_size, n_kv_heads, head_dim]``, keys already rotated.
Any page size the pool allows (1 to 4096, powers of two or not) works with any tile, because
each token's page is looked up on its own and the tail of a tile is masked. Tiles are powers of
two of at least 16 (`tl.dot` needs that on a GPU); fewer query heads per kv head than 16, or a
head_dim that is not a power of two, are padded and masked the same way. Inputs may be float32
(exact: no TF32), float16 or bfloat16; the softmax and the sums are always float32.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set below before `triton` is imported: `triton.jit` reads it when a
kernel is defined, and triton.language defines its own helpers at import). The interpreter runs
every program of the grid as a Python loop, slow but exact, which is what the tests and the
kernel lab need. Import this module only when the Triton path is wanted (`runner.attention_ops`
does it lazily).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

# No GPU and no choice made: the interpreter, decided before triton is imported. (An explicit
# TRITON_INTERPRET=0 is respected: compiling for a GPU target on a CPU-only machine is legitimate.)
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if sys.modules.get("triton") is not None:
        # triton.language's own helpers (tl.sum, tl.max) were already defined for a GPU
        raise ImportError(
            "triton was imported before minigrid_engine.kernels on a machine without CUDA: set "
            "TRITON_INTERPRET=1 before importing triton, or import minigrid_engine.kernels first"
        )
    os.environ["TRITON_INTERPRET"] = "1"

from minigrid_engine.errors import TRITON_MISSING, ConfigError, TritonMissing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as exc:
    if exc.name != "triton":
        raise
    raise TritonMissing(TRITON_MISSING) from None

if TYPE_CHECKING:
    from minigrid_engine.pool import KVPool

MIN_BLOCK = 16  # tl.dot needs every dimension >= 16 on a GPU; smaller shapes are padded and masked
MAX_SPLITS = 64


def interpreted() -> bool:
    """True when the kernels run under Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter makes a loop bound of a scalar (held as an array of shape (1,))
    with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted");
    Triton 3.9's squeezes the array first. Do the same for an interpreter that does not. (The
    compiled kernels on a GPU never take this path.)"""
    import inspect

    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        if patch is None or "squeeze" in inspect.getsource(patch):
            return
    except (OSError, TypeError):
        return

    def patched(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if interpreted():
    _interpreter_scalar_index()


# -- the kernels ---------------------------------------------------------------------------------
# Lengths and batch widths are not specialized on (== 1, divisible by 16): a new one is no new compile.
@triton.jit(do_not_specialize=["n_tokens"])
def _write_kv_kernel(
    KCache,
    VCache,
    Slots,
    K,
    V,
    n_tokens,
    page_size,
    stride_cp,  # cache: [n_pages, page_size, n_kv_heads * head_dim] (heads and dims contiguous)
    stride_ct,
    stride_kn,  # k, v: [N, n_kv_heads * head_dim]
    stride_vn,
    ROW: tl.constexpr,  # n_kv_heads * head_dim
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,  # columns per program: a chunk of the row, so few registers hold it
):
    """Program (i, j) stores columns j*BLOCK_ROW.. of tokens i*BLOCK_T.. at their slots: the page a
    slot names is written, no other."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    ok = (tokens < n_tokens)[:, None] & (cols < ROW)[None, :]
    slot = tl.load(Slots + tokens, mask=tokens < n_tokens, other=0)
    page, offset = slot // page_size, slot % page_size
    dst = page[:, None] * stride_cp + offset[:, None] * stride_ct + cols[None, :]
    k = tl.load(K + tokens[:, None] * stride_kn + cols[None, :], mask=ok)
    v = tl.load(V + tokens[:, None] * stride_vn + cols[None, :], mask=ok)
    tl.store(KCache + dst, k, mask=ok)
    tl.store(VCache + dst, v, mask=ok)


@triton.jit(do_not_specialize=["pages_per_split", "max_blocks"])
def _decode_kernel(
    Q,  # [B, n_heads, head_dim]
    KCache,  # [n_pages, page_size, n_kv_heads, head_dim]
    VCache,
    BlockTables,  # [B, max_blocks] page ids
    SeqLens,  # [B] tokens to attend over (>= 1)
    PartOut,  # [B, n_heads, n_splits, head_dim] float32: this split's normalised output (one split:
    # the output itself, [B, n_heads, 1, head_dim] in the query's dtype)
    PartLse,  # [B, n_heads, n_splits] float32: log2 of sum(2^scores) over this split (its weight)
    SlotTags,  # [n_pages, page_size] int64 last-writer tag of each slot (owner-check only)
    ReaderTags,  # [B] int64 the reading request's tag (owner-check only)
    Foreign,  # [B, max_blocks] int8 out: 1 where the page read was last written by someone else
    PagesRead,  # [B, n_kv_heads, max_blocks] int64 out: the page each program read (record only)
    scale_log2,  # softmax scale * log2(e): exp2 instead of exp
    page_size,
    pages_per_split,
    max_blocks,  # the block table's width: no request reads past its own row
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_bb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_fb,
    stride_rb,
    stride_rh,
    GROUP: tl.constexpr,  # query heads per kv head (grouped-query attention)
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OWNER_CHECK: tl.constexpr,
    RECORD: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (exact, no TF32), the default otherwise
):
    """One program = one request x one kv head x one split of its pages.

    The program serves the GROUP query heads that share the kv head, so each K/V page is read
    once for all of them. It walks its pages in block-table order; the page id is the only
    address it has, which is the whole point: it reads whatever that page holds.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)  # loop bounds in one integer type
    n_blocks = (seq_len + page_size - 1) // page_size  # blocks past the length are padding: never read
    # A length past its row would read the next request's block table (the leak, once more) or
    # past the table: the walk stops at the row's end, as the torch reference's gather does.
    n_blocks = tl.minimum(n_blocks, max_blocks)
    seq_len = tl.minimum(seq_len, n_blocks * page_size)
    first_block = split * pages_per_split
    last_block = tl.minimum(first_block + pages_per_split, n_blocks)

    g = tl.arange(0, BLOCK_H)  # query heads of this kv head (rows past GROUP are padding)
    d = tl.arange(0, BLOCK_D)
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # online softmax state, per query head: running max (log2 domain), denominator, output
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    if OWNER_CHECK:
        reader = tl.load(ReaderTags + b)

    # Walk this split's tokens BLOCK_N at a time. Token n lives in page block_table[n // page_size]
    # at offset n % page_size: the page id is the only address the kernel has, and it reads
    # whatever that page holds. (A tile is a piece of one page, or several small pages.)
    tok_start = first_block * page_size
    tok_end = tl.minimum(last_block * page_size, seq_len)
    for tile in range(tok_start, tok_end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        tok_ok = n < tok_end
        block = n // page_size
        page = tl.load(BlockTables + b * stride_bb + block, mask=tok_ok, other=0).to(tl.int64)
        offset = n % page_size
        if OWNER_CHECK:  # the fix, at the read: whose data is this slot, by its own tag?
            # Only flags are stored (1), so programs of other kv heads, and tokens of the same page,
            # never race to write different values into one flag.
            tag = tl.load(SlotTags + page * page_size + offset, mask=tok_ok, other=0)
            flag = tl.full([BLOCK_N], 1, dtype=tl.int8)
            tl.store(Foreign + b * stride_fb + block, flag, mask=tok_ok & (tag != reader))
        if RECORD:
            tl.store(PagesRead + b * stride_rb + kv_head * stride_rh + block, page, mask=tok_ok)
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k_row = page * stride_kp + offset * stride_kt + kv_head * stride_kh  # token n's key
        k = tl.load(KCache + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds >= 1 valid token
        alpha = tl.exp2(m_i - m_new)  # rescale what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        v_row = page * stride_vp + offset * stride_vt + kv_head * stride_vh  # token n's value
        v = tl.load(VCache + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # A split with no pages (a short request in a wide batch) leaves l_i = 0: weight 0 in the reduce.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        PartOut + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
        out.to(PartOut.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _reduce_kernel(
    PartOut,
    PartLse,
    Out,  # [B, n_heads, head_dim] in the query's dtype
    n_splits,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Combine the splits of one (request, head): weights 2^(lse_s - max lse), renormalised."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + s, mask=s < n_splits, other=float("-inf"))
    # split 0 always holds page 0, so the max is finite for any length >= 1 (the floor keeps an
    # empty request at 0, as one split leaves it, instead of NaN)
    w = tl.exp2(lse - tl.maximum(tl.max(lse, axis=0), -1e30))
    part = tl.load(
        PartOut + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=(s < n_splits)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_outb + h * stride_outh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["start", "n_query"])
def _prefill_kernel(
    Q,  # [T, n_heads, head_dim] at positions start .. start+T-1
    KCache,
    VCache,
    BlockTable,  # [n_blocks] page ids of this request
    Out,  # [T, n_heads, head_dim]
    scale_log2,
    start,
    n_query,
    page_size,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_M // GROUP_PAD tokens x GROUP_PAD heads
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (exact, no TF32), the default otherwise
):
    """One program = a few query tokens x every query head of one kv head, over keys 0..its last
    position, BLOCK_N at a time, each key found through the block table as in the decode kernel.
    The group's heads are rows of one tile, so each K/V page is read once for all of them."""
    TOKENS = BLOCK_M // GROUP_PAD  # constexpr
    m_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    rows = m_block * TOKENS + r // GROUP_PAD  # row r: token r // GROUP_PAD, head r % GROUP_PAD
    g = r % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (rows < n_query) & (g < GROUP)
    pos = start + rows  # each query's position: it may see keys 0..pos (causal)
    d = tl.arange(0, BLOCK_D)
    dim_ok = d < HEAD_DIM
    q = tl.load(
        Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    n_keys = tl.minimum(start + (m_block + 1) * TOKENS, start + n_query)  # keys the last row sees
    for tile in range(0, n_keys, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        tok_ok = n < n_keys
        page = tl.load(BlockTable + n // page_size, mask=tok_ok, other=0).to(tl.int64)
        offset = n % page_size
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k_row = page * stride_kp + offset * stride_kt + kv_head * stride_kh  # token n's key
        k = tl.load(KCache + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(tok_ok[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))  # causal
        # key 0 is visible to every row (padding rows too: pos >= 0), so after the first tile
        # every row's max is finite
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v_row = page * stride_vp + offset * stride_vt + kv_head * stride_vh  # token n's value
        v = tl.load(VCache + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


# -- the wrappers: same signatures as attention.py -----------------------------------------------
@dataclass(frozen=True)
class Tiles:
    """Tile sizes: BLOCK_N keys per step, BLOCK_M queries per prefill program, warps per program.

    Any page size works with any tile: each key's page is looked up on its own. The interpreter
    prefers big tiles (its cost is per operation, not per element); a GPU prefers tiles that fit
    in registers.
    """

    block_n: int
    block_m: int
    num_warps: int = 4

    @classmethod
    def default(cls, device: torch.device, dtype: torch.dtype) -> Tiles:
        if device.type != "cuda" or interpreted():
            return cls(block_n=256, block_m=128)
        if dtype == torch.float32:
            return cls(block_n=32, block_m=32)
        return cls(block_n=64, block_m=64)


WRITE_COLUMNS = 256  # write_kv: 16 tokens x 256 columns of K and of V per program (8 x 128 heads: 4)


def _pow2(n: int, floor: int = MIN_BLOCK) -> int:
    return max(floor, triton.next_power_of_2(n))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches must be [n_pages, page_size, n_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of q and of the caches")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[-2] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit a cache of {k_cache.shape[2]} kv heads x {k_cache.shape[3]}"
        )
    if q.device.type == "cpu" and not interpreted():
        raise ConfigError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported "
            "(minigrid_engine.kernels sets it itself when no GPU is visible)"
        )


def _check_lengths(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int, page_size: int) -> None:
    """Every request's length within its block table's row (1 to width x page size). Checked when the
    lengths are on the host, which costs no device sync; on a GPU the kernel bounds its walk by the
    row, so a bad length can never read another request's pages."""
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(seq_lens.shape) != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must be "
            f"[{batch}, max_blocks] and [{batch}] for a batch of {batch}"
        )
    if seq_lens.device.type != "cpu" or batch == 0:
        return
    room = block_tables.shape[1] * page_size
    short, long = int(seq_lens.min()), int(seq_lens.max())
    if short < 1 or long > room:
        raise ValueError(
            f"seq_lens run from {short} to {long} tokens: each must be 1 to {room} "
            f"({block_tables.shape[1]} blocks of {page_size} tokens in the block table)"
        )


_UNUSED: dict[torch.device, torch.Tensor] = {}


def _unused(device: torch.device) -> torch.Tensor:
    """A one-element pointer for a kernel argument whose feature is off (made once per device)."""
    if device not in _UNUSED:
        _UNUSED[device] = torch.zeros(1, 1, 1, dtype=torch.int64, device=device)
    return _UNUSED[device]


def _precision(t: torch.Tensor) -> str:
    """tl.dot's input precision: "ieee" keeps float32 exact (a GPU would use TF32); "tf32" is
    Triton's default, and float16 / bfloat16 dots are unaffected by it."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store k, v [N, n_kv_heads, head_dim] at flat `slots` [N] of one layer's cache (in place)."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    if k_cache.stride(2) != head_dim or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("write_kv needs caches whose heads and dims are contiguous")
    # [N, heads * dims] rows; a view when k comes straight from the model
    k = k.to(k_cache.dtype).reshape(n, kv_heads * head_dim)
    v = v.to(v_cache.dtype).reshape(n, kv_heads * head_dim)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    row = kv_heads * head_dim
    block_t, block_row = 16, min(WRITE_COLUMNS, triton.next_power_of_2(row))
    _write_kv_kernel[(triton.cdiv(n, block_t), triton.cdiv(row, block_row))](
        k_cache,
        v_cache,
        slots.contiguous(),
        k,
        v,
        n,
        k_cache.shape[1],
        k_cache.stride(0),
        k_cache.stride(1),
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK_T=block_t,
        BLOCK_ROW=block_row,
    )


def default_splits(batch: int, kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Splits of the pages per (request, kv head): 1 on CPU; on a GPU enough programs to fill every
    SM about twice (one long request is otherwise a handful of programs on a 132-SM chip)."""
    if device.type != "cuda" or interpreted():
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, max_blocks, triton.cdiv(2 * sms, batch * kv_heads)))


@dataclass
class DecodeRun:
    """What one decode launch produced (`pages_read` and `foreign` only when asked for).

    out: [B, n_heads, head_dim]. pages_read: [B, n_kv_heads, max_blocks], the page id the
    program of (request, kv head) loaded for each block of the block table, -1 where it read
    nothing (padding past the request's length). foreign: [B, max_blocks] bool, the owner-check
    flags. Block ``i`` is read by split ``i // pages_per_split`` (grid: B x n_kv_heads x n_splits).
    """

    out: torch.Tensor
    pages_read: torch.Tensor | None
    foreign: torch.Tensor | None
    n_splits: int
    pages_per_split: int


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_tags: torch.Tensor | None = None,
    reader_tags: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    record: bool = False,
    tiles: Tiles | None = None,
) -> DecodeRun:
    """Launch the decode kernel (then the reduce when split); owner-check runs when tags are given.

    `record=True` also returns the page each program read (the kernel lab draws it).
    """
    _check(q, k_cache, v_cache)
    b, n_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    if (slot_tags is None) != (reader_tags is None):
        raise ValueError("owner-check needs both slot_tags and reader_tags")
    if slot_tags is not None and tuple(slot_tags.shape) != tuple(k_cache.shape[:2]):
        raise ValueError(
            f"slot_tags has shape {tuple(slot_tags.shape)}: one tag per slot, "
            f"{tuple(k_cache.shape[:2])} (pages, page size) for this cache"
        )
    _check_lengths(block_tables, seq_lens, b, page_size)
    tiles = tiles or Tiles.default(q.device, q.dtype)
    want = num_splits or default_splits(b, kv_heads, max_blocks, q.device)
    per_split = triton.cdiv(max_blocks, max(1, min(want, max_blocks)))
    splits = triton.cdiv(max_blocks, per_split)  # every split starts inside the block table
    dev = q.device
    block_tables = block_tables.contiguous()
    if splits == 1:  # nothing to combine: the one split writes the answer, in the query's dtype
        part_out = torch.empty(b, n_heads, 1, head_dim, dtype=q.dtype, device=dev)
    else:
        part_out = torch.empty(b, n_heads, splits, head_dim, dtype=torch.float32, device=dev)
    part_lse = torch.empty(b, n_heads, splits, dtype=torch.float32, device=dev)
    check = slot_tags is not None
    foreign = torch.zeros(b, max_blocks, dtype=torch.int8, device=dev) if check else None
    pages_read = torch.full((b, kv_heads, max_blocks), -1, dtype=torch.int64, device=dev) if record else None
    unused = _unused(dev)  # pointer for a feature turned off
    f = foreign if foreign is not None else unused[0]
    r = pages_read if pages_read is not None else unused
    _decode_kernel[(b, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        slot_tags.contiguous() if slot_tags is not None else unused,
        reader_tags if reader_tags is not None else unused,
        f,
        r,
        math.log2(math.e) / math.sqrt(head_dim),
        page_size,
        per_split,
        max_blocks,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        f.stride(0),
        r.stride(0),
        r.stride(1),
        GROUP=n_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=_pow2(n_heads // kv_heads),
        BLOCK_D=_pow2(head_dim),
        BLOCK_N=tiles.block_n,
        OWNER_CHECK=check,
        RECORD=record,
        PRECISION=_precision(q),
        num_warps=tiles.num_warps,
    )
    if splits == 1:
        out = part_out[:, :, 0]
    else:
        out = torch.empty_like(q)
        _reduce_kernel[(b, n_heads)](
            part_out,
            part_lse,
            out,
            splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(splits),
        )
    flags = None if foreign is None else foreign.view(torch.bool)  # 0 / 1 bytes: a view, no copy
    return DecodeRun(out, pages_read, flags, splits, per_split)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """One query token per request over its first `seq_lens[b]` cached tokens (>= 1 each).

    q: [B, n_heads, head_dim]; block_tables: [B, max_blocks] (entries past a request's length
    are never read); seq_lens: [B]. Returns [B, n_heads, head_dim].
    """
    return decode(q, k_cache, v_cache, block_tables, seq_lens, num_splits=num_splits, tiles=tiles).out


def paged_decode_attention_checked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_tags: torch.Tensor,
    reader_tags: torch.Tensor,
    *,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with the `owner-check` at the memory read: (output, foreign [B, max_blocks] bool).

    slot_tags: [n_pages, page_size] int64 last-writer tag of each slot (`KVPool.writer_tags`);
    reader_tags: [B] int64 (`KVPool.tag_of`). `foreign` equals `attention.foreign_pages(slot_tags,
    reader_tags, block_tables, seq_lens, page_size)`, computed by the kernel from the tag it
    reads beside each token's K/V.
    """
    tags = (slot_tags, reader_tags)
    run = decode(q, k_cache, v_cache, block_tables, seq_lens, *tags, num_splits=num_splits, tiles=tiles)
    assert run.foreign is not None
    return run.out, run.foreign


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Causal attention of one request's new tokens at positions ``start .. start+T-1``.

    q: [T, n_heads, head_dim]; keys of positions ``0 .. start+T-1`` are read from the pages of
    `block_table` (this chunk's keys must already be written). Returns [T, n_heads, head_dim].
    """
    _check(q, k_cache, v_cache)
    t, n_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if start + t > block_table.shape[0] * page_size:
        raise ValueError(
            f"positions up to {start + t - 1} need {triton.cdiv(start + t, page_size)} pages, "
            f"block table has {block_table.shape[0]}"
        )
    out = torch.empty_like(q)
    if t == 0:
        return out
    tiles = tiles or Tiles.default(q.device, q.dtype)
    group = n_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(tiles.block_m, group_pad)  # at least one token of every head of the group
    _prefill_kernel[(triton.cdiv(t, block_m // group_pad), kv_heads)](
        q,
        k_cache,
        v_cache,
        block_table.contiguous(),
        out,
        math.log2(math.e) / math.sqrt(head_dim),
        start,
        t,
        page_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_D=_pow2(head_dim),
        BLOCK_N=tiles.block_n,
        PRECISION=_precision(q),
        num_warps=tiles.num_warps,
    )
    return out


# -- for the kernel lab --------------------------------------------------------------------------
def kernel_reads(
    pool: KVPool,
    block_tables: list[list[int]],
    seq_lens: list[int],
    readers: list[str],
    layer: int = 0,
    num_splits: int = 1,
) -> list[dict[str, Any]]:
    """Run the owner-checked decode kernel over `pool`'s pages and say what each program read.

    One row per (request, kv head, block) that a program read: the program's grid index
    (request, kv head, split), the page the block table sent it to, who wrote the slots it read
    there (`slot_writers`: request -> slots, from the pool's slot tags; `last_writer` and
    `last_writer_tenant`: the other request that wrote most of them, or the reader when none
    did), and whether the kernel's owner-check flagged it. The query is random: which pages are
    read does not depend on it, only on the block table and the length.
    """
    device = pool.k.device
    mc = pool.model_cfg
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in block_tables], device=device)
    lens = torch.tensor(seq_lens, device=device)
    q = torch.randn(len(readers), mc.n_heads, mc.head_dim, generator=torch.Generator().manual_seed(0))
    reader_tags = torch.tensor([pool.tag_of(r) for r in readers], device=device)
    run = decode(
        q.to(device, pool.k.dtype),
        pool.k[layer],
        pool.v[layer],
        table,
        lens,
        pool.writer_tags,
        reader_tags,
        num_splits=num_splits,
        record=True,
    )
    assert run.pages_read is not None and run.foreign is not None
    rows = []
    for b, reader in enumerate(readers):
        for kv_head in range(mc.n_kv_heads):
            for block, page in enumerate(run.pages_read[b, kv_head].tolist()):
                if page < 0:
                    continue  # past the request's length: never read
                read = min(pool.page_size, seq_lens[b] - block * pool.page_size)
                writers = pool.slot_writers(page, read)
                others = [w for w in writers if w[0] != reader]
                writer, tenant = max(others, key=writers.__getitem__) if others else next(iter(writers))
                rows.append(
                    {
                        "request": reader,
                        "program": (b, kv_head, block // run.pages_per_split),
                        "kv_head": kv_head,
                        "block": block,
                        "page": page,
                        "slot_writers": {w[0]: n for w, n in writers.items()},
                        "last_writer": writer,
                        "last_writer_tenant": tenant,
                        "flagged": bool(run.foreign[b, block]),
                    }
                )
    return rows
