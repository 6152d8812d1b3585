"""Snapshot files on disk: names, atomic writes, and reading a file safely.

:func:`atomic_save` writes a snapshot (one safetensors file,
:mod:`~nbdebug.core.snapshot.container`) so that a crash leaves either no file or the
whole one; :class:`PendingSave` does it in two parts (the tensors' bytes now, the rest
later: the guard's ``async_save``). :func:`open_snapshot_file` reads one: a safetensors
file from its header, its tensors mapped and read when used; a file of the older format
(versions 1-4, a ``torch.save`` zip archive) with ``torch.load(..., weights_only=True)``
after checking the zip archive and its checksums. No code from the file runs.
:func:`read_archive` gives the whole dictionary, :func:`read_payload` validates it
against the field table (:mod:`nbdebug.core.snapshot.format`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import tempfile
import threading
import warnings
import zipfile
import zlib
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..batch import iter_tensors
from ..text import first_line
from .container import TensorStore, is_container, materialize, read_document
from .containerwrite import ContainerWrite
from .format import FIELDS, SUFFIX, Lives, SnapshotError, validate_payload

_ZIP_MAGIC = b"PK\x03\x04"


def open_snapshot_file(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", mmap: bool = False
) -> tuple[Any, TensorStore | None]:
    """``(object, store)`` of the snapshot file at ``path``, not yet validated.

    A safetensors snapshot (version 5 on) gives its dictionary with the tensors of the
    lazy fields (:attr:`~nbdebug.core.snapshot.format.Lives.LAZY`: the model and optimizer
    states) as :class:`~nbdebug.core.snapshot.format.TensorRef` that ``store`` reads; an
    older file gives what ``torch.load(..., weights_only=True)`` gives, and no store.

    Raises
    ------
    SnapshotError
        The file is missing, empty, not a snapshot, truncated or corrupt, or holds Python
        objects other than tensors and plain containers.
    """
    p, head = _head(path)
    if head[:4] == _ZIP_MAGIC:
        return _read_zip(p, map_location=map_location, mmap=mmap), None
    payload, table = read_document(p)
    store = TensorStore(p, table, map_location)
    lazy = {f.key for f in FIELDS if f.lives is Lives.LAZY}
    eager = {k: v for k, v in payload.items() if k not in lazy}
    return {**payload, **materialize(eager, store)}, store


def read_archive(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", mmap: bool = False
) -> Any:
    """The whole object stored in the snapshot file at ``path`` (every tensor read), not
    yet validated; see :func:`open_snapshot_file`."""
    obj, store = open_snapshot_file(path, map_location=map_location, mmap=mmap)
    return obj if store is None else materialize(obj, store)


def _head(path: str | os.PathLike[str]) -> tuple[Path, bytes]:
    """The path and the first bytes of a snapshot file: one that can be read and begins
    like a zip archive or a safetensors file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__qualname__}.")
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except FileNotFoundError as e:
        raise SnapshotError(f"{p}: no such file.") from e
    except IsADirectoryError as e:
        raise SnapshotError(
            f"{p} is a directory, not a snapshot file (list_snapshots() lists one)."
        ) from e
    except OSError as e:
        raise SnapshotError(f"{p}: cannot read it ({first_line(e)}).") from e
    if not head:
        raise SnapshotError(f"{p} is empty (0 bytes): not a snapshot.")
    if head[:4] != _ZIP_MAGIC and not is_container(head):
        raise SnapshotError(
            f"{p} is not a snapshot: it is not a torch.save zip archive or a safetensors "
            f"file (it starts with {head[:4]!r})."
        )
    return p, head


