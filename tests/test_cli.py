"""The command line: clear one-line errors that name the value, and a working generate."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


def minigrid(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minigrid_engine.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pool", "--pool-tokens", "abc"], "'abc' is not a whole number"),
        (["pool", "--pool-tokens", "100"], "a pool of 100 tokens is smaller than one page of 128 tokens"),
        (["pool", "--pool-tokens", "1024", "--page-size", "0"], "0 must be at least 1"),
        (["pool", "--pool-memory", "lots"], "'lots' is not a memory size"),
        (["pool", "--pool-memory", "1KiB"], "memory budget of 1024 bytes is smaller than one page"),
        (["generate", "--prompt", ""], "prompt is empty"),
        (["generate", "--prompt", "hi", "--max-tokens", "-3"], "-3 must be at least 1"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_bad_values_get_one_clear_line(args: list[str], message: str) -> None:
    proc = minigrid(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_undecodable_prompt_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ALICE \xff\xfe")
    proc = minigrid("generate", "--prompt-file", str(bad))
    assert proc.returncode == 2
    assert "not valid UTF-8: byte 0xff at offset 6" in proc.stderr


def test_pool_reports_tokens_pages_and_bytes() -> None:
    proc = minigrid("pool", "--pool-tokens", "665", "--page-size", "128")
    assert proc.returncode == 0
    assert "665 tokens in 6 pages of 128 tokens" in proc.stdout
    assert "1536 bytes per token" in proc.stdout


def test_generate_copies_a_record() -> None:
    prompt = "ZED pin 7Q2M4K; ZED card PX81KQ0A; " * 6
    proc = minigrid("generate", "--prompt", prompt, "--max-tokens", "40", "--tenant", "zed")
    assert proc.returncode == 0, proc.stderr
    records = re.findall(r"ZED [a-z]+ [A-Z0-9]+; ", proc.stdout)
    assert records and all(r in prompt for r in records), proc.stdout
    assert "engine KV pool: 2048 tokens in 16 pages" in proc.stderr


def test_generate_rejects_a_prompt_over_the_context() -> None:
    proc = minigrid("generate", "--prompt", "x" * 300, "--context-length", "256", "--pool-tokens", "512")
    assert proc.returncode == 1
    assert "prompt of 300 tokens + max_tokens 32 = 332 exceeds the context length 256" in proc.stderr
