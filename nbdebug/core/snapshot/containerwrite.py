"""Writing the container file (:mod:`~nbdebug.core.snapshot.container`) in two parts, so
that a training step is held only while its tensors' bytes are copied.

:class:`ContainerWrite` first writes every tensor's bytes straight into the file, after
room left for the header (that write is the one copy of the tensors: into the page
cache, with nothing else kept: the live tensors may change once it returns; the file's
blocks are allocated before it, ``fallocate``); then :meth:`ContainerWrite.finish`
measures each tensor (CRC-32, non-finite count, norm) from the file's own pages, mapped,
and writes the header into the room left for it.
With ``measure_live`` (:func:`~nbdebug.core.snapshot.archive.atomic_save`: the tensors do
not change until it returns) each tensor is measured from the live tensor instead, on a
thread of its own while the next ones are written, and the disk write-back of every
32 MiB written is started on another (``sync_file_range``, where there is one: it waits
when the disk's queue is full, the writer does not), so that the fsync after the header
finds the file on the disk already: its time is about that of the disk's write, not the
write's plus the disk's. Tried and left out: two threads filling the page cache (two
writers gain nothing, the file's lock is taken per write; one writing beside one copying
into the file mapped held the step 0.41 s against 0.23 s for one writer into allocated
blocks, ``benchmarks/bench_snapshot.py``'s case).

Why not copy the tensors to memory and hand the copy to ``safetensors.save_file``: the
copy and the page cache would then be two fresh copies of the whole snapshot, and
writing from memory just allocated was measured at 2-4x the time of writing from the
live tensors (``benchmarks/bench_snapshot.py``); here the page cache is the only copy.
The header's room is its largest possible size (every checksum, count and norm at its
widest), padded with spaces once the real values are known, as safetensors pads it.
:class:`ContainerWrite` writes into an existing empty file (the caller's temporary file).
"""

from __future__ import annotations

import base64
import ctypes
import errno
import functools
import json
import math
import mmap
import os
import queue
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..text import dtype_name
from .container import META_CRC, META_KEY, TensorEntry, byte_view, measure_tensor

__all__ = ["ContainerWrite"]

