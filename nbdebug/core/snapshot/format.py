"""The snapshot file format: one table of fields drives the writer, the checks and the reader.

A snapshot is one dictionary of tensors and plain Python values: ``"format"``
(:data:`FORMAT`), ``"version"`` (the format version it was written in) and one entry per
row of :data:`FIELDS`. Each row (a :class:`Field`) says the key, the accepted types, the
default, the format version that introduced it, whether a file of that version or newer
must hold it, where it lives in the file (:class:`Lives`) and what it means in one line.

The file (version 5 on, :mod:`~nbdebug.core.snapshot.container`) is one safetensors
file: the tensors are its tensors, the rest one JSON document in its header. Files of
versions 1-4 are ``torch.save`` zip archives, read with ``weights_only=True``.

- :func:`build_payload` (used by :func:`~nbdebug.core.snapshot.save_snapshot`) writes
  every row in table order, filling the rows its producer left out with their defaults;
- :func:`validate_payload` checks a loaded dictionary against the table and fills in the
  rows that an older file lacks with their defaults;
- :func:`snapshot_attributes` gives the values that
  :class:`~nbdebug.core.snapshot.Snapshot` holds, one attribute per row.

:data:`FORMAT_VERSION` is the newest row's ``since``. A file of an older version loads
(its missing rows get their defaults); a file of a newer version is refused with a
:class:`SnapshotError` that says to upgrade nbdebug.

How to add a snapshot field
---------------------------
1. **One row** at the end of :data:`FIELDS`, with ``since`` one more than the newest
   row's (this raises :data:`FORMAT_VERSION`), a one-line ``doc`` and a ``default`` (or a
   ``default_factory`` for a list or dict): files written before the field existed read
   as that default. For example::

       Field("rank", (int, NoneType), "the process's rank in torch.distributed (None: "
             "single process)", since=2, default=None),

   ``required=True`` (the default) makes a file of version ``since`` or newer that lacks
   the key an incomplete file; ``required=False`` lets any file omit it. ``check=`` takes
   a function that raises ``ValueError("what is wrong")`` for a value of the right type
   that is still unusable; ``attr=`` names the :class:`~nbdebug.core.snapshot.Snapshot`
   attribute when it must differ from the key; ``lives=`` says where it lives in the file
   (:class:`Lives`: plain JSON by default; a value holding tensors is ``Lives.TENSORS``,
   or ``Lives.LAZY`` when it is large and read only when used).
2. **The producer** passes the value by keyword: ``save_snapshot(..., rank=rank)`` (the
   guard, a trainer callback). It is stored as plain data and checked against the row's
   types before the file is written.
3. **Reading**: ``snap.rank`` on a loaded :class:`~nbdebug.core.snapshot.Snapshot` (add
   ``rank: int | None`` to the annotations at the top of its class body so type checkers
   know it). Nothing else changes: the writer, the checks, :func:`load_snapshot` and
   :func:`list_snapshots` follow the table.
4. **The test**: the value round-trips, and a file of the previous version (see
   ``tests/test_snapshot_fields.py``) loads with the default.

Never change the types or meaning of an existing row, and never remove one: files
already written hold it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ..text import first_line, shorten
from .fieldchecks import (
    check_autocast,
    check_history,
    check_model_state,
    check_module_training,
    check_optimizer,
    check_reason,
    check_recipe,
    check_rng,
    check_time,
)
from .rewind import check_window

FORMAT = "nbdebug-snapshot"
SUFFIX = ".nbsnap"
#: an import path ``"package.module:qualname"`` (a model factory, a loss, a class)
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
NoneType = type(None)


class Lives(str, Enum):
    """Where a field's value lives in a (version 5) file, and when it is read."""

    #: plain data in the JSON header, read when the file is opened
    JSON = "json"
    #: structure in the JSON header, tensors in the safetensors data, read when opened
    TENSORS = "tensors"
    #: as TENSORS, but the tensors are read when the attribute is first used (the model
    #: state and the optimizer state: the bulk of the file)
    LAZY = "lazy"

    def __str__(self) -> str:
        return self.value


