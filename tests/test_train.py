"""The weight-making script still runs, and its corpus teaches copying."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from minigrid_engine.model import load_meta, load_model
from minigrid_engine.train import TrainConfig, sample_sequence


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
