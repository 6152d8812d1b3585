"""Jupyter server settings for `make lab` (passed with --config; nothing else reads them).

The lessons in notebooks/ are committed without outputs (tests/test_notebook_hygiene.py).
JupyterLab autosaves every open notebook, so a learner running a lesson would write its
outputs into the committed file. The pre-save hook below strips outputs and execution counts
from the lessons of this repository as they are saved (the open page keeps its outputs);
any other notebook is saved as it is.
"""

from pathlib import Path

LESSONS = Path(__file__).resolve().parent / "notebooks"


def strip_lesson_outputs(model, path, contents_manager, **kwargs):
    """Pre-save hook: a lesson (notebooks/*.ipynb) is saved without outputs."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    root = Path(contents_manager.root_dir).resolve()
    if (root / path).resolve().parent != LESSONS:
        return
    for cell in model["content"].get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None


c = get_config()  # noqa: F821  (provided by Jupyter when it loads this file)
c.ContentsManager.pre_save_hook = strip_lesson_outputs
# the server root is the repository (README and docs reachable), the page is the quickstart
c.ServerApp.root_dir = str(LESSONS.parent)
c.LabApp.default_url = "/lab/tree/notebooks/01_quickstart.ipynb"
