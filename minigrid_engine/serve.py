"""`minigrid serve`: start the router (this process) and the two worker processes, serve until stopped.

SIGINT or SIGTERM stops the HTTP server, then the workers (asked first, killed after a grace
period); one while the workers start stops them and exits 128 + the signal (130, 143). If this
process is killed outright, the workers see their connection close and exit.
Started by a notebook (`MINIGRID_EXIT_WITH_PARENT=1`), it also stops when its parent dies, so a
restarted or killed notebook kernel leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from minigrid_engine.config import ROLES, ServeConfig
from minigrid_engine.errors import ConfigError
from minigrid_engine.router import REFUSED_TAIL, Router


class Terminated(KeyboardInterrupt):
    """SIGTERM while the workers start: stopped as Ctrl-C is, and the exit status says which."""

    signum = signal.SIGTERM


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would kill this process
    before it stops the workers; here a signal only asks the server to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def stop(sig: int, frame: FrameType | None) -> None:
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def _tenants_line(tenants: dict[str, str]) -> str:
    names = sorted(tenants)
    return ", ".join(names) if len(names) <= 6 else f"{len(names)} ({names[0]} .. {names[-1]})"


def serve(
    cfg: ServeConfig,
    ready_file: Path | None = None,
    on_listening: Callable[[str], list[str]] | None = None,
    authkey: bytes | None = None,
) -> int:
    """Serve until stopped. `on_listening(url)` runs once the socket is bound, before the first
    request is served (workshop mode writes its keys file there); it returns lines to log.
    Whatever stops it, at startup too (Ctrl-C, SIGTERM, a port in use), stops the workers."""
    refusal = refusal_to_start(cfg)
    if refusal is not None:
        raise ConfigError(refusal)
    router = Router(cfg, authkey)
    # bound first, so a port in use is said at once; it listens once the workers are up
    sock = _bound(cfg.host, cfg.port)
    with _terminate_interrupts():
        try:
            router.start_workers()
            for line in router.startup_log[router.startup_said :]:
                print(f"minigrid: {line}", file=sys.stderr, flush=True)
            host, port = sock.getsockname()[:2]
            url = f"http://{host}:{port}"
            server = _Server(
                uvicorn.Config(router.app(), log_level="warning", lifespan="off", access_log=False)
            )
            print(
                f"minigrid: context length {cfg.context_length} tokens, fixes: {cfg.fixes}, "
                f"tenants: {_tenants_line(cfg.tenants)}",
                file=sys.stderr,
            )
            for line in on_listening(url) if on_listening is not None else []:
                print(f"minigrid: {line}", file=sys.stderr, flush=True)
            print(f"minigrid: serving on {url}", file=sys.stderr, flush=True)
            if ready_file is not None:
                ready_file.write_text(url + "\n")
            if os.environ.get("MINIGRID_EXIT_WITH_PARENT") == "1":
                _exit_with_parent(server)
        except BaseException:
            sock.close()
            router.stop_workers()
            raise
    try:
        server.run(sockets=[sock])  # its own signal handlers while it serves
    finally:
        router.stop_workers()
        print("minigrid: stopped", file=sys.stderr, flush=True)
    return 0


def refusal_to_start(cfg: ServeConfig) -> str | None:
    """Why the workers would refuse `cfg`, said once for all of them before any starts (one line
    naming them: `the prefill and decode workers refused to start: ...`), or None. Each worker
    checks again where it runs: a worker on another host, and a pool its memory cannot hold."""
    local = [role for role in ROLES if role not in cfg.remote]
    if cfg.device == "cuda" and local:
        import torch  # only here: the router is torch-free otherwise

        if not torch.cuda.is_available():
            no_gpu = f"--device cuda: no CUDA device is visible on this host (torch {torch.__version__})"
            return _refused(cfg, local, no_gpu)
    if cfg.fixes.capacity_check:  # fix `capacity-check`: the sentence the workers would say
        short = [role for role in ROLES if cfg.short_of_context(role)]
        too_small = cfg.capacity_refusal(short)
        if too_small is not None:
            return _refused(cfg, short, too_small)
    return None


def _refused(cfg: ServeConfig, roles: list[str], why: str) -> str:
    """`the prefill worker refused to start: WHY`, as the router says a worker's refusal
    (router.REFUSED_TAIL: the handle reads it back), or `the prefill and decode workers ...`."""
    many = sum(cfg.workers(role) for role in roles) > 1
    return f"the {' and '.join(roles)} {'workers' if many else 'worker'} {REFUSED_TAIL}{why}"


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a ConfigError naming the flag at fault (exit status 2)."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise ConfigError(f"--host {host}: cannot open a socket for it: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: {why} (--port 0 takes any free port)") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port {port}: {why} (ports below 1024 need privileges)") from None
        raise ConfigError(f"--host {host}: {why}") from None
    return sock


@contextlib.contextmanager
def _terminate_interrupts() -> Iterator[None]:
    """While the workers start, SIGTERM interrupts like Ctrl-C, so that the workers started so
    far are stopped rather than left without their router."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(sig: int, frame: FrameType | None) -> None:
        raise Terminated

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _exit_with_parent(server: uvicorn.Server, interval_s: float = 0.5) -> None:
    """Ask `server` to exit once this process's parent is gone (it is then re-parented)."""
    parent = os.getppid()

    def watch() -> None:
        while not server.should_exit:
            if os.getppid() != parent:
                print("minigrid: the process that started this engine is gone; stopping", file=sys.stderr)
                server.should_exit = True
                return
            threading.Event().wait(interval_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
