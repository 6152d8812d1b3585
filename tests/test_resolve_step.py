"""core.snapshot.resolve_step: every form a user hands nbdebug as "a step" (a model and
batch, a Snapshot, a NonFiniteError, a snapshot path, a directory of snapshots) resolves to
one ResolvedStep; each bad input is one clear sentence. Also the one history parser."""

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
from nbdebug.core.snapshot.resolve import ResolveOptions
from nbdebug.core.vocab import FailureKind


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