class SnapshotError(Exception):
    """A snapshot file cannot be used: missing, truncated, corrupt, foreign, written by a
    newer nbdebug, or holding a model state that does not fit the given model. The message
    says which, and what was found.

    Examples
    --------
    >>> try:
    ...     snap = nbdebug.load_snapshot("step-000048213.nbsnap", model=make_model)
    ... except nbdebug.SnapshotError as e:
    ...     print(e)   # e.g. "... does not fit the model: missing keys ['head.bias'] ..."

    ``needs_model`` is True when the snapshot was loaded without a model and the call
    needs one (a caller such as the ``%nbdebug`` magic then names its own way to give it).
    """

    needs_model: bool = False


# --------------------------------------------------------------------------- the table


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


#: the ``default`` of a :class:`Field` that has none (its producer must always give it)
NO_DEFAULT: Any = _NoDefault()
_IMMUTABLE = (NoneType, bool, int, float, str, bytes, tuple, frozenset)


@dataclass(frozen=True)
class Field:
    """One entry of the snapshot dictionary (one row of :data:`FIELDS`).

    Parameters
    ----------
    key : str
        The dictionary key in the file.
    types : tuple of type, or None
        The accepted types (``NoneType`` for ``None``); ``None`` accepts any plain data
        (a batch). ``bool`` is only accepted where it is listed, not as an ``int``.
    doc : str
        What the value is, in one line.
    since : int
        The format version that introduced the field.
    required : bool
        A file of version ``since`` or newer must hold it; otherwise any file may omit it.
    default, default_factory
        The value of a file that lacks the field, and of a writer that does not produce
        it (``default_factory`` for mutable values such as lists and dicts).
    attr : str
        The :class:`~nbdebug.core.snapshot.Snapshot` attribute; empty: the key.
    check : callable, optional
        ``check(value)`` raises ``ValueError`` saying what is wrong with a value of the
        right type (a structural check beyond the type).
    lives : Lives
        Where it lives in the file: plain JSON, or JSON with tensors read when the file
        is opened, or when the attribute is first used (``Lives.LAZY``).
    """

    key: str
    types: tuple[type, ...] | None
    doc: str
    _: KW_ONLY
    since: int = 1
    required: bool = True
    default: Any = NO_DEFAULT
    default_factory: Callable[[], Any] | None = None
    attr: str = ""
    check: Callable[[Any], None] | None = None
    lives: Lives = Lives.JSON

    def __post_init__(self) -> None:
        where = f"snapshot field {self.key!r}"
        if not isinstance(self.key, str) or not self.key.isidentifier():
            raise ValueError(f"a snapshot field key must be an identifier; got {self.key!r}.")
        if isinstance(self.since, bool) or not isinstance(self.since, int) or self.since < 1:
            raise ValueError(f"{where}: since must be a format version >= 1; got {self.since!r}.")
        if self.default is not NO_DEFAULT and self.default_factory is not None:
            raise ValueError(f"{where}: give a default or a default_factory, not both.")
        if not isinstance(self.default, _IMMUTABLE) and self.default is not NO_DEFAULT:
            raise ValueError(
                f"{where}: a mutable default ({type(self.default).__name__}) would be shared by "
                "every snapshot; use default_factory."
            )
        if not self.has_default and (self.since > 1 or not self.required):
            why = f"files older than version {self.since}" if self.since > 1 else "files without it"
            raise ValueError(f"{where} needs a default (or a default_factory) for {why}.")

    @property
    def attribute(self) -> str:
        """The name of the :class:`~nbdebug.core.snapshot.Snapshot` attribute."""
        return self.attr or self.key

    @property
    def has_default(self) -> bool:
        return self.default is not NO_DEFAULT or self.default_factory is not None

    def make_default(self) -> Any:
        """A fresh default value."""
        if self.default_factory is not None:
            return self.default_factory()
        if self.default is NO_DEFAULT:
            raise ValueError(f"the snapshot field {self.key!r} has no default.")
        return self.default

    def type_problem(self, value: Any) -> str | None:
        """What is wrong with the type of ``value`` (``None`` when it is accepted)."""
        if self.types is None:
            return None
        ok = isinstance(value, self.types)
        if isinstance(value, bool) and bool not in self.types:
            ok = False  # bool is an int, but not a step
        if ok:
            return None
        want = " or ".join("None" if t is NoneType else t.__name__ for t in self.types)
        return f"{self.key!r} should be {want}, got {type(value).__name__}"


