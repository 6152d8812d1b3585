"""Optimizer, schedule, clipping and mixed-precision checks: Adam moments off their
history or an ``eps`` that vanishes in float16, learning-rate spikes and schedule
boundaries, clipping that is always or never on, and a collapsing GradScaler.

They read a live optimizer or a stored ``state_dict`` (a snapshot's) through one view,
and the guard's history rows (``step``, ``loss``, ``grad_norm``, ``lr``, ``scale``,
``skipped``, and ``adam``: per-parameter bias-corrected moment RMS recorded by
``NaNGuard(checks=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...core.norms import fused_norms
from ...core.stats import is_finite_number
from ...core.text import dtype_name, fmt_num
from .base import (
    ADAM_SIGMA,
    CLIP_ALWAYS_SHARE,
    CLIP_MIN_STEPS,
    CLIP_REL_TOL,
    FP16_SMALLEST,
    HISTORY_MIN_ROWS,
    HISTORY_WINDOW,
    LR_BOUNDARY_LOSS_RISE,
    LR_BOUNDARY_WINDOW,
    LR_REL_TOL,
    LR_SPIKE_MIN_SHARE,
    LR_SPIKE_RATIO,
    SCALER_FALLS,
    SCALER_MIN_SCALE,
    SCALER_SKIPS,
    SCALER_WINDOW,
    Band,
    CheckContext,
    CheckFamily,
    Finding,
    OptimParam,
    position,
)
from .codes import CheckCode

#: A recorded log10 moment series steadier than this (in decades) counts as this steady.
ADAM_MIN_SIGMA = 0.2


def optimizer_params(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None
) -> list[OptimParam]:
    """The parameters of a live optimizer, named after ``model``'s parameters when given."""
    names: dict[int, str] = {}
    if model is not None:
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
    out = []
    for gi, g in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in g.items() if k != "params"}
        for pi, p in enumerate(g["params"]):
            name = names.get(id(p), f"group{gi}.param{pi}")
            out.append(OptimParam(name, hyper, optimizer.state.get(p, {}), dtype_name(p.dtype)))
    return out


def state_dict_params(
    state: Mapping[str, Any], names: Sequence[str | None] | None = None
) -> list[OptimParam]:
    """The parameters of an optimizer ``state_dict()`` (e.g. a snapshot's), named by ``names``
    (the parameter name of each index, as snapshots record them)."""
    out = []
    per_index = state.get("state", {}) or {}
    for gi, g in enumerate(state.get("param_groups", []) or []):
        hyper = {k: v for k, v in g.items() if k != "params"}
        for idx in g.get("params", []):
            name = None
            if names is not None and isinstance(idx, int) and 0 <= idx < len(names):
                name = names[idx]
            st = per_index.get(idx, {}) or {}
            dtype = next(
                (
                    dtype_name(v.dtype)
                    for v in st.values()
                    if isinstance(v, torch.Tensor) and v.ndim
                ),
                "",
            )
            out.append(OptimParam(name or f"group{gi}.param{idx}", hyper, st, dtype))
    return out


# --------------------------------------------------------------------------- Adam
def adam_moments(params: Sequence[OptimParam]) -> dict[str, list[float]]:
    """Bias-corrected RMS of ``exp_avg`` and ``exp_avg_sq`` per parameter (Adam-like state):
    ``{name: [m_rms, v_rms]}``. One fused norm per device and dtype."""
    rows = [
        p
        for p in params
        if _is_tensor(p.state.get("exp_avg")) and _is_tensor(p.state.get("exp_avg_sq"))
    ]
    if not rows:
        return {}
    tensors = []
    for p in rows:
        tensors += [_real(p.state["exp_avg"]), _real(p.state["exp_avg_sq"])]
    with torch.no_grad():
        norms = fused_norms(tensors)
    out = {}
    for i, p in enumerate(rows):
        n = max(p.state["exp_avg"].numel(), 1)
        step = _float(p.state.get("step"), 1.0)
        b1, b2 = _betas(p.hyper)
        c1 = 1 - b1 ** max(step, 1.0)
        c2 = 1 - b2 ** max(step, 1.0)
        out[p.name] = [
            float(norms[2 * i]) / math.sqrt(n) / (c1 if c1 > 0 else 1.0),
            float(norms[2 * i + 1]) / math.sqrt(n) / (c2 if c2 > 0 else 1.0),
        ]
    return out


