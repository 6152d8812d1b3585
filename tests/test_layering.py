"""The layers of DESIGN.md: magics/cli -> widgets -> figures -> core + analysis, one way.

Read from the source with ``ast`` (every import, also those inside functions), plus one
real import in a fresh interpreter to show that core pulls in no UI or pandas.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nbdebug"
LAYER = {
    "core": 0,
    "analysis": 0,
    "figures": 1,
    "widgets": 2,
    "magics": 3,
    "cli": 3,
    "integrations": 3,
}
UI = ("ipywidgets", "plotly", "IPython", "anywidget")


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "nbdebug" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYER else None


def _imports(path: Path) -> list[tuple[str, bool, str]]:
    """(imported module, at module level?, enclosing function name) for every import."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = ".".join(rel.parts[:-1])
    out: list[tuple[str, bool, str]] = []

    def visit(node: ast.AST, func: str, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name, False)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, top, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    mod = ".".join([*base, child.module] if child.module else base)
                else:
                    mod = child.module or ""
                out.append((mod, top, func))
            visit(child, func, top)

    visit(tree, "", True)
    return out


FILES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down_the_layers(path: Path) -> None:
    rel = path.relative_to(PKG)
    own = rel.parts[0].removesuffix(".py")
    if own not in LAYER:
        return  # nbdebug/__init__.py: the public surface may name any layer
    for mod, top, func in _imports(path):
        target = _layer_of(mod)
        if target is not None and target != own:
            allowed = LAYER[target] < LAYER[own] or (own == "analysis" and target == "core")
            assert allowed, f"{rel} imports {mod} (in {func or 'module scope'})"
            if own == "core":
                assert target == "core", f"core module {rel} imports {mod}"
        if own in ("core", "analysis") and top:
            assert not mod.startswith(UI), f"{rel} imports the UI package {mod} at module level"
        if own == "core" and top:
            assert not mod.startswith(("pandas", "scipy", "sklearn", "shap")), (
                f"{rel} imports {mod} at module level"
            )


def test_importing_core_loads_no_ui_and_no_pandas() -> None:
    code = (
        "import sys, nbdebug.core.trace, nbdebug.core.guard, nbdebug.core.snapshot;"
        "bad = [m for m in ('pandas', 'ipywidgets', 'plotly', 'IPython', "
        "'nbdebug.analysis', 'nbdebug.widgets')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_public_guard_brings_its_health_checks_in_a_fresh_process(tmp_path: Path) -> None:
    # core never imports analysis; the public name is core's guard that reads checks=True
    code = (
        "import torch, nbdebug; m = torch.nn.Linear(2, 1);"
        f"g = nbdebug.NaNGuard(m, directory={str(tmp_path)!r}, checks=True); print(g.checks)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "GuardChecks(every=50, clip_norm=None)", r.stdout


def test_core_guard_runs_the_checks_it_is_given_in_a_fresh_process(tmp_path: Path) -> None:
    # the core import path with a checks object; importing analysis registers nothing in core
    code = (
        "import torch\n"
        "import nbdebug.core.guard as core\n"
        "before = {k: v for k, v in vars(core).items() if not k.startswith('__')}\n"
        "cls = dict(vars(core.NaNGuard))\n"
        "from nbdebug.analysis.checks.guard import GuardChecks\n"
        "import nbdebug.analysis.checks\n"
        "after = {k: v for k, v in vars(core).items() if not k.startswith('__')}\n"
        "assert before == after and cls == dict(vars(core.NaNGuard)), 'import changed core'\n"
        "m = torch.nn.Linear(2, 1); m(torch.randn(3, 2)).sum().backward()\n"
        f"g = core.NaNGuard(m, directory={str(tmp_path)!r}, checks=GuardChecks(every=1))\n"
        "assert g.check(torch.tensor(1.0))\n"
        "print(g.history[-1]['checks'], g.checks.calls)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[] 1", r.stdout + r.stderr


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(path: Path) -> list[str]:
    """``from x import _name`` and ``module._name`` (``module`` an nbdebug module bound by
    an import) in one file; dunder names are not private."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG.parent)
    found: list[str] = []
    modules: set[str] = set()  # local names bound to nbdebug modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            inside = node.level > 0 or (node.module or "").startswith("nbdebug")
            for a in node.names:
                if inside and _is_private(a.name):
                    found.append(f"{rel}:{node.lineno} imports {a.name} from {node.module}")
                elif inside:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("nbdebug"):
                    modules.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = ast.unparse(node.value)
            if owner in modules or owner.startswith("nbdebug."):
                found.append(f"{rel}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    found = [line for path in FILES for line in _private_imports(path)]
    assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_feature_tabs_are_found_in_their_panel_files_and_not_through_the_app() -> None:
    from nbdebug.widgets.tabs import feature_tabs

    tabs = feature_tabs()
    assert [t.title for t in tabs] == ["Checks", "Fixes", "Gradcheck", "Drift", "Labels"]
    assert {t.build.__module__ for t in tabs} == {
        f"nbdebug.widgets.{m}" for m in ("checks", "fixes", "gradcheck", "drift", "labels")
    }
    for path in sorted((PKG / "widgets").glob("*.py")):
        if path.name == "app.py":
            continue
        mods = [m for m, _, _ in _imports(path)]
        assert "nbdebug.widgets.app" not in mods, f"{path.name} imports the app"


def test_a_result_shows_through_the_viewer_the_widgets_layer_registers() -> None:
    from nbdebug.core import display

    class Unshown:
        pass

    with pytest.raises(ImportError, match=r"no panel is registered for .*Unshown"):
        display.show(Unshown())
    seen: list[tuple[object, dict[str, object]]] = []
    display.register_viewer("Unshown", lambda obj, **kw: seen.append((obj, kw)) or "panel")
    try:
        obj = Unshown()
        assert display.show(obj, backend="output") == "panel"
        assert seen == [(obj, {"backend": "output"})]
    finally:
        display.unregister_viewer("Unshown")


FEATURES = sorted(
    p.name for p in (PKG / "analysis").iterdir() if p.is_dir() and (p / "__init__.py").exists()
)


def test_analysis_features_are_packages_that_import_only_core_and_the_shared_tabular_module() -> (
    None
):
    assert set(FEATURES) >= {"checks", "gradcheck", "drift", "labels", "diagnose"}
    loose = sorted(p.name for p in (PKG / "analysis").glob("*.py") if p.name != "__init__.py")
    assert loose == ["ranks.py", "tabular.py"], loose  # every other job lives in its feature
    found = []
    for path in sorted((PKG / "analysis").rglob("*.py")):
        rel = path.relative_to(PKG / "analysis")
        own = rel.parts[0].removesuffix(".py")
        for mod, _, func in _imports(path):
            parts = mod.split(".")
            if parts[:2] != ["nbdebug", "analysis"] or len(parts) < 3:
                continue
            other = parts[2]
            if other not in (own, "tabular"):
                found.append(f"analysis/{rel} imports {mod} (in {func or 'module scope'})")
    assert found == [], "features importing each other:\n" + "\n".join(found)


def test_core_groups_its_jobs_in_packages() -> None:
    for name in ("trace", "snapshot", "guard"):
        assert (PKG / "core" / name / "__init__.py").exists(), name
        assert not (PKG / "core" / f"{name}.py").exists(), name
