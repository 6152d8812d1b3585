"""The training step a trace runs, again for every pass and replay: :class:`StepCall`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch

from ..batch import Batch, LossFn, batch_size, call_model, compute_loss

__all__ = ["Amp", "StepCall"]

#: a context manager factory a pass's forward and loss run in (a recorded step's autocast)
Amp = Callable[[], AbstractContextManager[object]]


@dataclass(frozen=True)
class StepCall:
    """One training step, run again by every pass and replay of a trace.

    ``model(inputs)`` (a tensor, a tuple/list or a dict: :mod:`nbdebug.core.batch`), the
    loss ``loss_fn(output, target)`` (or the output's own), both inside ``autocast()``
    (a recorded step's autocast state; ``nullcontext`` for a plain trace).
    """

    model: torch.nn.Module
    inputs: Batch
    target: object = None
    loss_fn: LossFn | None = None
    autocast: Amp = nullcontext

    @cached_property
    def batch_size(self) -> int | None:
        """The first dimension of the batch's first tensor (its rows)."""
        return batch_size(self.inputs)

    def forward(self, batch: Batch) -> tuple[object, torch.Tensor]:
        """``(output, loss)`` of one forward on ``batch`` (a pass's own copy)."""
        with self.autocast():
            output = call_model(self.model, batch)
            return output, compute_loss(output, self.target, self.loss_fn)
