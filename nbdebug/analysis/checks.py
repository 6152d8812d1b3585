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
                                  hand-written (or Poisson log_input) loss, with abs > ``EXP_LIMIT``
                                  (88.72 float32/bfloat16, 11.09 float16, 709.8 float64)
fp16_overflow_risk      error     the first Inf made in float16 (by a non-exp, non-division op)
                        warning   float16 activation abs > ``FP16_RISK_FRACTION`` (0.5) x 65504;
                                  float32 ones too when a GradScaler (float16 autocast) is in use
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

Findings are sorted by severity, then by position in the trace (the event they point
at; findings from the optimizer and the history come after), then causes before symptoms.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.batch import LossError, check_inputs, check_model
from ..core.guard import NaNGuard, register_health_checks
from ..core.result import Trace, TraceError
from ..core.snapshot import Snapshot, SnapshotError
from ..core.trace import trace as _trace
from .checks_base import (
    CHECK_EVERY,
    Finding,
    Findings,
    TraceView,
    skipped,
    sort_findings,
)
from .checks_data import (
    constant_feature_findings,
    label_findings,
    labels_before_trace,
    trace_input_findings,
)
from .checks_forward import forward_findings, origin_findings, weight_findings
from .checks_grad import grad_findings, history_grad_findings, live_param_infos, total_grad_norm
from .checks_optim import (
    adam_findings,
    adam_moments,
    clip_findings,
    lr_findings,
    optimizer_params,
    scaler_findings,
    state_dict_params,
)
from .checks_state import check_state_dict

__all__ = [
    "CHECK_EVERY",
    "Finding",
    "Findings",
    "check",
    "check_state_dict",
    "guard_findings",
    "run_guard_checks",
]

_HISTORY_CHECKS = [
    "lr_spike",
    "lr_schedule_boundary",
    "grad_clip_always_on",
    "grad_clip_never_on",
    "grad_scaler_collapse",
]


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
    model: torch.nn.Module | None = None
    tr: Trace | None = None
    found: list[Finding] = []
    opt_params = None
    scale_now: float | None = None
    mixed = scaler is not None
    if isinstance(history, NaNGuard):
        history = list(history.history)
    rows = _history_rows(history)

    if isinstance(source, NaNGuard):
        return sort_findings(guard_findings(source, clip_norm=clip_norm))
    if isinstance(source, TraceError):
        if source.trace is None:
            raise ValueError("this TraceError carries no partial trace to check.")
        tr = source.trace
        found.append(_trace_error(str(source)))
    elif isinstance(source, Trace):
        tr = source
    elif isinstance(source, Snapshot):
        snap = source
        inputs = snap.inputs if inputs is None else inputs
        target = snap.target if target is None else target
        if rows is None:
            rows = _history_rows(snap.history)
        if loss_fn is None:
            try:
                loss_fn = snap.loss_fn()
            except SnapshotError as e:
                found.append(skipped(["forward", "backward"], str(e)))
        if snap.model is None:
            found.append(
                skipped(
                    ["forward", "backward"],
                    "the snapshot was loaded without a model (load_snapshot(path, model=...))",
                )
            )
        elif loss_fn is not None or snap.target is None:
            model = snap.model
            tr, extra = _traced(lambda lf: snap.trace(loss_fn=lf), loss_fn)
            found += extra
        elif not any(f.code == "check_skipped" for f in found):
            found.append(
                skipped(
                    ["forward", "backward"], "the snapshot recorded no loss function: pass loss_fn="
                )
            )
        if snap.optimizer_state is not None and optimizer is None:
            opt_params = state_dict_params(snap.optimizer_state, snap.optimizer_params)
        if snap.scaler_state and scaler is None:
            mixed = True
            s = snap.scaler_state.get("scale")
            scale_now = float(s) if isinstance(s, (int, float)) else None
    else:
        if (
            isinstance(source, (tuple, list))
            and len(source) in (2, 3)
            and isinstance(source[0], torch.nn.Module)
        ):
            model, inputs = source[0], source[1]
            if len(source) == 3:
                if target is not None:
                    raise ValueError("target was given twice: in the source tuple and as target=.")
                target = source[2]
        elif isinstance(source, torch.nn.Module):
            model = source
            if inputs is None:
                raise ValueError(
                    "check(model) needs the batch: pass inputs=... (or a (model, inputs) tuple)."
                )
        else:
            raise TypeError(
                "source must be a Trace, a Snapshot, a NaNGuard, a (model, inputs) "
                "tuple or a model with "
                f"inputs=...; got {type(source).__qualname__}."
            )
        check_model(model)
        check_inputs(inputs)
        m, x, y = model, inputs, target
        early = labels_before_trace(m, x, y, loss_fn)
        if early:
            found += early
            found.append(
                skipped(
                    ["forward", "backward"],
                    "not traced: the loss would hit these out-of-range "
                    "labels on the device (a device-side assert breaks the CUDA context)",
                )
            )
            target = None  # judged already
        else:
            tr, extra = _traced(lambda lf: _trace(m, x, y, lf), loss_fn)
            found += extra

    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__qualname__}."
            )
        opt_params = optimizer_params(optimizer, model)
        if model is None and tr is not None:
            _name_by_trace(opt_params, optimizer, tr)
    if scaler is not None:
        if not hasattr(scaler, "get_scale"):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler; got {type(scaler).__qualname__}."
            )
        if getattr(scaler, "is_enabled", lambda: True)():
            scale_now = float(scaler.get_scale())

    # ---- the trace: data, forward, gradients
    if tr is not None:
        view = TraceView(tr)
        found += trace_input_findings(view)
        found += origin_findings(view)
        found += weight_findings(tr.params, view)
        found += forward_findings(view, loss_fn=loss_fn, mixed_precision=mixed)
        if tr.error:
            found.append(
                skipped(
                    ["nonfinite_gradient", "vanishing_gradient", "exploding_gradient"],
                    "the trace stopped at an error before the backward",
                )
            )
        else:
            ran = any(e.phase == "backward" for e in tr.events) or not any(
                p.requires_grad for p in tr.params
            )
            found += grad_findings(
                tr.params,
                module_types=tr.module_types,
                position=view.position_of_param,
                backward_ran=ran,
            )
            if rows:
                found += history_grad_findings(rows, total_grad_norm(tr.params))
    else:
        view = None
    if inputs is not None:
        found += constant_feature_findings(inputs)
    else:
        found.append(skipped(["constant_feature"], "the batch is not available (pass inputs=)"))
    found += label_findings(view, inputs, target, loss_fn)

    # ---- optimizer, schedule, clipping, scaler
    if opt_params is not None:
        found += adam_findings(opt_params, rows or [])
    else:
        found.append(skipped(["adam_state_outlier"], "no optimizer (pass optimizer=)"))
    if rows:
        found += lr_findings(rows)
        found += clip_findings(rows, clip_norm)
        if scale_now is not None or any(r.get("scale") is not None for r in rows):
            found += scaler_findings(rows, scale_now)
        found += _recorded(rows, found)
    else:
        why = "no training history (pass history=, a NaNGuard, or check a guard's snapshot)"
        if scheduler is not None:
            lr = _last_lr(scheduler)
            why += f"; the scheduler alone gives only the current lr ({lr})"
        found.append(skipped(_HISTORY_CHECKS, why))
        if scale_now is not None:
            found += scaler_findings([], scale_now)
    return sort_findings(found)


