"""The sentences of a diagnosis: where the NaN/Inf is produced (the origin in words) and
the cause (the top row, the fixes that also work, or why none does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...core.guard.history import HistoryRow
from ...core.text import rows_text
from ...core.trace import Trace
from ...core.vocab import EventKind, FixKind, Phase
from .fix_pseudo import WeightsCorrupted
from .history import diverging
from .result import Cause, FixResult, StepOutcome

__all__ = ["StepFacts", "cause", "origin_text"]

#: Kinds whose cause takes the origin's rows when the fix names none.
_ROW_KINDS = (FixKind.EPSILON, FixKind.DROP_ROWS, FixKind.FLOAT32, FixKind.CUSTOM)


@dataclass(frozen=True)
class StepFacts:
    """What the cause sentence says about the step besides the rows.

    Attributes
    ----------
    recorded_failure : str or None
        What the run recorded (a snapshot's reason).
    dropped_autocast : str or None
        The recorded autocast dtype when the replays ran without it (``autocast=False``).
    history : sequence of dict
        The guard's history rows.
    """

    recorded_failure: str | None = None
    dropped_autocast: str | None = None
    history: Sequence[HistoryRow] = field(default_factory=list)


def origin_text(tr: Trace | None, plain: StepOutcome) -> str:
    """The origin of the failing step in words, lower case (it starts a sentence's
    second half): ``"norm (Normalize) produces NaN in the forward pass at Tensor.div
    (model.py:12), batch row 3"``."""
    if tr is None:
        return "the step could not be traced"
    o = tr.origin
    if o is None:
        if tr.first_nonfinite is not None:
            return f"the first non-finite value is at {tr.first_nonfinite.label}"
        if plain.error:
            return f"the step raises ({plain.error})"
        if plain.update is False:
            return (
                "forward, loss and backward are finite; the optimizer step makes the weights "
                "non-finite"
            )
        return "forward, loss and backward are finite"
    what = "NaN" if o.stats.n_nan else "Inf"
    if o.phase == Phase.INPUT:
        held = "the target" if o.kind == EventKind.TARGET else "the batch itself"
        where = f"{held} holds {what} (`{o.name}`)"
    elif o.phase == Phase.LOSS:
        where = f"the loss turns finite outputs into {what}"
    else:
        mt = f" ({o.module_type})" if o.module_type else ""
        stage = "forward" if o.phase == Phase.FORWARD else "backward"
        where = f"{o.module or '<model>'}{mt} produces {what} in the {stage} pass"
    op = f" at {o.op}" if o.op else ""
    src = f" ({o.source})" if o.source else ""
    rows = f", batch {rows_text(o.samples)}" if o.samples else ""
    param = f"; parameter {o.param}" if o.param else ""
    return f"{where}{op}{src}{rows}{param}"


def _finite_as_is(facts: StepFacts) -> str:
    """The plain replay is finite."""
    if facts.recorded_failure and facts.dropped_autocast is not None:
        return (
            f"the step replayed in the model's own dtypes (autocast=False) is finite, "
            f"although the run recorded {facts.recorded_failure}: the failure comes from "
            f"running under {facts.dropped_autocast} autocast; diagnose with autocast=True to "
            "find where."
        )
    if facts.recorded_failure:
        return (
            "the step replayed bit for bit is finite, although the run recorded "
            f"{facts.recorded_failure}: the failure is not reproducible (non-determinism, a "
            "module with state between calls, or hardware)."
        )
    return (
        "the step is finite end to end when run as it is: there is nothing to fix (or "
        "the failure is not reproducible)."
    )


def _fixed(results: list[FixResult], origin: str) -> str:
    """The top row made the step finite: it, and up to two other kinds that did too."""
    top = results[0]
    others = [
        r
        for r in results[1:]
        if r.finite and r.kind != FixKind.NOT_REPRODUCIBLE and r.kind != top.kind
    ][:2]
    also = ", as does " + " and ".join(r.action() for r in others) if others else ""
    return f"{origin}; {top.describe()} makes the step finite end to end{also}."


def _unfixed(results: list[FixResult], origin: str, facts: StepFacts) -> str:
    """No row made the step finite: none was replayed in the budget, or none works."""
    unrun = [r for r in results[1:] if r.applies and r.outcome.skipped]
    tried = [r for r in results[1:] if r.applies and not r.outcome.skipped]
    if unrun and not tried:
        n = f"{len(unrun)} candidate fix" + ("es" if len(unrun) > 1 else "")
        return (
            f"{origin}; budget_s ran out before any of the {n} found was replayed: raise it "
            "to try them."
        )
    again = " the failure reproduces, and" if results[0].kind == FixKind.NOT_REPRODUCIBLE else ""
    s = f"{origin};{again} no candidate fix made the step finite end to end"
    grew = diverging(facts.history)
    return s + (f"; {grew}." if grew else ".")


def cause(results: list[FixResult], tr: Trace | None, origin: str, facts: StepFacts) -> Cause:
    """The :class:`Cause` of ranked ``results`` (the top row) in one sentence."""
    top = results[0]
    o = tr.origin if tr is not None else None
    rows = top.rows
    if not rows and o is not None and top.kind in _ROW_KINDS:
        rows = list(o.samples)
    kind = top.kind
    if kind == FixKind.NOT_REPRODUCIBLE and top.finite:
        s = _finite_as_is(facts)
    elif kind == FixKind.WEIGHTS_CORRUPTED:
        what = top.fix.finding() if isinstance(top.fix, WeightsCorrupted) else top.describe()
        s = f"{what}: no replay of this step can fix it; {top.note or 'look at an earlier step'}."
    elif top.finite:
        s = _fixed(results, origin)
    else:
        s = _unfixed(results, origin, facts)
    return Cause(
        kind=kind,
        module=top.module,
        rows=rows,
        finite=top.finite,
        statement=s,
        fix=top.fix,
        op=getattr(top.fix, "op", None) or (o.op if o is not None else None),
        source=getattr(top.fix, "source", None) or (o.source if o is not None else None),
    )
