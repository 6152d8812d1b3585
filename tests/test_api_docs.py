"""The API reference: ``docs/api.md`` is what ``docs/gen_api.py`` generates from the
docstrings of ``nbdebug.__all__``, every public name is in it, every public name has a
numpy-style docstring with the sections that say how to call it, and ``pydoc`` renders the
package."""

from __future__ import annotations

import importlib.util
import inspect
import pydoc
import re
from pathlib import Path

import pytest

import nbdebug

ROOT = Path(__file__).resolve().parent.parent
GEN = ROOT / "docs" / "gen_api.py"
API = ROOT / "docs" / "api.md"

#: numpy-style section headings: a title line underlined with dashes
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*)\n-{3,}[ \t]*$", re.M)
#: a function says how to call it and what comes back; a class may instead list the
#: attributes of its instances (result objects are built by nbdebug, not by the user)
FUNCTION_SECTIONS = {"Parameters", "Returns", "Examples"}
CLASS_SECTIONS = FUNCTION_SECTIONS | {"Attributes"}

#: public names whose docstring lacks those sections today (owned by other modules; the
#: lead completes them). The test fails when this set is not exactly the set of names
#: without them: remove a name once its docstring is fixed, never add one silently.
KNOWN_INCOMPLETE: set[str] = set()


def _gen():
    spec = importlib.util.spec_from_file_location("nbdebug_gen_api", GEN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> str:
    return _gen().render()


def sections(doc: str) -> set[str]:
    return {m.group(1).strip() for m in _SECTION.finditer(doc)}


def test_api_md_is_up_to_date(generated):
    stored = API.read_text(encoding="utf-8")
    assert stored == generated, "docs/api.md is stale: run `python docs/gen_api.py --write`"


def test_every_public_name_is_documented_in_api_md(generated):
    for name in nbdebug.__all__:
        obj = getattr(nbdebug, name)
        kind = "class" if inspect.isclass(obj) else "function"
        assert f"\n### nbdebug.{name} ({kind})\n" in generated, name
        doc = inspect.getdoc(obj)
        assert doc, f"nbdebug.{name} has no docstring"
        assert doc.strip().splitlines()[0] in generated, f"the docstring of {name} is not in api.md"
    # the index links point at headings that exist (GitHub's anchors: lower case, no dots)
    anchors = set(re.findall(r"\]\(#([\w-]+)\)", generated))
    headings = {
        re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^### (.+)$", generated, re.M)
    }
    assert anchors and anchors <= headings, anchors - headings
    assert len(anchors) == len(nbdebug.__all__)
    assert " at 0x" not in generated, "memory addresses make the file change on every run"


def test_script_prints_and_writes_the_same_text(tmp_path, capsys, monkeypatch, generated):
    gen = _gen()
    assert gen.main([]) == 0
    assert capsys.readouterr().out == generated
    out = tmp_path / "api.md"
    monkeypatch.setattr(gen, "OUT", out)
    assert gen.main(["--write"]) == 0
    assert out.read_text(encoding="utf-8") == generated


def test_public_docstrings_have_numpy_sections():
    missing = set()
    for name in nbdebug.__all__:
        obj = getattr(nbdebug, name)
        doc = inspect.getdoc(obj) or ""
        wanted = CLASS_SECTIONS if inspect.isclass(obj) else FUNCTION_SECTIONS
        if not sections(doc) & wanted:
            missing.add(name)
    fixed = KNOWN_INCOMPLETE - missing
    assert not fixed, (
        f"these docstrings are complete now: remove them from KNOWN_INCOMPLETE: {sorted(fixed)}"
    )
    new = missing - KNOWN_INCOMPLETE
    assert not new, (
        f"public names without a Parameters/Returns/Examples (or Attributes) section: {sorted(new)}"
    )


def test_section_parser_reads_numpy_headings():
    doc = "Summary.\n\nParameters\n----------\nx : int\n\nReturns\n-------\nint\n"
    assert sections(doc) == {"Parameters", "Returns"}
    assert sections("Summary only, a line with dashes ---- inside.") == set()


def test_pydoc_renders_the_package():
    text = pydoc.plain(pydoc.render_doc(nbdebug))
    for name in nbdebug.__all__:
        assert re.search(rf"\b{re.escape(name)}\b", text), name


def test_every_code_fence_of_the_markdown_docs_is_closed():
    # one fence left open turns the rest of a page inside out (prose shown as code)
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        fences = [
            n
            for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if line.lstrip().startswith("```")
        ]
        assert len(fences) % 2 == 0, f"{page.name}: a code fence is left open (fences: {fences})"


def test_sections_follow_packages_and_no_title_is_a_module_path(generated):
    gen = _gen()
    assert gen.section_of("nbdebug.core.trace.events") == gen.section_of("nbdebug.core.trace")
    assert gen.section_of("nbdebug.analysis.checks.guard") == "Training-loop guard and snapshots"
    assert gen.section_of("nbdebug.analysis.checks.codes") == "Health checks"
    assert gen.section_of("nbdebug.core.text") == gen.OTHER  # never "nbdebug.core.text"
    titles = re.findall(r"^## (.+)$", generated, re.M)
    assert titles and not [t for t in titles if t.startswith("nbdebug.")], titles
