"""A worker process: one role (prefill or decode), its pool, its scheduler, its connections.

    python -m minigrid_engine.worker --role prefill --index 0 --router 127.0.0.1:PORT \
        --peer-ports P0,P1 --dist-port D --config JSON

Started by `minigrid serve`, or on another host by `minigrid worker` (see `remote_main`), which
asks the router for its slot and configuration instead. The control connections are
`multiprocessing.connection` sockets authenticated with the key in ``MINIGRID_AUTHKEY`` (or
``--authkey-file``); page data goes over `torch.distributed`. Each decode worker holds one
connection to every prefill worker; every message of a room goes to the worker the router paired
with this one for it. A worker exits when the router's connection closes, so an engine killed
hard leaves no orphans.
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
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

import torch

from minigrid_engine.config import ServeConfig
from minigrid_engine.decode import DecodeScheduler
from minigrid_engine.errors import REFUSAL_MARK, REFUSED_TO_START, ConfigError, PoolError
from minigrid_engine.fixes import parse_fixes
from minigrid_engine.messages import (
    Abort,
    AbortAck,
    Assign,
    Bootstrapped,
    GenerateRequest,
    Join,
    KVBootstrap,
    PeerHello,
    Query,
    QueryReply,
    Ready,
    RecentRooms,
    SetFixes,
    Shutdown,
    TransferBegin,
    TransferDone,
)
from minigrid_engine.model import ModelConfig, default_weights_path, load_model
from minigrid_engine.pool import KVPool, PoolConfig
from minigrid_engine.prefill import LATE, PrefillScheduler, TransferJob
from minigrid_engine.trace import Trace
from minigrid_engine.transfer import DistTransport, page_data

log = logging.getLogger("minigrid.worker")


def _addr(text: str, flag: str = "--router") -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f"{flag} {text!r} must be HOST:PORT with a port from 0 to 65535, e.g. 10.0.0.1:7100"
        )
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


class Peers:
    """This worker's connections to the other role's workers, and which of them each room is
    paired with (the router names the pair in the room's `GenerateRequest`)."""

    def __init__(self) -> None:
        self.conns: dict[str, LockedConn] = {}
        self.ranks: dict[str, int] = {}
        self.hosts: dict[str, str] = {}
        self.rooms: RecentRooms[str] = RecentRooms()  # who each recent room was paired with

    def add(self, worker: str, rank: int, conn: Connection, host: str) -> None:
        self.conns[worker], self.ranks[worker], self.hosts[worker] = LockedConn(conn), rank, host

    def pair(self, room: int, worker: str) -> None:
        if worker not in self.conns:
            raise KeyError(f"room {room} is paired with {worker!r}, not a peer of this worker")
        self.rooms[room] = worker

    def of(self, room: int) -> str:
        worker = self.rooms.get(room)
        if worker is None:
            if len(self.conns) == 1:
                return next(iter(self.conns))
            raise KeyError(f"room {room} is paired with no peer")
        return worker

    def conn(self, room: int) -> LockedConn:
        return self.conns[self.of(room)]

    def send(self, msg: Any) -> None:
        """Send a room's message to the worker paired with this one for that room."""
        try:
            conn = self.conn(msg.room)
        except KeyError as exc:  # a room this worker never heard of: nobody to tell
            log.warning("dropped %s: %s", type(msg).__name__, exc)
            return
        conn.send(msg)


class Worker:
    def __init__(
        self,
        worker_id: str,
        role: str,
        cfg: ServeConfig,
        router: Connection,
        peers: Peers,
        transport: DistTransport,
        address: str,
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.cfg = cfg
        self.address = address
        self.router = LockedConn(router)
        self.peers = peers
        self.transport = transport
        model = load_model(cfg.weights, device=cfg.device)
        weights = cfg.weights or default_weights_path()
        self.model_line = (
            f"{role} model: {sum(t.numel() for t in model.parameters()):,} parameters from {weights}"
        )
        tokens = cfg.pool_tokens(role)
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
            self.scheduler = PrefillScheduler(cfg, model, self.pool, self.router.send, self.peers.send)
            self.sent: queue.Queue[int] = queue.Queue()
            self.jobs: queue.Queue[TransferJob | None] = queue.Queue()
            threading.Thread(target=self._sender, name="kv-sender", daemon=True).start()
        else:
            self.scheduler = DecodeScheduler(cfg, model, self.pool, self.router.send, self.peers.send)
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
                    self.peers.send(AbortAck(j.room))
                else:
                    try:
                        self._send_job(j)
                    except Exception:  # a peer gone mid-transfer: this room fails, the sender goes on
                        log.exception("%s: the transfer of room %d failed", self.worker_id, j.room)

    def _send_job(self, job: TransferJob) -> None:
        try:
            self._transfer(job)
        finally:
            self.sent.put(job.room)  # its pages go back to the pool, sent or not

    def _transfer(self, job: TransferJob) -> None:
        assert isinstance(self.scheduler, PrefillScheduler)
        verdict = self.scheduler.outgoing(job, time.time())
        if verdict == "late":
            self.peers.send(TransferDone(job.room, False, error=LATE))
        elif verdict == "send":
            assert job.begin is not None and job.done is not None
            data = page_data(self.pool, job.src_pages)
            decode = self.peers.of(job.room)
            peer = self.peers.conns[decode]
            with peer.lock:
                for step in job.steps:  # "data", "done"; an injected fault reorders or drops (faults.py)
                    if step == "data":
                        peer.conn.send(job.begin)
                        self.transport.send(data, self.peers.ranks[decode])
                    else:
                        peer.conn.send(job.done)

    # -- messages ------------------------------------------------------------------------
    def handle(self, msg: Any, peer: str | None) -> None:
        """One message, from the router (`peer` None) or from the peer worker named `peer`."""
        s = self.scheduler
        if isinstance(msg, GenerateRequest):
            self.peers.pair(msg.room, msg.decode if self.role == "prefill" else msg.prefill)
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
            src = peer or self.peers.of(msg.room)  # page data follows on the pair it was announced on
            s.on_transfer_begin(
                msg, self.transport.recv(like, self.peers.ranks[src]), peer=f"{src}@{self.peers.hosts[src]}"
            )
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
        me = {"worker": self.worker_id}
        if q.kind == "pool":
            return [{**p, **me} for p in self.pool.snapshot()]
        if q.kind == "integrity":  # between two steps of this loop: the pool is at rest
            try:
                self.pool.check_integrity()
                orphans = sorted(set(self.pool.holders()) - self.scheduler.tracked())
                if orphans:  # pages nobody will ever release: a leak, whatever the counts say
                    held = ", ".join(f"{r} ({len(self.pool.reservation(r).pages)} pages)" for r in orphans)
                    raise PoolError(
                        f"{self.role} pool: pages held by requests this worker no longer tracks: {held}"
                    )
            except PoolError as exc:
                return {"ok": False, "error": str(exc), "pages_in_use": self.pool.pages_in_use, **me}
            return {"ok": True, "error": None, "pages_in_use": self.pool.pages_in_use, **me}
        if q.kind == "trace":
            tenant = q.args.get("tenant")
            events = self.pool.trace.events(since=int(q.args.get("since", 0)))
            return [{**e.to_dict(), **me} for e in events if tenant is None or e.tenant == tenant]
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
            "worker": self.worker_id,
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
        peer_of = {c.conn: w for w, c in self.peers.conns.items()}
        conns = [self.router.conn, *peer_of]
        busy = False
        while not self.stopping:
            for conn in wait(conns, timeout=0 if busy else 0.02):
                assert isinstance(conn, Connection)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if conn is self.router.conn or len(conns) == 2:  # the router, or the last peer
                        who = "router" if conn is self.router.conn else f"{peer_of[conn]} peer"
                        log.error("%s: the %s connection closed; exiting", self.worker_id, who)
                        return
                    # one peer of several is gone: its rooms fail through the router; serve the rest
                    log.error("%s: the %s peer connection closed", self.worker_id, peer_of[conn])
                    conns.remove(conn)
                    continue
                self._guarded(self.handle, msg, peer_of.get(conn))
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


def _refuse_to_start(role: str, cfg: ServeConfig) -> str | None:
    """Why this worker must not start (one line for the operator), or None."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return f"--device cuda: no CUDA device is visible to the {role} worker (torch {torch.__version__})"
    tokens = cfg.pool_tokens(role)
    if cfg.device == "cpu":
        try:
            pool = PoolConfig(tokens, cfg.page_size)
        except ConfigError as exc:  # a pool the pool module refuses: one line, not a traceback
            return f"the {role} worker cannot start: {exc}"
        need, have = pool.nbytes(ModelConfig()), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            return (
                f"--{role}-pool-tokens {tokens}: {pool.describe(ModelConfig(), role)} needs "
                f"{need / 2**30:,.1f} GiB, more than this machine's {have / 2**30:,.1f} GiB of memory"
            )
    # Fix `capacity-check`: the deployment check, made by the role from its own pool (serve makes
    # it too, before any worker starts, so that the reason is said once for every role).
    if cfg.fixes.capacity_check:
        return cfg.capacity_refusal([role])
    return None


def run_worker(
    role: str,
    index: int,
    cfg: ServeConfig,
    router: Connection,
    authkey: bytes,
    peer_ports: list[int],
    dist_port: int,
    address: str | None = None,
) -> int:
    """Join the peers and the torch.distributed group, say Ready, serve until told to stop."""
    worker_id, rank = f"{role}-{index}", cfg.rank(role, index)
    address = address or cfg.transfer_host  # where this worker's page data leaves or arrives
    peers = Peers()
    if role == "prefill":
        with Listener((cfg.transfer_host, peer_ports[index]), authkey=authkey) as listener:
            joined = 0
            while joined < cfg.decode_workers:
                try:
                    conn = listener.accept()
                except (AuthenticationError, EOFError, ConnectionError) as exc:  # not a peer: next
                    log.warning("%s: refused a connection to the KV transfer port: %r", worker_id, exc)
                    continue
                joined += 1
                hello = conn.recv()
                if not isinstance(hello, PeerHello):
                    raise RuntimeError(f"{worker_id}: a peer said {hello!r} instead of PeerHello")
                peers.add(hello.worker, hello.rank, conn, hello.host)
    else:
        for i, port in enumerate(peer_ports):
            conn = _connect((cfg.transfer_host, port), authkey)
            conn.send(PeerHello(worker_id, rank, address))
            peers.add(f"prefill-{i}", cfg.rank("prefill", i), conn, cfg.transfer_host)
    transport = DistTransport(rank, cfg.world_size, cfg.transfer_host, dist_port, cfg.device, bind=address)
    worker = Worker(worker_id, role, cfg, router, peers, transport, address)
    lines = [worker.pool.describe(), worker.model_line]  # the router prints them at startup
    router.send(
        Ready(
            role,
            os.getpid(),
            worker.pool.capacity_tokens,
            worker.pool.page_size,
            worker.pool.n_pages,
            lines,
            worker_id,
            address,
        )
    )
    try:
        worker.run()
    finally:
        worker.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a minigrid worker process (started by `minigrid serve`)")
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--index", type=int, default=0, help="which worker of its role (0)")
    p.add_argument("--router", required=True, help="HOST:PORT of the router's listener")
    p.add_argument("--peer-ports", required=True, help="prefill workers' bootstrap ports, comma-separated")
    p.add_argument("--dist-port", type=int, required=True, help="torch.distributed rendezvous port")
    p.add_argument("--config", required=True, help="ServeConfig as JSON")
    a = p.parse_args(argv)
    name = f"{a.role}-{a.index}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}: %(message)s", stream=sys.stderr)
    # The router decides when its workers stop (and stops them, asking first, when it is told to):
    # Ctrl-C or `kill -TERM` to the whole process group, as systemd and `timeout` send it, must
    # not look like a worker crash to restart. A worker whose router is gone exits on its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    authkey = bytes.fromhex(os.environ["MINIGRID_AUTHKEY"])
    cfg = ServeConfig.from_json(a.config)
    torch.set_num_threads(max(1, cfg.worker_threads))
    refusal = _refuse_to_start(a.role, cfg)
    if refusal is not None:
        print(REFUSAL_MARK + refusal, file=sys.stderr, flush=True)
        return REFUSED_TO_START
    router = _connect(_addr(a.router), authkey)
    ports = [int(x) for x in a.peer_ports.split(",")]
    try:
        return run_worker(a.role, a.index, cfg, router, authkey, ports, a.dist_port)
    except ConfigError as exc:  # e.g. a pool the device cannot hold: one line, not a traceback
        print(f"{REFUSAL_MARK}the {name} worker cannot start: {exc}", file=sys.stderr, flush=True)
        return REFUSED_TO_START


def remote_main(
    role: str, router_addr: str, authkey: bytes, address: str | None, index: int | None, timeout_s: float
) -> int:
    """`minigrid worker`: a worker on another host. It connects to the router (authenticated),
    asks for a slot of `role`, and gets the slot, the configuration and the peers' ports."""
    try:
        router = _connect(_addr(router_addr), authkey, timeout_s)
    except AuthenticationError:
        print(
            f"minigrid worker: the router at {router_addr} refused this worker's key: use the file the "
            "router was started with (--authkey-file)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    except OSError as exc:  # refused until the deadline, or a name that does not resolve
        why = (
            f"nothing listened there for {timeout_s:g} s"
            if isinstance(exc, ConnectionRefusedError)
            else exc.strerror or str(exc)
        )
        print(
            f"minigrid worker: cannot reach a router at {router_addr} ({why}): start it with "
            f"--worker-listen {router_addr}, or give --router the address it listens on",
            file=sys.stderr,
            flush=True,
        )
        return 2
    router.send(Join(role, index, address or ""))
    got = router.recv()
    if not isinstance(got, Assign):
        raise RuntimeError(f"the router said {got!r} instead of assigning a slot")
    if got.error is not None:
        print(f"minigrid worker: the router refused this worker: {got.error}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {got.worker}: %(message)s", stream=sys.stderr, force=True
    )
    try:  # the router's settings, on this host: e.g. its weights path may not exist here
        cfg = ServeConfig.from_json(got.config)
        refusal = _refuse_to_start(role, cfg)
    except ConfigError as exc:
        refusal = f"the {role} worker cannot start on this host: {exc}"
    if refusal is not None:
        print(refusal, file=sys.stderr, flush=True)
        router.close()
        return REFUSED_TO_START
    torch.set_num_threads(max(1, cfg.worker_threads))
    log.info("joined the router at %s as %s; page data from %s", router_addr, got.worker, address)
    return run_worker(role, got.index, cfg, router, authkey, got.peer_ports, got.dist_port, address)


if __name__ == "__main__":
    sys.exit(main())
