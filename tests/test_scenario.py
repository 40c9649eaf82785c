"""The scenarios are cut to the engine's numbers: sizes that disagree with it are refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from minigrid_engine.canary import Finding
from minigrid_engine.errors import MinigridError
from minigrid_engine.forensics import AffectedResponse
from minigrid_engine.handle import Reply
from minigrid_engine.scenario import (
    DayReport,
    DayRequest,
    LeakReport,
    _held_at_once,
    replay_day,
    run_incident,
    run_late_transfer,
)


class Stated:
    """A handle that states its numbers and must never be sent a prompt."""

    def __init__(self, **config: Any) -> None:
        self._config = config

    def config(self) -> dict[str, Any]:
        return self._config

    def complete(self, tenant: str, prompt: str, max_tokens: int = 16, **body: Any) -> Reply:
        raise AssertionError(f"{tenant}'s prompt was sent to an engine of other numbers")

    def trace(self, since: int = 0, tenant: str = "admin") -> dict[str, list[dict[str, Any]]]:
        return {}


ENGINE = Stated(context_length=900, prefill_pool_tokens=500, page_size=64)


def test_the_incident_on_other_numbers_than_the_engines_is_refused() -> None:
    with pytest.raises(MinigridError) as exc:
        run_incident(ENGINE, context_length=1024, prefill_pool_tokens=665, attacker_len=1000)
    assert "context_length=1,024 (the engine has 900), prefill_pool_tokens=665 (the engine has 500)" in str(
        exc.value
    )
    with pytest.raises(MinigridError, match="context_length=1,024 \\(the engine has 900\\)"):
        run_late_transfer(ENGINE, context_length=1024)
    with pytest.raises(MinigridError, match="prefill_pool_tokens=665 \\(the engine has 500\\)"):
        replay_day(ENGINE, context_length=900, prefill_pool_tokens=665, progress=False)


def test_victims_that_did_not_hold_their_pages_at_once_are_told_apart() -> None:
    """On a stalled machine alice's first request may finish before her second is admitted: the
    second takes the same decode pages back, and bob's reservation would reach unwritten ones."""

    def reply(rid: str) -> Reply:
        return Reply(200, "", 10, 1, rid, 0.01, 0.02)

    class Traced(Stated):
        def __init__(self, *reserved: tuple[str, list[int]]) -> None:
            super().__init__()
            self.events = [{"kind": "reserve", "request": r, "pages": p} for r, p in reserved]

        def trace(self, since: int = 0, tenant: str = "admin") -> dict[str, list[dict[str, Any]]]:
            return {"decode": self.events}

    replies = [reply("alice-5"), reply("alice-6")]
    assert _held_at_once(Traced(("alice-5", [0, 1, 2, 3, 4]), ("alice-6", [5, 6, 7, 8, 9])), replies)
    assert not _held_at_once(Traced(("alice-5", [0, 1, 2, 3, 4]), ("alice-6", [0, 1, 2, 3, 4])), replies)
    # another request's pages do not count
    assert _held_at_once(Traced(("alice-5", [0, 1]), ("bob-1", [0, 1]), ("alice-6", [2, 3])), replies)


@pytest.mark.parametrize(
    ("codes", "run", "says"),
    [
        ({"QZ7K2M9P"}, 0, "LEAK: alice's codes QZ7K2M9P"),
        (set(), 24, "LEAK: 24 characters in a row of alice's text"),  # a leak that shows no whole code
        (set(), 23, "clean"),
    ],
)
def test_a_leak_is_her_codes_or_a_long_enough_run_of_her_text(codes: set[str], run: int, says: str) -> None:
    answer = Reply(200, "...", 1000, 24, "bob-9", 0.04, 0.1)
    rep = LeakReport("alice", "bob", [], [], "", answer, codes, run)
    assert rep.leaked == (says != "clean") and rep.content() == says
    refused = LeakReport(
        "alice", "bob", [], [], "", Reply(400, "", None, None, "bob-9", None, 0.01), set(), 0
    )
    assert not refused.leaked and refused.content() == "no answer to test (HTTP 400)"


def test_the_day_counts_only_affected_responses_that_were_served() -> None:
    def request(
        rid: str, tokens: int, status: int = 200, canaries: dict[str, set[str]] | None = None
    ) -> DayRequest:
        reply = Reply(status, "", tokens, 4, rid, 0.1, 0.2)
        return DayRequest("bob", tokens, reply, Finding("bob", canaries or {}))

    day = DayReport(
        [
            request("a", 100),
            request("b", 700, canaries={"alice": {"ALICE-7Q2"}}),  # read alice's pages, and shows it
            request("c", 900),  # read alice's pages: nothing readable came out
            request("d", 800, status=400),  # read nothing: refused
        ],
        [AffectedResponse(rid, "bob", 1024, {"alice": [3]}) for rid in ("b", "c", "gone")],
        threshold_tokens=665,
    )
    assert (day.served, day.over_threshold, day.with_foreign_canaries) == (3, 3, 1)
    assert [r.reply.request_id for r in day.affected_served] == ["b", "c"]  # not a request never seen
    assert day.shortest_affected_prompt() == 700
    assert "affected responses (200)        2" in day.table()
    assert "with foreign canaries         1" in day.table()
