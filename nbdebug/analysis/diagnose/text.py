"""The sentences of a diagnosis: where the NaN/Inf is produced (the origin in words) and
the cause (the top row, the fixes that also work, or why none does)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...core.guard.history import HistoryRow
from ...core.text import fmt_num
from ...core.trace import Event, Trace
from ...core.vocab import EventKind, FixKind, Phase
from .advice import advice, replayed
from .divergence import Diverged
from .fix_pseudo import NotReproducible, UpdateRecorded, WeightsCorrupted
from .fix_rows import rows_phrase
from .history import diverging
from .hyper import OddHyper
from .result import Cause, FixResult, StepOutcome

if TYPE_CHECKING:
    from .over_steps import OverSteps

__all__ = ["StepFacts", "cause", "origin_text"]

#: The model's outputs are "extreme" at this magnitude: a loss origin after them is the
#: overflow of values the weights already made huge, not the loss function's fault.
EXTREME = 1e15

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
    step : int or None
        The diagnosed step.
    over_steps : OverSteps or None
        The replays over steps (a snapshot with a rewind window).
    odd : list of OddHyper
        The optimizer's hyper-parameters outside their usual range.
    spike : mapping or None
        A spike snapshot's reason (kind ``"spike"``): the step is finite by design.
    """

    recorded_failure: str | None = None
    dropped_autocast: str | None = None
    history: Sequence[HistoryRow] = field(default_factory=list)
    step: int | None = None
    over_steps: OverSteps | None = None
    odd: list[OddHyper] = field(default_factory=list)
    spike: Mapping[str, Any] | None = None

    def recorded_loss(self) -> float | None:
        """The non-finite loss the history recorded at this step, else ``None``."""
        for h in self.history:
            if self.step is not None and h.get("step") == self.step:
                v = h.get("loss")
                if isinstance(v, (int, float)) and not math.isfinite(v):
                    return float(v)
        return None


def _largest_before(tr: Trace, o: Event) -> Event | None:
    """The finite batch tensor or module output of largest magnitude before ``o``."""
    seen = [
        e
        for e in tr.events[: o.index]
        if e.phase in (Phase.INPUT, Phase.FORWARD)
        and e.kind in (EventKind.INPUT, EventKind.OUTPUT)
        and math.isfinite(e.stats.absmax)
    ]
    return max(seen, key=lambda e: (e.stats.absmax, e.index), default=None)


def _extreme_outputs(tr: Trace, o: Event, step: int | None) -> str:
    """``"the model's outputs reached 3e29 at step 7; the loss turned them into Inf"``
    when a loss (or forward) origin follows values of :data:`EXTREME` magnitude (the
    weights made them huge: the op that overflowed is not the cause), else ``""``."""
    if o.phase not in (Phase.LOSS, Phase.FORWARD):
        return ""
    big = _largest_before(tr, o)
    if big is None or big.stats.absmax < EXTREME:
        return ""
    what = "NaN" if o.stats.n_nan else "Inf"
    at = f" at step {step}" if step is not None else ""
    if o.phase == Phase.LOSS:
        outs = [e for e in tr.events[: o.index] if e.phase == Phase.FORWARD]
        last = big is outs[-1] if outs else False
        where = (
            "the model's outputs" if last or big.module == "" else f"the outputs of {big.module}"
        )
        return f"{where} reached {fmt_num(big.stats.absmax)}{at}; the loss turned them into {what}"
    held = "the batch" if big.phase == Phase.INPUT else f"the output of {big.module or '<model>'}"
    mt = f" ({o.module_type})" if o.module_type else ""
    return (
        f"the activations reached {fmt_num(big.stats.absmax)}{at} ({held}); "
        f"{o.module or '<model>'}{mt} turned them into {what}"
    )


def origin_text(
    tr: Trace | None, plain: StepOutcome, step: int | None = None, recorded: str | None = None
) -> str:
    """The origin of the failing step in words, lower case (it starts a sentence's
    second half): ``"norm (Normalize) produces NaN in the forward pass at Tensor.div
    (model.py:12), batch row 3"``; for a loss that overflows outputs already extreme,
    that (``"the model's outputs reached 3e29 at step 7; the loss turned them into
    Inf"``); for a finite replay of a step the run ``recorded`` as failing, that."""
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
        if recorded and plain.finite:
            return (
                "the stored batch replays finite (forward, loss and backward), although the "
                f"run recorded {recorded}"
            )
        return "forward, loss and backward are finite"
    if o.phase == Phase.OPTIMIZER:
        # the update's own sentence: "the Adam step made emb.weight non-finite: eps=0 ..."
        said = o.note or f"{o.op or 'the optimizer step'} made {o.param or o.name} non-finite"
        return f"forward, loss and backward are finite; {said}"
    extreme = _extreme_outputs(tr, o, step)
    if extreme:
        return extreme
    what = "NaN" if o.stats.n_nan else "Inf"
    if o.phase == Phase.INPUT:
        held = "the target" if o.kind == EventKind.TARGET else "the batch itself"
        where = f"{held} holds {what} (`{o.name}`)"
    elif o.phase == Phase.LOSS:
        where = f"the loss turns finite outputs into {what}"
    else:
        mt = f" ({o.module_type})" if o.module_type else ""
        stage = "forward" if o.phase == Phase.FORWARD else "backward"
        dtype = f" in {o.dtype}" if o.dtype in ("float16", "bfloat16") else ""
        where = f"{o.module or '<model>'}{mt} produces {what} in the {stage} pass{dtype}"
    op = f" at {o.op}" if o.op else ""
    src = f" ({o.source})" if o.source else ""
    rows = f", batch {rows_phrase(list(o.samples), tr.batch_size)}" if o.samples else ""
    param = f"; parameter {o.param}" if o.param else ""
    return f"{where}{op}{src}{rows}{param}"


