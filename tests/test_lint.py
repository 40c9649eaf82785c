"""The lint and type settings in pyproject.toml hold for the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `make setup` installs the [dev] extra")
    return found


def test_ruff_clean() -> None:
    proc = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_clean() -> None:
    proc = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_relative_link_of_the_docs_and_notebooks_resolves() -> None:
    """A learner follows README, INSTRUCTOR and the notebooks' links from JupyterLab's root (labs/):
    every relative link, image included, names a file of the repository."""
    import json
    import re

    link = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
    docs = [ROOT / "README.md", *ROOT.glob("labs/**/*.md")]
    texts = [(p, p.read_text()) for p in docs]
    for nb in ROOT.glob("labs/**/*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        texts.append((nb, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    broken = [
        f"{path.relative_to(ROOT)}: {target}"
        for path, text in texts
        for target in link.findall(text)
        if "://" not in target and not target.startswith("mailto:")
        if not (path.parent / target).exists()
    ]
    assert len(texts) > 15 and not broken, broken
