"""core.snapshot: the file format, atomic writes, safe loading, replay and listing."""

from __future__ import annotations

import collections
import io
import os
import pickle
import random
import re
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.core.snapshot import (
    FORMAT_VERSION,
    Snapshot,
    SnapshotError,
    list_snapshots,
    load_snapshot,
    save_snapshot,
)
from nbdebug.core.snapshot import archive as snapmod
from nbdebug.core.state import RngState
from nbdebug.figures.report import history_table, snapshot_facts


class Net(nn.Module):
    def __init__(self, hidden: int = 6):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


@pytest.fixture
def trained(tmp_path):
    """A model after two Adam steps, with its optimizer, scheduler and a batch."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(8, 4)
    y = torch.randint(0, 3, (8,))
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, x, y


def write_torch_save(payload: dict, path: Path) -> Path:
    """Write a snapshot in the format of versions 1-4 (a torch.save zip archive): files
    written before the safetensors layout still load."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # as nbdebug wrote them: the archive is named "archive"
        torch.save(payload, f)
    return path


def _save(tmp_path, trained, **kw):
    model, opt, sched, x, y = trained
    args = {
        "optimizer": opt,
        "scheduler": sched,
        "step": 12,
        "reason": {
            "kind": "loss",
            "message": "non-finite loss (nan) at step 12",
            "loss": float("nan"),
        },
        "history": [
            {"step": 11, "loss": 1.5, "grad_norm": 0.3, "skipped": False},
            {"step": 12, "loss": float("nan")},
        ],
        "loss_fn": nn.functional.cross_entropy,
    }
    args.update(kw)
    return save_snapshot(tmp_path / "snaps", model, x, y, **args)


# --------------------------------------------------------------------------- round trip


