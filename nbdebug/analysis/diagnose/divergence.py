"""Divergence as a cause: the weights grew over the updates before the failing step.

Read from the guard's history (its rows as :func:`nbdebug.parse_history` reads them): the
finite steps before the failure are split at the step the divergence began, the first of
the last run of steps whose gradient norm (or loss) lies far outside the band of the steps
before it. That band, the robust median and MAD of the steps *before* the divergence
began, is the healthy reference of the diagnosis; the steps being diagnosed never enter it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...core.guard.history import HistoryRow
from ...core.stats import is_finite_number
from ...core.text import fmt_num
from ...core.vocab import FixKind
from .fix import Fix
from .result import Reference

__all__ = ["DIVERGE_GROWTH", "DIVERGE_Z", "Diverged", "Divergence", "band", "find_divergence"]

#: A step is outside the healthy band when its robust z-score exceeds this.
DIVERGE_Z = 6.0
#: ... and the run diverged when the gradient norm or the loss at its end is this many
#: times the band's median.
DIVERGE_GROWTH = 100.0
#: The MAD is floored at this fraction of the median (a band of one or two steps).
_MAD_FLOOR = 0.1
#: The band holds at most this many steps before the divergence began.
_BAND = 20


def _value(h: HistoryRow, key: str) -> float | None:
    v = h.get(key)
    return float(v) if is_finite_number(v) else None  # type: ignore[arg-type]


def _healthy(h: HistoryRow) -> bool:
    return (
        not h.get("skipped")
        and not h.get("nonfinite")
        and _value(h, "loss") is not None
        and _value(h, "grad_norm") is not None
    )


def _robust(values: Sequence[float]) -> tuple[float, float]:
    """Median and the MAD scaled to a standard deviation (floored: see ``_MAD_FLOOR``)."""
    med = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - med) for v in values)
    return med, max(mad, _MAD_FLOOR * abs(med), 1e-12)


def band(rows: Sequence[HistoryRow]) -> Reference:
    """The robust band (median and MAD of ``loss`` and ``grad_norm``, median ``lr``) of
    healthy ``rows``; an empty :class:`Reference` when there is none."""
    good = [h for h in rows if _healthy(h)]
    if not good:
        return Reference()
    loss = _robust([_value(h, "loss") or 0.0 for h in good])
    grad = _robust([_value(h, "grad_norm") or 0.0 for h in good])
    lrs = [v for v in (_value(h, "lr") for h in good) if v is not None]
    return Reference(
        loss=loss[0],
        grad_norm=grad[0],
        lr=statistics.median(lrs) if lrs else None,
        loss_mad=loss[1],
        grad_norm_mad=grad[1],
    )


def _z(v: float, ref: tuple[float, float]) -> float:
    return (v - ref[0]) / ref[1]


@dataclass(frozen=True)
class Divergence:
    """The evidence that the weights diverged over the updates before the failing step.

    Attributes
    ----------
    began : int
        The step the divergence began (the first step outside the healthy band).
    step : int or None
        The failing step.
    band : Reference
        The healthy band: robust median and MAD of the steps before ``began``.
    grad_z : list of (int, float)
        Per step from ``began`` on: the gradient norm's robust z-score against the band.
    grad_norm : (float, float)
        The band's median gradient norm and the last finite one.
    weight_norm : (float, float) or None
        The weight norm before the divergence began and at the failing step (``None``
        when the guard did not measure it; ``NaNGuard(param_norm_every=1)``).
    lr : (float, float) or None
        The learning rate at the first row of the history and at the failing step.
    """

    began: int
    step: int | None
    band: Reference
    grad_z: list[tuple[int, float]] = field(default_factory=list)
    grad_norm: tuple[float, float] = (0.0, 0.0)
    weight_norm: tuple[float, float] | None = None
    lr: tuple[float, float] | None = None

    def lr_trend(self) -> str:
        """``"the learning rate rose from 0.001 to 0.136"`` (or "held at 3")."""
        if self.lr is None:
            return ""
        a, b = self.lr
        if b > 1.5 * a:
            return f"the learning rate rose from {fmt_num(a)} to {fmt_num(b)}"
        if b < a / 1.5:
            return f"the learning rate fell from {fmt_num(a)} to {fmt_num(b)}"
        return f"the learning rate held at {fmt_num(b)}"

    def evidence(self) -> str:
        """The history's story in one clause."""
        z = max((v for _, v in self.grad_z), default=0.0)
        parts = [
            f"the gradient norm rose from {fmt_num(self.grad_norm[0])} to "
            f"{fmt_num(self.grad_norm[1])} (robust z {fmt_num(z)})"
        ]
        if self.weight_norm is not None:
            a, b = self.weight_norm
            parts.append(f"the weight norm from {fmt_num(a)} to {fmt_num(b)}")
        lr = self.lr_trend()
        if lr:
            parts.append(lr)
        return ", ".join(parts)

    def statement(self) -> str:
        return f"the weights diverged over the updates from step {self.began}: {self.evidence()}"


