"""Page-ownership forensics: which pages each answer was read from, and whose data they held.

The postmortem's question, "which responses carried data from other customers' requests?", is
answered here from the decode role's trace alone: replay every write in order and, at each
request's first read of a page, name whose data the slots it read held.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]


def reads_by_request(events: list[Event]) -> dict[str, list[dict[str, Any]]]:
    """One pass over a role's trace: request -> the pages it read, in block order, each with the
    request and tenant whose data the slots it read held, and how long before the read that
    data was written (`age_s`; None for a page never written, or scrubbed).

    A prefill or transfer write makes a page its writer's. A decode write of one token makes the
    page the writer's only when it is the page's first slot (offset 0): the request then reads
    only its own tokens from it. A decode write further into a page does not: the slots before
    it still hold whoever wrote them, as in the incident's last page (bob's token at offset 104
    after 104 slots of alice's K/V).

    With several decode workers each has its own pool: a page is (worker, page), and each row
    names the worker it was read on (events without a worker count as one pool)."""
    writer: dict[tuple[str | None, int], tuple[str | None, str | None, float | None]] = {}
    out: dict[str, list[dict[str, Any]]] = {}
    seen: dict[str, set[tuple[str | None, int]]] = {}
    for e in events:
        kind, req, worker = e["kind"], e.get("request"), e.get("worker")
        if kind == "write":
            offset = e.get("detail", {}).get("offset")
            if offset is None or offset == 0:
                for p in e["pages"]:
                    writer[worker, p] = (req, e.get("tenant"), e.get("time"))
        elif kind == "scrub":  # zeroed: written by nobody
            for p in e["pages"]:
                writer[worker, p] = (None, None, None)
        elif kind == "read" and req is not None:
            rows, done = out.setdefault(req, []), seen.setdefault(req, set())
            for i, p in enumerate(e["pages"]):
                if (worker, p) not in done:
                    done.add((worker, p))
                    who, tenant, at = writer.get((worker, p), (None, None, None))
                    age = e["time"] - at if at is not None and e.get("time") is not None else None
                    row = {
                        "page": p,
                        "block": i,
                        "last_writer": who,
                        "last_writer_tenant": tenant,
                        "age_s": age,
                    }
                    if worker is not None:
                        row["worker"] = worker
                    rows.append(row)
    return out


def pages_read(events: list[Event], request_id: str) -> Iterator[dict[str, Any]]:
    """The pages `request_id` read (see `reads_by_request`)."""
    yield from reads_by_request(events).get(request_id, [])


@dataclass
class AffectedResponse:
    """A response whose attention read pages last written for another tenant."""

    request: str
    tenant: str
    kv_len: int | None  # tokens decode attended over when it began
    foreign: dict[str, list[int]] = field(default_factory=dict)  # other tenant -> pages

    @property
    def foreign_pages(self) -> int:
        return sum(len(p) for p in self.foreign.values())


def affected_responses(events: list[Event]) -> list[AffectedResponse]:
    """Every request in a decode trace that read another tenant's pages, in order of decoding."""
    tenant_of: dict[str, str] = {}
    kv_len: dict[str, int | None] = {}
    for e in events:
        if e.get("request") is not None and e.get("tenant") is not None:
            tenant_of.setdefault(e["request"], e["tenant"])
        if e["kind"] == "state" and e["detail"].get("to") == "decoding":
            kv_len[e["request"]] = e["detail"].get("kv_len")
    out = []
    for req, rows in reads_by_request(events).items():
        mine = tenant_of.get(req)
        foreign: dict[str, list[int]] = {}
        for r in rows:
            other = r["last_writer_tenant"]
            if other is not None and other != mine:
                foreign.setdefault(other, []).append(r["page"])
        if foreign and mine is not None:
            out.append(AffectedResponse(req, mine, kv_len.get(req), foreign))
    return out