def test_round_trip_fields(tmp_path, trained):
    model, opt, _sched, x, y = trained
    path = _save(tmp_path, trained)
    assert path == tmp_path / "snaps" / "step-000000012.nbsnap" and path.is_file()
    assert sorted(os.listdir(path.parent)) == ["step-000000012.nbsnap"]  # no temp file left

    snap = load_snapshot(path, Net)
    assert snap.step == 12 and snap.version == FORMAT_VERSION and snap.path == path
    assert snap.reason["kind"] == "loss" and "step 12" in snap.reason["message"]
    assert np.isnan(snap.reason["loss"])
    assert torch.equal(snap.inputs, x) and torch.equal(snap.target, y)
    assert isinstance(snap.model, Net)
    for k, v in model.state_dict().items():
        assert torch.equal(snap.model.state_dict()[k], v), k
    assert snap.model is not model and snap.model.training
    assert snap.optimizer_class == "torch.optim.adam:Adam"
    assert snap.scheduler_state is not None and snap.scheduler_state["last_epoch"] == 2
    assert str(snap.scheduler_class).endswith(":StepLR")
    assert snap.environment["torch"] == torch.__version__ and snap.environment["devices"] == ["cpu"]
    assert snap.environment["dtypes"] == ["float32", "int64"]  # BatchNorm's num_batches_tracked
    assert snap.loss_fn() is nn.functional.cross_entropy
    assert "step 12" in repr(snap) and "Net" in repr(snap)

    h = snap.history_frame()
    assert list(h.columns[:7]) == [
        "step",
        "loss",
        "grad_norm",
        "param_norm",
        "lr",
        "scale",
        "skipped",
    ]
    assert (
        h["step"].tolist() == [11, 12] and h["loss"].iloc[0] == 1.5 and np.isnan(h["loss"].iloc[1])
    )
    assert h["skipped"].dtype == bool and h["grad_norm"].isna().tolist() == [False, True]

    # the optimizer comes back with its moments and step counts
    opt2 = snap.build_optimizer()
    st1, st2 = opt.state_dict(), opt2.state_dict()
    assert st2["param_groups"][0]["lr"] == st1["param_groups"][0]["lr"]
    for i in st1["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st1["state"][i][key], st2["state"][i][key])
    assert all(p2 is q for p2, q in zip(opt2.param_groups[0]["params"], snap.model.parameters()))


def test_load_and_replay_never_change_the_callers_model(tmp_path, trained):
    model = trained[0]
    path = _save(tmp_path, trained)
    model.eval()
    handle = model.fc1.register_forward_hook(lambda *a: None)
    model.fc2.weight.grad = torch.ones_like(model.fc2.weight)
    before = fingerprint(model, versions=True)
    snap = load_snapshot(path, model)
    assert isinstance(snap.model, Net) and snap.model is not model
    snap.trace()
    snap.model.fc1.weight.data.add_(1.0)  # changing the copy does not reach the original
    assert_unchanged(before, model)
    handle.remove()


def test_model_from_factory_recipe_and_none(tmp_path, trained, monkeypatch):
    pkg = tmp_path / "pkgsrc"
    pkg.mkdir()
    marker = tmp_path / "factory-ran"
    (pkg / "snapfactory.py").write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            import torch
            from torch import nn

            class Net(nn.Module):
                def __init__(self, hidden=6):
                    super().__init__()
                    self.fc1 = nn.Linear(4, hidden)
                    self.bn = nn.BatchNorm1d(hidden)
                    self.drop = nn.Dropout(0.5)
                    self.fc2 = nn.Linear(hidden, 3)

                def forward(self, x):
                    return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))

            def make(hidden):
                Path({str(marker)!r}).write_text("ran")
                return Net(hidden)
            """
        )
    )
    monkeypatch.syspath_prepend(str(pkg))
    path = _save(tmp_path, trained, recipe=("snapfactory:make", {"hidden": 6}))

    # without trust the recipe is never imported: no model, but everything else is there
    snap = load_snapshot(path)
    assert snap.model is None and not marker.exists() and "snapfactory" not in sys.modules
    assert snap.recipe == {"factory": "snapfactory:make", "kwargs": {"hidden": 6}}
    assert snap.history and snap.inputs is not None
    with pytest.raises(SnapshotError, match="trust_recipe=True"):
        snap.trace()

    snap = load_snapshot(path, trust_recipe=True)
    assert marker.read_text() == "ran" and type(snap.model).__name__ == "Net"
    assert snap.model is not None
    for k, v in trained[0].state_dict().items():
        assert torch.equal(snap.model.state_dict()[k], v)

    # a zero-argument factory
    snap = load_snapshot(path, lambda: Net(6))
    assert isinstance(snap.model, Net)
    with pytest.raises(TypeError, match="returned int"):
        load_snapshot(path, lambda: 3)
    with pytest.raises(TypeError, match=r"torch.nn.Module, a zero-argument factory"):
        load_snapshot(path, model="Net")


def test_recipe_failure_is_a_snapshot_error(tmp_path, trained):
    path = _save(tmp_path, trained, recipe="no_such_module_xyz:make")
    with pytest.raises(SnapshotError, match="no_such_module_xyz"):
        load_snapshot(path, trust_recipe=True)
    with pytest.raises(ValueError, match=r"package.module:factory"):
        _save(tmp_path, trained, recipe="not a path")
    with pytest.raises(ValueError, match="JSON"):
        _save(tmp_path, trained, recipe=("m:f", {"x": object()}))


def test_batch_structures_and_unstorable_values(tmp_path):
    model = nn.Linear(3, 2)
    big = torch.randn(1000, 3)
    Pair = collections.namedtuple("Pair", "a b")
    inputs = {
        "x": big[:4],
        "extra": (Pair(torch.ones(2), 3), [np.arange(3), np.float32(2.5)]),
        "fn": print,
    }
    path = save_snapshot(tmp_path / "s.nbsnap", model, inputs, None, step=0)
    snap = load_snapshot(path, model)
    got = snap.inputs
    assert torch.equal(got["x"], big[:4])
    assert got["x"].untyped_storage().nbytes() == 4 * 3 * 4  # the view, not the whole data set
    assert isinstance(got["extra"][0], tuple) and torch.equal(got["extra"][0][0], torch.ones(2))
    assert torch.equal(got["extra"][1][0], torch.arange(3)) and got["extra"][1][1] == 2.5
    assert got["fn"] is None and snap.dropped == ["inputs['fn']"]
    assert snap.target is None


def test_unique_names_never_overwrite(tmp_path):
    model = nn.Linear(2, 2)
    p1 = save_snapshot(tmp_path, model, torch.ones(1, 2), step=5)
    p2 = save_snapshot(tmp_path, model, torch.zeros(1, 2), step=5)
    assert p1.name == "step-000000005.nbsnap" and p2.name == "step-000000005-1.nbsnap"
    assert torch.equal(load_snapshot(p1).inputs, torch.ones(1, 2))


def test_loss_module_and_lambda(tmp_path, trained):
    w = torch.tensor([1.0, 2.0, 0.5])
    path = _save(tmp_path, trained, loss_fn=nn.CrossEntropyLoss(weight=w, label_smoothing=0.2))
    snap = load_snapshot(path, Net)
    loss = snap.loss_fn()
    assert isinstance(loss, nn.CrossEntropyLoss) and loss.label_smoothing == 0.2
    assert isinstance(loss.weight, torch.Tensor) and torch.equal(loss.weight, w)
    out = torch.randn(8, 3)
    y = trained[4]
    assert torch.allclose(loss(out, y), nn.CrossEntropyLoss(weight=w, label_smoothing=0.2)(out, y))

    path = _save(tmp_path, trained, loss_fn=lambda o, t: nn.functional.cross_entropy(o, t))
    snap = load_snapshot(path, Net)
    with pytest.raises(SnapshotError, match=r"snap.trace\(loss_fn=\.\.\.\)"):
        snap.trace()
    tr = snap.trace(loss_fn=nn.functional.cross_entropy)
    assert tr.loss is not None and np.isfinite(tr.loss)


def test_replay_uses_the_stored_rng(tmp_path):
    """Dropout masks of the replay are those of the saved step."""
    torch.manual_seed(1)
    model = Net()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    rng = RngState.capture()
    loss = nn.functional.cross_entropy(model(x), y).item()  # consumes RNG (dropout)
    path = save_snapshot(
        tmp_path, model, x, y, step=3, rng=rng, loss_fn=nn.functional.cross_entropy
    )
    torch.manual_seed(12345)
    state = torch.get_rng_state()
    np_state, py_state = np.random.get_state(), random.getstate()
    tr = load_snapshot(path, Net).trace()
    assert tr.loss == pytest.approx(loss, rel=1e-6)
    # ... and the caller's RNG is back as it was
    assert torch.equal(torch.get_rng_state(), state)
    assert np.array_equal(np.random.get_state()[1], np_state[1])  # type: ignore[index]
    assert random.getstate() == py_state


# --------------------------------------------------------------------------- bad files


def test_damaged_tensor_bytes_are_refused(tmp_path, trained):
    # bytes changed inside a stored tensor leave a readable archive: the record's CRC-32
    # is what tells, and a replay of such a file would be a different step
    good = _save(tmp_path, trained, write=write_torch_save)
    data = good.read_bytes()
    weight = trained[0].fc1.weight.detach().numpy().tobytes()
    at = data.find(weight)
    assert at > 0
    bad = bytearray(data)
    bad[at : at + 4] = np.array([np.nan], dtype=np.float32).tobytes()
    path = tmp_path / "damaged.nbsnap"
    path.write_bytes(bytes(bad))
    with pytest.raises(SnapshotError, match=r"record 'archive/data/\d+' do not match the checksum"):
        load_snapshot(path, Net())
    assert path.read_bytes() == bytes(bad)  # the file is left as it was
    # listing maps the tensors without reading them: the damaged file is still listed
    listed = list_snapshots(tmp_path).set_index("path")
    assert listed.loc[str(path), "step"] == 12 and pd.isna(listed.loc[str(path), "error"])
    # a file written without checksums (torch's compute_crc32 off) still loads
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        plain = _save(tmp_path / "nocrc", trained, write=write_torch_save)
    with zipfile.ZipFile(plain) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    snap = load_snapshot(plain, Net())
    assert torch.equal(snap.model.fc1.weight, trained[0].fc1.weight)


def test_checksums_hold_for_tied_and_equal_tensors(tmp_path):
    # one storage per record: a tied weight is one record, two equal tensors are two records
    # with one checksum; both load, and damage to either copy is still caught
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("a", torch.ones(5))
    model.register_buffer("b", torch.ones(5))
    good = save_snapshot(tmp_path, model, torch.tensor([[1, 2]]), step=3)
    snap = load_snapshot(good, model)
    assert torch.equal(snap.model.b, torch.ones(5))
    data = good.read_bytes()
    ones = torch.ones(5).numpy().tobytes()
    first = data.find(ones)
    assert data.find(ones, first + 1) > first  # both copies are in the file
    bad = bytearray(data)
    bad[first : first + 4] = np.array([2.0], dtype=np.float32).tobytes()
    (tmp_path / "bad.nbsnap").write_bytes(bytes(bad))
    with pytest.raises(SnapshotError, match="do not match the checksum"):
        load_snapshot(tmp_path / "bad.nbsnap", model)
    # a sparse tensor has no strided storage to compare: its records are read from the file
    from nbdebug.core.snapshot.archive import read_archive

    torch.save({"sp": torch.eye(3).to_sparse(), "w": torch.ones(2)}, tmp_path / "sp.pt")
    assert torch.equal(read_archive(tmp_path / "sp.pt")["sp"].to_dense(), torch.eye(3))


def _payload(path: Path) -> dict:
    return snapmod.read_archive(path)


def test_a_bad_map_location_is_named_not_the_file(tmp_path, trained):
    good = _save(tmp_path, trained)
    before = good.read_bytes()
    cases = {
        "gpu": (ValueError, "got 'gpu', which is not a device"),
        3.5: (TypeError, "got float 3.5"),
        "meta": (ValueError, "meta device hold no values"),
    }
    if not torch.cuda.is_available():
        cases["cuda:0"] = (ValueError, "a device this machine has; got 'cuda:0'")
    for value, (err, text) in cases.items():
        with pytest.raises(err, match=re.escape(text)) as info:
            load_snapshot(good, map_location=value)
        assert "corrupt" not in str(info.value)
    assert good.read_bytes() == before
    # what torch.load takes still loads
    for value in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage):
        assert load_snapshot(good, map_location=value).step == load_snapshot(good).step


def test_replay_autocast_takes_a_bool_only(tmp_path, trained):
    # a dtype or a string in place of True would be taken as "true" and replay the
    # recorded state (float32 here), not the dtype the caller named
    snap = load_snapshot(_save(tmp_path, trained), model=Net())
    for bad in (torch.bfloat16, "bf16", 1):
        with pytest.raises(TypeError, match=f"autocast must be True or False; got {bad!r}"):
            snap.trace(autocast=bad)
        with pytest.raises(TypeError, match=f"autocast must be True or False; got {bad!r}"):
            nbdebug.diagnose(snap, autocast=bad, progress=False)
    assert snap.trace(autocast=False).loss is not None


def test_bad_files(tmp_path, trained):
    good = _save(tmp_path, trained)

    def put(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    data = good.read_bytes()
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "missing.nbsnap")
    with pytest.raises(SnapshotError, match="is a directory"):
        load_snapshot(tmp_path)
    with pytest.raises(SnapshotError, match="is empty"):
        load_snapshot(put("empty.nbsnap", b""))
    with pytest.raises(SnapshotError, match=r"not a torch.save zip archive"):
        load_snapshot(
            put(
                "random.nbsnap",
                bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
            )
        )
    for cut in (len(data) // 3, len(data) - 30):
        with pytest.raises(SnapshotError, match="truncated or corrupt"):
            load_snapshot(put(f"cut{cut}.nbsnap", data[:cut]))
    # a plain checkpoint
    torch.save(trained[0].state_dict(), tmp_path / "ckpt.pt")
    with pytest.raises(
        SnapshotError, match=r"not an nbdebug snapshot.*fc1.weight.*plain checkpoint"
    ):
        load_snapshot(tmp_path / "ckpt.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(SnapshotError, match="holds a list"):
        load_snapshot(tmp_path / "list.pt")
    # a zip that torch did not write
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(SnapshotError, match="corrupt"):
        load_snapshot(put("foreign.zip", buf.getvalue()))
    # a missing key, a wrong type, a newer format
    payload = _payload(good)
    for key in ("model_state", "inputs", "history"):
        broken = {k: v for k, v in payload.items() if k != key}
        torch.save(broken, tmp_path / f"no-{key}.nbsnap")
        with pytest.raises(SnapshotError, match=f"lacks '{key}'"):
            load_snapshot(tmp_path / f"no-{key}.nbsnap")
    torch.save({**payload, "step": "twelve"}, tmp_path / "wrongtype.nbsnap")
    with pytest.raises(SnapshotError, match="'step' should be int or None, got str"):
        load_snapshot(tmp_path / "wrongtype.nbsnap")
    for t in (
        1e300,
        float("nan"),
        -1e20,
    ):  # found by the fuzz test: a flipped bit in the time stamp
        torch.save({**payload, "time": t}, tmp_path / "badtime.nbsnap")
        with pytest.raises(SnapshotError, match=r"time stamp .* is not a date"):
            load_snapshot(tmp_path / "badtime.nbsnap")
    torch.save({**payload, "model_state": {"fc1.weight": 3}}, tmp_path / "badstate.nbsnap")
    with pytest.raises(SnapshotError, match="not named tensors"):
        load_snapshot(tmp_path / "badstate.nbsnap")
    torch.save(
        {"format": "nbdebug-snapshot", "version": FORMAT_VERSION + 1, "future": 1},
        tmp_path / "new.nbsnap",
    )
    with pytest.raises(
        SnapshotError, match=f"newer nbdebug.*version {FORMAT_VERSION + 1}.*upgrade"
    ):
        load_snapshot(tmp_path / "new.nbsnap")


class _Evil:
    def __reduce__(self):
        return (os.mkdir, (os.environ["NBDEBUG_EVIL_DIR"],))


def test_no_code_from_the_file_runs(tmp_path, trained, monkeypatch):
    target = tmp_path / "pwned"
    monkeypatch.setenv("NBDEBUG_EVIL_DIR", str(target))
    payload = _payload(_save(tmp_path, trained))
    payload["reason"] = {"kind": "loss", "message": "x", "evil": _Evil()}
    torch.save(payload, tmp_path / "evil.nbsnap")
    with pytest.raises(SnapshotError, match=r"Python objects other than tensors.*refused"):
        load_snapshot(tmp_path / "evil.nbsnap", Net)
    assert not target.exists()
    # a legacy (non-zip) torch pickle is refused before unpickling
    with open(tmp_path / "legacy.nbsnap", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(SnapshotError, match=r"not a torch.save zip archive"):
        load_snapshot(tmp_path / "legacy.nbsnap")
    assert not target.exists()


def test_state_that_does_not_fit(tmp_path, trained):
    path = _save(tmp_path, trained)

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 7)
            self.fc2 = nn.Linear(7, 3)
            self.extra = nn.Linear(3, 3)

    user_model = Other()
    before = fingerprint(user_model, versions=True)
    with pytest.raises(SnapshotError) as info:
        load_snapshot(path, user_model)
    msg = str(info.value)
    assert "does not fit the given Other" in msg
    assert "missing keys: extra.weight, extra.bias" in msg
    assert "unexpected keys: bn.weight, bn.bias, bn.running_mean" in msg
    assert (
        "fc1.weight: snapshot (6, 4) vs model (7, 4)" in msg
        and "fc2.weight: snapshot (3, 6) vs model (3, 7)" in msg
    )
    assert_unchanged(before, user_model)


# --------------------------------------------------------------------------- atomic write


def test_crash_between_write_and_rename(tmp_path, trained, monkeypatch):
    model, _opt, _, x, y = trained
    final = tmp_path / "step-000000007.nbsnap"
    old = save_snapshot(final, model, x, y, step=7, reason="first")
    old_bytes = old.read_bytes()
    calls = []

    def crash(src, dst):
        calls.append((src, dst))
        assert (
            Path(src).stat().st_size > 0 and Path(src).parent == tmp_path
        )  # fully written, same dir
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(snapmod.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_snapshot(final, model, torch.zeros(2, 4), y, step=7, reason="second")
    with pytest.raises(OSError, match="simulated crash"):
        save_snapshot(tmp_path / "step-000000008.nbsnap", model, x, y, step=8)
    assert len(calls) == 2
    # the old complete file is untouched, no half file under a final name, no temp file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000007.nbsnap"]
    assert final.read_bytes() == old_bytes
    assert load_snapshot(final).reason["message"] == "first"


# --------------------------------------------------------------------------- GPU -> CPU


@pytest.fixture
def cuda_tagged():
    """Make torch.save tag CPU storages as 'cuda:0', as a GPU run's file would be."""
    active = {"on": False}

    def tagger(storage):
        return "cuda:0" if active["on"] and storage.device.type == "cpu" else None

    def deserializer(storage, location):
        return None

    torch.serialization.register_package(-1, tagger, deserializer)
    try:
        yield active
    finally:
        active["on"] = False
        reg = torch.serialization._package_registry
        reg[:] = [e for e in reg if e[1] is not tagger]


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a CUDA file on a CPU-only machine")
def test_gpu_snapshot_loads_on_cpu(tmp_path, trained, cuda_tagged):
    cuda_tagged["on"] = True
    path = _save(tmp_path, trained, write=write_torch_save)
    cuda_tagged["on"] = False
    # the file really is a CUDA file: a plain load on this machine fails ...
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(path, weights_only=True)
    # ... and load_snapshot maps it to the CPU (default map_location) and replays it
    snap = load_snapshot(path, Net)
    assert all(v.device.type == "cpu" for v in snap.model_state.values())
    assert snap.inputs.device.type == "cpu"
    assert np.isfinite(snap.trace().loss)
    # an explicit map_location goes through the same code path
    seen = []

    def where(storage, location):
        seen.append(location)
        return storage

    snap = load_snapshot(path, Net, map_location=where)
    assert seen and set(seen) == {"cuda:0"}
    assert torch.equal(snap.inputs, trained[3])


