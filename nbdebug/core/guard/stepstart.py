"""What a guarded step started from, :class:`StepStart`: the RNG states and the buffers at
the start of the coming step (what a replay of its snapshot restores, and what a skipped
step puts back), and the writing of a step's snapshot as of that start."""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from ..snapshot.write import TrainingObjects
from ..state import BufferCopies, RngState
from .history import HistoryRow
from .writer import SnapshotWriter

__all__ = ["StepStart"]


class StepStart:
    """The RNG states and buffer copies of the model at the start of the coming step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rng = RngState.capture()
        self.buffers: BufferCopies = BufferCopies.capture(model, None)

    def mark(self) -> None:
        """Record the RNG states and the buffers now as the start of the coming step."""
        self.rng = RngState.capture()
        self.buffers = BufferCopies.capture(self.model, self.buffers)

    def write(
        self,
        writer: SnapshotWriter,
        objects: TrainingObjects,
        step: int,
        reason: dict[str, Any],
        batch: tuple[Any, Any],
        *,
        history: list[HistoryRow],
        distributed: dict[str, Any] | None,
        goes_on: bool,
    ) -> Path | None:
        """The snapshot of ``step`` with the RNG states and buffers as they were at its
        start; ``None`` when it was not written (a full disk warns). ``goes_on``: the
        step's update is applied (its buffer writes stay), else they are put back."""
        rng = self.rng  # the states at the start of the failing step (torch, numpy, Python)
        if rng.cuda is None:  # CUDA was first used during the step
            rng = dataclasses.replace(rng, cuda=RngState.capture().cuda)
        written = self.buffers.written(self.model)
        as_at_start: AbstractContextManager[object] = nullcontext()
        if written:
            # the forward of the bad batch wrote them (BatchNorm running statistics): the
            # snapshot holds them as they were at the start of the step, and a skipped
            # step leaves the model as if the batch never came
            reason["buffers_written"] = written
            reason["buffers_restored"] = not goes_on
            if goes_on:
                as_at_start = self.buffers.swapped_in()
            else:
                self.buffers.restore()
        try:
            with as_at_start:
                return writer.write(
                    objects,
                    step,
                    reason,
                    batch,
                    rng=rng,
                    history=history,
                    distributed=distributed,
                )
        except OSError as e:  # a full or unwritable disk: the step is still handled
            warnings.warn(
                f"nbdebug: the snapshot of step {step} could not be written to "
                f"{writer.directory} ({type(e).__name__}: {e}); the guard goes on "
                f"without it ({reason['action']}).",
                RuntimeWarning,
                stacklevel=5,
            )
            return None