#: The snapshot's fields, in the order they are written. Add a field: see the module doc.
FIELDS: tuple[Field, ...] = (
    Field("step", (int, NoneType), "the training step (None: not known)", default=None),
    Field("time", (float, int), "when it was written, seconds since the epoch", check=check_time),
    Field(
        "reason",
        (dict,),
        "why it was written: {'kind': str, 'message': str, ...what the guard measured}",
        check=check_reason,
    ),
    Field(
        "model_state",
        (dict,),
        "the model's state_dict (parameters and buffers, on their devices)",
        check=check_model_state,
        lives=Lives.LAZY,
    ),
    Field("model_class", (str, NoneType), "the model's class as 'module:qualname'", default=None),
    Field("model_training", (bool,), "the model's train flag"),
    Field(
        "inputs",
        None,
        "the batch inputs (tensors, tuples, lists, dicts of them)",
        default=None,
        lives=Lives.TENSORS,
    ),
    Field("target", None, "the batch target (as inputs)", default=None, lives=Lives.TENSORS),
    Field(
        "optimizer",
        (dict, NoneType),
        "the optimizer's state_dict",
        default=None,
        attr="optimizer_state",
        check=check_optimizer,
        lives=Lives.LAZY,
    ),
    Field(
        "optimizer_class", (str, NoneType), "the optimizer's class, 'module:qualname'", default=None
    ),
    Field(
        "optimizer_params",
        (list, NoneType),
        "the model parameter name behind each optimizer parameter index",
        default=None,
    ),
    Field(
        "scaler",
        (dict, NoneType),
        "the GradScaler's state_dict",
        default=None,
        attr="scaler_state",
        lives=Lives.TENSORS,
    ),
    Field(
        "scheduler",
        (dict, NoneType),
        "the learning-rate scheduler's state_dict",
        default=None,
        attr="scheduler_state",
        lives=Lives.TENSORS,
    ),
    Field(
        "scheduler_class", (str, NoneType), "the scheduler's class, 'module:qualname'", default=None
    ),
    Field(
        "rng",
        (dict, NoneType),
        "torch (CPU, CUDA), numpy and Python RNG states at the start of the step",
        default=None,
        check=check_rng,
        lives=Lives.TENSORS,
    ),
    Field(
        "history",
        (list,),
        "the guard's rolling history, one dict per step",
        default_factory=list,
        check=check_history,
    ),
    Field(
        "environment",
        (dict,),
        "torch / python / numpy versions, platform, devices and dtypes of the model",
    ),
    Field(
        "recipe",
        (dict, NoneType),
        "how to rebuild the model: {'factory': 'package.module:factory', 'kwargs': {...}}",
        default=None,
        check=check_recipe,
    ),
    Field(
        "loss_fn",
        (dict, NoneType),
        "how to rebuild the loss: {'name': 'module:qualname', ...}",
        default=None,
        attr="loss_fn_spec",
        lives=Lives.TENSORS,
    ),
    Field(
        "dropped",
        (list,),
        "paths of values that could not be stored as plain data (stored as None)",
        default_factory=list,
    ),
    # a distributed run (nbdebug.core.guard.agreement): one file per rank for the same step
    Field(
        "rank",
        (int, NoneType),
        "the process's rank in its torch.distributed group (None: a single process)",
        since=2,
        default=None,
    ),
    Field(
        "world_size",
        (int, NoneType),
        "the number of ranks (None: a single process)",
        since=2,
        default=None,
    ),
    Field(
        "local_first",
        (bool, NoneType),
        "this rank saw the non-finite value itself, before the ranks' agreement (False: "
        "only through it; None: a single process)",
        since=2,
        default=None,
    ),
    Field(
        "culprit_ranks",
        (list,),
        "the ranks that caused the bad step (their loss or weights, else their gradients, "
        "were not finite)",
        since=2,
        default_factory=list,
    ),
    Field(
        "rank_kinds",
        (dict,),
        "every rank's local verdict: {'0': ['grad'], '1': ['loss'], ...}",
        since=2,
        default_factory=dict,
    ),
    Field(
        "fingerprints",
        (dict, NoneType),
        "an exact fingerprint per replicated parameter: {'names': [str], 'values': int64 "
        "tensor (n, 2)}, compared across ranks by nbdebug.compare_ranks",
        since=2,
        default=None,
        lives=Lives.TENSORS,
    ),
    Field(
        "trainer",
        (dict, NoneType),
        "the trainer that ran the step: {'framework', 'version', 'global_step', 'args': "
        "its arguments (TrainingArguments, Trainer flags) as plain data}",
        since=3,
        default=None,
    ),
    Field(
        "autocast",
        (dict, NoneType),
        "the autocast state of the step's forward: {'device_type': str, 'dtype': str}, "
        "with 'backward': True when its backward ran inside the autocast block too "
        "(None: no autocast)",
        since=3,
        default=None,
        check=check_autocast,
    ),
    Field(
        "module_training",
        (dict,),
        "the submodules whose train flag differs from the model's, {name: bool} (a "
        "BatchNorm frozen in eval inside a model in train mode)",
        since=4,
        default_factory=dict,
        check=check_module_training,
    ),
    Field(
        "layout",
        (str,),
        "how the file holds the values: 'safetensors' (one safetensors file, the rest JSON "
        "in its header) or 'torch.save' (a zip archive, versions 1-4)",
        since=5,
        required=False,
        default="torch.save",
    ),
    Field(
        "loss_source",
        (dict, NoneType),
        "where the step's loss came from when the trainer's code computed it: {'call': "
        "'model_method' (model.<method>(batch, *args)) or 'trainer_method' "
        "(<class>.<method>(trainer, model, batch)), 'method', 'class' "
        "('module:qualname'), 'args', 'kwargs' (optional), 'silence' (instance methods made "
        "no-ops), 'batch' "
        "(how the batch is rebuilt from inputs and target)} (None: the model's output or "
        "loss_fn)",
        since=6,
        required=False,
        default=None,
    ),
    Field(
        "rewind",
        (dict, NoneType),
        "the guard's rewind window (NaNGuard(rewind=K)): the model, optimizer, scheduler "
        "and scaler states at the start of 'start_step' and every step since (batch or "
        "dataset ids, RNG states, learning rates, loss, gradient norm; "
        "nbdebug.core.snapshot.rewind) (None: no window)",
        since=7,
        required=False,
        default=None,
        attr="rewind_data",
        check=check_window,
        lives=Lives.LAZY,
    ),
    Field(
        "signals",
        (dict, NoneType),
        "the guard's per-layer signals (NaNGuard(signals=...)): {'names': [str], 'steps': "
        "int64 (n,), 'grad_norm', 'update_ratio', 'adam_lag': float32 (n, P), 'modules': "
        "[str], 'max_logit', 'logsumexp': float32 (n, M), the settings} (None: off)",
        since=7,
        required=False,
        default=None,
        attr="signals_data",
        lives=Lives.TENSORS,
    ),
    Field(
        "update_grads",
        (dict, NoneType),
        "the gradients an optimizer step consumed, by parameter name, when the guard rolled "
        "that update back (reason kind 'optimizer'): with the stored pre-step state they "
        "replay the update alone (None: no such step)",
        since=7,
        required=False,
        default=None,
        lives=Lives.LAZY,
    ),
    Field(
        "ids",
        (list, NoneType),
        "the dataset index of each batch row (the guard's check(..., ids=...); "
        "nbdebug.row_blame names the rows by them) (None: not given)",
        since=7,
        required=False,
        default=None,
    ),
    Field(
        "compiled",
        (dict, NoneType),
        "the torch.compile settings of a compiled model, {'backend': 'inductor'} (the back "
        "end's name, None when it could not be read); the state is the module it wraps "
        "(None: the model ran eagerly)",
        since=7,
        required=False,
        default=None,
    ),
)


