"""What each counterfactual replay over steps runs (:mod:`.over_steps`): the window's
steps turned into batches on the model's device, and one :class:`Plan` per
:class:`~.interventions.Intervention`.

From the window's first state (``start_step``) every plan replays the window's steps
through the failing step and ``k`` steps beyond it: the window's own steps after the
failure where it holds any, else the failing batch repeated (with the failing step's RNG
and learning rate). A window whose batches were not all stored replays the failing batch
only, from the failing step's own state (the earlier-state test still runs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.batch import named_tensors
from ...core.snapshot import ResolvedStep
from ...core.snapshot.data import to_device
from ...core.snapshot.replay import StepModule, rebuild_batch
from ...core.snapshot.rewind import RewindStep, RewindWindow
from ...core.state import RngState
from ...core.stats import has_nonfinite, is_finite_number
from ...core.text import fmt_num
from .divergence import Divergence
from .hyper import OddHyper
from .interventions import Intervention
from .result import Reference

__all__ = ["LR_FACTOR", "Plan", "PlannedStep", "Prepared", "has_moments", "plans", "prepare"]

#: The learning-rate intervention's factor.
LR_FACTOR = 0.1


@dataclass
class PlannedStep:
    """One update of a replay: the step it stands for, its batch (on the model's device,
    as the replayed model takes it), the RNG states it starts from, the learning rates."""

    step: int
    inputs: Any
    target: Any
    rng: RngState | None
    lr: list[float]


@dataclass
class Plan:
    """One replay over steps: from which state (``rewind``: the window's first; else the
    failing step's own), which updates, and what is changed."""

    intervention: Intervention
    change: str
    start_step: int
    rewind: bool
    steps: list[PlannedStep] = field(default_factory=list)
    checked_from: int = 0
    lr_held: list[float] | None = None
    clip: float | None = None
    reset_moments: bool = False
    skipped: str | None = None
    note: str = ""
    groups: dict[int, dict[str, float]] = field(default_factory=dict)  # group -> key -> value


@dataclass
class Prepared:
    """The window's steps as replayable updates."""

    window: RewindWindow
    failing: PlannedStep
    before: list[PlannedStep]  # the window's steps before the failing one (stored ones)
    beyond: list[PlannedStep]  # k updates after it
    bad: list[int]  # the failing batches' steps (recorded non-finite, and the failing one)
    complete: bool  # every batch before the failing step is stored
    repeated: bool  # ``beyond`` repeats the failing batch
    bad_batch: bool  # the failing batch itself holds NaN/Inf


def _finite(v: object) -> bool:
    return v is None or is_finite_number(v)


def _batch(src: ResolvedStep, model: torch.nn.Module, s: RewindStep) -> tuple[Any, Any]:
    """A stored window batch as the replayed model takes it (the trainer's batch form for
    a step whose loss the trainer's code computed, as the snapshot's own batch is)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs, target = to_device(s.inputs, device), to_device(s.target, device)
    if isinstance(model, StepModule):
        form = getattr(src.snapshot, "loss_source", None) or {}
        batch = rebuild_batch(form.get("batch"), inputs, target)
        if isinstance(batch, list) and model.pack != "list":
            batch = tuple(batch)
        return batch, None
    return inputs, target


def prepare(src: ResolvedStep, model: torch.nn.Module, window: RewindWindow, k: int) -> Prepared:
    """The window's steps as updates: the failing one (the snapshot's own batch and the
    step's RNG and learning rates), those before it (stored batches only) and ``k``
    beyond it."""
    if not window.steps:
        raise ValueError("the rewind window holds no steps: expected start_step .. the failure.")
    fail_at = src.step if src.step is not None else window.steps[-1].step
    idx = next((i for i, s in enumerate(window.steps) if s.step == fail_at), None)
    if idx is None:
        held = f"{window.steps[0].step}..{window.steps[-1].step}"
        raise ValueError(
            f"the rewind window holds steps {held}; expected the failing step {fail_at} in it."
        )
    f = window.steps[idx]
    failing = PlannedStep(f.step, src.inputs, src.target, f.rng, list(f.lr))
    before = [
        PlannedStep(s.step, *_batch(src, model, s), s.rng, list(s.lr))
        for s in window.steps[:idx]
        if s.stored
    ]
    after = [
        PlannedStep(s.step, *_batch(src, model, s), s.rng, list(s.lr))
        for s in window.steps[idx + 1 :]
        if s.stored
    ][:k]
    repeated = len(after) < k
    for i in range(len(after), k):
        after.append(PlannedStep(fail_at + i + 1, failing.inputs, failing.target, f.rng, f.lr))
    bad = [s.step for s in window.steps[:idx] if not (_finite(s.loss) and _finite(s.grad_norm))]
    tensors = [t for _, t in named_tensors((src.inputs, src.target))]
    return Prepared(
        window=window,
        failing=failing,
        before=before,
        beyond=after,
        bad=[*bad, fail_at],
        complete=len(before) == idx,
        repeated=repeated,
        bad_batch=any(has_nonfinite(t) for t in tensors),
    )


def _healthy_lr(p: Prepared, div: Divergence | None) -> tuple[list[float], str]:
    """The learning rates of the last healthy step in the window (before the divergence
    began, else before the failing step), and where they come from."""
    began = div.began if div is not None else p.failing.step
    steps = [s for s in p.window.steps if s.step < began and s.lr]
    if steps:
        return list(steps[-1].lr), f"the last healthy, step {steps[-1].step}'s"
    first = p.window.steps[0]
    return list(first.lr or p.failing.lr), f"the window's first, step {first.step}'s"


def _relabel(s: PlannedStep, step: int, lr: list[float] | None = None) -> PlannedStep:
    return PlannedStep(step, s.inputs, s.target, s.rng, list(s.lr if lr is None else lr))


def _skip_plan(p: Prepared) -> Plan:
    """The window without its failing batch(es); beyond the failure the window's healthy
    batches again, in order (the data the run would see next is not known)."""
    bad = set(p.bad)
    kept = [s for s in p.before if s.step not in bad]
    which = ", ".join(map(str, p.bad))
    plan = Plan(
        Intervention.SKIP_BATCH,
        f"skipping the failing batch{'es' if len(p.bad) > 1 else ''} (step {which})",
        p.window.start_step,
        rewind=True,
        checked_from=len(kept),
    )
    if not p.complete:
        plan.skipped = "the window's batches were not stored: no other batch to train on"
        return plan
    if not kept:
        plan.skipped = "the window holds no healthy batch to train on instead"
        return plan
    cycle = itertools.cycle(kept)
    beyond = [_relabel(next(cycle), s.step, s.lr) for s in p.beyond]
    plan.steps = kept + beyond
    plan.note = "beyond the failure: the window's healthy batches again"
    return plan


def has_moments(state: dict[str, Any] | None) -> bool:
    """Whether an optimizer ``state_dict()`` holds moments (tensors besides ``step``)."""
    per_param = (state or {}).get("state") or {}
    return any(
        isinstance(v, torch.Tensor) and key != "step"
        for st in per_param.values()
        for key, v in st.items()
    )


def plans(
    p: Prepared,
    ref: Reference,
    div: Divergence | None,
    failing_moments: bool,
    odd: list[OddHyper] | None = None,
) -> list[Plan]:
    """One plan per intervention (see the module docstring); ``failing_moments``: the
    failing step's optimizer state holds moments; ``odd``: the optimizer's hyper-parameters
    outside their usual range (a plan with usual values, only where there are some)."""
    start = p.window.start_step
    run = [*p.before, p.failing, *p.beyond] if p.complete else [p.failing, *p.beyond]
    rewind = p.complete
    at = start if rewind else p.failing.step
    checked = len(p.before) if rewind else 0
    held, where = _healthy_lr(p, div)
    low = [LR_FACTOR * v for v in held]
    out: list[Plan] = []
    if rewind:
        out.append(
            Plan(Intervention.PLAIN, "the window replayed as it ran", at, True, run, checked)
        )
    lr = Plan(Intervention.LOWER_LR, "", at, rewind, run, checked, lr_held=low)
    lr.change = (
        f"a learning rate x{LR_FACTOR:g} held at {fmt_num(low[0] if low else None)} "
        f"(x{LR_FACTOR:g} {where} {fmt_num(held[0] if held else None)})"
    )
    if not low:
        lr.skipped = "the window recorded no learning rate"
    out.append(lr)
    clip = Plan(Intervention.CLIP_GRAD, "", at, rewind, run, checked, clip=ref.grad_norm)
    clip.change = f"clipping the gradient norm at {fmt_num(ref.grad_norm)} (the healthy median)"
    if ref.grad_norm is None or not ref.grad_norm > 0:
        clip.skipped = "the history holds no healthy gradient norm to clip at"
    out.append(clip)
    out.append(_skip_plan(p))
    # the two tests of where the failure lies are one step each (PaLM's, Megatron's)
    earlier = [_relabel(p.failing, start, p.window.steps[0].lr or p.failing.lr)]
    change = f"the failing batch on the state of step {start}"
    out.append(Plan(Intervention.EARLIER_STATE, change, start, True, earlier))
    change = "the failing step rerun on its own state"
    out.append(Plan(Intervention.SAME_STATE, change, p.failing.step, False, [p.failing]))
    reset = Plan(
        Intervention.RESET_MOMENTS,
        f"the optimizer's moments reset at step {at}",
        at,
        rewind,
        run,
        checked,
        reset_moments=True,
    )
    if not (has_moments(p.window.optimizer_state) if rewind else failing_moments):
        reset.skipped = "the optimizer keeps no moments to reset"
    out.append(reset)
    if odd:
        change = ", ".join(o.change() for o in odd)
        hyper = Plan(Intervention.HYPERPARAMETERS, change, at, rewind, run, checked)
        for o in odd:
            hyper.groups.setdefault(o.group, {})[o.key] = o.sane
        out.append(hyper)
    return out
