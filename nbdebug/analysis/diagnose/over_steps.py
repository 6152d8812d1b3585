"""Counterfactual replays over steps: the run replayed from a rewind window (the state
``K`` steps before the failure and every step since, :class:`~nbdebug.core.snapshot.rewind.
RewindWindow`) through the failing step and ``k`` steps beyond it, once as it ran and once
per intervention (:class:`~.interventions.Intervention`: a learning rate x0.1 held at its
last healthy value, clipping at the healthy gradient norm, skipping the failing batch, the
failing batch on the earlier state, the same step on the same state, the optimizer's
moments reset), and the verdict the replays support (:class:`~.interventions.Verdict`).

Each replay runs on copies of the model and optimizer (never the caller's), one training
step at a time with the step's own RNG states and learning rates (:func:`.workbench.
training_step`, the same forward, loss and update as the single-step replays); the
caller's RNG states are put back afterwards.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...core.guard.history import HistoryRow
from ...core.snapshot import ResolvedStep, replay_contexts
from ...core.snapshot.rewind import RewindWindow
from ...core.state import RngState
from ...core.text import first_line
from ...core.vocab import FailureKind
from .divergence import Divergence, band, find_divergence
from .fix import Replay
from .hyper import odd_hyperparameters
from .interventions import FIXES, Intervention, StepsReplay, Verdict, band_text, in_band
from .interventions import supports as supported
from .interventions import verdict as overall
from .replay_plans import Plan, PlannedStep, Prepared, has_moments, plans, prepare
from .result import Reference
from .workbench import copy_training, training_step

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["NO_WINDOW", "STEPS_BEYOND", "OverSteps", "over_steps_of", "replay_window"]

#: ``k``, the steps replayed beyond the failing one, unless ``diagnose(..., steps=k)``.
STEPS_BEYOND = 3
#: The sentence of a snapshot written without a rewind window.
NO_WINDOW = "replays over steps need a rewind window: NaNGuard(..., rewind=K)."
#: The healthy band holds at most this many steps.
_BAND = 20

_WHY = {
    Verdict.DATA: "the failing batch breaks the earlier, healthy state too: the data alone",
    Verdict.NUMERICS: (
        "the failing batch, finite itself, turns non-finite on the earlier, healthy state too: "
        "an operation that cannot take these values"
    ),
    Verdict.DATA_X_STATE: (
        "the failing batch is harmless on the earlier state and the run stays healthy without "
        "it: this data with this state (as PaLM's loss spikes)"
    ),
    Verdict.OPTIMISATION: "the updates diverged",
    Verdict.TRANSIENT: (
        "the same step rerun on the same state is finite: a transient fault (hardware, a race, "
        "non-determinism), not the data or the weights"
    ),
}


@dataclass
class OverSteps:
    """The counterfactual replays over steps of one failure.

    Attributes
    ----------
    replays : list of StepsReplay
        One per intervention, the plain replay first.
    verdict : Verdict or None
        ``data``, ``data x state``, ``numerics``, ``optimisation`` or ``transient``
        (``None``: no replay told them apart).
    start_step, failing_step : int
        The window's first step and the failing one.
    k : int
        The steps replayed beyond the failing one.
    band : Reference
        The healthy band (median and MAD of loss and gradient norm of the steps before the
        divergence began, else before the failure).
    notes : list of str
    began : int or None
        The step the divergence began, when the history shows one (:func:`.divergence.
        find_divergence`).
    """

    replays: list[StepsReplay]
    verdict: Verdict | None
    start_step: int
    failing_step: int
    k: int
    band: Reference = field(default_factory=Reference)
    notes: list[str] = field(default_factory=list)
    began: int | None = None

    @property
    def ok(self) -> bool:
        """The run replayed as it ran (or the same step rerun) stays finite and healthy."""
        return any(
            r.counts
            for r in self.replays
            if r.intervention in (Intervention.PLAIN, Intervention.SAME_STATE)
        )

    def replay(self, which: str) -> StepsReplay:
        """The replay of intervention ``which`` (``"lower_lr"``, ...)."""
        for r in self.replays:
            if r.intervention == which:
                return r
        raise KeyError(
            f"no replay {which!r}; the replays are {[str(r.intervention) for r in self.replays]}."
        )

    def summary(self) -> str:
        """The verdict in one sentence, with the fixes that keep the run healthy and those
        that do not."""
        last = self.failing_step + self.k
        fixes = [r for r in self.replays if r.intervention in FIXES and r.ran]
        works = [r.change for r in fixes if r.counts]
        fails = [r.change for r in fixes if not r.counts]
        if self.verdict is None and self.began is not None and self.began <= self.start_step:
            head = (
                f"No replay over steps told the cause apart: the divergence began at step "
                f"{self.began}, before the window's first step {self.start_step}, so every "
                "replay starts from weights already diverging (a larger rewind=K reaches further "
                "back)"
            )
        elif self.verdict is None:
            head = "No replay over steps told the cause apart"
        else:
            head = f"Verdict {self.verdict}: {_WHY[self.verdict]}"
        if works:
            verb = "keeps" if len(works) == 1 else "keep"
            head += (
                f"; {_join(works)} {verb} the run finite and inside the healthy band "
                f"through step {last}"
            )
        if fails:
            head += f"; {_join(fails)} {'does' if len(fails) == 1 else 'do'} not"
        return head + "."

    def to_frame(self) -> pd.DataFrame:
        """One row per replay: ``intervention``, ``change``, ``start_step``, ``steps``,
        ``finite``, ``in_band``, ``counts``, ``supports``, ``loss``, ``grad_norm`` (the
        last replayed step's), ``outcome``, ``note``."""
        import pandas as pd

        rows = [
            {
                "intervention": str(r.intervention),
                "change": r.change,
                "start_step": r.start_step,
                "steps": len(r.steps),
                "finite": r.finite,
                "in_band": r.in_band,
                "counts": r.counts,
                "supports": None if r.supports is None else str(r.supports),
                "loss": r.loss[-1] if r.loss else math.nan,
                "grad_norm": r.grad_norm[-1] if r.grad_norm else math.nan,
                "outcome": r.outcome(),
                "note": r.note,
            }
            for r in self.replays
        ]
        return pd.DataFrame(rows)

    def curves(self) -> pd.DataFrame:
        """Long form, one row per replayed step: ``intervention``, ``step``, ``loss``,
        ``grad_norm`` (what the Fixes tab plots)."""
        import pandas as pd

        rows = [
            {"intervention": str(r.intervention), "step": s, "loss": a, "grad_norm": g}
            for r in self.replays
            for s, a, g in zip(r.steps, r.loss, r.grad_norm)
        ]
        return pd.DataFrame(rows, columns=["intervention", "step", "loss", "grad_norm"])

    def __repr__(self) -> str:
        lines = [
            f"OverSteps(steps {self.start_step}..{self.failing_step}+{self.k}): {self.summary()}"
        ]
        lines += [f"  {r!r}" for r in self.replays]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _rng(st: RngState | None) -> None:
    """Set the RNGs to ``st`` (its CUDA states only on a machine with those devices)."""
    if st is None:
        return
    if st.cuda is not None and not (
        torch.cuda.is_available() and len(st.cuda) == torch.cuda.device_count()
    ):
        st = dataclasses.replace(st, cuda=None)
    st.restore()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Bench:
    """Copies of the model and optimizer, loaded with the window's first state or the
    failing step's own before each replay."""

    def __init__(self, src: ResolvedStep, window: RewindWindow) -> None:
        self.model, self.optimizer = copy_training(src, "the replays over steps")
        self.loss_fn = src.loss_fn
        self.window = window
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.failing = (
            _state(self.model),
            None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
            src.scaler_state,
        )
        instead = "call nbdebug.diagnose(..., autocast=False)"
        self.forward, self.backward = replay_contexts(src.autocast, self.device, instead=instead)

    def load(self, rewind: bool) -> torch.amp.GradScaler | None:
        """Load a start state into the copies; the scaler that goes with it."""
        w = self.window
        model_state, opt_state, scaler_state = (
            (w.model_state, w.optimizer_state, w.scaler_state) if rewind else self.failing
        )
        own = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        self.model.load_state_dict(model_state)
        with torch.no_grad():  # weights stored in another dtype keep it (as snapshots do)
            for name, stored in model_state.items():
                t = own.get(name)
                if t is not None and t.dtype != stored.dtype and stored.is_floating_point():
                    t.data = stored.to(device=t.device, copy=True)
        if self.optimizer is not None:
            if opt_state is None:
                self.optimizer.state.clear()
            else:
                self.optimizer.load_state_dict(copy.deepcopy(opt_state))
        if scaler_state is None:
            return None
        s = torch.amp.GradScaler(self.device.type)
        s.load_state_dict(copy.deepcopy(scaler_state))
        return s

    def _lr(self, lrs: list[float]) -> None:
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        if len(lrs) != len(groups):
            return
        for g, lr in zip(groups, lrs):
            if isinstance(g.get("lr"), torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr

    def run(self, plan: Plan, ref: Reference) -> StepsReplay:
        """Replay ``plan``; stop at its first non-finite step."""
        rep = StepsReplay(
            plan.intervention, plan.change, plan.start_step, checked_from=plan.checked_from
        )
        rep.note, rep.skipped = plan.note, plan.skipped
        if plan.skipped is not None:
            return rep
        saved: list[tuple[dict[str, object], str, object]] = []
        try:
            scaler = self.load(plan.rewind)
            if plan.reset_moments and self.optimizer is not None:
                self.optimizer.state.clear()
            self._hyper(plan, saved)
            r = Replay(self.model, self.optimizer, loss_fn=self.loss_fn, scaler=scaler)
            r.clip_norm = plan.clip
            for s in plan.steps:
                if not self._step(r, s, plan, rep):
                    break
        except Exception as e:
            rep.error = first_line(e, 300)
        finally:
            for g, key, old in saved:
                g[key] = old
        rep.finite = (
            rep.error is None
            and len(rep.steps) == len(plan.steps)
            and all(math.isfinite(a) and math.isfinite(b) for a, b in zip(rep.loss, rep.grad_norm))
        )
        no_band = ref.loss is None or ref.grad_norm is None
        if rep.finite:
            rest = slice(plan.checked_from, None)
            rep.in_band = in_band(rep.loss[rest], rep.grad_norm[rest], ref)
        else:
            rep.in_band = None if no_band else False
        return rep

    def _hyper(self, plan: Plan, saved: list[tuple[dict[str, object], str, object]]) -> None:
        """Set the plan's hyper-parameters on the copy's groups; what they held goes to
        ``saved`` (put back after the replay)."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        for i, values in plan.groups.items():
            if i >= len(groups):
                raise ValueError(
                    f"the optimizer has {len(groups)} parameter groups; expected group {i}."
                )
            for key, v in values.items():
                saved.append((groups[i], key, groups[i].get(key)))
                groups[i][key] = v

    def _step(self, r: Replay, s: PlannedStep, plan: Plan, rep: StepsReplay) -> bool:
        r.inputs, r.target = s.inputs, s.target
        self._lr(plan.lr_held if plan.lr_held is not None else s.lr)
        _rng(s.rng)
        out = training_step(r, self.forward, self.backward)
        rep.steps.append(s.step)
        rep.loss.append(math.nan if out.loss is None else float(out.loss))
        rep.grad_norm.append(math.nan if out.grad_norm is None else float(out.grad_norm))
        return out.finite


def _after_update(src: ResolvedStep) -> str:
    """Why the failing step's own state cannot be replayed: the snapshot of an update that
    made the weights non-finite and was not rolled back holds the state after it; else
    ``""``."""
    snap = src.snapshot
    if snap is None or snap.kind != FailureKind.OPTIMIZER or snap.reason.get("rolled_back"):
        return ""
    return (
        "the snapshot holds the state after the failing update (not rolled back): there is "
        "no state of the step's own to replay it on"
    )


def _band_of(src: ResolvedStep, div: Divergence | None, failing: int) -> Reference:
    """The healthy band: the divergence's (the steps before it began), else that of the
    last ``_BAND`` healthy steps before the failure."""
    if div is not None:
        return div.band

    def before(h: HistoryRow) -> bool:
        s = h.get("step")
        return isinstance(s, (int, float)) and s < failing

    return band([h for h in src.history if before(h)][-_BAND:])


def replay_window(
    step: ResolvedStep,
    window: RewindWindow,
    *,
    steps: int = STEPS_BEYOND,
    divergence: Divergence | None = None,
    deadline: float | None = None,
) -> OverSteps:
    """Replay the run from ``window`` through the failing step and ``steps`` beyond it,
    once per intervention, on copies of ``step``'s model and optimizer.

    Parameters
    ----------
    step : ResolvedStep
        The failing step (:func:`~nbdebug.core.snapshot.resolve_step`): its model and
        optimizer (copied, never stepped), batch, loss and history.
    window : RewindWindow
        The state at the start of ``window.start_step`` and the steps since, the failing
        step among them.
    steps : int
        ``k``, the steps replayed beyond the failing one (>= 1).
    divergence : Divergence, optional
        The divergence the history shows (found from ``step.history`` when not given).
    deadline : float, optional
        A ``time.perf_counter()`` value after which no further replay starts.

    Returns
    -------
    OverSteps

    Raises
    ------
    TypeError
        A ``step`` or ``window`` of another type.
    ValueError
        ``steps`` below 1, a window without steps or without the failing step.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1; got {steps!r}.")
    if not isinstance(step, ResolvedStep):
        raise TypeError(
            f"step must be a ResolvedStep (nbdebug.core.snapshot.resolve_step); got "
            f"{type(step).__qualname__}."
        )
    if not isinstance(window, RewindWindow):
        raise TypeError(
            f"window must be a RewindWindow (snap.rewind); got {type(window).__qualname__}."
        )
    caller = RngState.capture()
    try:
        bench = _Bench(step, window)
        prep = prepare(step, bench.model, window, steps)
        fail_at = prep.failing.step
        div = divergence if divergence is not None else find_divergence(step.history, fail_at)
        ref = _band_of(step, div, fail_at)
        moments = has_moments(bench.failing[1])
        replays = []
        after = _after_update(step)
        for plan in plans(prep, ref, div, moments, odd_hyperparameters(bench.optimizer)):
            if after and not plan.rewind and plan.skipped is None:
                plan.skipped = after
            if deadline is not None and time.perf_counter() > deadline and plan.skipped is None:
                plan.skipped = "budget_s spent"
            replays.append(bench.run(plan, ref))
        # the earlier-state test needs an earlier state, and one before the divergence
        healthy = window.start_step < fail_at and (div is None or div.began > window.start_step)
        spike = step.snapshot is not None and step.snapshot.kind == FailureKind.SPIKE
        for r in replays:
            r.supports = supported(
                r, replays, bad_batch=prep.bad_batch, healthy_start=healthy, spike=spike
            )
        found = overall(replays, diverged=div is not None)
        notes = _notes(prep, ref, div, bench.optimizer is not None)
        began = None if div is None else div.began
        return OverSteps(replays, found, window.start_step, fail_at, steps, ref, notes, began)
    finally:
        caller.restore()


def _notes(p: Prepared, ref: Reference, div: Divergence | None, has_opt: bool) -> list[str]:
    w, k = p.window, len(p.beyond)
    out = [
        f"replays over steps from step {w.start_step} through the failing step {p.failing.step} "
        f"and {k} beyond it, held to the healthy band ({band_text(ref)})."
    ]
    if not p.complete:
        out.append(
            "the rewind window's batches were not stored (too large): replays of the failing "
            f"batch only, from step {p.failing.step}'s own state."
        )
    if p.complete and not p.before:
        out.append(
            f"the window holds only the failing step {p.failing.step}: the replays start from "
            "its own state, and there is no earlier state to try its batch on."
        )
    if p.repeated:
        out.append(
            "the window holds no batch beyond the failure: the failing batch is repeated "
            f"{k} times."
        )
    if not has_opt:
        out.append("no optimizer to replay: the replays over steps do not update the weights.")
    if w.optimizer_state is None and has_opt:
        out.append("the window holds no optimizer state: replays from its start begin with none.")
    return out


def over_steps_of(
    src: ResolvedStep,
    divergence: Divergence | None,
    *,
    steps: int | None = None,
    deadline: float | None = None,
) -> tuple[OverSteps | None, list[str]]:
    """For :func:`nbdebug.diagnose`: the replays over steps of a snapshot with a rewind
    window and the notes they add; for a snapshot without one, ``None`` and the sentence
    that a window would allow them (nothing for a model source)."""
    if src.snapshot is None:
        return None, []
    window = getattr(src.snapshot, "rewind", None)
    if not isinstance(window, RewindWindow):
        return None, [NO_WINDOW]
    over = replay_window(
        src,
        window,
        steps=STEPS_BEYOND if steps is None else steps,
        divergence=divergence,
        deadline=deadline,
    )
    return over, [*over.notes, over.summary()]
