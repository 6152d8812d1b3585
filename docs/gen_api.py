"""Generate ``docs/api.md``, the API reference, from the docstrings of ``nbdebug.__all__``.

Usage::

    python docs/gen_api.py            # print the reference
    python docs/gen_api.py --write    # write docs/api.md

``tests/test_api_docs.py`` checks that ``docs/api.md`` is what this script prints: after
changing a public signature or docstring, run it with ``--write``.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "api.md"

#: section title per package (or module), in reading order: a name's section is that of the
#: longest entry its defining module is or lies inside (``nbdebug.core.trace.events`` ->
#: ``nbdebug.core.trace``), so moving a module inside its package changes nothing here;
#: names from elsewhere follow under :data:`OTHER`
SECTIONS: dict[str, str] = {
    "nbdebug.core.trace": "Tracing a step",
    "nbdebug.core.stats": "Tracing a step",
    "nbdebug.core.guard": "Training-loop guard and snapshots",
    "nbdebug.core.snapshot": "Training-loop guard and snapshots",
    "nbdebug.analysis.ranks": "Training-loop guard and snapshots",
    "nbdebug.analysis.checks.guard": "Training-loop guard and snapshots",
    "nbdebug.analysis.checks": "Health checks",
    "nbdebug.analysis.gradcheck": "Gradient checks",
    "nbdebug.analysis.drift": "SHAP drift",
    "nbdebug.analysis.diagnose": "Verified fixes",
    "nbdebug.analysis.compare": "Comparing two replays",
    "nbdebug.analysis.blame": "Row blame",
    "nbdebug.analysis.labels": "Label noise",
    "nbdebug.widgets.labels": "Label noise",
    "nbdebug.widgets.app": "The debugger and the notebook extension",
    "nbdebug": "The debugger and the notebook extension",
}
#: the section of a public name defined outside every entry of :data:`SECTIONS`
OTHER = "Other public names"


def section_of(module: str) -> str:
    """The section of a name defined in ``module``: the longest :data:`SECTIONS` entry that
    is ``module`` or one of its parent packages (``nbdebug`` itself only for the package
    root's own names); :data:`OTHER` for a module outside them all (never a module path as
    a title)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        title = SECTIONS.get(".".join(parts[:n]))
        if title is not None:
            return title
    return SECTIONS.get(module, OTHER)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _plain_signature(obj: Any) -> str:
    """The call signature without annotations (the docstrings give the types)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    return _ADDRESS.sub("", text)


def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines())


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by ``cls`` or its nbdebug base classes."""
    seen: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("nbdebug"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property) or inspect.isfunction(value):
                seen[name] = value
    return sorted(seen.items())


def _kind(obj: Any) -> str:
    return "class" if inspect.isclass(obj) else "function"


def _anchor(name: str, obj: Any) -> str:
    """GitHub's anchor of the heading ``nbdebug.NAME (KIND)`` (``Trace`` and ``trace`` differ)."""
    return f"nbdebug{name.lower()}-{_kind(obj)}"


def _block(doc: str) -> list[str]:
    return ["```text", doc.rstrip(), "```"] if doc else ["*(no docstring)*"]


def render() -> str:
    """The whole reference as Markdown (deterministic: no addresses, sorted members)."""
    import nbdebug

    exports: dict[str, str] = dict(getattr(nbdebug, "_EXPORTS", {}))
    names = list(nbdebug.__all__)
    order = list(dict.fromkeys(SECTIONS.values()))
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name in names:
        obj = getattr(nbdebug, name)
        module = exports.get(name, getattr(obj, "__module__", "nbdebug"))
        title = section_of(module)
        if title not in order:
            order.append(title)
        groups.setdefault(title, []).append((name, obj))

    lines = [
        "# nbdebug API reference",
        "",
        "Every public name of `nbdebug` (`nbdebug.__all__`), with its signature and docstring.",
        "Generated by `python docs/gen_api.py --write`; do not edit by hand.",
        "",
    ]
    for title in order:
        if title not in groups:
            continue
        anchors = ", ".join(f"[`{n}`](#{_anchor(n, o)})" for n, o in groups[title])
        lines.append(f"- **{title}**: {anchors}")
    for title in order:
        if title not in groups:
            continue
        lines += ["", f"## {title}"]
        for name, obj in groups[title]:
            lines += [
                "",
                f"### nbdebug.{name} ({_kind(obj)})",
                "",
                f"`nbdebug.{name}{_plain_signature(obj)}`",
                "",
            ]
            lines += _block(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                members = _members(obj)
                if members:
                    lines += ["", "Methods and properties:", ""]
                for mname, member in members:
                    doc = _first_paragraph(inspect.getdoc(member) or "")
                    if isinstance(member, property):
                        head = f"`.{mname}` *(property)*"
                    else:
                        params = (
                            _plain_signature(member)
                            .replace("(self, ", "(")
                            .replace("(self)", "()")
                            .replace("(cls, ", "(")
                        )
                        head = f"`.{mname}{params}`"
                    lines.append(f"- {head}" + (f": {doc}" if doc else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help=f"write {OUT.name} instead of printing"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUT}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
