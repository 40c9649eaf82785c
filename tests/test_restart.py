"""A dead worker: its requests fail cleanly, no tenant's data leaks, the pages come back, `/health`
says what happens, and the engine serves again (or says plainly that it will not)."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from cli_run import minigrid

from minigrid_engine import router as router_module
from minigrid_engine.config import incident_preset
from minigrid_engine.errors import ConfigError
from minigrid_engine.handle import Engine, Reply, stop_process
from minigrid_engine.records import record_prompt
from minigrid_engine.recovery import DEFAULT_RETRY_AFTER_S, Recovery, Status, WorkerFailure
from minigrid_engine.router import Router, free_port
from minigrid_engine.scenario import codes_in, record_codes

TENANTS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}
KILLED = WorkerFailure("decode-0", "the decode worker died (exit status -9)", -9)


# -- the policy, without processes ------------------------------------------------------------
def test_a_death_restarts_until_the_limit_then_the_engine_is_down() -> None:
    r = Recovery(limit=2)
    assert r.to_dict() == {
        "restarts": {"count": 0, "in_window": 0, "limit": 2, "window_s": 600.0},
        "last_failure": None,
        "recovery": None,
    }
    assert r.on_failure(KILLED) and r.status is Status.RESTARTING
    assert (
        r.note == "restarting every local worker (restart 1 of 2 in 600 s) after the decode worker died "
        "(exit status -9)"
    )
    code, message = r.refusal() or ("", "")
    assert (
        code == "engine_restarting" and "restarting after the decode worker died (exit status -9)" in message
    )
    r.restarted(4.12)
    assert r.status is Status.OK and r.refusal() is None and r.retry_after_s() == 5
    assert r.note is not None and r.note.startswith("restarted every local worker in 4.1 s after the decode")
    assert r.on_failure(KILLED) and r.restarts == 2
    r.restarted(1.0)
    assert not r.on_failure(KILLED) and r.status is Status.DOWN and r.restarts == 2
    assert "will not restart the workers any more: it has restarted them 2 times in 600 s" in (r.note or "")
    assert "--worker-restarts 2 --worker-restart-window 600" in (r.note or "")
    code, message = r.refusal() or ("", "")
    assert code == "engine_down" and "the engine is down after the decode worker died" in message
    assert r.to_dict()["last_failure"]["worker"] == "decode-0"
    assert r.to_dict()["last_failure"]["at"].endswith("Z")


def test_retry_after_counts_down_from_the_time_a_start_took() -> None:
    """Before any restart, a client is told the workers' first start; during one, what is left."""
    now = [100.0]
    r = Recovery(limit=2, clock=lambda: now[0])
    assert r.retry_after_s() == DEFAULT_RETRY_AFTER_S  # nothing timed yet
    r.first_start_s = 7.3  # 2 x 2 workers on a busy 2-core machine
    assert r.retry_after_s() == 8
    assert r.on_failure(KILLED)
    now[0] += 3.0
    assert r.retry_after_s() == 5 and "retry in about 5 s" in (r.refusal() or ("", ""))[1]
    now[0] += 30.0
    assert r.retry_after_s() == 1  # late: soon, never 0 or less
    r.restarted(10.2)
    assert r.retry_after_s() == 11  # the last restart's time wins over the first start's


def test_restarts_older_than_the_window_no_longer_count() -> None:
    """A worker lost once a week is restarted every week; three losses within the window are not."""
    now = [1000.0]
    r = Recovery(limit=2, window_s=60, clock=lambda: now[0])
    for _ in range(5):  # one death every 61 s: never two within 60 s
        assert r.on_failure(KILLED), r.note
        r.restarted(1.0)
        assert r.note is not None and r.note.endswith("(restart 1 of 2 in 60 s)"), r.note
        now[0] += 61
    assert r.restarts == 5 and r.to_dict()["restarts"] == {
        "count": 5,
        "in_window": 0,
        "limit": 2,
        "window_s": 60,
    }
    assert r.on_failure(KILLED)
    r.restarted(1.0)
    now[0] += 30  # the second death within 60 s: the limit
    assert r.on_failure(KILLED) and "restart 2 of 2 in 60 s" in (r.note or "")
    r.restarted(1.0)
    now[0] += 29
    assert not r.on_failure(KILLED) and r.status is Status.DOWN
    assert "restarted them 2 times in 60 s" in (r.note or "")


