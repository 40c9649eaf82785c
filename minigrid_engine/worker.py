"""A worker process: one role (prefill or decode), its pool, its scheduler, its connections.

    python -m minigrid_engine.worker --role prefill --router 127.0.0.1:PORT --peer-port P --dist-port D

Started by `minigrid serve` (never by hand). The control connections are
`multiprocessing.connection` sockets authenticated with the key in ``MINIGRID_AUTHKEY``; page
data goes over `torch.distributed`. A worker exits when the router's connection closes, so an
engine killed hard leaves no orphans.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

import torch

from minigrid_engine.config import ServeConfig
from minigrid_engine.decode import DecodeScheduler
from minigrid_engine.errors import PoolError
from minigrid_engine.fixes import parse_fixes
from minigrid_engine.messages import (
    Abort,
    AbortAck,
    Bootstrapped,
    GenerateRequest,
    KVBootstrap,
    Query,
    QueryReply,
    Ready,
    SetFixes,
    Shutdown,
    TransferBegin,
    TransferDone,
)
from minigrid_engine.model import load_model
from minigrid_engine.pool import KVPool, PoolConfig
from minigrid_engine.prefill import PrefillScheduler, TransferJob
from minigrid_engine.trace import Trace
from minigrid_engine.transfer import DistTransport, page_data

log = logging.getLogger("minigrid.worker")


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float = 30) -> Connection:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class LockedConn:
    """A connection several threads may send on."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: object) -> None:
        with self.lock:
            self.conn.send(msg)