# --------------------------------------------------------------------------- listing


def test_list_snapshots(tmp_path, trained):
    model, _, _, x, y = trained
    save_snapshot(tmp_path, model, x, y, step=30, reason={"kind": "grad", "message": "grads at 30"})
    save_snapshot(tmp_path, model, x, y, step=4, reason={"kind": "loss", "message": "loss at 4"})
    (tmp_path / "step-000000099.nbsnap").write_bytes(b"garbage")
    (tmp_path / "notes.txt").write_text("not a snapshot")
    df = list_snapshots(tmp_path)
    assert list(df.columns) == ["path", "step", "kind", "reason", "time", "error"]
    assert df["step"].tolist()[:2] == [4, 30] and pd.isna(df["step"].iloc[2])
    assert df["reason"].tolist()[:2] == ["loss at 4", "grads at 30"]
    assert df["kind"].tolist()[:2] == ["loss", "grad"]
    assert pd.api.types.is_datetime64_any_dtype(df["time"]) and df["time"].notna().sum() == 2
    assert df["error"].iloc[2].endswith("(it starts with b'garb').")
    assert df["error"].iloc[:2].isna().all()
    (tmp_path / "empty").mkdir()
    assert len(list_snapshots(tmp_path / "empty")) == 0
    with pytest.raises(ValueError, match="is not a directory"):
        list_snapshots(tmp_path / "nope")
    with pytest.raises(TypeError, match="directory must be"):
        list_snapshots(3)  # type: ignore[arg-type]


