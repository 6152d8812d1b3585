"""The parts of :class:`~nbdebug.core.guard.NaNGuard`'s step: what it reads
(:class:`StepReading`), what it decides (:class:`Verdict`), its rules
(:class:`GuardOptions`), the health checks it is given (:class:`StepChecks`) and where
its snapshots go (:class:`SnapshotWriter`)."""

from __future__ import annotations

import abc
import math
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .batch import check_flag
from .distributed import SNAPSHOT_FIELDS, Agreement, full_tensors, is_dtensor, process_rank
from .snapshot import save_snapshot
from .snapshot_data import cpu_copy
from .snapshot_format import atomic_save, unique_path
from .state import RngState

if TYPE_CHECKING:  # pragma: no cover
    from .guard import NaNGuard

__all__ = ["ACTIONS", "GuardOptions", "SnapshotWriter", "StepChecks", "StepReading", "Verdict"]

ACTIONS = ("skip", "raise", "continue")


@dataclass(frozen=True)
class StepReading:
    """What :meth:`NaNGuard.measure_step` read of one step (one host read).

    Attributes
    ----------
    step : int
    loss : float or None
        ``None`` when the step passed no loss.
    grad_norm : float
        Total L2 norm of the gradients, unscaled (float64 when float32 overflowed).
    param_norm : float or None
        Total L2 norm of the weights (``None`` on steps that do not measure it).
    lr : float or None
        The first parameter group's learning rate.
    scale : float or None
        The GradScaler's scale (``None`` without an enabled scaler).
    scaled : bool
        Whether the gradients were still multiplied by ``scale`` when read.
    ranks : Agreement or None
        Distributed: every rank's local verdict on this step (set by ``NaNGuard.agree``;
        ``None`` for one process).
    """

    step: int
    loss: float | None
    grad_norm: float
    param_norm: float | None
    lr: float | None
    scale: float | None
    scaled: bool = False
    ranks: Agreement | None = None

    @property
    def loss_bad(self) -> bool:
        return self.loss is not None and not math.isfinite(self.loss)

    @property
    def finite(self) -> bool:
        """Loss, total gradient norm and (when measured) weight norm are all finite."""
        return not (
            self.loss_bad
            or not math.isfinite(self.grad_norm)
            or (self.param_norm is not None and not math.isfinite(self.param_norm))
        )


@dataclass
class Verdict:
    """The guard's decision on one :class:`StepReading`.

    Attributes
    ----------
    reading : StepReading
        What the decision acted on (on a bad step with the weight norm measured).
    kind : {"loss", "grad", "weights", "scale", "rank"} or None
        The failure, or ``None`` (go on and step); ``"rank"``: another rank's values were
        not finite (distributed).
    scaler_skip : bool
        The GradScaler skips this overflow step itself (not a failure).
    detail : dict
        On a non-finite reading: the element-wise look (``nonfinite_weights``,
        ``nonfinite_grads``, ``grad_norms``, ``param_norms``) and ``message_extra``.
    """

    reading: StepReading
    kind: str | None = None
    scaler_skip: bool = False
    detail: dict[str, Any] = field(default_factory=dict)


class StepChecks(abc.ABC):
    """What ``NaNGuard(checks=...)`` calls after each decision: health checks on the live
    model, owned by an object that keeps its own state (cadence, what it recorded).

    Core never imports the health checks: :class:`nbdebug.analysis.checks_guard.GuardChecks`
    implements this; ``nbdebug.NaNGuard`` turns ``checks=True`` / an int / a dict into one.
    """

    def attach(self, guard: NaNGuard) -> None:  # noqa: B027 (optional hook)
        """Called once by ``NaNGuard.__init__`` with the guard it serves."""

    @abc.abstractmethod
    def run(self, guard: NaNGuard, reading: StepReading, *, failing: bool) -> Mapping[str, Any]:
        """Check the step just read; return the fields to add to its history row
        (e.g. ``{"checks": [...]}``), empty when this step is not checked. Never raises."""


@dataclass(frozen=True)
class GuardOptions:
    """The guard's decision rules and bookkeeping (see :class:`NaNGuard`'s parameters of
    the same names), validated on construction."""

    patience: int | None = 1
    on_nonfinite: str = "skip"
    history: int = 500
    min_scale: float = 1.0
    scaler_patience: int = 20
    max_snapshots: int | None = 20
    param_norm_every: int = 10

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {ACTIONS}; got {self.on_nonfinite!r}.")
        p = self.patience
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise ValueError(f"patience must be a non-negative int or None; got {p!r}.")
        if not _positive_int(self.history):
            raise ValueError(f"history must be a positive int; got {self.history!r}.")
        m = self.max_snapshots
        if m is not None and (not isinstance(m, int) or m < 1):
            raise ValueError(f"max_snapshots must be a positive int or None; got {m!r}.")
        if not _positive_int(self.param_norm_every):
            raise ValueError(
                f"param_norm_every must be a positive int; got {self.param_norm_every!r}."
            )
        ms = self.min_scale
        number = isinstance(ms, (int, float)) and not isinstance(ms, bool)
        if not number or not 0 <= ms < math.inf:
            raise ValueError(f"min_scale must be a finite number >= 0; got {ms!r}.")
        if not _positive_int(self.scaler_patience):
            raise ValueError(
                f"scaler_patience must be a positive int; got {self.scaler_patience!r}."
            )
        object.__setattr__(self, "min_scale", float(ms))


