"""Forensics from a trace: whose data each page held when a request read it, and how old it was."""

from __future__ import annotations

from minigrid_engine.forensics import affected_responses, reads_by_request


def _ev(
    kind: str, request: str | None, tenant: str | None, pages: list[int], t: float, **detail: object
) -> dict:
    return {"kind": kind, "request": request, "tenant": tenant, "pages": pages, "time": t, "detail": detail}


def test_forensics_names_each_pages_writer_and_age_at_the_read() -> None:
    events = [
        _ev("write", "alice-1", "alice", [0, 1, 2], 1.0),  # alice's prompt
        _ev("write", "bob-2", "bob", [0], 2.5),  # bob's one-token stub, page 0
        _ev("scrub", None, None, [2], 2.6),  # page 2 zeroed: nobody's
        _ev("write", "bob-2", "bob", [1], 2.7, offset=5),  # a decode token mid-page: page 1 stays alice's
        _ev("state", "bob-2", "bob", [], 2.8, to="decoding", kv_len=300),
        _ev("read", "bob-2", "bob", [0, 1, 2, 3], 3.0),  # page 3: never written
        _ev("read", "bob-2", "bob", [0, 1], 3.5),  # a page read again keeps its first row
    ]
    rows = reads_by_request(events)["bob-2"]
    assert [(r["page"], r["last_writer_tenant"]) for r in rows] == [
        (0, "bob"),
        (1, "alice"),
        (2, None),
        (3, None),
    ]
    assert [r["age_s"] for r in rows] == [0.5, 2.0, None, None]
    (hit,) = affected_responses(events)
    assert (hit.request, hit.tenant, hit.kv_len, hit.foreign) == ("bob-2", "bob", 300, {"alice": [1]})
    # never-written and scrubbed pages are nobody's: reading them is no leak
    scrubbed = [
        _ev("write", "alice-1", "alice", [0, 1, 2], 1.0),
        _ev("scrub", None, None, [0, 1, 2], 2.0),
        _ev("write", "bob-2", "bob", [0], 2.5),
        _ev("read", "bob-2", "bob", [0, 1, 2, 3], 3.0),
    ]
    assert affected_responses(scrubbed) == []
    assert [r["last_writer_tenant"] for r in reads_by_request(scrubbed)["bob-2"]] == ["bob", None, None, None]
