"""Paged attention equals attention over the contiguous sequence, for any block table."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigrid_engine import attention


def _scatter(keys, vals, page: int, n_pages: int, gen: torch.Generator):
    """Place each request's [L, KH, D] k/v into random distinct pages; loud junk everywhere else."""
    kh, d = keys[0].shape[1:]
    k_cache = torch.randn(n_pages, page, kh, d, generator=gen) * 100
    v_cache = torch.randn(n_pages, page, kh, d, generator=gen) * 100
    free = torch.randperm(n_pages, generator=gen).tolist()
    tables = []
    for k, v in zip(keys, vals):
        need = -(-k.shape[0] // page)
        pages, free = free[:need], free[need:]
        slots = attention.slot_ids(torch.tensor(pages), torch.arange(k.shape[0]), page)
        attention.write_kv(k_cache, v_cache, slots, k, v)
        tables.append(pages)
    return k_cache, v_cache, tables


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    page=st.sampled_from([1, 2, 4, 8, 16, 32]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_matches_contiguous(lens, page, kv_heads, group, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    d = 8
    keys = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    vals = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    n_pages = sum(-(-n // page) for n in lens) + 3
    k_cache, v_cache, tables = _scatter(keys, vals, page, n_pages, gen)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen)
    out = attention.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lens))
    for b, n in enumerate(lens):
        ref = attention.contiguous_attention(q[b : b + 1], keys[b], vals[b], q_start=n - 1)
        torch.testing.assert_close(out[b], ref[0], atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 90),
    start_frac=st.floats(0, 0.9),
    page=st.sampled_from([1, 4, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_paged_prefill_matches_contiguous(n, start_frac, page, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    kh, h, d = 2, 4, 8
    keys, vals = torch.randn(n, kh, d, generator=gen), torch.randn(n, kh, d, generator=gen)
    n_pages = -(-n // page) + 4
    table = torch.randperm(n_pages, generator=gen)[: -(-n // page)]
    k_cache = torch.randn(n_pages, page, kh, d, generator=gen) * 100
    v_cache = torch.randn(n_pages, page, kh, d, generator=gen) * 100
    attention.write_kv(k_cache, v_cache, attention.slot_ids(table, torch.arange(n), page), keys, vals)
    start = int(start_frac * n)
    q = torch.randn(n - start, h, d, generator=gen)
    out = attention.paged_prefill_attention(q, k_cache, v_cache, table, start)
    ref = attention.contiguous_attention(q, keys, vals, q_start=start)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_owner_check_flags_a_page_for_any_foreign_slot_it_reads_and_none_it_does_not() -> None:
    """Per slot: a page whose first slot the reader wrote (a stub) is flagged for the slots after
    it; a foreign slot past the read length is not."""
    me, other = 1, 2
    tags = torch.full((3, 4), me)  # 3 pages of 4 slots, all the reader's ...
    tags[2, 3] = other  # ... but the last slot of page 2, read (position 3)
    tags[0, 2] = other  # ... and slot 2 of page 0, at position 6: past the length
    table, lens = torch.tensor([[2, 0], [1, 0]]), torch.tensor([6, 4])
    flags = attention.foreign_pages(tags, torch.tensor([me, me]), table, lens, 4)
    assert flags.tolist() == [[True, False], [False, False]]  # request 2 reads page 1 only
    assert attention.foreign_pages(tags, torch.tensor([other, me]), table, lens, 4).tolist() == [
        [True, True],
        [False, False],
    ]
