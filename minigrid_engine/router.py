"""The router: the HTTP front (OpenAI-style), tenants by API key, `/metrics`, `/health`.

It starts the worker processes (one per role by default, `--prefill-workers N --decode-workers M`
for more; a role named in `--remote` is started by hand on another host and joins), pairs one
prefill and one decode worker per request (`pairing.py`), talks to them over authenticated
sockets, and never imports torch (it stays small: the whole engine has to fit a 1 GB Binder
session). When a worker dies it fails the requests in flight and restarts every local worker, a
bounded number of times (`recovery.py`: the policy, and what `/health` says).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import itertools
import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minigrid_engine import openai_api as oai
from minigrid_engine.config import ADMIN, MODEL_ID, ROLES, ServeConfig, check_admin_key
from minigrid_engine.errors import REFUSAL_MARK, REFUSED_TO_START, ConfigError, MinigridError, counted, shown
from minigrid_engine.fixes import BUILT, FIXES, Fixes, parse_fixes
from minigrid_engine.messages import (
    Abort,
    Assign,
    GenerateRequest,
    Join,
    Query,
    QueryReply,
    Ready,
    Result,
    SetFixes,
    Shutdown,
    Tokens,
)
from minigrid_engine.openai_api import BadRequest, Sampling
from minigrid_engine.pairing import Pairing
from minigrid_engine.recovery import Recovery, Status, WorkerFailure
from minigrid_engine.tokenizer import ByteTokenizer

log = logging.getLogger("minigrid.router")
disable_created_metrics()
REMOTE_WAIT_S = 600  # how long the router waits for a worker started by hand on another host
PORT_TRIES = 4  # starts on fresh ports when one the workers were given was taken meanwhile
FIX_DRAIN_S = 30.0  # how long a switch of the fixes waits for the requests in flight
STOP_GRACE_S = 2.0  # how long a restart lets the survivors stop before it kills them
MAX_BODY_BYTES = 4 * 2**20


def _recv(conn: Connection) -> object:
    try:
        return conn.recv()
    except (EOFError, OSError) as exc:
        return exc


# How a worker's refusal of its settings (exit REFUSED_TO_START, one line why) is said by serve
# ("the prefill worker refused to start: WHY", or serve's "the prefill and decode workers ..."); the
# Python handle reads it back to tell a refusal from a crash.
REFUSED_TAIL = "refused to start: "
# `minigrid_requests_total{outcome}`: 200 ok; 4xx rejected (the engine refused the prompt) or invalid
# (a bad body), unauthorized (401); 5xx aborted (failed in the engine) or unavailable (restarting,
# down); disconnected (the client hung up first).
OUTCOMES = ("ok", "rejected", "invalid", "unauthorized", "aborted", "unavailable", "disconnected")


class StartupError(MinigridError):
    """A worker failed to start; the message carries what it said."""


class PortInUse(StartupError):
    """A worker could not bind a port it was given (taken between the router's pick and its bind)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why  # one line: which worker, and that a port was in use


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def api_error(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object, as a response body or as a stream's error event."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def request_id(tenant: str, room: int) -> str:
    """What every role, the trace and the client call one request."""
    return f"{tenant}-{room}"


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit`: by its declared
    length before a byte is read, or while it streams in (a chunked upload declares none)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise BadRequest(
            f"the request body of {declared[:20]} bytes exceeds the limit of {limit} bytes",
            "body_too_large",
            status=413,
        )
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise BadRequest(
                    f"the request body exceeds the limit of {limit} bytes", "body_too_large", status=413
                )
    except ClientDisconnect:  # gone while its body was still arriving: nothing was started
        raise BadRequest("the client closed the connection", "client_closed", status=499) from None
    return bytes(raw)


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 that says where it stops being JSON."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is not valid JSON: nested too deeply", "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError names the place; int() the digit limit
        raise BadRequest(f"the request body is not valid JSON: {shown_error(exc)}", "invalid_json") from None


def shown_error(exc: ValueError) -> str:
    """A JSON parse error in one short line (int's message names a setting the client cannot use)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    if "digits" in str(exc):
        return "a number has more than 4300 digits"
    return str(exc)[:120]


def tenant_view(events: list[dict[str, Any]], tenant: str) -> list[dict[str, Any]]:
    """`tenant`'s own trace events, other requests' names taken out (a transfer's `owners` lists
    whoever held the pages it landed in, and request ids carry their tenant's name)."""
    out = []
    for e in events:
        if e.get("tenant") != tenant:
            continue
        owners = e.get("detail", {}).get("owners")
        if owners is not None:
            mine = [o if o in (None, e["request"]) else "another request" for o in owners]
            e = {**e, "detail": {**e["detail"], "owners": mine}}
        out.append(e)
    return out


async def until_disconnected(request: Request) -> None:
    """Returns once the client has gone away (call after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class WorkerLink:
    role: str
    index: int
    name: str  # what errors and /health call it: the role when it is the role's only worker
    proc: subprocess.Popen[bytes] | None  # None: started by hand on another host (--remote)
    conn: Connection | None = None
    ready: Ready | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead_reason: str | None = None
    claimed: bool = False  # a remote worker has joined for this slot
    generation: int = 0  # which start of the workers it belongs to (each restart is a new one)
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=200))

    @property
    def worker(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready is not None else self.proc.pid if self.proc else None

    def alive(self) -> bool:
        running = self.proc is None or self.proc.poll() is None
        return self.dead_reason is None and running and self.conn is not None

    def death(self, wait_s: float = 0) -> str:
        """Why it is gone, for errors and /health: "the decode-0 worker died (exit status -9)"."""
        if self.proc is None:
            return f"the {self.name} worker died (its connection closed)"
        code = self.proc.poll()
        if code is None and wait_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(timeout=wait_s)
        if code is None:  # its connection closed, the process not yet gone
            return f"the {self.name} worker died (its connection closed)"
        if code == 0:  # it was told to stop, or its peer's connection closed
            return f"the {self.name} worker stopped (exit status 0)"
        return f"the {self.name} worker died (exit status {code})"

    def send(self, msg: object) -> None:
        if self.conn is None or not self.alive():
            raise ConnectionError(f"{self.name} worker is down: {self.dead_reason or 'not connected'}")
        with self.lock:
            self.conn.send(msg)


def spawn_worker(
    cfg: ServeConfig,
    role: str,
    index: int,
    router_addr: str,
    peer_ports: list[int],
    dist_port: int,
    env: dict[str, str],
) -> subprocess.Popen[bytes]:
    """Start worker `index` of `role` on this host; it connects back to `router_addr`."""
    cmd = [
        sys.executable,
        "-m",
        "minigrid_engine.worker",
        "--role",
        role,
        "--index",
        str(index),
        "--router",
        router_addr,
        "--peer-ports",
        ",".join(map(str, peer_ports)),
        "--dist-port",
        str(dist_port),
        "--config",
        cfg.to_json(),
    ]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


class FixesBusy(Exception):
    """The requests in flight did not finish in time for a switch of the fixes."""


class _Refused(Exception):
    """A request that arrives while the engine restarts or is down."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class Router:
    """Owns the workers and the request bookkeeping; `app()` is the FastAPI application."""

    def __init__(self, cfg: ServeConfig, authkey: bytes | None = None) -> None:
        self.cfg = cfg
        self.authkey = authkey  # shared with workers on other hosts; None: a fresh one per start
        self.tokenizer = ByteTokenizer()
        self.bodies = oai.Bodies(cfg.context_length, self.tokenizer)
        self.admin_key = cfg.admin_key or os.environ.get("MINIGRID_ADMIN_KEY")
        check_admin_key(cfg.tenants, self.admin_key)
        self.workers: dict[str, WorkerLink] = {}  # by worker id: prefill-0, decode-1...
        self.pairing = Pairing({role: cfg.workers(role) for role in ROLES})
        self._rooms = itertools.count(1)
        self._qids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Result]]] = {}
        self._streams: dict[int, asyncio.Queue[list[int]]] = {}  # streamed rooms: their new tokens
        self._queries: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._switching = False  # the fixes are being switched: new requests wait (set_fixes)
        self._switch_lock = threading.Lock()  # one switch at a time
        self._plock = threading.Lock()
        self.started_at = time.time()
        self.startup_log: list[str] = []
        self.startup_said = 0  # of those, the first lines already printed (remote mode: before it waits)
        self.recovery = Recovery(cfg.worker_restarts, cfg.remote, cfg.worker_restart_window_s)
        self.generation = 0  # bumped by each start of the workers
        self._closed = False  # stop_workers was called: a death now is the router stopping
        self.registry = CollectorRegistry()
        self.requests_total = Counter(
            "minigrid_requests", "Completion requests by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:  # every series exported from the start: an alert sees 0, not no data
            self.requests_total.labels(outcome)
        self.ttft = Histogram(
            "minigrid_time_to_first_token_seconds",
            "Time to first token",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.collector = _PoolCollector(self)
        self.registry.register(self.collector)

    # -- workers -------------------------------------------------------------------------
    def start_workers(self, timeout_s: float = 120) -> None:
        """Start every worker (local ones spawned, remote ones awaited) and wait for each Ready.
        A port taken between the router's pick and the worker's bind is retried on fresh ports."""
        t0 = time.monotonic()
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._launch(timeout_s)
                if self.generation == 1:  # a restart's first estimate (Retry-After)
                    self.recovery.first_start_s = time.monotonic() - t0
                return
            except PortInUse as exc:
                if attempt == PORT_TRIES or self.cfg.remote:
                    raise
                again = f"try {attempt + 1} of {PORT_TRIES}"
                line = f"{exc.why}; starting every worker again on fresh ports ({again})"
                print(f"minigrid: {line}", file=sys.stderr, flush=True)

    def _launch(self, timeout_s: float) -> None:
        """One start of every worker: a new generation, fresh ports, a new torch.distributed group."""
        authkey = self.authkey or secrets.token_bytes(32)
        env = dict(os.environ, MINIGRID_AUTHKEY=authkey.hex())
        try:
            # no authkey here: each connection's key check runs in its own thread (hello), so that a
            # stray or slow caller (a port scan, a worker with the wrong key) holds up nobody
            listener = Listener(_host_port(self.cfg.worker_listen))
        except OSError as exc:
            raise ConfigError(
                f"--worker-listen {self.cfg.worker_listen}: cannot listen for workers there "
                f"({exc.strerror or exc})"
            ) from None
        router_addr = "{}:{}".format(*listener.address)
        try:
            self._peer_ports = [free_port(self.cfg.transfer_host) for _ in range(self.cfg.prefill_workers)]
            self._dist_port = free_port(self.cfg.transfer_host)
        except OSError as exc:
            listener.close()
            raise ConfigError(
                f"--transfer-host {self.cfg.transfer_host}: cannot listen for the KV transfer there "
                f"({exc.strerror or exc}); give an address of this host"
            ) from None
        # The workers' command line is readable by every local user (`ps`): it carries no API key.
        self._worker_cfg = self.cfg.with_(tenants={name: "-" for name in self.cfg.tenants}, admin_key=None)
        with self._plock:
            self.generation += 1
            generation = self.generation
            self.workers = workers = {}
        first_start = generation == 1
        for role in ROLES:
            n = self.cfg.workers(role)
            for index in range(n):
                name = role if n == 1 else f"{role}-{index}"
                proc = None
                if role not in self.cfg.remote:
                    proc = spawn_worker(
                        self._worker_cfg, role, index, router_addr, self._peer_ports, self._dist_port, env
                    )
                link = WorkerLink(role, index, name, proc, generation=generation)
                workers[link.worker] = link
                if proc is not None:
                    threading.Thread(target=self._pump_stderr, args=(link,), daemon=True).start()
        if self.cfg.remote:  # what a firewall between the hosts must let through
            self.startup_log.append(
                f"KV transfer on {self.cfg.transfer_host}: bootstrap ports "
                f"{','.join(map(str, self._peer_ports))}, rendezvous port {self._dist_port}"
            )
            print(f"minigrid: {self.startup_log[-1]}", file=sys.stderr, flush=True)
        for role in self.cfg.remote:
            line = (
                f"waiting {REMOTE_WAIT_S} s for {self.cfg.workers(role)} {role} worker(s) from another "
                f"host: there run `minigrid worker --role {role} --router {router_addr} "
                f"--authkey-file FILE --dist-addr ITS_ADDRESS`"
            )
            self.startup_log.append(line)
            print(f"minigrid: {line}", file=sys.stderr, flush=True)
        self.startup_said = len(self.startup_log)  # said already: serve() prints only what follows
        accepted: queue.Queue[tuple[Connection, object]] = queue.Queue()

        def hello(conn: Connection) -> None:  # the key, then Ready, or (a remote worker) Join first
            try:
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
            except (AuthenticationError, EOFError, OSError) as exc:
                why = (
                    "a wrong key (not this router's --authkey-file)"
                    if isinstance(exc, AuthenticationError)
                    else "it left before the key check (a port scan?)"
                )
                print(f"minigrid: refused a connection to {router_addr}: {why}", file=sys.stderr, flush=True)
                conn.close()
                return
            first = _recv(conn)
            if isinstance(first, Join):
                assign = self._assign(first)
                with contextlib.suppress(OSError):
                    conn.send(assign)
                if assign.error is not None:
                    conn.close()
                    return
                first = _recv(conn)
            accepted.put((conn, first))

        def accept() -> None:  # a worker connects, then says Ready once its peers and pool are up
            while True:
                try:
                    conn = listener.accept()
                except OSError:  # closed: every worker is in, or the start failed
                    return
                threading.Thread(target=hello, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, name="accept-workers", daemon=True).start()
        wait_s = max(timeout_s, REMOTE_WAIT_S) if self.cfg.remote else timeout_s
        deadline = time.monotonic() + wait_s
        try:
            while any(w.ready is None for w in workers.values()):
                if self._closed:
                    raise StartupError("the router is stopping")
                for w in workers.values():
                    if w.proc is not None and w.proc.poll() is not None:
                        time.sleep(0.2)  # let its last lines arrive
                        said = "\n".join(w.log_tail)
                        why = f"the {w.name} worker exited with status {w.proc.returncode} during startup"
                        if w.proc.returncode == REFUSED_TO_START and w.log_tail:  # its one line
                            raise StartupError(f"the {w.name} worker {REFUSED_TAIL}{w.log_tail[-1]}")
                        if "address already in use" in said.lower():
                            raise PortInUse(f"{why}:\n{said}", f"{why}: a port it was given was in use")
                        raise StartupError(f"{why}:\n{said}")
                if time.monotonic() > deadline:
                    missing = ", ".join(w.worker for w in workers.values() if w.ready is None)
                    raise StartupError(f"workers not ready after {wait_s:.0f} s: {missing}")
                try:
                    conn, ready = accepted.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(ready, (EOFError, OSError)) and not self.cfg.remote:
                    continue  # a local worker gone before Ready: its exit status and log come next
                if not isinstance(ready, Ready) or ready.worker not in workers:
                    raise StartupError(f"a worker said {ready!r} instead of Ready")
                link = workers[ready.worker]
                link.conn, link.ready = conn, ready
                many = self.cfg.workers(link.role) > 1
                lines = [f"{link.worker}: {line}" if many else line for line in ready.log]
                if link.proc is None:
                    lines.append(f"{link.worker} joined from another host at {ready.host}")
                if first_start:  # serve() prints these; a restart's lines are printed here
                    self.startup_log += lines
                else:
                    for line in lines:
                        line = f"minigrid: restart {self.recovery.restarts}: {line}"
                        print(line, file=sys.stderr, flush=True)
                threading.Thread(target=self._reader, args=(link,), daemon=True).start()
        except BaseException:
            self._stop(list(workers.values()))
            raise
        finally:
            listener.close()

    def _assign(self, join: Join) -> Assign:
        """A slot for a worker that joined from another host, or the reason it gets none."""

        def refuse(why: str) -> Assign:
            log.warning("refused a %s worker from another host: %s", join.role, why)
            return Assign("", -1, "", [], 0, error=why)

        if join.role not in self.cfg.remote:
            return refuse(f"this router runs its {join.role} workers itself (no --remote {join.role})")
        with self._plock:
            free = [
                w
                for w in self.workers.values()
                if w.role == join.role and not w.claimed and join.index in (None, w.index)
            ]
            if not free:
                n = self.cfg.workers(join.role)
                return refuse(
                    f"no free {join.role} slot"
                    + (f" {join.index}" if join.index is not None else "")
                    + f" (the router expects {n} {join.role} worker(s), index 0 to {n - 1})"
                )
            link = free[0]
            link.claimed = True
        return Assign(link.worker, link.index, self._worker_cfg.to_json(), self._peer_ports, self._dist_port)

    def _pump_stderr(self, link: WorkerLink) -> None:
        assert link.proc is not None and link.proc.stderr is not None
        for raw in link.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if line.startswith(REFUSAL_MARK):  # said once, by the StartupError it becomes
                link.log_tail.append(line.removeprefix(REFUSAL_MARK))
                continue
            link.log_tail.append(line)
            print(line, file=sys.stderr, flush=True)

    def _reader(self, link: WorkerLink) -> None:
        assert link.conn is not None
        while True:
            try:
                msg = link.conn.recv()
            except (EOFError, OSError):
                link.dead_reason = link.dead_reason or link.death(wait_s=5)
                self._worker_died(link)  # says it, with what the router does about it
                return
            if isinstance(msg, Tokens):
                self._stream(msg)
            elif isinstance(msg, Result):
                self._resolve(msg)
            elif isinstance(msg, Abort):
                self._resolve(Result.failed(msg.room, msg.status, msg.code, msg.reason))
            elif isinstance(msg, QueryReply):
                with self._plock:
                    slot = self._queries.get(msg.qid)
                if slot is not None:
                    slot[1].append(msg.data)
                    slot[0].set()

    def _stream(self, msg: Tokens) -> None:
        with self._plock:
            entry = self._pending.get(msg.room)
            tokens = self._streams.get(msg.room)
        if entry is not None and tokens is not None:
            entry[0].call_soon_threadsafe(tokens.put_nowait, msg.ids)

    def _forget(self, room: int) -> tuple[asyncio.AbstractEventLoop, asyncio.Future[Result]] | None:
        """Take `room` out of the books (under `_plock`): it is answered, or nobody waits for it."""
        entry = self._pending.pop(room, None)
        self._streams.pop(room, None)
        if entry is not None:
            self.pairing.done(room)
        return entry

    def _resolve(self, result: Result) -> None:
        with self._plock:
            entry = self._forget(result.room)
        if entry is None:
            return
        loop, fut = entry

        def settle() -> None:
            if not fut.done():
                fut.set_result(result)

        loop.call_soon_threadsafe(settle)

    def _fail_rooms(self, worker: str, reason: str) -> None:
        """Fail every request paired with `worker` (it died); the other pairs go on serving."""
        with self._plock:
            rooms = {room: self.pairing.rooms[room] for room in self.pairing.rooms_of(worker)}
        for room, pair in rooms.items():
            for partner in pair:  # the survivor of the pair frees what it holds for the room
                if partner != worker:
                    with contextlib.suppress(ConnectionError, OSError):
                        self.workers[partner].send(Abort(room, reason, 503, "worker_unavailable", "router"))
            self._resolve(Result.failed(room, 503, "worker_unavailable", reason))

    # -- failures and restarts (recovery.py) ------------------------------------------------
    def _worker_died(self, link: WorkerLink) -> None:
        """`link`'s connection closed. The first death of a healthy engine decides: restart every
        local worker, or go down; any later one (the survivors the restart stops, a worker of an
        older start, the router stopping) has nothing left to decide."""
        with self._plock:
            decide = link.generation == self.generation and not self._closed
            decide = decide and self.recovery.status is Status.OK
            if decide:
                failure = self._first_failure(link)
                restart = self.recovery.on_failure(failure)
                dead = {w.worker: w.dead_reason or w.death() for w in self.workers.values() if not w.alive()}
        if not decide:
            if self._closed and link.generation == self.generation:
                self._fail_rooms(link.worker, link.dead_reason or link.death())
            return
        # the note names the failure: "restarting ... after REASON", or "REASON; the router will not ..."
        print(f"minigrid: {self.recovery.note}", file=sys.stderr, flush=True)
        threading.Thread(target=self._recover, args=(restart, dead), name="recover", daemon=True).start()

    def _first_failure(self, link: WorkerLink) -> WorkerFailure:
        """The failure to report: of the workers now dead, one that died of something (a signal,
        an error), not one that exited cleanly because its peer's connection closed (call under
        the lock)."""
        dead = [w for w in self.workers.values() if not w.alive() and w.conn is not None]
        failed = [w for w in dead if w.proc is not None and w.proc.poll() not in (None, 0)]
        first = link if any(w is link for w in failed) or not failed else failed[0]
        status = first.proc.poll() if first.proc is not None else None
        return WorkerFailure(first.worker, first.dead_reason or first.death(), status, first.proc is None)

    def _recover(self, restart: bool, dead: dict[str, str]) -> None:
        """Fail what is in flight, stop the survivors, then (`restart`) start every worker again,
        as many times as the restart limit allows."""
        t0 = time.monotonic()  # a restart's time is the outage: from the death to every worker Ready
        self._fail_pending(dead)
        self.collector.keep_counts()  # what the survivors counted, before they are stopped
        self._stop(
            list(self.workers.values()), STOP_GRACE_S, f"stopped by the router after {self.recovery.cause}"
        )
        while restart and not self._closed:
            try:
                self.start_workers()
            except StartupError as exc:
                error = str(exc)
            else:
                with self._plock:
                    gone = [w.death() for w in self.workers.values() if not w.alive()]
                    if not gone and not self._closed:
                        self.pairing = Pairing({role: self.cfg.workers(role) for role in ROLES})
                        self.recovery.restarted(time.monotonic() - t0)
                        break
                error = "; ".join(gone) or "the router is stopping"
                self._stop(list(self.workers.values()), STOP_GRACE_S)
            if self._closed:
                return
            with self._plock:
                restart = self.recovery.start_failed(error)
            print(f"minigrid: {self.recovery.note}", file=sys.stderr, flush=True)
        if restart:
            print(f"minigrid: {self.recovery.note}", file=sys.stderr, flush=True)

    def _fail_pending(self, dead: dict[str, str]) -> None:
        """Fail every request in flight: 503, naming the dead worker and what the router does next."""
        r = self.recovery
        if r.status is Status.RESTARTING:
            then = (
                f"the router is restarting every local worker ({r.counted()}): "
                f"retry in about {r.retry_after_s()} s"
            )
        else:
            then = r.why_not_restart() or "the engine is down"
        with self._plock:
            rooms = {room: self.pairing.rooms.get(room, ()) for room in self._pending}
        for room, pair in rooms.items():
            victim = next((w for w in pair if w in dead), None)
            if victim is not None:
                code, message = "worker_unavailable", f"{dead[victim]}; {then}"
            elif r.status is Status.RESTARTING:
                code = "engine_restarting"
                message = (
                    f"restarting after {r.cause}: this request was in flight on {' and '.join(pair)}, "
                    f"which the restart stops; retry in about {r.retry_after_s()} s"
                )
            else:
                code, message = "engine_down", f"the engine is down after {r.cause}; {then}"
            self._resolve(Result.failed(room, 503, code, message))

    def refusal(self) -> tuple[str, str] | None:
        """(code, message) for a request while the engine restarts or is down, else None."""
        with self._plock:
            return self.recovery.refusal()

    def retry_headers(self, code: str | None) -> dict[str, str] | None:
        """`Retry-After` for a 503 that a restart will cure."""
        if code == "engine_restarting" or (
            code == "worker_unavailable" and self.recovery.status is Status.RESTARTING
        ):
            return {"Retry-After": str(self.recovery.retry_after_s())}
        return None

    def _stop(self, links: list[WorkerLink], grace_s: float = 5, why: str | None = None) -> None:
        """Ask `links`' workers to stop, wait `grace_s`, then kill the local ones still running.
        `why`: what /health then says of each that was still up."""
        for w in links:
            try:
                if w.conn is not None and w.alive():
                    w.send(Shutdown(why or "router stopping"))
                    if why is not None:
                        w.dead_reason = w.dead_reason or f"the {w.name} worker was {why}"
            except (OSError, ConnectionError):
                pass
        deadline = time.monotonic() + grace_s
        for w in links:
            if w.proc is None:  # on another host: Shutdown was its word to stop
                if w.conn is not None:
                    w.conn.close()
                continue
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(timeout=5)
            if w.conn is not None:
                w.conn.close()

    def stop_workers(self, grace_s: float = 5) -> None:
        """Stop every worker for good (the router is stopping: no restart follows)."""
        self._closed = True
        self._stop(list(self.workers.values()), grace_s)

    def links(self, role: str) -> list[WorkerLink]:
        return [w for w in self.workers.values() if w.role == role]

    def query_role(self, role: str, kind: str, **args: Any) -> list[tuple[WorkerLink, Any]]:
        """Ask every live worker of `role`; blocking (call from a thread)."""
        return [(w, self.query(w.worker, kind, **args)) for w in self.links(role) if w.alive()]

    def query(self, worker: str, kind: str, timeout_s: float = 5, **args: Any) -> Any:
        """Ask one worker (by id, e.g. decode-1; a role names its first worker); blocking."""
        worker = worker if worker in self.workers else f"{worker}-0"
        qid = next(self._qids)
        event: threading.Event = threading.Event()
        box: list[Any] = []
        with self._plock:
            self._queries[qid] = (event, box)
        try:
            self.workers[worker].send(Query(qid, kind, args))
            if not event.wait(timeout_s):
                raise TimeoutError(f"{worker} worker did not answer a {kind} query in {timeout_s} s")
            return box[0]
        finally:
            with self._plock:
                self._queries.pop(qid, None)

    def fixes_refusal(self, fixes: Fixes) -> str | None:
        """Why `fixes` cannot be switched on for the running pools, or None when they can."""
        if not fixes.capacity_check:
            return None
        c = self.cfg
        short = [s for s in map(c.short_of_context, ROLES) if s]
        if not short:
            return None
        return (
            "capacity-check cannot be turned on for this running engine: "
            + "; ".join(short)
            + " (it is a deployment check: restart with a larger pool"
            + (", e.g. --preset corrected" if c.corrected_fits else "")
            + "). "
            "Every other fix can be switched live."
        )

    def set_fixes(self, fixes: Fixes, timeout_s: float = 10, drain_s: float = FIX_DRAIN_S) -> dict[str, str]:
        """Switch every worker to `fixes` (blocking; call from a thread). Each worker applies it
        between two steps of its loop and confirms; returns {worker: fixes it confirmed}.

        Between requests only: new requests wait at the door while those in flight finish
        (at most `drain_s`), so that no request is prefilled under one set of fixes and checked by
        decode under another. `FixesBusy` when they are not done by then (nothing switched)."""
        with self._switch_lock:
            return self._set_fixes(fixes, timeout_s, drain_s)

    def _set_fixes(self, fixes: Fixes, timeout_s: float, drain_s: float) -> dict[str, str]:
        waits: list[tuple[str, int, threading.Event, list[Any]]] = []
        with self._plock:
            self._switching = True
        try:
            deadline = time.monotonic() + drain_s
            while True:
                with self._plock:
                    busy = len(self._pending)
                if not busy:
                    break
                if time.monotonic() > deadline:
                    raise FixesBusy(
                        f"the fixes were not switched: {counted(busy, 'request')} still in "
                        f"flight after {drain_s:g} s (a switch waits for them); retry"
                    )
                time.sleep(0.02)
            for link in self.workers.values():  # every worker link, however many per role
                name = link.name
                qid = next(self._qids)
                event: threading.Event = threading.Event()
                box: list[Any] = []
                with self._plock:
                    self._queries[qid] = (event, box)
                waits.append((name, qid, event, box))
                link.send(SetFixes(qid, str(fixes)))
            self.cfg = self.cfg.with_(fixes=fixes)  # what /v1/minigrid/config and /metrics show
            deadline = time.monotonic() + timeout_s
            confirmed: dict[str, str] = {}
            for name, _, event, box in waits:
                if not event.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"the {name} worker did not confirm the fixes in {timeout_s:g} s")
                confirmed[name] = box[0]["fixes"]
            return confirmed
        finally:
            with self._plock:
                self._switching = False
                for _, qid, _, _ in waits:
                    self._queries.pop(qid, None)

    def health(self) -> dict[str, Any]:
        """ok: every worker up; restarting: a worker died and the router is starting them all
        again; down: it will not (the reason is in `recovery`). With the restarts, the last
        failure (which worker, why, when) and what the router did about it."""
        with self._plock:
            links = list(self.workers.values())
            status = self.recovery.status
            workers = {
                w.name: {
                    "up": w.alive(),
                    "pid": w.pid,
                    "worker": w.worker,
                    "role": w.role,
                    "host": w.ready.host if w.ready is not None else None,
                    "error": None if w.alive() else w.dead_reason or "starting",
                }
                for w in links
            }
            if status is Status.OK and not all(w["up"] for w in workers.values()):
                # a death the router has not heard of yet (its connection is about to close)
                status = Status.RESTARTING if self.recovery.why_not_restart() is None else Status.DOWN
            return {"status": status.value, "workers": workers, **self.recovery.to_dict()}

    # -- requests ------------------------------------------------------------------------
    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant whose key is presented (constant-time comparison), or None."""
        scheme, _, key_text = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive (RFC 7235)
            return None
        key = key_text.strip().encode()
        if not key:
            return None
        found = None
        for name, k in self.cfg.tenants.items():
            if hmac.compare_digest(key, k.encode()):
                found = name
        if self.admin_key and hmac.compare_digest(key, self.admin_key.encode()):
            found = found or ADMIN
        return found

    def next_room(self) -> int:
        """A fresh bootstrap room: the id of one request across the router and both workers."""
        return next(self._rooms)

    async def complete(
        self,
        tenant: str,
        ask: Sampling,
        tokens: asyncio.Queue[list[int]] | None = None,
        room: int | None = None,
    ) -> Result:
        """Send one request to a prefill/decode pair and wait for its `Result`. With `tokens`
        (a streamed request), each `Tokens` decode sends is put there as it comes."""
        room = self.next_room() if room is None else room
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Result] = loop.create_future()
        rid = request_id(tenant, room)
        links: list[WorkerLink] = []
        waited = 0.0
        while self._switching and waited < FIX_DRAIN_S + 15:  # the fixes are being switched: wait
            await asyncio.sleep(0.05)
            waited += 0.05
        try:
            with self._plock:
                refusal = self.recovery.refusal()  # a restart sweeps every room registered before it
                if refusal is not None:
                    raise _Refused(*refusal)
                alive = {w.worker for w in self.workers.values() if w.alive()}
                pair = self.pairing.pair(room, alive)  # the bootstrap room's prefill and decode
                links = [self.workers[w] for w in pair]
                self._pending[room] = (loop, fut)
                if tokens is not None:
                    self._streams[room] = tokens
            msg = GenerateRequest(
                room,
                rid,
                tenant,
                ask.prompt_ids,
                ask.max_tokens,
                ask.temperature,
                ask.seed,
                prefill=pair[0],
                decode=pair[1],
                stop=ask.stop,
                stream=tokens is not None,
            )
            for link in links:
                link.send(msg)
        except _Refused as exc:
            return Result.failed(room, 503, exc.code, exc.message, rid, tenant)
        except (ConnectionError, OSError) as exc:
            with self._plock:
                self._forget(room)
            return Result.failed(room, 503, "worker_unavailable", str(exc), rid, tenant)
        try:
            return await fut
        except asyncio.CancelledError:  # the client went away: tell the workers
            with self._plock:
                self._forget(room)
            for link in links:
                with contextlib.suppress(ConnectionError, OSError):
                    link.send(Abort(room, "client disconnected", 499, "client_closed", "router"))
            raise

    # -- the HTTP application ------------------------------------------------------------
    def app(self) -> FastAPI:
        # no redirect of /v1/completions/ to /v1/completions: a 307 with no OpenAI body helps no client
        app = FastAPI(title="minigrid", docs_url=None, redoc_url=None, redirect_slashes=False)
        router = self

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            if exc.status_code == 404:
                return api_error(
                    404, f"no route {request.method} {request.url.path}", "invalid_request_error", "not_found"
                )
            if exc.status_code == 405:
                return api_error(
                    405,
                    f"method {request.method} not allowed on {request.url.path}",
                    "invalid_request_error",
                    "method_not_allowed",
                    headers=dict(exc.headers or {}),  # Allow: the methods the route takes (RFC 9110)
                )
            return api_error(exc.status_code, str(exc.detail), "invalid_request_error")

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
            # A query parameter of the wrong type: name it and what it got (str(exc) would show
            # the handler's source file and line to the client); the key is checked first, as in
            # the handlers, so that a stranger learns nothing of a route's parameters
            if (
                request.url.path.startswith("/v1/")
                and router.tenant_of(request.headers.get("authorization")) is None
            ):
                return unauthorized()
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
            param = loc[-1] if loc else None
            expected = {
                "int_parsing": "an integer",
                "int_parsing_size": "an integer of at most 4,300 digits",
                "missing": "given",
            }.get(first.get("type", ""), "valid")
            got = f", got {shown(first['input'])}" if first.get("type") != "missing" else ""
            return api_error(
                400, f"'{param}' must be {expected}{got}", "invalid_request_error", "invalid_value", param
            )

        def admin_only(what: str) -> JSONResponse:
            return api_error(
                403, f"{what} are shown to the admin key only", "invalid_request_error", "forbidden"
            )

        def busy(code: str, message: str) -> JSONResponse:
            """503 while the engine restarts (with Retry-After) or is down."""
            return api_error(503, message, "server_error", code, headers=router.retry_headers(code))

        def worker_error(exc: Exception) -> JSONResponse:
            """503 for a view whose worker went away while it was asked."""
            why = router.refusal()
            if why is not None:
                return busy(*why)
            return api_error(503, str(exc), "server_error", "worker_unavailable")

        def unauthorized() -> JSONResponse:
            return api_error(
                401,
                "Incorrect or missing API key: send Authorization: Bearer KEY",
                "invalid_request_error",
                "invalid_api_key",
            )

        async def answer(request: Request, kind: str) -> Response:
            """`/v1/completions` (kind TEXT) and `/v1/chat/completions` (kind CHAT)."""
            tenant = router.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                router.requests_total.labels("unauthorized").inc()
                return unauthorized()
            try:
                raw = await read_body(request)
                # a body of megabytes takes a while to parse: off the event loop, so that other
                # clients (and /health) are not kept waiting
                body = parse_json(raw) if len(raw) < 2**16 else await asyncio.to_thread(parse_json, raw)
                ask = router.bodies.chat(body) if kind == oai.CHAT else router.bodies.completion(body)
            except BadRequest as exc:
                router.requests_total.labels("disconnected" if exc.status == 499 else "invalid").inc()
                return api_error(exc.status, exc.message, "invalid_request_error", exc.code, exc.param)
            refusal = router.refusal()
            if refusal is not None:
                router.requests_total.labels("unavailable").inc()
                return busy(*refusal)
            room = router.next_room()
            tokens: asyncio.Queue[list[int]] | None = asyncio.Queue() if ask.stream else None
            work = asyncio.ensure_future(router.complete(tenant, ask, tokens, room))
            # A streamed request answers 200 once its first token is there; an error before that
            # (a rejection, a failed transfer) is still a plain 4xx/5xx.
            first = asyncio.ensure_future(tokens.get()) if tokens is not None else None
            # uvicorn never cancels a handler whose client went away: watch for it, so that the
            # workers hear of it (Router.complete sends the Abort) instead of decoding for nobody.
            gone = asyncio.ensure_future(until_disconnected(request))
            waits: set[asyncio.Future[Any]] = {work, gone} if first is None else {work, gone, first}
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                work.cancel()
                raise
            finally:
                gone.cancel()
            if gone in done and not work.done():
                work.cancel()
                if first is not None:
                    first.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                router.requests_total.labels("disconnected").inc()
                return api_error(
                    499, "the client closed the connection", "invalid_request_error", "client_closed"
                )
            if work.done() and work.result().status != 200:
                if first is not None:
                    first.cancel()
                return failure(work.result(), kind)
            if tokens is None or first is None:
                result = work.result()
                answered(result)
                text = router.tokenizer.decode(result.output_ids)
                return JSONResponse(oai.response(kind, result, text, int(time.time())))
            return StreamingResponse(
                stream(kind, ask, request_id(tenant, room), work, tokens, first),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        def failed(result: Result) -> None:
            router.requests_total.labels("rejected" if result.status < 500 else "aborted").inc()

        def failure(result: Result, kind: str) -> JSONResponse:
            failed(result)
            return api_error(
                result.status,
                result.error or "request failed",
                result.error_type or "server_error",
                result.code,
                oai.error_param(kind, result.code),
                headers=router.retry_headers(result.code) if result.status == 503 else None,
            )

        def answered(result: Result) -> None:
            router.requests_total.labels("ok").inc()
            ttft = result.timings.get("ttft_s")
            if ttft is not None:
                router.ttft.observe(ttft)

        async def stream(
            kind: str,
            ask: Sampling,
            request_id: str,
            work: asyncio.Future[Result],
            tokens: asyncio.Queue[list[int]],
            first: asyncio.Future[list[int]],
        ) -> AsyncIterator[bytes]:
            """Server-sent events: a delta per decoded token (held back where `TextStream` says),
            then the finish, the usage if asked, `[DONE]`. A failure mid-stream is an error event."""
            created = int(time.time())
            text = oai.TextStream(ask.stop)
            pending: asyncio.Future[list[int]] | None = first
            try:
                if kind == oai.CHAT:
                    yield oai.sse(oai.chunk(kind, request_id, created, None, None, ask.include_usage))
                while pending is not None:
                    if not pending.done():
                        both: set[asyncio.Future[Any]] = {pending, work}
                        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                    if pending.done():
                        delta = text.push(pending.result())
                        if delta:
                            yield oai.sse(
                                oai.chunk(kind, request_id, created, delta, None, ask.include_usage)
                            )
                        pending = asyncio.ensure_future(tokens.get())
                    else:  # the Result is in: it has every token, cut at the stop
                        pending.cancel()
                        pending = None
                result = work.result()
                if result.status != 200:
                    failed(result)
                    message, type_ = result.error or "request failed", result.error_type or "server_error"
                    yield oai.sse(error_body(message, type_, result.code, oai.error_param(kind, result.code)))
                else:
                    answered(result)
                    tail = text.finish(result.output_ids)
                    yield oai.sse(
                        oai.chunk(
                            kind, request_id, created, tail or None, result.finish_reason, ask.include_usage
                        )
                    )
                    if ask.include_usage:
                        yield oai.sse(oai.usage_chunk(kind, result, created))
                yield oai.sse("[DONE]")
            finally:
                if pending is not None:
                    pending.cancel()
                if not work.done():  # the client left mid-stream
                    work.cancel()
                    router.requests_total.labels("disconnected").inc()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await answer(request, oai.TEXT)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await answer(request, oai.CHAT)

        def model_card() -> dict[str, Any]:
            return {
                "id": MODEL_ID,
                "object": "model",
                "created": int(router.started_at),
                "owned_by": "minigrid",
                "max_model_len": router.cfg.context_length,
            }

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            if router.tenant_of(request.headers.get("authorization")) is None:
                return unauthorized()
            return JSONResponse({"object": "list", "data": [model_card()]})

        @app.get("/v1/models/{model:path}")
        async def model(request: Request, model: str) -> Response:
            if router.tenant_of(request.headers.get("authorization")) is None:
                return unauthorized()
            if model != MODEL_ID:
                err = oai.unknown_model(model)
                return api_error(err.status, err.message, "invalid_request_error", err.code, err.param)
            return JSONResponse(model_card())

        @app.api_route("/health", methods=["GET", "HEAD"])
        async def health() -> Response:
            h = router.health()
            return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            data = await asyncio.to_thread(generate_latest, router.registry)
            return PlainTextResponse(data.decode(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/minigrid/config")
        async def config(request: Request) -> Response:
            tenant = router.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                return unauthorized()
            c = router.cfg
            return JSONResponse(
                {
                    "model": MODEL_ID,
                    "context_length": c.context_length,
                    "page_size": c.page_size,
                    "prefill_pool_tokens": c.prefill_pool_tokens,
                    "decode_pool_tokens": c.decode_pool_tokens,
                    "fixes": c.fixes.names(),
                    "you": tenant,  # "admin" for the admin key, else the key's tenant
                    # a tenant learns its own name only, never who else the engine serves
                    "tenants": sorted(c.tenants) if tenant == ADMIN else [tenant],
                    # the admin's: it names the weights' path and the hosts' addresses
                    **({"startup_log": router.startup_log} if tenant == ADMIN else {}),
                }
            )

        @app.post("/v1/minigrid/fixes")
        async def switch_fixes(request: Request) -> Response:
            """Admin only: switch the fixes of the running engine, e.g. {"fixes": "none"},
            {"fixes": "reject-before-transfer,owner-check"} or {"fixes": ["owner-check"]}."""
            tenant = router.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                return unauthorized()
            if tenant != ADMIN:
                return api_error(
                    403, "only the admin key may switch the fixes", "invalid_request_error", "forbidden"
                )
            valid = f"none, all, or a list of {', '.join(n for n in FIXES if n in BUILT)}"
            try:
                body = parse_json(await read_body(request, 64 * 1024))
                spec = body.get("fixes") if isinstance(body, dict) else None
                if isinstance(body, dict) and (extra := sorted(set(body) - {"fixes"})):
                    # e.g. {"fixes": "none", "owner-check": true}: a switch the client thinks it made
                    raise BadRequest(
                        f'unknown field {shown(extra[0])}: the body holds only "fixes" ({valid})',
                        "unknown_parameter",
                        extra[0][:60],
                    )
                if isinstance(spec, list) and spec and all(isinstance(n, str) for n in spec):
                    spec = ",".join(spec)
                if not isinstance(spec, str):
                    raise BadRequest(
                        f'send {{"fixes": ...}} with {valid}; got {shown(body)}', "invalid_value", "fixes"
                    )
                try:
                    fixes = parse_fixes(spec, what="fixes")
                except ConfigError as exc:
                    said = str(exc)  # an unknown name's error lists the fixes already: not twice
                    message = said if ", ".join(FIXES) in said else f"{said} (valid: {valid})"
                    raise BadRequest(message, "invalid_value", "fixes") from None
            except BadRequest as exc:
                return api_error(exc.status, exc.message, "invalid_request_error", exc.code, exc.param)
            refusal = router.fixes_refusal(fixes)
            if refusal is not None:
                return api_error(409, refusal, "invalid_request_error", "fix_not_applicable", "fixes")
            if (why := router.refusal()) is not None:
                return busy(*why)
            before = str(router.cfg.fixes)
            try:
                confirmed = await asyncio.to_thread(router.set_fixes, fixes)
            except FixesBusy as exc:
                return api_error(409, str(exc), "invalid_request_error", "fixes_busy", "fixes")
            except (ConnectionError, OSError, TimeoutError) as exc:
                return worker_error(exc)
            log.warning("fixes switched from %s to %s by the admin key", before, fixes)
            print(f"minigrid: fixes switched from {before} to {fixes}", file=sys.stderr, flush=True)
            return JSONResponse({"fixes": fixes.names(), "previous": before, "workers": confirmed})

        @app.get("/v1/minigrid/pools")
        async def pools(request: Request) -> Response:
            tenant = router.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                return unauthorized()
            if tenant != ADMIN:
                return admin_only("the page pools")
            if (why := router.refusal()) is not None:
                return busy(*why)
            # one list per role; each page names its worker (each worker has its own pool)
            try:
                snaps = {}
                for role in ROLES:
                    answers = await asyncio.to_thread(router.query_role, role, "pool")
                    snaps[role] = [p for _, ps in answers for p in ps]
            except (ConnectionError, OSError, TimeoutError) as exc:
                return worker_error(exc)
            return JSONResponse(snaps)

        @app.get("/v1/minigrid/integrity")
        async def integrity(request: Request) -> Response:
            tenant = router.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                return unauthorized()
            if tenant != ADMIN:
                return admin_only("the pool integrity checks")
            if (why := router.refusal()) is not None:
                return busy(*why)
            try:
                checks = {role: await asyncio.to_thread(router.integrity, role) for role in ROLES}
            except (ConnectionError, OSError, TimeoutError) as exc:
                return worker_error(exc)
            return JSONResponse({"ok": all(c["ok"] for c in checks.values()), **checks})

        @app.get("/v1/minigrid/trace")
        async def trace(
            request: Request, since: int = 0, role: str | None = None, worker: str | None = None
        ) -> Response:
            tenant = router.tenant_of(request.headers.get("authorization"))
            if tenant is None:
                return unauthorized()
            if role is not None and role not in ROLES:
                return api_error(
                    400,
                    f"role {shown(role)}: choose prefill or decode",
                    "invalid_request_error",
                    "invalid_value",
                    "role",
                )
            if worker is not None and worker not in router.workers:
                return api_error(
                    400,
                    f"worker {shown(worker)}: choose one of {', '.join(router.workers)}",
                    "invalid_request_error",
                    "invalid_value",
                    "worker",
                )
            if (why := router.refusal()) is not None:
                return busy(*why)
            only = None if tenant == ADMIN else tenant
            # each worker numbers its own events: `since` with `worker` (or `role`, when the role
            # has one worker) pages through one of them; every event names its worker
            try:
                events = {
                    r: await asyncio.to_thread(router.trace_of, r, worker, since=since, tenant=only)
                    for r in (ROLES if role is None else (role,))
                }
            except (ConnectionError, OSError, TimeoutError) as exc:
                return worker_error(exc)
            if only is not None:
                events = {r: tenant_view(evs, only) for r, evs in events.items()}
            return JSONResponse(events)

        return app

    def integrity(self, role: str) -> dict[str, Any]:
        """Each worker's pool check: free + owned = total, no page held twice (blocking)."""
        checks = {}
        for w in self.links(role):
            if not w.alive():
                down = f"the {w.name} worker is down"
                checks[w.worker] = {"ok": False, "error": down, "pages_in_use": None}
            else:
                checks[w.worker] = self.query(w.worker, "integrity")
        bad = [f"{w}: {c['error']}" for w, c in checks.items() if not c["ok"]]
        return {
            "ok": not bad,
            "error": "; ".join(bad) or None,
            "pages_in_use": sum(c["pages_in_use"] or 0 for c in checks.values()),
            "workers": checks,
        }

    def trace_of(self, role: str, worker: str | None, **args: Any) -> list[dict[str, Any]]:
        """`role`'s events, worker after worker (each in its own order), or one worker's (blocking)."""
        return [
            e
            for w in self.links(role)
            if w.alive() and worker in (None, w.worker)
            for e in self.query(w.worker, "trace", **args)
        ]


