"""Data health checks: non-finite inputs (rows), labels outside the classes the model
outputs (before the loss crashes on them), features constant across the batch and
inputs on a raw scale."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...core.batch import call_model, named_tensors
from ...core.state import preserved
from ...core.text import fmt_num, row_numbers, rows_text
from ...core.trace.events import Event
from ...core.vocab import EventKind, Phase
from .base import (
    CONSTANT_MIN_ROWS,
    CONSTANT_STD,
    UNSCALED_RANGE,
    Band,
    CheckContext,
    CheckFamily,
    Finding,
    LossFn,
    TraceView,
    is_floating,
    is_output,
    position,
    skipped,
)
from .codes import CheckCode
from .forward import is_torch_loss, loss_name

#: Keys of a dict batch that hold the labels when no target is given (Hugging Face style).
LABEL_KEYS = ("labels", "label", "targets", "target", "y")
_CLASS_LOSSES = (
    "cross_entropy",
    "crossentropyloss",
    "nll_loss",
    "nllloss",
    "multi_margin_loss",
    "multimarginloss",
)


def trace_input_findings(view: TraceView) -> list[Finding]:
    """``nonfinite_input`` and ``unscaled_input`` from the batch events of a trace."""
    out = []
    masks = set(view.trace.mask_events)
    for e in view.events:
        if e.phase != Phase.INPUT:
            continue
        s = e.stats
        if not e.finite and e.index not in masks:  # an intended -inf mask is not bad data
            rows = f"{rows_text(e.samples)} of " if e.samples else ""
            out.append(
                Finding(
                    CheckCode.NONFINITE_INPUT,
                    "error",
                    f"{rows}input {e.name}",
                    {"n_nan": s.n_nan, "n_inf": s.n_inf, "n_rows": len(e.samples), "threshold": 0},
                    "the batch itself holds NaN/Inf: drop or repair these rows in the "
                    "data pipeline "
                    "(torch.nan_to_num, or filter rows where ~torch.isfinite(x).all(1)).",
                    fix="keep = torch.isfinite(x).flatten(1).all(1); x, y = x[keep], y[keep]",
                    event=e.index,
                    rows=list(e.samples),
                )
            )
        if e.kind == EventKind.INPUT and (is_floating(e.dtype) or e.dtype.startswith("complex")):
            # (a target's scale is the loss's business: regression targets in their units)
            spread = s.max - s.min
            if spread == spread and spread > UNSCALED_RANGE:  # NaN-safe
                out.append(
                    Finding(
                        CheckCode.UNSCALED_INPUT,
                        "warning",
                        f"input {e.name}",
                        {"min": s.min, "max": s.max, "range": spread, "threshold": UNSCALED_RANGE},
                        f"inputs span {fmt_num(s.min)} .. {fmt_num(s.max)}: "
                        f"standardise them (subtract the mean, "
                        "divide by the std, per feature) so the first layer's "
                        "activations and gradients stay O(1).",
                        fix="x = (x - mean) / (std + 1e-8)  # statistics of the training set",
                        event=e.index,
                    )
                )
    return out


def constant_feature_findings(inputs: object) -> list[Finding]:
    """``constant_feature``: a floating input feature whose std across the batch is ~0.

    Features are columns of a 2-d input, the last dimension of a 3-d input (batch,
    sequence, features) and channels (dimension 1) of 4-d/5-d inputs.
    """
    out: list[Finding] = []
    prefix = "x" if isinstance(inputs, torch.Tensor) else "inputs"
    notes: list[str] = []
    checked = 0
    for name, t in named_tensors(inputs, prefix):
        if not t.is_floating_point():
            if t.is_complex():
                notes.append(f"{name} is complex")
            continue
        if t.ndim < 2 or t.shape[0] < CONSTANT_MIN_ROWS:
            notes.append(
                f"{name} has fewer than {CONSTANT_MIN_ROWS} rows"
                if t.ndim >= 2
                else f"{name} has one dimension"
            )
            continue
        checked += 1
        x = t.detach().to(torch.float64)
        dim = x.ndim - 1 if x.ndim == 3 else 1
        feats = x.movedim(dim, -1).reshape(-1, x.shape[dim])
        finite = torch.isfinite(feats)
        if not bool(finite.all()):
            feats = torch.where(finite, feats, torch.nan)
        mean = torch.nanmean(feats, dim=0)
        std = torch.sqrt(torch.nanmean((feats - mean) ** 2, dim=0))
        tol = CONSTANT_STD * torch.clamp(mean.abs(), min=1.0)
        const = torch.nonzero(std <= tol).flatten().tolist()
        if not const:
            continue
        which = "channels" if dim == 1 and x.ndim >= 4 else "features"
        out.append(
            Finding(
                CheckCode.CONSTANT_FEATURE,
                "warning",
                f"{which} {row_numbers(const)} of input {name}",
                {
                    "features": const[:50],
                    "n_constant": len(const),
                    "n_features": int(x.shape[dim]),
                    "values": [float(mean[i]) for i in const[:10]],
                    "threshold": CONSTANT_STD,
                },
                (
                    f"{len(const)} of {x.shape[dim]} {which} does not vary across the "
                    f"{x.shape[0]} rows: a standardisation divides it by a zero std (0/0), "
                    "and it carries no signal; drop it or add an epsilon to the std."
                    if len(const) == 1
                    else f"{len(const)} of {x.shape[dim]} {which} do not vary across the "
                    f"{x.shape[0]} rows: a standardisation divides them by a zero std (0/0), "
                    "and they carry no signal; drop them or add an epsilon to the std."
                ),
                fix="x = (x - mu) / (sigma + 1e-8)",
                position=position(Band.TRACE, 0.5),  # after the batch, before the model
            )
        )
    if not checked:
        why = "; ".join(notes[:3]) or "no floating input tensor (token ids?)"
        out.append(skipped([CheckCode.CONSTANT_FEATURE], why))
    return out


def label_findings(
    view: TraceView | None,
    inputs: object,
    target: object,
    loss_fn: LossFn | None,
    *,
    output_shape: tuple[int, ...] | None = None,
) -> list[Finding]:
    """``label_out_of_range``: class indices outside ``[0, C)`` (``ignore_index`` aside) or
    binary targets outside ``[0, 1]``, with their rows. ``C`` comes from the model output
    in ``view``, or from ``output_shape`` when given."""
    out_name = None
    if target is None and isinstance(inputs, Mapping):
        key = next((k for k in LABEL_KEYS if isinstance(inputs.get(k), torch.Tensor)), None)
        if key is not None:
            target = inputs[key]
            out_name = "output['logits']"
    if not isinstance(target, torch.Tensor) or target.numel() == 0:
        return []
    name = loss_name(loss_fn)
    y = target.detach()
    at = (
        position(Band.TRACE, view.loss_event)
        if view is not None and view.loss_event is not None
        else position(Band.STEP)
    )
    if "binary_cross_entropy" in name or name in ("bceloss", "bcewithlogitsloss"):
        return _binary_labels(y, at)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        return []
    shape = output_shape
    if shape is None:
        out_event = _logits_event(view, y, out_name)
        shape = tuple(out_event.shape) if out_event is not None else ()
    n_classes = _n_classes(tuple(y.shape), tuple(shape))
    if n_classes is None:
        return []
    known = any(k in name for k in _CLASS_LOSSES)
    if not known and (is_torch_loss(loss_fn) or (loss_fn is None and out_name is None)):
        return []  # a torch loss that does not take class indices (or no loss at all)
    ignore = getattr(loss_fn, "ignore_index", -100 if known or out_name else None)
    valid = (y >= 0) & (y < n_classes)
    if ignore is not None:
        valid |= y == ignore
    if bool(valid.all()):
        return []
    return [_class_labels_finding(y, ~valid, n_classes, at)]


def _binary_labels(y: torch.Tensor, at: float) -> list[Finding]:
    """Binary cross-entropy targets outside [0, 1]."""
    if not y.is_floating_point():
        return []
    bad = (y < 0) | (y > 1)
    if not bool(bad.any()):
        return []
    rows = _rows(bad)
    return [
        Finding(
            CheckCode.LABEL_OUT_OF_RANGE,
            "error",
            f"target {rows_text(rows)}",
            {
                "min": float(y.min()),
                "max": float(y.max()),
                "n_bad": int(bad.sum()),
                "threshold": "0 <= y <= 1",
            },
            "binary cross-entropy targets must lie in [0, 1]: fix the labels of these rows.",
            rows=rows,
            position=at,
        )
    ]


def _logits_event(view: TraceView | None, y: torch.Tensor, out_name: str | None) -> Event | None:
    """The model output the labels index into (``out_name``: one of several outputs)."""
    if view is None:
        return None
    out_event = view.output(out_name) if out_name else view.output()
    if out_event is None and view.trace.error:
        # the model raised before returning (e.g. its own loss on these labels): the
        # last module output shaped like per-row class scores stands for the logits
        out_event = next(
            (
                e
                for e in reversed(view.events)
                if is_output(e)
                and len(e.shape) == y.ndim + 1
                and e.shape[0] == (y.shape[0] if y.ndim else -1)
            ),
            None,
        )
    return out_event


def _n_classes(labels: tuple[int, ...], scores: tuple[int, ...]) -> int | None:
    """The number of classes of per-row class scores of shape ``scores`` that labels of
    shape ``labels`` index into (classes in dimension 1 or last), or ``None``."""
    if len(scores) < 2:
        return None
    if labels == scores[:1] + scores[2:]:
        return scores[1]
    if labels == scores[:-1]:
        return scores[-1]
    return None


def _class_labels_finding(y: torch.Tensor, bad: torch.Tensor, n_classes: int, at: float) -> Finding:
    rows = _rows(bad)
    vals = sorted({int(v) for v in y[bad].flatten()[:1000].tolist()})
    return Finding(
        CheckCode.LABEL_OUT_OF_RANGE,
        "error",
        f"target {rows_text(rows)}",
        {
            "bad_labels": vals[:20],
            "n_classes": int(n_classes),
            "min": int(y.min()),
            "max": int(y.max()),
            "n_bad": int(bad.sum()),
            "threshold": f"0 <= y < {n_classes}",
        },
        f"labels {vals[:5]} fall outside the {n_classes} classes the model outputs "
        f"(the loss raises, or "
        "on CUDA triggers a device-side assert): fix the label mapping or the output size.",
        fix=f"assert 0 <= y.min() and y.max() < {n_classes}",
        rows=rows,
        position=at,
    )


def labels_before_trace(
    model: torch.nn.Module,
    inputs: object,
    target: object,
    loss_fn: LossFn | None,
    *,
    on_cpu: bool = False,
) -> list[Finding]:
    """Off the CPU, an out-of-range class label makes the loss trigger a device-side assert
    that breaks the CUDA context: check integer labels against the output of one forward
    pass (no grad, state preserved) before tracing. A dict batch carrying its labels is
    left to the trace (the model computes its own loss on them). ``on_cpu``: check CPU
    labels this way too (on the CPU the trace names them from its partial trace)."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return []
    if target.device.type == "cpu" and not on_cpu:
        return []
    if target.is_complex() or target.dtype == torch.bool or target.numel() == 0:
        return []
    with preserved(model), torch.no_grad():
        out = call_model(model, inputs)
    logits = out
    if isinstance(out, Mapping):
        logits = out.get("logits")
    elif isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        return []
    return label_findings(None, inputs, target, loss_fn, output_shape=tuple(logits.shape))


def _rows(bad: torch.Tensor) -> list[int]:
    if bad.ndim == 0:
        return [0]
    return torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1)).flatten().tolist()


def _labels(ctx: CheckContext) -> list[Finding]:
    return label_findings(ctx.view, ctx.inputs, ctx.target, ctx.loss_fn)


#: The data checks, for :func:`nbdebug.check` (see :class:`~.checks_base.CheckFamily`).
FAMILIES = (
    CheckFamily(
        (CheckCode.NONFINITE_INPUT, CheckCode.UNSCALED_INPUT),
        ("trace",),
        lambda ctx: trace_input_findings(ctx.view) if ctx.view is not None else [],
    ),
    CheckFamily(
        (CheckCode.CONSTANT_FEATURE,),
        ("inputs",),
        lambda ctx: constant_feature_findings(ctx.inputs),
    ),
    CheckFamily((CheckCode.LABEL_OUT_OF_RANGE,), (), _labels),
)
