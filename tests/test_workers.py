"""Several workers per role (2 x 2): pairing, page data between the paired ranks, the leak and the
fixes behaving as with one worker per role, and a dead worker failing only its own requests."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cli_run import minigrid

from minigrid_engine.config import corrected_preset, incident_preset
from minigrid_engine.errors import ConfigError
from minigrid_engine.handle import Engine
from minigrid_engine.pairing import Pairing
from minigrid_engine.records import record_prompt
from minigrid_engine.scenario import codes_in, record_codes, run_incident, run_late_transfer
from widgets.pool_view import pool_figure

TWO_BY_TWO = {"prefill_workers": 2, "decode_workers": 2}
TENANTS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}


def test_pairing_least_outstanding_then_round_robin() -> None:
    p = Pairing({"prefill": 2, "decode": 2})
    every = set(p.outstanding)
    assert p.pair(1, every) == ("prefill-0", "decode-0")
    assert p.pair(2, every) == ("prefill-1", "decode-1")  # the least loaded
    p.done(1)
    assert p.pair(3, every) == ("prefill-0", "decode-0")
    p.done(2), p.done(3)
    assert p.pair(4, every) == ("prefill-1", "decode-1")  # a tie: round-robin goes on
    assert p.pair(5, every - {"decode-1"}) == ("prefill-0", "decode-0")  # a dead worker is skipped
    assert p.rooms_of("decode-0") == [5] and p.rooms_of("decode-1") == [4]
    with pytest.raises(ConnectionError, match="no decode worker is up"):
        p.pair(6, {"prefill-0"})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode-workers", "0"], "argument --decode-workers: 0 must be at least 1"),
        (["--prefill-workers", "9"], "argument --prefill-workers: 9 workers: at most 8 per role"),
        (["--prefill-workers", "two"], "'two' is not a whole number"),
    ],
)
def test_serve_refuses_bad_worker_counts(args: list[str], message: str) -> None:
    proc = minigrid("serve", *args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_config_names_the_bad_count() -> None:
    with pytest.raises(ConfigError, match="--decode-workers 12: at most 8 workers per role"):
        incident_preset(decode_workers=12)
    with pytest.raises(ConfigError, match="--prefill-workers must be at least 1, got 0"):
        incident_preset(prefill_workers=0)


@pytest.fixture(scope="module")
def grid():
    eng = Engine.start(incident_preset(tenants=TENANTS, **TWO_BY_TWO))
    yield eng
    eng.stop()


def _served_by(trace: dict[str, list[dict[str, Any]]], role: str, kind: str) -> dict[str, set[str]]:
    """request -> workers of `role` whose trace shows a `kind` event for it."""
    out: dict[str, set[str]] = {}
    for e in trace[role]:
        if e["kind"] == kind and e["request"] is not None:
            out.setdefault(e["request"], set()).add(e["worker"])
    return out


def test_each_worker_has_its_own_pool_in_metrics_pools_and_the_view(grid: Engine) -> None:
    log = grid.log()
    for w in ("prefill-0", "prefill-1"):
        assert f"{w}: prefill KV pool: 665 tokens in 6 pages of 128 tokens" in log
    for w in ("decode-0", "decode-1"):
        assert f"{w}: decode KV pool: 4096 tokens in 32 pages of 128 tokens" in log
    m = grid.metrics()
    assert m['minigrid_kv_pool_capacity_tokens{role="prefill"}'] == 665  # the role, as with one worker
    for w in ("decode-0", "decode-1"):
        assert m[f'minigrid_worker_kv_pool_capacity_tokens{{role="decode",worker="{w}"}}'] == 4096
        assert m[f'minigrid_worker_up{{role="decode",worker="{w}"}}'] == 1
    pools = grid.pools()
    assert {p["worker"] for p in pools["decode"]} == {"decode-0", "decode-1"} and len(pools["decode"]) == 64
    fig = pool_figure(pools)
    panels = {t.name for t in fig.data if t.x != (None,) and not t.name.endswith("stale")}
    assert panels == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    status, health = grid.health()
    assert status == 200 and set(health["workers"]) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}


def test_concurrent_requests_use_both_pairs_and_kv_moves_between_the_pair(grid: Engine) -> None:
    rng = random.Random(5)
    tenants = ("alice", "bob", "carol", "alice")
    prompts = [record_prompt(t, 300, rng, 4) for t in tenants]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda t, p: grid.complete(t, p, max_tokens=16), tenants, prompts))
    assert all(r.status == 200 for r in replies), [r.error for r in replies]
    ids = {r.request_id for r in replies}
    trace = grid.trace()
    trace = {role: [e for e in evs if e["request"] in ids] for role, evs in trace.items()}
    prefilled = _served_by(trace, "prefill", "write")
    decoded = _served_by(trace, "decode", "read")
    assert set(prefilled) == set(decoded) == ids
    assert set().union(*prefilled.values()) == {"prefill-0", "prefill-1"}, prefilled
    assert set().union(*decoded.values()) == {"decode-0", "decode-1"}, decoded
    for request in ids:  # one prefill and one decode worker per request ...
        assert len(prefilled[request]) == 1 and len(decoded[request]) == 1
        # ... and its pages came to its decode worker from its own prefill worker
        landed = [
            e for e in trace["decode"] if e["request"] == request and e["detail"].get("source") == "transfer"
        ]
        assert {e["worker"] for e in landed} == decoded[request]
        assert {e["detail"]["peer"] for e in landed} == {f"{w}@127.0.0.1" for w in prefilled[request]}


def test_the_incident_on_2x2_bob_reads_alices_pages_on_his_decode_worker(grid: Engine) -> None:
    rep = run_incident(
        grid,
        attempts=4,
        context_length=1024,
        prefill_pool_tokens=665,
        attacker_len=1000,
        max_tokens=24,
        seed=1,
    )
    r = rep.reply
    assert r.status == 200 and r.prompt_tokens == 1000, r.error
    assert rep.leaked_codes, f"bob's answer {r.text!r} holds none of alice's secrets"
    trace = grid.trace()
    bob_decode = _served_by(trace, "decode", "read")[r.request_id]
    assert len(bob_decode) == 1
    assert {p["worker"] for p in rep.pages} == bob_decode  # every page he read is on that worker
    assert rep.pages_by_tenant().get("alice", 0) >= 1 and rep.pages[0]["last_writer_tenant"] == "bob"
    # alice's earlier pages there were written by alice on that same worker: the leak is per worker
    alice_there = {
        e["request"]
        for e in trace["decode"]
        if e["tenant"] == "alice" and e["kind"] == "write" and e["worker"] in bob_decode
    }
    assert {p["last_writer"] for p in rep.pages if p["last_writer_tenant"] == "alice"} <= alice_there
    m = grid.metrics()
    assert (
        m['minigrid_kv_pages_in_use{role="decode"}'] == 0
        and m["minigrid_prefill_stubbed_requests_total"] >= 1
    )


def _incident(fixes: str) -> tuple[Any, dict[str, float]]:
    with Engine.start(incident_preset(**TWO_BY_TWO), fixes=fixes) as eng:
        rep = run_incident(
            eng, context_length=1024, prefill_pool_tokens=665, attacker_len=1000, max_tokens=24, seed=3
        )
        return rep, eng.metrics()


@pytest.mark.parametrize(
    ("fixes", "status", "code"),
    [
        ("reject-before-transfer", 400, "context_length_exceeded"),
        ("coverage-check", 500, "kv_coverage_mismatch"),
        ("owner-check", 500, "owner_check_violation"),
    ],
)
def test_each_fix_holds_on_2x2_as_on_1x1(fixes: str, status: int, code: str) -> None:
    rep, m = _incident(fixes)
    r = rep.reply
    assert r.status == status and r.error is not None and r.error["code"] == code, r.error
    assert r.text == "" and not rep.leaked_codes
    if fixes == "reject-before-transfer":
        assert not rep.pages and "1000 tokens" in r.error["message"]
    if fixes == "owner-check":
        assert m["minigrid_owner_check_violations_total"] >= 1
    for prompt, reply in zip(rep.victim_prompts, rep.victim_replies):
        assert reply.status == 200 and codes_in(reply.text) <= record_codes(prompt, rep.victim)
    assert m['minigrid_kv_pages_in_use{role="decode"}'] == 0


@pytest.mark.parametrize("fixes", ["none", "deferred-release"])
def test_deferred_release_on_2x2(fixes: str) -> None:
    """carol's late transfer lands in pages of the alice request on the same decode worker (bug),
    or nowhere (fix); two alice requests at once put one on each pair.

    The delay is aimed at carol (``@carol``): each prefill worker holds the injection list, and an
    untargeted delay would hold the first transfer of the alice request on the other pair too."""
    cfg = corrected_preset(
        release_timeout_s=2.0,
        inject=("delay-transfer=2.6@carol",),
        tenants={"alice": "sk-alice", "carol": "sk-carol"},
        **TWO_BY_TWO,
    )
    with Engine.start(cfg, fixes=fixes) as eng:
        rep = run_late_transfer(eng, context_length=cfg.context_length, seed=4, victims=2)
        assert rep.slow_reply.status == 504 and rep.slow_reply.error["code"] == "kv_transfer_timeout"
        assert all(r.status == 200 for r in rep.replies), [r.error for r in rep.replies]
        decoded = _served_by(eng.trace(), "decode", "read")
        assert {w for r in rep.replies for w in decoded[r.request_id]} == {"decode-0", "decode-1"}
        if fixes == "none":
            owners = {o for w in rep.foreign_writes for o in w["detail"]["owners"]}
            victims_there = {
                r.request_id
                for r in rep.replies
                if decoded[r.request_id] & {w["worker"] for w in rep.foreign_writes}
            }
            assert owners and owners == victims_there, rep.foreign_writes
        else:
            assert not rep.foreign_writes and not rep.foreign_codes, rep.foreign_writes
        deadline = time.monotonic() + 60  # deferred-release holds carol's pages one timeout more
        while eng.metrics()['minigrid_kv_pages_in_use{role="decode"}'] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert eng.metrics()['minigrid_kv_pages_in_use{role="decode"}'] == 0


def test_a_dead_decode_worker_on_2x2_restarts_every_worker_and_the_engine_serves_again() -> None:
    """The survivors share a torch.distributed group with the dead rank, which cannot rejoin it:
    the router starts all four workers again, on fresh ports."""
    rng = random.Random(21)
    prompts = {t: record_prompt(t, 200, rng, 4) for t in TENANTS}
    with Engine.start(incident_preset(tenants=TENANTS, **TWO_BY_TWO)) as eng:
        old = eng.worker_pids()
        os.kill(old["decode-1"], signal.SIGKILL)
        body = eng.wait_health("restarting", "down")
        assert body["status"] == "restarting" and eng.health()[0] == 503, body
        assert body["last_failure"]["reason"] == "the decode-1 worker died (exit status -9)"
        body = eng.wait_health("ok", "down")
        assert body["status"] == "ok" and body["restarts"]["count"] == 1, body
        assert set(eng.worker_pids().values()).isdisjoint(old.values())
        tenants = ("alice", "bob", "carol", "alice")
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda t: eng.complete(t, prompts[t], max_tokens=8), tenants))
        assert all(r.status == 200 for r in replies), [r.error for r in replies]
        for t, r in zip(tenants, replies):
            others = {c for o, p in prompts.items() if o != t for c in record_codes(p, o)}
            assert not codes_in(r.text) & others, (t, r.text)
        decoded = _served_by(eng.trace(), "decode", "read")
        assert {w for r in replies for w in decoded[r.request_id]} == {"decode-0", "decode-1"}
        check = eng.http.get("/v1/minigrid/integrity", headers={"Authorization": f"Bearer {eng.admin_key}"})
        body = check.json()
        assert check.status_code == 200 and body["ok"], body
        assert set(body["decode"]["workers"]) == {"decode-0", "decode-1"}
        assert body["decode"]["pages_in_use"] == 0 and body["prefill"]["pages_in_use"] == 0


def test_a_decode_worker_dying_mid_request_fails_the_requests_in_flight_and_the_engine_serves_again() -> None:
    """alice's request is on the dead worker (503 naming it); bob's on the other pair is stopped by
    the restart (503 saying so); afterwards carol is served with her own text only."""
    rng = random.Random(22)
    prompts = {t: record_prompt(t, 200, rng, 4) for t in TENANTS}
    # holds the first transfer of each prefill worker: both requests are in flight at the kill
    cfg = incident_preset(tenants=TENANTS, inject=("delay-transfer=3",), release_timeout_s=60, **TWO_BY_TWO)
    with Engine.start(cfg) as eng, ThreadPoolExecutor(2) as pool:
        first = pool.submit(eng.complete, "alice", prompts["alice"], max_tokens=6)
        deadline = time.monotonic() + 30  # the first request goes to the first pair
        while not any(e["kind"] == "reserve" for e in eng.trace()["decode"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = pool.submit(eng.complete, "bob", prompts["bob"], max_tokens=6)
        while (
            len({e["worker"] for e in eng.trace()["decode"] if e["kind"] == "reserve"}) < 2
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        os.kill(eng.worker_pids()["decode-0"], signal.SIGKILL)
        a, b = first.result(timeout=60), second.result(timeout=60)
        assert a.status == 503 and a.error is not None and a.error["code"] == "worker_unavailable", a.error
        assert a.error["message"].startswith(
            "the decode-0 worker died (exit status -9); the router is restarting"
        )
        assert b.status == 503 and b.error is not None and b.error["code"] == "engine_restarting", b.error
        assert b.error["message"].startswith("restarting after the decode-0 worker died (exit status -9)")
        for reply, reader in ((a, "alice"), (b, "bob")):
            text = json.dumps(reply.body)
            assert not any(c in text for t, p in prompts.items() if t != reader for c in record_codes(p, t))
        assert eng.wait_health("ok", "down")["status"] == "ok"
        after = eng.complete("carol", prompts["carol"], max_tokens=24)  # held 3 s: a fresh prefill
        assert after.status == 200 and "CAROL" in after.text, after.error
        others = {c for t, p in prompts.items() if t != "carol" for c in record_codes(p, t)}
        assert not codes_in(after.text) & others
