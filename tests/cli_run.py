"""Run the `minigrid` command line as a user does: a child process, its exit status and output."""

from __future__ import annotations

import subprocess
import sys


def minigrid(
    *args: str, timeout: int = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`minigrid ARGS...` with this interpreter; stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "minigrid_engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