def test_public_names():
    assert nbdebug.load_snapshot is load_snapshot and nbdebug.Snapshot is Snapshot
    assert nbdebug.SnapshotError is SnapshotError and nbdebug.list_snapshots is list_snapshots
    assert nbdebug.save_snapshot is save_snapshot


# --------------------------------------------------------------------------- fuzz


@pytest.fixture(scope="module")
def small_snapshot(tmp_path_factory) -> tuple[bytes, int]:
    """A small valid snapshot and the end offset of its pickle record (data.pkl)."""
    d = tmp_path_factory.mktemp("fuzz")
    model = nn.Linear(3, 2)
    p = save_snapshot(
        d,
        model,
        torch.randn(2, 3),
        torch.tensor([0, 1]),
        step=1,
        reason={"kind": "loss", "message": "m"},
        history=[{"step": 0, "loss": 1.0}],
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
        write=write_torch_save,
    )
    with zipfile.ZipFile(p) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    return p.read_bytes(), info.header_offset + 100 + info.file_size


_pos = st.integers(0, 10**7)
_mutation = st.tuples(
    st.sampled_from(["pickle", "anywhere"]),
    st.one_of(
        st.tuples(
            st.just("flip"), st.lists(st.tuples(_pos, st.integers(1, 255)), min_size=1, max_size=6)
        ),
        st.tuples(st.just("cut"), _pos),
        st.tuples(st.just("insert"), st.tuples(_pos, st.binary(min_size=1, max_size=64))),
        st.tuples(st.just("delete"), st.tuples(_pos, st.integers(1, 256))),
    ),
)


