"""The KV pool: reservation, release, reuse order, integrity, and clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minigrid_engine.errors import ConfigError, PoolError, PoolExhausted
from minigrid_engine.model import ModelConfig
from minigrid_engine.pool import KVPool, PoolConfig

MODEL = ModelConfig()


def make_pool(tokens: int = 1024, page: int = 128) -> KVPool:
    return KVPool(PoolConfig(tokens, page), MODEL)


def test_reserve_gives_whole_pages_and_release_returns_them() -> None:
    pool = make_pool(1024, 128)
    res = pool.reserve("a", "alice", 300)
    assert len(res.pages) == 3 and len(set(res.pages)) == 3
    assert pool.pages_in_use == 3 and pool.tokens_reserved == 300
    pool.check_integrity()
    assert pool.release("a") == res.pages
    assert pool.pages_in_use == 0 and pool.tokens_reserved == 0
    pool.check_integrity()


def test_recently_freed_pages_are_handed_out_first_in_the_same_order() -> None:
    pool = make_pool(2048, 128)
    pool.reserve("old", "x", 128 * 4)
    a = pool.reserve("a", "alice", 128 * 3).pages
    pool.release("a")
    b = pool.reserve("b", "bob", 128 * 3).pages
    assert b == a  # bob's block table is alice's, page for page
    assert all(pool.pages[p].last_writer is None for p in b)  # nothing written yet in this test


def test_freed_pages_are_not_zeroed() -> None:
    pool = make_pool(256, 128)
    res = pool.reserve("a", "alice", 128)
    pool.k[:, res.pages[0]] = 7.0
    pool.note_write("a", "alice", res.pages)
    pool.release("a")
    again = pool.reserve("b", "bob", 128)
    assert again.pages == res.pages
    assert torch.all(pool.k[:, again.pages[0]] == 7.0)
    info = pool.snapshot()[again.pages[0]]
    assert info["owner"] == "b" and info["last_writer"] == "a" and info["stale"]


def test_exhaustion_names_the_numbers() -> None:
    pool = make_pool(512, 128)
    pool.reserve("a", "alice", 300)
    with pytest.raises(PoolExhausted, match=r"300 tokens \(3 pages\) requested, 1 of 4 pages free"):
        pool.reserve("b", "bob", 300)
    pool.check_integrity()


def test_token_budget_that_is_not_whole_pages() -> None:
    # The incident's prefill pool: 665 tokens at 128 a page is 5.2 pages.
    pool = make_pool(665, 128)
    assert pool.n_pages == 6 and pool.capacity_tokens == 665
    assert pool.can_reserve(665) and not pool.can_reserve(666)
    pool.reserve("a", "alice", 600)
    assert not pool.can_reserve(128)  # a page is free but only 65 tokens of budget are left
    assert pool.can_reserve(65)


def test_double_release_and_foreign_release_are_refused() -> None:
    pool = make_pool(1024, 128)
    a = pool.reserve("a", "alice", 256)
    pool.reserve("b", "bob", 128)
    with pytest.raises(PoolError, match=r"cannot release page .* owned by a"):
        pool.release_pages("b", [a.pages[0]])
    pool.release("a")
    with pytest.raises(PoolError, match="holds no pages"):
        pool.release("a")
    with pytest.raises(PoolError, match="already free"):
        pool.release_pages("b", [a.pages[0]])
    pool.check_integrity()


def test_grow_adds_pages_only_when_needed() -> None:
    pool = make_pool(1024, 128)
    res = pool.reserve("a", "alice", 100)
    pool.grow("a", 128)
    assert len(res.pages) == 1
    pool.grow("a", 129)
    assert len(res.pages) == 2 and pool.tokens_reserved == 129
    pool.check_integrity()


def test_grow_takes_the_last_page_and_the_last_token_and_no_more() -> None:
    pool = make_pool(665, 128)  # 6 pages, 665 tokens
    pool.reserve("a", "alice", 10)
    pool.grow("a", 665)
    assert pool.free_pages == 0 and pool.tokens_reserved == 665
    with pytest.raises(PoolExhausted, match="1 tokens"):
        pool.grow("a", 666)
    pool.check_integrity()


def _held_twice(pool: KVPool) -> None:
    pool._held["b"].pages.append(pool._held["a"].pages[0])


def _free_and_held(pool: KVPool) -> None:
    pool._free.append(pool._held["a"].pages[0])


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda pool: pool._free.append(pool._free[-1]), "a page appears twice in the free list"),
        (_held_twice, r"held by a and b"),
        (_free_and_held, r"is free and held by a"),
        (lambda pool: setattr(pool.pages[pool._held["a"].pages[1]], "owner", "b"), "owner table says b"),
        (lambda pool: pool._free.pop(), r"4 free \+ 3 owned != 8 pages"),
        (lambda pool: setattr(pool.pages[pool._free[0]], "owner", "ghost"), "free page .* names owner ghost"),
        (lambda pool: setattr(pool, "_tokens_reserved", 300), "token count 300 disagrees"),
    ],
)
def test_integrity_check_names_each_broken_invariant(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    """`check_integrity` is what every pool test, the fuzz campaign and the fault campaign lean on:
    each way the bookkeeping can break must make it fail, naming what broke."""
    pool = make_pool(1024, 128)
    pool.reserve("a", "alice", 200)
    pool.reserve("b", "bob", 10)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(PoolError, match=message):
        pool.check_integrity()


def test_release_refuses_when_the_owner_table_disagrees() -> None:
    pool = make_pool(1024, 128)
    a = pool.reserve("a", "alice", 200)
    pool.reserve("b", "bob", 10)
    pool.pages[a.pages[0]].owner = "b"
    with pytest.raises(PoolError, match=f"page {a.pages[0]} is owned by b, not a"):
        pool.release("a")


@pytest.mark.parametrize(("end", "written"), [(300, 3), (256, 2), (257, 3), (1, 1)])
def test_a_prefill_span_names_its_writer_on_every_page_it_touched(end: int, written: int) -> None:
    pool = make_pool(1024, 128)
    old = pool.reserve("old", "carol", 128 * 3)
    pool.note_write("old", "carol", old.pages)
    pool.release("old")
    new = pool.reserve("a", "alice", 128 * 3)
    assert new.pages == old.pages
    pool.note_span("a", "alice", new.pages, 0, end)
    writers = [pool.pages[p].last_writer for p in new.pages]
    assert writers == ["a"] * written + ["old"] * (3 - written)


@pytest.mark.parametrize(
    ("tokens", "page", "message"),
    [
        (100, 128, "capacity_tokens 100 is smaller than one page of page_size 128 tokens"),
        (1024, 0, "page_size 0: between 1 and 4096 tokens per page"),
        ("1024", 128, "capacity_tokens must be a whole number, got '1024'"),
    ],
)
def test_bad_pool_config(tokens: object, page: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PoolConfig(tokens, page)  # type: ignore[arg-type]


def test_memory_budget_states_bytes_per_token() -> None:
    per_token = MODEL.kv_bytes_per_token()
    assert per_token == 2 * MODEL.n_layers * MODEL.n_kv_heads * MODEL.head_dim * 4
    cfg = PoolConfig.from_memory_budget(per_token * 128 * 5 + 17, 128, MODEL)
    assert cfg.capacity_tokens == 640 and cfg.n_pages == 5
    with pytest.raises(ConfigError, match="smaller than one page"):
        PoolConfig.from_memory_budget(per_token * 10, 128, MODEL)


class PoolMachine(RuleBasedStateMachine):
    """Random reserve / grow / release sequences; integrity after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(16 * 8 - 5, 8)  # 16 pages, a budget 5 tokens short of them: both limits bind
        self.live: dict[str, int] = {}
        self.n = 0

    @rule(tokens=st.integers(1, 64))
    def reserve(self, tokens: int) -> None:
        name = f"r{self.n}"
        self.n += 1
        fits = -(-tokens // 8) <= self.pool.free_pages and sum(self.live.values()) + tokens <= 16 * 8 - 5
        assert self.pool.can_reserve(tokens) == fits
        if fits:
            res = self.pool.reserve(name, "t", tokens)
            assert len(res.pages) == -(-tokens // 8)
            self.live[name] = tokens
        else:
            with pytest.raises(PoolExhausted):
                self.pool.reserve(name, "t", tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(1, 32))
    def grow(self, data: st.DataObject, extra: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        want = self.live[name] + extra
        new_pages = -(-want // 8) - len(self.pool.reservation(name).pages)
        if new_pages <= self.pool.free_pages and sum(self.live.values()) + extra <= 16 * 8 - 5:
            self.pool.grow(name, want)  # fits, to the last page and the last token
            self.live[name] = want
            assert len(self.pool.reservation(name).pages) == -(-want // 8)
        else:
            with pytest.raises(PoolExhausted):
                self.pool.grow(name, want)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.release(name)
        del self.live[name]
        with pytest.raises(PoolError):
            self.pool.release(name)

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()
        held = [p for r in self.live for p in self.pool.reservation(r).pages]
        assert len(held) == len(set(held)), "a page handed out twice"
        assert self.pool.tokens_reserved == sum(self.live.values())


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_writer_tags_are_per_slot_a_stub_leaves_the_rest_of_its_page_stale() -> None:
    pool = make_pool(512, 128)
    alice = pool.reserve("a", "alice", 300)
    pool.note_span("a", "alice", alice.pages, 0, 300)  # a prefill of 300 tokens
    assert pool.slot_writers(alice.pages[2]) == {("a", "alice"): 44, (None, None): 84}
    pool.release("a")
    bob = pool.reserve("b", "bob", 300)
    assert bob.pages == alice.pages
    pool.note_span("b", "bob", bob.pages, 0, 1)  # the one-token stub: slot 0 only
    assert pool.slot_writers(bob.pages[0]) == {("b", "bob"): 1, ("a", "alice"): 127}
    assert pool.slot_writers(bob.pages[0], 1) == {("b", "bob"): 1}
    pool.note_writes([("b", "bob", bob.pages[2], 44)])  # a decode token after alice's 44
    assert pool.slot_writers(bob.pages[2], 45) == {("a", "alice"): 44, ("b", "bob"): 1}
    pool.note_write("b", "bob", [bob.pages[1]])  # a transfer: the whole page
    assert pool.slot_writers(bob.pages[1]) == {("b", "bob"): 128}
    pool.scrub([bob.pages[0]])
    assert pool.slot_writers(bob.pages[0]) == {(None, None): 128}


def test_a_page_checksum_covers_k_and_v_of_every_layer_and_only_its_page() -> None:
    """`kv-checksum` compares these: a change to one value of one page, in K or V, in any layer or
    slot, must change that page's checksum and no other page's."""
    from minigrid_engine.transfer import page_checksums

    pool = make_pool(512, 16)
    pool.k.copy_(torch.randn_like(pool.k))
    pool.v.copy_(torch.randn_like(pool.v))
    pages = [3, 0, 7]
    before = page_checksums(pool, pages)
    assert len(set(before)) == 3
    for tensor in (pool.k, pool.v):
        for layer in range(MODEL.n_layers):
            for i, page in enumerate(pages):
                slot = (layer * 5 + i) % pool.page_size
                kept = tensor[layer, page, slot, -1, -1].item()
                tensor[layer, page, slot, -1, -1] = kept + 1.0
                after = page_checksums(pool, pages)
                assert after[i] != before[i] and [a for j, a in enumerate(after) if j != i] == [
                    b for j, b in enumerate(before) if j != i
                ], (layer, page, slot)
                tensor[layer, page, slot, -1, -1] = kept
                assert page_checksums(pool, pages) == before
