"""Skips that cannot hide (issue 32, item 5): counters and the last skip's reason in the
history and the repr, ``max_skips_in_row`` / ``max_skip_fraction``, ``skip_batches.json``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import nbdebug
from nbdebug.core.guard import SKIP_BATCHES, NaNGuard, NonFiniteError, load_skip_batches
from nbdebug.core.vocab import FailureKind


def _step(guard: NaNGuard, model: nn.Module, step: int, bad: bool, ids=None) -> bool:
    x = torch.randn(4, 3)
    loss = model(x).pow(2).mean() * (math.nan if bad else 1.0)
    loss.backward()
    ok = guard.check(loss, inputs=x, step=step, ids=ids)
    model.zero_grad()
    return ok


def _guard(tmp_path, **options) -> tuple[NaNGuard, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    options.setdefault("spike", False)
    return NaNGuard(model, directory=tmp_path, patience=None, **options), model


def test_counters_and_reason_in_history_and_repr(tmp_path):
    guard, model = _guard(tmp_path)
    for step, bad in enumerate([False, True, True, False, True]):
        _step(guard, model, step, bad)
    rows = list(guard.history)
    assert [r["skips"] for r in rows] == [0, 1, 2, 2, 3]
    assert [r["skips_in_row"] for r in rows] == [0, 1, 2, 0, 1]
    assert rows[1]["skip_reason"] == "non-finite loss" and "skip_reason" not in rows[0]
    s = guard.skips
    assert (s.total, s.in_row, s.checked, s.last_step) == (3, 1, 5, 4)
    assert s.fraction == pytest.approx(0.6)
    assert "3 skipped (last: step 4, non-finite loss)" in repr(guard)
    assert "skips" in guard.history_frame().columns


def test_max_skips_in_row_stops_with_a_clear_error_and_a_snapshot(tmp_path):
    guard, model = _guard(tmp_path, max_skips_in_row=2)
    _step(guard, model, 0, False)
    _step(guard, model, 1, True)
    _step(guard, model, 2, True)
    with pytest.raises(NonFiniteError) as info:
        _step(guard, model, 3, True)
    err = info.value
    assert str(err).startswith(
        "the guard stops the run: 3 updates skipped in a row (max_skips_in_row=2); "
        "the last, step 3: non-finite loss. Snapshot: "
    )
    assert err.kind == FailureKind.LOSS and err.step == 3 and err.path == guard.snapshots[-1]
    assert err.reason["limit"].startswith("3 updates skipped in a row")


def test_max_skips_in_row_writes_a_snapshot_when_the_step_had_none(tmp_path):
    guard, model = _guard(tmp_path, max_skips_in_row=0, max_snapshots=None)
    with pytest.raises(NonFiniteError) as info:
        _step(guard, model, 0, True)
    assert info.value.path is not None and info.value.path.exists()


def test_max_skip_fraction(tmp_path):
    guard, model = _guard(tmp_path, max_skip_fraction=0.1)
    for step in range(18):
        _step(guard, model, step, step in (3, 9))
    assert guard.skips.total == 2  # judged from the 20th step on
    _step(guard, model, 18, False)
    with pytest.raises(NonFiniteError, match=r"3 of 20 updates skipped, 15\.0% "):
        _step(guard, model, 19, True)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_skips_in_row": -1}, r"^max_skips_in_row must be a non-negative int or None"),
        ({"max_skip_fraction": 1.5}, r"^max_skip_fraction must be a number in \(0, 1\]"),
    ],
)
def test_bad_limits_are_one_sentence(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        NaNGuard(nn.Linear(2, 1), directory=tmp_path, **options)


def test_skip_batches_json_round_trip(tmp_path):
    guard, model = _guard(tmp_path)
    _step(guard, model, 0, False, ids=[0, 1, 2, 3])
    _step(guard, model, 1, True, ids=torch.tensor([4, 5, 6, 7]))
    _step(guard, model, 2, True, ids=[17, 5, 203, 8])
    data = json.loads((tmp_path / SKIP_BATCHES).read_text())
    assert data["ids"] == [4, 5, 6, 7, 8, 17, 203]
    assert data["steps"][1] == {"step": 2, "reason": "non-finite loss", "ids": [17, 5, 203, 8]}
    assert load_skip_batches(tmp_path) == {4, 5, 6, 7, 8, 17, 203}
    assert load_skip_batches(tmp_path / SKIP_BATCHES) == load_skip_batches(tmp_path)
    assert load_skip_batches(tmp_path / "elsewhere") == set()
    assert not list(tmp_path.glob(".skip_batches-*"))  # written atomically


def test_ids_of_the_wrong_length_are_one_sentence(tmp_path):
    guard, model = _guard(tmp_path)
    with pytest.raises(
        ValueError, match=r"^ids must give one dataset index per batch row: the batch has 4 "
    ):
        _step(guard, model, 0, False, ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"^ids must be integer dataset indices"):
        _step(guard, model, 0, False, ids=[1.5, 2, 3, 4])


def test_spike_skips_are_counted_with_their_reason(tmp_path):
    guard, model = _guard(tmp_path, spike=True, on_spike="skip")
    x = torch.randn(8, 3)
    for step in range(41):
        loss = model(x).pow(2).mean() * (1 + 0.01 * math.sin(step)) * (50 if step == 40 else 1)
        loss.backward()
        with pytest.warns(RuntimeWarning) if step == 40 else _nothing():
            guard.check(loss, inputs=x, step=step, ids=list(range(8)))
        model.zero_grad()
    assert guard.skips.total == 1 and str(guard.skips.last_reason).startswith("spike in ")
    assert guard.history[-1]["skip_reason"] == guard.skips.last_reason
    assert load_skip_batches(tmp_path) == set(range(8))
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=nn.Linear(3, 1))
    assert snap.reason["kind"] == "spike"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_lightning_callback_logs_the_skip_counters(tmp_path):
    pytest.importorskip("lightning", reason="the nbdebug[lightning] extra is not installed")
    import torch.nn.functional as F
    from test_integrations_lightning import K, Metrics, TinyModule, data, trainer

    from nbdebug.integrations.lightning import NaNGuardCallback

    cb, metrics = NaNGuardCallback(directory=tmp_path, loss_fn=F.mse_loss), Metrics()
    trainer([cb], logger=metrics).fit(TinyModule(), data())
    assert (K, {"nbdebug/skips": 1.0, "nbdebug/skips_in_row": 1.0}) in metrics.rows
    assert cb.guard.skips.total == 1 and cb.guard.skips.last_reason == "non-finite loss"


def test_the_hugging_face_callback_logs_the_skip_counters(tmp_path):
    transformers = pytest.importorskip("transformers")
    from models import tiny_gpt2
    from test_integrations_hf import Rows, arguments

    from nbdebug.integrations.hf import NaNGuardCallback

    cb = NaNGuardCallback(directory=tmp_path / "snaps")
    trainer = transformers.Trainer(
        model=tiny_gpt2(), args=arguments(tmp_path / "out"), train_dataset=Rows(), callbacks=[cb]
    )
    trainer.train()
    logged = [row for row in trainer.state.log_history if "nbdebug/skipped" in row]
    assert [(row["nbdebug/skips"], row["nbdebug/skips_in_row"]) for row in logged] == [(1.0, 1.0)]