def _mutate(data: bytes, pickle_end: int, mutation) -> bytes:
    region, (kind, arg) = mutation
    b = bytearray(data)
    n = len(b) if region == "anywhere" else min(pickle_end, len(b))
    if kind == "flip":
        for pos, x in arg:
            b[pos % n] ^= x
    elif kind == "cut":
        del b[arg % n :]
    elif kind == "insert":
        pos, chunk = arg
        b[pos % n : pos % n] = chunk
    else:
        pos, length = arg
        del b[pos % n : pos % n + length]
    return bytes(b)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(mutation=_mutation)
def test_fuzz_only_snapshot_error(small_snapshot, tmp_path, mutation):
    data, pickle_end = small_snapshot
    path = tmp_path / "fuzz.nbsnap"
    path.write_bytes(_mutate(data, pickle_end, mutation))
    try:
        snap = load_snapshot(path, nn.Linear(3, 2))
        # a mutation that kept the file valid (e.g. inside zip padding) loads fully
        assert isinstance(snap, Snapshot) and isinstance(snap.model, nn.Linear)
        repr(snap)
        snap.history_frame()
        list_snapshots(tmp_path)
        snapshot_facts(snap)  # what `nbdebug inspect` prints of it
        history_table(snap)
    except SnapshotError:
        pass


