"""The benchmarks still run (in a reduced form) and write the figures they claim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import needs
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run(script: str, out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_decode_bench(tmp_path: Path) -> None:
    r = run(
        "decode.py",
        tmp_path / "d.json",
        "--batches",
        "1",
        "4",
        "--steps",
        "4",
        "--prompt-len",
        "64",
        "--rounds",
        "1",
    )
    assert [row["batch"] for row in r["rows"]] == [1, 4]
    assert all(row["identical_tokens"] for row in r["rows"])  # paged and contiguous agree exactly
    assert r["peak_rss_mib"] > 0


@needs.triton
def test_decode_bench_triton_against_the_torch_path(tmp_path: Path) -> None:
    args = ["--batches", "2", "--steps", "2", "--prompt-len", "40", "--rounds", "1", "--page-size", "16"]
    r = run("decode.py", tmp_path / "t.json", "--attention", "triton", "--against", "torch", *args)
    (row,) = r["rows"]
    assert r["against"] == "torch" and row["identical_tokens"]  # the kernels' greedy tokens are torch's
    assert row["paged_over_torch_paged_time"] > 0 and "contiguous_tokens_per_s" not in row


def test_serve_bench(tmp_path: Path) -> None:
    r = run(
        "serve.py",
        tmp_path / "s.json",
        "--requests",
        "4",
        "--clients",
        "2",
        "--cold-starts",
        "1",
        "--rounds",
        "1",
    )
    assert r["mixed_workload"]["requests"] == 4 and r["stub_ttft"]["real_over_stub"] > 0
    assert r["peak_rss_all_processes_mib"] > 0


def test_fixes_bench(tmp_path: Path) -> None:
    r = run("fixes.py", tmp_path / "f.json", "--requests", "4", "--clients", "2", "--rounds", "2")
    assert {row["fixes"] for row in r["table"]} >= {"none", "all", "kv-checksum", "owner-check"}
    assert all(len(row["completion_tokens_per_s_rounds"]) == 2 for row in r["table"])
    assert r["noise"]["throughput"] >= 0 and r["noise"]["ttft_p50"] >= 0  # two rounds: a spread
    assert [row["page_size"] for row in r["scrub_by_page_size"]] == [16, 32, 64, 128, 256, 512]


def test_leak_text_bench(tmp_path: Path) -> None:
    r = run("leak_text.py", tmp_path / "l.json", "--trials", "1", "--shapes", "records", "letter")
    [shapes] = r["weights"].values()
    assert set(shapes) == {"records", "letter"}
    assert all(s["trials"] == 1 and len(s["runs"]) == 1 and s["runs"][0] >= 0 for s in shapes.values())


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_benchmark_explains_its_options(script: str) -> None:
    """`--help` prints the options (a bare % in a help string made argparse raise instead)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stdout + proc.stderr