class _PoolCollector:
    """Reads each worker's pool and counters at scrape time (fresh numbers, never cached).

    A worker's counters live in its process and start again from 0 when it is restarted; the
    collector keeps what each process had counted at its last scrape, and folds it into the totals
    when a new process (another pid) answers for that worker, so that a counter never goes down
    while the router runs. What a process counted after its last scrape dies with it."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._lock = threading.Lock()
        self._last: dict[str, tuple[Any, collections.Counter[str]]] = {}  # worker -> (pid, its counters)
        # counted by worker processes since replaced by new ones
        self._retired: collections.Counter[str] = collections.Counter()

    def _counted(self, worker: str, pid: Any, counters: dict[str, float]) -> None:
        with self._lock:
            before = self._last.get(worker)
            if before is not None and before[0] != pid:
                self._retired.update(before[1])
            self._last[worker] = (pid, collections.Counter(counters))

    def keep_counts(self) -> None:
        """Read the counters of every worker still alive (a restart is about to stop them)."""
        for w in self.router.workers.values():
            if w.alive():
                with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                    stats = self.router.query(w.worker, "stats", timeout_s=1)
                    self._counted(w.worker, stats.get("pid"), stats.get("counters", {}))

    def _totals(self) -> collections.Counter[str]:
        with self._lock:
            out = self._retired.copy()
            for _, counters in self._last.values():
                out.update(counters)
            return out

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        r = self.router
        cap = GaugeMetricFamily(
            "minigrid_kv_pool_capacity_tokens", "KV pool capacity in tokens", labels=["role"]
        )
        pages = GaugeMetricFamily("minigrid_kv_pool_pages", "KV pool size in pages", labels=["role"])
        used = GaugeMetricFamily("minigrid_kv_pages_in_use", "KV pages held by requests", labels=["role"])
        per = ["role", "worker"]
        up = GaugeMetricFamily("minigrid_worker_up", "1 when the worker process is alive", labels=per)
        w_cap = GaugeMetricFamily(
            "minigrid_worker_kv_pool_capacity_tokens", "One worker's KV pool capacity in tokens", labels=per
        )
        w_used = GaugeMetricFamily("minigrid_worker_kv_pages_in_use", "KV pages in use", labels=per)
        w_out = GaugeMetricFamily(
            "minigrid_worker_requests_outstanding", "Requests paired with the worker", labels=per
        )
        for role in ROLES:
            links = r.links(role)
            ready = [w.ready for w in links if w.ready is not None]
            if ready:
                cap.add_metric([role], min(x.capacity_tokens for x in ready))
                pages.add_metric([role], min(x.n_pages for x in ready))
            in_use: float | None = None
            for w in links:
                labels = [role, w.worker]
                up.add_metric(labels, 1.0 if w.alive() else 0.0)
                w_out.add_metric(labels, r.pairing.outstanding.get(w.worker, 0))
                if w.ready is not None:
                    w_cap.add_metric(labels, w.ready.capacity_tokens)
                if not w.alive():
                    continue
                try:
                    stats = r.query(w.worker, "stats", timeout_s=2)
                except (TimeoutError, ConnectionError, OSError):
                    continue
                w_used.add_metric(labels, stats["pages_in_use"])
                in_use = (in_use or 0) + stats["pages_in_use"]
                self._counted(w.worker, stats.get("pid"), stats["counters"])
            if in_use is not None:
                used.add_metric([role], in_use)
        yield cap
        yield pages
        yield used
        yield up
        yield w_cap
        yield w_used
        yield w_out
        ctx = GaugeMetricFamily("minigrid_context_length_tokens", "Advertised context length in tokens")
        ctx.add_metric([], r.cfg.context_length)
        yield ctx
        on = GaugeMetricFamily(
            "minigrid_fix_enabled", "1 when the fix is on (switchable live)", labels=["fix"]
        )
        names = r.cfg.fixes.names()
        for fix in FIXES:
            on.add_metric([fix], 1.0 if fix in names else 0.0)
        yield on
        restarts = CounterMetricFamily(
            "minigrid_worker_restarts", "Restarts of every local worker after one died (recovery.py)"
        )
        restarts.add_metric([], r.recovery.restarts)
        yield restarts
        page = GaugeMetricFamily("minigrid_kv_page_size_tokens", "Tokens per KV page")
        page.add_metric([], r.cfg.page_size)
        yield page
        # Counted by the fixes that detect them; they stay at zero while those fixes are off.
        counters = self._totals()
        for name, key, doc in (
            (
                "minigrid_kv_checksum_mismatches",
                "checksum_mismatches",
                "KV pages whose checksum did not match",
            ),
            (
                "minigrid_owner_check_violations",
                "owner_check_violations",
                "Page reads by a request that was not the page's last writer",
            ),
            (
                "minigrid_prefill_stubbed_requests",
                "stubbed",
                "Prompts too long for the prefill pool that went on as a one-token stub, the incident's "
                "path (a prompt reject-before-transfer refuses is counted rejected, not here)",
            ),
        ):
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], counters.get(key, 0.0))
            yield fam
