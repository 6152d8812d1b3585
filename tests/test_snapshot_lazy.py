"""Lazy snapshots (format 5, one safetensors file): load_snapshot reads the header, the
batch and the RNG states; the weights are read when used, the optimizer state only by
build_optimizer; the non-finite weights, their counts and the norms come from the
header; each tensor is checked against its checksum when read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

import nbdebug
from nbdebug.core.snapshot import FORMAT_VERSION, SnapshotError, load_snapshot, save_snapshot


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    F.cross_entropy(model(torch.randn(6, 64)), torch.randint(0, 4, (6,))).backward()
    opt.step()
    return model, opt


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture
def written(tmp_path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model, opt = _trained()
    with torch.no_grad():
        model[2].weight[0, :3] = float("nan")
        model[2].bias[1] = float("inf")
    x, y = torch.randn(6, 64), torch.randint(0, 4, (6,))
    path = save_snapshot(
        tmp_path / "s.nbsnap", model, x, y, optimizer=opt, step=9, loss_fn=F.cross_entropy
    )
    return path, model, opt


def test_the_file_is_one_safetensors_file_of_the_new_format(written):
    path, model, _opt = written
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        assert torch.equal(f.get_tensor("model_state/0.weight"), model[0].weight)
    assert {"model_state/0.weight", "optimizer/state/0/exp_avg", "inputs"} <= names
    doc = json.loads(meta["nbdebug"])
    assert doc["payload"]["version"] == FORMAT_VERSION >= 5 and doc["payload"]["layout"] == (
        "safetensors"
    )
    assert doc["tensors"]["model_state/2.weight"]["nonfinite"] == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.nbsnap"]  # no temp file


def test_load_reads_no_weight_until_used(written):
    path, model, opt = written
    snap = load_snapshot(path)
    small = snap.bytes_read  # the batch and the RNG states
    weights = _nbytes(model.state_dict().values())
    assert small < 14_000 and small < weights / 2
    # what inspect and list show, from the header alone
    assert "step 9" in repr(snap) and snap.reason["kind"] == "manual"
    snap.history_frame()
    assert snap.nonfinite_state() == {"2.weight": 3, "2.bias": 1}
    entries = snap.state_entries()
    assert entries["0.weight"].shape == (128, 64) and entries["0.weight"].numel == 8192
    norms = snap.param_norms()
    assert norms["0.weight"] == pytest.approx(float(model[0].weight.detach().norm()), rel=1e-6)
    assert norms["2.weight"] != norms["2.weight"]  # NaN
    assert snap.bytes_read == small
    # the weights are read when used, the optimizer state still not
    assert torch.equal(snap.model_state["0.weight"], model[0].weight)
    assert snap.bytes_read == small + weights
    opt_state = snap.optimizer_state
    assert opt_state is not None
    assert torch.equal(opt_state["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert snap.bytes_read > small + weights


def test_a_replay_reads_the_model_and_not_the_optimizer(written, tmp_path):
    path, model, _opt = written
    with torch.no_grad():
        model[2].weight.nan_to_num_(0.0)
        model[2].bias.nan_to_num_(0.0, 0.0, 0.0)
    x = torch.randn(6, 64)
    x[2, 1] = float("nan")
    path = save_snapshot(tmp_path / "r.nbsnap", model, x, torch.randint(0, 4, (6,)), step=3,
                         optimizer=_opt, loss_fn=F.cross_entropy)  # fmt: skip
    small = load_snapshot(path).bytes_read
    snap = load_snapshot(path, make_model)
    read = snap.bytes_read
    assert read == small + _nbytes(model.state_dict().values())
    tr = snap.trace()
    assert tr.origin is not None and tr.origin.phase == "input" and tr.origin.samples == [2]
    assert snap.bytes_read == read  # nothing more: the optimizer state stays unread
    part = snap.trace(modules="2")  # a NaN step: the exact pass still records every module
    assert part.origin is not None and part.origin.samples == [2]
    assert snap.bytes_read == read


def test_modules_reads_only_those_modules_state(written):
    path, model, _opt = written
    snap = load_snapshot(path, modules=["2"])
    before = snap.bytes_read
    assert sorted(snap.model_state) == ["2.bias", "2.weight"]
    assert snap.bytes_read - before == _nbytes([model[2].weight, model[2].bias])
    assert sorted(snap.nonfinite_state()) == ["2.bias", "2.weight"]
    assert sorted(load_snapshot(path, modules="0*").param_norms()) == ["0.bias", "0.weight"]
    # with a model the replay needs every weight: modules= is what the trace records
    full = load_snapshot(path, make_model, modules="2")
    assert len(full.model_state) == 4 and full.modules == ["2"]
    with pytest.raises(TypeError, match="modules must be a str or a sequence of str"):
        load_snapshot(path, modules=[3])  # type: ignore[list-item]


def test_a_damaged_weight_is_found_when_read_and_by_verify(written, tmp_path):
    path, _model, _opt = written
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    start, _end = json.loads(bytes(data[8 : 8 + n]))["model_state/0.bias"]["data_offsets"]
    data[8 + n + start] ^= 0x01
    bad = tmp_path / "bad.nbsnap"
    bad.write_bytes(bytes(data))
    snap = load_snapshot(bad)  # the header is intact: it loads, and lists
    assert nbdebug.list_snapshots(tmp_path).set_index("path").loc[str(bad), "step"] == 9
    msg = r"its tensor 'model_state/0.bias' do not match the checksum"
    with pytest.raises(SnapshotError, match=msg):
        snap.verify()
    with pytest.raises(SnapshotError, match=msg):
        snap.model_state  # noqa: B018
    with pytest.raises(SnapshotError, match=msg):
        load_snapshot(bad, make_model)
    assert load_snapshot(path).verify() == len(json.loads(bytes(data[8 : 8 + n]))) - 1


def test_tensors_of_every_kind_round_trip(tmp_path):
    model = nn.Linear(4, 4)
    model.register_buffer("bf", torch.randn(3).to(torch.bfloat16))
    model.register_buffer("mask", torch.tensor([True, False]))
    model.register_buffer("empty", torch.empty(0, 3))
    model.register_buffer("scalar", torch.tensor(2.5, dtype=torch.float64))
    big = torch.randn(10, 4)
    inputs = {
        "view": big[2:4],
        "t": big.t(),
        "z": torch.randn(2, 2, dtype=torch.complex64),
        "sparse": torch.eye(3).to_sparse(),
        "u16": torch.arange(4, dtype=torch.int16),
        "meta": (torch.float16, torch.device("cpu"), torch.Size([2, 3]), b"\x00\xff"),
        "odd": {1: "int key", "$x": "dollar key", None: 0.5, "nan": float("nan")},
        "ints": {3, 4},
    }
    path = save_snapshot(tmp_path / "k.nbsnap", model, inputs, step=1)
    snap = load_snapshot(path)
    got = snap.inputs
    assert torch.equal(got["view"], big[2:4]) and torch.equal(got["t"], big.t())
    assert got["view"].untyped_storage().nbytes() == 2 * 4 * 4  # only its own elements
    assert torch.equal(got["z"], inputs["z"]) and got["z"].dtype == torch.complex64
    assert torch.equal(got["sparse"].to_dense(), torch.eye(3)) and got["sparse"].is_sparse
    assert torch.equal(got["u16"], inputs["u16"])
    assert got["meta"] == inputs["meta"] and got["ints"] == {3, 4}
    odd = got["odd"]
    assert odd[1] == "int key" and odd["$x"] == "dollar key" and odd[None] == 0.5
    assert odd["nan"] != odd["nan"]
    state = snap.model_state
    for k, v in model.state_dict().items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    model[1].weight = model[0].weight
    path = save_snapshot(tmp_path / "t.nbsnap", model, torch.tensor([[1, 2]]))
    with safe_open(str(path), framework="pt") as f:
        stored = [k for k in f.keys() if k.startswith("model_state/")]  # noqa: SIM118
    assert stored == ["model_state/0.weight"]
    state = load_snapshot(path).model_state
    assert state["0.weight"] is state["1.weight"]


def test_map_location_forms(written):
    path, model, _opt = written
    seen: list[str] = []

    def where(storage, location):
        seen.append(location)
        return storage

    for loc in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, where):
        snap = load_snapshot(path, map_location=loc)
        assert torch.equal(snap.model_state["0.weight"], model[0].weight)
    assert seen and set(seen) == {"cpu"}


def test_inspect_verify_checks_every_tensor(written, tmp_path, capsys):
    from nbdebug.cli import main

    path, _model, _opt = written
    assert main(["inspect", str(path), "--verify", "--no-replay"]) == 0
    assert "verified  " in capsys.readouterr().out
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    start, _end = json.loads(bytes(data[8 : 8 + n]))["optimizer/state/1/exp_avg"]["data_offsets"]
    data[8 + n + start] ^= 0x40
    bad = tmp_path / "bad.nbsnap"
    bad.write_bytes(bytes(data))
    assert main(["inspect", str(bad), "--no-replay"]) == 0  # the optimizer state is not read
    capsys.readouterr()
    assert main(["inspect", str(bad), "--verify", "--no-replay"]) == 2
    err = capsys.readouterr().err
    assert "its tensor 'optimizer/state/1/exp_avg' do not match the checksum" in err


def test_tensors_read_survive_the_file_being_rewritten_in_place(written):
    # safetensors maps the file; a tensor still backed by the mapping would die (SIGBUS)
    # when the file is cut short or rewritten in place, as torch.save(raw, path) does
    path, model, _opt = written
    snap = load_snapshot(path)
    state, batch = snap.model_state, snap.inputs
    path.write_bytes(b"")
    assert torch.equal(state["0.weight"], model[0].weight) and float(batch.sum()) == float(
        batch.sum()
    )


def test_a_model_that_does_not_fit_is_refused_before_a_weight_is_read(written, monkeypatch):
    from nbdebug.core.snapshot.container import TensorStore

    path, _model, _opt = written
    read: list[str] = []
    original = TensorStore.read

    def spy(self, names, *, keep=True):
        names = list(names)
        read.extend(names)
        return original(self, names, keep=keep)

    monkeypatch.setattr(TensorStore, "read", spy)
    with pytest.raises(SnapshotError, match=r"0.weight: snapshot \(128, 64\) vs model \(128, 8\)"):
        load_snapshot(path, lambda: nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 4)))
    assert not [n for n in read if n.startswith("model_state/")]
