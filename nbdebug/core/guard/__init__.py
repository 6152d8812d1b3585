"""A training-loop sentinel: :class:`NaNGuard` checks every step and writes a snapshot
of the first step whose loss, gradients or weights are not finite.

Three forms, all sharing one :meth:`NaNGuard.check`::

    guard = nbdebug.NaNGuard(model, optimizer, directory="snapshots")

    # 1. explicit: you keep your loop as it is
    for step, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=step):   # False: non-finite
            optimizer.step()
        optimizer.zero_grad()

    # 2. a guarded step: the guard steps the optimizer when the step is finite, and
    #    zeroes the gradients
    for step, (x, y) in enumerate(loader):
        with guard.step(x, y, step=step) as s:
            s.loss = loss_fn(model(x), y)
            s.loss.backward()

    # 3. a decorated step function returning the loss after its backward
    @guard.wrap
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

With a ``torch.amp.GradScaler``, pass it as ``scaler=`` and step through it::

    guard = nbdebug.NaNGuard(model, optimizer, scaler=scaler, autocast=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # so that update() may run on every step
    if guard.check(loss, inputs=x, target=y, step=step):   # pass the unscaled loss
        scaler.step(optimizer)          # skips an overflow step by itself
    scaler.update()                     # also on a step the guard skipped
    optimizer.zero_grad()

``scaler.update()`` needs the overflow check of ``unscale_()`` or ``step()``: without the
``unscale_()`` line, call ``update()`` only after ``scaler.step()`` (inside the ``if``).

A step whose loss is finite but whose gradients hold Inf/NaN is the scaler's business (a
float16 gradient overflow is routine: the scaler skips the update and lowers its scale):
``check()`` returns ``True`` so that ``scaler.step()`` skips it, writes no snapshot and
records the history row as ``skipped=True, nonfinite=None``, until the scale collapses
(below ``min_scale``, or ``scaler_patience`` overflows in a row: ``kind="scale"``). A
non-finite loss (a NaN or an overflow in the forward, which no scale fixes) is a failure
like without a scaler: a snapshot (holding the scaler's state and the autocast state) and
``False``.

The package, one job per module: :mod:`.guard` (:class:`NaNGuard`), :mod:`.options` (its
options by group), :mod:`.reading` (what a step reads), :mod:`.verdict` (what it decides),
:mod:`.history` (the rows it records), :mod:`.writer` (its snapshots), :mod:`.failure`
(:class:`NonFiniteError`), :mod:`.forms` (``guard.step``, ``guard.wrap``), :mod:`.checks`
(the health checks it is given), :mod:`.spike` and :mod:`.spike_watch` (the spike
detector and what the guard does on a spike), :mod:`.skips` (skip counters, limits and
``skip_batches.json``), :mod:`.objects` (the training objects it is given),
:mod:`.agreement` and :mod:`.replicas` (distributed runs).
"""

from .agreement import RankAgreement, RankError
from .checks import GuardView, StepChecks, register_checks, resolve_checks
from .failure import NonFiniteError, last_error
from .forms import GuardedStep
from .guard import NaNGuard
from .history import HISTORY_COLUMNS, HistoryRow, history_frame, parse_history
from .options import (
    ACTIONS,
    DistributedOptions,
    FailureOptions,
    GuardOptions,
    HistoryOptions,
    ScalerOptions,
    SnapshotOptions,
    WatchOptions,
)
from .reading import StepReading
from .replicas import ReplicaMismatch, fingerprint, first_mismatch, replica_differences
from .skips import SKIP_BATCHES, SkipCounter, load_skip_batches
from .spike import SPIKE_ACTIONS, SpikeDetector, SpikeFinding, SpikeSettings
from .spike_watch import SpikeWatch
from .verdict import Verdict
from .writer import SnapshotWriter

__all__ = [
    "ACTIONS",
    "HISTORY_COLUMNS",
    "SKIP_BATCHES",
    "SPIKE_ACTIONS",
    "DistributedOptions",
    "FailureOptions",
    "GuardOptions",
    "GuardView",
    "GuardedStep",
    "HistoryOptions",
    "HistoryRow",
    "NaNGuard",
    "NonFiniteError",
    "RankAgreement",
    "RankError",
    "ReplicaMismatch",
    "ScalerOptions",
    "SkipCounter",
    "SnapshotOptions",
    "SnapshotWriter",
    "SpikeDetector",
    "SpikeFinding",
    "SpikeSettings",
    "SpikeWatch",
    "StepChecks",
    "StepReading",
    "Verdict",
    "WatchOptions",
    "fingerprint",
    "first_mismatch",
    "history_frame",
    "last_error",
    "load_skip_batches",
    "parse_history",
    "register_checks",
    "replica_differences",
    "resolve_checks",
]
