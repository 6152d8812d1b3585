"""Snapshot files: everything needed to replay one training step, saved when it failed.

A snapshot is one file (``step-000048213.nbsnap``) written by :func:`save_snapshot`
(usually through :class:`~nbdebug.NaNGuard`): one safetensors file holding the tensors,
with everything else as JSON in its header (:mod:`~.container`; files of formats 1-4 are
``torch.save`` zip archives), together one dictionary of tensors and plain values (the
model state, the batch, the optimizer, scaler and scheduler states, the RNG states, the
guard's history, versions, how to rebuild the model and the loss). Its fields, their
types, defaults and where they live are the table :data:`nbdebug.core.snapshot.format.FIELDS`,
which also says how to add one.

One module per job: :mod:`~.format` (the field table), :mod:`~.archive` (files on disk),
:mod:`~.container` (the safetensors layout, lazy tensors),
:mod:`~.data` (live objects as plain data), :mod:`~.write` (:func:`save_snapshot`),
:mod:`~.load` (:func:`load_snapshot`), :mod:`~.snapshot` (:class:`Snapshot` and its
replay), :mod:`~.replay` (autocast), :mod:`~.listing` (:func:`list_snapshots`) and
:mod:`~.resolve` (:func:`resolve_source`: whatever a user hands nbdebug, told apart;
:func:`resolve_step`: as one step to replay).

Loading executes nothing from the file (JSON and raw tensor bytes; ``torch.load(...,
weights_only=True)`` for the older format); tensors are read when used.
The model architecture comes from the caller, or from the recorded recipe when the caller
opts in with ``trust_recipe=True``.
"""

from .archive import (
    RANK_NAME,
    atomic_save,
    open_snapshot_file,
    read_archive,
    read_payload,
    unique_path,
)
from .container import TensorEntry
from .data import import_object
from .format import FIELDS, FORMAT_VERSION, SUFFIX, Field, Lives, SnapshotError
from .listing import earliest_snapshot, list_snapshots
from .load import check_state_fits, load_snapshot
from .replay import autocast_state, replay_autocast, replay_contexts
from .resolve import Caller, ResolvedStep, Source, SourceError, resolve_source, resolve_step
from .snapshot import Snapshot
from .write import TrainingObjects, save_snapshot

__all__ = [
    "FIELDS",
    "FORMAT_VERSION",
    "RANK_NAME",
    "SUFFIX",
    "Caller",
    "Field",
    "Lives",
    "ResolvedStep",
    "Snapshot",
    "SnapshotError",
    "Source",
    "SourceError",
    "TensorEntry",
    "TrainingObjects",
    "atomic_save",
    "autocast_state",
    "check_state_fits",
    "earliest_snapshot",
    "import_object",
    "list_snapshots",
    "load_snapshot",
    "open_snapshot_file",
    "read_archive",
    "read_payload",
    "replay_autocast",
    "replay_contexts",
    "resolve_source",
    "resolve_step",
    "save_snapshot",
    "unique_path",
]
