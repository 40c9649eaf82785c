"""What every committed notebook holds: a valid nbformat 4 file, kernelspec `python3` (papermill's
`-k python3`), no outputs, and one `parameters` cell with a `result_path` for CI's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat


def committed_clean(path: Path) -> dict[str, Any]:
    """Check `path` as committed; return the notebook, for the checks its series adds."""
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)  # e.g. a cell id in a 4.4 notebook, which some front ends refuse
    assert nb.nbformat == 4, f"{path.name} is nbformat {nb.nbformat}"
    assert nb.metadata["kernelspec"]["name"] == "python3", path.name
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{path.name} has outputs"
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged parameters"
    assert "result_path" in tagged[0].source, f"{path.name}: CI reads its results from result_path"
    return nb
