"""The trace: one event per allocation, write, read, free and state change, with its owners.

Widgets, metrics and forensics read only this log. Events are plain dataclasses so that they
cross process boundaries (pickle) and serialise to JSON unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

# Event kinds. Page events carry the pages they touched.
RESERVE = "reserve"  # pages handed to a request
WRITE = "write"  # K/V written into pages (positions in detail)
READ = "read"  # attention read pages (up to detail["kv_len"] tokens)
RELEASE = "release"  # pages returned to the free list (not zeroed)
STATE = "state"  # a request changed state (detail: from, to)


@dataclass(frozen=True)
class TraceEvent:
    seq: int
    time: float
    kind: str
    role: str
    request: str | None
    tenant: str | None
    pages: tuple[int, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pages"] = list(self.pages)
        return d


class Trace:
    """Append-only, thread-safe event log. `maxlen` bounds memory on long runs (oldest dropped)."""

    def __init__(self, role: str = "engine", maxlen: int | None = 200_000) -> None:
        self.role = role
        self.maxlen = maxlen
        self._events: list[TraceEvent] = []
        self._seq = 0
        self._dropped = 0
        self._lock = threading.Lock()

    def emit(
        self,
        kind: str,
        request: str | None,
        tenant: str | None,
        pages: Iterable[int] = (),
        **detail: Any,
    ) -> TraceEvent:
        with self._lock:
            ev = TraceEvent(self._seq, time.time(), kind, self.role, request, tenant, tuple(pages), detail)
            self._seq += 1
            self._events.append(ev)
            if self.maxlen is not None and len(self._events) > self.maxlen:
                cut = len(self._events) - self.maxlen
                del self._events[:cut]
                self._dropped += cut
            return ev

    def events(self, since: int = 0, kind: str | None = None) -> list[TraceEvent]:
        """Events with `seq >= since` (optionally of one kind), oldest first."""
        with self._lock:
            evs = [e for e in self._events if e.seq >= since]
        return [e for e in evs if kind is None or e.kind == kind]

    def for_request(self, request: str) -> list[TraceEvent]:
        return [e for e in self.events() if e.request == request]

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def dropped(self) -> int:
        return self._dropped

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events())

    def __len__(self) -> int:
        return len(self._events)