def adam_findings(
    params: Sequence[OptimParam],
    history: Sequence[Mapping[str, Any]] = (),
    *,
    moments: dict[str, list[float]] | None = None,
) -> list[Finding]:
    """``adam_state_outlier``: a float16 ``exp_avg_sq`` holding zeros while ``eps`` rounds
    to 0 in float16 (the update divides by zero), and a parameter's bias-corrected moment
    RMS more than ``ADAM_SIGMA`` sigma (log10 scale) off its recorded history."""
    out = [f for p in params if (f := _vanishing_eps(p)) is not None]
    if moments is None:
        moments = adam_moments(params)
    past = _recorded_moments(history)
    for name, (m, v) in moments.items():
        series = past.get(name, [])
        if len(series) < HISTORY_MIN_ROWS:
            continue
        for label, cur, hist in (
            ("exp_avg", m, [s[0] for s in series]),
            ("exp_avg_sq", v, [s[1] for s in series]),
        ):
            found = _moment_outlier(name, label, cur, hist)
            if found is not None:
                out.append(found)
                break
    return out


def _vanishing_eps(p: OptimParam) -> Finding | None:
    """A float16 ``exp_avg_sq`` holding zeros while ``eps`` rounds to 0 in float16."""
    v = p.state.get("exp_avg_sq")
    eps = p.hyper.get("eps")
    if (
        not isinstance(v, torch.Tensor)
        or not v.numel()
        or not isinstance(eps, (int, float))
        or v.dtype != torch.float16
    ):
        return None
    if float(torch.tensor(float(eps), dtype=torch.float16)) != 0.0:
        return None
    n_zero = int((v.detach() == 0).sum())
    if not n_zero:
        return None
    return Finding(
        CheckCode.ADAM_STATE_OUTLIER,
        "error",
        f"optimizer state of {p.name}",
        {
            "eps": float(eps),
            "eps_in_float16": 0.0,
            "exp_avg_sq_zeros": n_zero,
            "numel": v.numel(),
            "threshold": FP16_SMALLEST,
        },
        f"exp_avg_sq is 0 for {n_zero} elements and eps={eps:g} rounds to "
        f"0 in float16, so "
        "the update divides by sqrt(v) + eps = 0: use eps >= 1e-4 with "
        "float16 states, or keep "
        "float32 master weights (autocast + GradScaler).",
        fix="torch.optim.Adam(params, eps=1e-4)",
        param=p.name,
    )


def _recorded_moments(history: Sequence[Mapping[str, Any]]) -> dict[str, list[list[float]]]:
    """The Adam moments a guard recorded (``row["adam"]``), per parameter, recent rows."""
    past: dict[str, list[list[float]]] = {}
    for r in history[-HISTORY_WINDOW:]:
        rec = r.get("adam") if isinstance(r, Mapping) else None
        if isinstance(rec, Mapping):
            for k, mv in rec.items():
                if isinstance(mv, (list, tuple)) and len(mv) == 2:
                    past.setdefault(str(k), []).append([float(mv[0]), float(mv[1])])
    return past


def _moment_outlier(name: str, label: str, cur: float, hist: list[float]) -> Finding | None:
    """A moment RMS ``cur`` more than ``ADAM_SIGMA`` sigma (log10) off its history."""
    logs = np.log10([h for h in hist if h > 0 and math.isfinite(h)])
    if len(logs) < HISTORY_MIN_ROWS or not (cur > 0 and math.isfinite(cur)):
        return None
    mu, sd = float(logs.mean()), max(float(logs.std()), ADAM_MIN_SIGMA)
    z = (math.log10(cur) - mu) / sd
    if abs(z) <= ADAM_SIGMA:
        return None
    return Finding(
        CheckCode.ADAM_STATE_OUTLIER,
        "warning",
        f"optimizer state of {name}",
        {
            "moment": label,
            "rms": cur,
            "history_median": float(10 ** np.median(logs)),
            "z_log10": z,
            "threshold": ADAM_SIGMA,
            "history_rows": len(logs),
        },
        f"the {label} RMS of {name} is {abs(z):.1f} sigma "
        f"{'above' if z > 0 else 'below'} its "
        "history (log scale): a gradient spike reached this parameter; "
        "clip gradients, lower "
        "the learning rate, or check the batches of these steps.",
        param=name,
    )


