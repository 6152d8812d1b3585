"""Mixed-precision checks: what bfloat16 loses (precision), as opposed to what float16
loses (range; ``fp16_overflow_risk`` in :mod:`nbdebug.analysis.checks.forward`).

bfloat16 has float32's exponent (largest finite value ~3.4e38, so it overflows where
float32 does) but 8 bits of mantissa: neighbouring bfloat16 numbers are 2**-8 (0.39 %)
apart. Its failure is lost precision: values whose spread is below that step collapse
to a few representable numbers (a sum of many small terms stops growing, a normalised
activation becomes constant), and a loss computed in bfloat16 no longer shows changes
smaller than 0.39 % of itself. float16 has 11 bits of mantissa but a largest finite value
of 65504: its failure is overflow to Inf (and gradients underflowing to 0 without a
GradScaler).

======================  ========  ==============================================================
code                    severity  triggered by (threshold)
======================  ========  ==============================================================
bf16_precision_loss     warning   a bfloat16 module output whose std < ``BF16_SPREAD`` (2**-8) x
                                  abs(mean) (its spread is below one bfloat16 step; a constant
                                  non-zero output included), or a loss
                                  computed in bfloat16
======================  ========  ==============================================================
"""

from __future__ import annotations

from ...core.text import fmt_num
from ...core.vocab import EventKind, Phase
from .base import CheckContext, CheckFamily, Finding, TraceView, module_label
from .codes import CheckCode

__all__ = ["BF16_SPREAD", "FAMILIES", "precision_findings"]

#: the relative distance between neighbouring bfloat16 numbers (8 bits of mantissa)
BF16_SPREAD = 2.0**-8


def precision_findings(view: TraceView) -> list[Finding]:
    """``bf16_precision_loss`` findings of one trace (see the module doc)."""
    out: list[Finding] = []
    reported: set[tuple[float, ...]] = set()
    for e in view.events:
        if e.dtype != "bfloat16" or e.stats is None:
            continue
        s = e.stats
        if e.phase == Phase.LOSS:
            out.append(
                Finding(
                    CheckCode.BF16_PRECISION_LOSS,
                    "warning",
                    "the loss",
                    {"dtype": "bfloat16", "loss": s.mean, "threshold": BF16_SPREAD},
                    "the loss is computed in bfloat16, whose 8-bit mantissa hides changes "
                    "smaller than 0.4 % of it: compute the loss in float32.",
                    fix="loss = loss_fn(output.float(), target)",
                    event=e.index,
                )
            )
            continue
        if e.phase != Phase.FORWARD or e.kind != EventKind.OUTPUT or s.numel < 2 or not s.mean:
            continue
        ratio = s.std / abs(s.mean)
        # a container whose output is its last child's (the same tensor, the same numbers)
        # is not a second finding
        key = (s.numel, s.mean, s.std, s.min, s.max)
        if ratio < BF16_SPREAD and key not in reported:
            reported.add(key)
            where = module_label(e.module, view.types.get(e.module, ""))
            out.append(
                Finding(
                    CheckCode.BF16_PRECISION_LOSS,
                    "warning",
                    where,
                    {
                        "std": s.std,
                        "mean": s.mean,
                        "std_over_mean": ratio,
                        "threshold": BF16_SPREAD,
                    },
                    f"its bfloat16 output varies by {fmt_num(ratio)} of its mean, less than one "
                    "bfloat16 step (2**-8): the values collapse to a few numbers; run this "
                    "module in float32 or subtract the offset first.",
                    fix="with torch.autocast('cpu', enabled=False): y = module(x.float())",
                    event=e.index,
                    module=e.module,
                )
            )
    return out


def _precision(ctx: CheckContext) -> list[Finding]:
    assert ctx.view is not None
    return precision_findings(ctx.view)


#: The mixed-precision checks, for :func:`nbdebug.check`.
FAMILIES = (CheckFamily((CheckCode.BF16_PRECISION_LOSS,), ("trace",), _precision),)