def format_version() -> int:
    """The format version this nbdebug writes and the newest it reads: the newest row's
    ``since``."""
    return max(f.since for f in FIELDS)


#: Version of the file layout this nbdebug writes; it reads this one and older ones.
FORMAT_VERSION = format_version()


# --------------------------------------------------------------------------- writer and reader


def build_payload(values: Mapping[str, Any]) -> dict[str, Any]:
    """The snapshot dictionary of ``values`` (plain data by key): the format header, then
    every field of :data:`FIELDS` in table order, a missing one as its default.

    Raises
    ------
    TypeError
        A key is not a field, a value has a type its field does not accept, or a field
        without a default has no value.
    ValueError
        A value that fails its field's check (the one the reader runs).
    """
    fields = FIELDS
    keys = [f.key for f in fields]
    unknown = [k for k in values if k not in keys]
    if unknown:
        raise TypeError(
            f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not a "
            f"snapshot field; the fields are {', '.join(keys)}."
        )
    payload: dict[str, Any] = {"format": FORMAT, "version": format_version()}
    for f in fields:
        if f.key in values:
            value = values[f.key]
        elif f.has_default:
            value = f.make_default()
        else:
            raise TypeError(f"cannot write the snapshot: no value for the field {f.key!r}.")
        problem = f.type_problem(value)
        if problem:
            raise TypeError(f"cannot write the snapshot: {problem}.")
        if f.check is not None:  # the reader's check, so that no file it refuses is written
            try:
                f.check(value)
            except ValueError as e:
                raise ValueError(
                    f"cannot write the snapshot: {e} (got {shorten(repr(value), 80)})."
                ) from None
        payload[f.key] = value
    return payload