def test_two_background_writes_of_one_name_keep_both_files(tmp_path: Path) -> None:
    # a background write creates its file later: the name is reserved when handed out
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    guards = [
        nbdebug.NaNGuard(m, directory=tmp_path, async_save=True, on_nonfinite="continue")
        for m in (gen, disc)
    ]
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    for g, m in zip(guards, (gen, disc)):
        m(x).sum().backward()
        assert g.check(m(x).sum(), inputs=x, step=3) is False
    for g in guards:
        g.close()
    (a,), (b,) = guards[0].snapshots, guards[1].snapshots
    assert a != b and sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])
    assert load_snapshot(a).model_state["weight"].shape == (4, 4)
    assert load_snapshot(b).model_state["weight"].shape == (1, 4)


class FrozenNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(self.bn(self.fc(x))))


def test_a_submodule_frozen_in_eval_replays_in_eval(tmp_path: Path) -> None:
    # fine-tuning: model.train(); model.bn.eval(); the replay uses the running statistics
    torch.manual_seed(0)
    model = FrozenNorm()
    with torch.no_grad():
        model.bn.running_mean.fill_(-10.0)
    model.train()
    model.bn.eval()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    x[5] = -1000.0  # only this row goes negative through the frozen statistics
    live = nbdebug.trace(model, x, y, loss_fn=F.mse_loss)
    path = save_snapshot(tmp_path / "s.nbsnap", model, x, y, loss_fn=F.mse_loss)
    snap = load_snapshot(path, model=FrozenNorm)
    assert snap.model_training is True and snap.module_training == {"bn": False}
    rep = snap.trace()
    assert snap.model.bn.training is False and snap.model.fc.training is True
    assert live.origin is not None and rep.origin is not None
    assert (rep.origin.module, rep.origin.samples) == (live.origin.module, live.origin.samples)
    assert live.origin.samples == [5]