def test_a_restart_exactly_the_window_ago_no_longer_counts() -> None:
    now = [1000.0]
    r = Recovery(limit=1, window_s=60, clock=lambda: now[0])
    assert r.on_failure(KILLED)
    r.restarted(1.0)
    now[0] += 59.999  # within the window: the limit of 1 is reached
    assert r.recent() == 1
    now[0] = 1060.0  # 60 s after it began: out of the window
    assert r.recent() == 0 and r.on_failure(KILLED), r.note


def test_a_failed_restart_tries_again_within_the_limit() -> None:
    r = Recovery(limit=2)
    assert r.on_failure(KILLED)
    assert r.start_failed("the prefill worker exited with status 1 during startup:\nTraceback ...")
    assert r.status is Status.RESTARTING and r.restarts == 2
    assert "after restart 1 failed (the prefill worker exited with status 1 during startup:)" in (
        r.note or ""
    )
    assert not r.start_failed("again") and r.status is Status.DOWN


def test_restarts_off_or_remote_workers_go_down_and_say_why() -> None:
    off = Recovery(limit=0)
    assert not off.on_failure(KILLED) and off.status is Status.DOWN
    assert "restarts are off (--worker-restarts 0)" in (off.note or "")
    remote = Recovery(limit=3, remote=("decode",))
    assert not remote.on_failure(WorkerFailure("decode-0", "the decode worker died", None, remote=True))
    assert remote.status is Status.DOWN and remote.restarts == 0
    assert "run on another host (--remote decode)" in (remote.note or "")
    assert "the router will not restart the workers" in (remote.note or "")


def test_config_takes_worker_restarts_from_0() -> None:
    assert incident_preset().worker_restarts == 3 and incident_preset(worker_restarts=0).worker_restarts == 0
    with pytest.raises(ConfigError, match="--worker-restarts must be at least 0, got -1"):
        incident_preset(worker_restarts=-1)
    with pytest.raises(ConfigError, match="--worker-restarts 101: at most 100"):
        incident_preset(worker_restarts=101)
    assert incident_preset(worker_restart_window_s=3600).worker_restart_window_s == 3600
    for bad in (0, -5, float("nan"), float("inf"), "600", True):
        with pytest.raises(ConfigError, match=r"--worker-restart-window .* must be between 1 and 604800"):
            incident_preset(worker_restart_window_s=bad)


def test_serve_refuses_a_negative_restart_count_in_one_line() -> None:
    proc = minigrid("serve", "--worker-restarts", "-1", timeout=60)
    assert proc.returncode == 2 and "--worker-restarts must be at least 0, got -1" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = minigrid("serve", "--worker-restart-window", "0", timeout=60)
    assert proc.returncode == 2 and "--worker-restart-window 0.0 must be between 1 and" in proc.stderr


# -- real processes -----------------------------------------------------------------------------
def _admin(eng: Engine, path: str) -> Any:
    return eng.http.get(path, headers={"Authorization": f"Bearer {eng.admin_key}"})


def _own_codes_only(tenant: str, prompt: str, reply: Reply) -> None:
    """`reply` (200) holds no code but `tenant`'s own from `prompt` (the first may be cut short:
    the answer goes on from wherever the prompt stopped)."""
    assert reply.status == 200, reply.error
    own = record_codes(prompt, tenant)
    assert own, prompt  # the prompt has whole records to compare with
    foreign = {c for c in codes_in(reply.text) if not any(o.endswith(c) for o in own)}
    assert not foreign, (tenant, reply.text)


def _no_secret_of(prompts: dict[str, str], body: dict[str, Any], reader: str) -> None:
    """No other tenant's code appears anywhere in the response body `reader` got (text or error)."""
    seen = json.dumps(body)
    for tenant, prompt in prompts.items():
        if tenant != reader:
            leaked = {c for c in record_codes(prompt, tenant) if c in seen}
            assert not leaked, f"{reader} got {tenant}'s {leaked}: {seen[:300]}"