#: safetensors' dtype codes of the dtypes it stores natively; any other is stored as
#: its bytes (``raw``), a complex tensor as its real view (``complex``)
_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64",
}  # fmt: skip
#: the widest values a header can hold: its room is measured with them
_WIDEST_CRC = 0xFFFFFFFF
_WIDEST_NORM = -1.2345678901234567e-308  # 24 characters: no float's repr is longer
#: flushes a file's data to the disk (``fdatasync`` where there is one)
_datasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)
#: bytes written between two starts of the disk write-back (``measure_live``)
_KICK = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start write-out of the range's dirty pages
#: the C library's functions that ``os`` lacks, with their argument types
_LIBC = {
    "sync_file_range": [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
    "fallocate64": [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
}


@functools.cache
def _libc(name: str) -> Callable[..., int] | None:
    """Linux's C function ``name`` (one of :data:`_LIBC`), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = _LIBC[name]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _start_writeback(fd: int, start: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` from ``start`` to the disk, not waiting
    for it (a hint: a failure shows in the fsync that follows)."""
    fn = _libc("sync_file_range")
    if fn is not None:
        fn(fd, start, length, _SYNC_FILE_RANGE_WRITE)


def _allocate(fd: int, size: int) -> bool:
    """Allocate the first ``size`` bytes of ``fd`` on the disk (its size grows to
    ``size``): whether it was done. A full disk raises ``OSError``; a file system that
    cannot (or no ``fallocate``) gives False."""
    fn = _libc("fallocate64")
    if fn is None:
        return False
    if fn(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(err, os.strerror(err))
    return False


def _join(path: str, key: object) -> str:
    """The tensor name of ``key`` under ``path``: ``model_state/fc1.weight``."""
    return f"{path}/{key}" if path else str(key)


@dataclass
class _Item:
    """One tensor to store: the live tensor (until its bytes are written) and where."""

    name: str
    tensor: torch.Tensor | None
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]  # as stored
    stored: str
    entry: TensorEntry  # its table entry, with the widest values until measured
    start: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _stored_form(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], str]:
    """(dtype, shape, kind) of ``t`` as the file stores it."""
    if t.is_complex():
        return t.real.dtype, (*t.shape, 2), "complex"
    if t.dtype not in _CODES:
        return torch.uint8, (t.numel() * t.element_size(),), "raw"
    return t.dtype, tuple(t.shape), "native"


class _Encoder:
    """The snapshot dictionary as JSON plus the tensors to store (not yet copied)."""

    def __init__(self) -> None:
        self.items: dict[str, _Item] = {}
        self._memo: dict[tuple[Any, ...], str] = {}

    def encode(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.sparse_coo:
                s = obj.detach().coalesce()
                return {
                    "$sparse": [
                        self.encode(s.indices(), _join(path, "indices")),
                        self.encode(s.values(), _join(path, "values")),
                        list(s.shape),
                    ]
                }
            return {"$tensor": self._tensor(obj.detach(), path)}
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"$float": repr(obj)}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: self.encode(v, _join(path, k)) for k, v in obj.items()}
            return {
                "$dict": [
                    [self.encode(k, path), self.encode(v, _join(path, k))] for k, v in obj.items()
                ]
            }
        if isinstance(obj, list):
            return [self.encode(v, _join(path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, _join(path, i)) for i, v in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            return {"$set": [self.encode(v, path) for v in obj]}
        if isinstance(obj, bytes):
            return {"$bytes": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"$dtype": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if isinstance(obj, torch.Size):
            return {"$size": list(obj)}
        raise TypeError(f"cannot write {type(obj).__qualname__} at {path} into a snapshot.")

    def _tensor(self, t: torch.Tensor, path: str) -> str:
        key: tuple[Any, ...] = (t.untyped_storage().data_ptr(), t.storage_offset())
        key += (tuple(t.shape), t.stride(), t.dtype, str(t.device))
        if key in self._memo:  # the same tensor twice (tied weights): stored once
            return self._memo[key]
        name = path if path not in self.items else f"{path}#{len(self.items)}"
        self._memo[key] = name
        dtype, shape, stored = _stored_form(t)
        floating = dtype.is_floating_point
        norm = _WIDEST_NORM if floating and path.startswith("model_state/") else None
        entry = TensorEntry(
            name, dtype_name(t.dtype), tuple(t.shape), str(t.device), _WIDEST_CRC,
            t.numel() * (1 + (stored == "complex")) if floating else None, norm, stored,
        )  # fmt: skip
        self.items[name] = _Item(name, t, dtype, shape, stored, entry)
        return name


def _stored_tensor(item: _Item) -> torch.Tensor:
    """``item``'s tensor as the file stores it: on the CPU, contiguous, of its stored
    dtype and shape (a copy only when it is on another device, not contiguous, or
    complex)."""
    assert item.tensor is not None
    t = item.tensor.to("cpu")
    if item.stored == "complex":
        t = torch.view_as_real(t)
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if item.stored == "raw" else t


class ContainerWrite:
    """The container file of the snapshot dictionary ``obj`` at ``path``, begun: made
    here, every tensor's bytes written (after room for the header), nothing of ``obj``
    kept. :meth:`finish` measures the tensors from the file and writes the header.
    ``measure_live``: ``obj``'s tensors do not change until :meth:`finish` returns; they
    are measured while written, from themselves. Not atomic:
    :class:`~nbdebug.core.snapshot.archive.PendingSave` does that around it."""

    def __init__(self, obj: Mapping[str, Any], path: Path, *, measure_live: bool = False) -> None:
        self.path = path
        self._measured = measure_live
        enc = _Encoder()
        self._payload = enc.encode(dict(obj), "")
        # widest element first, as safetensors orders them: every tensor stays aligned
        self._items = sorted(enc.items.values(), key=lambda i: -i.dtype.itemsize)
        offset = 0
        for item in self._items:
            item.start, offset = offset, offset + item.nbytes
        self._end = offset
        room = len(self._header(widest=True))
        self._room = -(-room // 8) * 8  # the data starts 8-byte aligned
        # "r+b" on the (empty) file the caller made: truncating it on open ("wb") makes
        # ext4 start writing it back as it is closed (auto_da_alloc), on the held step
        with open(path, "r+b") as f:
            # its blocks allocated first: writing into them was measured at 0.4-0.8x the
            # time of writing into a hole (no block to reserve per page), and a full disk
            # fails here, before any byte is written
            _allocate(f.fileno(), 8 + self._room + self._end)
            f.seek(8 + self._room)
            if measure_live:
                self._write_measuring(f)
            else:
                for item in self._items:
                    if item.nbytes:
                        f.write(byte_view(_stored_tensor(item)))
                    item.tensor = None  # the live tensor is not needed any more
            f.truncate(8 + self._room + self._end)

    def _write_measuring(self, f: BinaryIO) -> None:
        """Write every tensor's bytes while one thread measures each tensor written (from
        the live tensor: the file's pages are not read back) and another starts the disk
        write-back of every 32 MiB written (``sync_file_range`` waits when the disk's
        queue is full: not the writer). Their errors are raised here once they stopped."""
        measures: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        kicks: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        failed: list[BaseException] = []
        fd = f.fileno()
        threads = [
            threading.Thread(target=_serve, args=(q, fn, failed), name=name, daemon=True)
            for q, fn, name in (
                (measures, _measure_into, "nbdebug-snapshot-measure"),
                (kicks, functools.partial(_start_writeback, fd), "nbdebug-snapshot-writeback"),
            )
        ]
        for t in threads:
            t.start()
        kicked = written = 8 + self._room
        try:
            for item in self._items:
                if failed:
                    break
                stored = _stored_tensor(item)
                data = byte_view(stored)
                for i in range(0, len(data), _KICK):  # the disk starts on a big one early
                    written += f.write(data[i : i + _KICK])
                    if written - kicked >= _KICK:
                        f.flush()
                        kicks.put((kicked, written - kicked))
                        kicked = written
                measures.put((item, stored))
                item.tensor = None
        finally:
            for q in (measures, kicks):
                q.put(None)
            for t in threads:
                t.join()
        if failed:
            raise failed[0]

    def _header(self, *, widest: bool = False) -> bytes:
        """The safetensors header (``widest``: with every value not yet measured at its
        widest, to size its room)."""
        doc = {
            "payload": self._payload,
            "tensors": {i.name: i.entry.as_json() for i in self._items},
        }
        text = json.dumps(doc, separators=(",", ":"))
        crc = str(_WIDEST_CRC if widest else zlib.crc32(text.encode()))
        header: dict[str, Any] = {"__metadata__": {META_KEY: text, META_CRC: crc}}
        for i in self._items:
            code = _CODES[i.dtype]
            header[i.name] = {
                "dtype": code,
                "shape": list(i.shape),
                "data_offsets": [i.start, i.start + i.nbytes],
            }
        return json.dumps(header, separators=(",", ":")).encode()

    def finish(self) -> None:
        """Measure every tensor from the file's pages (unless measured while written: their
        write-back began then) and write the header. The tensors' bytes go to the disk (an
        ``fdatasync`` on a thread of its own) while they are measured, so that the
        caller's fsync after it has the header alone to write."""
        with open(self.path, "r+b") as f:
            if not self._measured:
                self._measure_flushing(f.fileno())
            header = self._header()
            if len(header) > self._room:  # cannot happen: the room is the widest header
                raise RuntimeError(
                    f"the snapshot header of {self.path} outgrew its room ({len(header)} > "
                    f"{self._room} bytes)."
                )
            f.seek(0)
            f.write(struct.pack("<Q", self._room) + header.ljust(self._room, b" "))

    def _measure_flushing(self, fd: int) -> None:
        """Measure every tensor from the file's pages while an ``fdatasync`` of them runs
        on a thread of its own (its error raised here)."""
        failed: list[OSError] = []  # a failed flush is raised here, not lost

        def flush() -> None:
            try:
                _datasync(fd)
            except OSError as e:
                failed.append(e)

        flusher = threading.Thread(target=flush, name="nbdebug-snapshot-flush", daemon=True)
        flusher.start()
        try:
            self._measure(fd)
        finally:
            flusher.join()
        if failed:
            raise failed[0]

    def _measure(self, fd: int) -> None:
        base = 8 + self._room
        if not self._end:
            for item in self._items:
                item.entry = _measured(item, torch.empty(item.shape, dtype=item.dtype))
            return
        # a private mapping: reads share the page cache's pages, nothing is copied
        m = mmap.mmap(fd, base + self._end, access=mmap.ACCESS_COPY)
        data = torch.frombuffer(m, dtype=torch.uint8)
        for item in self._items:
            view = data[base + item.start : base + item.start + item.nbytes]
            item.entry = _measured(item, view.view(item.dtype).view(item.shape))
        del data, view  # no view of the mapping may outlive it
        m.close()


def _serve(
    jobs: queue.SimpleQueue[tuple[Any, ...] | None],
    fn: Callable[..., None],
    failed: list[BaseException],
) -> None:
    """``fn(*job)`` for every job of ``jobs`` until a None; once one failed (its error
    added to ``failed``), the rest are only taken."""
    while (job := jobs.get()) is not None:
        try:
            if not failed:
                fn(*job)
        except BaseException as e:
            failed.append(e)


def _measure_into(item: _Item, stored: torch.Tensor) -> None:
    item.entry = _measured(item, stored)


def _measured(item: _Item, stored: torch.Tensor) -> TensorEntry:
    """``item``'s table entry with the CRC-32, non-finite count and norm of ``stored``,
    its tensor as the file holds it."""
    e = item.entry
    nonfinite, norm = measure_tensor(stored, with_norm=e.norm is not None)
    crc = zlib.crc32(byte_view(stored)) if stored.numel() else 0
    return TensorEntry(e.name, e.dtype, e.shape, e.device, crc, nonfinite, norm, e.stored)