def validate_payload(obj: Any, path: Path | str = "<snapshot>") -> dict[str, Any]:
    """Check a loaded snapshot dictionary against :data:`FIELDS`; return it with the
    fields that an older format lacks filled in with their defaults (a new dictionary).

    Raises
    ------
    SnapshotError
        Not a snapshot dictionary, a newer format, a missing field, a value of the
        wrong type or one that fails its field's check.
    """
    if not isinstance(obj, dict):
        raise SnapshotError(
            f"{path} is a torch file but not an nbdebug snapshot: it holds a {type(obj).__name__}, "
            "not a snapshot dictionary."
        )
    if obj.get("format") != FORMAT:
        keys = [k for k in list(obj)[:6] if isinstance(k, str)]
        raise SnapshotError(
            f"{path} is a torch file but not an nbdebug snapshot (no format {FORMAT!r} field; keys "
            f"{keys}{' ...' if len(obj) > 6 else ''}): a plain checkpoint? Load it with torch.load."
        )
    version = obj.get("version")
    newest = format_version()
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise SnapshotError(f"{path} has an invalid format version {version!r}.")
    if version > newest:
        raise SnapshotError(
            f"{path} was written by a newer nbdebug (snapshot format version {version}; this "
            f"nbdebug reads versions up to {newest}): upgrade nbdebug to load it."
        )
    fields = FIELDS
    missing = [f.key for f in fields if f.key not in obj and f.required and f.since <= version]
    if missing:
        raise SnapshotError(
            f"{path} is an incomplete snapshot: it lacks {', '.join(map(repr, missing))}."
        )
    out = dict(obj)
    for f in fields:
        if f.key not in out:
            out[f.key] = f.make_default()
    for f in fields:
        problem = f.type_problem(out[f.key])
        if problem:
            raise SnapshotError(f"{path} is corrupt: {problem}.")
    for f in fields:
        if f.check is None:
            continue
        try:
            f.check(out[f.key])
        except ValueError as e:
            raise SnapshotError(f"{path} is corrupt: {e}.") from e
        except Exception as e:
            raise SnapshotError(
                f"{path} is corrupt: its {f.key!r} field cannot be checked ({first_line(e)})."
            ) from e
    return out


def snapshot_attributes(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``{Snapshot attribute: value}`` for every field of a validated payload."""
    return {f.attribute: payload[f.key] for f in FIELDS}
