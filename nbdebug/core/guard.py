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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from .batch import check_loss_fn, check_model
from .distributed import (
    KIND_BITS,
    REMOTE_KIND,
    RankAgreement,
    local_tensor,
    unwrap_data_parallel,
)
from .guard_step import (
    ACTIONS,
    GuardOptions,
    SnapshotWriter,
    StepChecks,
    StepReading,
    Verdict,
)
from .norms import fused_norms, total_norm
from .snapshot import autocast_state
from .snapshot_format import parse_recipe
from .state import BufferCopies, RngState, unique_parameters
from .text import fmt_num

_last: NonFiniteError | None = None


class NonFiniteError(RuntimeError):
    """A guarded training step was not finite and the guard was told to stop.

    Attributes
    ----------
    path : pathlib.Path or None
        The snapshot of the first bad step of the current run of bad steps (``None``
        only when ``max_snapshots`` was exhausted).
    step : int
        That step.
    reason : dict
        ``"kind"`` (``"loss"``, ``"grad"``, ``"weights"``, ``"scale"``) and ``"message"``,
        with the measured values.
    """

    def __init__(self, message: str, *, path: Path | None, step: int, reason: dict[str, Any]):
        super().__init__(message)
        self.path = path
        self.step = step
        self.reason = reason

    def __reduce__(self) -> Any:
        return (_rebuild_error, (str(self), self.path, self.step, self.reason))


def _rebuild_error(
    message: str, path: Path | None, step: int, reason: dict[str, Any]
) -> NonFiniteError:
    return NonFiniteError(message, path=path, step=step, reason=reason)


def last_error() -> NonFiniteError | None:
    """The last :class:`NonFiniteError` a guard raised in this process (or, failing
    that, the one IPython stored in ``sys.last_exc`` / ``sys.last_value``)."""
    if _last is not None:
        return _last
    for name in ("last_exc", "last_value"):
        err = getattr(sys, name, None)
        if isinstance(err, NonFiniteError):
            return err
    return None


def _check_optimizer_of(model: torch.nn.Module, optimizer: Any) -> None:
    """An optimizer over none of the model's parameters is another model's (one over some
    parameters outside the model, such as a learned temperature, is fine)."""
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if own and held and not any(id(p) in own for p in held):
        raise ValueError(
            f"the optimizer holds {len(held)} parameter(s), none of them the model's: "
            "expected the optimizer built over this model's parameters (model.parameters())."
        )


def _training_objects(optimizer: Any, scaler: Any, scheduler: Any) -> tuple[Any, Any, Any]:
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or None; got "
            f"{type(optimizer).__qualname__}."
        )
    if scaler is not None and not (hasattr(scaler, "state_dict") and hasattr(scaler, "get_scale")):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None; got {type(scaler).__qualname__}."
        )
    if scheduler is not None and not hasattr(scheduler, "state_dict"):
        raise TypeError(
            "scheduler must have a state_dict() (an LR scheduler); got "
            f"{type(scheduler).__qualname__}."
        )
    return optimizer, scaler, scheduler


_HALF = ("float16", "bfloat16")


def _autocast_option(value: Any, device_type: str) -> dict[str, str]:
    """``NaNGuard(autocast=...)`` as the snapshot's ``autocast`` field."""
    name = str(value).replace("torch.", "") if isinstance(value, (torch.dtype, str)) else None
    if name not in _HALF:
        raise ValueError(
            "autocast must be torch.float16, torch.bfloat16 (or 'float16', 'bfloat16') or "
            f"None; got {value!r}."
        )
    return {"device_type": device_type, "dtype": name}


def _option(owner: str, name: str) -> Any:
    """A read-only guard attribute that is ``guard.<owner>.<name>``."""
    return property(
        lambda self: getattr(getattr(self, owner), name), doc=f"``{owner}.{name}`` (read-only)."
    )