# --------------------------------------------------------------------------- learning rate
@dataclass(frozen=True)
class _LrCurve:
    """The recorded learning rates: the rows that hold one, their steps, and the sign of
    each change (1 up, -1 down, 0 steady)."""

    rows: list[Mapping[str, Any]]
    lr: np.ndarray
    steps: list[Any]
    sign: np.ndarray


def lr_findings(history: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """``lr_spike`` (the lr grows more than ``LR_SPIKE_RATIO`` x between recorded steps,
    from a steady or falling lr of at least ``LR_SPIKE_MIN_SHARE`` of its maximum so far) and
    ``lr_schedule_boundary`` (the
    lr curve changes regime: warm-up end, decay start, a step decay, a restart); the
    boundary is a warning when the loss rises ``LR_BOUNDARY_LOSS_RISE`` x (or goes
    non-finite) within ``LR_BOUNDARY_WINDOW`` rows after it."""
    pts = [(i, r) for i, r in enumerate(history) if is_finite_number(r.get("lr"))]
    if len(pts) < 3:
        return []
    lr = np.array([float(r["lr"]) for _, r in pts])
    d = np.diff(lr)
    tol = LR_REL_TOL * np.maximum(np.abs(lr[1:]), np.abs(lr[:-1])) + 1e-300
    sign = np.where(d > tol, 1, np.where(d < -tol, -1, 0))
    curve = _LrCurve([r for _, r in pts], lr, [r.get("step", i) for i, r in pts], sign)
    spikes = _lr_spikes(curve)  # row -> finding
    out = list(spikes.values())
    # boundaries: where the sign of the change switches; a one-step jump (step decay)
    # switches twice in a row and counts once
    k = 1
    while k < len(sign):
        if sign[k] != sign[k - 1]:
            if k + 1 not in spikes:  # a spike is already reported
                out.append(_boundary(curve, k))
            k += 2 if k + 1 < len(sign) and sign[k + 1] != sign[k] else 1
            continue
        k += 1
    return out


def _lr_spikes(c: _LrCurve) -> dict[int, Finding]:
    out: dict[int, Finding] = {}
    for k in range(2, len(c.lr)):
        prev, cur = c.lr[k - 1], c.lr[k]
        steady = c.sign[k - 2] <= 0  # not during a warm-up
        if not (
            prev > 0
            and cur / prev > LR_SPIKE_RATIO
            and steady
            and prev >= LR_SPIKE_MIN_SHARE * float(np.max(c.lr[:k]))
        ):
            continue
        out[k] = Finding(
            CheckCode.LR_SPIKE,
            "warning",
            f"step {c.steps[k]}",
            {
                "lr_before": float(prev),
                "lr": float(cur),
                "ratio": float(cur / prev),
                "threshold": LR_SPIKE_RATIO,
            },
            f"the learning rate jumped {cur / prev:.3g}x at step {c.steps[k]}: "
            f"check the scheduler "
            "(a restart, a wrong step count, scheduler.step() called per batch "
            "instead of per epoch).",
            step=_int(c.steps[k]),
            position=position(Band.HISTORY, k),
        )
    return out


def _boundary(c: _LrCurve, k: int) -> Finding:
    """The ``lr_schedule_boundary`` where the sign of the change switches at ``k``."""
    at = k  # lr[at] is the last value of the old regime; the change shows at at + 1
    sign = c.sign
    kind = _regime(sign[k - 1], sign[k], sign[k + 1] if k + 1 < len(sign) else sign[k])
    after = c.rows[at + 1 : at + 1 + LR_BOUNDARY_WINDOW]
    before = c.rows[max(0, at + 1 - LR_BOUNDARY_WINDOW) : at + 1]
    rise = _loss_rise(before, after)
    bad = rise is not None and (not math.isfinite(rise) or rise > LR_BOUNDARY_LOSS_RISE)
    ev: dict[str, Any] = {
        "lr_before": float(c.lr[at]),
        "lr_after": float(c.lr[min(at + 1, len(c.lr) - 1)]),
        "kind": kind,
        "threshold": LR_BOUNDARY_LOSS_RISE,
    }
    if rise is not None:
        ev["loss_rise"] = rise
    advice = (
        f"the loss rose {fmt_num(rise)}x within {LR_BOUNDARY_WINDOW} steps "
        f"after this {kind}: lengthen the "
        "warm-up, lower the peak learning rate, or smooth the schedule."
        if bad
        else f"the learning-rate schedule changes regime here ({kind}); watch the "
        f"loss around this step."
    )
    step = c.steps[min(at + 1, len(c.steps) - 1)]
    return Finding(
        CheckCode.LR_SCHEDULE_BOUNDARY,
        "warning" if bad else "info",
        f"step {step}",
        ev,
        advice,
        step=_int(step),
        position=position(Band.HISTORY, at),
    )


def _regime(before: int, now: int, after: int) -> str:
    if before > 0 and now <= 0:
        return "end of warm-up"
    if before == 0 and now < 0 and after == 0:
        return "step decay"
    if before == 0 and now < 0:
        return "start of decay"
    if before < 0 and now > 0:
        return "restart"
    if before == 0 and now > 0:
        return "start of warm-up"
    return "end of decay"


def _loss_rise(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
) -> float | None:
    if not after:
        return None
    if any(r.get("loss") is not None and not is_finite_number(r.get("loss")) for r in after):
        return math.inf
    b = [float(r["loss"]) for r in before if is_finite_number(r.get("loss"))]
    a = [float(r["loss"]) for r in after if is_finite_number(r.get("loss"))]
    if not a or not b:
        return None
    base = float(np.median(b))
    if base <= 0:
        return None
    return max(a) / base


# --------------------------------------------------------------------------- clipping
def clip_findings(history: Sequence[Mapping[str, Any]], clip_norm: float | None) -> list[Finding]:
    """``grad_clip_always_on`` (the recorded gradient norm reached ``max_norm`` in more than
    ``CLIP_ALWAYS_SHARE`` of the last steps) and ``grad_clip_never_on`` (it never did)."""
    if clip_norm is None:
        clip_norm = next(
            (
                float(r["clip_norm"])
                for r in reversed(history)
                if is_finite_number(r.get("clip_norm"))
            ),
            None,
        )
    if clip_norm is None or clip_norm <= 0:
        return []
    norms = np.array(
        [
            float(r["grad_norm"])
            for r in history[-HISTORY_WINDOW:]
            if is_finite_number(r.get("grad_norm"))
        ]
    )
    if len(norms) < CLIP_MIN_STEPS:
        return []
    # a norm measured before clipping exceeds max_norm; after clipping it equals it
    on = norms >= clip_norm * (1 - CLIP_REL_TOL)
    share = float(on.mean())
    ev = {
        "max_norm": clip_norm,
        "share_clipped": share,
        "steps": len(norms),
        "median_grad_norm": float(np.median(norms)),
    }
    if share > CLIP_ALWAYS_SHARE:
        return [
            Finding(
                CheckCode.GRAD_CLIP_ALWAYS_ON,
                "warning",
                f"clip_grad_norm_(max_norm={clip_norm:g})",
                {**ev, "threshold": CLIP_ALWAYS_SHARE},
                f"the gradient was clipped in {share:.0%} of the last {len(norms)} "
                f"steps (median norm "
                f"{fmt_num(float(np.median(norms)))}): every update has the same "
                f"length, so max_norm acts as the "
                "learning rate; raise max_norm above the typical norm or lower the learning rate.",
                fix=f"clip_grad_norm_(params, max_norm={2 * float(np.median(norms)):.3g})",
            )
        ]
    if share == 0.0:
        return [
            Finding(
                CheckCode.GRAD_CLIP_NEVER_ON,
                "info",
                f"clip_grad_norm_(max_norm={clip_norm:g})",
                {**ev, "max_grad_norm": float(norms.max()), "threshold": clip_norm},
                f"the gradient norm never reached max_norm={clip_norm:g} in "
                f"{len(norms)} steps (largest "
                f"{fmt_num(float(norms.max()))}): clipping is only a safety net here; "
                f"lower max_norm if spikes "
                "between these values hurt.",
            )
        ]
    return []


# --------------------------------------------------------------------------- GradScaler
def scaler_findings(
    history: Sequence[Mapping[str, Any]], scale_now: float | None = None
) -> list[Finding]:
    """``grad_scaler_collapse``: the scale fell ``SCALER_FALLS`` times in a row, or
    ``SCALER_SKIPS`` of the last ``SCALER_WINDOW`` steps were skipped (warning); the scale
    is below ``SCALER_MIN_SCALE`` (error)."""
    scales = [float(r["scale"]) for r in history if is_finite_number(r.get("scale"))]
    if scale_now is None and scales:
        scale_now = scales[-1]
    falls = 0
    for a, b in zip(reversed(scales[:-1]), reversed(scales[1:])):
        if b < a:
            falls += 1
        else:
            break
    recent = list(history[-SCALER_WINDOW:])
    skips = sum(1 for r in recent if r.get("skipped") and is_finite_number(r.get("scale")))
    ev = {
        "scale": scale_now,
        "consecutive_falls": falls,
        "skipped_recent": skips,
        "window": SCALER_WINDOW,
        "threshold": {"falls": SCALER_FALLS, "skips": SCALER_SKIPS, "min_scale": SCALER_MIN_SCALE},
    }
    if scale_now is not None and scale_now < SCALER_MIN_SCALE:
        return [
            Finding(
                CheckCode.GRAD_SCALER_COLLAPSE,
                "error",
                "GradScaler",
                ev,
                f"the loss scale fell to {fmt_num(scale_now)} (< "
                f"{SCALER_MIN_SCALE:g}): the gradients overflow float16 "
                "even unscaled, i.e. something is already Inf/NaN; find the first "
                "non-finite step (NaNGuard "
                "snapshot) rather than scaling further.",
            )
        ]
    if falls >= SCALER_FALLS or skips >= SCALER_SKIPS:
        return [
            Finding(
                CheckCode.GRAD_SCALER_COLLAPSE,
                "warning",
                "GradScaler",
                ev,
                f"the loss scale fell {falls} times in a row and {skips} of the last "
                f"{len(recent)} steps were "
                "skipped: float16 gradients keep overflowing; look for activations "
                "near 65504, lower the "
                "learning rate, or use bfloat16.",
            )
        ]
    return []


# --------------------------------------------------------------------------- helpers
def _is_tensor(v: object) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() > 0


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.abs() if t.is_complex() else t


def _float(v: object, default: float) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().reshape(-1)[0]) if v.numel() else default
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _betas(hyper: Mapping[str, Any]) -> tuple[float, float]:
    b = hyper.get("betas")
    if isinstance(b, (tuple, list)) and len(b) == 2:
        return _float(b[0], 0.9), _float(b[1], 0.999)
    return 0.9, 0.999