def _traced(run: Any, loss_fn: Any) -> tuple[Trace | None, list[Finding]]:
    """Trace; without a usable loss, trace the forward only; a model that raises gives its
    partial trace."""
    try:
        return run(loss_fn), []
    except LossError as e:
        note = skipped(
            ["nonfinite_gradient", "vanishing_gradient", "exploding_gradient"], f"no loss: {e}"
        )
        try:
            return run(_no_loss), [note]
        except TraceError as err:
            return err.trace, [note, _trace_error(str(err))]
    except TraceError as err:
        return err.trace, [_trace_error(str(err))]


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
        position=1e11,
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


def _recorded(rows: list[dict[str, Any]], live: list[Finding]) -> list[Finding]:
    """Findings a guard recorded in its history (``row["checks"]``), once per (code, where)
    with the first and last step, unless a live check found the same thing."""
    seen = {(f.code, f.where) for f in live}
    acc: dict[tuple[str, str], Finding] = {}
    for r in rows:
        for d in r.get("checks") or []:
            if not isinstance(d, Mapping) or "code" not in d:
                continue
            key = (str(d.get("code")), str(d.get("where", "")))
            if key in seen:
                continue
            step = r.get("step")
            f = acc.get(key)
            if f is None:
                try:
                    f = Finding.from_dict(d)
                except (TypeError, ValueError):
                    continue
                f.step = step if isinstance(step, int) else f.step
                f.evidence["first_step"] = step
                f.evidence["times"] = 0
                f.position = 2e12 + (step if isinstance(step, int) else 0)
                acc[key] = f
            f.evidence["last_step"] = step
            f.evidence["times"] += 1
    for f in acc.values():
        f.advice = f"recorded by the guard at step {f.evidence['first_step']}: {f.advice}"
    return list(acc.values())


