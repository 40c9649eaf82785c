"""Every lab notebook runs headless under papermill, in both directions: the leak, then the fix."""

from __future__ import annotations

import json
from pathlib import Path

import papermill as pm
import pytest

LABS = Path(__file__).resolve().parents[1] / "labs"
NOTEBOOKS = sorted(LABS.glob("*.ipynb"))


def test_there_are_labs() -> None:
    assert NOTEBOOKS, "labs/ holds no notebook"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_clean(nb: Path) -> None:
    data = json.loads(nb.read_text())
    assert data["metadata"]["kernelspec"]["name"] == "python3"
    for cell in data["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{nb.name} has outputs"
    tagged = [c for c in data["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{nb.name} needs exactly one cell tagged parameters"


def run_lab(name: str, tmp_path: Path, **params: object) -> dict:
    out = tmp_path / "result.json"
    pm.execute_notebook(
        str(LABS / name),
        str(tmp_path / f"out-{name}"),
        parameters={**params, "result_path": str(out)},
        kernel_name="python3",
        progress_bar=False,
        start_timeout=120,
        cwd=str(LABS),
    )
    return json.loads(out.read_text())


def test_leak_lab_shows_the_leak(tmp_path: Path) -> None:
    r = run_lab("01_the_leak.ipynb", tmp_path, fixes="none")
    assert r["status"] == 200 and r["prompt_tokens"] == 1000
    assert r["leaked_codes"], f"the leak lab no longer leaks: {r['text']!r}"
    assert r["pages_by_tenant"] == {"alice": 7, "bob": 1}


def test_leak_lab_with_the_fix_shows_the_400(tmp_path: Path) -> None:
    r = run_lab("01_the_leak.ipynb", tmp_path, fixes="reject-before-transfer")
    assert r["status"] == 400 and r["error"]["code"] == "context_length_exceeded"
    assert not r["leaked_codes"]