class GuardedStep:
    """What ``with guard.step(...) as s:`` yields: set ``s.loss`` in the block; after the
    block ``s.ok`` tells whether the step was finite (and the optimizer stepped)."""

    def __init__(self, guard: NaNGuard, inputs: Any, target: Any, step: int | None):
        self.guard = guard
        self.inputs = inputs
        self.target = target
        self.step = step
        self.loss: Any = None
        self.ok: bool | None = None

    def __repr__(self) -> str:
        return f"GuardedStep(step={self.step}, ok={self.ok})"


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
        (``"checks"``). Here a :class:`StepChecks` object, e.g.
        ``nbdebug.analysis.checks_guard.GuardChecks(every=50, clip_norm=1.0)`` (one per
        guard: it keeps the cadence). ``nbdebug.NaNGuard`` (this class, extended by
        :mod:`nbdebug.analysis.checks_guard`) also takes ``True`` (every 50 steps), a
        number of steps, or ``{"every": n, "clip_norm": c}``; ``False``/``None``: off.
    param_norm_every : int
        Measure the total parameter norm every this many checks (and on every bad step);
        other history rows hold ``None``. Reading all weights is a pass over memory as
        long as the gradient check itself: every 10th step keeps the guard near 1 % of a
        step. ``1``: every step.
    process_group : torch.distributed.ProcessGroup, None or False
        Distributed training (see :mod:`nbdebug.core.distributed`): every rank's ``check()``
        joins one tiny ``all_reduce`` so that all ranks skip a step that any rank found
        non-finite, and each writes its own snapshot (``step-000000003-rank1.nbsnap``).
        ``None``: a DDP model's group, else the default group when ``torch.distributed`` is
        initialised; ``False``: no agreement (this rank decides alone). A DDP/DataParallel
        wrapper is unwrapped: snapshots hold the inner module's state.
    check_replicas_every : int or None
        Distributed: every this many steps compare a fingerprint of every parameter across
        the ranks (one ``all_gather``); the first that differs is a
        :class:`~nbdebug.core.distributed.ReplicaMismatch` finding (a warning, the history
        row's ``"replicas"``, :attr:`replica_findings`). ``None``: off.
    timeout : float, optional
        Distributed: seconds every collective of the agreement waits for the other ranks
        (default 300) before raising :class:`~nbdebug.core.distributed.RankError` naming the
        rank(s) that did not answer.
    async_save : bool
        Copy a snapshot's tensors to the CPU during the step and write the file on a
        background thread, so that a run that goes on (``on_nonfinite="continue"``) is
        not blocked by the disk. :meth:`close` waits for the writes and raises the first
        error; a process that exits waits for them too.
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
        The decision rules (``patience``, ``on_nonfinite``, ``min_scale``, ...).
    checks : StepChecks or None
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
        scaler: Any = None,
        scheduler: Any = None,
        directory: str | os.PathLike[str] = "nbdebug-snapshots",
        patience: int | None = 1,
        on_nonfinite: str = "skip",
        history: int = 500,
        loss_fn: Callable[..., Any] | None = None,
        recipe: str | None = None,
        recipe_kwargs: dict[str, Any] | None = None,
        min_scale: float = 1.0,
        scaler_patience: int = 20,
        max_snapshots: int | None = 20,
        checks: Any = False,
        param_norm_every: int = 10,
        process_group: Any = None,
        check_replicas_every: int | None = None,
        timeout: float | None = None,
        async_save: bool = False,
        autocast: torch.dtype | str | None = None,
    ):
        wrapper = model
        if isinstance(model, torch.nn.Module):
            model = unwrap_data_parallel(model)
        self.model = check_model(model)
        self.optimizer, self.scaler, self.scheduler = _training_objects(
            optimizer, scaler, scheduler
        )
        _check_optimizer_of(self.model, self.optimizer)
        self.options = GuardOptions(
            patience=patience,
            on_nonfinite=on_nonfinite,
            history=history,
            min_scale=min_scale,
            scaler_patience=scaler_patience,
            max_snapshots=max_snapshots,
            param_norm_every=param_norm_every,
        )
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"directory must be a str or os.PathLike; got {type(directory).__qualname__}."
            )
        check_loss_fn(loss_fn)
        self.writer = SnapshotWriter(
            directory,
            max_snapshots=max_snapshots,
            loss_fn=loss_fn,
            recipe=parse_recipe(recipe, recipe_kwargs),
            async_save=async_save,
        )
        self.checks: StepChecks | None = self.resolve_checks(checks)
        if self.checks is not None:
            self.checks.attach(self)

        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.snapshots: list[Path] = self.writer.paths
        self.ok: bool | None = None
        self.bad_streak = 0
        self.scaler_streak = 0
        self._streak_first: tuple[Path | None, int, dict[str, Any]] | None = None
        self._next_step = 0
        self._checks = 0

        self._params = unique_parameters(model)
        seen = {id(p) for p in self._params}
        self._extra = []  # optimizer parameters outside the model: their gradients are cleared too
        if optimizer is not None:
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                if id(p) not in seen:
                    seen.add(id(p))
                    self._extra.append(p)
        devices = {p.device for p in self._params}
        self._device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        if autocast is not None:
            self.writer.fields["autocast"] = _autocast_option(autocast, self._device.type)
        self._buffers: BufferCopies | None = None
        self.mark_step_start()
        self.agreement = RankAgreement.create(
            wrapper,
            list(self.model.named_parameters()),
            process_group,
            timeout=timeout,
            check_replicas_every=check_replicas_every,
            options={
                k: getattr(self.options, k)
                for k in ("on_nonfinite", "patience", "min_scale", "scaler_patience")
            },
        )

    @property
    def replica_findings(self) -> list[Any]:
        """The replica check's findings so far (empty when it is off)."""
        return self.agreement.replica_findings if self.agreement is not None else []

    @staticmethod
    def resolve_checks(checks: Any) -> StepChecks | None:
        """The ``checks=`` option as a :class:`StepChecks` (or ``None``: off). Core takes a
        ``StepChecks`` object; ``nbdebug.NaNGuard`` extends this to ``True``/int/dict."""
        if checks is None or checks is False:
            return None
        if isinstance(checks, StepChecks):
            return checks
        raise TypeError(
            "nbdebug.core.guard.NaNGuard(checks=...) takes a StepChecks object, e.g. "
            "nbdebug.analysis.checks_guard.GuardChecks(every=50); use nbdebug.NaNGuard for "
            f"checks=True, a number of steps or a dict; got {checks!r}."
        )

    # the options, readable as before
    directory = _option("writer", "directory")
    loss_fn = _option("writer", "loss_fn")
    recipe = _option("writer", "recipe")
    max_snapshots = _option("options", "max_snapshots")
    patience = _option("options", "patience")
    on_nonfinite = _option("options", "on_nonfinite")
    min_scale = _option("options", "min_scale")
    scaler_patience = _option("options", "scaler_patience")
    param_norm_every = _option("options", "param_norm_every")

    # ------------------------------------------------------------------ checking
    def _exact_norm(self, tensors: Sequence[torch.Tensor]) -> float:
        """The norm in float64: finite elements whose float32 sum of squares overflowed
        (a diverging run, |x| ~ 1e19) still give a finite norm. Only when float32 said inf."""
        with torch.no_grad():
            ts = [t.detach() for t in tensors]
            return float(total_norm(ts, device=self._device, dtype=torch.float64))

    def _scaler_unscaled(self) -> bool:
        """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last update."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if self.optimizer is None or not isinstance(states, dict):
            return False
        stage = states.get(id(self.optimizer), {}).get("stage")
        return getattr(stage, "name", "") == "UNSCALED"

    def _scale_info(self) -> tuple[Any, bool]:
        """(the scaler's scale as a tensor or float or None, whether grads are still scaled)."""
        sc = self.scaler
        if sc is None or not getattr(sc, "is_enabled", lambda: True)():
            return None, False
        scale = getattr(sc, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            scale = float(sc.get_scale())
        return scale, not self._scaler_unscaled()

    def check(
        self,
        loss: Any,
        *,
        inputs: Any = None,
        target: Any = None,
        step: int | None = None,
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
        step = self._step_number(step)
        if torch.is_autocast_enabled(self._device.type):
            # checked inside the autocast block: the snapshots replay under this state,
            # the backward too (it came before this check, so inside the block as well)
            self.writer.fields["autocast"] = autocast_state(self._device.type, backward=True)
        measure_params = self._checks % self.options.param_norm_every == 0
        self._checks += 1
        reading = self.agree(self.measure_step(loss, step=step, measure_params=measure_params))
        row = self._record(reading)
        verdict = self.decide(reading)
        reading = verdict.reading  # a bad step's weight norm is always measured
        row["param_norm"], row["skipped"] = reading.param_norm, verdict.scaler_skip
        if self.checks is not None:  # health checks, recorded in the row (e.g. row["checks"])
            row.update(self.checks.run(self, reading, failing=verdict.kind is not None))
        if verdict.kind is None:
            self._passed()
            return True
        return self._fail(verdict, row, reading, inputs, target)

    def _step_number(self, step: Any) -> int:
        if step is None:
            step = self._next_step
        elif isinstance(step, bool) or not isinstance(step, int):
            try:
                step = int(step)
            except (TypeError, ValueError):
                raise TypeError(f"step must be an int; got {type(step).__qualname__}.") from None
        self._next_step = step + 1
        return step

    def _loss_tensor(self, loss: Any) -> torch.Tensor:
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"loss must be a scalar; got a tensor of shape {tuple(loss.shape)}."
                )
            return loss.detach().reshape(()).to(self._device, torch.float32)
        if loss is None:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        if isinstance(loss, (int, float)):
            return torch.tensor(float(loss), dtype=torch.float32, device=self._device)
        raise TypeError(
            f"loss must be a scalar tensor, a float or None; got {type(loss).__qualname__}."
        )

    def _grads(self) -> list[torch.Tensor]:
        # an FSDP2 gradient is a DTensor: this rank measures its own shard, no collective
        grads = [local_tensor(g) for g in (p.grad for p in self._params) if g is not None]
        if any(g.is_sparse for g in grads):  # nn.Embedding(sparse=True)
            grads = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        return grads

    def _local_params(self) -> list[torch.Tensor]:
        return [local_tensor(p) for p in self._params]

    def measure_step(self, loss: Any, *, step: int, measure_params: bool = True) -> StepReading:
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
        loss_t = self._loss_tensor(loss)
        grads = self._grads()
        scale, scaled = self._scale_info()
        dev = self._device
        with torch.no_grad():
            parts = [loss_t, total_norm(grads, device=dev)]
            if measure_params:
                parts.append(total_norm(self._local_params(), device=dev))
        if isinstance(scale, torch.Tensor):
            parts.append(scale.detach().reshape(()).to(dev, torch.float32))
        lr: Any = None
        if self.optimizer is not None and self.optimizer.param_groups:
            lr = self.optimizer.param_groups[0].get("lr")
            if isinstance(lr, torch.Tensor):
                parts.append(lr.detach().reshape(()).to(dev, torch.float32))
        values = iter(torch.stack(parts).tolist())  # the one host synchronisation
        loss_v = next(values)
        gnorm = next(values)
        pnorm: float | None = next(values) if measure_params else None
        if isinstance(scale, torch.Tensor):
            scale = next(values)
        if isinstance(lr, torch.Tensor):
            lr = next(values)
        if math.isinf(gnorm):
            gnorm = self._exact_norm(grads)
        if pnorm is not None and math.isinf(pnorm):
            pnorm = self._exact_norm(self._local_params())
        if scale is not None and scaled and scale > 0 and math.isfinite(gnorm):
            gnorm = gnorm / scale
        return StepReading(
            step=step,
            loss=loss_v if loss is not None else None,
            grad_norm=gnorm,
            param_norm=pnorm,
            lr=float(lr) if isinstance(lr, (int, float)) else None,
            scale=scale,
            scaled=scaled,
        )

    def agree(self, reading: StepReading) -> StepReading:
        """The reading the decision acts on. One process: its own. Distributed: the same
        reading with ``ranks`` set, every rank's local verdict from one ``all_reduce(MAX)``
        (see :mod:`nbdebug.core.distributed`), which :meth:`decide` turns into the same
        decision on every rank. The replica check runs here when it is due."""
        ag = self.agreement
        if ag is None:
            return reading
        bits = 0
        if reading.loss_bad:
            bits |= KIND_BITS["loss"]
        if not math.isfinite(reading.grad_norm) and self.scaler is None:
            bits |= KIND_BITS["grad"]  # with a scaler, an overflow is the scaler's business
        if reading.param_norm is not None and not math.isfinite(reading.param_norm):
            bits |= KIND_BITS["weights"]
        outcome = ag.agree(reading.step, bits)
        if ag.due(reading.step):
            outcome.checked_replicas = True
            outcome.replicas = ag.compare_replicas(
                reading.step, list(self.model.named_parameters())
            )
            if outcome.replicas is not None:
                warnings.warn(outcome.replicas.message, RuntimeWarning, stacklevel=3)
        return dataclasses.replace(reading, ranks=outcome)

    def _record(self, reading: StepReading) -> dict[str, Any]:
        row: dict[str, Any] = {
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
        """Fail, or go on: what is not finite (an element-wise look only on a non-finite
        reading) and the GradScaler rules (an overflow the scaler skips is no failure until
        ``scaler_patience`` in a row or a scale below ``min_scale``). Updates the scaler
        streak. Distributed (``reading.ranks`` set by :meth:`agree`): a step that another
        rank found non-finite fails here too, ``kind="rank"``; ``detail["distributed"]``
        says who saw what (the snapshot's distributed fields)."""
        opts = self.options
        scale = reading.scale
        verdict = Verdict(reading=reading)
        if not reading.finite:
            verdict.kind, verdict.detail = self._diagnose(reading)
            if reading.param_norm is None:  # a bad step: the weights are measured too
                norms = verdict.detail["param_norms"].values()
                pnorm = math.sqrt(sum(v * v for v in norms))
                verdict.reading = dataclasses.replace(reading, param_norm=pnorm)
        if verdict.kind == "grad" and scale is not None:
            # the scaler sees the inf/NaN gradients and skips this update itself
            verdict.kind = None
            verdict.scaler_skip = True
            self.scaler_streak += 1
            if self.scaler_streak >= opts.scaler_patience:
                verdict.kind = "scale"
                verdict.detail["message_extra"] = f"{self.scaler_streak} overflow steps in a row"
        elif scale is not None:
            self.scaler_streak = 0
        if verdict.kind is None and scale is not None and scale < opts.min_scale:
            verdict.kind = "scale"
            verdict.detail["message_extra"] = (
                f"the scale fell to {fmt_num(scale, none='None')} (< min_scale={opts.min_scale:g})"
            )
        ranks = reading.ranks
        if ranks is not None and ranks.any_bad:  # another rank (or this one) was not finite
            if verdict.kind is None:
                _, verdict.detail = self._diagnose(verdict.reading)
                verdict.detail["message_extra"] = ranks.message(reading.step)
                verdict.kind = REMOTE_KIND
                if verdict.reading.param_norm is None:
                    norms = verdict.detail["param_norms"].values()
                    pnorm = math.sqrt(sum(v * v for v in norms))
                    verdict.reading = dataclasses.replace(verdict.reading, param_norm=pnorm)
            verdict.detail["distributed"] = ranks.record(list(self.model.named_parameters()))
        return verdict

    @torch.no_grad()
    def _diagnose(self, reading: StepReading) -> tuple[str | None, dict[str, Any]]:
        """Element-wise look at what is not finite (only on a bad step)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        pnorm, gnorm, scale = reading.param_norm, reading.grad_norm, reading.scale

        def bad_of(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, int]]:
            out = {}
            for name, t in pairs:
                fin = torch.isfinite(t)
                if not bool(fin.all()):
                    n_nan = int(torch.isnan(t).sum())
                    out[name] = {"nan": n_nan, "inf": int(t.numel() - int(fin.sum()) - n_nan)}
            return out

        weights = {}
        if pnorm is None or not math.isfinite(pnorm):
            weights = bad_of(
                [(names.get(id(p), "?"), local_tensor(p).detach()) for p in self._params]
            )
        with_grad = [
            (names.get(id(p), "?"), local_tensor(p.grad))
            for p in self._params
            if p.grad is not None
        ]
        bad_grads = bad_of([(n, g) for n, g in with_grad]) if not math.isfinite(gnorm) else {}
        grad_norms = {}
        if with_grad:
            norms = fused_norms([g for _, g in with_grad], dtype=torch.float64).tolist()
            div = scale if scale is not None and scale > 0 and self.scaler is not None else 1.0
            grad_norms = {n: v / div for (n, _), v in zip(with_grad, norms)}
        weight_norms = fused_norms([t.detach() for t in self._local_params()], dtype=torch.float64)
        detail: dict[str, Any] = {
            "nonfinite_weights": weights,
            "nonfinite_grads": bad_grads,
            "grad_norms": grad_norms,
            "param_norms": dict(
                zip([names.get(id(p), "?") for p in self._params], weight_norms.tolist())
            ),
        }
        if weights:
            return "weights", detail
        if reading.loss_bad:
            return "loss", detail
        if bad_grads:
            return "grad", detail
        return None, detail  # a norm overflowed but every element is finite

    def _message(self, kind: str, step: int, loss: float | None, detail: dict[str, Any]) -> str:
        def listing(d: dict[str, dict[str, int]]) -> str:
            items = [f"{n} ({v['nan']} NaN, {v['inf']} Inf)" for n, v in list(d.items())[:5]]
            more = f" and {len(d) - 5} more" if len(d) > 5 else ""
            return ", ".join(items) + more

        if kind == "weights":
            return f"non-finite weights at step {step}: {listing(detail['nonfinite_weights'])}"
        if kind == "loss":
            grads = detail["nonfinite_grads"]
            tail = f"; non-finite gradients in {listing(grads)}" if grads else ""
            return f"non-finite loss ({fmt_num(loss, none='None')}) at step {step}{tail}"
        if kind == "grad":
            with_loss = (
                "with no loss given to the guard"
                if loss is None
                else f"with a finite loss ({fmt_num(loss)})"
            )
            return (
                f"non-finite gradients at step {step} {with_loss}: "
                f"{listing(detail['nonfinite_grads'])}"
            )
        if kind == REMOTE_KIND:
            return str(detail.get("message_extra", ""))
        return f"GradScaler scale collapsing at step {step}: {detail.get('message_extra', '')}"

    def _passed(self) -> None:
        self.bad_streak = 0
        self._streak_first = None
        self.mark_step_start()
        self.ok = True

    def _fail(
        self,
        verdict: Verdict,
        row: dict[str, Any],
        reading: StepReading,
        inputs: Any,
        target: Any,
    ) -> bool:
        kind, detail, step, action = verdict.kind, verdict.detail, reading.step, self.on_nonfinite
        assert kind is not None
        message = self._message(kind, step, reading.loss, detail)
        detail.pop("message_extra", None)
        distributed = detail.pop("distributed", None)  # snapshot fields of their own
        if distributed is not None and kind != REMOTE_KIND:
            message += (
                f" (rank {distributed['rank']} of {distributed['world_size']}; culprit rank(s) "
                f"{distributed['culprit_ranks']}: every rank skips this step)"
            )
        reason: dict[str, Any] = {
            "kind": kind,
            "message": message,
            "step": step,
            "loss": reading.loss,
            "grad_norm": reading.grad_norm,
            "param_norm": reading.param_norm,
            "scale": reading.scale,
            "action": action,
            **detail,
        }
        row["nonfinite"] = kind
        row["skipped"] = action != "continue"
        rng = self._rng  # the states at the start of the failing step (torch, numpy, Python)
        if rng.cuda is None:  # CUDA was first used during the step
            rng = dataclasses.replace(rng, cuda=RngState.capture().cuda)
        buffers = self._buffers
        assert buffers is not None
        written = buffers.written(self.model)
        as_at_start: Any = nullcontext()
        if written:
            # the forward of the bad batch wrote them (BatchNorm running statistics): the
            # snapshot holds them as they were at the start of the step, and a skipped
            # step leaves the model as if the batch never came
            reason["buffers_written"] = written
            reason["buffers_restored"] = action != "continue"
            if action == "continue":
                as_at_start = buffers.swapped_in()
            else:
                buffers.restore()
        try:
            with as_at_start:
                path = self.writer.write(
                    self, step, reason, inputs, target, rng=rng, distributed=distributed
                )
        except OSError as e:  # a full or unwritable disk: the step is still handled
            path = None
            warnings.warn(
                f"nbdebug: the snapshot of step {step} could not be written to "
                f"{self.writer.directory} ({type(e).__name__}: {e}); the guard goes on "
                f"without it ({action}).",
                RuntimeWarning,
                stacklevel=3,
            )
        self.bad_streak += 1
        if self._streak_first is None:
            self._streak_first = (path, step, reason)
        if action != "continue":
            self.clear_grads()
        self.ok = False
        self.mark_step_start()
        too_many = self.patience is not None and self.bad_streak > self.patience
        if action == "raise" or too_many:
            first_path, first_step, first_reason = self._streak_first
            saved = (
                f"Snapshot: {first_path}"
                if first_path is not None
                else "No snapshot was written (max_snapshots reached, or the write failed)"
            )
            if action == "raise":
                text = f"{message}. {saved}"
            else:
                text = (
                    f"{self.bad_streak} non-finite steps in a row "
                    f"(patience={self.patience}); the first, "
                    f"step {first_step}: {first_reason['message']}. {saved}"
                )
            err = NonFiniteError(text, path=first_path, step=first_step, reason=first_reason)
            global _last
            _last = err
            raise err
        return False

    def close(self) -> None:
        """Wait for the snapshots still being written (``async_save``); raise ``OSError``
        naming the first write that failed."""
        self.writer.close()

    def mark_step_start(self) -> None:
        """Record the RNG states and the buffers now as the start of the coming step (what
        a replay of its snapshot restores, and what a skipped step puts back in the
        buffers). :meth:`check` records them after each step by itself; call this when the
        loop draws random numbers or writes buffers between steps (data loading, a trainer
        callback's ``on_train_batch_start``)."""
        self._rng = RngState.capture()
        self._buffers = BufferCopies.capture(self.model, self._buffers)

    def clear_grads(self) -> None:
        """Set every gradient of the model (and optimizer) to ``None``: an optimizer step
        then leaves those parameters unchanged."""
        for p in self._params:
            p.grad = None
        for p in self._extra:
            p.grad = None

    # ------------------------------------------------------------------ other forms
    @contextmanager
    def step(
        self, inputs: Any = None, target: Any = None, *, step: int | None = None
    ) -> Iterator[GuardedStep]:
        """A guarded training step (context manager).

        In the block do the forward and backward and set ``s.loss``. On leaving it the
        guard checks; when the step is finite it steps the optimizer (through the scaler,
        then ``scaler.update()``, when there is one); then it zeroes the gradients. The
        RNG state at the start of the block is what a replay uses.
        """
        s = GuardedStep(self, inputs, target, step)
        self.mark_step_start()
        yield s
        self._finish(s)

    def _finish(self, s: GuardedStep) -> None:
        loss = s.loss
        if isinstance(loss, (tuple, list)) and loss:
            loss = loss[0]
        if loss is None:
            raise ValueError(
                "set s.loss inside the guarded step (with guard.step(...) as s: s.loss = ...)."
            )
        opt = self.optimizer
        try:
            s.ok = self.check(loss, inputs=s.inputs, target=s.target, step=s.step)
            if opt is not None and self.scaler is not None:
                if s.ok:
                    self.scaler.step(opt)
                if s.ok or self._scaler_unscaled():
                    # after unscale_() in the block the scaler expects its update(), also on
                    # a step the guard skipped (the next unscale_() raises otherwise)
                    self.scaler.update()
            elif s.ok and opt is not None:
                opt.step()
        finally:
            if opt is not None:
                opt.zero_grad(set_to_none=True)

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

        def deco(f: Callable[..., Any]) -> Callable[..., Any]:
            sig = inspect.signature(f)
            params = list(sig.parameters)

            def pick(bound: inspect.BoundArguments, which: int | str | None) -> Any:
                if which is None:
                    return None
                name = params[which] if isinstance(which, int) and which < len(params) else which
                return bound.arguments.get(name) if isinstance(name, str) else None

            @functools.wraps(f)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                bound = sig.bind(*args, **kwargs)
                with self.step(pick(bound, inputs), pick(bound, target)) as s:
                    out = f(*args, **kwargs)
                    s.loss = out
                return out

            return wrapper

        return deco(fn) if fn is not None else deco

    # ------------------------------------------------------------------ views
    def history_frame(self) -> Any:
        """The rolling history as a DataFrame (same layout as ``Snapshot.history_frame()``)."""
        from .snapshot import history_frame

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
            f"patience={self.patience}, {where}, {len(self.snapshots)} snapshot(s) in "
            f"{self.directory})"
        )


__all__ = [
    "ACTIONS",
    "GuardOptions",
    "NaNGuard",
    "NonFiniteError",
    "SnapshotWriter",
    "StepChecks",
    "StepReading",
    "Verdict",
    "last_error",
]
