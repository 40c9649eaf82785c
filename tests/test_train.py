"""The weight-making script still runs, and its corpus teaches copying."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from minigrid_engine.model import load_meta, load_model
from minigrid_engine.records import SHAPES, shaped_prompt
from minigrid_engine.train import TrainConfig, sample_leak_row, sample_sequence


def test_train_script_runs_a_few_steps_and_saves_loadable_weights(tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minigrid_engine.train",
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "64",
            "--max-position",
            "256",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "step     2/3" in proc.stdout
    model = load_model(out)
    assert model.num_parameters() == load_meta(out)["parameters"]
    assert out.stat().st_size < 4_000_000


def test_training_text_repeats_blocks_with_spaces() -> None:
    rng = random.Random(1)
    seq = bytes(sample_sequence(rng, TrainConfig().seq_len))
    assert len(seq) == TrainConfig().seq_len + 1
    assert b" " in seq
    # a repeated block means some 32-byte window occurs twice
    windows = [seq[i : i + 32] for i in range(0, len(seq) - 32)]
    assert len(set(windows)) < len(windows)


def test_train_refuses_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "minigrid_engine.train", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--steps 0" in proc.stderr


def test_a_leak_row_is_what_decode_reads_after_a_stub() -> None:
    """Documents side by side, then the stub, then tails (stubbed requests): a tail reads the stub,
    some of the documents' pages and its own past, never another tail; only tails are scored, and
    each tail's text is a copy of a document's."""
    rng = random.Random(5)
    for _ in range(20):
        inputs, targets, positions, allowed = sample_leak_row(rng, 512, 2048)
        assert len(inputs) == len(targets) == len(positions) == 512 and allowed.shape == (512, 512)
        assert allowed.diagonal().all() and not allowed.triu(1).any()  # causal, each reads itself
        stub = min(i for i, t in enumerate(targets) if t != -100) - 1  # the first tail follows it
        assert positions[stub] == 0 and all(t == -100 for t in targets[: stub + 1])
        starts = [stub + 1] + [i for i in range(stub + 2, 512) if not allowed[i, i - 1]]
        assert len(starts) >= 2
        for a, b in zip(starts, [*starts[1:], 512]):
            assert allowed[a:b, stub].all()  # the stub is in every tail's block table
            assert not allowed[a:b, stub + 1 : a].any()  # no tail reads another
            assert bytes(inputs[a:b]) in bytes(inputs[:stub])  # a copy of what it was handed
            assert positions[a:b] == list(range(positions[a], positions[a] + b - a))


def test_shaped_prompts_are_exact_and_tenant_specific() -> None:
    rng = random.Random(2)
    for shape in ["records", *SHAPES]:
        text = shaped_prompt("alice", shape, 300, rng)
        assert len(text.encode()) == 300 and text.isascii()
    try:
        shaped_prompt("alice", "poem", 10, rng)
    except ValueError as e:
        assert "poem" in str(e) and "letter" in str(e)
    else:
        raise AssertionError("an unknown shape was accepted")


def test_a_records_prompt_names_its_codes_and_the_one_its_end_cuts() -> None:
    for seed in range(200):
        secrets: list[str] = []
        text = shaped_prompt(
            "alice", "records", random.Random(seed).randint(20, 300), random.Random(seed), secrets
        )
        pieces = [p.split() for p in text.split("; ")]  # NAME field CODE, the last maybe cut short
        assert secrets == [p[2].rstrip(";") for p in pieces if len(p) == 3], text
        assert secrets and all(s in text for s in secrets)
