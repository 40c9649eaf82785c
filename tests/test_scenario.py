"""The scenarios are cut to the engine's numbers: sizes that disagree with it are refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from minigrid_engine.errors import MinigridError
from minigrid_engine.handle import Reply
from minigrid_engine.scenario import replay_day, run_incident, run_late_transfer


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
