"""Gradient health checks: non-finite gradients (which parameters), vanishing and
exploding grad/weight norm ratios, and a total gradient norm far above its recent
history. They read :class:`~nbdebug.core.trace.events.ParamInfo` records, from a trace or
measured on a live model (:func:`live_param_infos`, one fused norm per device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ...core.norms import fused_norms
from ...core.state import unique_parameters
from ...core.stats import count_nonfinite, is_finite_number
from ...core.text import dtype_name, fmt_num
from ...core.trace.events import ParamInfo
from ...core.vocab import Phase
from .base import (
    EXPLODING_HISTORY_FACTOR,
    EXPLODING_RATIO,
    HISTORY_MIN_ROWS,
    HISTORY_WINDOW,
    VANISHING_RATIO,
    CheckContext,
    CheckFamily,
    Finding,
    skipped,
)
from .codes import CheckCode


def live_param_infos(model: torch.nn.Module) -> list[ParamInfo]:
    """:class:`ParamInfo` of every parameter of ``model`` from its current ``.grad``
    (read only; NaN/Inf are counted element-wise only for tensors whose norm is not finite)."""
    params = unique_parameters(model)
    names: dict[int, str] = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    grads = [_dense(p.grad) for p in params if p.grad is not None]
    with torch.no_grad():
        wn = fused_norms([p.detach() for p in params]) if params else np.empty(0)
        gn = fused_norms(grads) if grads else np.empty(0)
    out = []
    gi = 0
    for p, n in zip(params, wn):
        name = names.get(id(p), "?")
        g_norm: float | None = None
        g_nan = g_inf = 0
        if p.grad is not None:
            g_norm = float(gn[gi])
            if not math.isfinite(g_norm):
                g_nan, g_inf = count_nonfinite(grads[gi])
            gi += 1
        w_nan, w_inf = (0, 0) if math.isfinite(float(n)) else count_nonfinite(p.detach())
        out.append(
            ParamInfo(
                name=name,
                module=name.rsplit(".", 1)[0] if "." in name else "",
                shape=tuple(p.shape),
                dtype=dtype_name(p.dtype),
                requires_grad=p.requires_grad,
                norm=float(n),
                grad_norm=g_norm,
                n_nan=w_nan,
                n_inf=w_inf,
                grad_n_nan=g_nan,
                grad_n_inf=g_inf,
            )
        )
    return out


def _dense(g: torch.Tensor) -> torch.Tensor:
    g = g.detach()
    if g.is_sparse:
        return g.coalesce().values()
    return g


def total_grad_norm(params: Sequence[ParamInfo]) -> float | None:
    norms = [p.grad_norm for p in params if p.grad_norm is not None]
    if not norms:
        return None
    return float(math.sqrt(sum(n * n for n in norms)))


#: What a grad/weight norm ratio says (:func:`ratio_verdict`, :func:`param_verdict`).
RatioVerdict = Literal["vanishing", "exploding", "ok", "unknown", "not judged"]


def ratio_verdict(ratio: float | None) -> RatioVerdict:
    """The one judgement of a grad norm / weight norm ratio, shared by the health checks,
    the Layers tab's table and its bar plot.

    Parameters
    ----------
    ratio : float or None
        ``grad_norm / norm`` of a parameter (``ParamInfo.ratio``).

    Returns
    -------
    {"vanishing", "exploding", "ok", "unknown"}
        ``"vanishing"`` below ``VANISHING_RATIO`` (1e-5, zero included), ``"exploding"``
        above ``EXPLODING_RATIO`` (100, inf included), ``"ok"`` between, ``"unknown"`` for
        ``None`` or NaN.

    Examples
    --------
    >>> ratio_verdict(1e-7), ratio_verdict(0.01), ratio_verdict(1e3)
    ('vanishing', 'ok', 'exploding')
    """
    if ratio is None or math.isnan(ratio):
        return "unknown"
    if ratio < VANISHING_RATIO:
        return "vanishing"
    if ratio > EXPLODING_RATIO:
        return "exploding"
    return "ok"


#: Module types whose weights get sparse gradients (only the rows of the batch's ids):
#: their small ratio is expected.
SPARSE_GRAD_TYPES = frozenset({"Embedding", "EmbeddingBag"})


def judged(p: ParamInfo, module_type: str = "") -> bool:
    """Whether a parameter's grad/weight norm ratio can be called vanishing or exploding:
    the one rule of the health checks and the Layers plot.

    A parameter is judged when it requires grad, got a gradient, is a weight matrix or
    kernel (``ndim >= 2``: biases and norm scales are not), its weight and gradient are
    finite with a non-zero weight norm (the norms are over the finite elements only), and
    its module (``module_type``) is not an embedding (sparse gradients: a small ratio is
    expected).
    """
    if p.grad_norm is None or not p.requires_grad or len(p.shape) < 2:
        return False
    if p.grad_n_nan or p.grad_n_inf or p.n_nan or p.n_inf:
        return False
    if not (math.isfinite(p.grad_norm) and math.isfinite(p.norm)) or p.norm <= 0:
        return False
    return module_type not in SPARSE_GRAD_TYPES


def param_verdict(p: ParamInfo, module_type: str = "") -> RatioVerdict:
    """:func:`ratio_verdict` of a parameter's ratio when it is :func:`judged`, else
    ``"not judged"``: a parameter the checks call vanishing or exploding is the one the
    Layers plot marks."""
    if not judged(p, module_type):
        return "not judged"
    assert p.grad_norm is not None
    return ratio_verdict(p.grad_norm / p.norm)


def param_verdicts(
    params: Sequence[ParamInfo], module_types: Mapping[str, str]
) -> dict[str, RatioVerdict]:
    """:func:`param_verdict` of every parameter (``module_types``: module name -> its
    class name, as ``Trace.module_types``), by parameter name."""
    return {p.name: param_verdict(p, module_types.get(p.module, "")) for p in params}


#: The codes of the gradient checks of one step.
GRAD_CODES = (
    CheckCode.NONFINITE_GRADIENT,
    CheckCode.VANISHING_GRADIENT,
    CheckCode.EXPLODING_GRADIENT,
)


def grad_findings(
    params: Sequence[ParamInfo],
    *,
    module_types: dict[str, str] | None = None,
    position: Callable[[str], float] | None = None,
    backward_ran: bool = True,
) -> list[Finding]:
    """``nonfinite_gradient``, ``vanishing_gradient``, ``exploding_gradient`` (ratio), and
    info findings for what cannot be checked (no parameters, frozen, unused).

    ``position(name)`` gives the trace position of a parameter's gradient (for sorting).
    """
    types = module_types or {}
    pos = position or (lambda name: math.inf)
    if not params:
        return [skipped(GRAD_CODES, "the model has no parameters")]
    if not backward_ran:
        return [skipped(GRAD_CODES, "no backward pass (no loss, or nothing requires grad)")]
    out = _without_gradient(params)
    out += _nonfinite_gradients(params, pos)
    for p in params:
        verdict = param_verdict(p, types.get(p.module, ""))
        if verdict in _RATIO_FINDINGS:
            out.append(_ratio_finding(p, verdict, float(pos(p.name))))
    return out


def _without_gradient(params: Sequence[ParamInfo]) -> list[Finding]:
    """Frozen parameters (skipped) and parameters no gradient reached (unused)."""
    out: list[Finding] = []
    frozen = [p.name for p in params if not p.requires_grad]
    unused = [p.name for p in params if p.requires_grad and p.grad_norm is None]
    if frozen:
        out.append(
            skipped(
                [CheckCode.VANISHING_GRADIENT, CheckCode.EXPLODING_GRADIENT],
                f"{len(frozen)} frozen parameter(s) (requires_grad=False) have no gradient",
                params=frozen[:20],
            )
        )
    if unused and len(unused) < len(params) - len(frozen):
        out.append(
            Finding(
                CheckCode.UNUSED_PARAMETER,
                "info",
                f"{len(unused)} parameter(s)",
                {"params": unused[:20]},
                "no gradient reached these parameters: they are not used by this forward (or "
                "their path is detached); with DDP this needs find_unused_parameters=True.",
                param=unused[0],
            )
        )
    return out


def _nonfinite_gradients(params: Sequence[ParamInfo], pos: Callable[[str], float]) -> list[Finding]:
    bad = sorted((p for p in params if p.grad_n_nan or p.grad_n_inf), key=lambda p: pos(p.name))
    if not bad:
        return []
    first = bad[0]
    ev: dict[str, Any] = {p.name: {"nan": p.grad_n_nan, "inf": p.grad_n_inf} for p in bad[:10]}
    ev["n_params"] = len(bad)
    ev["threshold"] = 0
    names = ", ".join(p.name for p in bad[:5]) + (
        f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    )
    return [
        Finding(
            CheckCode.NONFINITE_GRADIENT,
            "error",
            f"gradients of {names}",
            ev,
            "these gradients hold NaN/Inf: skip the step (NaNGuard does), and look "
            "at the first "
            "backward event that is not finite for the cause.",
            event=None,
            param=first.name,
            module=first.module,
            position=pos(first.name),
        )
    ]


#: verdict -> (code, threshold, fix, advice about the ``{ratio}``) of a judged parameter
_RATIO_FINDINGS: dict[RatioVerdict, tuple[CheckCode, float, str, str]] = {
    "vanishing": (
        CheckCode.VANISHING_GRADIENT,
        VANISHING_RATIO,
        "",
        "grad/weight norm ratio {ratio}: this layer barely learns; add normalisation or "
        "residual connections, check for saturated or dead activations before it, or raise "
        "its learning rate.",
    ),
    "exploding": (
        CheckCode.EXPLODING_GRADIENT,
        EXPLODING_RATIO,
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)",
        "grad/weight norm ratio {ratio}: one step would move this weight far beyond its "
        "size; clip the gradient norm and lower the learning rate.",
    ),
}


def _ratio_finding(p: ParamInfo, verdict: RatioVerdict, at: float) -> Finding:
    """The vanishing or exploding finding of a judged parameter."""
    assert p.grad_norm is not None
    ratio = p.grad_norm / p.norm
    code, threshold, fix, advice = _RATIO_FINDINGS[verdict]
    ev = {"grad_norm": p.grad_norm, "weight_norm": p.norm, "ratio": ratio, "threshold": threshold}
    text = advice.format(ratio=fmt_num(ratio))
    where = f"parameter {p.name}"
    return Finding(
        code, "warning", where, ev, text, fix=fix, param=p.name, module=p.module, position=at
    )


def history_grad_findings(
    history: Sequence[dict[str, Any]], current: float | None
) -> list[Finding]:
    """``exploding_gradient`` when ``current`` (the total gradient norm) is more than
    ``EXPLODING_HISTORY_FACTOR`` times the median of the recent history."""
    if current is None or not math.isfinite(current):
        return []
    norms = [
        float(r["grad_norm"])
        for r in history[-HISTORY_WINDOW:]
        if is_finite_number(r.get("grad_norm"))
    ]
    if len(norms) < HISTORY_MIN_ROWS:
        return []
    med = float(np.median(norms))
    if med <= 0 or current <= EXPLODING_HISTORY_FACTOR * med:
        return []
    return [
        Finding(
            CheckCode.EXPLODING_GRADIENT,
            "warning",
            "total gradient norm",
            {
                "grad_norm": current,
                "median": med,
                "factor": current / med,
                "threshold": EXPLODING_HISTORY_FACTOR,
                "history_rows": len(norms),
            },
            f"the gradient norm is {current / med:.3g}x its recent median "
            f"({fmt_num(med)}): a loss spike or a bad "
            "batch; clip the gradient norm (e.g. at a few times the median) and check this batch.",
            fix=f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={3 * med:.3g})",
        )
    ]


def _trace_grads(ctx: CheckContext) -> list[Finding]:
    tr, view = ctx.trace, ctx.view
    assert tr is not None and view is not None
    ran = any(e.phase == Phase.BACKWARD for e in tr.events) or not any(
        p.requires_grad for p in tr.params
    )
    return grad_findings(
        tr.params, module_types=tr.module_types, position=view.position_of_param, backward_ran=ran
    )


def _history_grads(ctx: CheckContext) -> list[Finding]:
    assert ctx.trace is not None
    return history_grad_findings(ctx.history or [], total_grad_norm(ctx.trace.params))


#: The gradient checks, for :func:`nbdebug.check` (see :class:`~.base.CheckFamily`).
FAMILIES = (
    CheckFamily(
        (
            CheckCode.NONFINITE_GRADIENT,
            CheckCode.VANISHING_GRADIENT,
            CheckCode.EXPLODING_GRADIENT,
            CheckCode.UNUSED_PARAMETER,
        ),
        ("trace", "backward"),
        _trace_grads,
    ),
    CheckFamily(
        (CheckCode.EXPLODING_GRADIENT,),
        ("trace", "backward", "history"),
        _history_grads,
    ),
)
