"""``nbdebug.diagnose()``: replay the failing step with candidate fixes and rank the causes
by what removes the non-finite value.

The algorithm:

1. resolve the source (a :class:`~nbdebug.Snapshot`, a snapshot path, or a model and a
   batch) into a :class:`~.workbench.Workbench`: copies of the model, the optimizer and
   the scaler holding the step's state, the batch, the loss and the step's RNG;
2. trace the step (:func:`nbdebug.trace`) to find where the NaN/Inf is produced;
3. choose the fix menu from the origin and the findings (:func:`~.menu.menu`) plus the
   user's fixes;
4. replay the whole step (forward, loss, backward, clipping, ``optimizer.step()``) once
   plainly and once per fix, each on freshly reset copies;
5. rank (:func:`~.rank.rank`): a fix counts only when the loss, every gradient and the
   weights after the update are finite; among those the most local change first, then
   the smallest deviation of loss and gradient norm from the recent healthy history.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...core.guard.update_replay import with_update_origin
from ...core.snapshot import ResolvedStep, resolve_step
from ...core.snapshot.listing import list_snapshots
from ...core.snapshot.load import ModelSource
from ...core.snapshot.resolve import ResolveOptions
from ...core.state import RngState
from ...core.text import fmt_num
from ...core.trace import Trace, TraceError
from ...core.vocab import FailureKind, FixKind, Phase
from .advice import advice_code
from .compiled import compiler_note, precision_note
from .divergence import Diverged, find_divergence
from .fix import FixLike
from .fix_epsilon import EpsilonFix
from .fix_optstate import eps_groups
from .fix_pseudo import NotReproducible, UpdateRecorded, WeightsCorrupted
from .fix_rows import out_of_range_rows
from .history import earlier_step, reference
from .hyper import odd_hyperparameters
from .menu import MenuContext, menu
from .options import DiagnoseOptions
from .over_steps import over_steps_of
from .rank import rank
from .result import Diagnosis, FixResult, Reference, StepOutcome, safe_text
from .rewrite import FAMILIES
from .text import StepFacts, cause, origin_text
from .workbench import Workbench

__all__ = ["diagnose"]


def diagnose(
    source: object,
    inputs: Any = None,
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    *,
    model: ModelSource | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    options: DiagnoseOptions | None = None,
    **kwargs: Any,
) -> Diagnosis:
    """Replay the failing step with candidate fixes and rank the causes by what removes the
    NaN/Inf.

    Parameters
    ----------
    source : Snapshot, str/PathLike, NonFiniteError or torch.nn.Module
        A loaded snapshot; a snapshot file (or a directory of them: the earliest is taken)
        with ``model=``; the guard's error (it names its snapshot); or the model itself,
        followed by its batch.
    inputs, target, loss_fn
        With a model: the batch and the loss, as :func:`nbdebug.trace` takes them
        (``model(x)``, ``model(*inputs)``, ``model(**inputs)``; ``loss_fn(output, target)``).
        With a snapshot: ``loss_fn`` overrides the recorded one.
    model : torch.nn.Module or callable, optional
        With a snapshot path: the architecture (a module, copied, or a factory).
    optimizer : torch.optim.Optimizer, optional
        With a model: the optimizer over its parameters (copied with its state; never
        stepped itself). A snapshot brings its own optimizer state.
    options : DiagnoseOptions, optional
        The keyword options below as one value; keywords given as well replace its fields.
    scaler : torch.amp.GradScaler, optional
        Its state is copied into the replays' scaler.
    history : NaNGuard, list of dict or DataFrame, optional
        Healthy rows (``loss``, ``grad_norm``) to compare the fixes with; a snapshot
        brings the guard's history.
    fixes : sequence, optional
        Fix objects (:class:`nbdebug.Fix` and its subclasses) to try, and/or kind names
        that select from the menu (``["epsilon", "drop_rows"]``). Default: the whole menu.
    steps : int
        Optimizer steps replayed on the batch per fix (all must stay finite); a row's
        ``loss`` and ``grad_norm`` are the last step's, so a fix that stays finite but
        still diverges is ranked after those near the healthy history. With a snapshot
        holding a rewind window (``NaNGuard(rewind=K)``) also ``k``, the steps the replays
        over steps run beyond the failing one (default 3 when not given; ``d.replays``).
    budget_s : float, optional
        Stop starting replays after this many seconds (the remaining rows say so).
    trust_recipe : bool
        With a snapshot path and no ``model``: build the model from the recorded recipe.
    progress : bool
        A ``tqdm.auto`` progress bar over the replays.
    autocast : bool
        With a snapshot of a step that ran under ``torch.autocast`` (``snap.autocast``):
        the trace and every replay (the plain one and each fix) run their forward and
        loss under the same dtype, as ``snap.trace()`` does. ``False``: in the model's
        own dtypes. (With a model, the replays run under whatever autocast is active
        around the call.)

    Returns
    -------
    Diagnosis
        ``.cause`` (kind, module, rows, finite, statement), ``.results``, ``.to_frame()``,
        ``.summary()``, ``.ok`` (the step as it is is finite), ``.show()``.

    Raises
    ------
    TypeError, ValueError
        A source of the wrong type, a missing batch, an optimizer over other parameters,
        an ``autocast`` that is not a bool, an unknown keyword option.
    SnapshotError
        An unreadable snapshot, a model that does not fit it, no model to build, an
        autocast dtype this machine's device does not support (``autocast=False``
        replays without it).
    TraceError
        The step raises before any value is non-finite (e.g. a batch that does not fit
        the model): there is no NaN to diagnose. As :func:`nbdebug.trace` raises it: it
        names the module and carries the partial trace.

    Examples
    --------
    >>> d = nbdebug.diagnose("snapshots/step-000048213.nbsnap", model=make_model)
    >>> d.cause.kind, d.cause.module, d.cause.rows
    ('epsilon', 'norm', [3])
    >>> d.to_frame()
    """
    opts = DiagnoseOptions.of(options, kwargs)
    caller = RngState.capture()
    t_start = time.perf_counter()
    try:
        how = ResolveOptions(trust_recipe=opts.trust_recipe, scaler=opts.scaler, caller="diagnose")
        src = resolve_step(
            source,
            inputs,
            target,
            loss_fn=loss_fn,
            model=model,
            optimizer=optimizer,
            history=opts.history,
            options=how,
        )
        bench = Workbench(src, steps=opts.steps, autocast=opts.autocast)
        # replays over steps: k = steps when given, else their own default
        beyond = kwargs.get("steps", None if options is None else options.steps)
        return _diagnose(src, bench, opts, t_start, beyond)
    finally:
        caller.restore()


def _trace(bench: Workbench, notes: list[str], src: ResolvedStep) -> Trace:
    """The trace of the step as it is; a partial one (and a note) when it raises after
    a value went non-finite. A snapshot whose step failed in the optimizer update (reason
    kind ``"optimizer"``) gets that update as its origin where the forward and backward
    are finite, as ``snap.trace()`` does."""
    try:
        tr = bench.trace()
    except TraceError as e:
        if e.trace is None or e.trace.first_nonfinite is None:
            # the step fails before any value is non-finite (a batch that does not fit
            # the model, a target of the wrong length): there is no NaN to diagnose
            raise
        notes.append(f"the trace of the step raised: {e}")
        tr = e.trace
    if src.snapshot is None:
        return tr
    try:
        return with_update_origin(src.snapshot, tr)
    except Exception as e:  # the update's replay is a hint; the replays decide
        notes.append(f"the optimizer update could not be replayed alone: {e}")
        return tr


def _unrolled_update(src: ResolvedStep) -> dict[str, Any] | None:
    """The reason of a snapshot whose optimizer update made the weights non-finite and
    was not rolled back (``NaNGuard(check_update=True)``): it holds the weights after
    that update. ``None`` for any other source."""
    snap = src.snapshot
    if snap is None or snap.kind != FailureKind.OPTIMIZER:
        return None
    reason = dict(snap.reason)
    return None if reason.get("rolled_back", False) else reason


def _plain(bench: Workbench, notes: list[str]) -> tuple[NotReproducible, StepOutcome]:
    """The step replayed as it is, twice (the first also warms up: an optimizer's first
    step is slow); a note when the two disagree."""
    plain_fix = NotReproducible()
    first = bench.run(plain_fix)
    plain = bench.run(plain_fix)
    same_loss = first.loss == plain.loss or (first.loss != first.loss and plain.loss != plain.loss)
    if first.finite != plain.finite or not same_loss:
        notes.append(
            "two identical replays of the step disagree (loss "
            f"{fmt_num(first.loss)} vs {fmt_num(plain.loss)}): the step is not deterministic."
        )
    return plain_fix, plain


def _diagnose(
    src: ResolvedStep,
    bench: Workbench,
    opts: DiagnoseOptions,
    t_start: float,
    beyond: int | None = None,
) -> Diagnosis:
    notes = list(src.notes)
    tr = _trace(bench, notes, src)
    div = find_divergence(src.history, src.step)
    # the healthy band: the steps before a divergence began, never the steps diagnosed
    ref = div.band if div is not None else reference(src.history)
    plain_fix, plain = _plain(bench, notes)
    spike = _spike_reason(src)
    if not plain.finite or (spike is not None and _reproduces(spike, plain)):
        plain_fix.reproduced()
    ctx = _menu_context(tr, bench, src, ref)
    ctx.divergence = div
    kinds, extra = opts.choice.kinds, opts.choice.extra
    candidates: list[FixLike] = []
    if kinds is None or kinds:
        candidates = [f for f in menu(tr, ctx) if kinds is None or f.kind in kinds]
    candidates += extra
    budget = _Budget(opts.budget_s, t_start)
    # a spike's re-run that reproduces it is a finding, not a step made finite
    results = [FixResult(plain_fix, plain, unchanged=spike is not None and plain.finite)]
    results += _run_all(bench, tr, candidates, plain, budget, opts.progress)
    for r in results:
        if plain.seconds > 0 and r.outcome.skipped is None and r.applies:
            r.cost = r.outcome.seconds / plain.seconds
        _mark_unchanged(r, plain)
    if plain.error:
        notes.append(f"the plain replay of the step raised: {plain.error}")
    origin = origin_text(tr, plain, src.step, src.recorded_failure)
    rank(results, ref, spike=spike is not None)
    dropped = None
    if src.autocast is not None and not opts.autocast:
        dropped = str(src.autocast.get("dtype", "its autocast dtype"))
    deadline = None if opts.budget_s is None else t_start + opts.budget_s
    over, said = over_steps_of(src, div, steps=beyond, deadline=deadline)
    notes += said
    odd = odd_hyperparameters(bench.optimizer)
    facts = StepFacts(src.recorded_failure, dropped, src.history, src.step, over, odd, spike)
    for r in results:
        if isinstance(r.fix, Diverged):
            r.fix.code = advice_code(r.fix.divergence, over, odd)
    # the replay comparison: is a compiled model's NaN the compiler's; a float32 fix's evidence
    notes += [n for n in (compiler_note(src), precision_note(src, tr, results)) if n]
    plain_fix.pipeline = plain.finite and facts.recorded_loss() is not None
    return Diagnosis(
        cause=cause(results, tr, origin, facts),
        results=results,
        trace=tr,
        origin=origin,
        plain=plain,
        reference={"loss": ref.loss, "grad_norm": ref.grad_norm},
        notes=notes,
        step=src.step,
        workbench=bench,
        over_steps=over,
    )


def _menu_context(
    tr: Trace | None, bench: Workbench, src: ResolvedStep, ref: Reference
) -> MenuContext:
    ctx = MenuContext(has_optimizer=bench.optimizer is not None)
    if bench.optimizer is not None and bench.optimizer.param_groups:
        lr = bench.optimizer.param_groups[0].get("lr")
        ctx.lr = float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
    if src.scaler_state is not None:
        sc = src.scaler_state.get("scale")
        ctx.scaler_scale = float(sc) if isinstance(sc, (int, float, torch.Tensor)) else None
    ctx.grad_norm_ref = ref.grad_norm
    ctx.out_of_range = out_of_range_rows((bench.inputs, bench.target), bench.batch_size)
    ctx.corrupted = bench.nonfinite_state()
    ctx.eps_groups = eps_groups(bench.optimizer)
    ctx.update_recorded = _unrolled_update(src)
    if ctx.corrupted:
        ctx.earlier = earlier_step(src.history, src.step)
        ctx.directory, ctx.earlier_snapshot = _snapshot_before(src)
    o = tr.origin if tr is not None else None
    if o is not None and o.phase in (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD):
        module = None if o.phase == Phase.LOSS else o.module
        ctx.probed, ctx.sites = bench.probe(module, FAMILIES)
        seen = bench.recognise()
        ctx.builtins, ctx.builtin_lines, ctx.casts = seen.found, seen.lines, seen.casts
        ctx.builtin_dims, ctx.builtin_returns = seen.dims, seen.returns
        ctx.exp_lines = seen.exp_lines
    return ctx


def _spike_reason(src: ResolvedStep) -> dict[str, Any] | None:
    """A spike snapshot's reason (kind ``"spike"``: a finite step the spike detector
    flagged), else ``None``."""
    snap = src.snapshot
    if snap is None or snap.kind != FailureKind.SPIKE:
        return None
    return dict(snap.reason)


def _reproduces(spike: dict[str, Any], plain: StepOutcome) -> bool:
    """The plain replay of a spike step is finite with the loss the guard recorded (within
    1%; any finite loss where none was recorded)."""
    if not plain.finite or plain.loss is None:
        return False
    recorded = spike.get("loss")
    if isinstance(recorded, bool) or not isinstance(recorded, (int, float)):
        return True
    return math.isclose(plain.loss, float(recorded), rel_tol=1e-2)


def _snapshot_before(src: ResolvedStep) -> tuple[str | None, str | None]:
    """The diagnosed snapshot's directory and the latest snapshot file there before its
    step (``None`` where there is none)."""
    path = getattr(src.snapshot, "path", None) if src.snapshot is not None else None
    if path is None:
        return None, None
    directory = Path(path).parent
    try:
        df = list_snapshots(directory)
    except (OSError, ValueError):
        return str(directory), None
    step = -1 if src.step is None else src.step
    df = df[df["step"].notna() & (df["step"] < step)]
    return str(directory), (str(df["path"].iloc[-1]) if len(df) else None)


#: Rows that report the step as it is rather than change it.
_FINDINGS = (
    FixKind.NOT_REPRODUCIBLE,
    FixKind.RERUN,
    FixKind.WEIGHTS_CORRUPTED,
    FixKind.DIVERGED,
)


def _mark_unchanged(r: FixResult, plain: StepOutcome) -> None:
    """A fix whose replay is identical to the plain replay changed nothing, and none is
    needed where the plain replay is finite: either way it is no fix."""
    finding = r.kind in _FINDINGS or isinstance(r.fix, UpdateRecorded)
    if finding or not r.applies or r.outcome.skipped is not None:
        return
    if not plain.finite and not r.outcome.finite:
        return  # a fix that did not work: its row says so without this
    if r.outcome.same_as(plain):
        why = "changed nothing: the replay is identical to the plain replay"
    elif plain.finite and r.outcome.finite:
        why = "no fix: the step replayed as it was is finite without it"
    else:
        return
    r.unchanged = True
    r.note = "; ".join(x for x in (r.note, why) if x)


@dataclass(frozen=True)
class _Budget:
    seconds: float | None
    start: float

    def spent(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start > self.seconds


def _skip_row(fix: FixLike, tr: Trace | None) -> FixResult | None:
    """The row of a fix that does not apply (or whose ``applies()`` raised), else None."""
    try:
        applies = getattr(fix, "applies", None)
        ok = bool(applies(tr)) if callable(applies) and tr is not None else True
    except Exception as e:
        out = StepOutcome(error=f"applies() raised {type(e).__name__}: {e}")
        return FixResult(fix, out, applies=False)
    if ok:
        return None
    why = getattr(fix, "why_not", None)
    text = safe_text(lambda: why(tr), "") if callable(why) else ""
    return FixResult(
        fix,
        StepOutcome(skipped="does not apply"),
        applies=False,
        note=text or "does not apply to this step.",
    )


def _run_one(
    bench: Workbench, tr: Trace | None, fix: FixLike, plain: StepOutcome, budget: _Budget
) -> FixResult:
    skip = _skip_row(fix, tr)
    if skip is not None:
        return skip
    if isinstance(fix, WeightsCorrupted):
        return FixResult(fix, copy.copy(plain), note=fix.earlier)
    if isinstance(fix, UpdateRecorded):
        why = "not replayed: the snapshot holds the weights after the failing update"
        return FixResult(fix, StepOutcome(skipped=why), note=fix.message)
    if isinstance(fix, Diverged):  # a finding: the step as it is, no fix
        row = FixResult(fix, copy.copy(plain), note=fix.divergence.evidence())
        row.unchanged = True
        return row
    if budget.spent():
        why = f"not replayed: budget_s={budget.seconds:g} s spent"
        return FixResult(fix, StepOutcome(skipped=why))
    out = bench.run(fix)
    note = ""
    if isinstance(fix, EpsilonFix) and fix.rewritten == 0 and out.error is None:
        note = f"no {fix.op} operation ran in {fix.place()}: nothing was rewritten."
    return FixResult(fix, out, note=note)


def _run_all(
    bench: Workbench,
    tr: Trace | None,
    candidates: list[FixLike],
    plain: StepOutcome,
    budget: _Budget,
    progress: bool,
) -> list[FixResult]:
    from tqdm.auto import tqdm

    bar = tqdm(candidates, desc="replaying fixes", disable=not progress, leave=False)
    try:
        return [_run_one(bench, tr, fix, plain, budget) for fix in bar]
    finally:
        bar.close()