def _read_zip(p: Path, *, map_location: Any, mmap: bool) -> Any:
    """A snapshot of versions 1-4: ``torch.load(weights_only=True)`` of its zip archive,
    after checking its records against their CRC-32s."""
    if not zipfile.is_zipfile(p):  # no end-of-archive record: cut short while written or copied
        raise SnapshotError(f"{p} is truncated or corrupt: its zip archive has no end record.")
    stored = _check_records(p, tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        msg = str(e)
        if "Weights only load failed" in msg:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", msg)
            what = f" (such as {found.group(1)})" if found else ""
            raise SnapshotError(
                f"{p} holds Python objects other than tensors and plain containers{what}: it is "
                "corrupt or was not written by nbdebug, and is refused (loading it could run code)."
            ) from e
        if "TorchScript" in msg:
            raise SnapshotError(
                f"{p} is not a snapshot: it is a TorchScript archive (torch.jit.save); load "
                "it with torch.jit.load."
            ) from e
        if "central directory" in msg or "failed reading zip archive" in msg:
            raise SnapshotError(
                f"{p} is truncated or corrupt: its zip archive cannot be read."
            ) from e
        raise SnapshotError(f"{p} is corrupt: torch.load failed ({first_line(e)}).") from e
    if not mmap:  # a memory-mapped load reads no tensor: nothing to compare
        _check_tensor_bytes(p, obj, stored)
    return obj


#: bytes read at a time when the records' checksums are verified
_CHECK_CHUNK = 16 << 20


def _check_records(p: Path, *, tensors: bool) -> list[int]:
    """The archive's records against the CRC-32 its writer stored (``torch.load`` does not
    compare them): damaged bytes inside a tensor would otherwise load, and replay a
    different step, without a word. Read in chunks, so memory stays flat.
    ``tensors=False`` reads all but the tensors' records (those are compared once loaded,
    by :func:`_check_tensor_bytes`, or not read at all by a memory-mapped load) and
    returns the tensors' stored CRCs. A record with no checksum (CRC 0: torch.save with
    ``compute_crc32`` off, or an empty record) is not checked."""
    name = "?"
    stored: list[int] = []
    try:
        with zipfile.ZipFile(p) as z:
            for info in z.infolist():
                if not tensors and "/data/" in info.filename:
                    stored.append(info.CRC)
                    continue
                if info.CRC == 0:
                    continue
                name = info.filename
                with z.open(info) as f:
                    while f.read(_CHECK_CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        if "CRC" not in str(e):
            raise SnapshotError(f"{p} is truncated or corrupt: {first_line(e)}.") from e
        raise SnapshotError(
            f"{p} is corrupt: the bytes of its record {name!r} do not match the checksum "
            "stored with them (the file was damaged after it was written)."
        ) from e
    except OSError as e:
        raise SnapshotError(f"{p}: cannot read it ({first_line(e)}).") from e
    except Exception as e:  # a damaged directory: names, sizes, offsets
        raise SnapshotError(
            f"{p} is truncated or corrupt: its zip archive cannot be read ({first_line(e)})."
        ) from e
    return stored


def _check_tensor_bytes(p: Path, obj: Any, stored: list[int]) -> None:
    """The loaded tensors' storages against the CRC-32s stored for the tensor records:
    one storage per record, so every stored checksum is some storage's unless bytes were
    damaged. In memory, without reading the file again; a sparse tensor or one off the
    CPU (``map_location``) has the file's records read instead. On a mismatch the file is
    read to name the record."""
    storages: dict[int, torch.UntypedStorage] = {}
    for t in iter_tensors(obj):
        if t.layout != torch.strided or t.device.type != "cpu":  # sparse, or mapped away
            _check_records(p, tensors=True)
            return
        st = t.untyped_storage()
        if st.nbytes():
            storages.setdefault(st.data_ptr(), st)
    got = Counter(_crc32(st) for st in storages.values())
    want = Counter(c for c in stored if c)  # CRC 0: written without a checksum
    if want - got:  # a record's checksum that no loaded storage has
        _check_records(p, tensors=True)  # names the damaged record
        raise SnapshotError(
            f"{p} is corrupt: the bytes of its stored tensors do not match the checksums "
            "stored with them (the file was damaged after it was written)."
        )


def _crc32(storage: torch.UntypedStorage) -> int:
    data = torch.empty(0, dtype=torch.uint8).set_(storage)  # a byte view, no copy
    return zlib.crc32(data.numpy().data)


def read_payload(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """The validated dictionary stored in a snapshot file (no code runs), with the fields
    that an older format lacks filled in with their defaults. ``mmap``: a file of the
    older format is memory-mapped, a safetensors one leaves the model and optimizer states
    unread.

    Raises
    ------
    SnapshotError
        The file is missing, empty, not a torch zip archive, truncated or corrupt, not a
        snapshot, written by a newer nbdebug, or lacks a key.
    """
    if mmap:  # the lazy fields' tensors are not read (TensorRef in their place)
        obj = open_snapshot_file(path, map_location=map_location, mmap=True)[0]
    else:
        obj = read_archive(path, map_location=map_location)
    return validate_payload(obj, Path(path))


# --------------------------------------------------------------------------- files


def snapshot_name(step: int | None, rank: int | None = None) -> str:
    """File name of the snapshot of ``step``: ``step-000048213.nbsnap``; of one rank of a
    distributed run: ``step-000048213-rank1.nbsnap``."""
    tail = f"-rank{rank}{SUFFIX}" if rank is not None else SUFFIX
    if step is None:
        return "snapshot-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f") + tail
    return f"step-{step:09d}{tail}" if step >= 0 else f"step-m{-step:09d}{tail}"


#: ``...-rankN.nbsnap``: the rank of a distributed run's snapshot file, from its name.
RANK_NAME = re.compile(r"-rank(\d+)(?:-\d+)?\.nbsnap$")


def unique_path(
    directory: str | os.PathLike[str], step: int | None, *, rank: int | None = None
) -> Path:
    """A path in ``directory`` for the snapshot of ``step`` (of ``rank``) that no file
    holds yet and no write of this process is about to take: the name is reserved until
    :func:`atomic_save` of it ends (a background write creates its file later, and two
    guards of one directory, or two bad steps of one number, would otherwise share it)."""
    d = Path(directory)
    base = d / snapshot_name(step, rank)
    path, n = base, 1
    with _RESERVED_LOCK:
        while path.exists() or path.absolute() in _RESERVED:
            path = base.with_name(f"{base.stem}-{n}{SUFFIX}")
            n += 1
        _RESERVED.add(path.absolute())
    return path


#: the snapshot paths handed out by unique_path whose write has not ended yet
_RESERVED: set[Path] = set()
_RESERVED_LOCK = threading.Lock()


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the snapshot dictionary ``obj`` to ``path`` atomically (one safetensors file,
    :mod:`~nbdebug.core.snapshot.containerwrite`): a temporary file in the same
    directory, fsynced, renamed over ``path``, then the directory fsynced. A crash at any
    point leaves either no file or the complete file under ``path`` (and never a
    temporary file after an exception). ``obj``'s tensors do not change meanwhile, so
    they are measured while they are written (``measure_live``)."""
    return PendingSave(obj, path, measure_live=True).finish()


class PendingSave:
    """:func:`atomic_save` in two parts. Made: the temporary file holds every tensor's
    bytes (copied from ``obj``, whose tensors may change from then on). :meth:`finish`
    (on any thread, once): checksums and header, fsync, rename over ``path``. An
    exception in either part removes the temporary file and releases the name.
    ``measure_live``: ``obj``'s tensors stay as they are until :meth:`finish` returns, and
    are measured from themselves while written (see
    :class:`~nbdebug.core.snapshot.containerwrite.ContainerWrite`)."""

    def __init__(
        self, obj: Mapping[str, Any], path: str | os.PathLike[str], *, measure_live: bool = False
    ) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
            )
        except BaseException:
            self._release()
            raise
        os.close(fd)
        self._tmp = Path(tmp)
        try:
            self._file = ContainerWrite(obj, self._tmp, measure_live=measure_live)
        except BaseException:
            self._abandon()
            raise

    def finish(self) -> Path:
        """Finish the file and put it in place; its path."""
        try:
            self._file.finish()
            with open(self._tmp, "rb") as f:  # fsync flushes the pages any fd wrote
                os.fsync(f.fileno())
            os.replace(self._tmp, self.path)
        except BaseException:
            self._abandon()
            raise
        self._release()
        _fsync_dir(self.path.parent)
        return self.path

    def _abandon(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)
        self._release()

    def _release(self) -> None:
        with _RESERVED_LOCK:
            _RESERVED.discard(self.path.absolute())
