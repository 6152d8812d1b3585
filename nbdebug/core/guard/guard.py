"""The training-loop guard, :class:`NaNGuard` (see :mod:`nbdebug.core.guard` for the three
ways to use it): each ``check()`` reads the step (:mod:`.reading`), agrees with the other
ranks (:mod:`.agreement`), decides (:mod:`.verdict`), records the history row
(:mod:`.history`) and, on a bad step, writes a snapshot (:mod:`.writer`)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..batch import check_model
from ..parallel import unwrap_data_parallel
from ..snapshot.replay import autocast_state
from ..snapshot.write import Scaler, Scheduler, TrainingObjects, compile_settings
from ..state import unique_parameters
from ..text import fmt_num
from .agreement import RankAgreement, local_bits
from .checks import StepChecks, resolve_checks
from .failure import record_error, streak_error
from .forms import GuardedStep, guarded_step, wrap_step
from .history import HistoryRow, history_frame
from .objects import check_optimizer_of, training_objects
from .options import GuardOptions
from .reading import Loss, StepMeter, StepReading
from .replicas import ReplicaMismatch
from .rewind import RewindKeeper
from .signal_meter import SignalMeter
from .skips import SkipCounter, batch_ids, record_skip_batch, skip_error
from .spike import SpikeFinding
from .spike_watch import SpikeWatch
from .stepstart import StepStart
from .update_watch import UpdateWatch
from .verdict import Decider, Verdict, failure_reason
from .writer import SnapshotWriter

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .signals import LayerSignals

__all__ = ["NaNGuard"]


def _option(group: str, name: str) -> Any:
    """A read-only guard attribute that is ``guard.options.<group>.<name>`` (or, for
    ``group="writer"``, ``guard.writer.<name>``)."""

    def get(self: NaNGuard) -> object:
        owner = self.writer if group == "writer" else getattr(self.options, group)
        return getattr(owner, name)

    where = "writer" if group == "writer" else f"options.{group}"
    return property(get, doc=f"``{where}.{name}`` (read-only).")


class NaNGuard:
    """Watch a training loop; on the first non-finite step write a snapshot file.

    Parameters
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer, optional
        Its state goes into the snapshot; its first group's learning rate into the history.
    scaler : torch.amp.GradScaler, optional
        Gradients are measured unscaled; overflow steps the scaler skips are not failures.
    scheduler : optional
        A learning-rate scheduler; its state goes into the snapshot.
    options : GuardOptions, optional
        Every option below as one value, by group (:class:`GuardOptions`); the options
        given by keyword (``**settings``, the names below) override it. An unknown name
        is a ``TypeError`` that lists the options.
    directory : str or PathLike
        Where snapshots go (created on the first one): ``step-000048213.nbsnap``.
    patience : int or None
        How many consecutive bad steps are tolerated under ``"skip"``/``"continue"``: the
        next one in a row raises :class:`NonFiniteError`. ``None``: never raise.
    on_nonfinite : {"skip", "raise", "continue"}
        ``"skip"``: clear the gradients (``p.grad = None``, so even an unconditional
        ``optimizer.step()`` leaves the weights as they were) and return ``False``.
        ``"raise"``: clear the gradients and raise :class:`NonFiniteError`.
        ``"continue"``: only record (snapshot, history) and return ``False``.
    history : int
        Length of the rolling history kept and stored in snapshots.
    rewind : int, "auto", bool or None
        The rewind window (:mod:`nbdebug.core.guard.rewind`, :attr:`rewind`,
        ``snap.rewind``): the states refreshed every ``rewind`` steps and each step since.
        ``"auto"``: every 8 steps when they fit ``min(2 GiB, 25 % of free RAM)``; ``False``: off.
    loss_fn : callable, optional
        The loss, stored by import path (``torch.nn.functional.cross_entropy``, an
        ``nn.CrossEntropyLoss()``) so that ``snap.trace()`` replays without arguments.
    recipe : str, optional
        ``"package.module:factory"`` that builds the model, with ``recipe_kwargs`` (JSON):
        lets ``load_snapshot(path, trust_recipe=True)`` rebuild it.
    recipe_kwargs : dict, optional
    min_scale : float
        With a scaler: a scale below this is a failure (``kind="scale"``).
    scaler_patience : int
        With a scaler: this many overflow-skipped steps in a row is a failure.
    max_snapshots : int or None
        At most this many snapshot files per guard (later bad steps are only recorded).
    checks : StepChecks, bool, int or dict
        Health checks on the live model (:func:`nbdebug.check`'s cheap ones, no extra
        forward), run after each decision; their findings go into the history row
        (``"checks"``): ``True`` (every 50 steps), a number of steps,
        ``{"every": n, "clip_norm": c}``, or a :class:`StepChecks` object such as
        ``nbdebug.GuardChecks(every=50, clip_norm=1.0)`` (one per guard: it keeps the
        cadence); ``False``/``None``: off.
    param_norm_every : int
        Measure the total parameter norm every this many checks (and on every bad step);
        other history rows hold ``None``. Reading all weights is a pass over memory as
        long as the gradient check itself: every 10th step keeps the guard near 1 % of a
        step. ``1``: every step.
    process_group : torch.distributed.ProcessGroup, None or False
        Distributed training (see :mod:`nbdebug.core.guard.agreement`): every rank's ``check()``
        joins one tiny ``all_reduce`` so that all ranks skip a step that any rank found
        non-finite, and each writes its own snapshot (``step-000000003-rank1.nbsnap``).
        ``None``: a DDP model's group, else the default group when ``torch.distributed`` is
        initialised; ``False``: no agreement (this rank decides alone). A DDP/DataParallel
        wrapper is unwrapped: snapshots hold the inner module's state.
    check_replicas_every : int or None
        Distributed: every this many steps compare a fingerprint of every parameter across
        the ranks (one ``all_gather``); the first that differs is a
        :class:`~nbdebug.core.guard.ReplicaMismatch` finding (a warning, the history
        row's ``"replicas"``, :attr:`replica_findings`). ``None``: off.
    timeout : float, optional
        Distributed: seconds every collective of the agreement waits for the other ranks
        (default 300) before raising :class:`~nbdebug.RankError` naming the
        rank(s) that did not answer.
    async_save : bool
        Write a snapshot's tensor bytes into its temporary file during the step and finish
        it (checksums, header, fsync, rename) on a background thread, so that a run that
        goes on (``on_nonfinite="continue"``) is not blocked by the disk. :meth:`close`
        waits for the writes and raises the first error; a process that exits waits for
        them too.
    spike : bool, float, dict or SpikeSettings
        The spike detector (:mod:`nbdebug.core.guard.spike`), on by default: a finite step
        whose loss or gradient norm has a robust z-score above 6 against the last 128
        healthy steps is a spike, and so is a loss whose last 8 steps' median is 6
        standard errors above theirs (a finding in the row's ``"spikes"`` and
        :attr:`spike_findings`). A z threshold, ``{"z", "window", "warmup", "rise"}``;
        ``False``: off.
    on_spike : {"snapshot", "skip", "raise", "ignore"}
        ``"snapshot"``: a snapshot of kind ``"spike"`` and the step goes on; ``"skip"``:
        also skip the update (``False``); ``"raise"``: :class:`NonFiniteError`
        (``kind="spike"``); ``"ignore"``: only the finding. Distributed: ``"ignore"``.
    signals : bool, dict or SignalSettings
        Per-layer signals (:attr:`signals`, ``snap.signals``; see
        :mod:`nbdebug.core.guard.signal_meter`); ``False``: off.
    autocast : torch.dtype, str or None
        The autocast dtype the step's forward runs in (``torch.float16``,
        ``torch.bfloat16`` or their names), for a loop whose ``check()`` comes after the
        ``torch.autocast`` block: the snapshots replay under it, on the model's device
        type (``snap.autocast``). ``check()`` called inside the block records the active
        state by itself. ``None``: only what ``check()`` finds.

    Attributes
    ----------
    history : collections.deque of dict
        ``step``, ``loss``, ``grad_norm`` (unscaled), ``param_norm`` (see
        ``param_norm_every``), ``lr``, ``scale``,
        ``skipped``, ``nonfinite`` (the failure kind or ``None``), ``time``.
    snapshots : list of pathlib.Path
    ok : bool or None
        Result of the last check.
    options : GuardOptions
        Every option, by group (:mod:`nbdebug.core.guard.options`); also readable flat
        (``guard.patience``, ``guard.directory``, ...).
    checks : StepChecks or None
    rewind : RewindKeeper or None
        The rewind window's keeper (``guard.rewind.current()``: the window now; ``None``: off).
    spikes : SpikeWatch or None
        The spike detector and what it found (``None``: ``spike=False``).
    agreement : RankAgreement or None
        The distributed agreement (``None``: this process decides alone).

    Examples
    --------
    >>> guard = nbdebug.NaNGuard(model, optimizer, directory="snapshots", checks=True)
    >>> if guard.check(loss, inputs=x, target=y, step=step):
    ...     optimizer.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scaler: Scaler | None = None,
        scheduler: Scheduler | None = None,
        options: GuardOptions | None = None,
        **settings: Any,
    ):
        if options is not None and not isinstance(options, GuardOptions):
            raise TypeError(f"options must be a GuardOptions; got {type(options).__qualname__}.")
        wrapper = model
        if isinstance(model, torch.nn.Module):
            model = unwrap_data_parallel(model)
        self.model = check_model(model)
        self.optimizer, self.scaler, self.scheduler = training_objects(optimizer, scaler, scheduler)
        check_optimizer_of(self.model, self.optimizer)
        self.options = opts = GuardOptions.from_settings(options, **settings)
        self.writer = SnapshotWriter(opts.snapshots)
        self.writer.set_field("compiled", compile_settings(wrapper))  # torch.compile'd?
        self.checks: StepChecks | None = resolve_checks(opts.checks.checks)
        if self.checks is not None:
            self.checks.attach(self)
        self.history: deque[HistoryRow] = deque(maxlen=opts.history.history)
        self.snapshots: list[Path] = self.writer.paths
        self.ok: bool | None = None
        self.bad_streak = 0
        self._streak_first: tuple[Path | None, int, dict[str, Any]] | None = None
        self._next_step = 0
        self._checks = 0
        params = unique_parameters(model)
        seen = {id(p) for p in params}
        self._extra = []  # optimizer parameters outside the model: their gradients are cleared too
        for p in (p for g in optimizer.param_groups for p in g["params"]) if optimizer else ():
            if id(p) not in seen:
                seen.add(id(p))
                self._extra.append(p)
        self.meter = StepMeter(self.model, self.optimizer, self.scaler, params)
        self.decider = Decider(opts.scaler)
        autocast = opts.snapshots.autocast_field(self.meter.device.type)
        if autocast is not None:
            self.writer.set_field("autocast", autocast)
        self.start = StepStart(self.model)  # the RNG states and buffers of the coming step
        self.agreement = RankAgreement.create(
            wrapper, list(self.model.named_parameters()), opts.distributed, opts.agreed()
        )
        self.skips = SkipCounter()
        self._ids: list[int] | None = None
        self.spikes = SpikeWatch.create(
            opts, distributed=self.agreement is not None, params=self.meter.params
        )
        self.meter.signals = SignalMeter.create(opts, self.meter, self.writer)
        self.update_watch = UpdateWatch.create(self)  # the optimizer steps (None: off)
        # after the watch: its hooks run first (an update it undoes is not copied)
        self.rewind = RewindKeeper.create(opts.history.rewind, self)  # the window (None: off)

    @property
    def replica_findings(self) -> list[ReplicaMismatch]:
        """The replica check's findings so far (empty when it is off)."""
        return self.agreement.replica_findings if self.agreement is not None else []

    @property
    def spike_findings(self) -> list[SpikeFinding]:
        """The spike detector's findings so far (the last ``history``; empty when off)."""
        return list(self.spikes.findings) if self.spikes is not None else []

    @property
    def signals(self) -> LayerSignals | None:
        """The per-layer signals of the steps held (a copy; ``None``: ``signals=False``)."""
        return self.meter.signals.view() if self.meter.signals is not None else None

    @property
    def scaler_streak(self) -> int:
        """Overflow steps the GradScaler skipped in a row."""
        return self.decider.scaler_streak

    # the options, readable flat as before
    directory = _option("writer", "directory")
    loss_fn = _option("writer", "loss_fn")
    recipe = _option("writer", "recipe")
    max_snapshots = _option("writer", "max_snapshots")
    patience = _option("failure", "patience")
    on_nonfinite = _option("failure", "on_nonfinite")
    on_spike = _option("failure", "on_spike")
    min_scale = _option("scaler", "min_scale")
    scaler_patience = _option("scaler", "scaler_patience")
    param_norm_every = _option("checks", "param_norm_every")

    def set_snapshot_field(self, key: str, value: object) -> None:
        """Write ``value`` into the snapshot field ``key`` (``"trainer"``, ``"autocast"``,
        ...) of every snapshot from now on; ``None``: the field's default again. A trainer
        callback records its trainer this way."""
        self.writer.set_field(key, value)

    # ------------------------------------------------------------------ checking
    def check(
        self,
        loss: Loss,
        *,
        inputs: Any = None,
        target: Any = None,
        step: int | None = None,
        ids: Sequence[int] | torch.Tensor | None = None,
    ) -> bool:
        """Check one step after its backward and before the optimizer step.

        Parameters
        ----------
        loss : Tensor (scalar) or float or None
            The step's loss (unscaled when a GradScaler is used).
        inputs, target : optional
            The batch; stored in the snapshot when the step is not finite.
        step : int, optional
            The step number (default: one more than the last).
        ids : sequence of int or Tensor, optional
            The dataset index of each batch row: a skipped batch's go into
            ``skip_batches.json`` (:mod:`nbdebug.core.guard.skips`).

        Called inside a ``torch.autocast`` block, the guard records its state (device
        type, dtype) and its snapshots replay under it (``snap.autocast``); outside it,
        give the dtype once as ``NaNGuard(..., autocast=torch.float16)``.

        With a GradScaler, Inf/NaN gradients under a finite loss return ``True``: the
        scaler's ``step()`` skips that update itself (see the module docstring).

        Returns
        -------
        bool
            ``True`` when loss and gradients are finite (go on and step the optimizer);
            ``False`` when they are not (a snapshot was written; see ``on_nonfinite``).

        Raises
        ------
        NonFiniteError
            ``on_nonfinite="raise"``, or more than ``patience`` bad steps in a row.
        """
        self._ids = batch_ids(ids, inputs)
        self.writer.set_field("ids", self._ids)  # row blame maps the rows to dataset indices
        step = self._step_number(step)
        device_type = self.meter.device.type
        if torch.is_autocast_enabled(device_type):
            # checked inside the autocast block: the snapshots replay under this state,
            # the backward too (it came before this check, so inside the block as well)
            self.writer.set_field("autocast", autocast_state(device_type, backward=True))
        measure_params = self._checks % self.options.checks.param_norm_every == 0
        self._checks += 1
        read = self.meter.measure(loss, step=step, measure_params=measure_params, signals=True)
        reading = self.agree(read)
        row = self._record(reading)
        verdict = self.decide(reading)
        reading = verdict.reading  # a bad step's weight norm is always measured
        row["param_norm"], row["skipped"] = reading.param_norm, verdict.scaler_skip
        if self.checks is not None:  # health checks, recorded in the row (e.g. row["checks"])
            row.update(self.checks.run(self, reading, failing=verdict.kind is not None))  # type: ignore[typeddict-item]
        if self.rewind is not None:  # the step joins the window before any snapshot of it
            self.rewind.record(reading, verdict, (inputs, target), self._ids, self.ok)
        if verdict.kind is None:
            return self._passed(reading, row, (inputs, target), verdict.scaler_skip)
        return self._fail(verdict, row, (inputs, target))

    def _step_number(self, step: object) -> int:
        if step is None:
            step = self._next_step
        elif isinstance(step, bool) or not isinstance(step, int):
            try:
                step = int(step)  # type: ignore[call-overload]
            except (TypeError, ValueError):
                raise TypeError(f"step must be an int; got {type(step).__qualname__}.") from None
        assert isinstance(step, int)
        self._next_step = step + 1
        return step

    def measure_step(self, loss: Loss, *, step: int, measure_params: bool = True) -> StepReading:
        """Read the step: loss, total gradient norm (unscaled), weight norm (when
        ``measure_params``), learning rate and scale, with one host synchronisation.
        Changes nothing, in the model or in the guard.

        Parameters
        ----------
        loss : Tensor (scalar) or float or None
        step : int
        measure_params : bool
            Also read the total weight norm (a pass over all weights).

        Returns
        -------
        StepReading
        """
        return self.meter.measure(loss, step=step, measure_params=measure_params)

    def scaler_unscaled(self) -> bool:
        """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last update."""
        return self.meter.scaler_unscaled()

    def agree(self, reading: StepReading) -> StepReading:
        """The reading the decision acts on. One process: its own. Distributed: the same
        reading with ``ranks`` set, every rank's local verdict from one ``all_reduce(MAX)``
        (see :mod:`nbdebug.core.guard.agreement`), which :meth:`decide` turns into the same
        decision on every rank. The replica check runs here when it is due."""
        ag = self.agreement
        if ag is None:
            return reading
        bits = local_bits(
            loss=reading.loss_bad,
            grad=reading.grad_bad and self.scaler is None,  # with a scaler: its business
            weights=reading.weights_bad,
        )
        outcome = ag.agree(reading.step, bits)
        if ag.due(reading.step):
            outcome.checked_replicas = True
            outcome.replicas = ag.compare_replicas(
                reading.step, list(self.model.named_parameters())
            )
            if outcome.replicas is not None:
                warnings.warn(outcome.replicas.message, RuntimeWarning, stacklevel=3)
        return dataclasses.replace(reading, ranks=outcome)

    def _record(self, reading: StepReading) -> HistoryRow:
        row: HistoryRow = {
            "step": reading.step,
            "loss": reading.loss,
            "grad_norm": reading.grad_norm,
            "param_norm": reading.param_norm,
            "lr": reading.lr,
            "scale": reading.scale,
            "skipped": False,
            "nonfinite": None,
            "time": time.time(),
        }
        if reading.ranks is not None:
            row["rank"] = reading.ranks.rank
            if reading.ranks.checked_replicas:
                found = reading.ranks.replicas
                row["replicas"] = found.parameter if found is not None else "equal"
        self.history.append(row)
        return row

    def decide(self, reading: StepReading) -> Verdict:
        """Fail, or go on (see :class:`~nbdebug.core.guard.verdict.Decider`): what is not
        finite and the GradScaler rules; updates the scaler streak. Distributed: a step
        that another rank found non-finite fails here too, ``kind="rank"``."""
        return self.decider.decide(reading, self.meter)

    def _passed(
        self, reading: StepReading, row: HistoryRow, batch: tuple[Any, Any], scaler_skip: bool
    ) -> bool:
        self.bad_streak = 0
        self._streak_first = None
        go_on = True
        if self.spikes is not None and not scaler_skip:
            go_on = self.spikes.watch(reading, row, batch, self)
        self._account(row, batch)
        if self.update_watch is not None and go_on:  # watch the update this check lets through
            self.update_watch.arm(reading.step, batch, self.start.rng)
        self.mark_step_start()
        self.ok = go_on
        return go_on

    def _fail(self, verdict: Verdict, row: HistoryRow, batch: tuple[Any, Any]) -> bool:
        kind, reading, action = verdict.kind, verdict.reading, self.on_nonfinite
        assert kind is not None
        message, reason, distributed = failure_reason(verdict, action)
        row["nonfinite"] = kind
        goes_on = action == "continue"
        row["skipped"] = not goes_on
        path = self.write_step(reading.step, reason, batch, distributed, goes_on=goes_on)
        self.bad_streak += 1
        if self._streak_first is None:
            self._streak_first = (path, reading.step, reason)
        if path is not None:
            row["snapshot"] = str(path)
        if not goes_on:
            self.clear_grads()
        self.ok = False
        self._account(row, batch)
        self.mark_step_start()
        too_many = self.patience is not None and self.bad_streak > self.patience
        if action == "raise" or too_many:
            assert self._streak_first is not None
            err = streak_error(
                message,
                self._streak_first,
                raised=action == "raise",
                streak=self.bad_streak,
                patience=self.patience,
            )
            raise record_error(err)
        return False

    def _account(self, row: HistoryRow, batch: tuple[Any, Any]) -> None:
        """Count the step's skip (the row's counters), note a skipped batch's dataset
        indices in ``skip_batches.json``, and stop past ``max_skips_in_row`` /
        ``max_skip_fraction``: :class:`NonFiniteError` with a snapshot."""
        self.skips.record(row)
        if row["skipped"] and self._ids is not None:
            record_skip_batch(self.writer.directory, row["step"], row["skip_reason"], self._ids)
        why = self.skips.over(self.options.failure)
        if why is None:
            return
        reason = self.skips.stop_reason(why, row["step"])
        path = row.get("snapshot") or self.write_step(
            row["step"], reason, batch, None, goes_on=False
        )
        raise record_error(skip_error(reason, Path(path) if path else None))

    def write_step(
        self,
        step: int,
        reason: dict[str, Any],
        batch: tuple[Any, Any],
        distributed: dict[str, Any] | None,
        *,
        goes_on: bool,
    ) -> Path | None:
        """The snapshot of the failing (or spiking) step, with the RNG states and buffers as
        they were at its start; ``None`` when it was not written. ``goes_on``: the step's
        update is applied (its buffer writes stay), else they are put back."""
        objects = TrainingObjects(self.model, self.optimizer, self.scheduler, self.scaler)
        return self.start.write(
            self.writer,
            objects,
            step,
            reason,
            batch,
            history=list(self.history),
            distributed=distributed,
            goes_on=goes_on,
        )

    def close(self) -> None:
        """Wait for the snapshots still being written (``async_save``) and remove the
        hooks of the signals, the update watch and the rewind window; raise ``OSError``
        naming the first write that failed."""
        for part in (self.meter.signals, self.update_watch, self.rewind):
            if part is not None:
                part.close()
        self.writer.close()

    def mark_step_start(self) -> None:
        """Record the RNG states and the buffers now as the start of the coming step (what
        a replay of its snapshot restores, and what a skipped step puts back in the
        buffers). :meth:`check` records them after each step by itself; call this when the
        loop draws random numbers or writes buffers between steps (data loading, a trainer
        callback's ``on_train_batch_start``)."""
        self.start.mark()

    def clear_grads(self) -> None:
        """Set every gradient of the model (and optimizer) to ``None``: an optimizer step
        then leaves those parameters unchanged."""
        for p in self.meter.params:
            p.grad = None
        for p in self._extra:
            p.grad = None

    # ------------------------------------------------------------------ other forms
    def step(
        self, inputs: Any = None, target: Any = None, *, step: int | None = None
    ) -> AbstractContextManager[GuardedStep]:
        """A guarded training step (context manager).

        In the block do the forward and backward and set ``s.loss``. On leaving it the
        guard checks; when the step is finite it steps the optimizer (through the scaler,
        then ``scaler.update()``, when there is one); then it zeroes the gradients. The
        RNG state at the start of the block is what a replay uses.
        """
        return guarded_step(self, inputs, target, step)

    def wrap(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        inputs: int | str = 0,
        target: int | str | None = 1,
    ) -> Any:
        """Decorator for a step function that does forward + backward and returns the loss
        (or a tuple starting with it): each call becomes a guarded step (see :meth:`step`).

        ``inputs`` / ``target`` name the function's parameters holding the batch (position
        or name; ``target=None`` for none). ``guard.ok`` tells whether the last call stepped.
        """
        return wrap_step(self, fn, inputs, target)

    # ------------------------------------------------------------------ views
    def history_frame(self) -> pd.DataFrame:
        """The rolling history as a DataFrame (same layout as ``Snapshot.history_frame()``)."""
        return history_frame(list(self.history))

    def __repr__(self) -> str:
        last = self.history[-1] if self.history else None
        where = (
            f"last step {last['step']} loss={fmt_num(last['loss'], none='None')}"
            if last
            else "no step yet"
        )
        return (
            f"NaNGuard({type(self.model).__qualname__}, on_nonfinite={self.on_nonfinite!r}, "
            f"patience={self.patience}, {where}, {self.skips.summary()}, "
            f"{self.rewind.summary() if self.rewind else 'rewind off'}, "
            f"{self.meter.signals.summary() + ', ' if self.meter.signals else ''}"
            f"{len(self.snapshots)} snapshot(s) in "
            f"{self.directory})"
        )
