"""The counterfactual replays over steps (:mod:`.over_steps`): their vocabularies
(:class:`Intervention`, :class:`Verdict`), what one replay measured (:class:`StepsReplay`),
the healthy band it is held to, and which verdict each replay supports.

A replay *counts* when the run stays finite and its loss and gradient norm stay inside
the healthy band (robust median + ``BAND_Z`` MADs of the steps before the divergence
began, :func:`.divergence.band`) from the failing step through the ``k`` steps beyond it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...core.text import fmt_num
from ...core.vocab import Vocab
from .divergence import DIVERGE_Z
from .result import Reference

__all__ = ["BAND_Z", "Intervention", "StepsReplay", "Verdict", "in_band", "supports", "verdict"]

#: A step is inside the healthy band when its loss and its gradient norm are at most this
#: many robust sigmas (MADs) above the band's medians (the divergence's own threshold).
BAND_Z = DIVERGE_Z


class Intervention(Vocab):
    """What a replay over steps changes (:attr:`StepsReplay.intervention`)."""

    PLAIN = "plain"  # the window replayed as it ran
    LOWER_LR = "lower_lr"  # lr x0.1, the schedule held at its last healthy value
    CLIP_GRAD = "clip_grad"  # the gradient norm clipped at the healthy band's median
    SKIP_BATCH = "skip_batch"  # the failing batch(es) left out
    EARLIER_STATE = "earlier_state"  # the failing batch on the window's first state
    SAME_STATE = "same_state"  # the failing step rerun on its own recorded state
    RESET_MOMENTS = "reset_moments"  # the optimizer's moments reset at the window's start
    HYPERPARAMETERS = "hyperparameters"  # out-of-range momentum / weight decay set to usual


class Verdict(Vocab):
    """What kind of failure the replays over steps point at (:attr:`StepsReplay.supports`,
    :attr:`OverSteps.verdict`)."""

    DATA = "data"  # the failing batch breaks a healthy state too
    DATA_X_STATE = "data x state"  # harmless earlier, fatal with this state (PaLM)
    NUMERICS = "numerics"  # a finite batch turns non-finite on a healthy state too
    OPTIMISATION = "optimisation"  # the updates diverged (lr, clipping, moments)
    TRANSIENT = "transient"  # the same step on the same state replays finite


#: Replays that change the run (fixes); the others are tests of where the failure lies.
FIXES = (
    Intervention.LOWER_LR,
    Intervention.CLIP_GRAD,
    Intervention.SKIP_BATCH,
    Intervention.RESET_MOMENTS,
    Intervention.HYPERPARAMETERS,
)


@dataclass
class StepsReplay:
    """One counterfactual replay over steps.

    Attributes
    ----------
    intervention : Intervention
    change : str
        What was changed, in words.
    start_step : int
        The step whose start state the replay begins from (the window's first, or the
        failing step for ``same_state``).
    steps : list of int
        The step each replayed update stands for (beyond the failure: ``failing + i``).
    loss, grad_norm : list of float
        Per replayed step (NaN/Inf kept; the gradient norm the update used, after
        clipping). The replay stops at its first non-finite step.
    checked_from : int
        Index into ``steps`` from which the band applies (the failing step's place).
    finite : bool
        Every replayed step was finite, and all planned steps ran.
    in_band : bool or None
        Every checked step's loss and gradient norm inside the healthy band (``None``:
        the history holds no healthy band).
    supports : Verdict or None
        The verdict this replay supports (set once all replays ran).
    note : str
    skipped : str or None
        Why the replay did not run.
    error : str or None
        What the replay raised.
    """

    intervention: Intervention
    change: str
    start_step: int
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    checked_from: int = 0
    finite: bool = False
    in_band: bool | None = None
    supports: Verdict | None = None
    note: str = ""
    skipped: str | None = None
    error: str | None = None

    @property
    def ran(self) -> bool:
        return self.skipped is None and bool(self.steps)

    @property
    def counts(self) -> bool:
        """The run stayed finite and (where there is a band) inside the healthy band."""
        return self.ran and self.error is None and self.finite and self.in_band is not False

    def outcome(self) -> str:
        """``"finite, inside the band"``, ``"non-finite at step 7"``, ..."""
        if self.skipped is not None:
            return f"not replayed: {self.skipped}"
        if self.error is not None:
            return f"raised: {self.error}"
        if not self.finite:
            bad = [s for s, a, b in zip(self.steps, self.loss, self.grad_norm) if not _ok(a, b)]
            return f"non-finite at step {bad[0]}" if bad else "non-finite"
        if self.in_band is None:
            return "finite (no healthy band to compare with)"
        return "finite, inside the healthy band" if self.in_band else "finite, outside the band"

    def __repr__(self) -> str:
        last = self.steps[-1] if self.steps else self.start_step
        return (
            f"StepsReplay({self.intervention}: {self.change}; steps {self.start_step}..{last}: "
            f"{self.outcome()}; supports {self.supports or '-'})"
        )


def _ok(loss: float, grad: float) -> bool:
    return math.isfinite(loss) and math.isfinite(grad)


def in_band(loss: Sequence[float], grad: Sequence[float], ref: Reference) -> bool | None:
    """Every (loss, grad norm) pair at most ``BAND_Z`` MADs above the band's medians;
    ``None`` when ``ref`` holds no band."""
    if ref.loss is None or ref.grad_norm is None:
        return None
    loss_top = ref.loss + BAND_Z * (ref.loss_mad or 0.1 * abs(ref.loss))
    grad_top = ref.grad_norm + BAND_Z * (ref.grad_norm_mad or 0.1 * abs(ref.grad_norm))
    return all(a <= loss_top and b <= grad_top for a, b in zip(loss, grad))


def band_text(ref: Reference) -> str:
    """``"loss <= 1.2, grad norm <= 40"``: the band's upper edges, for the notes."""
    if ref.loss is None or ref.grad_norm is None:
        return "no healthy band"
    lt = ref.loss + BAND_Z * (ref.loss_mad or 0.1 * abs(ref.loss))
    gt = ref.grad_norm + BAND_Z * (ref.grad_norm_mad or 0.1 * abs(ref.grad_norm))
    return f"loss <= {fmt_num(lt)}, grad norm <= {fmt_num(gt)}"


