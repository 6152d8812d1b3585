"""What a guard does with the spike detector (:class:`SpikeWatch`): score each finite step,
record the findings in its history row, and act on a spike (``on_spike``: a snapshot of
kind ``"spike"``, a skipped update, an error, or nothing)."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
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
        self.streak = 0  # consecutive spike steps up to the last one

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
        status = {k: v for k, v in self.detector.status.items() if not v.startswith("warming")}
        if status:
            row["spike_status"] = status
        go_on = self._act(found, reading, row, batch, guard) if found else True
        self.spiking = bool(found)
        self.streak = self.streak + 1 if found else 0
        # a spike is kept out of the window (the next steps are scored against the healthy
        # ones), unless the spikes go on longer than MIN_WINDOW steps: a new level
        if go_on and (not found or self.streak > MIN_WINDOW):
            self.detector.admit(reading)
        return go_on

    def _act(
        self,
        found: list[SpikeFinding],
        reading: StepReading,
        row: HistoryRow,
        batch: tuple[Any, Any],
        guard: SpikeHost,
    ) -> bool:
        """Record the spikes and act on them (one snapshot per run of spikes)."""
        row["spikes"] = [f.as_dict() for f in found]
        self.findings.extend(found)
        action, first = self.action, not self.spiking
        message = "; ".join(f.message for f in found)
        if first:
            warnings.warn(f"nbdebug: {message}", RuntimeWarning, stacklevel=5)
        if action == "ignore":
            return True
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
