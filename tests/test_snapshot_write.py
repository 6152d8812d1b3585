"""Writing a snapshot file fast: a synchronous save measures every tensor from the live
tensor on a thread of its own while the next ones are written, and starts the disk
write-back on the way; an async one measures the file's pages afterwards. Both allocate
the file's blocks first (a full disk is an OSError before a byte is written). Either way
the checksums, counts and norms are those of the file's bytes, and a failure leaves no
file and the destination as it was."""

from __future__ import annotations

import ctypes
import errno
import json
import math
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from nbdebug.core.snapshot import containerwrite
from nbdebug.core.snapshot.archive import PendingSave, atomic_save, unique_path
from nbdebug.core.snapshot.container import read_document
from nbdebug.core.snapshot.format import FORMAT


def tensors() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    w = torch.randn(5, 7)
    w[0, 0], w[1, 2], w[4, 6] = float("nan"), float("inf"), float("-inf")
    x = torch.randn(3, 9)
    x[2, 1] = x[0, 8] = float("nan")
    z = torch.randn(2, 3, dtype=torch.complex64)
    zx = z.clone()
    zx[1, 1] = complex(1.0, float("nan"))
    return {
        "model_state": {
            "w": w,
            "h": torch.randn(3, 4).half(),
            "bf": torch.randn(6).to(torch.bfloat16),
            "d": torch.tensor(-2.5, dtype=torch.float64),
            "e": torch.empty(0, 3),
            "t": torch.randn(4, 6).t(),  # not contiguous
            "mask": torch.tensor([True, False, True]),
            "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),  # stored as bytes
            "z": z,
        },
        "inputs": {"x": x, "ids": torch.arange(7), "zx": zx},
    }


def stored_bytes(t: torch.Tensor) -> bytes:
    """The bytes a tensor is stored as, worked out in plain torch."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def file_tensors(path: Path) -> dict[str, bytes]:
    """Each stored tensor's bytes as the file holds them (from the safetensors header)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    return {
        k: raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]
        for k, v in header.items()
        if k != "__metadata__"
    }


def write(live: bool, obj: dict[str, Any], path: Path) -> Path:
    return atomic_save(obj, path) if live else PendingSave(obj, path).finish()


@pytest.mark.parametrize("live", [True, False], ids=["save_snapshot", "async"])
def test_the_table_holds_the_checksums_counts_and_norms_of_the_files_bytes(
    tmp_path: Path, live: bool
) -> None:
    state = tensors()
    path = write(live, {"format": FORMAT, **state}, tmp_path / "s.nbsnap")
    table, in_file = read_document(path)[1], file_tensors(path)
    assert sorted(table) == sorted(f"{g}/{k}" for g, ts in state.items() for k in ts)
    for group, ts in state.items():
        for key, t in ts.items():
            name, e = f"{group}/{key}", table[f"{group}/{key}"]
            assert in_file[name] == stored_bytes(t), name
            assert e.crc32 == zlib.crc32(stored_bytes(t)), name
            floating = t.is_floating_point() or t.is_complex()
            real = torch.view_as_real(t) if t.is_complex() else t
            want = int((~torch.isfinite(real)).sum()) if floating else None
            assert e.nonfinite == want, name
            if group == "model_state" and floating:
                norm = float(torch.linalg.vector_norm(real.double()))
                assert e.norm == pytest.approx(norm, rel=1e-3, nan_ok=True), name
            else:
                assert e.norm is None, name
    assert table["model_state/w"].nonfinite == 3 and math.isnan(table["model_state/w"].norm)
    assert table["inputs/x"].nonfinite == 2 and table["inputs/zx"].nonfinite == 1
    assert table["model_state/e"].crc32 == 0 and table["model_state/e"].nonfinite == 0


def test_a_sync_write_starts_the_write_back_of_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kicks: list[tuple[int, int]] = []
    real = containerwrite._start_writeback

    def spy(fd: int, start: int, length: int) -> None:
        kicks.append((start, length))
        real(fd, start, length)

    monkeypatch.setattr(containerwrite, "_KICK", 4096)
    monkeypatch.setattr(containerwrite, "_start_writeback", spy)
    big = {f"p{i}": torch.randn(1000) for i in range(12)}  # 4,000 bytes each
    big["large"] = torch.randn(2560)  # 10,240 bytes: written in 4,096-byte parts
    path = atomic_save({"format": FORMAT, "model_state": big}, tmp_path / "s.nbsnap")
    data_start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    # every second tensor's end starts the write-back of the two written since the last,
    # then each part of the large one (its last part is left to the fsync)
    want = [(8000 * i, 8000) for i in range(6)] + [(48000, 4096), (52096, 4096)]
    assert kicks == [(data_start + a, n) for a, n in want]
    loaded = load_file(path)
    assert all(torch.equal(loaded[f"model_state/{k}"], v) for k, v in big.items())


def test_a_failure_on_the_measuring_thread_is_raised_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(t: torch.Tensor, *, with_norm: bool) -> tuple[int | None, float | None]:
        raise RuntimeError("the measuring thread failed")

    dest = tmp_path / "old.nbsnap"
    dest.write_bytes(b"the snapshot written before")
    monkeypatch.setattr(containerwrite, "measure_tensor", broken)
    with pytest.raises(RuntimeError, match="the measuring thread failed"):
        atomic_save({"format": FORMAT, "model_state": tensors()["model_state"]}, dest)
    assert dest.read_bytes() == b"the snapshot written before"
    assert list(tmp_path.iterdir()) == [dest]  # no temporary file left
    assert not [t for t in threading.enumerate() if t.name.startswith("nbdebug-snapshot-")]
    fresh = unique_path(tmp_path, 4)
    with pytest.raises(RuntimeError, match="the measuring thread failed"):
        atomic_save({"format": FORMAT, "x": torch.ones(3)}, fresh)
    assert unique_path(tmp_path, 4) == fresh and list(tmp_path.iterdir()) == [dest]


def _no_fallocate(name: str) -> None:
    return None


def _unsupported(name: str) -> Any:
    def fallocate(*args: Any) -> int:
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    return fallocate if name == "fallocate64" else None


@pytest.mark.parametrize("libc", [_no_fallocate, _unsupported], ids=["none", "unsupported"])
def test_a_write_without_fallocate_writes_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, libc: Any
) -> None:
    obj = {"format": FORMAT, **tensors()}
    allocated: list[bool] = []
    real = containerwrite._allocate

    def spy(fd: int, size: int) -> bool:
        allocated.append(real(fd, size))
        return allocated[-1]

    monkeypatch.setattr(containerwrite, "_allocate", spy)
    first = PendingSave(obj, tmp_path / "a.nbsnap").finish()
    monkeypatch.setattr(containerwrite, "_libc", libc)
    second = PendingSave(obj, tmp_path / "b.nbsnap").finish()
    assert allocated == [True, False]  # tmp_path's file system allocates (ext4, tmpfs)
    assert first.read_bytes() == second.read_bytes()
    for name, t in file_tensors(first).items():
        group, key = name.split("/")
        assert t == stored_bytes(obj[group][key]), name


def test_a_full_disk_when_allocating_is_an_os_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(name: str) -> Any:
        def fallocate(*args: Any) -> int:
            ctypes.set_errno(errno.ENOSPC)
            return -1

        return fallocate

    monkeypatch.setattr(containerwrite, "_libc", full)
    with pytest.raises(OSError, match="No space left on device"):
        PendingSave({"format": FORMAT, "x": torch.ones(8)}, tmp_path / "s.nbsnap")
    assert not list(tmp_path.iterdir())
