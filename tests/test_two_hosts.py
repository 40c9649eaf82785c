"""Prefill and decode on two hosts: the KV crosses a real link over torch.distributed.

As root where `ip netns add` works (here and in CI), the test makes two network namespaces joined
by a veth pair, 10.203.0.1/24 and 10.203.0.2/24 (names unique per run, removed in a finalizer):
the router and the prefill worker run in the first, the decode worker (`minigrid worker`) in the
second, and the only way between them is the veth. Elsewhere it falls back to two processes on
two loopback addresses (127.0.0.2 and 127.0.0.3) and says why.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_run import minigrid

from minigrid_engine.handle import stop_process
from minigrid_engine.model import ModelConfig
from minigrid_engine.router import free_port

CLIENT = """
import json, sys
from minigrid_engine.handle import Engine
from minigrid_engine.scenario import run_incident
url, admin = sys.argv[1], sys.argv[2]
eng = Engine.connect(url, tenants={"alice": "sk-alice", "bob": "sk-bob"}, admin_key=admin)
eng.wait_ready(120)
rep = run_incident(eng, context_length=1024, prefill_pool_tokens=665, attacker_len=1000,
                   max_tokens=24, attempts=4, seed=1)
moved = [e for e in eng.trace()["decode"] if e["kind"] == "write" and e["detail"].get("source") == "transfer"]
print(json.dumps({
    "status": rep.reply.status, "code": (rep.reply.error or {}).get("code"), "text": rep.reply.text,
    "leaked": sorted(rep.leaked_codes), "foreign_pages": rep.pages_by_tenant().get("alice", 0),
    "peers": sorted({e["detail"]["peer"] for e in moved}), "pages_moved": sum(len(e["pages"]) for e in moved),
    "health": eng.health()[1],
}))
"""


@dataclass
class Hosts:
    """Two places to run a command: host `a` (router + prefill) and host `b` (decode)."""

    a: str
    b: str
    prefix_a: list[str] = field(default_factory=list)
    prefix_b: list[str] = field(default_factory=list)
    veth_a: str | None = None  # the link's end in host a (namespaces only)

    def tx_bytes(self) -> int | None:
        if self.veth_a is None:
            return None
        out = subprocess.run(
            [*self.prefix_a, "cat", f"/sys/class/net/{self.veth_a}/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    tag = secrets.token_hex(3)
    ns_a, ns_b, veth_a, veth_b = f"mg-{tag}-a", f"mg-{tag}-b", f"mg{tag}a", f"mg{tag}b"
    why = None
    if os.geteuid() != 0 or shutil.which("ip") is None:
        why = "not root, or no `ip` command"
    else:
        try:
            _sh("ip", "netns", "add", ns_a)
        except subprocess.CalledProcessError as exc:
            why = f"`ip netns add` is not permitted here: {exc.stderr.strip()}"
    if why is not None:
        print(f"two hosts: network namespaces unavailable ({why}); using 127.0.0.2 and 127.0.0.3")
        yield Hosts("127.0.0.2", "127.0.0.3")
        return
    try:
        _sh("ip", "netns", "add", ns_b)
        _sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for ns, dev, addr in ((ns_a, veth_a, "10.203.0.1/24"), (ns_b, veth_b, "10.203.0.2/24")):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield Hosts(
            "10.203.0.1",
            "10.203.0.2",
            ["ip", "netns", "exec", ns_a],
            ["ip", "netns", "exec", ns_b],
            veth_a,
        )
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its end of the veth, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("fixes", ["none", "owner-check"])
def test_prefill_and_decode_on_two_hosts(hosts: Hosts, fixes: str, tmp_path: Path) -> None:
    key = tmp_path / "authkey"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    admin = secrets.token_hex(16)
    in_ns = bool(hosts.prefix_a)
    listen = f"{hosts.a}:{7100 if in_ns else free_port(hosts.a)}"
    http_host = "127.0.0.1" if in_ns else hosts.a  # the client runs beside the router
    http_port = 8000 if in_ns else free_port(hosts.a)
    env = dict(os.environ, MINIGRID_ADMIN_KEY=admin, PYTHONUNBUFFERED="1")
    router_log, worker_log = (tmp_path / "router.log").open("wb"), (tmp_path / "worker.log").open("wb")
    serve_cmd = [
        *hosts.prefix_a,
        sys.executable,
        "-m",
        "minigrid_engine.cli",
        "serve",
        "--fixes",
        fixes,
        "--host",
        http_host,
        "--port",
        str(http_port),
        "--remote",
        "decode",
        "--worker-listen",
        listen,
        "--transfer-host",
        hosts.a,
        "--authkey-file",
        str(key),
        "--tenants",
        "alice:sk-alice,bob:sk-bob",
    ]
    worker_cmd = [
        *hosts.prefix_b,
        sys.executable,
        "-m",
        "minigrid_engine.cli",
        "worker",
        "--role",
        "decode",
        "--router",
        listen,
        "--authkey-file",
        str(key),
        "--dist-addr",
        hosts.b,
    ]
    procs = []
    try:
        procs.append(subprocess.Popen(serve_cmd, stdout=router_log, stderr=subprocess.STDOUT, env=env))
        procs.append(subprocess.Popen(worker_cmd, stdout=worker_log, stderr=subprocess.STDOUT, env=env))
        before = hosts.tx_bytes()
        client = subprocess.run(
            [*hosts.prefix_a, sys.executable, "-c", CLIENT, f"http://{http_host}:{http_port}", admin],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        after = hosts.tx_bytes()
        logs = (tmp_path / "router.log").read_text() + (tmp_path / "worker.log").read_text()
        assert client.returncode == 0, client.stderr[-3000:] + logs[-3000:]
        got = json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            p.terminate()  # all at once, then each reaped
        for p in procs:
            stop_process(p)
        router_log.close()
        worker_log.close()
    decode = got["health"]["workers"]["decode"]
    assert decode["up"] and decode["host"] == hosts.b  # the decode worker joined from the other host
    assert got["peers"] == [f"prefill-0@{hosts.a}"]  # every page it received came from there
    assert "decode-0 joined from another host at " + hosts.b in logs
    if fixes == "none":  # the leak crosses hosts: bob's answer holds alice's secrets
        assert got["status"] == 200 and got["leaked"] and got["foreign_pages"] >= 1, got
    else:
        assert got["status"] == 500 and got["code"] == "owner_check_violation" and got["text"] == "", got
    if before is not None and after is not None:  # the page data went over the veth
        page_bytes = 128 * ModelConfig().kv_bytes_per_token()
        assert after - before >= got["pages_moved"] * page_bytes, (before, after, got["pages_moved"])


def test_a_worker_with_the_wrong_key_is_refused(tmp_path: Path) -> None:
    """...and neither it nor a bare connection (a port scan) keeps the right worker out."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(secrets.token_hex(32))
    bad.write_text(secrets.token_hex(32))
    listen = f"127.0.0.2:{free_port('127.0.0.2')}"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minigrid_engine.cli",
            "serve",
            "--fixes",
            "none",
            "--port",
            "0",
            "--remote",
            "decode",
            "--worker-listen",
            listen,
            "--authkey-file",
            str(good),
            "--transfer-host",
            "127.0.0.2",
            "--ready-file",
            str(tmp_path / "ready"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    joined = None
    try:
        deadline = time.monotonic() + 60
        worker = None
        while time.monotonic() < deadline:
            worker = minigrid(
                "worker",
                "--role",
                "decode",
                "--router",
                listen,
                "--authkey-file",
                str(bad),
                "--connect-timeout",
                "1",
                timeout=60,
            )
            if "Connection refused" not in worker.stderr:  # the router listens: the key was checked
                break
        assert worker is not None and worker.returncode == 2
        assert "refused this worker's key" in worker.stderr and "Traceback" not in worker.stderr, (
            worker.stderr
        )
        host, port = listen.split(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # connects, says nothing
        stalled = socket.create_connection((host, int(port)), timeout=5)  # connects, stays silent
        joined = subprocess.Popen(
            [
                *(sys.executable, "-m", "minigrid_engine.cli", "worker", "--role", "decode"),
                *("--router", listen, "--authkey-file", str(good), "--dist-addr", "127.0.0.2"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert serve.poll() is None and time.monotonic() < deadline, "the right worker never joined"
            time.sleep(0.2)
        stalled.close()
    finally:
        for proc in (joined, serve):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=15)
    said = serve.stderr.read() if serve.stderr else ""
    assert "refused a connection to " in said and "a wrong key" in said and "Traceback" not in said, said
    # said once, before the router waits (serve's startup lines do not repeat them)
    assert said.count("KV transfer on 127.0.0.2") == 1 and said.count("waiting 600 s for 1 decode") == 1, said
    assert "decode-0 joined from another host" in said, said
    # the worker's end, said once: what died, then why the router does not restart it
    down = "minigrid: the decode worker died (its connection closed); the router will not restart"
    assert down in said and said.count("the decode worker died") == 1, said
