"""The two schedulers wired in one process: the protocol's outcomes without sockets."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from minigrid_engine.config import corrected_preset, incident_preset
from minigrid_engine.engine import Engine
from minigrid_engine.fixes import parse_fixes
from minigrid_engine.handle import pages_read
from minigrid_engine.inprocess import InProcessCluster
from minigrid_engine.messages import AbortAck, TransferBegin
from minigrid_engine.model import load_model
from minigrid_engine.pool import PoolConfig
from minigrid_engine.records import record_prompt


@pytest.fixture(scope="module")
def model():
    return load_model()


def assert_pools_whole(cluster: InProcessCluster) -> None:
    """Both pools intact, every page back."""
    for pool in (cluster.prefill_pool, cluster.decode_pool):
        pool.check_integrity()
        assert pool.pages_in_use == 0


def incident(cluster: InProcessCluster, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(2):
        cluster.submit("alice", record_prompt("alice", 574, rng, 8), 24)
    cluster.run()
    return cluster.complete("bob", record_prompt("bob", 1000, rng, 10), 24)


def test_faulty_protocol_reads_seven_stale_pages(model) -> None:
    c = InProcessCluster(incident_preset(), model)
    r = incident(c)
    assert r.status == 200 and r.prompt_tokens == 1000
    events = [e.to_dict() for e in c.decode_pool.trace.events()]
    writers = [p["last_writer_tenant"] for p in pages_read(events, r.request_id)]
    assert writers.count("alice") == 7 and writers.count("bob") == 1
    assert_pools_whole(c)


def test_rejection_reserves_nothing_in_either_pool(model) -> None:
    c = InProcessCluster(incident_preset(fixes="reject-before-transfer"), model)
    r = incident(c)
    assert r.status == 400 and r.code == "context_length_exceeded"
    bob_reserves = [
        e
        for pool in (c.prefill_pool, c.decode_pool)
        for e in pool.trace.events(kind="reserve")
        if e.tenant == "bob"
    ]
    assert not bob_reserves


@pytest.mark.parametrize("fixes", ["none", "reject-before-transfer,coverage-check,owner-check"])
def test_a_request_larger_than_the_decode_pool_is_refused_and_the_queue_goes_on(model, fixes: str) -> None:
    c = InProcessCluster(incident_preset(fixes=fixes, decode_pool_tokens=512), model)
    rng = random.Random(3)
    big = c.submit("alice", record_prompt("alice", 600, rng, 8), 24)
    small = c.submit("bob", record_prompt("bob", 200, rng, 4), 8)
    c.run()
    r = c.results[big]
    assert r.status == 400 and r.code == "context_length_exceeded"
    assert "624 tokens of decode KV (600 prompt + 24 max_tokens)" in (r.error or "")
    assert "decode KV pool of 512 tokens" in (r.error or "")
    assert c.results[small].status == 200 and len(c.results[small].output_ids) > 0
    assert_pools_whole(c)


def test_a_seed_samples_the_same_text_in_both_engines_and_every_bit_of_it_counts(model) -> None:
    cluster = InProcessCluster(corrected_preset(), model)
    single = Engine(model=model, pool=PoolConfig(2048, 128), context_length=1024)
    prompt = "alice: the quarterly numbers are"

    def disaggregated(seed: int) -> list[int]:
        return cluster.complete("alice", prompt, 24, temperature=1.5, seed=seed).output_ids

    def one_process(seed: int) -> list[int]:
        req = single.submit("alice", prompt, 24, temperature=1.5, seed=seed)
        single.run()
        return req.output_ids

    for seed in (7, 2**40 + 7, -(2**63)):
        assert disaggregated(seed) == disaggregated(seed) == one_process(seed)
    # torch keeps only a seed's low 32 bits: seeds that differ above them must still differ
    assert len({tuple(disaggregated(s)) for s in (5, 5 + 2**32, 5 + 2**33, 5 - 2**32)}) == 4


# -- coverage-check and deferred-release on what the wire delivers (InProcessCluster.on_the_wire) --


def cut_last_page(begin: TransferBegin, data: torch.Tensor) -> tuple[TransferBegin, torch.Tensor]:
    return replace(begin, dst_pages=begin.dst_pages[:-1]), data[:, :, :-1]


@pytest.mark.parametrize("fixes", ["none", "coverage-check"])
def test_a_page_lost_on_the_wire_is_caught_by_coverage_check(model, fixes: str) -> None:
    c = InProcessCluster(corrected_preset(fixes=fixes), model)
    c.on_the_wire = cut_last_page
    r = c.complete("alice", record_prompt("alice", 600, random.Random(1), 8), 8)  # 5 pages of 128
    if fixes == "none":  # the faulty engine commits: its last prompt page was never written
        assert r.status == 200
    else:
        assert r.status == 502 and r.code == "kv_coverage_mismatch"
        assert "page data for only 4 of 5 prompt pages had arrived" in (r.error or "")
    assert_pools_whole(c)


@pytest.mark.parametrize("fixes", ["none", "coverage-check"])
def test_page_data_named_for_pages_the_room_does_not_hold_is_written_nowhere(model, fixes: str) -> None:
    c = InProcessCluster(corrected_preset(fixes=fixes), model)
    victim = c.decode_pool.n_pages - 1  # a page no request holds in this run
    before = c.decode_pool.k[:, victim].clone()

    def redirect(begin: TransferBegin, data: torch.Tensor) -> tuple[TransferBegin, torch.Tensor]:
        assert victim not in begin.dst_pages
        return replace(begin, dst_pages=[victim, *begin.dst_pages[1:]]), data

    c.on_the_wire = redirect
    r = c.complete("alice", record_prompt("alice", 300, random.Random(2), 8), 8)
    written = not torch.equal(c.decode_pool.k[:, victim], before)
    if fixes == "none":
        assert written  # the faulty engine writes wherever the message says
    else:
        assert r.status == 502 and r.code == "kv_transfer_bad_pages", r
        assert not written
        (dropped,) = c.decode_pool.trace.events(kind="dropped")
        assert dropped.pages[0] == victim
    assert_pools_whole(c)


def test_decode_checking_coverage_refuses_a_prefill_that_states_no_kv_length(model) -> None:
    """Two hosts at different versions, or a switch half done: decode has `coverage-check`,
    prefill does not, so its done message says nothing of how much KV it wrote."""
    c = InProcessCluster(corrected_preset(fixes="coverage-check"), model)
    c.prefill.fixes = parse_fixes("none")
    r = c.complete("alice", record_prompt("alice", 300, random.Random(3), 8), 8)
    assert r.status != 200 and r.code == "kv_coverage_mismatch"
    assert "prefill states no KV length (its coverage-check is off), decode preallocated 300" in (
        r.error or ""
    )


@pytest.mark.parametrize("fixes", ["none", "deferred-release"])
def test_late_page_data_for_a_room_that_holds_no_pages(model, fixes: str) -> None:
    c = InProcessCluster(corrected_preset(fixes=fixes), model)
    pool = c.decode_pool
    shape = (2, pool.k.shape[0], 1, *pool.k.shape[2:])
    before = pool.k[:, 0].clone()
    c.decode.on_transfer_begin(TransferBegin(999, [0]), torch.ones(shape))  # room 999: long gone
    writes = [e for e in pool.trace.events(kind="write") if list(e.pages) == [0]]
    if fixes == "none":
        assert writes and not torch.equal(pool.k[:, 0], before)
    else:
        assert not writes and torch.equal(pool.k[:, 0], before)
        (dropped,) = pool.trace.events(kind="dropped")
        assert list(dropped.pages) == [0]


@pytest.mark.parametrize(("length", "stubbed"), [(665, False), (666, True)])
def test_a_prompt_exactly_the_prefill_pool_is_prefilled_one_token_more_is_stubbed(
    model, length: int, stubbed: bool
) -> None:
    c = InProcessCluster(incident_preset(), model)
    rng = random.Random(5)
    for _ in range(2):  # pages for the stub to find
        c.submit("alice", record_prompt("alice", 574, rng, 8), 8)
    c.run()
    r = c.complete("bob", record_prompt("bob", length, rng, 8), 8)
    assert r.status == 200 and r.prompt_tokens == length
    events = [e.to_dict() for e in c.decode_pool.trace.events()]
    writers = [p["last_writer_tenant"] for p in pages_read(events, r.request_id)]
    assert len(writers) == 6 and ("alice" in writers) == stubbed, writers  # stubbed: stale pages read


@pytest.mark.parametrize("fixes", ["coverage-check", "coverage-check,deferred-release"])
def test_a_failed_transfers_pages_wait_for_prefills_word_under_deferred_release(model, fixes: str) -> None:
    """Decode fails a transfer whose page data never came. The faulty engine frees the pages at
    once (late data could still land in them); `deferred-release` keeps them until prefill
    acknowledges that nothing more is coming for the room."""
    c = InProcessCluster(corrected_preset(fixes=fixes), model)
    c.on_the_wire = lambda begin, data: None  # the page data is lost
    held_when_acknowledged: list[int] = []
    acknowledge = c.decode.on_abort_ack

    def on_abort_ack(msg: AbortAck) -> None:
        held_when_acknowledged.append(c.decode_pool.pages_in_use)
        acknowledge(msg)

    c.decode.on_abort_ack = on_abort_ack  # type: ignore[method-assign]
    r = c.complete("alice", record_prompt("alice", 300, random.Random(4), 8), 8)
    assert r.status == 502 and r.code == "kv_coverage_mismatch", r
    if "deferred-release" in fixes:
        assert held_when_acknowledged == [3]  # 308 tokens of decode KV, quarantined until then
    else:
        assert held_when_acknowledged == []
    assert_pools_whole(c)


@pytest.mark.parametrize("cancel", ["arrives", "lost"])
def test_a_transfer_past_its_deadline_is_never_started_even_when_decodes_cancel_is_lost(
    model, cancel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`deferred-release` has two guards against late page data: decode's cancel, and prefill's own
    deadline on each transfer (the release timeout). With the cancel lost, the deadline alone holds:
    a transfer held past it sends a failed done message, never its data."""
    monkeypatch.setenv("MINIGRID_FAULT_INJECTION", "1")
    cfg = corrected_preset(fixes="deferred-release", inject=("delay-transfer=0.4",), release_timeout_s=0.1)
    c = InProcessCluster(cfg, model)
    if cancel == "lost":
        on_abort = c.prefill.on_abort
        c.prefill.on_abort = lambda msg: None if msg.source == "decode" else on_abort(msg)  # type: ignore[method-assign]
    sent: list[int] = []

    def wire(begin: TransferBegin, data: torch.Tensor) -> tuple[TransferBegin, torch.Tensor]:
        sent.append(begin.room)
        return begin, data

    c.on_the_wire = wire
    r = c.complete("alice", record_prompt("alice", 300, random.Random(6), 8), 8)  # waits out the hold
    assert r.status == 504 and r.code == "kv_transfer_timeout", r
    assert sent == []  # the held transfer came due after its deadline: no page data went out
    held = [e for e in c.prefill_pool.trace.events() if e.kind == "fault"]
    assert len(held) == 1  # the injected delay did hold the transfer
    assert_pools_whole(c)
