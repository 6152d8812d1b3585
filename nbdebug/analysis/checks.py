"""Health checks: the training-stability checklist as findings that point at the cause.

>>> findings = nbdebug.check((model, x), target=y, loss_fn=F.cross_entropy, optimizer=opt)
>>> findings[0]            # the most severe, earliest in the trace
Finding(error log_of_nonpositive at the loss: n_nan=1, n_inf=0, phase=loss, op=Tensor.mul)
>>> findings.to_frame()    # one row per finding

``check`` takes a :class:`~nbdebug.core.result.Trace`, a
:class:`~nbdebug.core.snapshot.Snapshot` (replayed when it has a model), a
``(model, inputs)`` / ``(model, inputs, target)`` tuple or a model with ``inputs=`` (traced
with :func:`nbdebug.trace`), or a :class:`~nbdebug.core.guard.NaNGuard` (the cheap checks
on its live model, optimizer and history). ``NaNGuard(..., checks=True)`` runs the cheap
checks every ``CHECK_EVERY`` steps and records their findings in its history (``"checks"``
of a row), so a snapshot tells what went wrong before the NaN.

Codes, severities and thresholds (module-level constants of
:mod:`nbdebug.analysis.checks_base`):

======================  ========  ==============================================================
code                    severity  triggered by (threshold)
======================  ========  ==============================================================
nonfinite_input         error     NaN/Inf in the batch (rows listed)
label_out_of_range      error     class label < 0 or >= C (C from the model output; ignore_index
                                  aside), or a binary target outside [0, 1] (rows listed)
constant_feature        warning   feature std across the batch <= ``CONSTANT_STD`` (1e-6) x
                                  max(1, abs(mean)), batch of >= ``CONSTANT_MIN_ROWS`` (8) rows
unscaled_input          warning   floating input max - min > ``UNSCALED_RANGE`` (1e4)
exp_overflow_risk       error     the first Inf made by exp/exp2/expm1/cosh/sinh
                        warning   input to Softmax/LogSoftmax/Softmin, or model output feeding a
                                  hand-written (or Poisson log_input) loss, with abs >
                                  ``EXP_RISK_FRACTION`` (0.5) x ``EXP_LIMIT`` (88.72
                                  float32/bfloat16, 11.09 float16, 709.8 float64): before the
                                  overflow, where exp(x)**2 already overflows
fp16_overflow_risk      error     the first Inf made in float16 (by a non-exp, non-division op)
                        warning   float16 activation abs > ``FP16_RISK_FRACTION`` (0.5) x 65504;
                                  float32 ones too when a GradScaler (float16 autocast) is in use
bf16_precision_loss     warning   a bfloat16 module output whose std < ``BF16_SPREAD`` (2**-8) x
                                  abs(mean), or a loss computed in bfloat16
                                  (:mod:`~nbdebug.analysis.checks_precision`)
dead_relu               warning   share of exact zeros after a ReLU > ``DEAD_RELU_ZERO_FRAC`` (0.9)
saturated_activation    warning   tanh/sigmoid outputs within ``SATURATION_EPS`` (1e-3) of the
                                  bounds for > ``SATURATION_SHARE`` (0.5) of the elements (a
                                  lower bound from the recorded mean square / histogram)
log_of_nonpositive      error     the first NaN/Inf made by log/log2/log10/log1p/sqrt/rsqrt (a
                                  value <= 0 in the forward, or 0 under sqrt in the backward)
                        warning   probabilities <= 0 or >= 1 reaching binary_cross_entropy
division_by_zero        error     the first NaN/Inf made by a division (0/0, x/0)
nonfinite_origin        error     any other first NaN/Inf (op and note of the trace's origin)
nonfinite_weight        error     a parameter or buffer (or checkpoint tensor) holding NaN/Inf
nonfinite_gradient      error     parameters whose gradient holds NaN/Inf (listed)
vanishing_gradient      warning   grad norm / weight norm < ``VANISHING_RATIO`` (1e-5), weights
                                  with ndim >= 2 (embeddings aside)
exploding_gradient      warning   that ratio > ``EXPLODING_RATIO`` (100), or the total grad norm
                                  > ``EXPLODING_HISTORY_FACTOR`` (10) x the median of the last
                                  ``HISTORY_WINDOW`` (100) history rows (>= 5 rows)
adam_state_outlier      error     float16 exp_avg_sq holding zeros while eps rounds to 0 in
                                  float16 (< 2**-24)
                        warning   a parameter's bias-corrected exp_avg/exp_avg_sq RMS more than
                                  ``ADAM_SIGMA`` (3) sigma (log10) off its recorded history
lr_spike                warning   lr grows > ``LR_SPIKE_RATIO`` (2) x between recorded steps,
                                  from a steady or falling lr (not during a warm-up) of >=
                                  ``LR_SPIKE_MIN_SHARE`` (0.1) of its maximum so far
lr_schedule_boundary    info      the lr curve changes regime (warm-up end, decay start, step
                                  decay, restart);
                        warning   ... and the loss rises > ``LR_BOUNDARY_LOSS_RISE`` (1.5) x (or is
                                  non-finite) within ``LR_BOUNDARY_WINDOW`` (20) rows after it
grad_clip_always_on     warning   grad norm >= max_norm in > ``CLIP_ALWAYS_SHARE`` (0.9) of >=
                                  ``CLIP_MIN_STEPS`` (20) recorded steps (``clip_norm=``)
grad_clip_never_on      info      grad norm below max_norm in all of >= 20 recorded steps
grad_scaler_collapse    warning   ``SCALER_FALLS`` (5) scale decreases in a row, or
                                  ``SCALER_SKIPS`` (5) skipped steps of the last 20
                        error     scale < ``SCALER_MIN_SCALE`` (1)
state_dict_mismatch     error     missing / unexpected keys, shape changes (``check_state_dict``)
dtype_downcast          warning   float32 weights from a float16/bfloat16 checkpoint (max
                                  round-off = finfo.eps / 2 x the largest value)
unused_parameter        info      no gradient reached a parameter that requires grad
trace_error             error     the model or the loss raised (the partial trace is checked)
check_skipped           info      a check could not apply, and why (no parameters, frozen
                                  layers, no optimizer, no history, no batch, ...)
======================  ========  ==============================================================

Findings are sorted by severity, then by position (named bands,
:class:`~nbdebug.analysis.checks_base.Band`: the trace by event, the step, a trace error,
the history by row, what a guard recorded by step; then findings with no position such
as the optimizer's), then causes before symptoms.

How :func:`check` works: the source is resolved into one
:class:`~nbdebug.analysis.checks_base.CheckContext` (trace, batch, loss, optimizer state,
history, scale), then every :class:`~nbdebug.analysis.checks_base.CheckFamily` of
``FAMILIES`` runs when the context has what it ``needs``; a family held back is named in
one ``check_skipped`` finding per missing need. Adding a health check: write it in its
family file (``checks_data``, ``checks_forward``, ``checks_grad``, ``checks_optim``), list
it in that file's ``FAMILIES`` with its codes and needs, and test it in
``tests/test_checks.py``. A :class:`~nbdebug.core.guard.NaNGuard` source is checked on its
live model by :func:`~nbdebug.analysis.checks_guard.guard_findings`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.batch import LossError, check_inputs, check_model
from ..core.guard import NaNGuard
from ..core.result import Trace, TraceError
from ..core.snapshot import Snapshot, SnapshotError
from ..core.trace import trace as _trace
from . import (
    checks_data,
    checks_forward,
    checks_grad,
    checks_guard,
    checks_optim,
    checks_precision,
)
from .checks_base import (
    CHECK_EVERY,
    NEEDS,
    Band,
    CheckContext,
    CheckFamily,
    Finding,
    Findings,
    TraceView,
    check_clip_norm,
    position,
    run_families,
    skipped,
    sort_findings,
)
from .checks_data import labels_before_trace
from .checks_guard import GuardChecks, guard_findings, parse_checks
from .checks_optim import optimizer_params, state_dict_params
from .checks_state import check_state_dict

__all__ = [
    "CHECK_EVERY",
    "FAMILIES",
    "Finding",
    "Findings",
    "GuardChecks",
    "check",
    "check_state_dict",
    "guard_findings",
    "parse_checks",
]

#: Every check family, in the order they run (each file's ``FAMILIES``).
FAMILIES: tuple[CheckFamily, ...] = (
    *checks_data.FAMILIES,
    *checks_forward.FAMILIES,
    *checks_precision.FAMILIES,
    *checks_grad.FAMILIES,
    *checks_optim.FAMILIES,
    *checks_guard.FAMILIES,
)


def check(
    source: Any,
    *,
    inputs: Any = None,
    target: Any = None,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    scheduler: Any = None,
    history: Any = None,
    clip_norm: float | None = None,
) -> Findings:
    """Run the health checks on a trace, a snapshot, a model and batch, or a guard.

    Parameters
    ----------
    source : Trace, Snapshot, (model, inputs[, target]), torch.nn.Module or NaNGuard
        A module needs ``inputs=``; a model and batch are traced with
        :func:`nbdebug.trace` (one forward + backward; the model is left as it was).
    inputs : Tensor, tuple/list or dict, optional
        The batch (for a Trace source: enables ``constant_feature``).
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

    Returns
    -------
    Findings
        A list of :class:`Finding`, sorted by severity then position in the trace;
        ``.to_frame()`` gives a table, ``.counts`` the number per severity.

    Raises
    ------
    TypeError, ValueError
        An unsupported ``source``, a model without ``inputs``, a malformed batch.
        Odd models (no parameters, frozen layers, integer buffers, complex tensors) never
        raise: checks that cannot apply give an ``"info"`` finding saying why.
    """
    clip_norm = check_clip_norm(clip_norm)
    if isinstance(source, NaNGuard):
        return sort_findings(guard_findings(source, clip_norm=clip_norm))
    ctx = CheckContext(inputs=inputs, target=target, loss_fn=loss_fn, clip_norm=clip_norm)
    ctx.history = _history_rows(list(history.history) if isinstance(history, NaNGuard) else history)
    model = _resolve_source(ctx, source)
    _resolve_training(ctx, model, optimizer, scaler, scheduler)
    ctx.view = TraceView(ctx.trace) if ctx.trace is not None else None
    return sort_findings(run_families(ctx, FAMILIES))


def _resolve_source(ctx: CheckContext, source: Any) -> torch.nn.Module | None:
    """Fill ``ctx.trace`` (and the batch, the loss, the history a snapshot brings) from
    ``source``; returns the live model when there is one."""
    if isinstance(source, TraceError):
        if source.trace is None:
            raise ValueError("this TraceError carries no partial trace to check.")
        ctx.trace = source.trace
        ctx.found.append(_trace_error(str(source)))
        return None
    if isinstance(source, Trace):
        ctx.trace = source
        if source.error:  # the partial trace of a step that raised (as the debugger holds it)
            ctx.found.append(_trace_error(source.error))
        return None
    if isinstance(source, Snapshot):
        return _resolve_snapshot(ctx, source)
    if (
        isinstance(source, (tuple, list))
        and len(source) in (2, 3)
        and isinstance(source[0], torch.nn.Module)
    ):
        model, ctx.inputs = source[0], source[1]
        if len(source) == 3:
            if ctx.target is not None:
                raise ValueError("target was given twice: in the source tuple and as target=.")
            ctx.target = source[2]
    elif isinstance(source, torch.nn.Module):
        model = source
        if ctx.inputs is None:
            raise ValueError(
                "check(model) needs the batch: pass inputs=... (or a (model, inputs) tuple)."
            )
    else:
        raise TypeError(
            "source must be a Trace, a Snapshot, a NaNGuard, a (model, inputs) tuple or a "
            f"model with inputs=...; got {type(source).__qualname__}."
        )
    check_model(model)
    check_inputs(ctx.inputs)
    m, x, y = model, ctx.inputs, ctx.target
    early = labels_before_trace(m, x, y, ctx.loss_fn)
    if early:
        ctx.found += early
        ctx.missing["trace"] = (
            "not traced: the loss would hit these out-of-range "
            "labels on the device (a device-side assert breaks the CUDA context)"
        )
        ctx.target = None  # judged already
    else:
        ctx.trace = _traced(ctx, lambda lf: _trace(m, x, y, lf))
    return model


def _resolve_snapshot(ctx: CheckContext, snap: Snapshot) -> torch.nn.Module | None:
    ctx.inputs = snap.inputs if ctx.inputs is None else ctx.inputs
    ctx.target = snap.target if ctx.target is None else ctx.target
    if ctx.history is None:
        ctx.history = _history_rows(snap.history)
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
    elif ctx.loss_fn is not None or snap.target is None:
        ctx.trace = _traced(ctx, lambda lf: snap.trace(loss_fn=lf))
    else:
        ctx.missing["trace"] = loss_error or "the snapshot recorded no loss function: pass loss_fn="
        loss_error = None
    if loss_error is not None:
        ctx.found.append(skipped(["forward", "backward"], loss_error))
    if snap.optimizer_state is not None:
        ctx.optimizer_params = state_dict_params(snap.optimizer_state, snap.optimizer_params)
    if snap.scaler_state:
        ctx.mixed_precision = True
        s = snap.scaler_state.get("scale")
        ctx.scale = float(s) if isinstance(s, (int, float)) else None
    return snap.model


def _resolve_training(
    ctx: CheckContext, model: torch.nn.Module | None, optimizer: Any, scaler: Any, scheduler: Any
) -> None:
    """The optimizer's state, the scaler's scale and the scheduler's note (given ones win
    over a snapshot's)."""
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__qualname__}."
            )
        ctx.optimizer_params = optimizer_params(optimizer, model)
        if model is None and ctx.trace is not None:
            _name_by_trace(ctx.optimizer_params, optimizer, ctx.trace)
    if scaler is not None:
        if not hasattr(scaler, "get_scale"):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler; got {type(scaler).__qualname__}."
            )
        ctx.mixed_precision = True
        ctx.scale = (
            float(scaler.get_scale()) if getattr(scaler, "is_enabled", lambda: True)() else None
        )
    if scheduler is not None and not ctx.history:
        lr = _last_lr(scheduler)
        ctx.missing["history"] = (
            f"{NEEDS['history']}; the scheduler alone gives only the current lr ({lr})"
        )


