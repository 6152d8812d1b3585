"""The options of :class:`nbdebug.NaNGuard`, in the groups a user thinks in.

:class:`GuardOptions` is made of one frozen group each for what the guard checks
(:class:`WatchOptions`), what it does with a bad step (:class:`FailureOptions`), its
snapshots (:class:`SnapshotOptions`), its history (:class:`HistoryOptions`), the GradScaler
rules (:class:`ScalerOptions`) and the distributed agreement (:class:`DistributedOptions`).
Every option keeps its flat keyword: ``NaNGuard(model, opt, directory=..., patience=3)``
is ``GuardOptions.from_settings(directory=..., patience=3)``. Each group validates its
values when it is made, so a wrong value fails where it is given (a trainer callback's
options too, before training starts).

A new option goes in the group it belongs to (a rewind window next to ``history``, a spike
detector next to ``checks``, what to do on a spike next to ``on_nonfinite``) and is a flat
keyword of the guard from then on.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..batch import check_flag, check_loss_fn
from ..options import grouped_options
from ..snapshot.data import parse_recipe
from .checks import resolve_checks
from .rewind import check_rewind
from .signals import SignalSettings, signal_settings
from .skips import check_limits
from .spike import SPIKE_ACTIONS, SpikeAction, SpikeSettings, spike_settings
from .update_watch import check_update_mode

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from .checks import StepChecks

__all__ = [
    "ACTIONS",
    "Action",
    "DistributedOptions",
    "FailureOptions",
    "GuardOptions",
    "HistoryOptions",
    "ScalerOptions",
    "SnapshotOptions",
    "WatchOptions",
]

#: what the guard does with a bad step (``on_nonfinite``)
Action = Literal["skip", "raise", "continue"]
ACTIONS: tuple[Action, ...] = ("skip", "raise", "continue")
_HALF = ("float16", "bfloat16")


def _positive_int(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


@dataclass(frozen=True)
class WatchOptions:
    """What the guard looks at on each step.

    Attributes
    ----------
    checks : StepChecks, bool, int or dict
        Health checks on the live model after each decision (``True``: every 50 steps,
        a number of steps, ``{"every": n, "clip_norm": c}``, or a ``StepChecks`` object
        such as ``nbdebug.GuardChecks(every=50)``); ``False``/``None``: off.
    param_norm_every : int
        Measure the total weight norm every this many checks (and on every bad step).
    spike : bool, float, dict or SpikeSettings
        The spike detector (:mod:`nbdebug.core.guard.spike`): ``True`` (default: robust
        z-score above 6 against the last 128 healthy steps, warm-up 32), a z threshold, a
        dict ``{"z": ..., "window": ..., "warmup": ...}`` or a :class:`SpikeSettings`;
        ``False``/``None``: off.
    signals : bool, dict or SignalSettings
        The per-layer signals (:mod:`nbdebug.core.guard.signals`): ``True`` (default:
        gradient norms every step, the update ratio after each rewind copy (every 10th
        step without one), Adam's lag every 10th, a ring of 500 steps), a dict
        ``{"ring", "update_every", "adam_every", "modules"}`` or a :class:`SignalSettings`;
        ``False``/``None``: off.
    check_update : bool or "rollback"
        Check every optimizer step after a passed ``check()``
        (:mod:`nbdebug.core.guard.update_watch`: one fused finiteness read of the updated
        weights, of the optimizer state every 10th step): ``True`` (default) catches a bad
        update at its step; ``"rollback"`` also keeps a pre-step copy, so the bad update
        is undone exactly and its snapshot replays it; ``False``/``None``: off.
    """

    checks: StepChecks | bool | int | Mapping[str, Any] | None = False
    param_norm_every: int = 10
    spike: SpikeSettings | bool | float | Mapping[str, Any] | None = True
    signals: SignalSettings | bool | Mapping[str, Any] | None = True
    check_update: bool | str | None = True

    def __post_init__(self) -> None:
        if not _positive_int(self.param_norm_every):
            raise ValueError(
                f"param_norm_every must be a positive int; got {self.param_norm_every!r}."
            )
        resolve_checks(self.checks)  # validates (the guard resolves its own copy)
        spike_settings(self.spike)  # validates
        signal_settings(self.signals)  # validates
        check_update_mode(self.check_update)  # validates

    @property
    def spike_settings(self) -> SpikeSettings | None:
        """``spike`` as settings (``None``: the detector is off)."""
        return spike_settings(self.spike)

    @property
    def signal_settings(self) -> SignalSettings | None:
        """``signals`` as settings (``None``: off)."""
        return signal_settings(self.signals)


@dataclass(frozen=True)
class FailureOptions:
    """What the guard does with a bad step.

    Attributes
    ----------
    on_nonfinite : {"skip", "raise", "continue"}
    patience : int or None
        Consecutive bad steps tolerated under ``"skip"``/``"continue"`` (``None``: never
        raise).
    on_spike : {"snapshot", "skip", "raise", "ignore"}
        What a spike (a finite step the spike detector flags) does: ``"snapshot"``
        (default) writes a snapshot of kind ``"spike"`` and the step goes on; ``"skip"``
        also skips the update (``check()`` returns ``False``), up to 8 in a row: a longer
        run of flagged steps is a new level, whose updates go on (a warning says so);
        ``"raise"`` writes it and raises :class:`NonFiniteError` (``kind="spike"``);
        ``"ignore"``: only the finding in the history. One snapshot per run of
        consecutive spikes.
    max_skips_in_row : int or None
        More skipped updates in a row than this (the guard's, a spike's, a GradScaler
        overflow's) stop the run: :class:`NonFiniteError` with a snapshot. ``None``: no limit.
    max_skip_fraction : float or None
        A share of skipped updates above this (judged from the 20th step, while skipping)
        stops the run the same way. ``None``: no limit.
    """

    on_nonfinite: Action = "skip"
    patience: int | None = 1
    on_spike: SpikeAction = "snapshot"
    max_skips_in_row: int | None = None
    max_skip_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {ACTIONS}; got {self.on_nonfinite!r}.")
        if self.on_spike not in SPIKE_ACTIONS:
            raise ValueError(f"on_spike must be one of {SPIKE_ACTIONS}; got {self.on_spike!r}.")
        check_limits(self.max_skips_in_row, self.max_skip_fraction)
        p = self.patience
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise ValueError(f"patience must be a non-negative int or None; got {p!r}.")


@dataclass(frozen=True)
class SnapshotOptions:
    """Where and how the snapshots of bad steps are written.

    Attributes
    ----------
    directory : str or PathLike
    max_snapshots : int or None
        At most this many files per guard.
    async_save : bool
        Write the files on a background thread.
    loss_fn : callable, optional
        Stored by import path, so that ``snap.trace()`` replays without arguments.
    recipe : str, optional
        ``"package.module:factory"`` that builds the model, with ``recipe_kwargs`` (JSON).
    recipe_kwargs : dict, optional
    autocast : torch.dtype, str or None
        The autocast dtype the step's forward runs in (for a ``check()`` after the block).
    """

    directory: str | os.PathLike[str] = "nbdebug-snapshots"
    max_snapshots: int | None = 20
    async_save: bool = False
    loss_fn: Callable[..., Any] | None = None
    recipe: str | None = None
    recipe_kwargs: Mapping[str, Any] | None = None
    autocast: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        m = self.max_snapshots
        if m is not None and (not isinstance(m, int) or m < 1):
            raise ValueError(f"max_snapshots must be a positive int or None; got {m!r}.")
        if not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(
                f"directory must be a str or os.PathLike; got {type(self.directory).__qualname__}."
            )
        check_loss_fn(self.loss_fn)
        parse_recipe(self.recipe, self.recipe_kwargs)  # validates
        check_flag(self.async_save, "async_save")
        if self.autocast is not None:
            self.autocast_field("cpu")  # validates

    @property
    def recipe_spec(self) -> dict[str, Any] | None:
        """The recipe as the snapshot's ``recipe`` field."""
        return parse_recipe(self.recipe, self.recipe_kwargs)

    def autocast_field(self, device_type: str) -> dict[str, str] | None:
        """``autocast`` as the snapshot's ``autocast`` field, on ``device_type``."""
        value = self.autocast
        if value is None:
            return None
        name = str(value).replace("torch.", "") if isinstance(value, (torch.dtype, str)) else None
        if name not in _HALF:
            raise ValueError(
                "autocast must be torch.float16, torch.bfloat16 (or 'float16', 'bfloat16') or "
                f"None; got {value!r}."
            )
        return {"device_type": device_type, "dtype": name}


@dataclass(frozen=True)
class HistoryOptions:
    """What the guard remembers of the steps.

    Attributes
    ----------
    history : int
        Length of the rolling history kept and stored in snapshots.
    rewind : int, "auto", bool or None
        The rewind window (:mod:`nbdebug.core.guard.rewind`): a copy of the model,
        optimizer, scheduler and scaler states refreshed every ``rewind`` steps, and every
        step since, stored in snapshots. ``"auto"`` (default): every 8 steps when the
        state fits ``min(2 GiB, 25 % of the available RAM)``, else off; ``True``: every 8
        steps; ``0``/``None``/``False``: off.
    """

    history: int = 500
    rewind: int | str | bool | None = "auto"

    def __post_init__(self) -> None:
        if not _positive_int(self.history):
            raise ValueError(f"history must be a positive int; got {self.history!r}.")
        check_rewind(self.rewind)


@dataclass(frozen=True)
class ScalerOptions:
    """The GradScaler rules: when a collapsing scale is a failure (``kind="scale"``).

    Attributes
    ----------
    min_scale : float
        A scale below this is a failure.
    scaler_patience : int
        This many overflow-skipped steps in a row is a failure.
    """

    min_scale: float = 1.0
    scaler_patience: int = 20

    def __post_init__(self) -> None:
        ms = self.min_scale
        number = isinstance(ms, (int, float)) and not isinstance(ms, bool)
        if not number or not 0 <= ms < math.inf:
            raise ValueError(f"min_scale must be a finite number >= 0; got {ms!r}.")
        if not _positive_int(self.scaler_patience):
            raise ValueError(
                f"scaler_patience must be a positive int; got {self.scaler_patience!r}."
            )
        object.__setattr__(self, "min_scale", float(ms))


@dataclass(frozen=True)
class DistributedOptions:
    """The agreement of a distributed run (see :mod:`nbdebug.core.guard.agreement`).

    Attributes
    ----------
    process_group : torch.distributed.ProcessGroup, None or False
        ``None``: a DDP model's group, else the default group when ``torch.distributed``
        is initialised; ``False``: no agreement.
    check_replicas_every : int or None
        Compare a fingerprint of every parameter across the ranks every this many steps.
    timeout : float, optional
        Seconds every collective waits for the other ranks (default 300).
    """

    process_group: ProcessGroup | Literal[False] | None = None
    check_replicas_every: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        every = self.check_replicas_every
        if every is not None and not _positive_int(every):
            raise ValueError(f"check_replicas_every must be a positive int or None; got {every!r}.")
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {t!r}.")


#: the groups of :class:`GuardOptions`, by attribute
GROUPS: dict[str, type] = {
    "checks": WatchOptions,
    "failure": FailureOptions,
    "snapshots": SnapshotOptions,
    "history": HistoryOptions,
    "scaler": ScalerOptions,
    "distributed": DistributedOptions,
}


@dataclass(frozen=True)
class GuardOptions:
    """Every option of a :class:`nbdebug.NaNGuard`, by group.

    Attributes
    ----------
    checks : WatchOptions
    failure : FailureOptions
    snapshots : SnapshotOptions
    history : HistoryOptions
    scaler : ScalerOptions
    distributed : DistributedOptions

    Examples
    --------
    >>> opts = GuardOptions.from_settings(directory="snaps", patience=3)
    >>> opts.failure.patience
    3
    >>> guard = nbdebug.NaNGuard(model, opt, options=opts)
    """

    checks: WatchOptions = field(default_factory=WatchOptions)
    failure: FailureOptions = field(default_factory=FailureOptions)
    snapshots: SnapshotOptions = field(default_factory=SnapshotOptions)
    history: HistoryOptions = field(default_factory=HistoryOptions)
    scaler: ScalerOptions = field(default_factory=ScalerOptions)
    distributed: DistributedOptions = field(default_factory=DistributedOptions)

    @staticmethod
    def names() -> tuple[str, ...]:
        """Every flat option name, group by group."""
        return tuple(f.name for g in GROUPS.values() for f in dataclasses.fields(g))

    @classmethod
    def from_settings(cls, base: GuardOptions | None = None, **settings: Any) -> GuardOptions:
        """The options ``base`` (default: the defaults) with the flat ``settings``
        (``directory=``, ``patience=``, ...) put into their groups and validated.

        Raises
        ------
        TypeError
            A name that is no option (the message lists the options).
        ValueError
            A value its option refuses.
        """
        base = base if base is not None else cls()
        return grouped_options(base, GROUPS, settings, where="NaNGuard()")

    def agreed(self) -> dict[str, object]:
        """The options every rank of a distributed run must share (they decide what every
        rank does with a bad step), as plain data."""
        return {
            "on_nonfinite": self.failure.on_nonfinite,
            "patience": self.failure.patience,
            "min_scale": self.scaler.min_scale,
            "scaler_patience": self.scaler.scaler_patience,
        }
