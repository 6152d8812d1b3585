"""Whatever a user hands nbdebug, told apart once (:func:`resolve_source`), and as one
replayable training step (:func:`resolve_step`).

The debugger, :func:`nbdebug.diagnose`, :func:`nbdebug.check`, the ``%nbdebug`` magic and
the command line take a source in the same forms: a recorded
:class:`~nbdebug.core.trace.result.Trace`, a :class:`~nbdebug.core.snapshot.Snapshot`, a
:class:`~nbdebug.NonFiniteError` (which names its snapshot), the path of a snapshot file, a
directory of snapshots, or a model and its batch. :func:`resolve_source` is the one place
those forms are told apart and checked, with one set of error sentences; each entry point
says which kinds it takes (:class:`Caller`) and keeps its own behaviour for them (the
debugger opens a directory of per-rank files as the per-rank debugger, the command line
carries on without a model, the magic names ``--model`` where a model is missing).
:func:`resolve_step` builds on it what a replay needs: the snapshot's model with its
state, its optimizer rebuilt, its loss and RNG states.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..batch import LossFn, check_inputs, check_model
from ..state import RngState
from ..trace.result import Trace, TraceError
from ..vocab import SourceKind
from .archive import RANK_NAME
from .format import SnapshotError
from .listing import list_snapshots
from .load import ModelSource, load_snapshot
from .snapshot import Snapshot
from .write import Scaler

if TYPE_CHECKING:  # pragma: no cover
    from ..guard.history import HistoryRow

__all__ = [
    "ALL_KINDS",
    "STEP_KINDS",
    "Caller",
    "ResolveOptions",
    "ResolvedStep",
    "Source",
    "SourceError",
    "expected_forms",
    "model_missing",
    "resolve_source",
    "resolve_step",
    "source_kind",
]

#: every kind of source, and those that are a step to replay (a recorded Trace is not)
ALL_KINDS = frozenset(SourceKind)
STEP_KINDS = frozenset({SourceKind.SNAPSHOT, SourceKind.DIRECTORY, SourceKind.MODEL})

#: the forms a source takes, as the error sentences name them (in this order)
FORMS: tuple[tuple[SourceKind, str], ...] = (
    (SourceKind.TRACE, "a Trace"),
    (SourceKind.SNAPSHOT, "a Snapshot"),
    (SourceKind.SNAPSHOT, "a snapshot path (with model=...)"),
    (SourceKind.DIRECTORY, "a directory of snapshots"),
    (SourceKind.SNAPSHOT, "a NonFiniteError"),
    (SourceKind.MODEL, "a torch.nn.Module with its batch"),
)


class SourceError(TypeError, ValueError):
    """A source of a form the caller does not take, or given with the wrong companions (a
    batch beside a snapshot, a model without its batch, a batch given twice): one sentence
    saying what was expected and what was given. It is a ``TypeError`` and a
    ``ValueError`` both, as the entry points raised one or the other before."""


@dataclass(frozen=True)
class Caller:
    """The entry point that resolves a source (:func:`resolve_source`).

    Attributes
    ----------
    name : str
        The call the error sentences name (``"diagnose"`` reads ``diagnose(path) ...``).
    accept : frozenset of SourceKind
        The kinds it takes; another is refused in one sentence listing these. A directory
        where only files are taken is read as a file (which says it is a directory).
    need_model : bool
        A snapshot must come with its model (given, or built by a trusted recipe): else a
        :class:`SnapshotError` whose ``needs_model`` is set (see :func:`model_missing`).
    """

    name: str = "resolve_source"
    accept: frozenset[SourceKind] = ALL_KINDS
    need_model: bool = False


@dataclass(frozen=True)
class Source:
    """What a user handed nbdebug, told apart by :func:`resolve_source`.

    Attributes
    ----------
    kind : SourceKind
    model : torch.nn.Module or None
        ``MODEL``: the user's module, untouched (a ``torch.compile``'d one as it is).
    inputs, target
        ``MODEL``: the batch. ``TRACE``: what was given beside the trace (or ``None``).
    snapshot : Snapshot or None
        ``SNAPSHOT``: the snapshot, loaded with the given model (or without one).
    trace : Trace or None
        ``TRACE``: the trace (a ``TraceError``'s partial trace).
    error : str or None
        ``TRACE`` from a ``TraceError``: its message.
    directory : pathlib.Path or None
    files : tuple of pathlib.Path
        ``DIRECTORY``: its readable snapshot files, the earliest step first.
    per_rank : bool
        ``DIRECTORY``: the files of its earliest step are the per-rank files of one
        distributed step (``...-rankN.nbsnap``, :func:`nbdebug.compare_ranks`).
    factory : torch.nn.Module or callable or None
        ``DIRECTORY``: the architecture given for its files (``model=``, or in the batch's
        place: ``resolve_source(directory, make_model)``).
    """

    kind: SourceKind
    model: torch.nn.Module | None = None
    inputs: object = None
    target: object = None
    snapshot: Snapshot | None = None
    trace: Trace | None = None
    error: str | None = None
    directory: Path | None = None
    files: tuple[Path, ...] = ()
    per_rank: bool = False
    factory: ModelSource | None = None


def source_kind(source: object) -> SourceKind | None:
    """The kind of source ``source`` is (``None``: no form nbdebug takes); nothing is read
    (a path is a directory or else a snapshot file)."""
    from ..guard.failure import NonFiniteError  # core.guard imports the snapshots

    if isinstance(source, (Trace, TraceError)):
        return SourceKind.TRACE
    if isinstance(source, (Snapshot, NonFiniteError)):
        return SourceKind.SNAPSHOT
    if isinstance(source, (str, os.PathLike)):
        return SourceKind.DIRECTORY if Path(source).is_dir() else SourceKind.SNAPSHOT
    if isinstance(source, torch.nn.Module) or _model_tuple(source):
        return SourceKind.MODEL
    return None


def _model_tuple(source: object) -> bool:
    return (
        isinstance(source, (tuple, list))
        and len(source) in (2, 3)
        and isinstance(source[0], torch.nn.Module)
    )


def resolve_source(
    source: object,
    inputs: object = None,
    target: object = None,
    *,
    model: ModelSource | None = None,
    trust_recipe: bool = False,
    caller: str | Caller = "resolve_source",
) -> Source:
    """Tell apart what ``source`` is, check it, and load a snapshot it names.

    Parameters
    ----------
    source : Trace, TraceError, Snapshot, NonFiniteError, str or PathLike, torch.nn.Module or tuple
        A recorded trace; a snapshot; the error a guard raised (its snapshot); the path of
        a snapshot file; a directory of snapshots (listed, not loaded); a model (with
        ``inputs``) or a ``(model, inputs[, target])`` tuple.
    inputs, target : optional
        The batch of a model. For a path ``inputs`` may be the model (or its factory):
        ``resolve_source(path, make_model)``.
    model : torch.nn.Module or callable, optional
        The architecture a snapshot is loaded with (a module, copied, or a zero-argument
        factory); also reloads a :class:`Snapshot` that was loaded without one.
    trust_recipe : bool
        Without a model, build it with the recorded recipe (this runs that code).
    caller : str or Caller
        The entry point (its name in the sentences, the kinds it takes, whether a snapshot
        needs a model).

    Returns
    -------
    Source

    Raises
    ------
    SourceError
        A kind the caller does not take, a batch beside a snapshot, a model without its
        batch (or given twice), ``model=`` beside a model or a trace.
    SnapshotError
        A file that cannot be read, a directory without a readable snapshot file, an error
        without a snapshot, a snapshot without a model where the caller needs one
        (``needs_model`` set).

    Examples
    --------
    >>> src = resolve_source("snapshots/", caller=Caller("debug"))
    >>> src.kind, src.files, src.per_rank
    """
    who = caller if isinstance(caller, Caller) else Caller(caller)
    kind = source_kind(source)
    if kind is None or (kind not in who.accept and kind is not SourceKind.DIRECTORY):
        raise SourceError(_expected(who, source))
    if isinstance(source, (Trace, TraceError)):
        return _trace_source(source, inputs, target, model, who)
    if kind is SourceKind.MODEL:
        return _model_source(source, inputs, target, model, who)
    if isinstance(source, Snapshot):
        if inputs is not None or target is not None:
            raise SourceError(_batch_given(who, "snapshot"))
        return _loaded(source, model, who)
    path = _path_of(source)
    if model is None and (isinstance(inputs, torch.nn.Module) or callable(inputs)):
        model, inputs = inputs, None  # resolve_source(path, factory)
    if inputs is not None or target is not None:
        what = "directory" if kind is SourceKind.DIRECTORY else "path"
        raise SourceError(_batch_given(who, what))
    if kind is SourceKind.DIRECTORY:
        listed = _directory(path, model)
        if SourceKind.DIRECTORY in who.accept:
            return listed
        # a caller that takes files only: reading the directory as one says what it is
    return _loaded(load_snapshot(path, model, trust_recipe=trust_recipe), None, who)


def expected_forms(accept: Iterable[SourceKind], also: Iterable[str] = ()) -> str:
    """The forms of the kinds ``accept`` (and ``also``, what a caller takes besides) as
    the error sentences list them: ``"a Snapshot, ..., or a torch.nn.Module with its batch"``."""
    kinds = set(accept)
    forms = [text for kind, text in FORMS if kind in kinds] + list(also)
    return f"{', '.join(forms[:-1])}, or {forms[-1]}" if len(forms) > 1 else forms[0]


def _expected(who: Caller, source: object) -> str:
    listed = expected_forms(who.accept)
    return f"{who.name}() expects {listed}; got {type(source).__qualname__}."


def _batch_given(who: Caller, what: str) -> str:
    return (
        f"{who.name}({what}) takes no inputs or target: it takes the batch from the snapshot "
        "(a Snapshot carries its batch; pass the model as model=, not a batch)."
    )


def model_missing(snap: Snapshot, caller: str) -> SnapshotError:
    """The error of a snapshot loaded without the model that ``caller`` needs
    (``needs_model`` set, so that an entry point can name its own way to give one)."""
    where = str(snap.path) if snap.path is not None else "this snapshot"
    hint = ""
    if snap.recipe is not None:
        recipe = snap.recipe["factory"]
        hint = f", or trust_recipe=True to build it with the recorded recipe {recipe!r}"
    err = SnapshotError(
        f"{where} was loaded without a model: give {caller}(..., model=...) (a module or a "
        f"zero-argument factory for {snap.model_class}){hint}."
    )
    err.needs_model = True
    return err


def _trace_source(
    source: Trace | TraceError, inputs: object, target: object, model: object, who: Caller
) -> Source:
    if model is not None:
        raise SourceError(f"{who.name}(trace) takes no model=: the trace is already recorded.")
    if isinstance(source, TraceError):
        if source.trace is None:
            raise SourceError("this TraceError carries no partial trace: nothing was recorded.")
        return Source(
            SourceKind.TRACE, trace=source.trace, error=str(source), inputs=inputs, target=target
        )
    return Source(SourceKind.TRACE, trace=source, inputs=inputs, target=target)


def _model_source(
    source: object, inputs: object, target: object, model: object, who: Caller
) -> Source:
    if model is not None:
        raise SourceError(
            f"{who.name}(model, inputs) takes no model=: the model is the first argument."
        )
    net = source
    if isinstance(source, (tuple, list)):
        net = source[0]
        if inputs is not None:
            raise SourceError(
                f"{who.name}((model, inputs)): inputs were given twice: in the source tuple "
                "and as inputs=."
            )
        inputs = source[1]
        if len(source) == 3:
            if target is not None:
                raise SourceError(
                    f"{who.name}((model, inputs, target)): target was given twice: in the "
                    "source tuple and as target=."
                )
            target = source[2]
    assert isinstance(net, torch.nn.Module)
    if inputs is None:
        raise SourceError(f"{who.name}(model, inputs) needs the batch: inputs is missing.")
    check_inputs(inputs)
    return Source(SourceKind.MODEL, model=net, inputs=inputs, target=target)


def _path_of(source: object) -> str | os.PathLike[str]:
    """A path as it is; a NonFiniteError's snapshot path."""
    if isinstance(source, (str, os.PathLike)):
        return source
    path = getattr(source, "path", None)
    if path is None:
        raise SnapshotError(
            f"this {type(source).__name__} carries no snapshot (max_snapshots was reached, "
            "or the write failed): nothing to replay."
        )
    return Path(path)


def _directory(path: str | os.PathLike[str], factory: ModelSource | None) -> Source:
    """A directory's readable snapshot files (the earliest step first) and whether those
    of its earliest step are the per-rank files of one distributed step."""
    import pandas as pd

    df = list_snapshots(path)
    ok = df[df["error"].isna()]
    if ok.empty:
        raise SnapshotError(f"the directory {Path(path)} holds no readable snapshot file.")
    files = tuple(Path(p) for p in ok["path"])
    steps = [None if pd.isna(s) else int(s) for s in ok["step"]]
    first = [f for f, s in zip(files, steps) if s == steps[0]] if steps[0] is not None else []
    per_rank = bool(first) and all(RANK_NAME.search(f.name) for f in first)
    return Source(
        SourceKind.DIRECTORY, directory=Path(path), files=files, per_rank=per_rank, factory=factory
    )


def _loaded(snap: Snapshot, model: ModelSource | None, who: Caller) -> Source:
    """A loaded snapshot (reloaded with ``model`` when it has none)."""
    if snap.model is None and model is not None and snap.path is not None:
        snap = load_snapshot(snap.path, model, trust_recipe=snap.trust_recipe)
    if who.need_model and snap.model is None:
        raise model_missing(snap, who.name)
    return Source(SourceKind.SNAPSHOT, snapshot=snap)


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
    inputs: object = None,
    target: object = None,
    *,
    loss_fn: LossFn | None = None,
    model: ModelSource | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    history: object = None,
    options: ResolveOptions | None = None,
) -> ResolvedStep:
    """The step that ``source`` stands for, as one :class:`ResolvedStep`
    (:func:`resolve_source` tells the source apart; a snapshot must have a model).

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
    SourceError
        An unsupported source, a batch given with a snapshot, a model without its batch,
        an optimizer given with a snapshot (a ``TypeError``).
    ValueError
        An optimizer over parameters that are not the model's.
    SnapshotError
        A file that cannot be read, a directory without a readable snapshot, a snapshot
        without a model.
    """
    opts = options if options is not None else ResolveOptions()
    who = Caller(opts.caller, STEP_KINDS, need_model=True)
    trust = opts.trust_recipe
    src = resolve_source(source, inputs, target, model=model, trust_recipe=trust, caller=who)
    notes: list[str] = []
    if src.kind is SourceKind.DIRECTORY:
        earliest = src.files[0]
        notes.append(f"took {earliest.name}, the earliest snapshot in {source}")
        src = resolve_source(earliest, model=src.factory, trust_recipe=trust, caller=who)
    if src.snapshot is not None:
        if optimizer is not None:
            raise SourceError(
                f"{who.name}(snapshot, optimizer=...): a snapshot replays its own optimizer "
                f"state; give {who.name}(model, inputs, optimizer=...) for a live optimizer."
            )
        return _from_snapshot(src.snapshot, loss_fn, history, opts, notes)
    return _from_model(src, loss_fn, optimizer, history, opts)


def _from_snapshot(
    snap: Snapshot,
    loss_fn: LossFn | None,
    history: object,
    opts: ResolveOptions,
    notes: list[str],
) -> ResolvedStep:
    from ..guard.history import parse_history

    step = snap.replay_step(loss_fn, f"{opts.caller}(snapshot, loss_fn=...)")
    opt = None
    try:
        opt = snap.build_optimizer()
    except SnapshotError as e:
        notes.append(f"{str(e).rstrip('.')}: the weights after the update are not checked.")
    scaler = opts.scaler
    return ResolvedStep(
        model=step.model,  # the trainer's own loss code around the model, if it had one
        inputs=step.inputs,
        target=step.target,
        loss_fn=step.loss_fn,
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
    src: Source,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    history: object,
    opts: ResolveOptions,
) -> ResolvedStep:
    from ..guard.history import parse_history

    m = check_model(src.model)  # a compiled model replays through the module it wraps
    if optimizer is not None:
        _check_optimizer(m, optimizer)
    scaler = opts.scaler
    return ResolvedStep(
        model=m,
        inputs=src.inputs,
        target=src.target,
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
