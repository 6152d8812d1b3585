"""The guard's spike detector (issue 32, item 1): robust z-score of the loss and of the
gradient norm against the recent healthy steps; findings, snapshots of kind "spike" and
``on_spike``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from models import run_uncapped_warmup
from torch import nn

import nbdebug
from nbdebug.core.guard import NaNGuard, NonFiniteError
from nbdebug.core.guard.reading import StepReading
from nbdebug.core.guard.spike import MIN_WINDOW, SpikeDetector, SpikeSettings, spike_settings
from nbdebug.core.vocab import FailureKind


def _reading(step: int, loss: float | None, grad_norm: float) -> StepReading:
    return StepReading(
        step=step, loss=loss, grad_norm=grad_norm, param_norm=None, lr=None, scale=None
    )


def _noisy(n: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.05 * torch.randn(n, generator=g)).tolist()


def test_detector_flags_a_jump_against_the_median_and_mad():
    det = SpikeDetector(SpikeSettings())
    for i, v in enumerate(_noisy(60)):
        assert det.score(_reading(i, v, v)) == []
        det.admit(_reading(i, v, v))
    found = det.score(_reading(60, 1.02, 10.0))  # the gradient norm 10x, the loss not
    assert [f.signal for f in found] == ["grad_norm"]
    f = found[0]
    assert f.z > 6 and f.threshold == pytest.approx(6.0) and f.window == 60
    assert f.median == pytest.approx(1.0, rel=0.05) and len(f.history) == 16
    assert "grad_norm spiked at step 60" in f.message and "robust sigmas" in f.message
    assert f.as_dict()["message"] == f.message
    # downward moves are no spike
    assert det.score(_reading(61, 0.01, 0.01)) == []


def test_nonfinite_values_never_enter_the_window():
    det = SpikeDetector(SpikeSettings())
    for i, v in enumerate(_noisy(30)):
        det.admit(_reading(i, v, v))
    before = list(det.windows["grad_norm"].values)
    nan = _reading(30, math.nan, math.inf)
    assert det.score(nan) == []
    det.admit(nan)
    assert list(det.windows["grad_norm"].values) == before
    assert len(det.windows["loss"].values) == 30


def test_warmup_is_silent_then_raises_the_threshold():
    det = SpikeDetector(SpikeSettings(z=6, warmup=32))
    for i in range(MIN_WINDOW - 1):
        det.admit(_reading(i, 1.0, 1.0))
    assert det.score(_reading(7, 100.0, 100.0)) == []
    assert "warming up" in det.status["loss"]
    det.admit(_reading(7, 1.0, 1.0))
    assert det.threshold(8) == pytest.approx(12.0)  # twice z at 8 steps
    assert det.threshold(32) == pytest.approx(6.0) == det.threshold(100)
    assert det.score(_reading(8, 100.0, 100.0))  # a huge spike is flagged from step 9


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, SpikeSettings()),
        (8, SpikeSettings(z=8.0)),
        ({"window": 64}, SpikeSettings(window=64)),
        (False, None),
        (None, None),
    ],
)
def test_spike_option_values(value, expected):
    assert spike_settings(value) == expected


def test_bad_spike_options_are_one_sentence():
    with pytest.raises(ValueError, match=r"^spike must be True .*got 'yes'\.$"):
        NaNGuard(nn.Linear(2, 1), spike="yes")
    with pytest.raises(ValueError, match=r"at least 8 steps to estimate the spread.*got 3\.$"):
        NaNGuard(nn.Linear(2, 1), spike={"window": 3})
    with pytest.raises(ValueError, match=r"^spike must be True"):
        NaNGuard(nn.Linear(2, 1), spike={"windwo": 64})
    with pytest.raises(ValueError, match=r"^on_spike must be one of .*got 'boom'\.$"):
        NaNGuard(nn.Linear(2, 1), on_spike="boom")
    with pytest.raises(ValueError, match=r"^spike z must be a positive"):
        NaNGuard(nn.Linear(2, 1), spike=-1.0)


def _run(guard: NaNGuard, model: nn.Module, scales: list[float]) -> list[bool]:
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    oks = []
    for step, s in enumerate(scales):
        loss = nn.functional.mse_loss(model(x), y) * s
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            oks.append(guard.check(loss, inputs=x, target=y, step=step))
        model.zero_grad()
    return oks


def _guard(tmp_path, **options) -> tuple[NaNGuard, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return NaNGuard(model, directory=tmp_path, **options), model


def test_spike_is_on_by_default_and_writes_a_spike_snapshot(tmp_path):
    guard, model = _guard(tmp_path)
    assert guard.spikes is not None and guard.spikes.action == "snapshot"
    scales = [*_noisy(40), 50.0, 60.0, *_noisy(5, seed=1)]
    oks = _run(guard, model, scales)
    assert all(oks)  # a spike under "snapshot" does not stop the step
    rows = list(guard.history)
    assert [r["step"] for r in rows if "spikes" in r] == [40, 41]
    first = rows[40]["spikes"]
    assert {f["signal"] for f in first} == {"loss", "grad_norm"} and first[0]["z"] > 6
    # one snapshot per run of consecutive spikes, named after its step
    assert [p.name for p in guard.snapshots] == ["step-000000040.nbsnap"]
    assert rows[40]["snapshot"] == str(guard.snapshots[0])
    assert [f.step for f in guard.spike_findings] == [40, 40, 41, 41]
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=nn.Linear(4, 1))
    assert snap.reason["kind"] == FailureKind.SPIKE == "spike" and snap.step == 40
    assert snap.reason["spikes"][0]["z"] > 6 and snap.inputs.shape == (16, 4)


def test_spike_warns_once_per_run(tmp_path):
    guard, model = _guard(tmp_path, on_spike="ignore")
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for step, s in enumerate([*_noisy(40), 50.0, 60.0]):
        loss = nn.functional.mse_loss(model(x), y) * s
        loss.backward()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            guard.check(loss, step=step)
        assert len(w) == (1 if step == 40 else 0)
        model.zero_grad()
    assert not guard.snapshots  # "ignore": only the findings


def test_on_spike_skip_clears_the_gradients_and_keeps_the_window_clean(tmp_path):
    guard, model = _guard(tmp_path, on_spike="skip")
    oks = _run(guard, model, [*_noisy(40), 50.0])
    assert oks[-1] is False and guard.ok is False
    assert all(p.grad is None for p in model.parameters())
    assert guard.history[-1]["skipped"] is True
    assert len(guard.spikes.detector.windows["loss"].values) == 40  # the skip stays out
    assert [p.name for p in guard.snapshots] == ["step-000000040.nbsnap"]


def test_on_spike_raise(tmp_path):
    guard, model = _guard(tmp_path, on_spike="raise")
    with pytest.raises(NonFiniteError, match="spiked at step 40") as info:
        _run(guard, model, [*_noisy(40), 50.0])
    assert info.value.kind == FailureKind.SPIKE and info.value.step == 40
    assert info.value.path == guard.snapshots[0]


def test_spike_off(tmp_path):
    guard, model = _guard(tmp_path, spike=False)
    assert guard.spikes is None and guard.spike_findings == []
    assert all(_run(guard, model, [*_noisy(40), 50.0]))
    assert not guard.snapshots and "spikes" not in guard.history[-1]


def test_detector_without_gradients_says_so_and_never_blocks(tmp_path):
    guard, _ = _guard(tmp_path)
    for step in range(3):
        assert guard.check(torch.tensor(1.0), step=step) is True  # before any backward
    assert "no gradients yet" in guard.history[-1]["spike_status"]["grad_norm"]


def test_a_diverging_run_is_flagged_before_its_nan(tmp_path):
    guard, _, _ = run_uncapped_warmup(
        {"directory": tmp_path, "on_spike": "ignore", "patience": None}
    )
    bad = next(r["step"] for r in guard.history if r["nonfinite"])
    flagged = [f.step for f in guard.spike_findings if f.step < bad]
    assert flagged and bad - flagged[0] >= 3


def test_a_hard_batch_that_comes_back_every_epoch_is_no_spike(tmp_path):
    # four fixed batches, one with targets far from the model's reach: its loss is about
    # twice the others' every fourth step and creeps up as the model fits the rest (a robust
    # z-score alone flags it at 15 sigmas); the lr jump at step 40 is a real spike
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NaNGuard(model, opt, directory=tmp_path, on_spike="ignore", patience=None)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    y[48:] *= 3.0
    for step in range(44):
        if step == 40:
            for g in opt.param_groups:
                g["lr"] = 1e3
        xb, yb = x[(step % 4) * 16 : (step % 4 + 1) * 16], y[(step % 4) * 16 : (step % 4 + 1) * 16]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if guard.check(loss, step=step):
                opt.step()
    flagged = sorted({f.step for f in guard.spike_findings})
    assert flagged and flagged[0] == 41, flagged  # the first step after the lr jump, no earlier


def test_a_spike_snapshot_never_takes_the_place_of_the_failures(tmp_path):
    # max_snapshots=1: the spike's snapshot is written, and so is the NaN step's after it
    guard, model = _guard(tmp_path, max_snapshots=1, patience=None)
    scales = [*_noisy(40), 50.0, *_noisy(3, seed=1), float("nan"), float("nan")]
    oks = _run(guard, model, scales)
    assert oks[:44] == [True] * 44 and oks[44:] == [False, False]
    kinds = [nbdebug.load_snapshot(p).kind for p in guard.snapshots]
    assert kinds == ["spike", "loss"], kinds  # one of each: the second NaN step writes none
