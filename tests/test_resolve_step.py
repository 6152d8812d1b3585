"""core.snapshot.resolve_source and resolve_step: every form a user hands nbdebug (a
recorded Trace, a model and batch, a Snapshot, a NonFiniteError, a snapshot path, a
directory of snapshots) is told apart in one place and resolves to one Source (or one
ResolvedStep to replay); each bad input is one clear sentence, the same at every entry point
(check, diagnose, debug, %nbdebug, the nbdebug command). Also the one history parser."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.core.guard import HistoryRow, NonFiniteError, parse_history
from nbdebug.core.snapshot import ResolvedStep, TrainingObjects, resolve_step
from nbdebug.core.snapshot.resolve import (
    STEP_KINDS,
    Caller,
    ResolveOptions,
    SourceError,
    resolve_source,
    source_kind,
)
from nbdebug.core.trace import TraceError
from nbdebug.core.vocab import FailureKind, SourceKind


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


def _failing_guard(tmp_path: Path, **options: object) -> tuple[nbdebug.NaNGuard, nn.Module]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, loss_fn=F.mse_loss, **options)
    x, y = _batch()
    for step in range(3):
        xb = x.clone()
        if step == 2:
            xb[1, 0] = float("nan")
        loss = F.mse_loss(model(xb), y)
        loss.backward()
        if guard.check(loss, inputs=xb, target=y, step=step):
            opt.step()
        opt.zero_grad()
    return guard, model


# ---------------------------------------------------------------------- each source kind
def test_a_model_and_its_batch() -> None:
    model = _mlp()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = resolve_step(model, x, y, loss_fn=F.mse_loss, optimizer=opt)
    assert isinstance(r, ResolvedStep)
    assert r.model is model and r.inputs is x and r.target is y and r.optimizer is opt
    assert r.loss_fn is F.mse_loss and r.snapshot is None and r.step is None
    assert r.history == [] and r.recorded_failure is None and r.notes == []
    # the same as a (model, inputs, target) tuple
    t = resolve_step((model, x, y))
    assert t.model is model and t.inputs is x and t.target is y


def test_a_snapshot_and_its_path(tmp_path: Path) -> None:
    guard, model = _failing_guard(tmp_path)
    [path] = guard.snapshots
    snap = nbdebug.load_snapshot(path, model=_mlp)
    for source in (snap, path, str(path)):
        r = resolve_step(source, model=_mlp)
        assert r.step == 2 and r.snapshot is not None and r.model is not model
        assert r.recorded_failure == "a non-finite loss at step 2"
        assert torch.isnan(r.inputs).any() and r.loss_fn is not None
        assert isinstance(r.optimizer, torch.optim.SGD)
        assert [h["step"] for h in r.history] == [0, 1, 2]
        assert r.history[-1]["nonfinite"] is FailureKind.LOSS
    # resolve_step(path, factory): the factory in the batch's place
    assert resolve_step(path, _mlp).step == 2


def test_a_nonfinite_error_names_its_snapshot(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError) as info:
        _failing_guard(tmp_path, on_nonfinite="raise")
    r = resolve_step(info.value, model=_mlp)
    assert r.step == 2 and r.snapshot is not None and r.snapshot.path == info.value.path


def test_a_directory_takes_its_earliest_readable_snapshot(tmp_path: Path) -> None:
    _failing_guard(tmp_path)
    later = nbdebug.save_snapshot(tmp_path / "step-000000009.nbsnap", _mlp(), step=9)
    (tmp_path / "step-000000000.nbsnap").write_bytes(b"not a snapshot")
    r = resolve_step(tmp_path, model=_mlp)
    assert r.step == 2 and r.snapshot is not None and r.snapshot.path != later
    assert r.notes and "earliest snapshot" in r.notes[0]


def test_history_given_replaces_the_snapshots(tmp_path: Path) -> None:
    guard, _ = _failing_guard(tmp_path)
    r = resolve_step(guard.snapshots[0], model=_mlp, history=[{"step": 0, "loss": 1.0}])
    assert r.history == [{"step": 0, "loss": 1.0}]
    live = resolve_step(_mlp(), *_batch(), history=guard)
    assert [h["step"] for h in live.history] == [0, 1, 2]


def test_options_name_the_caller_and_a_scaler_replaces_the_state(tmp_path: Path) -> None:
    guard, _ = _failing_guard(tmp_path)

    class Scaler:
        def state_dict(self) -> dict[str, float]:
            return {"scale": 8.0}

        def get_scale(self) -> float:
            return 8.0

    opts = ResolveOptions(scaler=Scaler(), caller="diagnose")
    r = resolve_step(guard.snapshots[0], model=_mlp, options=opts)
    assert r.scaler_state == {"scale": 8.0}
    with pytest.raises(TypeError, match=r"^diagnose\(\) expects a Snapshot"):
        resolve_step(42, options=opts)


# ---------------------------------------------------------------------- bad input
def test_each_bad_input_is_one_clear_sentence(tmp_path: Path) -> None:
    guard, _ = _failing_guard(tmp_path)
    path = guard.snapshots[0]
    x, _ = _batch()
    cases = [
        (TypeError, "expects a Snapshot, a snapshot path", lambda: resolve_step(3.5)),
        (TypeError, "needs the batch: inputs is missing", lambda: resolve_step(_mlp())),
        (TypeError, "takes no model=", lambda: resolve_step(_mlp(), x, model=_mlp)),
        (TypeError, "takes the batch from the snapshot", lambda: resolve_step(path, x)),
        (
            TypeError,
            "a Snapshot carries its batch",
            lambda: resolve_step(nbdebug.load_snapshot(path, model=_mlp), x),
        ),
        (
            TypeError,
            "replays its own optimizer state",
            lambda: resolve_step(
                path, model=_mlp, optimizer=torch.optim.SGD(_mlp().parameters(), lr=1)
            ),
        ),
        (
            ValueError,
            "not the model's",
            lambda: resolve_step(_mlp(), x, optimizer=torch.optim.SGD(_mlp().parameters(), lr=1)),
        ),
        (
            nbdebug.SnapshotError,
            "loaded without a model",
            lambda: resolve_step(nbdebug.load_snapshot(path)),
        ),
        (nbdebug.SnapshotError, "no such file", lambda: resolve_step(tmp_path / "none.nbsnap")),
        (
            nbdebug.SnapshotError,
            "holds no readable snapshot file",
            lambda: resolve_step(tmp_path / "empty"),
        ),
        (
            nbdebug.SnapshotError,
            "carries no snapshot",
            lambda: resolve_step(NonFiniteError("m", path=None, step=1, reason={})),
        ),
        (TypeError, "history must be", lambda: resolve_step(_mlp(), x, history=3)),
    ]
    (tmp_path / "empty").mkdir()
    for exc, words, call in cases:
        with pytest.raises(exc, match=words) as info:
            call()
        text = str(info.value)
        assert text.count(". ") == 0 or text.endswith("."), text


# ---------------------------------------------------------------------- the history row
def test_parse_history_reads_every_form_and_a_frames_nan_as_not_recorded() -> None:
    rows: list[HistoryRow] = [
        {"step": 0, "loss": 1.0, "grad_norm": 2.0, "nonfinite": None},
        {"step": 1, "loss": math.nan, "grad_norm": math.nan, "nonfinite": FailureKind.LOSS},
    ]
    assert parse_history(None) == []
    assert parse_history(rows) == rows  # a list: taken as it is (a NaN loss stays NaN)
    assert math.isnan(parse_history(rows)[1]["loss"])
    frame = pd.DataFrame(rows)
    back = parse_history(frame)
    assert back[1]["loss"] is None and back[1]["nonfinite"] is FailureKind.LOSS
    assert parse_history([{"step": 3, "nonfinite": "grad"}])[0]["nonfinite"] is FailureKind.GRAD
    for bad in (3, "rows", [1, 2], {"step": 1}):
        with pytest.raises(TypeError, match="history must be a NaNGuard, a list of dicts"):
            parse_history(bad)


def test_save_snapshot_takes_the_training_objects_as_one_value(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    x, y = _batch()
    F.mse_loss(model(x), y).backward()
    opt.step()
    path = nbdebug.save_snapshot(tmp_path, TrainingObjects(model, opt), x, y, step=4)
    snap = nbdebug.load_snapshot(path, model=_mlp)
    assert snap.optimizer_class == "torch.optim.adam:Adam" and snap.step == 4
    with pytest.raises(TypeError, match="got optimizer twice"):
        nbdebug.save_snapshot(tmp_path, TrainingObjects(model, opt), optimizer=opt)


# ---------------------------------------------------------------------- resolve_source
def _snapshot_at(path: Path, step: int) -> Path:
    x, y = _batch()
    return nbdebug.save_snapshot(path, _mlp(), x, y, step=step, loss_fn=F.mse_loss)


def test_resolve_source_tells_each_kind_apart(tmp_path: Path) -> None:
    model = _mlp()
    x, y = _batch()
    tr = nbdebug.trace(model, x, y, F.mse_loss)
    for source, kind in [
        (tr, SourceKind.TRACE),
        (model, SourceKind.MODEL),
        ((model, x), SourceKind.MODEL),
        ([model, x, y], SourceKind.MODEL),
        (tmp_path, SourceKind.DIRECTORY),
        (tmp_path / "step.nbsnap", SourceKind.SNAPSHOT),
        (str(tmp_path / "missing"), SourceKind.SNAPSHOT),
        (NonFiniteError("m", path=None, step=1, reason={}), SourceKind.SNAPSHOT),
        ((1, 2), None),
        (3.5, None),
    ]:
        assert source_kind(source) is kind, source
    # a recorded trace, with what was given beside it
    t = resolve_source(tr, x)
    assert t.kind is SourceKind.TRACE and t.trace is tr and t.inputs is x and t.error is None
    err = TraceError("ValueError in head: boom", trace=tr)
    assert resolve_source(err).trace is tr and resolve_source(err).error == str(err)
    # a model and its batch: the user's module as it is, untouched
    m = resolve_source(model, x, y)
    assert m.kind is SourceKind.MODEL and m.model is model and m.inputs is x and m.target is y
    tup = resolve_source((model, x, y))
    assert tup.model is model and tup.inputs is x and tup.target is y


def test_resolve_source_keeps_a_compiled_module_as_the_user_gave_it() -> None:
    model = _mlp()
    compiled = torch.compile(model)  # compiles on the first call only
    x, _ = _batch()
    assert resolve_source(compiled, x).model is compiled
    assert resolve_step(compiled, x).model is model  # the replay runs the module it wraps


def test_resolve_source_loads_a_snapshot_with_or_without_its_model(tmp_path: Path) -> None:
    guard, _ = _failing_guard(tmp_path)
    [path] = guard.snapshots
    bare = resolve_source(path)
    assert bare.kind is SourceKind.SNAPSHOT and bare.snapshot is not None
    assert bare.snapshot.model is None and bare.snapshot.step == 2
    built = resolve_source(path, _mlp)  # the factory in the batch's place
    assert built.snapshot is not None and built.snapshot.model is not None
    # a Snapshot loaded without one is loaded again with the model given
    again = resolve_source(bare.snapshot, model=_mlp)
    assert again.snapshot is not None and again.snapshot.model is not None
    with pytest.raises(NonFiniteError) as info:
        _failing_guard(tmp_path / "raise", on_nonfinite="raise")
    by_error = resolve_source(info.value, model=_mlp)
    assert by_error.snapshot is not None and by_error.snapshot.path == info.value.path
    # a caller that needs the model: one error with needs_model set
    with pytest.raises(nbdebug.SnapshotError, match="was loaded without a model") as missing:
        resolve_source(path, caller=Caller("debug", need_model=True))
    assert missing.value.needs_model and "debug(..., model=...)" in str(missing.value)


def test_resolve_source_lists_a_directory_and_knows_per_rank_files(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    late = _snapshot_at(plain / "step-000000009.nbsnap", 9)
    early = _snapshot_at(plain / "step-000000002.nbsnap", 2)
    (plain / "step-000000000.nbsnap").write_bytes(b"not a snapshot")
    d = resolve_source(plain)
    assert d.kind is SourceKind.DIRECTORY and d.directory == plain
    assert d.files == (early, late) and not d.per_rank  # readable ones, earliest first
    ranks = tmp_path / "ranks"
    files = [_snapshot_at(ranks / f"step-000000003-rank{r}.nbsnap", 3) for r in (1, 0)]
    _snapshot_at(ranks / "step-000000007-rank0.nbsnap", 7)
    r = resolve_source(ranks, model=_mlp)
    assert r.per_rank and set(r.files[:2]) == set(files) and r.factory is _mlp
    # a caller that takes files only reads the directory as one, which says what it is
    with pytest.raises(nbdebug.SnapshotError, match="is a directory, not a snapshot file"):
        resolve_source(plain, caller=Caller("nbdebug", frozenset({SourceKind.SNAPSHOT})))


def test_resolve_source_each_bad_input_is_one_sentence(tmp_path: Path) -> None:
    guard, _ = _failing_guard(tmp_path)
    path = guard.snapshots[0]
    x, y = _batch()
    tr = nbdebug.trace(_mlp(), x, y, F.mse_loss)
    step_only = Caller("diagnose", STEP_KINDS)
    cases = [
        (
            SourceError,
            r"^resolve_source\(\) expects a Trace, a Snapshot",
            lambda: resolve_source(3.5),
        ),
        (
            SourceError,
            r"^diagnose\(\) expects a Snapshot.*; got Trace\.$",
            lambda: resolve_source(tr, caller=step_only),
        ),
        (SourceError, "needs the batch: inputs is missing", lambda: resolve_source(_mlp())),
        (SourceError, "takes no model=", lambda: resolve_source(_mlp(), x, model=_mlp)),
        (SourceError, "takes no model=: the trace", lambda: resolve_source(tr, model=_mlp)),
        (SourceError, "inputs were given twice", lambda: resolve_source((_mlp(), x), x)),
        (SourceError, "target was given twice", lambda: resolve_source((_mlp(), x, y), None, y)),
        (
            SourceError,
            r"resolve_source\(path\) takes no inputs or target",
            lambda: resolve_source(path, x),
        ),
        (
            SourceError,
            r"\(directory\) takes no inputs or target",
            lambda: resolve_source(tmp_path, x),
        ),
        (
            SourceError,
            "a Snapshot carries its batch",
            lambda: resolve_source(nbdebug.load_snapshot(path), None, y),
        ),
        (SourceError, "carries no partial trace", lambda: resolve_source(TraceError("boom"))),
        (ValueError, "the batch is empty", lambda: resolve_source(_mlp(), torch.empty(0, 4))),
    ]  # a missing file, an empty directory, an error without a snapshot: see below
    for exc, words, call in cases:
        with pytest.raises(exc, match=words) as info:
            call()
        text = str(info.value)
        assert text.endswith("."), text
    # a SourceError is both: the entry points raised TypeError or ValueError before
    assert issubclass(SourceError, TypeError) and issubclass(SourceError, ValueError)


# ---------------------------------------------------------------------- every entry point
def _entry_point_errors(source: Path | str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """The one-line error each entry point gives for ``source``."""
    from IPython.core.interactiveshell import InteractiveShell

    from nbdebug.cli import main

    said: dict[str, str] = {}
    for name, call in [
        ("check", lambda: nbdebug.check(source)),
        ("diagnose", lambda: nbdebug.diagnose(source, model=_mlp)),
        ("debug", lambda: nbdebug.debug(source, model=_mlp)),
    ]:
        with pytest.raises((nbdebug.SnapshotError, TypeError, ValueError)) as info:
            call()
        said[name] = str(info.value)
    sh = InteractiveShell.instance()
    sh.user_ns["make"] = _mlp
    sh.run_cell("%load_ext nbdebug")
    try:
        capsys.readouterr()
        sh.run_line_magic("nbdebug", f"{source} --model make")
        said["%nbdebug"] = capsys.readouterr().err.strip().removeprefix("nbdebug: ")
    finally:
        sh.run_cell("%unload_ext nbdebug")
        sh.user_ns.pop("make", None)
    assert main(["inspect", str(source)]) == 2
    said["nbdebug inspect"] = capsys.readouterr().err.strip().removeprefix("nbdebug: error: ")
    return said


def test_every_entry_point_gives_the_same_sentence_for_the_same_bad_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "broken.nbsnap").write_bytes(b"\x00 not a snapshot")
    garbage = tmp_path / "garbage.nbsnap"
    garbage.write_bytes(b"\x00 not a snapshot either")
    for source, sentence in [
        (empty, f"the directory {empty} holds no readable snapshot file."),
        (garbage, f"{garbage} is not a snapshot: it is not a torch.save zip archive"),
    ]:
        said = _entry_point_errors(source, capsys)
        assert set(said) == {"check", "diagnose", "debug", "%nbdebug", "nbdebug inspect"}
        for name, text in said.items():
            assert text.startswith(sentence), (name, text)
        assert len(set(said.values())) == 1, said
    # a path that does not exist: one sentence; the magic words it its own way (its line
    # names a file: "no such file: PATH", pinned by tests/test_magics.py)
    missing = tmp_path / "missing.nbsnap"
    said = _entry_point_errors(missing, capsys)
    magic = said.pop("%nbdebug")
    assert set(said.values()) == {f"{missing}: no such file."}, said
    assert magic == f"no such file: {missing}"
    # the error of a guard that wrote no snapshot
    err = NonFiniteError("m", path=None, step=1, reason={})
    for call in (nbdebug.check, nbdebug.diagnose, nbdebug.debug):
        with pytest.raises(nbdebug.SnapshotError, match=r"^this NonFiniteError carries no"):
            call(err)
