"""The documentation's front: the README is a front page under 200 lines with the two
commands and the links to the rest; every relative link of the README, CONTRIBUTING,
CHANGELOG and ``docs/*.md`` points at a file (and a heading) that exists; the pages name
public ``nbdebug.X`` names, not the deep module path behind one; the version has one home.
Static checks only: nothing is executed from the pages."""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import nbdebug
from nbdebug import _version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
#: pages written for people who carry the project on: they may name modules
MODULE_PAGES = {DOCS / "architecture.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DEEP = re.compile(r"\bnbdebug\.(?:core|analysis|widgets|figures)(?:\.\w+)+")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (links and names in code are not links)."""
    out, inside = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to
    hyphens (``## The guard: `bench_guard.py` `` -> ``the-guard-bench_guardpy``)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(prose(page))]


def test_slug_follows_github():
    assert slug("Faster statistics on CPU: `nbdebug build-kernels`") == (
        "faster-statistics-on-cpu-nbdebug-build-kernels"
    )
    assert slug("nbdebug.trace (function)") == "nbdebugtrace-function"
    assert slug("Where was the NaN produced? `nbdebug.trace()`") == (
        "where-was-the-nan-produced-nbdebugtrace"
    )


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n < 200, f"README.md has {n} lines: move reference material to docs/*.md"
    assert "make lab" in text and "make test" in text
    for target in ("docs/architecture.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/debugger.png"):
        assert target in links(README), f"README.md should link {target}"
    assert not _DEEP.search(text), "the README names only public nbdebug.X names"


@pytest.mark.parametrize("heading", ["Lightning", "Hugging Face Trainer"])
def test_readme_trainer_sections_have_a_five_line_example(heading):
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m is not None, f"README.md needs a '## {heading}' section"
    code = re.search(r"```python\n(.*?)```", m.group(1), re.S)
    assert code is not None, f"the {heading} section needs its example"
    lines = [line for line in code.group(1).splitlines() if line.strip()]
    assert 1 < len(lines) <= 6, f"the {heading} example has {len(lines)} lines"
    assert "docs/integrations.md" in m.group(1)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p not in MODULE_PAGES], ids=lambda p: p.name)
def test_pages_name_public_names_not_deep_paths(page):
    public = set(nbdebug.__all__)
    deep = []
    for m in _DEEP.finditer(page.read_text(encoding="utf-8")):
        name = m.group(0).rsplit(".", 1)[1]  # the name the path leads to
        if name in public:
            deep.append(f"{m.group(0)} (write nbdebug.{name})")
    assert not deep, f"{page.name} names deep paths of public names: {sorted(set(deep))}"


def test_the_version_has_one_home():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"], "pyproject.toml reads the version: no copy"
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "nbdebug._version.__version__"
    assert nbdebug.__version__ == _version.__version__
    # the installed metadata is built from that home (reinstall after changing it)
    assert version("nbdebug") == nbdebug.__version__


#: pages whose file paths are checked against the tree
PATH_PAGES = [DOCS / "architecture.md", ROOT / "CONTRIBUTING.md"]
_TOP = ("nbdebug", "tests", "docs", "benchmarks", "notebooks", "binder")
_PY = re.compile(r"(?<![\w./<>-])((?:[\w<>-]+/)*[\w<>-]+\.(?:py|cpp|md)|(?:[\w-]+/)+)(?![\w/])")


def named_paths(page: Path) -> list[tuple[str, Path | None]]:
    """Every file or folder path a page names, with where it resolves (None: nowhere).
    ``core/trace/hooks.py, recorder.py``: a bare name is looked up beside the last path of
    its paragraph; under a heading ``### `nbdebug/core/` ``, a table row's ``trace/`` is
    ``nbdebug/core/trace/``; ``<panel>`` placeholders are skipped."""
    out: list[tuple[str, Path | None]] = []
    base = ROOT
    near: Path | None = None
    for line in page.read_text(encoding="utf-8").splitlines():
        head = re.match(r"^#+ .*?`((?:nbdebug/)[\w/]*/)`", line)
        if head:
            base = ROOT / head.group(1)
        if not line.strip():
            near = None  # a bare name is read beside a path of its paragraph
        for m in _PY.finditer(line):
            text = m.group(1)
            if "<" in text or text.startswith(("http", "www")):
                continue
            found = _resolve(text, near, base)
            out.append((text, found))
            if found is not None:
                near = found if found.is_dir() else found.parent
    return out


def _resolve(text: str, near: Path | None, base: Path) -> Path | None:
    first = text.split("/", 1)[0]
    tries = [ROOT / text] if first in _TOP else []
    if "/" not in text.rstrip("/"):  # a bare name: beside the last path first
        around = [] if near is None else [near, near.parent]  # inside, or beside
        tries += [p / text for p in (*around, base)]
    tries += [ROOT / "nbdebug" / text, base / text]
    return next((p for p in tries if p.exists()), None)


@pytest.mark.parametrize("page", PATH_PAGES, ids=lambda p: p.name)
def test_the_paths_a_page_names_exist(page):
    missing = sorted({text for text, found in named_paths(page) if found is None})
    assert not missing, f"{page.name} names paths that do not exist: {missing}"
    tests = re.findall(r"`(tests/[\w]+\.py)::(\w+)`", page.read_text(encoding="utf-8"))
    for path, func in tests:
        assert f"def {func}(" in (ROOT / path).read_text(encoding="utf-8"), f"{path}::{func}"