def supports(
    r: StepsReplay,
    replays: Sequence[StepsReplay],
    *,
    bad_batch: bool,
    healthy_start: bool,
    spike: bool = False,
) -> Verdict | None:
    """The verdict replay ``r`` supports, given the others (``bad_batch``: the failing
    batch holds NaN/Inf itself; ``healthy_start``: the window's first state lies before the
    divergence began, so the earlier-state test means something; ``spike``: the failing
    step is a spike, finite by design, so a finite re-run of it is no transient fault)."""
    if not r.ran or r.error is not None:
        return None
    kind = r.intervention
    if kind in (Intervention.PLAIN, Intervention.SAME_STATE) and spike:
        return None
    if kind in (Intervention.PLAIN, Intervention.SAME_STATE):
        # the failure did not come back: finite and (where there is a band) healthy; a
        # finite replay outside the band reproduces a spike or a divergence
        return Verdict.TRANSIENT if r.counts else None
    if kind is Intervention.EARLIER_STATE:
        if not healthy_start:
            return None
        if r.counts:
            return Verdict.DATA_X_STATE
        if r.finite:
            # the batch does not break the earlier state (finite), nor is it harmless there
            # (outside the band): it tells neither the data nor the numerics apart
            return None
        return Verdict.DATA if bad_batch else Verdict.NUMERICS
    if not r.counts:
        return None
    if kind is Intervention.SKIP_BATCH:  # the batch alone (the earlier-state test), or with
        earlier = next((x for x in replays if x.intervention is Intervention.EARLIER_STATE), None)
        said = None
        if earlier is not None:
            said = supports(
                earlier, replays, bad_batch=bad_batch, healthy_start=healthy_start, spike=spike
            )
        if said in (Verdict.DATA, Verdict.NUMERICS):
            return said
        return Verdict.DATA if bad_batch else Verdict.DATA_X_STATE
    return Verdict.OPTIMISATION


def verdict(replays: Sequence[StepsReplay], *, diverged: bool) -> Verdict | None:
    """The overall verdict: transient when the same step on the same state replays
    finite; data (or numerics) when the failing batch breaks the earlier, healthy state
    too; optimisation when lowering the learning rate, clipping or resetting the moments
    keeps the run healthy (and skipping the batch does not, or the history shows a
    divergence); data x state when skipping the batch does; else ``None``."""
    said = {r.intervention: r.supports for r in replays}
    if said.get(Intervention.SAME_STATE) is Verdict.TRANSIENT:
        return Verdict.TRANSIENT
    if said.get(Intervention.EARLIER_STATE) in (Verdict.DATA, Verdict.NUMERICS):
        return said[Intervention.EARLIER_STATE]
    optim = any(said.get(k) is Verdict.OPTIMISATION for k in FIXES)
    skip = said.get(Intervention.SKIP_BATCH)
    if optim and (skip is None or diverged):
        return Verdict.OPTIMISATION
    if skip is not None:
        return skip
    return Verdict.OPTIMISATION if optim else None