def _traced(ctx: CheckContext, run: Any) -> Trace | None:
    """Trace with ``ctx.loss_fn``; without a usable loss, trace the forward only; a model
    that raises gives its partial trace (and a ``trace_error`` finding)."""
    try:
        return run(ctx.loss_fn)
    except LossError as e:
        ctx.found.append(
            skipped(
                ["nonfinite_gradient", "vanishing_gradient", "exploding_gradient"], f"no loss: {e}"
            )
        )
        try:
            return run(_no_loss)
        except TraceError as err:
            ctx.found.append(_trace_error(str(err)))
            return err.trace
    except TraceError as err:
        ctx.found.append(_trace_error(str(err)))
        return err.trace


def _name_by_trace(opt_params: list[Any], optimizer: torch.optim.Optimizer, tr: Trace) -> None:
    """Without the model, name the optimizer's parameters after the trace's when they are
    the same number, in the same order, with the same shapes (``model.parameters()`` order)."""
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    if len(shapes) == len(tr.params) and all(s == p.shape for s, p in zip(shapes, tr.params)):
        for op, p in zip(opt_params, tr.params):
            op.name = p.name


def _no_loss(*args: Any) -> torch.Tensor:
    """A constant loss: the trace records the forward and skips the backward."""
    return torch.zeros(())


