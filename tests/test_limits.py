"""The size limits of DESIGN.md, read from the package's source with ``ast``.

- no file of ``nbdebug/`` over 600 lines;
- no function over 80 lines (from its ``def`` to its last line, its docstring not counted);
- no function with more than 8 parameters (``self``/``cls``, ``*args`` and ``**kwargs``
  not counted): options beyond that are keyword-only and grouped in frozen dataclasses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nbdebug"
FILES = sorted(PKG.rglob("*.py"))
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` (decorators excluded) to the end, less the docstring's."""
    assert node.end_lineno is not None
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        n -= first.end_lineno - first.lineno + 1
    return n


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")])


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _id(p: Path) -> str:
    return str(p.relative_to(PKG))


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_file_is_at_most_600_lines(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n <= MAX_FILE_LINES, f"{_id(path)} has {n} lines (at most {MAX_FILE_LINES})"


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_functions_are_at_most_80_lines(path: Path) -> None:
    long = [
        f"{f.name} (line {f.lineno}): {function_lines(f)} lines"
        for f in functions(path)
        if function_lines(f) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{_id(path)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_functions_take_at_most_8_parameters(path: Path) -> None:
    many = [
        f"{f.name} (line {f.lineno}): {parameter_count(f)} parameters"
        for f in functions(path)
        if parameter_count(f) > MAX_PARAMETERS
    ]
    assert not many, f"{_id(path)}: functions over {MAX_PARAMETERS} parameters: {many}"


def test_the_measures_count_what_they_say() -> None:
    src = (
        "def f(self, a, b, /, c, *args, d, e=1, **kw):\n"
        '    """Doc\n\n    more."""\n'
        "    x = 1\n"
        "    return x\n"
    )
    (node,) = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)]
    assert parameter_count(node) == 5  # a, b, c, d, e
    assert function_lines(node) == 3  # def, x = 1, return x
