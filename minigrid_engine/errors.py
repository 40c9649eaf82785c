"""Errors the engine raises on purpose, each with a message that names the numbers."""

from __future__ import annotations

import json
from typing import Any

REFUSED_TO_START = 3  # a worker's exit status when it refuses its configuration, in one line
# ... which a local worker marks so, for the router to say once (in its error) and not echo first
REFUSAL_MARK = "minigrid-refusal: "


class MinigridError(Exception):
    """Base of every error minigrid raises deliberately."""

    def _render_traceback_(self) -> list[str]:
        """In a notebook, the message a learner can act on instead of a traceback (IPython calls
        this when the exception reaches the cell)."""
        return [f"{type(self).__name__}: {self}"]


class ConfigError(MinigridError, ValueError):
    """A configuration value that cannot work (names the value and the constraint)."""


class BadInput(MinigridError, ValueError):
    """A request the engine refuses: empty prompt, undecodable bytes, impossible sizes.

    `code` and `param` are what the HTTP API answers with (an OpenAI-style error body)."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


class TritonMissing(MinigridError, ImportError):
    """Triton is not installed: it ships wheels for Linux with Python 3.11 or later only."""


TRITON_WHEELS = (
    "its wheels are for Linux with Python 3.11 or later only (pip install 'minigrid[kernels]' there)"
)
TRITON_MISSING = (
    f"Triton is not installed here; {TRITON_WHEELS}. The Triton kernels (lab 12, --attention triton) "
    "need it; everything else runs without it. On macOS or Windows, open the labs on Binder or a "
    "Linux machine."
)


class PoolError(MinigridError):
    """Misuse of a KV pool: exhaustion, double release, release by a non-owner."""


class PoolExhausted(PoolError):
    """Not enough free pages for a reservation."""


def error_message(text: str) -> str | None:
    """The `error.message` of an OpenAI-style error body, or None when `text` is not one."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def counted(n: int, unit: str) -> str:
    """`n` and its unit, singular for one: "1 token", "3 pages"."""
    return f"{n} {unit}{'' if n == 1 else 's'}"


def shown(value: Any, limit: int = 60) -> str:
    """`value` as JSON for an error message, cut short: a hostile body is never echoed whole."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."
