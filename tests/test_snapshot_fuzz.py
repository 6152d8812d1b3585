"""Damaged snapshot files: truncations and byte flips in every region of the file (the
safetensors header's length, its JSON, the JSON metadata inside it, the tensor data; for
the older torch.save format its zip records, pickle, tensor data and central directory)
raise SnapshotError naming what is wrong, never a zipfile, json, struct or safetensors
error; a flipped tensor byte is caught by that tensor's checksum."""

from __future__ import annotations

import json
import random
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import nbdebug
from nbdebug.core.snapshot import Snapshot, SnapshotError, list_snapshots, load_snapshot
from nbdebug.figures.report import history_table, snapshot_facts


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _write(directory: Path, *, legacy: bool = False) -> Path:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

    def torch_save(payload: dict, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(payload, f)
        return path

    return nbdebug.save_snapshot(
        directory / "s.nbsnap",
        model,
        x,
        y,
        optimizer=opt,
        step=4,
        reason={"kind": "loss", "message": "nan at 4"},
        history=[{"step": 3, "loss": 0.5}],
        loss_fn=nn.functional.cross_entropy,
        write=torch_save if legacy else None,
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A valid snapshot's bytes and its regions: {name: (start, end)}."""
    data = _write(tmp_path_factory.mktemp("good")).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n]
    # safetensors writes __metadata__ first (our JSON document and its CRC), then the
    # tensors' entries (dtype, shape, offsets), then space padding
    names = [k for k in json.loads(header) if k != "__metadata__"]
    end_meta = min(header.find(f'"{k}":{{"dtype"'.encode()) for k in names)
    assert header.startswith(b'{"__metadata__":') and end_meta > 0
    return data, {
        "length": (0, 8),
        "metadata": (8, 8 + end_meta),
        "header": (8 + end_meta, 8 + n),
        "tensors": (8 + n, len(data)),
    }


def _offsets(data: bytes, name: str) -> tuple[int, int]:
    (n,) = struct.unpack("<Q", data[:8])
    a, b = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _use(path: Path) -> Snapshot:
    """Everything a user does with a snapshot: load it with a model (reads the weights),
    inspect it, verify every tensor, rebuild the optimizer, replay."""
    snap = load_snapshot(path, make_model())
    repr(snap)
    snap.history_frame()
    snapshot_facts(snap)
    history_table(snap)
    snap.nonfinite_state()
    snap.param_norms()
    snap.verify()
    snap.build_optimizer()
    list_snapshots(path.parent)
    return snap


def test_the_regions_are_what_the_test_takes_them_for(good, tmp_path):
    data, regions = good
    assert [regions[k] for k in ("length", "metadata", "header", "tensors")] == sorted(
        regions.values()
    )
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    assert set(header["__metadata__"]) == {"nbdebug", "nbdebug_crc32"}
    assert "model_state/0.weight" in header and "optimizer/state/0/exp_avg" in header
    path = tmp_path / "s.nbsnap"
    path.write_bytes(data)
    assert _use(path).step == 4


@pytest.mark.parametrize("region", ["length", "header", "metadata", "tensors"])
def test_truncation_in_every_region_is_a_snapshot_error(good, tmp_path, region):
    data, regions = good
    start, end = regions[region]
    for cut in sorted({start, (start + end) // 2, end - 1}):
        path = tmp_path / f"cut{cut}.nbsnap"
        path.write_bytes(data[:cut])
        with pytest.raises(SnapshotError, match=r"truncated or corrupt|is empty|not a snapshot"):
            _use(path)


def test_a_flipped_tensor_byte_names_the_tensor(good, tmp_path):
    data, regions = good
    start, end = regions["tensors"]
    path = tmp_path / "flip.nbsnap"
    hit = set()
    for at in range(start, end, 7):
        bad = bytearray(data)
        bad[at] ^= 0x10
        path.write_bytes(bytes(bad))
        with pytest.raises(
            SnapshotError, match=r"its tensor '([^']+)' do not match the checksum"
        ) as e:
            _use(path)
        hit.add(str(e.value).split("'")[1])
    assert {"model_state/0.weight", "optimizer/state/0/exp_avg_sq", "inputs"} <= hit
    # listing reads the header and the small fields only: a damaged weight is still listed
    bad = bytearray(data)
    bad[_offsets(data, "model_state/0.weight")[0]] ^= 0x10
    path.write_bytes(bytes(bad))
    listed = list_snapshots(tmp_path)
    assert listed["error"].isna().all() and listed["step"].tolist() == [4]


def test_a_flipped_metadata_byte_is_caught_by_its_checksum(good, tmp_path):
    data, regions = good
    start, end = regions["metadata"]
    path = tmp_path / "meta.nbsnap"
    rng = random.Random(0)
    for at in rng.sample(range(start, end), 60):
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        with pytest.raises(
            SnapshotError,
            match=r"JSON metadata does not match the checksum|header is not JSON|is corrupt",
        ):
            load_snapshot(path)  # the header alone: caught without reading a weight


def _mutated(
    tmp_path: Path, data: bytes, span: tuple[int, int], flips: list, cut: float | None
) -> Path:
    """``data`` with up to six bytes of ``span`` XOR-ed and, with ``cut``, cut short at
    that fraction of ``span``, written to a file."""
    start, end = span
    bad = bytearray(data)
    for where, x in flips[:6]:
        bad[start + int(where * (end - start))] ^= x
    if cut is not None:
        del bad[start + int(cut * (end - start)) :]
    path = tmp_path / "fuzz.nbsnap"
    path.write_bytes(bytes(bad))
    return path


_REGIONS = st.sampled_from(["length", "header", "metadata", "tensors"])
_FLIPS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(region=_REGIONS, flips=_FLIPS, cut=st.none() | st.floats(0, 1))
def test_fuzz_every_region(good, tmp_path, region, flips, cut):
    data, regions = good
    path = _mutated(tmp_path, data, regions[region], flips, cut)
    try:
        snap = _use(path)
    except SnapshotError as e:
        assert str(e) and "Traceback" not in str(e)
    else:  # a flip that changed nothing the reader sees (JSON whitespace) loads fully
        assert snap.step == 4


@pytest.fixture(scope="module")
def legacy(tmp_path_factory) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A snapshot of the older format (a torch.save zip) and its regions."""
    p = _write(tmp_path_factory.mktemp("legacy"), legacy=True)
    data = p.read_bytes()
    with zipfile.ZipFile(p) as z:
        infos = z.infolist()
    pkl = next(i for i in infos if i.filename.endswith("data.pkl"))
    tensors = [i for i in infos if "/data/" in i.filename]
    directory = data.rfind(b"PK\x01\x02", 0, data.rfind(b"PK\x05\x06"))
    first_dir = data.find(b"PK\x01\x02")
    return data, {
        "pickle": (pkl.header_offset, pkl.header_offset + 100 + pkl.file_size),
        "tensors": (tensors[0].header_offset, first_dir),
        "directory": (first_dir, max(directory, first_dir) + 1),
        "end": (data.rfind(b"PK\x05\x06"), len(data)),
    }


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    region=st.sampled_from(["pickle", "tensors", "directory", "end"]),
    flips=_FLIPS,
    cut=st.none() | st.floats(0, 1),
)
def test_fuzz_the_older_format(legacy, tmp_path, region, flips, cut):
    data, regions = legacy
    path = _mutated(tmp_path, data, regions[region], flips, cut)
    try:
        snap = _use(path)
    except SnapshotError as e:
        assert str(e)
    else:
        assert snap.step == 4
