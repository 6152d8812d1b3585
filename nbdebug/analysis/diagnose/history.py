"""Reading the guard's history for a diagnosis (its rows as
:func:`nbdebug.parse_history` reads them): the recent healthy reference
band, whether the loss diverged over the steps before, and which earlier step to look at
when the weights were already bad."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ...core.guard.history import HistoryRow
from ...core.stats import is_finite_number
from ...core.text import fmt_num
from .result import Reference

__all__ = [
    "FAR",
    "diverging",
    "earlier_step",
    "reference",
]

#: A finite fix whose loss or gradient norm is this many times off the history (or a
#: loss that grew this many times over the steps) is "far".
FAR = 100.0


def reference(history: Sequence[HistoryRow], last: int = 20) -> Reference:
    """Medians of ``loss``, ``grad_norm`` and ``lr`` over the last healthy history rows
    (not skipped, not non-finite, loss and gradient norm finite)."""
    good = [
        h
        for h in history
        if not h.get("skipped")
        and not h.get("nonfinite")
        and is_finite_number(h.get("loss"))
        and is_finite_number(h.get("grad_norm"))
    ][-last:]
    if not good:
        return Reference()
    lrs = [_number(h.get("lr")) for h in good if is_finite_number(h.get("lr"))]
    return Reference(
        loss=statistics.median(_number(h.get("loss")) for h in good),
        grad_norm=statistics.median(_number(h.get("grad_norm")) for h in good),
        lr=statistics.median(lrs) if lrs else None,
    )


def diverging(history: Sequence[HistoryRow], last: int = 10) -> str:
    """Why the steps before this one point at the learning rate (the loss grew ``FAR``
    times over the last healthy rows), or ""."""
    losses = [
        (h.get("step"), _number(h.get("loss")))
        for h in history[-last:]
        if is_finite_number(h.get("loss"))
    ]
    if len(losses) < 2:
        return ""
    low = min(range(len(losses)), key=lambda i: abs(losses[i][1]))
    (s0, a), (s1, b) = losses[low], losses[-1]
    if low == len(losses) - 1 or abs(b) <= FAR * (abs(a) + 1e-12):
        return ""
    return (
        f"the loss grew from {fmt_num(a)} (step {s0}) to {fmt_num(b)} (step {s1}) before it: "
        "the weights diverged over those updates, so lower the learning rate (or warm it up) "
        "and resume from a checkpoint before the growth"
    )


def _number(v: object) -> float:
    """A value :func:`~nbdebug.core.stats.is_finite_number` accepted, as a float."""
    return float(v)  # type: ignore[arg-type]


def _step_of(h: HistoryRow) -> int | None:
    s = h.get("step")
    return int(s) if isinstance(s, (int, float)) else None


def _first_bad(rows: Sequence[HistoryRow]) -> HistoryRow | None:
    """The first row whose weight norm, else whose loss or gradient norm, is not finite."""
    bad = next(
        (
            h
            for h in rows
            if h.get("param_norm") is not None and not is_finite_number(h["param_norm"])
        ),
        None,
    )
    if bad is None:
        bad = next(
            (
                h
                for h in rows
                if not is_finite_number(h.get("loss")) or not is_finite_number(h.get("grad_norm"))
            ),
            None,
        )
    return bad


def earlier_step(history: Sequence[HistoryRow], step: int | None) -> str:
    """Which earlier step to look at when the weights were already corrupted."""
    rows = [h for h in history if step is None or _step_of(h) is None or (_step_of(h) or 0) < step]
    if not rows:
        return (
            "the history holds no earlier step: the weights were corrupted before the guard's "
            "history began"
        )
    bad = _first_bad(rows)
    if bad is not None:
        bad_step = _step_of(bad) or 0
        prev = [h for h in rows if _step_of(h) is not None and (_step_of(h) or 0) < bad_step]
        at = prev[-1] if prev else bad
        return (
            f"look at step {at.get('step')}: the weights went bad at or before step "
            f"{bad.get('step')} "
            f"(last healthy grad norm {fmt_num(at.get('grad_norm'))}, lr {fmt_num(at.get('lr'))})"
        )
    last = rows[-1]
    return (
        f"look at what followed step {last.get('step')}, the last step in the history and a "
        f"healthy one (grad norm {fmt_num(last.get('grad_norm'))}, lr {fmt_num(last.get('lr'))}): "
        "its update, or a write to the weights outside the optimizer (a loaded checkpoint, "
        "code that edits them), made them non-finite"
    )
