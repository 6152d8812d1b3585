"""What to change in a run whose weights diverged, said only as far as the replays over
steps verified it: the changes that kept the run healthy, those that did not, and, where no
replay could check one, the usual remedies and the optimizer's out-of-range
hyper-parameters (:mod:`.hyper`) labelled unverified. In words (:func:`advice`) and as code
(:func:`advice_code`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...core.text import fmt_num
from .divergence import Divergence
from .hyper import OddHyper
from .interventions import FIXES, Intervention, StepsReplay

if TYPE_CHECKING:
    from .over_steps import OverSteps

__all__ = ["advice", "advice_code", "replayed", "tried"]


def tried(over: OverSteps | None) -> list[StepsReplay]:
    """The replays over steps that change the run (fixes) and ran."""
    if over is None:
        return []
    return [r for r in over.replays if r.intervention in FIXES and r.ran and r.error is None]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _usual(div: Divergence, odd: list[OddHyper]) -> str:
    """The usual remedies, unverified: the out-of-range hyper-parameters first; clipping
    only where no weight decay is out of range (the decay is added after clipping)."""
    out = [f"set {o.key}={o.sane:g} instead of {o.value:g}" for o in odd]
    out.append("lower the learning rate (or cap its warm-up)")
    if not any(o.key == "weight_decay" for o in odd):
        out.append(f"clip the gradient norm at the healthy {fmt_num(div.band.grad_norm)}")
    return " or ".join(out)


def _do(r: StepsReplay, div: Divergence, odd: list[OddHyper]) -> str:
    """What a replay that kept the run healthy asks of the user, as an imperative."""
    kind = r.intervention
    if kind is Intervention.LOWER_LR:
        return "lower the learning rate (or cap its warm-up)"
    if kind is Intervention.CLIP_GRAD:
        return f"clip the gradient norm at the healthy {fmt_num(div.band.grad_norm)}"
    if kind is Intervention.HYPERPARAMETERS:
        return "set " + _join([f"{o.key}={o.sane:g}" for o in odd])
    if kind is Intervention.RESET_MOMENTS:
        return "reset the optimizer's moments"
    return "leave out the failing batch"


def advice(div: Divergence, over: OverSteps | None, odd: list[OddHyper]) -> str:
    """The clauses that follow the divergence's statement (each starts with ``"; "``):
    the out-of-range hyper-parameters as facts, then what the replays over steps verified,
    or, without them, the usual remedies labelled unverified; ends with a full stop."""
    resume = f"resume from a checkpoint before step {div.began}"
    facts = "".join(f"; {o.why}" for o in odd)
    ran = tried(over)
    unverified = f"unverified, the usual remedies: {_usual(div, odd)}, then {resume}."
    if over is None or not ran:
        return (
            f"{facts}; no replay over steps verified a change (a snapshot written with "
            f"NaNGuard(rewind=K) lets diagnose try them); {unverified}"
        )
    works = [r for r in ran if r.counts]
    fails = [r.change for r in ran if not r.counts]
    last = over.failing_step + over.k
    if works:
        verb = "keeps" if len(works) == 1 else "keep"
        said = f", while {_join(fails)} {'does' if len(fails) == 1 else 'do'} not" if fails else ""
        do = " or ".join(_do(r, div, odd) for r in works)
        return (
            f"{facts}; the replays over steps show that {_join([r.change for r in works])} "
            f"{verb} the run finite and inside the healthy band through step {last}{said}: "
            f"{do}, and {resume}."
        )
    none = f"; none of the changes replayed over steps ({_join(fails)}) kept the run healthy"
    if div.began <= over.start_step:
        return (
            f"{facts}{none}, but they start from step {over.start_step}, after the divergence "
            f"began at step {div.began} (a larger NaNGuard(rewind=K) reaches further back); "
            f"{unverified}"
        )
    hyper = any(r.intervention is Intervention.HYPERPARAMETERS for r in ran)
    left = [] if hyper else [f"{o.key}={o.sane:g}" for o in odd]
    hint = f"; unverified: {_join(left)}" if left else ""
    finite = [r for r in ran if r.finite]
    if finite:
        leads = " or ".join(_lead(r, div, odd) for r in finite)
        hint = (
            f"; only {_join([r.change for r in finite])} kept it finite, outside the healthy "
            f"band: {leads} is the lead, unverified{hint}"
        )
    return (
        f"{facts}{none} through step {last}{hint}: find what drives the growth before you {resume}."
    )


def _lead(r: StepsReplay, div: Divergence, odd: list[OddHyper]) -> str:
    """The direction a replay that stayed finite but outside the band points in."""
    further = {
        Intervention.LOWER_LR: "lower the learning rate by more than x0.1",
        Intervention.CLIP_GRAD: f"clip the gradient norm below {fmt_num(div.band.grad_norm)}",
    }
    return further.get(r.intervention) or _do(r, div, odd)


def replayed(over: OverSteps | None) -> str:
    """What the replays over steps showed, as one clause (no leading separator, no full
    stop): the changes that kept the run healthy and those that did not, or that none
    did, or that there were none."""
    ran = tried(over)
    if over is None or not ran:
        return (
            "no replay over steps tried a change (a snapshot written with NaNGuard(rewind=K) "
            "lets diagnose try them)"
        )
    works = [r.change for r in ran if r.counts]
    fails = [r.change for r in ran if not r.counts]
    last = over.failing_step + over.k
    if not works:
        return (
            f"none of the changes replayed over steps ({_join(fails)}) kept the run finite and "
            f"inside the healthy band through step {last}"
        )
    verb = "keeps" if len(works) == 1 else "keep"
    said = f", while {_join(fails)} {'does' if len(fails) == 1 else 'do'} not" if fails else ""
    return (
        f"the replays over steps show that {_join(works)} {verb} the run finite and inside the "
        f"healthy band through step {last}{said}"
    )


def _lr_line(div: Divergence) -> str:
    lr = div.band.lr
    if lr is None or not math.isfinite(lr):
        return "for g in optimizer.param_groups:\n    g['lr'] *= 0.1"
    return (
        f"for g in optimizer.param_groups:\n    g['lr'] = {lr * 0.1:.3g}  "
        f"# x0.1 the healthy {fmt_num(lr)}; cap a warm-up schedule there"
    )


def _clip_line(div: Divergence) -> str:
    return (
        "torch.nn.utils.clip_grad_norm_(model.parameters(), "
        f"max_norm={fmt_num(div.band.grad_norm)})  # before optimizer.step()"
    )


def _code_of(r: StepsReplay, div: Divergence, odd: list[OddHyper]) -> list[str]:
    kind = r.intervention
    if kind is Intervention.LOWER_LR:
        return [_lr_line(div)]
    if kind is Intervention.CLIP_GRAD:
        return [_clip_line(div)]
    if kind is Intervention.HYPERPARAMETERS:
        return [o.code() for o in odd]
    if kind is Intervention.RESET_MOMENTS:
        return ["optimizer.state.clear()  # the moments restarted"]
    return [f"# {r.change}"]


def advice_code(div: Divergence, over: OverSteps | None, odd: list[OddHyper]) -> str:
    """The advice as code: the changes the replays over steps verified; without them, the
    usual remedies under an ``unverified`` comment."""
    head = f"# resume from a checkpoint before step {div.began}, then:"
    ran = tried(over)
    works = [r for r in ran if r.counts]
    if works:
        if len(works) > 1:
            head += "  (each of these kept the run healthy in the replays)"
        return "\n".join([head, *(line for r in works for line in _code_of(r, div, odd))])
    if ran:
        fails = _join([r.change for r in ran])
        hyper = any(r.intervention is Intervention.HYPERPARAMETERS for r in ran)
        left = [] if hyper else [o.code() + " (unverified)" for o in odd]
        leads = [f"# lead, unverified: {_lead(r, div, odd)}" for r in ran if r.finite]
        head = f"# none of the replayed changes kept the run healthy: {fails}"
        return "\n".join([head, *leads, *left])
    lines = [o.code() for o in odd] + [_lr_line(div)]
    if not any(o.key == "weight_decay" for o in odd):
        lines.append(_clip_line(div))
    return "\n".join([head, "# unverified (no replay over steps): the usual remedies", *lines])
