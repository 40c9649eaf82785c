"""Errors the engine raises on purpose, each with a message that names the numbers."""

from __future__ import annotations

REFUSED_TO_START = 3  # a worker's exit status when it refuses its configuration, in one line


class MinigridError(Exception):
    """Base of every error minigrid raises deliberately."""


class ConfigError(MinigridError, ValueError):
    """A configuration value that cannot work (names the value and the constraint)."""


class BadInput(MinigridError, ValueError):
    """A request the engine refuses: empty prompt, undecodable bytes, impossible sizes."""


class PoolError(MinigridError):
    """Misuse of a KV pool: exhaustion, double release, release by a non-owner."""


class PoolExhausted(PoolError):
    """Not enough free pages for a reservation."""
