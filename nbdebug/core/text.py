"""How nbdebug writes values as text: one helper per job, used by every layer above.

torch-free on purpose (``dtype_name`` only reads ``str(dtype)``), so analysis, figures and
widgets can share it without importing more than they need.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from collections.abc import Sequence


def fmt_num(v: object, spec: str = ".4g", *, nan: str = "nan", none: str = "-") -> str:
    """A number as nbdebug shows it.

    Floats (Python or numpy) with ``spec`` (4 significant digits by default), NaN as
    ``nan`` (or the given text), infinities as ``inf``/``-inf``, ``None`` as ``none``;
    bools, integers and anything else as ``str(v)``.
    """
    if v is None:
        return none
    if isinstance(v, (bool, numbers.Integral)) or not isinstance(v, numbers.Real):
        return str(v)
    f = float(v)
    if math.isnan(f):
        return nan
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return format(f, spec)


def count_text(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 row"``, ``"3 rows"`` (``plural``: the noun's plural when not ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def row_numbers(rows: Sequence[int], most: int | None = 8) -> str:
    """``"3, 5, 9"``; past ``most`` rows ``"3, 5, ... (12 rows)"`` (``most=None``: all)."""
    rows = list(rows)
    if most is None or len(rows) <= most:
        return ", ".join(map(str, rows))
    return ", ".join(map(str, rows[:most])) + f", ... ({len(rows)} rows)"


def rows_text(rows: Sequence[int], most: int | None = 8) -> str:
    """Batch rows as a phrase: ``"row 3"``, ``"rows 3, 5"``, ``"rows 3, 5, ... (12 rows)"``;
    ``""`` for no rows."""
    if not rows:
        return ""
    return ("row " if len(rows) == 1 else "rows ") + row_numbers(rows, most)


def first_line(e: BaseException, most: int = 200, *, with_type: bool = True) -> str:
    """The first line of an exception's message (at most ``most`` characters), as
    ``"ValueError: message"`` (``with_type=False``: ``"message"``); the type name alone
    when the message is empty."""
    text = str(e).strip().splitlines()
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text[0][:most]}" if with_type else text[0][:most]


def dtype_name(dtype: object) -> str:
    """``torch.float32`` -> ``"float32"`` (any object: its ``str`` without ``torch.``)."""
    return str(dtype).replace("torch.", "")


def qualified_name(prefix: str, name: str) -> str:
    """A parameter's or buffer's name as ``model.named_parameters()`` gives it:
    ``"encoder.0" + "weight"`` -> ``"encoder.0.weight"``; the root module's own: ``name``."""
    return f"{prefix}.{name}" if prefix else name


def fmt_bytes(n: float) -> str:
    """``"512 B"``, ``"12.5 KiB"``, ``"3.2 MiB"``, ``"1.1 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop always returns


def shorten(text: str, width: int = 120) -> str:
    """``text`` on one line, cut at a word boundary to at most ``width`` characters
    (``" ..."`` marks the cut); never cut mid-word."""
    return textwrap.shorten(str(text), width, placeholder=" ...")


def cost_text(cost: float | None) -> str:
    """A fix's cost (its replay's seconds over the plain replay's) to 2-3 significant
    digits: ``"173x"``, ``"1.4x"``, ``"0.95x"``; ``"-"`` when unknown."""
    if cost is None or cost != cost:
        return "-"
    return f"{cost:.0f}x" if abs(cost) >= 100 else f"{float(f'{cost:.2g}'):g}x"


def code_name(obj: object) -> str:
    """The name of a function or class as its code reads it: ``__qualname__`` without the
    enclosing functions of a local definition (``WFn``, not ``make.<locals>.WFn``);
    ``Outer.Inner`` stays."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return str(name).rsplit("<locals>.", 1)[-1]
