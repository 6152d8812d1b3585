"""The snapshot file of format version 5 and newer: one safetensors file.

Its tensors are the safetensors tensors (named by where they sit in the snapshot:
``model_state/fc1.weight``, ``optimizer/state/0/exp_avg``), and everything else is one
JSON document in the safetensors header's ``__metadata__`` (key :data:`META_KEY`, with
its CRC-32 under :data:`META_CRC`): the snapshot dictionary with every tensor replaced by
``{"$tensor": name}``, and a table of the tensors (dtype, shape, device, the CRC-32 of
their bytes, their non-finite element count and, for the model state, their L2 norm),
recorded at write time so that a reader gets them without reading the weights.

Why one safetensors file: a reader opens it with ``safe_open`` (memory-mapped, no
pickle, no code), reads the header alone to list, describe and summarise a snapshot, and
reads a single tensor without the rest; any safetensors tool opens it too. A zip around
a safetensors member would hide it from ``safe_open`` (it needs the file itself), and a
directory cannot be renamed into place as atomically as one file.

This module reads the file; :mod:`~nbdebug.core.snapshot.containerwrite` writes it.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..text import dtype_name, first_line
from .format import FORMAT, SnapshotError
from .tensorref import TensorRef

__all__ = [
    "META_CRC",
    "META_KEY",
    "TensorEntry",
    "TensorStore",
    "byte_view",
    "is_container",
    "measure_tensor",
]

META_KEY = "nbdebug"
META_CRC = "nbdebug_crc32"
#: safetensors' own limit on its header
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor as the header describes it (nothing of it read)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    crc32: int
    nonfinite: int | None = None
    norm: float | None = None
    stored: str = "native"  # "native", "complex" (as view_as_real) or "raw" (bytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))

    def as_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("dtype", "device", "crc32", "stored")}
        out["shape"] = list(self.shape)
        if self.nonfinite is not None:
            out["nonfinite"] = self.nonfinite
        if self.norm is not None:
            out["norm"] = self.norm if math.isfinite(self.norm) else repr(self.norm)
        return out

    @classmethod
    def from_json(cls, name: str, d: Mapping[str, Any]) -> TensorEntry:
        norm = d.get("norm")
        return cls(
            name,
            str(d["dtype"]),
            tuple(int(n) for n in d["shape"]),
            str(d["device"]),
            int(d["crc32"]),
            None if d.get("nonfinite") is None else int(d["nonfinite"]),
            None if norm is None else float(norm),
            str(d.get("stored", "native")),
        )


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def measure_tensor(t: torch.Tensor, *, with_norm: bool) -> tuple[int | None, float | None]:
    """(non-finite element count, L2 norm) of a floating tensor, else Nones. Reduced in
    float32 (float64 would double the cost of writing a snapshot). A finite norm (or sum)
    means no NaN/Inf: counted element-wise only otherwise."""
    if not t.is_floating_point():
        return None, None
    if not t.numel():
        return 0, 0.0 if with_norm else None
    acc = torch.float32 if t.element_size() < 4 else None
    norm = float(torch.linalg.vector_norm(t, dtype=acc)) if with_norm else None
    quick = norm if norm is not None else float(t.sum(dtype=acc))
    if math.isfinite(quick):
        return 0, norm
    return int((~torch.isfinite(t)).sum()), norm


# --------------------------------------------------------------------------- reading


def is_container(head: bytes) -> bool:
    """Whether a file's first bytes are a safetensors header (8-byte length, then ``{``)."""
    return len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 0