def _finite_as_is(facts: StepFacts) -> str:
    """The plain replay is finite."""
    if facts.spike is not None:
        return (
            f"{_spike_head(facts)}; replayed as it was, the step does not reproduce it: the "
            "spike is not reproducible (non-determinism, a module with state between calls, "
            "or hardware)."
        )
    if facts.recorded_failure and facts.dropped_autocast is not None:
        return (
            f"the step replayed in the model's own dtypes (autocast=False) is finite, "
            f"although the run recorded {facts.recorded_failure}: the failure comes from "
            f"running under {facts.dropped_autocast} autocast; diagnose with autocast=True to "
            "find where."
        )
    nan = facts.recorded_loss()
    if facts.recorded_failure and nan is not None:
        return (
            f"the stored batch replays finite end to end, although the run recorded a {nan} "
            f"loss at step {facts.step}: the data the step saw differs from the data stored, "
            "so look at the input pipeline (DataLoader workers, a buffer reused or changed "
            "before the step finished, an in-place transform)."
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
        if r.finite and not isinstance(r.fix, NotReproducible) and r.kind != top.kind
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
    plain = next((r for r in results if isinstance(r.fix, NotReproducible)), None)
    reproduced = plain is not None and plain.outcome.skipped is None and not plain.finite
    again = " the failure reproduces, and" if reproduced else ""
    s = f"{origin};{again} no candidate fix made the step finite end to end"
    grew = diverging(facts.history)
    return s + (f"; {grew}." if grew else ".")


def _diverged(results: list[FixResult], top: Diverged, origin: str, facts: StepFacts) -> str:
    """The history shows a divergence: the origin, whether a change to this step made it
    finite, the evidence and what to change in the run, as far as the replays over steps
    verified it (:func:`.advice.advice`)."""
    d = top.divergence
    fixed = [
        r
        for r in results
        if r.finite and r.kind != FixKind.DIVERGED and not isinstance(r.fix, NotReproducible)
    ]
    plain = next((r for r in results if isinstance(r.fix, NotReproducible)), None)
    if fixed:
        now = f"{fixed[0].action()} makes this step finite, but"
    elif any(isinstance(r.fix, UpdateRecorded) for r in results):
        now = (
            "the snapshot holds the weights after that update (check_update=True does not roll "
            "it back), and"
        )
    elif plain is not None and plain.outcome.finite:
        now = "the step replayed as it is stays finite, but"
    else:
        now = "the failure reproduces, and no candidate fix made the step finite end to end:"
    return f"{origin}; {now} {d.statement()}{advice(d, facts.over_steps, facts.odd)}"


def _spike_head(facts: StepFacts) -> str:
    """``"step 8 is a spike, not a failing step: loss spiked at step 8: 3.8e9 is 3.2e7
    robust sigmas above ..."``."""
    reason = facts.spike or {}
    at = f"step {facts.step}" if facts.step is not None else "this step"
    said = str(reason.get("message", "")) or "a loss or gradient-norm spike"
    found = [f for f in reason.get("spikes") or [] if isinstance(f, dict)]
    rise = bool(found) and all(f.get("rise") is not None for f in found)
    what = "part of a sustained rise of the loss" if rise else "a spike"
    return (
        f"{at} is {what}, not a failing step ({said}): the guard wrote this snapshot before "
        "any NaN, so the step is finite by design"
    )


def _spike(results: list[FixResult], top: FixResult, facts: StepFacts) -> str:
    """A spike snapshot whose re-run reproduces the spike: the spike, the divergence the
    history shows (and the advice the replays over steps verify), or what the replays over
    steps showed."""
    plain = next((r for r in results if isinstance(r.fix, NotReproducible)), None)
    loss = plain.outcome.loss if plain is not None else None
    again = f"; replayed as it was, the step reproduces it (loss {fmt_num(loss)})"
    head = _spike_head(facts) + again
    if isinstance(top.fix, Diverged):
        d = top.fix.divergence
        return f"{head}; {d.statement()}{advice(d, facts.over_steps, facts.odd)}"
    over = facts.over_steps
    verdict = f" (their verdict: {over.verdict})" if over is not None and over.verdict else ""
    return f"{head}; {replayed(over)}{verdict}."


def _recorded_update(fix: UpdateRecorded) -> str:
    """The guard saw the update make the weights non-finite and did not roll it back."""
    return (
        f"{fix.message}; the weights were finite before that update (the guard watched every "
        "update) and the snapshot holds them after it (check_update=True does not roll an "
        f"update back), so no fix can be replayed on it: use {fix.remedy()}, and record with "
        "NaNGuard(check_update='rollback') to have diagnose verify it."
    )


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
    elif facts.spike is not None and kind in (FixKind.DIVERGED, FixKind.RERUN):
        s = _spike(results, top, facts)
    elif isinstance(top.fix, Diverged):
        s = _diverged(results, top.fix, origin, facts)
    elif isinstance(top.fix, UpdateRecorded):
        s = _recorded_update(top.fix)
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
