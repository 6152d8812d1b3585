"""Where a guard's snapshots go: :class:`SnapshotWriter`, the one place a guard touches
the disk."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..parallel import full_tensors, is_dtensor, process_rank
from ..snapshot.archive import PendingSave, unique_path
from ..snapshot.format import FIELDS
from ..snapshot.write import TrainingObjects, save_snapshot
from ..state import RngState
from ..vocab import FailureKind
from .agreement import SNAPSHOT_FIELDS
from .options import SnapshotOptions

__all__ = ["SnapshotWriter"]

#: the snapshot fields a guard can be given (:meth:`SnapshotWriter.set_field`): every field
#: of the table but those the guard writes itself
_SETTABLE = frozenset(f.key for f in FIELDS) - {
    "step", "reason", "history", "inputs", "target", *SNAPSHOT_FIELDS,
}  # fmt: skip


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
    """Writes the snapshot of a failing step (at most ``max_snapshots``, and as many spike
    snapshots besides: an early warning never uses up the failure's place); ``paths`` lists
    what it wrote. The one place a guard touches the disk.

    With ``async_save`` the snapshot's tensors are copied into its (temporary) file during
    the step, and the file is finished on a background thread (checksums, header, fsync,
    rename: a crash leaves no file under the final name); :meth:`close` waits for the
    writes and raises the first error.
    The threads are not daemons: a process that exits waits for them."""

    def __init__(self, options: SnapshotOptions) -> None:
        self.options = options
        self.directory = Path(options.directory)
        _check_directory(self.directory)
        self.max_snapshots = options.max_snapshots
        self.loss_fn = options.loss_fn
        self.recipe = options.recipe_spec
        self.async_save = options.async_save
        self.paths: list[Path] = []
        self.spikes_written = 0  # of paths: spike snapshots (a budget of their own)
        #: (path, exception) of background writes that failed (raised by :meth:`close`)
        self.errors: list[tuple[Path, BaseException]] = []
        self._threads: list[threading.Thread] = []
        self._fields: dict[str, Any] = {}
        #: ``rewind(step)``: the snapshot's ``rewind`` field for ``step`` (set by a guard
        #: with ``rewind=``: :meth:`nbdebug.core.guard.rewind.RewindKeeper.payload`)
        self.rewind: Callable[[int], dict[str, Any] | None] | None = None

    @property
    def fields(self) -> Mapping[str, Any]:
        """Further snapshot fields by key (``"trainer"``, ``"autocast"``, ...) written into
        every snapshot (read-only: :meth:`set_field` sets one)."""
        return dict(self._fields)

    def set_field(self, key: str, value: object) -> None:
        """Write ``value`` into the field ``key`` of every snapshot from now on (``None``:
        the field's default again; a callable: its result at each write).

        Raises
        ------
        TypeError
            ``key`` is not a field of the snapshot table, or one the guard writes itself.
        """
        if key not in _SETTABLE:
            raise TypeError(f"{key!r} is not a snapshot field a guard can be given.")
        if value is None:
            self._fields.pop(key, None)
        else:
            self._fields[key] = value

    def write(
        self,
        objects: TrainingObjects,
        step: int,
        reason: Mapping[str, Any],
        batch: tuple[Any, Any],
        *,
        rng: RngState,
        history: Sequence[Mapping[str, Any]],
        distributed: Mapping[str, Any] | None = None,
    ) -> Path | None:
        """Save the snapshot of ``step`` (the model, optimizer, scaler and scheduler of
        ``objects``, ``history``, the batch ``(inputs, target)``, ``rng`` as of the start
        of the step); ``None`` once ``max_snapshots`` files were written.

        ``distributed`` (the agreement's record: ``rank``, ``world_size``, ``local_first``,
        ``culprit_ranks``, ...) goes into the snapshot fields of those names and names the
        file ``step-...-rankN.nbsnap``. A sharded (FSDP2) model's state is gathered whole
        first: every rank writes at the same step, so every rank joins the all-gathers."""
        # spike snapshots have a budget of their own: an early warning never takes the
        # place of the failure's snapshot
        spike = reason.get("kind") == FailureKind.SPIKE
        written = self.spikes_written if spike else len(self.paths) - self.spikes_written
        if self.max_snapshots is not None and written >= self.max_snapshots:
            return None
        fields = (
            {k: distributed[k] for k in SNAPSHOT_FIELDS if k in distributed} if distributed else {}
        )
        if self.rewind is not None:
            fields["rewind"] = self.rewind(step)
        rank = fields.get("rank", process_rank())
        model, optimizer = objects.model, objects.optimizer
        if any(is_dtensor(p) for p in model.parameters()):
            objects = TrainingObjects(
                model,
                optimizer,
                objects.scheduler,
                objects.scaler,
                model_state=full_tensors(model.state_dict()),
                optimizer_state=full_tensors(optimizer.state_dict()) if optimizer else None,
            )
        path = save_snapshot(
            unique_path(self.directory, step, rank=rank),
            objects,
            batch[0],
            batch[1],
            step=step,
            reason=reason,
            history=history,
            write=self._write_in_background if self.async_save else None,
            recipe=self.recipe,
            loss_fn=self.loss_fn,
            rng=rng,
            **{k: v() if callable(v) else v for k, v in self._fields.items()},
            **fields,
        )
        self.paths.append(path)
        self.spikes_written += spike
        return path

    def _write_in_background(self, payload: dict[str, Any], path: Path) -> Path:
        # the step is held while the tensors' bytes go into the file (training goes on
        # and changes the live tensors); checksums, header, fsync and rename run on a
        # background thread
        try:
            pending = PendingSave(payload, path)
        except Exception as e:  # surfaced by close(), as a failed background write is
            self._failed(path, e)
            return path

        def run() -> None:
            try:
                pending.finish()
            except BaseException as e:  # surfaced by close()
                self._failed(path, e)

        thread = threading.Thread(target=run, name=f"nbdebug-snapshot-{path.name}")
        thread.start()
        self._threads.append(thread)
        return path

    def _failed(self, path: Path, error: BaseException) -> None:
        self.errors.append((path, error))
        warnings.warn(
            f"nbdebug: writing the snapshot {path} failed: {error}", RuntimeWarning, stacklevel=1
        )

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
