"""Ranking the rows of a diagnosis: a fix counts only when the loss, every gradient and
the weights after the update are finite; among those the most local change first, then
the smallest deviation of loss and gradient norm from the recent healthy history."""

from __future__ import annotations

import math

from ...core.text import fmt_num
from ...core.vocab import FixKind
from .fix import FixLike
from .fix_pseudo import NotReproducible, UpdateRecorded
from .history import FAR
from .result import FixResult, Reference, StepOutcome

__all__ = ["deviation", "far_from_history", "locality", "rank"]


def _against(o: StepOutcome, ref: Reference) -> list[tuple[str, float, float]]:
    """(label, value, reference) of the loss and the gradient norm, where both are known
    and the value is finite."""
    out = []
    for label, v, r in (
        ("loss", o.loss, ref.loss),
        ("gradient norm", o.grad_norm, ref.grad_norm),
    ):
        if r is not None and v is not None and math.isfinite(v):
            out.append((label, v, r))
    return out


def deviation(o: StepOutcome, ref: Reference) -> float:
    """How far a replay's loss and gradient norm are from the healthy history (a sum of
    ``log1p`` of the relative differences)."""
    return sum((math.log1p(abs(v - r) / (abs(r) + 1e-12)) for _, v, r in _against(o, ref)), 0.0)


def far_from_history(o: StepOutcome, ref: Reference) -> str:
    """Why a finite replay is far from the healthy history ("loss 952 vs 0.067"), or
    still diverging over its replayed updates (``steps=``: the loss grew ``FAR`` times),
    or ""."""
    for label, v, r in _against(o, ref):
        if abs(v - r) > (FAR - 1.0) * (abs(r) + 1e-12):
            return f"finite, but far from the healthy history: {label} {fmt_num(v)} vs {fmt_num(r)}"
    first, last = o.first_loss, o.loss
    if (
        first is not None
        and last is not None
        and math.isfinite(last)
        and abs(last) > FAR * (abs(first) + 1e-12)
    ):
        return (
            f"finite, but diverging over the {o.steps} replayed updates: loss "
            f"{fmt_num(first)} -> {fmt_num(last)}"
        )
    return ""


def locality(fix: FixLike) -> float:
    """The fix's locality (lower is more local): ``rank_locality``, else ``locality``,
    else that of a custom fix."""
    v = getattr(fix, "rank_locality", None)
    if isinstance(v, (int, float)):
        return float(v)
    loc = getattr(fix, "locality", None)
    return float(loc) if isinstance(loc, (int, float)) else 2.5


def _key(
    i: int, r: FixResult, ref: Reference, recorded: bool = False, spike: bool = False
) -> tuple[float, float, float, int]:
    loc = locality(r.fix)
    if isinstance(r.fix, NotReproducible):
        # a finite plain re-run outranks everything: every fix is then finite too
        # a plain re-run that fails (kind rerun) is no cause: after every fix tried; nor is
        # one of a snapshot that holds the weights after its failing update (``recorded``)
        # a spike snapshot's re-run that reproduces the spike (kind rerun, finite) is its
        # finding, after a divergence the history shows (``spike``)
        if spike and r.kind == FixKind.RERUN:
            return (0.9, 0.0, 0.0, i)
        cause = r.finite and r.kind == FixKind.NOT_REPRODUCIBLE and not recorded
        return (0, 0.0, 0.0, i) if cause else (4.5, 0.0, 0.0, i)
    if r.kind == FixKind.DIVERGED:
        # the history shows the run diverging: above every change to this one step
        return (0.5, 0.0, 0.0, i)
    if r.kind == FixKind.WEIGHTS_CORRUPTED or isinstance(r.fix, UpdateRecorded):
        return (1, 0.0, 0.0, i)
    if r.finite:
        # more than FAR times off the history: after the fixes that stay close to it
        return (2 + 0.5 * bool(far_from_history(r.outcome, ref)), loc, r.deviation or 0.0, i)
    if not r.applies or r.outcome.skipped:
        return (5, loc, 0.0, i)
    if r.outcome.error:
        return (4, loc, 0.0, i)
    return (3, loc, 0.0, i)


def rank(results: list[FixResult], ref: Reference, *, spike: bool = False) -> None:
    """Sort ``results`` in place and number them (``rank`` 1 first); a finite row far
    from the history gets a note saying so. ``spike``: the step is a spike snapshot's
    (finite by design), whose re-run is its finding."""
    for r in results:
        r.deviation = deviation(r.outcome, ref) if r.finite else None
        finding = r.kind in (FixKind.DIVERGED, FixKind.WEIGHTS_CORRUPTED) or isinstance(
            r.fix, UpdateRecorded
        )
        far = far_from_history(r.outcome, ref) if r.finite and not finding else ""
        if far:
            r.note = "; ".join(x for x in (r.note, far) if x)
    recorded = any(isinstance(r.fix, UpdateRecorded) for r in results)
    order = sorted(
        enumerate(results), key=lambda item: _key(item[0], item[1], ref, recorded, spike)
    )
    results[:] = [r for _, r in order]
    for n, r in enumerate(results, 1):
        r.rank = n
