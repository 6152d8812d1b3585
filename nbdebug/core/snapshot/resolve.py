"""Whatever a user hands nbdebug, as one training step: :func:`resolve_step`.

The debugger, :func:`nbdebug.diagnose`, :func:`nbdebug.check`, the ``%nbdebug`` magic and
the command line all take "a step" in the same forms: a model and its batch, a
:class:`~nbdebug.core.snapshot.Snapshot`, a :class:`~nbdebug.NonFiniteError` (which names
its snapshot), the path of a snapshot file, or a directory of snapshots (its earliest
readable one). This module is the one place those forms are told apart and checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..batch import check_inputs, check_model
from ..state import RngState
from .data import to_device
from .format import SnapshotError
from .listing import earliest_snapshot
from .load import ModelSource, load_snapshot
from .snapshot import Snapshot
from .write import Scaler

if TYPE_CHECKING:  # pragma: no cover
    from ..guard.history import HistoryRow

__all__ = ["ResolveOptions", "ResolvedStep", "resolve_step"]


@dataclass(frozen=True)
class ResolveOptions:
    """How :func:`resolve_step` resolves a source.

    Attributes
    ----------
    trust_recipe : bool
        A snapshot path given without ``model=``: build the model with the recorded recipe
        (this imports and runs that code: only for files you trust).
    scaler : torch.amp.GradScaler, optional
        A live scaler whose state replaces the snapshot's.
    caller : str
        The function named in the error sentences (``"diagnose"``).
    """

    trust_recipe: bool = False
    scaler: Scaler | None = None
    caller: str = "resolve_step"


@dataclass
class ResolvedStep:
    """One training step, ready to replay.

    Attributes
    ----------
    model : torch.nn.Module
        The model to replay on: the caller's module, or a snapshot's copy with the stored
        state loaded (never the caller's own object for a snapshot).
    inputs, target
        The batch (a snapshot's on the model's device).
    loss_fn : callable or None
        The given loss, else the one the snapshot recorded.
    optimizer : torch.optim.Optimizer or None
        The caller's, or the snapshot's rebuilt with its state (``None`` when it cannot be:
        see :attr:`notes`).
    scaler_state : dict or None
        The GradScaler state of the step.
    rng : RngState
        The RNG states the step starts from (the snapshot's, else the current ones).
    history : list of HistoryRow
        The run's rows: ``history=`` when given, else the snapshot's.
    step : int or None
    recorded_failure : str or None
        What the run recorded at this step, in words (a snapshot's failure).
    notes : list of str
        What was chosen or left out, one sentence each (the snapshot of a directory that
        was taken, an optimizer that could not be rebuilt).
    snapshot : Snapshot or None
    autocast : dict or None
        The step's recorded autocast state (the snapshot's ``autocast`` field).
    """

    model: torch.nn.Module
    inputs: Any
    target: Any
    loss_fn: Any
    optimizer: torch.optim.Optimizer | None
    scaler_state: dict[str, Any] | None
    rng: RngState
    history: list[HistoryRow]
    step: int | None = None
    recorded_failure: str | None = None
    notes: list[str] = field(default_factory=list)
    snapshot: Snapshot | None = None
    autocast: dict[str, Any] | None = None


def resolve_step(
    source: object,
    inputs: Any = None,
    target: Any = None,
    *,
    loss_fn: Any = None,
    model: ModelSource | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    history: object = None,
    options: ResolveOptions | None = None,
) -> ResolvedStep:
    """The step that ``source`` stands for, as one :class:`ResolvedStep`.

    Parameters
    ----------
    source : torch.nn.Module, (model, inputs[, target]), Snapshot, NonFiniteError, str or PathLike
        A model (with ``inputs``); a snapshot; the error a guard raised (its snapshot); the
        path of a snapshot file (with ``model=`` or ``trust_recipe``); a directory of
        snapshots (the earliest readable one).
    inputs, target : optional
        The batch of a model source. For a path source ``inputs`` may be the model (or its
        factory): ``resolve_step(path, factory)``.
    loss_fn : callable, optional
        Overrides the snapshot's recorded loss.
    model : torch.nn.Module or callable, optional
        The architecture of a snapshot loaded without one (a module, copied, or a
        zero-argument factory).
    optimizer : torch.optim.Optimizer, optional
        A model source's live optimizer (over the model's parameters).
    history : NaNGuard, list of dict or DataFrame, optional
        The run's history rows (see :func:`nbdebug.parse_history`).
    options : ResolveOptions, optional

    Returns
    -------
    ResolvedStep

    Examples
    --------
    >>> step = resolve_step("snapshots/", model=make_model)   # the earliest snapshot
    >>> step.model, step.inputs, step.recorded_failure

    Raises
    ------
    TypeError
        An unsupported source, a batch given with a snapshot, a model without its batch.
    ValueError
        An optimizer over parameters that are not the model's.
    SnapshotError
        A file that cannot be read, a directory without a readable snapshot, a snapshot
        without a model.
    """
    opts = options if options is not None else ResolveOptions()
    src, inputs, model, notes = _unwrap(source, inputs, model, opts)
    if isinstance(src, Snapshot):
        if inputs is not None or target is not None:
            raise TypeError(
                f"a Snapshot carries its batch: {opts.caller}(snapshot) takes no inputs or target."
            )
        if optimizer is not None:
            raise TypeError(
                f"{opts.caller}(snapshot, optimizer=...): a snapshot replays its own optimizer "
                f"state; give {opts.caller}(model, inputs, optimizer=...) for a live optimizer."
            )
        return _from_snapshot(src, loss_fn, model, history, opts, notes)
    if isinstance(src, (tuple, list)) and len(src) in (2, 3):  # (model, inputs[, target])
        parts: tuple[object, ...] = tuple(src)
        if isinstance(parts[0], torch.nn.Module):
            if inputs is not None or (len(parts) == 3 and target is not None):
                raise TypeError(f"{opts.caller}((model, inputs)) got the batch twice.")
            src, inputs = parts[0], parts[1]
            target = parts[2] if len(parts) == 3 else target
    if isinstance(src, torch.nn.Module):
        if model is not None:
            raise TypeError(
                f"{opts.caller}(model, inputs) takes no model=: the model is the first argument."
            )
        return _from_model(src, inputs, target, loss_fn, optimizer, history, opts)
    raise TypeError(
        f"{opts.caller}() expects a Snapshot, a snapshot path (with model=...), a "
        f"NonFiniteError, or a model and its batch; got {type(src).__qualname__}."
    )


def _unwrap(
    source: object, inputs: Any, model: ModelSource | None, opts: ResolveOptions
) -> tuple[object, Any, ModelSource | None, list[str]]:
    """An error's snapshot path, a path's (or a directory's earliest) snapshot, loaded."""
    notes: list[str] = []
    if isinstance(source, BaseException) and hasattr(source, "path"):
        path = source.path
        if path is None:
            raise SnapshotError(
                f"this {type(source).__name__} carries no snapshot (max_snapshots was reached, "
                "or the write failed): nothing to replay."
            )
        source = path
    if not isinstance(source, (str, os.PathLike)):
        return source, inputs, model, notes
    if model is None and (isinstance(inputs, torch.nn.Module) or callable(inputs)):
        model, inputs = inputs, None  # resolve_step(path, factory)
    if inputs is not None:
        raise TypeError(
            f"{opts.caller}(path, ...) takes the batch from the snapshot: pass the model as "
            "model=, not a batch."
        )
    p = Path(source)
    if p.is_dir():
        p = earliest_snapshot(p)
        notes.append(f"took {p.name}, the earliest snapshot in {source}")
    return load_snapshot(p, model, trust_recipe=opts.trust_recipe), None, model, notes


def _from_snapshot(
    snap: Snapshot,
    loss_fn: Any,
    model: ModelSource | None,
    history: object,
    opts: ResolveOptions,
    notes: list[str],
) -> ResolvedStep:
    from ..guard.history import parse_history

    if snap.model is None:
        if model is None or snap.path is None:
            raise SnapshotError(
                f"this snapshot was loaded without a model: give {opts.caller}(snapshot, "
                f"model=...) (a module or a zero-argument factory for {snap.model_class})."
            )
        snap = load_snapshot(snap.path, model, trust_recipe=snap.trust_recipe)
    m = snap.reset_model()
    loss_fn = snap.replay_loss_fn(loss_fn, f"{opts.caller}(snapshot, loss_fn=...)")
    opt = None
    try:
        opt = snap.build_optimizer()
    except SnapshotError as e:
        notes.append(f"{str(e).rstrip('.')}: the weights after the update are not checked.")
    device = next((p.device for p in m.parameters()), torch.device("cpu"))
    scaler = opts.scaler
    return ResolvedStep(
        model=m,
        inputs=to_device(snap.inputs, device),
        target=to_device(snap.target, device),
        loss_fn=loss_fn,
        optimizer=opt,
        scaler_state=snap.scaler_state if scaler is None else scaler.state_dict(),
        rng=_snapshot_rng(snap),
        history=parse_history(history if history is not None else snap.history),
        step=snap.step,
        recorded_failure=snap.recorded_failure,
        notes=notes,
        snapshot=snap,
        autocast=snap.autocast,
    )


def _snapshot_rng(snap: Snapshot) -> RngState:
    """The RNG states the snapshot's step started from (the current ones when it has none);
    the caller's states are left as they were."""
    if snap.rng is None:
        return RngState.capture()
    caller = RngState.capture()
    try:
        snap.restore_rng()
        return RngState.capture()
    finally:
        caller.restore()


def _from_model(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer | None,
    history: object,
    opts: ResolveOptions,
) -> ResolvedStep:
    from ..guard.history import parse_history

    m = check_model(model)
    if inputs is None:
        raise TypeError(f"{opts.caller}(model, inputs, ...) needs the batch: inputs is missing.")
    check_inputs(inputs)
    if optimizer is not None:
        _check_optimizer(m, optimizer)
    scaler = opts.scaler
    return ResolvedStep(
        model=m,
        inputs=inputs,
        target=target,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scaler_state=None if scaler is None else scaler.state_dict(),
        rng=RngState.capture(),
        history=parse_history(history),
    )


def _check_optimizer(model: torch.nn.Module, optimizer: object) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, Iterable):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__qualname__}."
        )
    own = {id(p) for p in model.parameters()}
    foreign = [p for g in groups if isinstance(g, Mapping) for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's: "
            "pass the optimizer built over this model's parameters."
        )
