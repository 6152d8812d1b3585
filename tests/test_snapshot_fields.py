"""core.snapshot.format: one field table drives the writer, the checks and the reader, so
a file written today still loads after a field is added, and a newer file is refused."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import nbdebug
from nbdebug import _version
from nbdebug.core.snapshot import (
    FORMAT_VERSION,
    Snapshot,
    SnapshotError,
    list_snapshots,
    load_snapshot,
    read_archive,
    read_payload,
    save_snapshot,
)
from nbdebug.core.snapshot import format as fmt
from nbdebug.core.snapshot.format import (
    FIELDS,
    NO_DEFAULT,
    Field,
    NoneType,
    validate_payload,
)

CORE = Path(__file__).resolve().parents[1] / "nbdebug" / "core"


def _write_today(tmp_path: Path) -> tuple[Path, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save_snapshot(
        tmp_path / "old.nbsnap",
        model,
        x,
        torch.tensor([0, 1, 0, 1]),
        optimizer=opt,
        step=7,
        reason={"kind": "loss", "message": "nan at 7"},
        history=[{"step": 6, "loss": 0.5}],
        loss_fn=nn.functional.cross_entropy,
    )
    return path, model, x


def _future_fields(since: int, *, required: bool = True) -> tuple[Field, ...]:
    """Today's table plus two fields of the next format version (hypothetical ones, as a
    new feature would add them): one with a default, one with a default factory."""
    return (
        *FIELDS,
        Field(
            "node",
            (int, NoneType),
            "the process's node (None: one process)",
            since=since,
            required=required,
            default=None,
        ),
        Field(
            "future_ranks",
            (list,),
            "ranks that saw the non-finite value first",
            since=since,
            default_factory=list,
        ),
    )


def test_a_file_of_today_loads_after_a_field_is_added(tmp_path, monkeypatch):
    old, model, x = _write_today(tmp_path)
    raw = read_archive(old)
    assert raw["version"] == FORMAT_VERSION and "node" not in raw

    monkeypatch.setattr(fmt, "FIELDS", _future_fields(FORMAT_VERSION + 1))
    assert fmt.format_version() == FORMAT_VERSION + 1

    # the old file reads with the new fields' defaults, everything else as written
    snap = load_snapshot(old, nn.Linear(3, 2))
    assert snap.version == FORMAT_VERSION
    assert snap.node is None and snap.future_ranks == []  # type: ignore[attr-defined]
    assert snap.step == 7 and snap.reason["message"] == "nan at 7"
    assert torch.equal(snap.inputs, x) and snap.history == [{"step": 6, "loss": 0.5}]
    assert snap.model is not None
    assert torch.equal(snap.model.weight, model.weight)
    assert snap.build_optimizer().param_groups[0]["lr"] == 0.1
    payload = read_payload(old)
    assert payload["node"] is None and payload["future_ranks"] == []
    # a default factory gives each snapshot its own list
    assert load_snapshot(old).future_ranks is not snap.future_ranks  # type: ignore[attr-defined]
    assert list_snapshots(tmp_path)["step"].tolist() == [7]

    # the new writer stores the producer's values under the next version
    new = save_snapshot(tmp_path / "new.nbsnap", model, x, step=8, node=1, future_ranks=[1])
    raw_new = read_archive(new)
    assert raw_new["version"] == FORMAT_VERSION + 1
    assert raw_new["node"] == 1 and raw_new["future_ranks"] == [1]
    snap_new = load_snapshot(new)
    assert snap_new.node == 1 and snap_new.version == FORMAT_VERSION + 1  # type: ignore[attr-defined]
    # ... and a producer that gives nothing gets the defaults written
    plain = save_snapshot(tmp_path / "plain.nbsnap", model, x, step=9)
    raw_plain = read_archive(plain)
    assert raw_plain["node"] is None and raw_plain["future_ranks"] == []

    # today's nbdebug refuses the newer file in one clear sentence
    monkeypatch.undo()
    assert fmt.format_version() == FORMAT_VERSION
    with pytest.raises(
        SnapshotError,
        match=rf"new\.nbsnap was written by a newer nbdebug \(snapshot format version "
        rf"{FORMAT_VERSION + 1}; this nbdebug reads versions up to {FORMAT_VERSION}\): "
        r"upgrade nbdebug",
    ):
        load_snapshot(new)


def test_required_and_optional_new_fields(tmp_path, monkeypatch):
    old, _model, _x = _write_today(tmp_path)
    raw = read_archive(old)
    nxt = FORMAT_VERSION + 1
    monkeypatch.setattr(fmt, "FIELDS", _future_fields(nxt))
    # a file of the new version must hold a required new field ...
    with pytest.raises(
        SnapshotError, match=r"incomplete snapshot: it lacks 'node', 'future_ranks'"
    ):
        Snapshot.from_payload({**raw, "version": nxt}, "x.nbsnap")
    # ... an optional one may be left out by any file
    monkeypatch.setattr(fmt, "FIELDS", _future_fields(nxt, required=False))
    with pytest.raises(SnapshotError, match=r"it lacks 'future_ranks'\.$"):
        Snapshot.from_payload({**raw, "version": nxt})
    snap = Snapshot.from_payload({**raw, "version": nxt, "future_ranks": [0]})
    assert snap.node is None and snap.future_ranks == [0]  # type: ignore[attr-defined]
    # a new field of the wrong type is a corrupt file
    with pytest.raises(SnapshotError, match=r"is corrupt: 'node' should be int or None, got str"):
        Snapshot.from_payload({**raw, "version": nxt, "node": "one", "future_ranks": []})


def test_the_writer_checks_fields_against_the_table(tmp_path, monkeypatch):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"'rnak' is not a snapshot field; the fields are step, "):
        save_snapshot(tmp_path / "a.nbsnap", model, rnak=1)
    with pytest.raises(TypeError, match=r"writes the field 'model_state' from its own arguments"):
        save_snapshot(tmp_path / "a.nbsnap", model, model_state={})
    monkeypatch.setattr(fmt, "FIELDS", _future_fields(FORMAT_VERSION + 1))
    with pytest.raises(TypeError, match=r"cannot write the snapshot: 'node' should be int or None"):
        save_snapshot(tmp_path / "a.nbsnap", model, node="zero")
    with pytest.raises(TypeError, match=r"'node' should be int or None, got bool"):
        save_snapshot(tmp_path / "a.nbsnap", model, node=True)
    monkeypatch.undo()
    # the reader's field checks run on the way in too: no file the reader would call corrupt
    for bad in (
        {"dtype": "bfloat16"},
        {"device_type": "cpu", "dtype": 3},
        {"device_type": "cpu", "dtype": "bfloat16", "backward": "yes"},
    ):
        with pytest.raises(ValueError, match=r"cannot write the snapshot: its autocast state"):
            save_snapshot(tmp_path / "a.nbsnap", model, autocast=bad)
    assert list(tmp_path.iterdir()) == []  # nothing written by a refused call
    good = save_snapshot(
        tmp_path / "a.nbsnap", model, autocast={"device_type": "cpu", "dtype": "bfloat16"}
    )
    assert load_snapshot(good, model=nn.Linear(2, 2)).autocast["dtype"] == "bfloat16"


def test_the_file_holds_exactly_the_table(tmp_path):
    old, _model, _x = _write_today(tmp_path)
    raw = read_archive(old)
    assert list(raw) == ["format", "version", *(f.key for f in FIELDS)]
    snap = load_snapshot(old)
    for f in FIELDS:
        assert hasattr(snap, f.attribute), f.key
        value = getattr(snap, f.attribute)
        assert type(value) is type(raw[f.key]) or f.key == "time", f.key
    assert snap.optimizer_state is not None
    assert snap.optimizer_state["param_groups"] == raw["optimizer"]["param_groups"]
    assert snap.loss_fn_spec is not None and snap.loss_fn_spec["name"].endswith(":cross_entropy")


def test_from_payload_matches_load_snapshot(tmp_path):
    old, _model, _x = _write_today(tmp_path)
    raw = read_archive(old)
    snap = Snapshot.from_payload(raw, old)
    ref = load_snapshot(old)
    assert snap.path == old and snap.model is None
    assert snap.step == ref.step and snap.reason == ref.reason and snap.history == ref.history
    assert all(torch.equal(snap.model_state[k], v) for k, v in ref.model_state.items())
    assert "node" not in raw and validate_payload(raw) is not raw  # the input is not changed
    with pytest.raises(SnapshotError, match=r"<snapshot> is a torch file but not an nbdebug"):
        Snapshot.from_payload([1, 2])
    broken = {k: v for k, v in raw.items() if k != "history"}
    with pytest.raises(
        SnapshotError, match=r"mem\.nbsnap is an incomplete snapshot: it lacks 'history'"
    ):
        Snapshot.from_payload(broken, "mem.nbsnap")


def test_the_table_is_consistent():
    keys = [f.key for f in FIELDS]
    attrs = [f.attribute for f in FIELDS]
    assert len(set(keys)) == len(keys) and len(set(attrs)) == len(attrs)
    assert max(f.since for f in FIELDS) == FORMAT_VERSION
    own = {name for klass in Snapshot.__mro__ for name in vars(klass)} - set(
        Snapshot.__annotations__
    )
    assert not own & set(attrs), "a field attribute shadows a Snapshot method"
    assert set(attrs) <= set(Snapshot.__annotations__)  # today's fields are typed
    for f in FIELDS:
        if f.has_default and f.types is not None:
            assert f.type_problem(f.make_default()) is None, f.key


def test_bad_field_rows_are_refused():
    with pytest.raises(ValueError, match=r"'node' needs a default .* files older than version 2"):
        Field("node", (int,), "doc", since=2)
    with pytest.raises(ValueError, match=r"'extra' needs a default .* files without it"):
        Field("extra", (int,), "doc", required=False)
    with pytest.raises(ValueError, match="use default_factory"):
        Field("ranks", (list,), "doc", since=2, default=[])
    with pytest.raises(ValueError, match="not both"):
        Field("ranks", (list,), "doc", since=2, default=None, default_factory=list)
    with pytest.raises(ValueError, match="since must be a format version >= 1; got 0"):
        Field("x", (int,), "doc", since=0)
    with pytest.raises(ValueError, match="must be an identifier"):
        Field("not a key", (int,), "doc")
    f = Field("x", (int,), "doc")
    assert f.default is NO_DEFAULT and not f.has_default
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.since = 2  # type: ignore[misc]


def test_error_line():
    from nbdebug.core.text import first_line as error_line

    assert error_line(ValueError("first\nsecond")) == "ValueError: first"
    assert error_line(RuntimeError()) == "RuntimeError"
    assert error_line(OSError("  ")) == "OSError"
    assert error_line(ValueError("x" * 500)) == "ValueError: " + "x" * 200


def test_core_reads_the_version_from_version_module(tmp_path):
    assert nbdebug.__version__ == _version.__version__
    path, _m, _x = _write_today(tmp_path)
    assert load_snapshot(path).environment["nbdebug"] == _version.__version__
    for p in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module is not None, f"core/{p.name} imports the package root"
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module != "nbdebug", f"core/{p.name} imports the package root"


def test_shorten_cuts_a_long_message_at_a_word_boundary():
    # Snapshot.__repr__ shows the reason's message through it
    from nbdebug.core.text import shorten

    words = " ".join(f"word{i}" for i in range(60))
    short = shorten(words, 120)
    assert len(short) <= 120 and short.endswith(" ...")
    kept = short.removesuffix(" ...").split(" ")
    assert kept == words.split(" ")[: len(kept)]  # whole words only, in order
    assert shorten("a short message") == "a short message"