def test_a_torchscript_archive_is_named_and_a_bad_path_or_flag_too(tmp_path: Path) -> None:
    scripted = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 1)), str(scripted))
    with pytest.raises(SnapshotError, match=r"not a snapshot: it is a TorchScript archive"):
        load_snapshot(scripted)
    with pytest.raises(TypeError, match=r"^path must be a str or os\.PathLike; got int\.$"):
        load_snapshot(3)  # type: ignore[arg-type]
    path = save_snapshot(tmp_path / "s.nbsnap", nn.Linear(2, 1), torch.zeros(1, 2))
    with pytest.raises(TypeError, match=r"trust_recipe must be True or False; got 'yes'"):
        load_snapshot(path, trust_recipe="yes")  # type: ignore[arg-type]


def test_numpy_rng_captured_as_np_random_get_state_says_through_every_kind_of_draw():
    """RngState.capture reuses its last numpy state only while the generator is unchanged:
    after uniform draws, a normal draw (which caches its twin), the cached twin's use
    (which changes no word of the generator), a reseed and a set_state, the captured state
    equals np.random.get_state() field by field."""
    from nbdebug.core.state import RngState

    def same(a, b):
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]

    saved = np.random.get_state()
    try:
        np.random.seed(3)
        draws = [
            lambda: None,
            lambda: np.random.rand(5),
            lambda: np.random.randn(),  # caches the second normal
            lambda: np.random.randn(),  # uses it: the generator's words stay the same
            lambda: None,
            lambda: np.random.seed(3),
            lambda: np.random.set_state(saved),
            lambda: np.random.randint(0, 10, 3),
        ]
        for draw in draws:
            draw()
            got = RngState.capture().numpy
            assert same(got, np.random.get_state())
            got_again = RngState.capture().numpy
            assert same(got_again, np.random.get_state())
    finally:
        np.random.set_state(saved)