def _int(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _scaler(ctx: CheckContext) -> list[Finding]:
    rows = ctx.history or []
    if ctx.scale is None and not any(r.get("scale") is not None for r in rows):
        return []
    return scaler_findings(rows, ctx.scale)


#: The optimizer and schedule checks, for :func:`nbdebug.check` (see
#: :class:`~.base.CheckFamily`).
FAMILIES = (
    CheckFamily(
        (CheckCode.ADAM_STATE_OUTLIER,),
        ("optimizer",),
        lambda ctx: adam_findings(ctx.optimizer_params or [], ctx.history or []),
    ),
    CheckFamily(
        (CheckCode.LR_SPIKE, CheckCode.LR_SCHEDULE_BOUNDARY),
        ("history",),
        lambda ctx: lr_findings(ctx.history or []),
    ),
    CheckFamily(
        (CheckCode.GRAD_CLIP_ALWAYS_ON, CheckCode.GRAD_CLIP_NEVER_ON),
        ("history",),
        lambda ctx: clip_findings(ctx.history or [], ctx.clip_norm),
    ),
    # without a history the current scale is still judged (below SCALER_MIN_SCALE)
    CheckFamily((CheckCode.GRAD_SCALER_COLLAPSE,), ("history",), _scaler, fallback=_scaler),
)
