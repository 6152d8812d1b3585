"""Forward-pass health checks on a recorded trace: corrupted weights, and the warning
signs before a NaN/Inf appears (large inputs to softmax or to an exp in the loss,
activations near the float16 limit, dead ReLUs, saturated tanh/sigmoid). The cause of a
NaN/Inf that did appear is named by :mod:`~nbdebug.analysis.checks.origin`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from ...core.stats import HIST_EDGES, Histogram
from ...core.text import fmt_num
from ...core.trace.events import Event, ParamInfo
from ...core.vocab import Phase
from .base import (
    DEAD_RELU_ZERO_FRAC,
    EXP_RISK_FRACTION,
    FP16_MAX,
    FP16_RISK_FRACTION,
    SATURATION_EPS,
    SATURATION_SHARE,
    CheckContext,
    CheckFamily,
    Finding,
    LossFn,
    TraceView,
    exp_limit,
    is_floating,
    is_output,
    module_label,
)
from .codes import CheckCode
from .origin import origin_findings

SOFTMAX_TYPES = frozenset({"Softmax", "LogSoftmax", "Softmin", "Softmax2d"})
RELU_TYPES = frozenset({"ReLU", "ReLU6"})


# --------------------------------------------------------------------------- weights
def weight_findings(params: Iterable[ParamInfo], view: TraceView | None = None) -> list[Finding]:
    """``nonfinite_weight``: parameters (or a buffer named by the trace's origin) holding
    NaN/Inf. ``params`` are :class:`~nbdebug.core.trace.events.ParamInfo` records."""
    out = []
    o = view.trace.origin if view is not None else None
    named = set()
    for p in params:
        if not (p.n_nan or p.n_inf):
            continue
        named.add(p.name)
        event = None
        if view is not None:
            event = o.index if o is not None and o.param == p.name else None
            if event is None:
                event = next(
                    (
                        e.index
                        for e in view.events
                        if e.phase == Phase.FORWARD and e.module == p.module
                    ),
                    None,
                )
        out.append(
            Finding(
                CheckCode.NONFINITE_WEIGHT,
                "error",
                f"parameter {p.name}",
                {"n_nan": p.n_nan, "n_inf": p.n_inf, "numel": math.prod(p.shape), "threshold": 0},
                "this weight already holds NaN/Inf (a previous update diverged, or a "
                "bad checkpoint): "
                "reload the last good checkpoint and find the step that broke it (NaNGuard).",
                event=event,
                param=p.name,
                module=p.module,
            )
        )
    if o is not None and o.param and o.param not in named and o.corrupted:
        out.append(
            Finding(
                CheckCode.NONFINITE_WEIGHT,
                "error",
                f"buffer {o.param}",
                {"threshold": 0},
                "this buffer already holds NaN/Inf (e.g. BatchNorm running statistics updated on a "
                "non-finite batch): reset it or reload a good checkpoint.",
                event=o.index,
                param=o.param,
                module=o.module,
            )
        )
    return out


# --------------------------------------------------------------------------- warning signs
#: One warning sign of a module output: ``sign(view, event, module type, mixed precision)``
#: gives the finding and its score (the worst call of a module is kept), or ``None``.
Sign = Callable[[TraceView, Event, str, bool], "tuple[Finding, float] | None"]


def forward_findings(
    view: TraceView, *, loss_fn: LossFn | None = None, mixed_precision: bool = False
) -> list[Finding]:
    """Large inputs to softmax/exp, activations near the float16 limit, dead ReLUs,
    saturated tanh/sigmoid, probabilities of 0/1 reaching a binary cross-entropy."""
    worst: dict[tuple[str, str], tuple[Finding, float]] = {}  # (code, module) -> worst call
    seen: set[tuple[Any, ...]] = set()
    for e in view.events:
        if not is_output(e) or not e.finite or not e.shape:
            continue
        key = (e.shape, e.dtype, e.stats.numel, e.stats.norm, e.stats.min, e.stats.max)
        if key in seen and not view.is_leaf(e.module):
            continue  # a container returning its last child's output: judged once
        seen.add(key)
        mtype = e.module_type or view.types.get(e.module, "")
        for sign in SIGNS:
            found = sign(view, e, mtype, mixed_precision)
            if found is None:
                continue
            prev = worst.get((found[0].code, found[0].module or ""))
            if prev is None or found[1] > prev[1]:
                worst[(found[0].code, found[0].module or "")] = found
    return [f for f, _ in worst.values()] + _loss_input_findings(view, loss_fn)


def _softmax_input(
    view: TraceView, e: Event, mtype: str, mixed_precision: bool
) -> tuple[Finding, float] | None:
    """``exp_overflow_risk`` (warning): large inputs reach a softmax."""
    if mtype not in SOFTMAX_TYPES:
        return None
    inp = view.input_of(e)
    if inp is None or not inp.finite or not is_floating(inp.dtype):
        return None
    lim = exp_limit(e.dtype)
    if inp.stats.absmax <= EXP_RISK_FRACTION * lim:
        return None
    evidence = {
        "input_absmax": inp.stats.absmax,
        "threshold": EXP_RISK_FRACTION * lim,
        "limit": lim,
        "input_from": inp.label,
    }
    advice = (
        f"inputs up to {fmt_num(inp.stats.absmax)} reach this {mtype} (exp overflows above "
        f"{lim:.4g} in {e.dtype}, warned from {EXP_RISK_FRACTION * lim:.4g}); its "
        "probabilities saturate to exact 0/1 and a log of them gives -inf: scale the logits "
        "down (temperature, normalisation) or keep them in log space."
    )
    return _sign(CheckCode.EXP_OVERFLOW_RISK, view, e, mtype, evidence, advice), inp.stats.absmax


def _fp16_activation(
    view: TraceView, e: Event, mtype: str, mixed_precision: bool
) -> tuple[Finding, float] | None:
    """``fp16_overflow_risk`` (warning): activations near the float16 limit."""
    s = e.stats
    if s.absmax <= FP16_RISK_FRACTION * FP16_MAX:
        return None
    if not (e.dtype == "float16" or (mixed_precision and is_floating(e.dtype))):
        return None
    if e.dtype == "float16":
        advice = (
            f"float16 activations reach {fmt_num(s.absmax)}, within a factor 2 of the "
            "largest float16 (65504): run this module in float32 or bfloat16, or "
            "rescale its inputs."
        )
    else:
        advice = (
            f"activations reach {fmt_num(s.absmax)}: under float16 autocast (a "
            "GradScaler is in use) this module's output would overflow 65504; use "
            "bfloat16 autocast or rescale."
        )
    evidence = {"absmax": s.absmax, "threshold": FP16_RISK_FRACTION * FP16_MAX, "limit": FP16_MAX}
    return _sign(CheckCode.FP16_OVERFLOW_RISK, view, e, mtype, evidence, advice), s.absmax


def _dead_relu(
    view: TraceView, e: Event, mtype: str, mixed_precision: bool
) -> tuple[Finding, float] | None:
    """``dead_relu``: most of a ReLU's outputs are exactly 0."""
    s = e.stats
    if mtype not in RELU_TYPES or s.zero_frac <= DEAD_RELU_ZERO_FRAC:
        return None
    advice = (
        f"{s.zero_frac:.0%} of this ReLU's outputs are exactly 0, so no gradient flows "
        "through them: lower the learning rate, check the initialisation and the bias, or "
        "use LeakyReLU/GELU."
    )
    evidence = {"zero_frac": s.zero_frac, "threshold": DEAD_RELU_ZERO_FRAC}
    f = _sign(CheckCode.DEAD_RELU, view, e, mtype, evidence, advice, fix="nn.LeakyReLU(0.01)")
    return f, s.zero_frac


def _saturation(
    view: TraceView, e: Event, mtype: str, mixed_precision: bool
) -> tuple[Finding, float] | None:
    """``saturated_activation``: tanh/sigmoid outputs at their bounds."""
    share = saturated_share(mtype, e, view.input_of(e) if mtype in ("Tanh", "Sigmoid") else None)
    if share is None or share <= SATURATION_SHARE:
        return None
    evidence = {
        "saturated_share_at_least": share,
        "threshold": SATURATION_SHARE,
        "eps": SATURATION_EPS,
    }
    advice = (
        f"at least {share:.0%} of this {mtype}'s outputs lie within {SATURATION_EPS:g} of its "
        "bounds, where its derivative is ~0: normalise its inputs (LayerNorm/BatchNorm before "
        "it) or lower the initial weights."
    )
    return _sign(CheckCode.SATURATED_ACTIVATION, view, e, mtype, evidence, advice), share


def _sign(
    code: CheckCode,
    view: TraceView,
    e: Event,
    mtype: str,
    evidence: dict[str, Any],
    advice: str,
    fix: str = "",
) -> Finding:
    where = module_label(e.module, mtype)
    return Finding(
        code, "warning", where, evidence, advice, fix=fix, event=e.index, module=e.module
    )


#: The warning signs of a module output, in the order they are judged.
SIGNS: tuple[Sign, ...] = (_softmax_input, _fp16_activation, _dead_relu, _saturation)


def saturated_share(mtype: str, e: Event, inp: Event | None = None) -> float | None:
    """A lower bound on the share of a tanh/sigmoid output within ``SATURATION_EPS`` of its
    bounds, from the recorded statistics (the trace keeps no elements): the larger of

    * from the output: tanh: ``E[y^2] <= s + (1 - s)(1 - eps)^2``, so
      ``s >= (E[y^2] - (1-eps)^2) / (1 - (1-eps)^2)``; sigmoid: the share below ``eps`` from
      the log10|y| histogram, plus the share above ``1 - eps`` bounded the same way from the
      mean of the other elements (the near-0 ones add at most their bins' upper edges);
    * from the input (``inp``: the output of the module that ran just before, used only
      when it has as many elements): the share of pre-activations with ``|x| >= 10``
      (tanh and sigmoid are then within 5e-5 of a bound), capped by the share of outputs
      whose histogram bins agree (``|y| >= 0.316`` for tanh; ``y < 1e-4`` or ``y >= 0.316``
      for sigmoid).

    The histograms come from at most ``HIST_SAMPLE`` evenly strided elements, so for large
    tensors the bound holds up to that sampling.
    """
    s = e.stats
    if not s.numel or mtype not in ("Tanh", "Sigmoid"):
        return None
    eps = SATURATION_EPS
    h = e.hist
    total = max(int(h.total), 1)
    if mtype == "Tanh":
        ms = s.norm * s.norm / s.numel
        lo = (1 - eps) ** 2
        share = max(0.0, min(1.0, (ms - lo) / (1 - lo)))
    else:
        cut = max(
            int((math.log10(eps) + 1e-12 >= HIST_EDGES).sum()) - 1, 0
        )  # bins entirely below eps
        low = h.counts[:cut]
        near0 = (int(low.sum()) + int(h.n_zero)) / total
        rest = 1.0 - near0
        if rest <= 0:
            return 1.0
        low_sum = float((low * 10.0 ** HIST_EDGES[1 : cut + 1]).sum()) / total
        mean_rest = (s.mean - low_sum) / rest
        share = min(1.0, near0 + rest * max(0.0, (mean_rest - (1 - eps)) / eps))
    if inp is not None and inp.finite and inp.stats.numel == s.numel and inp.hist.total:
        big = _share(inp.hist, lo=1.0)
        agree = _share(h, lo=-0.5) + (
            0.0 if mtype == "Tanh" else _share(h, hi=-4.0) + h.n_zero / total
        )
        share = max(share, min(big, agree))
    return share


def _share(h: Histogram, *, lo: float = -math.inf, hi: float = math.inf) -> float:
    """Share of a histogram's elements in the bins lying within [lo, hi) (log10|x|)."""
    inside = (HIST_EDGES[:-1] >= lo - 1e-12) & (HIST_EDGES[1:] <= hi + 1e-12)
    return float(h.counts[inside].sum()) / max(int(h.total), 1)


# --------------------------------------------------------------------------- the loss's input
def loss_name(loss_fn: object) -> str:
    if loss_fn is None:
        return ""
    if hasattr(loss_fn, "func") and callable(loss_fn.func):  # functools.partial
        loss_fn = loss_fn.func
    name = getattr(loss_fn, "__name__", None)
    if isinstance(name, str):
        return name.lower()
    return type(loss_fn).__name__.lower()


def is_torch_loss(loss_fn: object) -> bool:
    if loss_fn is None:
        return False
    if hasattr(loss_fn, "func") and callable(loss_fn.func):
        loss_fn = loss_fn.func
    mod = getattr(loss_fn, "__module__", None) or type(loss_fn).__module__
    if not isinstance(getattr(loss_fn, "__name__", None), str):
        mod = type(loss_fn).__module__
    return isinstance(mod, str) and (mod == "torch" or mod.startswith("torch."))


def _loss_input_findings(view: TraceView, loss_fn: LossFn | None) -> list[Finding]:
    out = view.output()
    if out is None or loss_fn is None or not out.finite or not is_floating(out.dtype):
        return []
    name = loss_name(loss_fn)
    position = view.loss_event if view.loss_event is not None else out.index
    # (code, evidence, advice, fix) of each warning about what reaches the loss
    found: list[tuple[CheckCode, dict[str, object], str, str]] = []
    poisson_exp = "poisson" in name and bool(getattr(loss_fn, "log_input", True))
    if not is_torch_loss(loss_fn) or poisson_exp:
        lim = exp_limit(out.dtype)
        if out.stats.absmax > EXP_RISK_FRACTION * lim:
            kind = (
                "PoissonNLLLoss with log_input=True computes exp(input)"
                if poisson_exp
                else (
                    "a hand-written loss that exponentiates them (exp, softmax + log) "
                    "overflows or underflows"
                )
            )
            evidence: dict[str, object] = {
                "output_absmax": out.stats.absmax,
                "threshold": EXP_RISK_FRACTION * lim,
                "limit": lim,
            }
            advice = (
                f"the model's outputs reach {fmt_num(out.stats.absmax)} (exp overflows above "
                f"{lim:.4g} in {out.dtype}, warned from {EXP_RISK_FRACTION * lim:.4g}): {kind}; "
                "use a stable built-in (F.cross_entropy, F.log_softmax, torch.logsumexp) or "
                "scale the logits."
            )
            fix = "loss = F.cross_entropy(logits, y)"
            found.append((CheckCode.EXP_OVERFLOW_RISK, evidence, advice, fix))
    if ("binary_cross_entropy" in name or name == "bceloss") and "logits" not in name:
        s = out.stats
        if s.min <= 0 or s.max >= 1:
            bce: dict[str, object] = {
                "output_min": s.min,
                "output_max": s.max,
                "threshold": "0 < p < 1",
            }
            advice = (
                "probabilities of exactly 0 or 1 reach binary_cross_entropy, which takes "
                "log(p) and log(1 - p) (clamped at -100, gradients of 1e12): output logits and "
                "use binary_cross_entropy_with_logits."
            )
            fix = "loss = F.binary_cross_entropy_with_logits(logits, y)"
            found.append((CheckCode.LOG_OF_NONPOSITIVE, bce, advice, fix))
    where, at = "the loss (model output)", float(position)
    return [
        Finding(
            code, "warning", where, ev, advice, fix=fix, event=out.index, module="", position=at
        )
        for code, ev, advice, fix in found
    ]


def _origin(ctx: CheckContext) -> list[Finding]:
    assert ctx.view is not None
    return origin_findings(ctx.view)


def _weights(ctx: CheckContext) -> list[Finding]:
    assert ctx.trace is not None
    return weight_findings(ctx.trace.params, ctx.view)


def _forward(ctx: CheckContext) -> list[Finding]:
    assert ctx.view is not None
    return forward_findings(ctx.view, loss_fn=ctx.loss_fn, mixed_precision=ctx.mixed_precision)


#: The forward checks, for :func:`nbdebug.check` (see :class:`~.base.CheckFamily`).
FAMILIES = (
    CheckFamily(
        (
            CheckCode.LOG_OF_NONPOSITIVE,
            CheckCode.EXP_OVERFLOW_RISK,
            CheckCode.FP16_OVERFLOW_RISK,
            CheckCode.DIVISION_BY_ZERO,
            CheckCode.NONFINITE_ORIGIN,
        ),
        ("trace",),
        _origin,
    ),
    CheckFamily((CheckCode.NONFINITE_WEIGHT,), ("trace",), _weights),
    CheckFamily(
        (
            CheckCode.EXP_OVERFLOW_RISK,
            CheckCode.FP16_OVERFLOW_RISK,
            CheckCode.DEAD_RELU,
            CheckCode.SATURATED_ACTIVATION,
        ),
        ("trace",),
        _forward,
    ),
)