def _trace_error(message: str) -> Finding:
    return Finding(
        "trace_error",
        "error",
        "the traced step",
        {"message": message[:500]},
        "the model or the loss raised; the findings above come from the partial trace "
        "(fix them first).",
        position=position(Band.TRACE_ERROR),
    )


def _history_rows(history: Any) -> list[dict[str, Any]] | None:
    if history is None:
        return None
    if hasattr(history, "to_dict") and hasattr(history, "columns"):  # a DataFrame
        return [{k: _nan_none(v) for k, v in r.items()} for r in history.to_dict("records")]
    if isinstance(history, Sequence) or hasattr(history, "__iter__"):
        rows = list(history)
        if not all(isinstance(r, Mapping) for r in rows):
            raise TypeError(
                "history must be a list of dicts (a guard's history), a DataFrame or a NaNGuard."
            )
        return [dict(r) for r in rows]
    raise TypeError(
        f"history must be a list of dicts, a DataFrame or a NaNGuard; got "
        f"{type(history).__qualname__}."
    )


def _nan_none(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def _last_lr(scheduler: Any) -> Any:
    try:
        lr = scheduler.get_last_lr()
        return lr[0] if isinstance(lr, (list, tuple)) and len(lr) == 1 else lr
    except Exception:
        return "unknown"
