"""Forward-pass health checks on a recorded trace: where the first NaN/Inf came from
(log of a non-positive value, exp overflow, float16 overflow, division by zero,
corrupted weights), and the warning signs before one appears (large inputs to softmax
or to an exp in the loss, activations near the float16 limit, dead ReLUs, saturated
tanh/sigmoid)."""

from __future__ import annotations

import math
import re
from typing import Any

from ..core.stats import HIST_EDGES
from ..core.text import fmt_num, rows_text
from .checks_base import (
    DEAD_RELU_ZERO_FRAC,
    EXP_LIMIT,
    EXP_RISK_FRACTION,
    FP16_MAX,
    FP16_RISK_FRACTION,
    SATURATION_EPS,
    SATURATION_SHARE,
    CheckContext,
    CheckFamily,
    Finding,
    TraceView,
    module_label,
)

LOG_OPS = frozenset(
    {"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "xlogy", "lgamma", "digamma", "acosh"}
)
EXP_OPS = frozenset({"exp", "exp2", "expm1", "cosh", "sinh", "ldexp"})
DIV_OPS = frozenset(
    {
        "div",
        "truediv",
        "rtruediv",
        "itruediv",
        "true_divide",
        "divide",
        "reciprocal",
        "floor_divide",
        "fmod",
        "remainder",
    }
)
#: ops that float16 autocast runs in float16, casting float32 inputs first (inside the op,
#: so a finite input over 65504 shows as the op itself making Inf, or NaN as inf*w - inf*w)
AUTOCAST_FP16_OPS = frozenset(
    {
        "linear",
        "matmul",
        "mm",
        "bmm",
        "mv",
        "addmm",
        "addmv",
        "addr",
        "addbmm",
        "baddbmm",
        "einsum",
        "chain_matmul",
        "multi_dot",
        "vecdot",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "prelu",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
    }
)
#: dtype casts: an Inf one of them makes from finite values overflowed the target dtype
CAST_OPS = frozenset({"to", "half", "type", "copy", "to_copy"})
SOFTMAX_TYPES = frozenset({"Softmax", "LogSoftmax", "Softmin", "Softmax2d"})
RELU_TYPES = frozenset({"ReLU", "ReLU6"})
_MADE_BY = re.compile(r"made by ([\w.]+)")


def op_kind(op: str | None) -> str:
    """``"torch.log"`` -> ``"log"``; ``"Tensor.__truediv__"`` -> ``"truediv"``."""
    if not op:
        return ""
    return op.rsplit(".", 1)[-1].strip("_")


def is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def exp_limit(dtype: str) -> float:
    return EXP_LIMIT.get(dtype, EXP_LIMIT["float32"])


# --------------------------------------------------------------------------- the origin
def origin_findings(view: TraceView) -> list[Finding]:
    """Name the cause of the first non-finite value (forward, loss or backward origin)."""
    tr = view.trace
    o = tr.origin
    if o is None:
        first = tr.first_nonfinite
        if first is None or first.phase == "input":
            return []
        return [
            Finding(
                "nonfinite_origin",
                "error",
                _where(view, first),
                {"n_nan": first.stats.n_nan, "n_inf": first.stats.n_inf},
                "non-finite values appear here but their origin was not found; step through the "
                "events before it.",
                event=first.index,
                module=first.module,
                rows=list(first.samples),
            )
        ]
    if o.phase == "input":
        return []  # the data checks name the rows (nonfinite_input)
    bad_params = {p.name for p in tr.params if p.n_nan or p.n_inf}
    if o.param and (o.param in bad_params or "already held non-finite" in (o.note or "")):
        return []  # nonfinite_weight names it
    kinds = [op_kind(o.op)]
    m = _MADE_BY.search(o.note or "")
    if m:
        kinds.insert(0, op_kind(m.group(1)))  # the op that made the first Inf, e.g. torch.log
    made_by = m.group(1) if m else o.op
    where = _where(view, o)
    ev: dict[str, Any] = {"n_nan": o.stats.n_nan, "n_inf": o.stats.n_inf, "phase": o.phase}
    if o.op:
        ev["op"] = o.op
    if o.source:
        ev["source"] = o.source
    common = {"event": o.index, "module": o.module, "param": o.param, "rows": list(o.samples)}
    rows = f" ({rows_text(o.samples)})" if o.samples else ""
    if any(k in LOG_OPS for k in kinds):
        op = made_by or "log/sqrt"
        back = o.phase == "backward"
        ev["threshold"] = "input <= 0" if not back else "input == 0 (infinite derivative)"
        if "sqrt" in op:
            # a square root's input must be >= 0 by construction: clamping it hides the bug
            # and zeroes the gradient of the clamped rows (lesson 02's exercise shows it)
            advice = (
                f"{op} received a negative value{rows}: make its input non-negative by "
                "construction, e.g. F.softplus(x) + 1e-6 for a scale or variance (or "
                "x.square() before a root); clamping stops the gradient of those rows."
                if not back
                else f"the derivative of {op} is infinite at 0{rows}: add a small constant "
                "inside the root, torch.sqrt(x + 1e-12), e.g. for a norm of a zero row."
            )
            fix = "F.softplus(x) + 1e-6" if not back else "torch.sqrt(x + 1e-12)"
        else:
            advice = (
                f"{op} received a value <= 0{rows}: clamp its input first, e.g. "
                f"torch.log(x.clamp_min(1e-12)), "
                "or compute in log space (log_softmax instead of log(softmax))."
                if not back
                else f"the derivative of {op} is infinite at 0{rows}: clamp its input away "
                "from 0 (x.clamp_min(1e-12)) before the call, also behind torch.where."
            )
            fix = "torch.log(x.clamp_min(1e-12))"
        return [Finding("log_of_nonpositive", "error", where, ev, advice, fix=fix, **common)]
    if any(k in EXP_OPS for k in kinds):
        inp = view.input_of(o) if o.phase == "forward" else None
        if inp is not None and inp.finite:
            ev["input_absmax"] = inp.stats.absmax
        ev["threshold"] = exp_limit(o.dtype)
        return [
            Finding(
                "exp_overflow_risk",
                "error",
                where,
                ev,
                f"{made_by} overflowed{rows}: exp(x) is infinite for x > "
                f"{exp_limit(o.dtype):.4g} in {o.dtype}; "
                "subtract the max first (torch.logsumexp, softmax) or clamp x.",
                fix="torch.exp(x - x.amax(dim=-1, keepdim=True))",
                **common,
            )
        ]
    if any(k in DIV_OPS for k in kinds):
        ev["threshold"] = "denominator == 0"
        return [
            Finding(
                "division_by_zero",
                "error",
                where,
                ev,
                f"{made_by} divided by zero{rows} (0/0 gives NaN, x/0 Inf): add an epsilon to the "
                "denominator or clamp it.",
                fix="x / (d + 1e-6)  # or d.clamp_min(1e-6)",
                **common,
            )
        ]
    # a backward origin ran in the dtype of its module's forward (an fp16 matmul's weight
    # gradient overflows in float16, then lands in the float32 .grad)
    ran = o.dtype if o.phase != "backward" or o.dtype == "float16" else view.ran_in(o.module)
    if fp16_overflow(view, o, ran):
        inp = view.input_of(o) if o.phase == "forward" else None
        if inp is not None and inp.finite:
            ev["input_absmax"] = inp.stats.absmax
        largest = largest_reaching(view, o) if o.phase == "forward" else None
        value = largest if largest is not None and largest > FP16_MAX else None
        if value is not None:
            ev["reached_absmax"] = value
        ev["threshold"] = FP16_MAX
        return [
            fp16_overflow_finding(
                where, ev, made_by, rows, value, to_nan=bool(o.stats.n_nan), **common
            )
        ]
    note = f" ({o.note})" if o.note else ""
    return [
        Finding(
            "nonfinite_origin",
            "error",
            where,
            ev,
            f"{made_by or 'this module'} produced the first non-finite "
            f"value{rows}{note}; step into it.",
            **common,
        )
    ]


def fp16_overflow(view: TraceView, o: Any, ran: str | None) -> bool:
    """Whether float16 made the first non-finite value of the origin ``o`` (``ran``: the
    dtype its module ran in). The evidence, any of:

    * an Inf in the origin's tensor, and its module ran in float16;
    * the root of its chain made an Inf, and the module ran in float16 (the Inf then
      became NaN within it, ``inf - inf``);
    * the root is a cast (``Tensor.to``, ``.half()``) that made an Inf from finite values
      and float16 came out of the call (``.half()`` itself, a submodule's output);
    * the module ran in float16, its root is an op that float16 autocast runs in float16
      (``linear``, ``matmul``, ``conv2d``...) and made NaN from finite inputs, and a
      finite value over 65504 reached the module (the cast inside the op made the Inf,
      ``inf*w + (-inf)*w`` the NaN).

    A NaN made by any other op (``acos`` of 2, a log of a negative value) is not.
    """
    if ran == "float16" and o.stats.n_inf:
        return True
    root = o.chain[0] if o.chain else None
    if o.phase != "forward" or root is None:
        return False
    kind = op_kind(root.op)
    if root.value == "inf":
        return ran == "float16" or (
            kind in CAST_OPS and (kind == "half" or _float16_within(view, o))
        )
    largest = largest_reaching(view, o)
    return (
        ran == "float16"
        and kind in AUTOCAST_FP16_OPS
        and largest is not None
        and largest > FP16_MAX
    )


def fp16_overflow_finding(
    where: str,
    evidence: dict[str, Any],
    made_by: str | None,
    in_rows: str,
    value: float | None = None,
    *,
    to_nan: bool = False,
    **common: Any,
) -> Finding:
    """The ``fp16_overflow_risk`` error: what overflowed (``value``, the largest finite
    value that reached it, against 65504, where it is known; ``to_nan``: the Inf it made
    became NaN; ``in_rows``: " (rows 1, 2)" or "") and the fix."""
    if value is not None:
        limit = f" ({fmt_num(value)} reached it, over 65504, the largest finite float16)"
    else:
        limit = " (largest finite value 65504)"
    nan = ", and the Inf became NaN" if to_nan else ""
    return Finding(
        "fp16_overflow_risk",
        "error",
        where,
        evidence,
        f"{made_by or 'this module'} overflowed float16{limit}{in_rows}{nan}: run it "
        "in float32 (autocast keeps reductions in float32), or scale its "
        "inputs or weights down.",
        fix="with torch.autocast('cuda', dtype=torch.bfloat16): ...  # or module.float()",
        **common,
    )


def _call_span(view: TraceView, o: Any) -> tuple[list[Any], Any]:
    """The outputs of a forward origin's submodules in its call (they complete just before
    it), and the event completed before that call, as :meth:`TraceView.input_of` has it (a
    module output or a batch tensor; ``None`` if neither)."""
    prefix = o.module + "." if o.module else ""
    inner: list[Any] = []
    for e in reversed(view.events[: o.index]):
        if e.phase == "forward" and e.kind == "output":
            if e.call == o.call:
                continue  # another output of the same call
            if e.module != o.module and e.module.startswith(prefix):
                inner.append(e)
                continue
            return inner, e
        return inner, e if e.phase == "input" else None
    return inner, None


def largest_reaching(view: TraceView, o: Any) -> float | None:
    """The largest finite absolute value among the tensors that reached a forward origin
    (its input, the batch for the model itself, and its submodules' outputs in that call);
    ``None`` when none is known."""
    inner, before = _call_span(view, o)
    if o.module == "":
        inner += [e for e in view.events if e.phase == "input" and e.kind == "input"]
    elif before is not None:
        inner.append(before)
    return max((e.stats.absmax for e in inner if e.finite and is_floating(e.dtype)), default=None)


def _float16_within(view: TraceView, o: Any) -> bool:
    """Whether a submodule of a forward origin returned float16 in the origin's call."""
    return any(e.dtype == "float16" for e in _call_span(view, o)[0])


def _where(view: TraceView, e: Any) -> str:
    if e.phase == "loss":
        return "the loss"
    if e.phase == "input":
        return f"input {e.name}"
    base = module_label(e.module, e.module_type or view.types.get(e.module, ""))
    if e.param:
        return f"{base}, parameter {e.param}"
    return f"{base} ({e.phase})" if e.phase == "backward" else base


# --------------------------------------------------------------------------- weights
def weight_findings(params: Any, view: TraceView | None = None) -> list[Finding]:
    """``nonfinite_weight``: parameters (or a buffer named by the trace's origin) holding
    NaN/Inf. ``params`` are :class:`~nbdebug.core.events.ParamInfo` records."""
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
                    (e.index for e in view.events if e.phase == "forward" and e.module == p.module),
                    None,
                )
        out.append(
            Finding(
                "nonfinite_weight",
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
    if (
        o is not None
        and o.param
        and o.param not in named
        and "already held non-finite" in (o.note or "")
    ):
        out.append(
            Finding(
                "nonfinite_weight",
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
def forward_findings(
    view: TraceView, *, loss_fn: Any = None, mixed_precision: bool = False
) -> list[Finding]:
    """Large inputs to softmax/exp, activations near the float16 limit, dead ReLUs,
    saturated tanh/sigmoid, probabilities of 0/1 reaching a binary cross-entropy."""
    out: list[Finding] = []
    worst: dict[tuple[str, str], Finding] = {}  # (code, module) -> the worst call

    def keep(f: Finding, score: float) -> None:
        key = (f.code, f.module or "")
        prev = worst.get(key)
        if prev is None or score > prev.evidence.get("_score", -math.inf):
            f.evidence["_score"] = score
            worst[key] = f

    seen: set[tuple[Any, ...]] = set()
    for e in view.events:
        if e.phase != "forward" or e.kind != "output" or not e.finite or not e.shape:
            continue
        key = (e.shape, e.dtype, e.stats.numel, e.stats.norm, e.stats.min, e.stats.max)
        if key in seen and not view.is_leaf(e.module):
            continue  # a container returning its last child's output: judged once
        seen.add(key)
        mtype = e.module_type or view.types.get(e.module, "")
        s = e.stats
        where = module_label(e.module, mtype)
        if mtype in SOFTMAX_TYPES:
            inp = view.input_of(e)
            if inp is not None and inp.finite and is_floating(inp.dtype):
                lim = exp_limit(e.dtype)
                if inp.stats.absmax > EXP_RISK_FRACTION * lim:
                    keep(
                        Finding(
                            "exp_overflow_risk",
                            "warning",
                            where,
                            {
                                "input_absmax": inp.stats.absmax,
                                "threshold": EXP_RISK_FRACTION * lim,
                                "limit": lim,
                                "input_from": inp.label,
                            },
                            f"inputs up to {fmt_num(inp.stats.absmax)} reach this "
                            f"{mtype} (exp overflows above "
                            f"{lim:.4g} in {e.dtype}, warned from "
                            f"{EXP_RISK_FRACTION * lim:.4g}); its probabilities saturate to "
                            f"exact 0/1 and a log of "
                            "them gives -inf: scale the logits down (temperature, "
                            "normalisation) or keep "
                            "them in log space.",
                            event=e.index,
                            module=e.module,
                        ),
                        inp.stats.absmax,
                    )
        fp16_risk = s.absmax > FP16_RISK_FRACTION * FP16_MAX
        if fp16_risk and (e.dtype == "float16" or (mixed_precision and is_floating(e.dtype))):
            if e.dtype == "float16":
                text = (
                    f"float16 activations reach {fmt_num(s.absmax)}, within a factor 2 of the "
                    "largest float16 (65504): run this module in float32 or bfloat16, or "
                    "rescale its inputs."
                )
            else:
                text = (
                    f"activations reach {fmt_num(s.absmax)}: under float16 autocast (a "
                    "GradScaler is in use) this module's output would overflow 65504; use "
                    "bfloat16 autocast or rescale."
                )
            limits = {"threshold": FP16_RISK_FRACTION * FP16_MAX, "limit": FP16_MAX}
            keep(
                Finding(
                    "fp16_overflow_risk",
                    "warning",
                    where,
                    {"absmax": s.absmax, **limits},
                    text,
                    event=e.index,
                    module=e.module,
                ),
                s.absmax,
            )
        if mtype in RELU_TYPES and s.zero_frac > DEAD_RELU_ZERO_FRAC:
            keep(
                Finding(
                    "dead_relu",
                    "warning",
                    where,
                    {"zero_frac": s.zero_frac, "threshold": DEAD_RELU_ZERO_FRAC},
                    f"{s.zero_frac:.0%} of this ReLU's outputs are exactly 0, so no gradient flows "
                    "through them: lower the learning rate, check the initialisation "
                    "and the bias, or use "
                    "LeakyReLU/GELU.",
                    fix="nn.LeakyReLU(0.01)",
                    event=e.index,
                    module=e.module,
                ),
                s.zero_frac,
            )
        share = saturated_share(
            mtype, e, view.input_of(e) if mtype in ("Tanh", "Sigmoid") else None
        )
        if share is not None and share > SATURATION_SHARE:
            keep(
                Finding(
                    "saturated_activation",
                    "warning",
                    where,
                    {
                        "saturated_share_at_least": share,
                        "threshold": SATURATION_SHARE,
                        "eps": SATURATION_EPS,
                    },
                    f"at least {share:.0%} of this {mtype}'s outputs lie within "
                    f"{SATURATION_EPS:g} of its "
                    "bounds, where its derivative is ~0: normalise its inputs "
                    "(LayerNorm/BatchNorm before "
                    "it) or lower the initial weights.",
                    event=e.index,
                    module=e.module,
                ),
                share,
            )
    out.extend(worst.values())
    out.extend(_loss_input_findings(view, loss_fn))
    for f in out:
        f.evidence.pop("_score", None)
    return out


def saturated_share(mtype: str, e: Any, inp: Any = None) -> float | None:
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


def _share(h: Any, *, lo: float = -math.inf, hi: float = math.inf) -> float:
    """Share of a histogram's elements in the bins lying within [lo, hi) (log10|x|)."""
    inside = (HIST_EDGES[:-1] >= lo - 1e-12) & (HIST_EDGES[1:] <= hi + 1e-12)
    return float(h.counts[inside].sum()) / max(int(h.total), 1)


# --------------------------------------------------------------------------- the loss's input
def loss_name(loss_fn: Any) -> str:
    if loss_fn is None:
        return ""
    if hasattr(loss_fn, "func") and callable(loss_fn.func):  # functools.partial
        loss_fn = loss_fn.func
    if isinstance(getattr(loss_fn, "__name__", None), str):
        return str(loss_fn.__name__).lower()
    return type(loss_fn).__name__.lower()


def is_torch_loss(loss_fn: Any) -> bool:
    if loss_fn is None:
        return False
    if hasattr(loss_fn, "func") and callable(loss_fn.func):
        loss_fn = loss_fn.func
    mod = getattr(loss_fn, "__module__", None) or type(loss_fn).__module__
    if not isinstance(getattr(loss_fn, "__name__", None), str):
        mod = type(loss_fn).__module__
    return isinstance(mod, str) and (mod == "torch" or mod.startswith("torch."))


def _loss_input_findings(view: TraceView, loss_fn: Any) -> list[Finding]:
    out = view.output()
    if out is None or loss_fn is None or not out.finite or not is_floating(out.dtype):
        return []
    name = loss_name(loss_fn)
    position = view.loss_event if view.loss_event is not None else out.index
    findings = []
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
            findings.append(
                Finding(
                    "exp_overflow_risk",
                    "warning",
                    "the loss (model output)",
                    {
                        "output_absmax": out.stats.absmax,
                        "threshold": EXP_RISK_FRACTION * lim,
                        "limit": lim,
                    },
                    f"the model's outputs reach {fmt_num(out.stats.absmax)} (exp "
                    f"overflows above {lim:.4g} in {out.dtype}, warned from "
                    f"{EXP_RISK_FRACTION * lim:.4g}): {kind}; "
                    "use a stable built-in (F.cross_entropy, F.log_softmax, "
                    "torch.logsumexp) or scale the logits.",
                    fix="loss = F.cross_entropy(logits, y)",
                    event=out.index,
                    module="",
                    position=float(position),
                )
            )
    if ("binary_cross_entropy" in name or name == "bceloss") and "logits" not in name:
        s = out.stats
        if s.min <= 0 or s.max >= 1:
            findings.append(
                Finding(
                    "log_of_nonpositive",
                    "warning",
                    "the loss (model output)",
                    {"output_min": s.min, "output_max": s.max, "threshold": "0 < p < 1"},
                    "probabilities of exactly 0 or 1 reach binary_cross_entropy, which "
                    "takes log(p) and "
                    "log(1 - p) (clamped at -100, gradients of 1e12): output logits and use "
                    "binary_cross_entropy_with_logits.",
                    fix="loss = F.binary_cross_entropy_with_logits(logits, y)",
                    event=out.index,
                    module="",
                    position=float(position),
                )
            )
    return findings


def _forward(ctx: CheckContext) -> list[Finding]:
    assert ctx.view is not None
    return forward_findings(ctx.view, loss_fn=ctx.loss_fn, mixed_precision=ctx.mixed_precision)


#: The forward checks, for :func:`nbdebug.check` (see :class:`~.checks_base.CheckFamily`).
FAMILIES = (
    CheckFamily(
        (
            "log_of_nonpositive",
            "exp_overflow_risk",
            "fp16_overflow_risk",
            "division_by_zero",
            "nonfinite_origin",
        ),
        ("trace",),
        lambda ctx: origin_findings(ctx.view),  # type: ignore[arg-type]
    ),
    CheckFamily(
        ("nonfinite_weight",), ("trace",), lambda ctx: weight_findings(ctx.trace.params, ctx.view)
    ),
    CheckFamily(
        ("exp_overflow_risk", "fp16_overflow_risk", "dead_relu", "saturated_activation"),
        ("trace",),
        _forward,
    ),
)
