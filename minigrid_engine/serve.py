"""`minigrid serve`: start the router (this process) and the two worker processes, serve until stopped.

SIGINT or SIGTERM stops the HTTP server, then the workers (asked first, killed after a grace
period). If this process is killed outright, the workers see their connection close and exit.
Started by a notebook (`MINIGRID_EXIT_WITH_PARENT=1`), it also stops when its parent dies, so a
restarted or killed notebook kernel leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from minigrid_engine.config import ServeConfig
from minigrid_engine.router import Router


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
    router = Router(cfg, authkey)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    with _terminate_interrupts():
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:  # bound first, so a port in use is said at once; it listens once the workers are up
                sock.bind((cfg.host, cfg.port))
            except OSError as exc:
                raise OSError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}") from None
            router.start_workers()
            for line in router.startup_log:
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


@contextlib.contextmanager
def _terminate_interrupts() -> Iterator[None]:
    """While the workers start, SIGTERM interrupts like Ctrl-C, so that the workers started so
    far are stopped rather than left without their router."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(sig: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

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