# --------------------------------------------------------------------------- the guard
_CALLS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def parse_checks(checks: Any) -> dict[str, Any] | None:
    """``NaNGuard(checks=...)``: ``True`` (every ``CHECK_EVERY`` steps), a positive int (every
    that many steps), or ``{"every": int, "clip_norm": float}``; ``False``/``None``/``0``: off."""
    if checks is None or checks is False or (isinstance(checks, int) and checks == 0):
        return None
    if checks is True:
        return {"every": CHECK_EVERY, "clip_norm": None}
    if isinstance(checks, int) and not isinstance(checks, bool):
        if checks < 1:
            raise ValueError(
                f"checks must be True, a positive number of steps or a dict; got {checks!r}."
            )
        return {"every": checks, "clip_norm": None}
    if isinstance(checks, Mapping):
        unknown = set(checks) - {"every", "clip_norm"}
        if unknown:
            raise ValueError(
                f"checks accepts the keys 'every' and 'clip_norm'; got {sorted(unknown)}."
            )
        every = checks.get("every", CHECK_EVERY)
        clip = checks.get("clip_norm")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checks['every'] must be a positive int; got {every!r}.")
        if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
            raise ValueError(f"checks['clip_norm'] must be a positive number; got {clip!r}.")
        return {"every": every, "clip_norm": None if clip is None else float(clip)}
    raise ValueError(f"checks must be True, a positive number of steps or a dict; got {checks!r}.")


def run_guard_checks(
    guard: Any, row: dict[str, Any], *, failing: bool = False
) -> list[Finding] | None:
    """Called by :meth:`NaNGuard.check` after it appended ``row`` to its history: every
    ``every`` calls (and on a failing step) run :func:`guard_findings` and record them in
    ``row["checks"]`` (warnings and errors; information once) and the Adam moments in
    ``row["adam"]``. Never raises: a failing check is recorded as an info finding."""
    opts = parse_checks(getattr(guard, "checks", None))
    if opts is None:
        return None
    state = _CALLS.setdefault(guard, [0, None, set()])
    n = state[0]
    state[0] = n + 1
    if n % opts["every"] and not failing:
        return None
    try:
        findings = guard_findings(guard, row=row, clip_norm=opts["clip_norm"], since_step=state[1])
    except Exception as e:  # a diagnosis aid must never stop the training loop
        findings = [
            Finding(
                "check_skipped",
                "info",
                "guard checks",
                {"error": f"{type(e).__name__}: {e}"[:300]},
                "not checked: the health checks failed on this step.",
            )
        ]
    state[1] = row.get("step")
    keep = []
    for f in findings:
        if f.severity == "info":
            key = (f.code, f.where)
            if f.code == "check_skipped" or key in state[2]:
                continue
            state[2].add(key)
        keep.append(f.to_dict())
    row["checks"] = keep
    return findings


def guard_findings(
    guard: Any,
    *,
    row: dict[str, Any] | None = None,
    clip_norm: float | None = None,
    since_step: Any = None,
) -> list[Finding]:
    """The cheap checks (no forward) on what a :class:`NaNGuard` has: the model's weights and
    ``.grad`` (non-finite, vanishing/exploding ratios), the total gradient norm against the
    history, the optimizer's state, the learning rate, clipping and the scaler's scale.

    With ``row`` (the guard's current history row) the Adam moments are stored in
    ``row["adam"]`` and schedule findings older than ``since_step`` are left out.
    """
    model = guard.model
    rows = [dict(r) for r in guard.history]
    past = rows[:-1] if row is not None and rows else rows
    current = row if row is not None else (rows[-1] if rows else {})
    params = live_param_infos(model)
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    out: list[Finding] = []
    out += weight_findings(params)
    if any(p.grad_norm is not None for p in params) or not params:
        out += grad_findings(params, module_types=types)
    else:
        out.append(
            skipped(
                ["nonfinite_gradient", "vanishing_gradient", "exploding_gradient"],
                "no parameter has a .grad (call the checks after backward)",
            )
        )
    out += history_grad_findings(past, _num(current.get("grad_norm")))
    opt = getattr(guard, "optimizer", None)
    if opt is not None:
        ops = optimizer_params(opt, model)
        moments = adam_moments(ops)
        out += adam_findings(ops, past, moments=moments)
        if row is not None and moments:
            row["adam"] = moments
    sched = lr_findings(rows)
    if since_step is not None:
        sched = [
            f
            for f in sched
            if f.step is None or not isinstance(since_step, int) or f.step > since_step
        ]
    out += sched
    out += clip_findings(rows, clip_norm)
    if getattr(guard, "scaler", None) is not None:
        out += scaler_findings(rows, _num(current.get("scale")))
    for f in out:
        if f.step is None:
            f.step = current.get("step")
    return out


def _num(v: Any) -> float | None:
    try:
        return None if v is None or isinstance(v, bool) else float(v)
    except (TypeError, ValueError):
        return None


register_health_checks(parse_checks, run_guard_checks)
