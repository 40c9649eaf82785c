"""Recovery: what the router does when a worker dies, and what `/health` says about it.

Every worker is a rank of one torch.distributed group (`transfer.py`), and a gloo group cannot
take a rank back once its process is gone: the survivors' transfers with the dead rank hang or
fail, and a new process cannot join the old group. So the router does not nurse half a group.
When a local worker dies it fails every request in flight (the dead worker's own with
``worker_unavailable``, the others' with ``engine_restarting``), stops the survivors, and starts
every local worker again on fresh ports: new processes, fresh pools, a new group. It does so at
most ``--worker-restarts`` times (3) within any ``--worker-restart-window`` seconds (600), so
that a crash loop ends, plainly, while a deployment that loses a worker once a week is not down
for good after its third week (restarts older than the window no longer count, as Kubernetes
forgets a pod's back-off after ten minutes of running)::

    ok --a worker dies--> restarting --every worker Ready--> ok
                             |    ^
                             |    +--a start fails, restarts left--+
                             +--no restart left (in the window), restarts off, a remote worker--> down

A worker on another host (``--remote``) was started by hand there: the router cannot start it
again, so a death with remote workers in the group goes straight to ``down`` and says so.

Torch-free: the router imports it. The router serialises every call (under its lock).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from minigrid_engine.errors import counted

DEFAULT_RETRY_AFTER_S = 5  # what a client is told to wait before the first restart has been timed
DEFAULT_RESTART_WINDOW_S = 600.0  # restarts older than this no longer count against the limit


class Status(enum.Enum):
    """What `/health` says: 200 for ``ok``, 503 otherwise."""

    OK = "ok"
    RESTARTING = "restarting"
    DOWN = "down"


@dataclass(frozen=True)
class WorkerFailure:
    """One worker's death as the router saw it."""

    worker: str  # its id, e.g. decode-0
    reason: str  # "the decode-0 worker died (exit status -9)"
    exit_status: int | None = None  # None: on another host, or still unknown
    remote: bool = False
    at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        when = datetime.fromtimestamp(self.at, timezone.utc).isoformat(timespec="seconds")
        return {
            "worker": self.worker,
            "reason": self.reason,
            "exit_status": self.exit_status,
            "remote": self.remote,
            "at": when.replace("+00:00", "Z"),
        }


@dataclass
class Recovery:
    """The router's record of worker failures and restarts: at most `limit` (``--worker-restarts``)
    within any `window_s` seconds (``--worker-restart-window``)."""

    limit: int
    remote: tuple[str, ...] = ()  # roles run on another host: the router cannot restart them
    window_s: float = DEFAULT_RESTART_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    status: Status = Status.OK
    restarts: int = 0  # restarts begun, over the engine's life
    began: list[float] = field(default_factory=list)  # when each restart within the window began
    last_failure: WorkerFailure | None = None
    note: str | None = None  # what the router is doing, or did, about the last failure
    last_restart_s: float | None = None  # how long the last successful restart took
    first_start_s: float | None = None  # how long the engine's first start of its workers took

    def why_not_restart(self) -> str | None:
        """Why the router will not restart its workers now (one plain sentence), or None."""
        if self.remote:
            roles = " ".join(f"--remote {r}" for r in self.remote)
            return (
                f"the router will not restart the workers: the {', '.join(self.remote)} workers run on "
                f"another host ({roles}) and only whoever started them there can start them again; "
                "restart `minigrid serve`, then `minigrid worker` on that host"
            )
        if self.limit == 0:
            return (
                "the router will not restart the workers: restarts are off (--worker-restarts 0); "
                "restart `minigrid serve`"
            )
        recent = self.recent()
        if recent >= self.limit:
            return (
                f"the router will not restart the workers any more: it has restarted them "
                f"{counted(recent, 'time')} in {self.window_s:g} s, the limit set by "
                f"--worker-restarts {self.limit} --worker-restart-window {self.window_s:g}; "
                "find out why they die, then restart `minigrid serve`"
            )
        return None

    def recent(self) -> int:
        """Restarts begun within the last `window_s` seconds: those that count against `limit`."""
        since = self.clock() - self.window_s
        self.began = [t for t in self.began if t > since]
        return len(self.began)

    def counted(self) -> str:
        """Where the current restart stands against the limit, e.g. "restart 2 of 3 in 600 s"."""
        return f"restart {self.recent()} of {self.limit} in {self.window_s:g} s"

    def on_failure(self, failure: WorkerFailure) -> bool:
        """Record `failure` (the engine was ok). True: restart now (status ``restarting``);
        False: ``down``, and `note` says why."""
        self.last_failure = failure
        return self._next_attempt(failure.reason)

    def start_failed(self, error: str) -> bool:
        """A restart did not bring every worker up. True: try again; False: ``down``."""
        first = error.strip().splitlines()[0] if error.strip() else "no reason given"
        return self._next_attempt(f"restart {self.restarts} failed ({first})")

    def restarted(self, seconds: float) -> None:
        """Every worker is Ready again."""
        self.status = Status.OK
        self.last_restart_s = seconds
        after = f" after {self.last_failure.reason}" if self.last_failure is not None else ""
        self.note = f"restarted every local worker in {seconds:.1f} s{after} ({self.counted()})"

    def _next_attempt(self, why: str) -> bool:
        refusal = self.why_not_restart()
        if refusal is not None:
            self.status = Status.DOWN
            self.note = f"{why}; {refusal}"
            return False
        self.restarts += 1
        self.began.append(self.clock())
        self.status = Status.RESTARTING
        self.note = f"restarting every local worker ({self.counted()}) after {why}"
        return True

    @property
    def cause(self) -> str:
        """The last failure in a few words, for error messages."""
        return self.last_failure.reason if self.last_failure is not None else "a worker failure"

    def refusal(self) -> tuple[str, str] | None:
        """(code, message) for a request that arrives now, or None while the engine is ok."""
        if self.status is Status.RESTARTING:
            return (
                "engine_restarting",
                f"the engine is restarting after {self.cause}: retry in about {self.retry_after_s()} s",
            )
        if self.status is Status.DOWN:
            return "engine_down", f"the engine is down after {self.cause}; {self.note}"
        return None

    def retry_after_s(self) -> int:
        """Seconds a client should wait (the `Retry-After` header): what is left of a restart that
        takes as long as the last one did, or before any, as long as the workers' first start."""
        took = self.last_restart_s if self.last_restart_s is not None else self.first_start_s
        if took is None:
            return DEFAULT_RETRY_AFTER_S
        if self.status is Status.RESTARTING and self.began:
            took -= self.clock() - self.began[-1]
        return max(1, math.ceil(took))

    def to_dict(self) -> dict[str, Any]:
        """The part of `/health` about failures: restarts, last_failure, recovery."""
        return {
            "restarts": {
                "count": self.restarts,
                "in_window": self.recent(),
                "limit": self.limit,
                "window_s": self.window_s,
            },
            "last_failure": self.last_failure.to_dict() if self.last_failure is not None else None,
            "recovery": self.note,
        }
