"""What the guard decides on a :class:`~nbdebug.core.guard.reading.StepReading`: fail or
go on (:class:`Verdict`, made by :class:`Decider`, which keeps the GradScaler streak), and
the one-sentence message of a failure (:func:`failure_message`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..text import fmt_num
from ..vocab import FailureKind
from .options import ScalerOptions
from .reading import StepMeter, StepReading

__all__ = ["Decider", "Verdict", "failure_message", "failure_reason"]


@dataclass
class Verdict:
    """The guard's decision on one :class:`StepReading`.

    Attributes
    ----------
    reading : StepReading
        What the decision acted on (on a bad step with the weight norm measured).
    kind : FailureKind or None
        The failure, or ``None`` (go on and step); ``"rank"``: another rank's values were
        not finite (distributed).
    scaler_skip : bool
        The GradScaler skips this overflow step itself (not a failure).
    detail : dict
        On a non-finite reading: the element-wise look (``nonfinite_weights``,
        ``nonfinite_grads``, ``grad_norms``, ``param_norms``) and ``message_extra``.
    """

    reading: StepReading
    kind: FailureKind | None = None
    scaler_skip: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    def look(self, meter: StepMeter) -> FailureKind | None:
        """The element-wise look at the reading (its detail); on a bad step the weight norm
        is measured too. Returns the kind the look found."""
        kind, self.detail = meter.inspect(self.reading)
        if self.reading.param_norm is None:
            norms = self.detail["param_norms"].values()
            pnorm = math.sqrt(sum(v * v for v in norms))
            self.reading = dataclasses.replace(self.reading, param_norm=pnorm)
        return kind


class Decider:
    """Fail, or go on: what is not finite (an element-wise look only on a non-finite
    reading) and the GradScaler rules (an overflow the scaler skips is no failure until
    ``scaler_patience`` in a row or a scale below ``min_scale``).

    Attributes
    ----------
    scaler_streak : int
        Overflow steps the scaler skipped in a row.
    """

    def __init__(self, rules: ScalerOptions) -> None:
        self.rules = rules
        self.scaler_streak = 0

    def decide(self, reading: StepReading, meter: StepMeter) -> Verdict:
        """The verdict on ``reading``; updates the scaler streak. Distributed
        (``reading.ranks`` set): a step that another rank found non-finite fails here too,
        ``kind="rank"``; ``detail["distributed"]`` says who saw what (the snapshot's
        distributed fields)."""
        verdict = Verdict(reading=reading)
        if not reading.finite:
            verdict.kind = verdict.look(meter)
        self._scaler_rules(verdict, reading.scale)
        ranks = reading.ranks
        if ranks is not None and ranks.any_bad:  # another rank (or this one) was not finite
            if verdict.kind is None:
                verdict.look(meter)
                verdict.detail["message_extra"] = ranks.message(reading.step)
                verdict.kind = FailureKind.RANK
            verdict.detail["distributed"] = ranks.record(list(meter.model.named_parameters()))
        return verdict

    def _scaler_rules(self, verdict: Verdict, scale: float | None) -> None:
        rules = self.rules
        if verdict.kind == FailureKind.GRAD and scale is not None:
            # the scaler sees the inf/NaN gradients and skips this update itself
            verdict.kind = None
            verdict.scaler_skip = True
            self.scaler_streak += 1
            if self.scaler_streak >= rules.scaler_patience:
                verdict.kind = FailureKind.SCALE
                verdict.detail["message_extra"] = f"{self.scaler_streak} overflow steps in a row"
        elif scale is not None:
            self.scaler_streak = 0
        if verdict.kind is None and scale is not None and scale < rules.min_scale:
            verdict.kind = FailureKind.SCALE
            verdict.detail["message_extra"] = (
                f"the scale fell to {fmt_num(scale, none='None')} (< min_scale={rules.min_scale:g})"
            )


def _listing(d: dict[str, dict[str, int]]) -> str:
    items = [f"{n} ({v['nan']} NaN, {v['inf']} Inf)" for n, v in list(d.items())[:5]]
    more = f" and {len(d) - 5} more" if len(d) > 5 else ""
    return ", ".join(items) + more


def failure_message(
    kind: FailureKind, step: int, loss: float | None, detail: dict[str, Any]
) -> str:
    """The one-sentence message of a failure of ``kind`` at ``step``."""
    if kind == FailureKind.WEIGHTS:
        return f"non-finite weights at step {step}: {_listing(detail['nonfinite_weights'])}"
    if kind == FailureKind.LOSS:
        grads = detail["nonfinite_grads"]
        tail = f"; non-finite gradients in {_listing(grads)}" if grads else ""
        return f"non-finite loss ({fmt_num(loss, none='None')}) at step {step}{tail}"
    if kind == FailureKind.GRAD:
        with_loss = (
            "with no loss given to the guard"
            if loss is None
            else f"with a finite loss ({fmt_num(loss)})"
        )
        return (
            f"non-finite gradients at step {step} {with_loss}: "
            f"{_listing(detail['nonfinite_grads'])}"
        )
    if kind == FailureKind.RANK:
        return str(detail.get("message_extra", ""))
    return f"GradScaler scale collapsing at step {step}: {detail.get('message_extra', '')}"


def failure_reason(
    verdict: Verdict, action: str
) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """The failure's message, the snapshot's ``reason`` (``action``: ``on_nonfinite``)
    and the distributed record."""
    kind, detail, reading = verdict.kind, verdict.detail, verdict.reading
    assert kind is not None
    message = failure_message(kind, reading.step, reading.loss, detail)
    detail.pop("message_extra", None)
    distributed = detail.pop("distributed", None)  # snapshot fields of their own
    if distributed is not None and kind != FailureKind.RANK:
        message += (
            f" (rank {distributed['rank']} of {distributed['world_size']}; culprit rank(s) "
            f"{distributed['culprit_ranks']}: every rank skips this step)"
        )
    reason: dict[str, Any] = {
        "kind": kind,
        "message": message,
        "step": reading.step,
        "loss": reading.loss,
        "grad_norm": reading.grad_norm,
        "param_norm": reading.param_norm,
        "scale": reading.scale,
        "action": action,
        **detail,
    }
    return message, reason, distributed
