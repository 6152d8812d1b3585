"""Snapshots at scale: async_save copies the tensors' bytes into the file during the step
and finishes it on a background thread (training goes on, errors surface on close), the
header's room holds its widest values, and a process killed mid-write leaves no
half-written file under the final name."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import nbdebug
from nbdebug.core.snapshot.archive import PendingSave, unique_path
from nbdebug.core.snapshot.container import read_document
from nbdebug.core.snapshot.data import cpu_copy
from nbdebug.core.snapshot.format import FORMAT


def bad_step(guard: nbdebug.NaNGuard, model: nn.Module, step: int) -> bool:
    x = torch.randn(4, 3)
    x[2, 1] = float("nan")
    y = torch.randn(4, 1)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return guard.check(loss, inputs=x, target=y, step=step)


def test_async_save_stores_the_step_as_it_was_while_training_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp_path, on_nonfinite="continue", patience=None, async_save=True
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert bad_step(guard, model, 5) is False
    (path,) = guard.snapshots
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the file is written
    guard.close()
    snap = nbdebug.load_snapshot(path, model=lambda: nn.Linear(3, 1))
    assert snap.step == 5 and snap.reason["kind"] == "loss"
    assert all(torch.equal(snap.model_state[k], v) for k, v in before.items())
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_a_failed_background_write_is_raised_by_close(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    guard = nbdebug.NaNGuard(
        model, directory=tmp_path / "snaps", on_nonfinite="continue", async_save=True
    )
    (tmp_path / "snaps").write_text("a file took the directory's place after the guard began")
    with pytest.warns(RuntimeWarning, match="writing the snapshot .* failed"):
        assert bad_step(guard, model, 1) is False  # the step itself is not held up
        with pytest.raises(OSError, match=r"background write of the snapshot .*step-000000001"):
            guard.close()


def test_async_save_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="async_save must be True or False; got 'yes'"):
        nbdebug.NaNGuard(nn.Linear(1, 1), directory=tmp_path, async_save="yes")  # type: ignore[arg-type]


def test_cpu_copy_keeps_tied_tensors_tied() -> None:
    w = torch.randn(3, 3)
    copied = cpu_copy({"a": w, "b": w[:], "c": [w.t()]})
    assert copied["a"] is copied["b"] and copied["a"].data_ptr() != w.data_ptr()
    assert torch.equal(copied["c"][0], w.t())


def test_a_pending_save_holds_the_bytes_of_when_it_began(tmp_path: Path) -> None:
    w = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    b = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    obj = {"format": FORMAT, "model_state": {"w": w, "b": b}}
    path = tmp_path / "s.nbsnap"
    pending = PendingSave(obj, path)
    before = {"model_state/w": w.clone(), "model_state/b": b.clone()}
    w.fill_(7.0)  # training goes on before the file is finished
    b.zero_()
    assert not path.exists()
    assert pending.finish() == path and not [p for p in tmp_path.iterdir() if p != path]
    for k, v in load_file(path).items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)
    table = read_document(path)[1]
    # measured from the file's bytes, not from the live tensors as they are now
    assert table["model_state/w"].nonfinite == 2 and table["model_state/b"].nonfinite is None
    for k, v in before.items():
        assert table[k].crc32 == zlib.crc32(v.numpy().tobytes())


def test_the_header_has_room_for_its_widest_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {
        "all_nan": torch.full((12345,), float("nan")),  # count = numel: its widest
        "wide_norm": torch.tensor([-1.2345678901234567e-150], dtype=torch.float64),
        "half": torch.randn(3, 5).half(),
        "flags": torch.tensor([True, False]),
    }
    obj = {"format": FORMAT, "model_state": state}
    path = PendingSave(obj, tmp_path / "s.nbsnap").finish()
    header = struct.unpack("<Q", path.read_bytes()[:8])[0]
    data = sum(t.numel() * t.element_size() for t in state.values())
    assert header % 8 == 0 and path.stat().st_size == 8 + header + data
    table, loaded = read_document(path)[1], load_file(path)
    for k, t in state.items():
        e = table[f"model_state/{k}"]
        torch.testing.assert_close(loaded[f"model_state/{k}"], t, rtol=0, atol=0, equal_nan=True)
        assert e.crc32 == zlib.crc32(t.numpy().tobytes())
        if t.is_floating_point():
            assert e.nonfinite == int((~torch.isfinite(t)).sum())
            norm = float(torch.linalg.vector_norm(t.float() if k == "half" else t))
            assert e.norm == pytest.approx(norm, rel=1e-6, nan_ok=True)


def test_a_failed_finish_leaves_no_file_and_frees_the_name(tmp_path: Path) -> None:
    path = unique_path(tmp_path, 3)
    pending = PendingSave({"format": FORMAT, "x": torch.ones(4)}, path)
    (tmp_file,) = tmp_path.iterdir()
    tmp_file.unlink()  # the temporary file went away before the write finished
    with pytest.raises(FileNotFoundError):
        pending.finish()
    assert not list(tmp_path.iterdir()) and unique_path(tmp_path, 3) == path


def test_a_failed_flush_to_the_disk_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    # the tensors' bytes are flushed on a thread of their own while they are measured
    monkeypatch.setattr("nbdebug.core.snapshot.containerwrite._datasync", full)
    pending = PendingSave({"format": FORMAT, "x": torch.ones(4)}, tmp_path / "s.nbsnap")
    with pytest.raises(OSError, match="No space left on device"):
        pending.finish()
    assert not list(tmp_path.iterdir())


def test_a_process_killed_mid_write_leaves_no_file_under_the_final_name(tmp_path: Path) -> None:
    final = tmp_path / "step-000000001.nbsnap"
    code = textwrap.dedent(
        f"""
        import torch
        from nbdebug.core.snapshot.archive import atomic_save
        big = {{"t%d" % i: torch.randn(4_000_000) for i in range(40)}}  # 640 MB
        print("writing", flush=True)
        atomic_save(big, {str(final)!r})
        print("done", flush=True)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"writing"
    deadline = time.monotonic() + 120
    tmp_files: list[Path] = []
    while time.monotonic() < deadline and not tmp_files:
        tmp_files = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        time.sleep(0.01)
    assert tmp_files, "the writer never created its temporary file"
    while time.monotonic() < deadline and tmp_files[0].exists() and not tmp_files[0].stat().st_size:
        time.sleep(0.005)  # some bytes are written: it is mid-write
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not final.exists()  # no half-written file under the final name
    assert len(nbdebug.list_snapshots(tmp_path)) == 0