def _header(p: Path) -> dict[str, Any]:
    """The safetensors header of ``p``, parsed and checked against the file's size."""
    size = p.stat().st_size
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise SnapshotError(
                f"{p} is truncated or corrupt: its safetensors header says {n} bytes, the file "
                f"has {size}."
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise SnapshotError(
            f"{p} is corrupt: its safetensors header is not JSON ({first_line(e)})."
        ) from e
    if not isinstance(header, dict):
        raise SnapshotError(f"{p} is corrupt: its safetensors header is not a JSON object.")
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__"]
    if any(not isinstance(e, int) for e in ends) or 8 + n + max(ends, default=0) > size:
        raise SnapshotError(
            f"{p} is truncated or corrupt: its tensor data ends before the header says "
            f"({size} bytes)."
        )
    return header


def read_document(p: Path) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
    """(the snapshot dictionary with :class:`TensorRef` in place of tensors, the tensor
    table) of the container file ``p``, from its header alone."""
    meta = _header(p).get("__metadata__")
    if isinstance(meta, dict) and (META_KEY in meta) != (META_CRC in meta):
        raise SnapshotError(
            f"{p} is corrupt: its metadata holds {sorted(meta)[:4]}, not both {META_KEY!r} and "
            f"{META_CRC!r} (the file was damaged after it was written)."
        )
    if not isinstance(meta, dict) or META_KEY not in meta:
        raise SnapshotError(
            f"{p} is a safetensors file but not an nbdebug snapshot (no {META_KEY!r} metadata): "
            "weights? Load it with safetensors.torch.load_file."
        )
    text = meta[META_KEY]
    if str(zlib.crc32(str(text).encode())) != meta.get(META_CRC):
        raise SnapshotError(
            f"{p} is corrupt: its JSON metadata does not match the checksum stored with it "
            "(the file was damaged after it was written)."
        )
    try:
        doc = json.loads(text)
        table = {n: TensorEntry.from_json(n, e) for n, e in doc["tensors"].items()}
        payload = _decode(doc["payload"], table)
    except SnapshotError:
        raise
    except Exception as e:
        raise SnapshotError(
            f"{p} is corrupt: its JSON metadata cannot be read ({first_line(e)})."
        ) from e
    if not isinstance(payload, dict):
        raise SnapshotError(f"{p} is corrupt: its JSON metadata holds no snapshot dictionary.")
    if payload.get("format") != FORMAT:
        raise SnapshotError(f"{p} is a safetensors file but not an nbdebug snapshot.")
    return payload, table


_TAGS: dict[str, Callable[[Any], Any]] = {
    "$float": float,
    "$tuple": tuple,
    "$set": set,
    "$dtype": lambda s: _dtype(str(s)),
    "$device": torch.device,
    "$size": torch.Size,
    "$bytes": base64.b64decode,
}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _decode(obj: Any, table: Mapping[str, TensorEntry]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, table) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "$tensor":
            if value not in table:
                raise ValueError(f"it names a tensor {value!r} that is not in the file")
            e = table[value]
            return TensorRef(value, e.dtype, e.shape)
        if tag == "$sparse":
            indices, values, size = (_decode(v, table) for v in value)
            return TensorRef(values.name, values.dtype, tuple(size), indices=indices)
        if tag == "$dict":
            return {_decode(k, table): _decode(v, table) for k, v in value}
        if tag in _TAGS:
            inner = _decode(value, table) if tag in ("$tuple", "$set") else value
            return _TAGS[tag](inner)
    return {k: _decode(v, table) for k, v in obj.items()}


class TensorStore:
    """The tensors of one container file, read when asked for (``safe_open`` per read,
    each tensor's bytes checked against its CRC-32) and kept once read.

    ``map_location`` as for ``torch.load``: a device, a ``{recorded: device}`` dict or a
    ``fn(storage, recorded_location)``."""

    def __init__(self, path: Path, table: Mapping[str, TensorEntry], map_location: Any) -> None:
        self.path = path
        self.table = dict(table)
        self.map_location = map_location
        self.cache: dict[str, torch.Tensor] = {}
        self.bytes_read = 0

    def read(self, names: Iterable[str], *, keep: bool = True) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (read from the file, checked, placed on ``map_location``)."""
        names = list(dict.fromkeys(names))
        want = [n for n in names if n not in self.cache]
        got = {n: self.cache[n] for n in names if n in self.cache}
        if want:
            got.update(self._read(want))
            if keep:
                self.cache.update({n: got[n] for n in want})
        return got

    def verify(self) -> int:
        """Read every tensor and check its CRC-32 (nothing kept); the number checked."""
        names = list(self.table)
        for i in range(0, len(names), 16):
            self.read(names[i : i + 16], keep=False)
        return len(names)

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                for n in names:
                    # get_tensor maps the file: a copy, so that no tensor dies (SIGBUS)
                    # when the file is later cut or rewritten in place
                    out[n] = self._check(self.table[n], f.get_tensor(n).clone())
        except SnapshotError:
            raise
        except FileNotFoundError as e:
            raise SnapshotError(f"{self.path}: no such file (it was moved or deleted).") from e
        except Exception as e:  # safetensors' own errors: a damaged header or data
            raise SnapshotError(
                f"{self.path} is truncated or corrupt: its tensors cannot be read "
                f"({first_line(e)})."
            ) from e
        return out

    def _check(self, e: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        crc = zlib.crc32(byte_view(t)) if t.numel() else 0
        self.bytes_read += t.numel() * t.element_size()
        if crc != e.crc32:
            raise SnapshotError(
                f"{self.path} is corrupt: the bytes of its tensor {e.name!r} do not match the "
                "checksum stored with them (the file was damaged after it was written)."
            )
        if e.stored == "complex":
            t = torch.view_as_complex(t)
        elif e.stored == "raw":
            t = t.view(getattr(torch, e.dtype)).reshape(e.shape)
        if tuple(t.shape) != e.shape or dtype_name(t.dtype) != e.dtype:
            raise SnapshotError(
                f"{self.path} is corrupt: its tensor {e.name!r} is {dtype_name(t.dtype)} "
                f"{tuple(t.shape)}, its table says {e.dtype} {e.shape}."
            )
        return _place(t, e.device, self.map_location)


def _place(t: torch.Tensor, recorded: str, map_location: Any) -> torch.Tensor:
    """``t`` (read on the CPU) where ``map_location`` puts a tensor recorded on
    ``recorded``, as ``torch.load`` would."""
    where: str | torch.device
    if callable(map_location):
        st = map_location(t.untyped_storage(), recorded)
        where = st.device if isinstance(st, torch.UntypedStorage) else t.device
    elif isinstance(map_location, dict):
        where = map_location.get(recorded, recorded)
    else:
        where = recorded if map_location is None else map_location
    try:
        return t.to(where)
    except (RuntimeError, AssertionError) as e:
        raise SnapshotError(
            f"a tensor of the snapshot was recorded on {recorded!r} and cannot be placed on "
            f"{str(where)!r} ({first_line(e)}): pass map_location='cpu'."
        ) from e


def materialize(obj: Any, store: TensorStore) -> Any:
    """``obj`` with every :class:`TensorRef` read from ``store`` (in one pass)."""
    refs: list[TensorRef] = []
    _collect(obj, refs)
    names = [r.name for r in refs] + [r.indices.name for r in refs if r.indices is not None]
    tensors = store.read(names)
    return _fill(obj, tensors)


def _collect(obj: Any, out: list[TensorRef]) -> None:
    if isinstance(obj, TensorRef):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _collect(v, out)


def _fill(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        t = tensors[obj.name]
        if obj.indices is not None:
            try:
                return torch.sparse_coo_tensor(
                    tensors[obj.indices.name], t, obj.shape, check_invariants=True
                ).coalesce()
            except RuntimeError as e:
                raise SnapshotError(
                    f"a snapshot's sparse tensor {obj.name!r} is corrupt ({first_line(e)})."
                ) from e
        return t
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


def describe_tensor(key: str, t: torch.Tensor) -> TensorEntry:
    """The :class:`TensorEntry` of a loaded tensor (a file of the older format records
    none): measured now, no checksum."""
    dense = t.to_dense() if t.layout != torch.strided else t
    x = dense.detach().abs() if dense.is_complex() else dense.detach()
    nonfinite, norm = measure_tensor(x, with_norm=True)
    return TensorEntry(key, dtype_name(t.dtype), tuple(t.shape), str(t.device), 0, nonfinite, norm)
