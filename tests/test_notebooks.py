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


@pytest.mark.notebook
def test_output_plots_write_nothing_back_under_nbclient(monkeypatch, tmp_path):
    """nbclient emulates the front end of an ``Output`` widget: each display message
    captured into one made it send the widget's outputs back to the kernel on the shell
    channel while it waited there for the cell's reply, and the cell then stalled for the
    whole cell timeout (jupyter/nbclient#312; lesson 01 took over 600 s). The Output back end
    sets the outputs instead: nothing is written back, and the figures still reach the
    notebook's widget state."""
    from nbclient import output_widget

    writes: list[int] = []
    sync_state = output_widget.OutputWidget.sync_state

    def counted(self):
        writes.append(len(self.outputs))
        return sync_state(self)

    monkeypatch.setattr(output_widget.OutputWidget, "sync_state", counted)
    monkeypatch.setenv("NBDEBUG_PLOT_BACKEND", "output")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(code)
        for code in (
            "import torch, torch.nn.functional as F\nfrom torch import nn\nimport nbdebug\n"
            "torch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), "
            "nn.Linear(8, 3))\nx, y = torch.randn(4, 10), torch.randint(0, 3, (4,))\n"
            "dbg = nbdebug.debug(model, x, y, F.cross_entropy)\ndbg",
            'dbg.step.buttons["first"].click()\nfor _ in range(8):\n'
            '    dbg.step.buttons["next"].click()\ndbg.current_event.index',
        )
    ]
    NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "8"
    assert writes == []
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    plots = [
        out["data"]["application/vnd.plotly.v1+json"]
        for model in state.values()
        if model["model_name"] == "OutputModel"
        for out in model["state"].get("outputs", [])
    ]
    # the norm plot and the histogram at least (the Gradcheck tab's has nothing to draw)
    assert sum(bool(p["data"]) for p in plots) >= 2