class Worker:
    def __init__(
        self, role: str, cfg: ServeConfig, router: Connection, peer: Connection, transport: DistTransport
    ) -> None:
        self.role = role
        self.cfg = cfg
        self.router = LockedConn(router)
        self.peer = LockedConn(peer)
        self.transport = transport
        model = load_model(cfg.weights, device=cfg.device)
        tokens = cfg.prefill_pool_tokens if role == "prefill" else cfg.decode_pool_tokens
        self.pool = KVPool(
            PoolConfig(tokens, cfg.page_size),
            model.cfg,
            role,
            Trace(role, cfg.trace_maxlen),
            cfg.device,
            scrub_on_free=cfg.fixes.scrub_on_free,
        )
        self.scheduler: PrefillScheduler | DecodeScheduler
        if role == "prefill":
            self.scheduler = PrefillScheduler(cfg, model, self.pool, self.router.send, self.peer.send)
            self.sent: queue.Queue[int] = queue.Queue()
            self.jobs: queue.Queue[TransferJob | None] = queue.Queue()
            threading.Thread(target=self._sender, name="kv-sender", daemon=True).start()
        else:
            self.scheduler = DecodeScheduler(cfg, model, self.pool, self.router.send, self.peer.send)
        self.stopping = False

    # -- prefill's sender thread: TransferBegin, the page data, TransferDone, in that order --
    def _sender(self) -> None:
        held: list[tuple[float, TransferJob]] = []  # injected delays: sent later, others go on
        while True:
            wait_s = max(0.0, min(due for due, _ in held) - time.time()) if held else None
            try:
                job = self.jobs.get(timeout=wait_s)
            except queue.Empty:
                job = None
            else:
                if job is None:
                    return
            ready: list[TransferJob] = []
            if job is not None and job.delay_s > 0:
                held.append((time.time() + job.delay_s, job))
            elif job is not None:
                ready.append(job)
            now = time.time()
            ready += [j for due, j in held if due <= now]
            held = [(due, j) for due, j in held if due > now]
            for j in ready:
                if j.ack_only:  # deferred-release: drop what is held for the room, then acknowledge
                    held = [(due, h) for due, h in held if h.room != j.room]
                    self.peer.send(AbortAck(j.room))
                else:
                    self._send_job(j)

    def _send_job(self, job: TransferJob) -> None:
        assert isinstance(self.scheduler, PrefillScheduler)
        if job.room in self.scheduler.cancelled:
            pass  # decode gave up on it (deferred-release): nothing goes out
        elif time.time() > job.deadline:
            # deferred-release: a transfer that cannot start within the timeout is not started.
            self.peer.send(TransferDone(job.room, False, error="transfer deadline passed before it started"))
        else:
            assert job.begin is not None and job.done is not None
            data = page_data(self.pool, job.src_pages)
            with self.peer.lock:
                self.peer.conn.send(job.begin)
                self.transport.send(data)
                if not job.drop_done:
                    self.peer.conn.send(job.done)
                if job.duplicate_done:
                    self.peer.conn.send(job.done)
        self.sent.put(job.room)

    # -- messages ------------------------------------------------------------------------
    def handle(self, msg: Any, from_peer: bool) -> None:
        s = self.scheduler
        if isinstance(msg, GenerateRequest):
            s.on_generate(msg)
        elif isinstance(msg, Abort):
            s.on_abort(msg)
        elif isinstance(msg, Query):
            self.router.send(QueryReply(msg.qid, self.query(msg)))
        elif isinstance(msg, SetFixes):
            self.set_fixes(msg)
        elif isinstance(msg, Shutdown):
            self.stopping = True
        elif isinstance(msg, KVBootstrap) and isinstance(s, PrefillScheduler):
            s.on_kv_bootstrap(msg)
        elif isinstance(msg, Bootstrapped) and isinstance(s, DecodeScheduler):
            s.on_bootstrapped(msg)
        elif isinstance(msg, TransferBegin) and isinstance(s, DecodeScheduler):
            mc = self.pool.model_cfg
            like = torch.empty(
                2,
                mc.n_layers,
                len(msg.dst_pages),
                self.pool.page_size,
                mc.n_kv_heads,
                mc.head_dim,
                dtype=self.pool.k.dtype,
                device=self.pool.k.device,
            )
            s.on_transfer_begin(msg, self.transport.recv(like))
        elif isinstance(msg, TransferDone) and isinstance(s, DecodeScheduler):
            s.on_transfer_done(msg)
        elif isinstance(msg, AbortAck) and isinstance(s, DecodeScheduler):
            s.on_abort_ack(msg)
        else:
            log.warning("%s worker: unexpected message %r", self.role, msg)

    def set_fixes(self, msg: SetFixes) -> None:
        """Switch the fixes live. Called from the loop between two steps, so no batch runs with a
        mix; a request already in flight meets the new fixes at its next step on each role. The
        router has already refused what cannot hold here (capacity-check on a too-small pool)."""
        fixes = parse_fixes(msg.fixes)
        self.cfg = self.cfg.with_(fixes=fixes)
        self.pool.scrub_on_free = fixes.scrub_on_free
        s = self.scheduler
        s.cfg, s.fixes = self.cfg, fixes
        if isinstance(s, DecodeScheduler):
            s.runner.owner_check = fixes.owner_check
        log.info("%s worker: fixes now %s", self.role, fixes)
        self.router.send(QueryReply(msg.qid, {"role": self.role, "fixes": str(fixes)}))

    def query(self, q: Query) -> Any:
        if q.kind == "stats":
            return self.stats()
        if q.kind == "pool":
            return self.pool.snapshot()
        if q.kind == "integrity":  # between two steps of this loop: the pool is at rest
            try:
                self.pool.check_integrity()
            except PoolError as exc:
                return {"ok": False, "error": str(exc), "pages_in_use": self.pool.pages_in_use}
            return {"ok": True, "error": None, "pages_in_use": self.pool.pages_in_use}
        if q.kind == "trace":
            tenant = q.args.get("tenant")
            events = self.pool.trace.events(since=int(q.args.get("since", 0)))
            return [e.to_dict() for e in events if tenant is None or e.tenant == tenant]
        return {"error": f"unknown query {q.kind!r}"}

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        queues = (
            {"bootstrap": len(s.bootstrap_queue), "waiting": len(s.waiting), "inflight": len(s.inflight)}
            if isinstance(s, PrefillScheduler)
            else {"prealloc": len(s.prealloc), "transfer": len(s.transfer), "running": len(s.running)}
        )
        return {
            "role": self.role,
            "pid": os.getpid(),
            "capacity_tokens": self.pool.capacity_tokens,
            "page_size": self.pool.page_size,
            "pages": self.pool.n_pages,
            "pages_in_use": self.pool.pages_in_use,
            "tokens_reserved": self.pool.tokens_reserved,
            "queues": queues,
            "counters": dict(s.counters),
            "trace_next_seq": self.pool.trace.next_seq,
        }

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        conns = [self.router.conn, self.peer.conn]
        busy = False
        while not self.stopping:
            for conn in wait(conns, timeout=0 if busy else 0.02):
                assert isinstance(conn, Connection)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    who = "router" if conn is self.router.conn else "peer"
                    log.error("%s worker: the %s connection closed; exiting", self.role, who)
                    return
                self._guarded(self.handle, msg, conn is self.peer.conn)
            busy = bool(self._guarded(self._step))

    def _step(self) -> bool:
        s = self.scheduler
        if isinstance(s, PrefillScheduler):
            while True:
                try:
                    s.on_transfer_sent(self.sent.get_nowait())
                except queue.Empty:
                    break
            busy = s.step()
            while s.transfers:
                self.jobs.put(s.transfers.popleft())
            return busy
        return s.step()

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """Run `fn`; a bug fails the requests in flight (with the reason), never the worker."""
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("%s worker: internal error", self.role)
            self.scheduler.fail_all(f"internal error in the {self.role} worker: {type(exc).__name__}: {exc}")
            return False

    def close(self) -> None:
        if self.role == "prefill":
            self.jobs.put(None)
        self.transport.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a minigrid worker process (started by `minigrid serve`)")
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--router", required=True, help="HOST:PORT of the router's listener")
    p.add_argument("--peer-port", type=int, required=True, help="prefill's bootstrap port")
    p.add_argument("--dist-port", type=int, required=True, help="torch.distributed rendezvous port")
    p.add_argument("--config", required=True, help="ServeConfig as JSON")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {a.role}: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router decides when workers stop
    authkey = bytes.fromhex(os.environ["MINIGRID_AUTHKEY"])
    cfg = ServeConfig.from_json(a.config)
    torch.set_num_threads(max(1, cfg.worker_threads))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print(
            f"--device cuda: no CUDA device is visible to the {a.role} worker (torch {torch.__version__})",
            file=sys.stderr,
            flush=True,
        )
        return 3
    if cfg.fixes.capacity_check:
        # Fix `capacity-check`: the deployment check, made by the role from its own pool.
        tokens = cfg.prefill_pool_tokens if a.role == "prefill" else cfg.decode_pool_tokens
        if tokens < cfg.context_length:
            print(
                f"capacity-check: the {a.role} KV pool holds {tokens} tokens, fewer than the context "
                f"length of {cfg.context_length} tokens: a valid prompt would not fit. Raise "
                f"--{a.role}-pool-tokens to at least {cfg.context_length} (--preset corrected) or lower "
                f"--context-length; --fixes none runs the faulty configuration on purpose.",
                file=sys.stderr,
                flush=True,
            )
            return 3
    router = _connect(_addr(a.router), authkey)
    peer_addr = (cfg.transfer_host, a.peer_port)
    if a.role == "prefill":
        with Listener(peer_addr, authkey=authkey) as listener:
            peer = listener.accept()
    else:
        peer = _connect(peer_addr, authkey)
    transport = DistTransport(a.role, cfg.transfer_host, a.dist_port, cfg.device)
    worker = Worker(a.role, cfg, router, peer, transport)
    line = worker.pool.describe()  # the router prints it: the startup line operators read
    router.send(
        Ready(
            a.role,
            os.getpid(),
            worker.pool.capacity_tokens,
            worker.pool.page_size,
            worker.pool.n_pages,
            [line],
        )
    )
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
