"""Health checks: the training-stability checklist as findings that point at the cause.

>>> findings = nbdebug.check((model, x), target=y, loss_fn=F.cross_entropy, optimizer=opt)
>>> findings[0]            # the most severe, earliest in the trace
Finding(error log_of_nonpositive at the loss: n_nan=1, n_inf=0, phase=loss, op=Tensor.mul)
>>> findings.to_frame()    # one row per finding

``check`` takes a :class:`~nbdebug.core.trace.result.Trace`, a
:class:`~nbdebug.core.snapshot.Snapshot` (replayed when it has a model), a
``(model, inputs)`` / ``(model, inputs, target)`` tuple or a model with ``inputs=`` (traced
with :func:`nbdebug.trace`), or a :class:`nbdebug.NaNGuard` (the cheap checks
on its live model, optimizer and history). ``NaNGuard(..., checks=True)`` runs the cheap
checks every ``CHECK_EVERY`` steps and records their findings in its history (``"checks"``
of a row), so a snapshot tells what went wrong before the NaN.

The codes, their families, severities and meanings are one table,
:data:`~nbdebug.analysis.checks.codes.CODES` (``check``'s docstring shows it); the
thresholds are module-level constants of :mod:`nbdebug.analysis.checks.base`.

Findings are sorted by severity, then by position (named bands,
:class:`~nbdebug.analysis.checks.base.Band`: the trace by event, the step, a trace error,
the history by row, what a guard recorded by step; then findings with no position such
as the optimizer's), then causes before symptoms.

How :func:`check` works: the source is resolved into one
:class:`~nbdebug.analysis.checks.base.CheckContext` (trace, batch, loss, optimizer state,
history, scale), then every :class:`~nbdebug.analysis.checks.base.CheckFamily` of
``FAMILIES`` runs when the context has what it ``needs``; a family held back is named in
one ``check_skipped`` finding per missing need. Adding a health check: write it in its
family module of this package (``data``, ``origin``, ``forward``, ``precision``, ``grad``,
``optim``), list it in a ``FAMILIES`` tuple with its codes and needs, give a new
code its row in :data:`~nbdebug.analysis.checks.codes.CODES`, and test it in
``tests/test_checks.py``. A :class:`nbdebug.NaNGuard` source is checked on its
live model by :func:`~nbdebug.analysis.checks.guard.guard_findings`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...core.batch import LossError
from ...core.guard import NaNGuard, parse_history
from ...core.options import options_from
from ...core.snapshot import Snapshot, SnapshotError
from ...core.snapshot.load import ModelSource
from ...core.snapshot.resolve import Caller, expected_forms, resolve_source, source_kind
from ...core.trace import trace as run_trace
from ...core.trace.result import Trace, TraceError
from ...core.vocab import SourceKind
from . import data, forward, grad, guard, optim, precision
from .base import (
    CHECK_EVERY,
    NEEDS,
    Band,
    CheckContext,
    CheckFamily,
    Finding,
    Findings,
    LossFn,
    TraceView,
    check_clip_norm,
    position,
    run_families,
    skipped,
    sort_findings,
)
from .codes import CheckCode
from .guard import GuardChecks, guard_findings, parse_checks
from .state import check_state_dict

__all__ = [
    "CHECK_EVERY",
    "FAMILIES",
    "CheckOptions",
    "Finding",
    "Findings",
    "GuardChecks",
    "check",
    "check_state_dict",
    "guard_findings",
    "parse_checks",
]

#: Every check family, in the order they run (each module's ``FAMILIES``).
FAMILIES: tuple[CheckFamily, ...] = (
    *data.FAMILIES,
    *forward.FAMILIES,
    *precision.FAMILIES,
    *grad.FAMILIES,
    *optim.FAMILIES,
    *guard.FAMILIES,
)


class GradScalerLike(Protocol):
    """What the checks read of a ``torch.amp.GradScaler``."""

    def get_scale(self) -> float: ...


class SchedulerLike(Protocol):
    """What the checks read of a learning-rate scheduler."""

    def get_last_lr(self) -> list[float]: ...


@dataclass(frozen=True)
class CheckOptions:
    """The keyword arguments of :func:`check` (see there), validated.

    Attributes
    ----------
    inputs, target : optional
        The batch and its labels (for a trace or snapshot source: enable the data checks).
    loss_fn : callable, optional
    optimizer : torch.optim.Optimizer, optional
    scaler : torch.amp.GradScaler, optional
    scheduler : torch.optim.lr_scheduler.LRScheduler, optional
    history : NaNGuard, list of dict or pandas.DataFrame, optional
    clip_norm : float, optional
        The gradient-clipping norm the training loop uses.

    Raises
    ------
    TypeError
        An optimizer that is not a ``torch.optim.Optimizer``, a scaler without
        ``get_scale()``.
    ValueError
        A ``clip_norm`` that is not a positive finite number.
    """

    inputs: object = None
    target: object = None
    loss_fn: LossFn | None = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: GradScalerLike | None = None
    scheduler: SchedulerLike | None = None
    history: object = None
    clip_norm: float | None = None
    model: ModelSource | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", check_clip_norm(self.clip_norm))
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer; got "
                f"{type(self.optimizer).__qualname__}."
            )
        if self.scaler is not None and not hasattr(self.scaler, "get_scale"):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler; got {type(self.scaler).__qualname__}."
            )


def check(source: object, **options: Any) -> Findings:
    """Run the health checks on a trace, a snapshot, a model and batch, or a guard.

    Parameters
    ----------
    source : Trace, Snapshot, path, (model, inputs[, target]), torch.nn.Module or NaNGuard
        A module needs ``inputs=``; a model and batch are traced with
        :func:`nbdebug.trace` (one forward + backward; the model is left as it was). A
        snapshot path (or a NonFiniteError, its snapshot) is loaded with ``model=``, and
        replayed when it has one. :func:`nbdebug.core.snapshot.resolve_source` tells the
        forms apart.
    inputs : Tensor, tuple/list or dict, optional
        The batch (a Trace source brings its own, as it brings its target and loss
        function: :attr:`Trace.call <nbdebug.core.trace.result.Trace.call>`).
    target : optional
        Labels: enables ``label_out_of_range``; passed to ``loss_fn``.
    loss_fn : callable, optional
        As in :func:`nbdebug.trace`; also tells which loss the outputs feed.
    optimizer : torch.optim.Optimizer, optional
        Its state (Adam moments, eps).
    scaler : torch.amp.GradScaler, optional
        Its scale; also marks float16 mixed precision.
    scheduler : optional
        A learning-rate scheduler (its current lr is reported; schedule checks read the history).
    history : list of dict, pandas.DataFrame or NaNGuard, optional
        A guard's rolling history (``step``, ``loss``, ``grad_norm``, ``lr``, ``scale``,
        ``skipped``). A Snapshot brings its own.
    clip_norm : float, optional
        The ``max_norm`` of your gradient clipping (for the clipping checks).
    model : torch.nn.Module or callable, optional
        For a snapshot path (or a Snapshot loaded without one): the architecture (a
        module, copied, or a zero-argument factory), as for :func:`nbdebug.load_snapshot`.

    Returns
    -------
    Findings
        A list of :class:`Finding`, sorted by severity then position in the trace;
        ``.to_frame()`` gives a table, ``.counts`` the number per severity.

    Raises
    ------
    TypeError, ValueError
        An unsupported ``source``, a model without ``inputs``, a malformed batch, an
        unknown keyword argument. Odd models (no parameters, frozen layers, integer
        buffers, complex tensors) never raise: checks that cannot apply give an
        ``"info"`` finding saying why.

    Notes
    -----
    The codes (generated from :data:`nbdebug.analysis.checks.codes.CODES`):

    .. check codes (generated by nbdebug.analysis.checks.codes)

    ====================  ==========  ===============  ======================================  =====
    code                  family      severity         meaning                                 since
    ====================  ==========  ===============  ======================================  =====
    nonfinite_input       data        error            any NaN/Inf in the batch (rows listed)  0.1.0
    label_out_of_range    data        error            class label < 0 or >= C outputs         0.1.0
                                                       (``ignore_index`` aside); binary
                                                       target outside [0, 1]
    constant_feature      data        warning          std across the batch <= 1e-6 x max(1,   0.1.0
                                                       abs(mean)), batch >= 8 rows
    unscaled_input        data        warning          max - min of a floating input > 1e4     0.1.0
    exp_overflow_risk     forward     error / warning  first Inf made by exp / input to        0.1.0
                                                       Softmax, or logits into a hand-written
                                                       loss, above half the exp limit (44.36
                                                       in float32, 5.55 in float16)
    fp16_overflow_risk    forward     error / warning  first Inf made in float16 / float16     0.1.0
                                                       activations above 0.5 x 65504 (float32
                                                       ones too with a GradScaler)
    bf16_precision_loss   precision   warning          a bfloat16 module output whose std <    0.1.0
                                                       2**-8 x abs(mean), or a loss computed
                                                       in bfloat16
    dead_relu             forward     warning          share of exact zeros after a ReLU >     0.1.0
                                                       0.9
    saturated_activation  forward     warning          tanh/sigmoid outputs within 1e-3 of     0.1.0
                                                       the bounds for > 50% of elements (a
                                                       lower bound from the recorded
                                                       statistics)
    log_of_nonpositive    forward     error / warning  first NaN/Inf made by log/sqrt (input   0.1.0
                                                       <= 0, or sqrt'(0)) / probabilities of
                                                       0 or 1 into binary_cross_entropy
    division_by_zero      forward     error            first NaN/Inf made by a division        0.1.0
    nonfinite_origin      forward     error            any other first NaN/Inf                 0.1.0
    nonfinite_weight      forward     error            a parameter, buffer or checkpoint       0.1.0
                                                       tensor holding NaN/Inf
    nonfinite_gradient    gradient    error            parameters whose gradient holds         0.1.0
                                                       NaN/Inf (listed)
    vanishing_gradient    gradient    warning          grad/weight norm ratio < 1e-5 (weights  0.1.0
                                                       with ndim >= 2, embeddings aside)
    exploding_gradient    gradient    warning          that ratio > 100, or total grad norm >  0.1.0
                                                       10 x the median of the last 100
                                                       history rows
    unused_parameter      gradient    info             no gradient reached a parameter that    0.1.0
                                                       requires grad
    adam_state_outlier    optimizer   error / warning  float16 ``exp_avg_sq`` zeros with an    0.1.0
                                                       eps that rounds to 0 in float16 / a
                                                       moment's RMS > 3 sigma (log10) off its
                                                       recorded history
    lr_spike              optimizer   warning          lr grows > 2x between steps from a      0.1.0
                                                       steady or falling value (not a warm-
                                                       up)
    lr_schedule_boundary  optimizer   info / warning   warm-up end, decay start, step decay,   0.1.0
                                                       restart / and the loss rises > 1.5x
                                                       within 20 steps
    grad_clip_always_on   optimizer   warning          grad norm >= max_norm in > 90% of >=    0.1.0
                                                       20 steps
    grad_clip_never_on    optimizer   info             grad norm below max_norm in all of >=   0.1.0
                                                       20 steps
    grad_scaler_collapse  optimizer   warning / error  5 scale decreases in a row or 5         0.1.0
                                                       skipped of the last 20 steps / scale <
                                                       1
    state_dict_mismatch   checkpoint  error            missing / unexpected keys, shape        0.1.0
                                                       changes (``check_state_dict``)
    dtype_downcast        checkpoint  warning          float32 weights from a                  0.1.0
                                                       float16/bfloat16 checkpoint (max
                                                       round-off = eps/2 x largest value)
    trace_error           run         error            the model or the loss raised (the       0.1.0
                                                       partial trace is still checked)
    check_skipped         run         info             a check could not apply, and why (no    0.1.0
                                                       parameters, frozen layers, no
                                                       optimizer, no history, no batch, ...)
    ====================  ==========  ===============  ======================================  =====

    ..
    """
    opts = options_from(CheckOptions, options, where="check()")
    if isinstance(source, NaNGuard):
        return sort_findings(guard_findings(source, clip_norm=opts.clip_norm))
    ctx = CheckContext(
        inputs=opts.inputs, target=opts.target, loss_fn=opts.loss_fn, clip_norm=opts.clip_norm
    )
    history = opts.history
    ctx.history = None if history is None else [dict(r) for r in parse_history(history)]
    model = _resolve_source(ctx, source, opts.model)
    _resolve_training(ctx, model, opts)
    ctx.view = TraceView(ctx.trace) if ctx.trace is not None else None
    return sort_findings(run_families(ctx, FAMILIES))


#: what :func:`check` takes through :func:`~nbdebug.core.snapshot.resolve_source` (a
#: NaNGuard it checks itself; a directory is read as a file, which says it is one)
CHECK_SOURCE = Caller("check", frozenset({SourceKind.TRACE, SourceKind.SNAPSHOT, SourceKind.MODEL}))


def _resolve_source(
    ctx: CheckContext, source: object, model: ModelSource | None
) -> torch.nn.Module | None:
    """Fill ``ctx.trace`` (and the batch, the loss, the history a snapshot brings) from
    ``source``; returns the live model when there is one."""
    kind = source_kind(source)
    if kind is None:
        forms = expected_forms(CHECK_SOURCE.accept, also=("a NaNGuard",))
        raise TypeError(f"source must be {forms}; got {type(source).__qualname__}.")
    # a batch given beside a snapshot is what the checks read (the replay keeps its own)
    x, y = (None, None) if kind is SourceKind.SNAPSHOT else (ctx.inputs, ctx.target)
    src = resolve_source(source, x, y, model=model, caller=CHECK_SOURCE)
    if src.trace is not None:
        ctx.trace = src.trace
        _reuse_call(ctx, src.trace)
        error = src.error or src.trace.error  # a partial trace (as the debugger holds it)
        if error:
            ctx.found.append(_trace_error(error))
        return None
    if src.snapshot is not None:
        return _resolve_snapshot(ctx, src.snapshot)
    net = src.model
    assert net is not None  # a model and its batch
    x, y = ctx.inputs, ctx.target = src.inputs, src.target
    early = data.labels_before_trace(net, x, y, ctx.loss_fn)
    if early:
        ctx.found += early
        ctx.missing["trace"] = (
            "not traced: the loss would hit these out-of-range "
            "labels on the device (a device-side assert breaks the CUDA context)"
        )
        ctx.target = None  # judged already
    else:
        ctx.trace = _traced(ctx, lambda lf: run_trace(net, x, y, lf))
    return net


def _reuse_call(ctx: CheckContext, tr: Trace) -> None:
    """The batch, target and loss function the trace ran with, where none is given."""
    call = tr.call
    if call is None:
        return
    ctx.inputs = call.inputs if ctx.inputs is None else ctx.inputs
    ctx.target = call.target if ctx.target is None else ctx.target
    ctx.loss_fn = call.loss_fn if ctx.loss_fn is None else ctx.loss_fn


def _resolve_snapshot(ctx: CheckContext, snap: Snapshot) -> torch.nn.Module | None:
    ctx.inputs = snap.inputs if ctx.inputs is None else ctx.inputs
    ctx.target = snap.target if ctx.target is None else ctx.target
    if ctx.history is None:
        ctx.history = [dict(r) for r in parse_history(snap.history)]
    loss_error = None
    if ctx.loss_fn is None:
        try:
            ctx.loss_fn = snap.loss_fn()
        except SnapshotError as e:
            loss_error = str(e)
    if snap.model is None:
        ctx.missing["trace"] = (
            "the snapshot was loaded without a model (load_snapshot(path, model=...))"
        )
    elif ctx.loss_fn is not None or snap.target is None or snap.loss_source is not None:
        # (no loss function but a recorded loss source: the trainer's code computes it)
        ctx.trace = _traced(ctx, lambda lf: snap.trace(loss_fn=lf))
    else:
        ctx.missing["trace"] = loss_error or "the snapshot recorded no loss function: pass loss_fn="
        loss_error = None
    if loss_error is not None:
        ctx.found.append(skipped(["forward", "backward"], loss_error))
    if snap.optimizer_state is not None:
        ctx.optimizer_params = optim.state_dict_params(snap.optimizer_state, snap.optimizer_params)
    if snap.scaler_state:
        ctx.mixed_precision = True
        s = snap.scaler_state.get("scale")
        ctx.scale = float(s) if isinstance(s, (int, float)) else None
    return snap.model


def _resolve_training(ctx: CheckContext, model: torch.nn.Module | None, opts: CheckOptions) -> None:
    """The optimizer's state, the scaler's scale and the scheduler's note (given ones win
    over a snapshot's)."""
    if opts.optimizer is not None:
        ctx.optimizer_params = optim.optimizer_params(opts.optimizer, model)
        if model is None and ctx.trace is not None:
            _name_by_trace(ctx.optimizer_params, opts.optimizer, ctx.trace)
    scaler = opts.scaler
    if scaler is not None:
        ctx.mixed_precision = True
        enabled = getattr(scaler, "is_enabled", lambda: True)()
        ctx.scale = float(scaler.get_scale()) if enabled else None
    if opts.scheduler is not None and not ctx.history:
        lr = _last_lr(opts.scheduler)
        ctx.missing["history"] = (
            f"{NEEDS['history']}; the scheduler alone gives only the current lr ({lr})"
        )


def _traced(ctx: CheckContext, run: Callable[[LossFn | None], Trace]) -> Trace | None:
    """Trace with ``ctx.loss_fn``; without a usable loss, trace the forward only; a model
    that raises gives its partial trace (and a ``trace_error`` finding)."""
    try:
        return run(ctx.loss_fn)
    except LossError as e:
        ctx.found.append(skipped(grad.GRAD_CODES, f"no loss: {e}"))
        try:
            return run(_no_loss)
        except TraceError as err:
            ctx.found.append(_trace_error(str(err)))
            return err.trace
    except TraceError as err:
        ctx.found.append(_trace_error(str(err)))
        return err.trace


def _name_by_trace(
    opt_params: list[optim.OptimParam], optimizer: torch.optim.Optimizer, tr: Trace
) -> None:
    """Without the model, name the optimizer's parameters after the trace's when they are
    the same number, in the same order, with the same shapes (``model.parameters()`` order)."""
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    if len(shapes) == len(tr.params) and all(s == p.shape for s, p in zip(shapes, tr.params)):
        for op, p in zip(opt_params, tr.params):
            op.name = p.name


def _no_loss(*args: object) -> torch.Tensor:
    """A constant loss: the trace records the forward and skips the backward."""
    return torch.zeros(())


def _trace_error(message: str) -> Finding:
    return Finding(
        CheckCode.TRACE_ERROR,
        "error",
        "the traced step",
        {"message": message[:500]},
        "the model or the loss raised; the findings above come from the partial trace "
        "(fix them first).",
        position=position(Band.TRACE_ERROR),
    )


def _last_lr(scheduler: SchedulerLike) -> object:
    try:
        lr = scheduler.get_last_lr()
        return lr[0] if isinstance(lr, (list, tuple)) and len(lr) == 1 else lr
    except Exception:
        return "unknown"
