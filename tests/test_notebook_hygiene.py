"""Every notebook of the repository is stored clean (no outputs, no execution counts, the
``python3`` kernel), and the lesson notebooks follow the lesson layout: an opening that says
what the learner will see, exercises at the end with separate solution cells, no downloads,
and a row in the README's lessons table. Static checks only: ``test_notebooks.py`` runs them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"node_modules", "build", "dist", "site-packages"}


def repo_notebooks() -> list[Path]:
    """Every ``.ipynb`` under the repository, hidden folders (.venv, .git, checkpoints) and
    build output left out."""
    found = []
    for p in ROOT.rglob("*.ipynb"):
        parts = p.relative_to(ROOT).parts[:-1]
        if any(part.startswith(".") or part in SKIP_DIRS for part in parts):
            continue
        found.append(p)
    return sorted(found)


ALL = repo_notebooks()
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def test_the_lessons_are_there():
    names = {p.name for p in LESSONS}
    for expected in (
        "01_quickstart.ipynb",
        "02_nan_postmortem.ipynb",
        "03_vanishing_exploding.ipynb",
        "04_gradcheck_custom_op.ipynb",
        "05_shap_drift.ipynb",
        "06_label_noise.ipynb",
        "07_diagnose_the_run.ipynb",
        "08_see_it_coming.ipynb",
    ):
        assert expected in names
    assert set(LESSONS) <= set(ALL)


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_stored_without_outputs(path):
    nb = _read(path)
    nbformat.validate(nb)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} are stored with outputs or execution counts: strip them"
    )
    timed = [i for i, c in enumerate(nb.cells) if "execution" in c.get("metadata", {})]
    assert not timed, f"{path.name}: cells {timed} carry execution timing metadata: strip it"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: kernelspec must be python3"
    )


def _headings(cell: nbformat.NotebookNode) -> list[str]:
    return [line.strip() for line in cell.source.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lesson_layout(path):
    cells = _read(path).cells
    first = cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), (
        f"{path.name}: open with a title"
    )
    assert re.search(r"you\s+will\s+see", first.source, re.I), (
        f"{path.name}: the opening says what the learner will see"
    )

    ex = [
        i
        for i, c in enumerate(cells)
        if c.cell_type == "markdown" and "## Exercises" in _headings(c)
    ]
    assert len(ex) == 1, f"{path.name}: one '## Exercises' section"
    sol = [
        i
        for i, c in enumerate(cells)
        if c.cell_type == "markdown" and any("Solutions" in h for h in _headings(c))
    ]
    assert len(sol) == 1 and sol[0] > ex[0], (
        f"{path.name}: a 'Solutions' heading after the exercises"
    )
    exercises = re.findall(r"^\d+\. ", cells[ex[0]].source, re.M)
    solutions = cells[sol[0] + 1 :]
    assert exercises and solutions, f"{path.name}: numbered exercises and solution cells"
    # Run All must not run the solutions: each is a markdown cell holding one python code
    # block (tests/test_notebooks.py runs those blocks after the lesson), collapsed
    for c in solutions:
        assert c.cell_type == "markdown" and solution_code(c) is not None, (
            f"{path.name}: nothing but solutions (markdown with one ```python block) at the end"
        )
        assert c.metadata.get("jupyter", {}).get("source_hidden") is True, (
            f"{path.name}: collapse solution cells"
        )


def solution_code(cell) -> str | None:
    """The code of a solution cell (a markdown cell that is one ```python block)."""
    m = re.fullmatch(r"\s*```python\n(.*)\n```\s*", cell.source, re.S)
    return m.group(1) if m else None


DOWNLOADS = re.compile(
    r"fetch_\w+\(|urlopen|urlretrieve|requests\.(get|post)|download\s*=\s*True|hf_hub_download|"
    r"from_pretrained|https?://|!\s*(pip|wget|curl)\b|%pip\b"
)


@pytest.mark.parametrize("path", LESSONS, ids=_ids(LESSONS))
def test_lessons_use_only_bundled_or_generated_data(path):
    for i, c in enumerate(_read(path).cells):
        if c.cell_type == "code":
            m = DOWNLOADS.search(c.source)
            assert m is None, f"{path.name} cell {i}: {m.group(0)!r} fetches something at run time"


def test_lessons_write_files_only_to_temporary_directories():
    """A notebook that writes snapshots or journals puts them under tempfile.mkdtemp()."""
    writers = re.compile(r"NaNGuard\(|LabelCleaner\(|\.export\(|save_snapshot\(")
    for path in LESSONS:
        code = "\n".join(c.source for c in _read(path).cells if c.cell_type == "code")
        if writers.search(code):
            assert "tempfile.mkdtemp(" in code, f"{path.name} writes files: use tempfile.mkdtemp()"
            for m in re.finditer(r"(directory|journal)\s*=\s*([^,)\n]+)", code):
                assert not m.group(2).strip().startswith(("'", '"')), (
                    f"{path.name}: {m.group(0)!r} writes into the working directory"
                )


def test_readme_lessons_table_lists_every_notebook():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Lessons \(notebooks\)\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m is not None, "README.md needs a '## Lessons (notebooks)' section"
    section = m.group(1)
    linked = re.findall(r"\]\((notebooks/[^)]+\.ipynb)\)", section)
    assert sorted(set(linked)) == sorted(f"notebooks/{p.name}" for p in LESSONS)
    rows = [line for line in section.splitlines() if line.startswith("| [")]
    assert len(rows) == len(LESSONS) and all(line.count("|") >= 4 for line in rows)
    assert (
        "mybinder.org/v2/gh/" in section
        and "urlpath=lab/tree/notebooks/01_quickstart.ipynb" in section
    )
