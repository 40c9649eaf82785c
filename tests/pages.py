"""Waiting for an engine's pools to give every page back (a release follows the transfer's
acknowledgement, so it can come after the client has its answer)."""

from __future__ import annotations

import time

from minigrid_engine.handle import Engine


def pages_in_use(engine: Engine) -> dict[str, float]:
    m = engine.metrics()
    return {role: m[f'minigrid_kv_pages_in_use{{role="{role}"}}'] for role in ("prefill", "decode")}


def wait_pages_free(engine: Engine, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(pages_in_use(engine).values()):
            return True
        time.sleep(0.1)
    return False
