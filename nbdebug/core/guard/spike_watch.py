"""What a guard does with the spike detector (:class:`SpikeWatch`): score each finite step,
record the findings in its history row, and act on a spike (``on_spike``: a snapshot of
kind ``"spike"``, a skipped update, an error, or nothing).

A spike is a transient; a run of more than :data:`~.spike.MIN_WINDOW` flagged steps in a
row is a new level (data in other units, a new phase of training), whatever was done with
the steps: their values, kept aside while the run lasts, become the window (the baseline
moves to the new level, so neither the spike test nor the sustained-rise test keeps
flagging it), and the step that ends the run goes on even under ``on_spike="skip"`` (a
warning says so). Without this a skipped step could never join the window, every later
step would score against the old level, and ``"skip"`` would freeze the weights for the
rest of the run. A run that keeps growing after that is flagged again (a new run: under
``"skip"`` skipped again), so a divergence is still held back until it stops on a
non-finite step or settles.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..vocab import FailureKind
from .failure import NonFiniteError, record_error
from .spike import MIN_WINDOW, SpikeAction, SpikeDetector, SpikeFinding, spike_action

if TYPE_CHECKING:  # pragma: no cover
    from .history import HistoryRow
    from .options import GuardOptions
    from .reading import StepReading

__all__ = ["SpikeHost", "SpikeWatch"]


class SpikeHost(Protocol):
    """What the spike watch needs of its guard: write a step's snapshot, clear gradients."""

    def write_step(
        self,
        step: int,
        reason: dict[str, Any],
        batch: tuple[Any, Any],
        distributed: dict[str, Any] | None,
        *,
        goes_on: bool,
    ) -> Path | None: ...

    def clear_grads(self) -> None: ...


class SpikeWatch:
    """The guard's spike detector with its findings and its action.

    Attributes
    ----------
    detector : SpikeDetector
    action : {"snapshot", "skip", "raise", "ignore"}
        ``on_spike`` (``"ignore"`` in a distributed run).
    findings : collections.deque of SpikeFinding
        The last ``history`` findings.
    """

    def __init__(
        self,
        detector: SpikeDetector,
        action: SpikeAction,
        keep: int,
        params: Sequence[torch.Tensor] = (),
    ) -> None:
        self.detector = detector
        self.action = action
        self.findings: deque[SpikeFinding] = deque(maxlen=keep)
        self.params: list[torch.Tensor] = list(params)
        self.spiking = False  # the last scored step was a spike
        self.streak = 0  # consecutive spike steps up to the last one (since a new level)
        self.pending: list[StepReading] = []  # the streak's steps, kept out of the window
        self.skipped = 0  # updates skipped in the streak

    @classmethod
    def create(
        cls, options: GuardOptions, *, distributed: bool, params: Sequence[torch.Tensor] = ()
    ) -> SpikeWatch | None:
        """The watch the options ask for (``None``: ``spike=False``)."""
        settings = options.checks.spike_settings
        if settings is None:
            return None
        action = spike_action(options.failure.on_spike, distributed)
        return cls(SpikeDetector(settings), action, options.history.history, params)

    def watch(
        self, reading: StepReading, row: HistoryRow, batch: tuple[Any, Any], guard: SpikeHost
    ) -> bool:
        """Score a finite step, record and act; returns whether the step goes on. A
        signal that cannot be scored (no gradients yet) is said in ``row["spike_status"]``
        and never blocks the step."""
        grads = reading.grad_norm > 0 or any(p.grad is not None for p in self.params)
        found = self.detector.score(reading, has_grads=grads)
        self.detector.observe(reading, found)
        status = {k: v for k, v in self.detector.status.items() if not v.startswith("warming")}
        if status:
            row["spike_status"] = status
        if not found:
            self.spiking, self.streak, self.skipped = False, 0, 0
            self.pending.clear()  # the run was a transient: its values stay out
            self.detector.admit(reading)
            return True
        # a spike is kept out of the window (the next steps are scored against the healthy
        # ones), unless the spikes go on longer than MIN_WINDOW steps, skipped or not: then
        # they are a new level, and the whole run joins the window
        self.streak += 1
        self.pending.append(reading)
        level = self.streak > MIN_WINDOW
        if level:
            found = [replace(f, new_level=True) for f in found]
        first, self.spiking = not self.spiking, True
        go_on = self._act(found, reading, row, batch, guard, first=first)
        self.skipped += not go_on
        if level:
            self._new_level(found)
        return go_on

    def _new_level(self, found: list[SpikeFinding]) -> None:
        """Admit the run of spikes as a new level (and say so where updates were skipped)."""
        first, last = self.pending[0].step, self.pending[-1].step
        self.detector.new_level(self.pending)
        if self.skipped:
            signals = " and ".join(dict.fromkeys(f.signal for f in found))
            warnings.warn(
                f"nbdebug: {signals} stayed above the spike threshold for {len(self.pending)} "
                f"steps in a row (steps {first} to {last}, {self.skipped} updates skipped): "
                f"taken as a new level, the spike detector's baseline moves to it and step "
                f"{last}'s update goes on; a further rise is flagged, and skipped, again.",
                RuntimeWarning,
                stacklevel=5,
            )
        self.pending.clear()
        self.streak = self.skipped = 0

    def _act(
        self,
        found: list[SpikeFinding],
        reading: StepReading,
        row: HistoryRow,
        batch: tuple[Any, Any],
        guard: SpikeHost,
        *,
        first: bool,
    ) -> bool:
        """Record the spikes and act on them (one snapshot per run of spikes; ``first``:
        the step begins a run). A new level's step is recorded and goes on."""
        row["spikes"] = [f.as_dict() for f in found]
        self.findings.extend(found)
        action, level = self.action, found[0].new_level
        message = "; ".join(f.message for f in found)
        if first:
            skip = (
                f"; its update is skipped, and so is each next flagged step's, up to "
                f"{MIN_WINDOW} in a row (a longer run is a new level: its updates go on)"
                if action == "skip"
                else ""
            )
            warnings.warn(f"nbdebug: {message}{skip}.", RuntimeWarning, stacklevel=5)
        if action == "ignore" or level:
            return True  # a new level is no spike (its run began with the snapshot)
        reason: dict[str, Any] = {
            **{k: getattr(reading, k) for k in ("step", "loss", "grad_norm", "param_norm")},
            **{"kind": FailureKind.SPIKE, "message": message, "action": action},
            "spikes": row["spikes"],
        }
        path = None
        if first or action == "raise":
            path = guard.write_step(reading.step, reason, batch, None, goes_on=action == "snapshot")
        if path is not None:
            row["snapshot"] = str(path)
        if action == "snapshot":
            return True
        row["skipped"] = True
        guard.clear_grads()
        if action == "raise":
            saved = f"Snapshot: {path}" if path is not None else "No snapshot was written"
            error = NonFiniteError(
                f"{message}. {saved}", path=path, step=reading.step, reason=reason
            )
            raise record_error(error)
        return False