def _tail_start(rows: list[HistoryRow]) -> int | None:
    """Index of the first row of the last run of rows outside the band of the rows
    before it; ``None`` when the last row is inside its band."""
    start = None
    for b in range(len(rows) - 1, 0, -1):
        base = rows[max(0, b - _BAND) : b]
        grad = _robust([_value(h, "grad_norm") or 0.0 for h in base])
        loss = _robust([_value(h, "loss") or 0.0 for h in base])
        out = all(
            max(_z(_value(h, "grad_norm") or 0.0, grad), _z(_value(h, "loss") or 0.0, loss))
            > DIVERGE_Z
            for h in rows[b:]
        )
        if not out:
            break
        start = b
    return start


def _step(h: HistoryRow) -> int | None:
    s = h.get("step")
    return int(s) if isinstance(s, (int, float)) else None


def _norms(before: list[HistoryRow], after: list[HistoryRow]) -> tuple[float, float] | None:
    a = [v for v in (_value(h, "param_norm") for h in before) if v is not None]
    b = [v for v in (_value(h, "param_norm") for h in after) if v is not None]
    return (a[-1], b[-1]) if a and b else None


def find_divergence(history: Sequence[HistoryRow], step: int | None) -> Divergence | None:
    """The divergence the history shows before the failing ``step``, or ``None``: the
    last run of healthy steps outside the robust band of the steps before it, ending at
    the failure with the gradient norm or the loss ``DIVERGE_GROWTH`` times the band's
    median (and the weight norm grown, where it was measured)."""
    before = [h for h in history if step is None or (_step(h) is None or (_step(h) or 0) < step)]
    rows = [h for h in before if _healthy(h)]
    b = _tail_start(rows) if len(rows) >= 2 else None
    if b is None:
        return None
    ref = band(rows[max(0, b - _BAND) : b])
    last = rows[-1]
    g0, l0 = ref.grad_norm or 0.0, ref.loss or 0.0
    g1, l1 = _value(last, "grad_norm") or 0.0, _value(last, "loss") or 0.0
    if g1 < DIVERGE_GROWTH * g0 and abs(l1) < DIVERGE_GROWTH * (abs(l0) + 1e-12):
        return None
    failing = [h for h in history if step is not None and _step(h) == step]
    weights = _norms(rows[:b], rows[b:] + failing)
    if weights is not None and weights[1] < 1.5 * weights[0]:
        return None  # the weights did not grow: not a divergence through the updates
    lrs = [v for v in (_value(h, "lr") for h in list(history)) if v is not None]
    scale = (ref.grad_norm or 0.0, ref.grad_norm_mad or 1e-12)
    return Divergence(
        began=_step(rows[b]) or 0,
        step=step,
        band=ref,
        grad_z=[(_step(h) or 0, _z(_value(h, "grad_norm") or 0.0, scale)) for h in rows[b:]],
        grad_norm=(g0, g1),
        weight_norm=weights,
        lr=(lrs[0], lrs[-1]) if lrs else None,
    )


class Diverged(Fix):
    """A finding rather than a fix: the weights diverged over the updates before the
    failing step (:class:`Divergence`), so no change to that one step can repair the
    run. The replay runs the step as it is."""

    kind = FixKind.DIVERGED

    def __init__(self, divergence: Divergence):
        super().__init__()
        self.divergence = divergence
        #: the advice as code, as far as the replays over steps verified it (set by the
        #: diagnosis: :func:`.advice.advice_code`); ``None``: the usual remedies
        self.code: str | None = None

    def describe(self) -> str:
        return (
            "none possible on this step: the weights diverged over the updates from step "
            f"{self.divergence.began}"
        )

    def snippet(self) -> str:
        if self.code is not None:
            return self.code
        d = self.divergence
        lr = d.band.lr
        lr_line = (
            f"for g in optimizer.param_groups:\n    g['lr'] = {lr * 0.1:.3g}  "
            f"# x0.1 the healthy {fmt_num(lr)}; cap a warm-up schedule there\n"
            if lr is not None and math.isfinite(lr)
            else ""
        )
        clip = fmt_num(d.band.grad_norm)
        return (
            f"# resume from a checkpoint before step {d.began}, then:\n{lr_line}"
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip})  "
            "# before optimizer.step()"
        )
