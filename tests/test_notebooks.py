"""Every notebook in ``notebooks/`` runs top to bottom with nbclient on the ``python3``
kernel (the venv's own ipykernel), and is stored without outputs. The solutions (markdown
code blocks, which Run All leaves alone) then run as extra cells in the same kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from test_notebook_hygiene import solution_code

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_clean(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    stored = [
        c
        for c in nb.cells
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not stored, f"{path.name} is stored with outputs: strip them"
    solutions = [
        code
        for c in nb.cells
        if "solution" in c.metadata.get("tags", []) and (code := solution_code(c)) is not None
    ]
    nb.cells += [nbformat.v4.new_code_cell(code) for code in solutions]
    # raises CellExecutionError on the first cell that fails
    NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", (
                f"{path.name}: {out.get('ename')}: {out.get('evalue')}"
            )
            # %nbdebug reports bad input as one printed line instead of raising
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                assert "nbdebug: " not in out.get("text", ""), f"{path.name}: {out['text']}"
