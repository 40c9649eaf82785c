"""Attention math: contiguous causal attention (training, reference) and paged attention (torch).

Paged attention reads K/V only through a block table: logical token ``i`` of a request lives in
page ``block_table[i // page_size]`` at offset ``i % page_size``. The functions trust the block
table completely; they have no idea who wrote a page. That trust is the incident.

Cache layout, one layer: ``[n_pages, page_size, n_kv_heads, head_dim]``. Keys are stored already
rotated to their positions.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


class CausalAttention:
    """Attention backend over contiguous [B, T] sequences with a causal mask (training)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return out.transpose(1, 2)


class MaskedAttention:
    """Attention backend over contiguous sequences with an explicit mask (training).

    `allowed` [B, T, T] bool: query i may read key j. Several documents laid side by side, each
    causal within itself, and a tail that reads some of them: what decode sees when its block
    table holds pages that other requests wrote in their own passes.
    """

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed[:, None]  # broadcast over heads

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.allowed, enable_gqa=True
        )
        return out.transpose(1, 2)


def slot_ids(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat slot index (page * page_size + offset) of each logical position."""
    return block_table[positions // page_size] * page_size + positions % page_size


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store k, v [N, n_kv_heads, head_dim] at flat `slots` [N] of one layer's cache."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim)[slots] = k
    v_cache.view(-1, kv_heads, head_dim)[slots] = v


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, n_blocks] page ids -> [B, n_blocks * page_size, n_kv_heads, head_dim] in logical order."""
    b, n = block_tables.shape
    # index_select copies whole pages in one pass (about 1.6x faster than advanced indexing on CPU)
    pages = cache.index_select(0, block_tables.reshape(-1))
    return pages.view(b, n * cache.shape[1], *cache.shape[2:])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """One query token per request over its first `seq_lens[b]` cached tokens.

    q: [B, n_heads, head_dim]; block_tables: [B, max_blocks] (padding entries are masked out);
    seq_lens: [B]. Returns [B, n_heads, head_dim].
    """
    keys = gather_pages(k_cache, block_tables)  # [B, L, KH, D]
    values = gather_pages(v_cache, block_tables)
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        enable_gqa=True,
    )
    return out[:, :, 0, :]


def foreign_pages(
    slot_tags: torch.Tensor,
    reader_tags: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """The `owner-check` at the memory read: [B, max_blocks] True where a page about to be read
    holds a slot, among those read, last written by someone other than the reader.

    slot_tags: [n_pages, page_size], the writer of each slot (`KVPool.writer_tags`), read beside
    the K/V through the same block table. Per slot: a page whose first slot the reader wrote (a
    one-token stub) is still flagged when it reads the slots after it. Padding is never flagged."""
    tags = slot_tags[block_tables]  # [B, max_blocks, page_size]
    blocks = torch.arange(block_tables.shape[1], device=block_tables.device)
    positions = blocks[:, None] * page_size + torch.arange(page_size, device=block_tables.device)[None, :]
    read = positions[None] < seq_lens[:, None, None]
    return ((tags != reader_tags[:, None, None]) & read).any(dim=-1)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Causal attention of one request's new tokens at positions ``start .. start+T-1``.

    q: [T, n_heads, head_dim]; the keys of positions ``0 .. start+T-1`` are read from the pages
    of `block_table` (this chunk's keys must already be written). Returns [T, n_heads, head_dim].
    """
    total = start + q.shape[0]
    keys = gather_pages(k_cache, block_table[None])[0, :total]
    values = gather_pages(v_cache, block_table[None])[0, :total]
    return contiguous_attention(q, keys, values, start)


def contiguous_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int
) -> torch.Tensor:
    """Reference: causal attention of q [T, H, D] at positions q_start.. over keys/values [L, KH, D]."""
    t, total = q.shape[0], keys.shape[0]
    q_pos = torch.arange(q_start, q_start + t, device=q.device)
    causal = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=causal[None, None],
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