def _positive_int(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


def _check_directory(directory: Path) -> None:
    """Refuse, when the guard is made rather than at the failing step, a snapshot
    directory that cannot be one: an existing file, or a path under one."""
    for p in (directory, *directory.parents):
        if p.exists():
            if not p.is_dir():
                what = "is an existing file" if p == directory else f"is under {p}, a file"
                raise ValueError(
                    f"directory must be a directory for the snapshots; {directory} {what}."
                )
            return


class SnapshotWriter:
    """Writes the snapshot of a failing step (at most ``max_snapshots``); ``paths`` lists
    what it wrote. The one place a guard touches the disk.

    With ``async_save`` the snapshot's tensors are copied to the CPU during the step and
    the file is written on a background thread (atomically: a crash leaves no file under
    the final name); :meth:`close` waits for the writes and raises the first error.
    The threads are not daemons: a process that exits waits for them."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_snapshots: int | None,
        loss_fn: Callable[..., Any] | None,
        recipe: dict[str, Any] | None,
        async_save: bool = False,
    ) -> None:
        check_flag(async_save, "async_save")
        self.directory = Path(directory)
        _check_directory(self.directory)
        self.max_snapshots = max_snapshots
        self.loss_fn = loss_fn
        self.recipe = recipe
        self.async_save = async_save
        self.paths: list[Path] = []
        #: (path, exception) of background writes that failed (raised by :meth:`close`)
        self.errors: list[tuple[Path, BaseException]] = []
        self._threads: list[threading.Thread] = []
        #: further snapshot fields by key (``"trainer"``, ...), written into every snapshot
        self.fields: dict[str, Any] = {}

    def write(
        self,
        guard: NaNGuard,
        step: int,
        reason: dict[str, Any],
        inputs: Any,
        target: Any,
        *,
        rng: RngState,
        distributed: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Save the snapshot of ``step`` (the guard's model, optimizer, scaler, scheduler
        and history, the batch, ``rng`` as of the start of the step); ``None`` once
        ``max_snapshots`` files were written.

        ``distributed`` (the agreement's record: ``rank``, ``world_size``, ``local_first``,
        ``culprit_ranks``, ...) goes into the snapshot fields of those names and names the
        file ``step-...-rankN.nbsnap``. A sharded (FSDP2) model's state is gathered whole
        first: every rank writes at the same step, so every rank joins the all-gathers."""
        if self.max_snapshots is not None and len(self.paths) >= self.max_snapshots:
            return None
        fields = (
            {k: distributed[k] for k in SNAPSHOT_FIELDS if k in distributed} if distributed else {}
        )
        rank = fields.get("rank", process_rank())
        model_state = optimizer_state = None
        if any(is_dtensor(p) for p in guard.model.parameters()):
            model_state = full_tensors(guard.model.state_dict())
            if guard.optimizer is not None:
                optimizer_state = full_tensors(guard.optimizer.state_dict())
        path = save_snapshot(
            unique_path(self.directory, step, rank=rank),
            guard.model,
            inputs,
            target,
            optimizer=guard.optimizer,
            scaler=guard.scaler,
            scheduler=guard.scheduler,
            step=step,
            reason=reason,
            history=list(guard.history),
            recipe=self.recipe,
            loss_fn=self.loss_fn,
            rng=rng,
            state_dict=model_state,
            optimizer_state_dict=optimizer_state,
            write=self._write_in_background if self.async_save else None,
            **self.fields,
            **fields,
        )
        self.paths.append(path)
        return path

    def _write_in_background(self, payload: dict[str, Any], path: Path) -> Path:
        payload = cpu_copy(payload)  # training goes on and changes the live tensors

        def run() -> None:
            try:
                atomic_save(payload, path)
            except BaseException as e:  # surfaced by close()
                self.errors.append((path, e))
                warnings.warn(
                    f"nbdebug: writing the snapshot {path} failed: {e}",
                    RuntimeWarning,
                    stacklevel=1,
                )

        thread = threading.Thread(target=run, name=f"nbdebug-snapshot-{path.name}")
        thread.start()
        self._threads.append(thread)
        return path

    def close(self) -> None:
        """Wait for the background writes; raise ``OSError`` naming the first that failed."""
        while self._threads:
            self._threads.pop(0).join()
        if self.errors:
            path, error = self.errors[0]
            raise OSError(
                f"the background write of the snapshot {path} failed "
                f"({type(error).__name__}: {error}); {len(self.errors)} write(s) failed."
            ) from error