def _whole_again(eng: Engine) -> None:
    """Serving, every pool intact and empty, no page owned."""
    check = _admin(eng, "/v1/minigrid/integrity")
    assert check.status_code == 200 and check.json()["ok"], check.json()
    assert check.json()["prefill"]["pages_in_use"] == 0 and check.json()["decode"]["pages_in_use"] == 0
    m = eng.metrics()
    assert m['minigrid_kv_pages_in_use{role="prefill"}'] == 0
    assert m['minigrid_kv_pages_in_use{role="decode"}'] == 0
    assert all(p["owner"] is None for role in eng.pools().values() for p in role)


def _wait_event(eng: Engine, role: str, kind: str, n: int = 1, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(e["kind"] == kind for e in eng.trace()[role]) < n:
        assert time.monotonic() < deadline, f"no {kind} event on {role} in {timeout_s} s"
        time.sleep(0.05)


def test_a_decode_worker_killed_while_idle_is_restarted_and_the_engine_serves_again() -> None:
    rng = random.Random(11)
    prompts = {t: record_prompt(t, 300, rng, 4) for t in ("alice", "bob")}
    with Engine.start(incident_preset(tenants=TENANTS)) as eng:
        before = eng.complete("alice", prompts["alice"], max_tokens=16)
        _own_codes_only("alice", prompts["alice"], before)
        stubbed = eng.complete("carol", record_prompt("carol", 900, rng, 4), max_tokens=4)
        assert stubbed.status == 200 and eng.metrics()["minigrid_prefill_stubbed_requests_total"] == 1
        old = eng.worker_pids()
        os.kill(old["decode"], signal.SIGKILL)
        body = eng.wait_health("restarting", "down", timeout_s=30)
        assert body["status"] == "restarting", body
        assert body["last_failure"]["worker"] == "decode-0" and body["last_failure"]["exit_status"] == -9
        assert body["last_failure"]["reason"] == "the decode worker died (exit status -9)"
        assert body["restarts"] == {"count": 1, "in_window": 1, "limit": 3, "window_s": 600.0}
        assert body["recovery"].startswith("restarting every local worker (restart 1 of 3 in 600 s)")
        assert eng.health()[0] == 503
        # while it restarts: a request gets 503 and when to come back; the admin views a 503, never a 500
        during = eng.http.post(
            "/v1/completions",
            json={"prompt": prompts["bob"], "max_tokens": 4},
            headers={"Authorization": "Bearer sk-bob"},
        )
        assert during.status_code == 503, during.text
        assert during.json()["error"]["code"] == "engine_restarting"
        assert "restarting after the decode worker died (exit status -9)" in during.json()["error"]["message"]
        assert int(during.headers["retry-after"]) >= 1
        for path in ("/v1/minigrid/pools", "/v1/minigrid/integrity", "/v1/minigrid/trace"):
            r = _admin(eng, path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting", (path, r.text)
        assert eng.http.get("/metrics").status_code == 200
        body = eng.wait_health("ok", "down")
        assert body["status"] == "ok" and body["restarts"]["count"] == 1, body
        assert body["recovery"].startswith("restarted every local worker in ")
        assert body["last_failure"]["worker"] == "decode-0"
        new = eng.worker_pids()
        assert set(new.values()).isdisjoint(old.values())  # every worker is a new process
        after = eng.complete("bob", prompts["bob"], max_tokens=16)
        _own_codes_only("bob", prompts["bob"], after)
        _no_secret_of(prompts, after.body, "bob")
        _whole_again(eng)
        assert eng.metrics()["minigrid_worker_restarts_total"] == 1
        # the counters the dead processes held stay counted: a _total never goes down
        assert eng.metrics()["minigrid_prefill_stubbed_requests_total"] == 1
        stubbed = eng.complete("carol", record_prompt("carol", 900, rng, 4), max_tokens=4)
        assert eng.metrics()["minigrid_prefill_stubbed_requests_total"] == 2
        assert "restarted every local worker in" in eng.log()


def test_the_prefill_worker_killed_during_a_transfer_fails_that_request_and_the_engine_serves_again() -> None:
    rng = random.Random(12)
    prompts = {t: record_prompt(t, 300, rng, 4) for t in ("alice", "bob")}
    # the transfer is held open 3 s; decode waits for it far longer than that
    cfg = incident_preset(tenants=TENANTS, inject=("delay-transfer=3",), release_timeout_s=60)
    with Engine.start(cfg) as eng:
        r = _kill_prefill_mid_transfer(eng, "alice", prompts["alice"])
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
        assert r.json()["error"]["message"].startswith(
            "the prefill worker died (exit status -9); the router is restarting"
        )
        assert int(r.headers["retry-after"]) >= 1  # a restart will cure it: say when to come back
        body = eng.wait_health("ok", "down")
        assert body["status"] == "ok", body
        assert body["last_failure"]["worker"] == "prefill-0", body  # not decode, which exited after it
        _whole_again(eng)  # the pages decode held for alice went with the old pool
        after = eng.complete("bob", prompts["bob"], max_tokens=16)  # held 3 s too: a fresh prefill
        _own_codes_only("bob", prompts["bob"], after)
        _no_secret_of(prompts, after.body, "bob")
        _no_secret_of(prompts, r.json(), "alice")
        _whole_again(eng)


def _kill_prefill_mid_transfer(eng: Engine, tenant: str, prompt: str) -> Any:
    """Kill the prefill worker while it holds `tenant`'s transfer open (the engine must inject
    `delay-transfer`); the HTTP response that request then gets."""
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            eng.http.post,
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 8},
            headers={"Authorization": f"Bearer {TENANTS[tenant]}"},
        )
        _wait_event(eng, "prefill", "fault")  # prefill holds the page data: the transfer is open
        _wait_event(eng, "decode", "reserve")  # and decode holds pages for it
        os.kill(eng.worker_pids()["prefill"], signal.SIGKILL)
        return slow.result(timeout=60)


def test_a_request_in_flight_when_the_engine_goes_down_is_not_told_to_retry() -> None:
    cfg = incident_preset(
        tenants=TENANTS, inject=("delay-transfer=3",), release_timeout_s=60, worker_restarts=0
    )
    with Engine.start(cfg) as eng:
        r = _kill_prefill_mid_transfer(eng, "alice", record_prompt("alice", 300, random.Random(13), 4))
        assert r.status_code == 503 and "retry-after" not in r.headers  # no restart is coming
        error = r.json()["error"]
        assert error["code"] == "worker_unavailable", error
        assert error["message"].startswith("the prefill worker died (exit status -9); the router will not")
        assert "restarts are off (--worker-restarts 0)" in error["message"]
        assert eng.wait_health("down")["status"] == "down"


def test_when_the_restart_limit_is_reached_the_engine_is_down_and_says_so() -> None:
    with Engine.start(incident_preset(worker_restarts=1)) as eng:
        os.kill(eng.worker_pids()["decode"], signal.SIGKILL)
        assert eng.wait_health("restarting", "down")["status"] == "restarting"
        assert eng.wait_health("ok", "down")["restarts"] == {
            "count": 1,
            "in_window": 1,
            "limit": 1,
            "window_s": 600.0,
        }
        assert eng.complete("alice", "ALICE pin 48213X; " * 8, max_tokens=6).status == 200
        os.kill(eng.worker_pids()["decode"], signal.SIGKILL)
        body = eng.wait_health("down")
        assert eng.health()[0] == 503
        assert body["restarts"] == {"count": 1, "in_window": 1, "limit": 1, "window_s": 600.0}
        assert body["last_failure"]["reason"] == "the decode worker died (exit status -9)"
        plain = "the router will not restart the workers any more: it has restarted them 1 time"
        assert plain in body["recovery"] and "--worker-restarts 1" in body["recovery"]
        r = eng.http.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"Authorization": "Bearer sk-alice"},
        )
        assert r.status_code == 503 and "retry-after" not in r.headers
        error = r.json()["error"]
        assert error["code"] == "engine_down" and plain in error["message"]
        assert "the engine is down after the decode worker died (exit status -9)" in error["message"]
        integrity = _admin(eng, "/v1/minigrid/integrity")
        assert integrity.status_code == 503 and integrity.json()["error"]["code"] == "engine_down"
        deadline = time.monotonic() + 30  # the survivor is stopped: nothing is left running
        while any(w["up"] for w in eng.health()[1]["workers"].values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(w["up"] for w in eng.health()[1]["workers"].values())


def test_a_port_taken_before_a_worker_binds_it_is_retried_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    picks = iter([port])  # the first port the router picks (prefill's bootstrap port) is taken
    real = router_module.free_port
    monkeypatch.setattr(router_module, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    router = Router(incident_preset())
    try:
        router.start_workers()
        assert all(w.alive() for w in router.workers.values()) and router.generation == 2
        assert router._peer_ports[0] != port
        assert router.health()["status"] == "ok"
    finally:
        router.stop_workers()
        taken.close()
    err = capsys.readouterr().err
    assert "the prefill worker exited with status 1 during startup: a port it was given was in use" in err
    assert "starting every worker again on fresh ports (try 2 of 4)" in err


def test_a_worker_from_another_host_is_not_restarted_and_the_engine_says_so(tmp_path: Path) -> None:
    """`--remote decode`: the router cannot start a worker someone started on another host (here
    the same host, over loopback), so its death leaves the engine down, saying so plainly."""
    key = tmp_path / "authkey"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    ready, admin = tmp_path / "url", secrets.token_hex(16)
    listen = f"127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "minigrid_engine.cli"]
    remote = ["--remote", "decode", "--worker-listen", listen, "--authkey-file", str(key)]
    env = dict(os.environ, MINIGRID_ADMIN_KEY=admin, PYTHONUNBUFFERED="1")
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [*cli, "serve", "--fixes", "none", "--port", "0", "--ready-file", str(ready), *remote],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    worker = subprocess.Popen(
        [*cli, "worker", "--role", "decode", "--router", listen, "--authkey-file", str(key)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text().strip():
            assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        eng = Engine(ready.read_text().strip(), {"alice": "sk-alice"}, admin)
        assert eng.wait_health("ok")["workers"]["decode"]["up"]
        assert eng.complete("alice", "ALICE pin 48213X; " * 8, max_tokens=6).status == 200
        worker.kill()
        body = eng.wait_health("down", timeout_s=30)
        assert body["last_failure"]["worker"] == "decode-0" and body["last_failure"]["remote"]
        assert body["restarts"] == {"count": 0, "in_window": 0, "limit": 3, "window_s": 600.0}
        assert "run on another host (--remote decode)" in body["recovery"]
        r = eng.complete("alice", "ALICE pin 48213X; " * 8, max_tokens=6)
        assert r.status == 503 and r.error is not None and r.error["code"] == "engine_down", r.error
        assert "the router will not restart the workers" in r.error["message"]
        assert "`minigrid worker` on that host" in r.error["message"]
        eng.http.close()
    finally:
        for p in (worker, serve):
            stop_process(p)
        log.close()


def test_sigterm_to_the_process_group_stops_the_engine_without_a_restart(tmp_path: Path) -> None:
    """`timeout`, systemd and a terminal send SIGTERM (or SIGINT) to every process of the group:
    the workers leave their stopping to the router, so no worker death is seen, no restart begins,
    and every process is gone within seconds."""
    ready, log_path = tmp_path / "url", tmp_path / "serve.log"
    with log_path.open("wb") as log:
        serve = subprocess.Popen(
            [
                *(sys.executable, "-m", "minigrid_engine.cli", "serve", "--preset", "corrected"),
                *("--port", "0", "--ready-file", str(ready)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text().strip():
            assert time.monotonic() < deadline and serve.poll() is None, log_path.read_text()
            time.sleep(0.1)
        workers = psutil.Process(serve.pid).children(recursive=True)
        assert len(workers) >= 2, workers
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, alive
        said = log_path.read_text()
        assert "restart" not in said.lower() and "died" not in said, said
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
