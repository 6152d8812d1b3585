"""The spike detector on losses near their floor and on slow rises (issue 32, item 1):
the loss is scored as a factor (log space) while it is positive, so a converged model's
heavy-tailed batch loss is no spike; a loss that has been negative is scored as it
is; a rise that no single step makes (the median of the last 8 steps far above the
window's) is flagged as a rise; and a new level moves the baseline to it."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from models import run_uncapped_warmup, warmup_mlp
from sklearn.datasets import load_digits
from torch import nn

import nbdebug
from nbdebug.core.guard import NaNGuard
from nbdebug.core.guard.reading import StepReading
from nbdebug.core.guard.spike import RISE_STEPS, SpikeDetector, SpikeSettings


def _reading(step: int, loss: float | None, grad_norm: float) -> StepReading:
    return StepReading(
        step=step, loss=loss, grad_norm=grad_norm, param_norm=None, lr=None, scale=None
    )


def _feed(det: SpikeDetector, losses, grads, start: int = 0) -> list:
    """Score and admit each step as the guard does (flagged steps stay out)."""
    found_all = []
    for i, (loss, grad) in enumerate(zip(losses, grads), start):
        r = _reading(i, loss, grad)
        found = det.score(r)
        det.observe(r, found)
        if not found:
            det.admit(r)
        found_all += found
    return found_all


def _scaled_run(tmp_path, scales: list[float]) -> tuple[NaNGuard, float]:
    """A guard (``on_spike="ignore"``) over a linear model that is never updated, whose
    loss at step ``i`` is its fixed loss times 5 % noise times ``scales[i]``; returns the
    guard and that fixed loss."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = NaNGuard(model, directory=tmp_path, on_spike="ignore", rewind=None)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    g = torch.Generator().manual_seed(0)
    noise = (1.0 + 0.05 * torch.randn(len(scales), generator=g)).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step, (s, k) in enumerate(zip(noise, scales)):
            loss = nn.functional.mse_loss(model(x), y) * s * k
            loss.backward()
            guard.check(loss, step=step)
            model.zero_grad()
    return guard, nn.functional.mse_loss(model(x), y).item()


def test_a_converged_classifiers_batch_loss_is_no_spike(tmp_path):
    # digits, an MLP, SGD with batch 1: a batch's loss is one sample's, 5x the median
    # and more now and then (a sample the model gets wrong); the gradient norm follows
    # it. Scored as it is, the loss read 6-robust-sigma spikes at steps 1611 and 1987 of
    # this very run
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NaNGuard(model, opt, on_spike="ignore", rewind=None, directory=tmp_path)
    losses = []
    for step in range(2000):
        idx = torch.randint(0, len(X), (1,), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
        loss.backward()
        losses.append(loss.item())
        assert guard.check(loss, step=step)
        opt.step()
        opt.zero_grad()
    late = np.array(losses[1000:])
    # the run is what the test says: trained (below log(10) = 2.3), heavy-tailed
    assert np.median(late) < 1.0 and late.max() > 5 * np.median(late)
    assert guard.spike_findings == []


def test_a_rise_no_single_step_makes_is_flagged_as_a_rise():
    # log-normal noise (sigma 0.5 in log space) at level 1 for 150 steps, then the level
    # climbs by 10 % a step (a divergence doubles in 7 steps): no value of the climb's
    # first steps is 6 sigmas above the median, but their median soon is many standard
    # errors above it
    rng = np.random.default_rng(0)
    noise = rng.normal(0.0, 0.5, 260)
    level = np.concatenate([np.zeros(150), 0.1 * np.arange(1, 111)])
    values = np.exp(level + noise)
    det = SpikeDetector(SpikeSettings())
    found = _feed(det, values[:150], values[:150])
    assert found == []
    found = _feed(det, values[150:], np.ones(110), start=150)
    assert found, "the climb was not flagged"
    first = found[0]
    assert first.signal == "loss" and first.rise is not None
    assert "rose at step" in first.message and f"last {RISE_STEPS} steps" in first.message
    # before any single value was 6 sigmas above the window's median (sigma of the noise:
    # 0.5), i.e. before exp(3) = 20x the median
    singles = [i for i in range(150, 260) if values[i] > 20.0]
    assert first.step < singles[0]
    # the median the finding reports is the window's, in the loss's units
    assert first.median == pytest.approx(1.0, rel=0.25)
    assert first.rise > first.median


def test_a_loss_that_turns_negative_is_scored_as_it_is():
    # a likelihood loss: positive, then below zero; the window keeps its values as they
    # are from the first one below zero
    rng = np.random.default_rng(1)
    up = list(1.0 + 0.05 * rng.standard_normal(20))
    down = list(-1.0 + 0.05 * rng.standard_normal(130))
    det = SpikeDetector(SpikeSettings())
    _feed(det, up + down[:10], np.ones(30))
    window = det.windows["loss"]
    assert not window.log
    assert window.values == pytest.approx(up + down[:10])
    _feed(det, down[10:], np.ones(120), start=30)
    assert window.values == pytest.approx(down[-128:])
    # a jump to +2 from a window around -1 is a spike, scored as it is
    found = det.score(_reading(150, 2.0, 1.0))
    assert [f.signal for f in found] == ["loss"] and found[0].rise is None


def test_a_positive_loss_is_scored_as_a_factor():
    # a loss at 0.01 whose batches vary 3x either way: 0.1 (10x) is within its spread
    rng = np.random.default_rng(2)
    losses = np.exp(math.log(0.01) + 0.7 * rng.standard_normal(200))
    det = SpikeDetector(SpikeSettings())
    assert _feed(det, losses, np.ones(200)) == []
    top = float(losses.max())
    assert det.score(_reading(200, 1.5 * top, 1.0)) == []  # above all, but 8x: no spike
    found = det.score(_reading(200, 1000 * 0.01, 1.0))  # 1000x the median: a spike
    assert [f.signal for f in found] == ["loss"] and found[0].z > 6


def test_a_new_level_moves_the_baseline_to_it(tmp_path):
    # the loss scaled 10x from step 40 on: 9 steps flagged, the last a new level; the
    # window then holds the new level's steps alone, and the steps after it are not
    # flagged (nor as a rise: its median is the new level's)
    guard, base = _scaled_run(tmp_path, [10.0 if step >= 40 else 1.0 for step in range(80)])
    flagged = sorted({f.step for f in guard.spike_findings})
    assert flagged == list(range(40, 49))
    assert all(f.new_level for f in guard.spike_findings if f.step == 48)
    window = guard.spikes.detector.windows["loss"].values
    assert len(window) == 80 - 40  # the 9 of the new level, then the 31 steps after it
    assert min(window) > math.log(5 * base)  # (held in log space)


def test_a_geometric_growth_stays_flagged_through_its_new_levels(tmp_path):
    # the loss multiplied by 1.35 a step from step 60 (a divergence at a steady rate):
    # each run of 9 flags is a new level for the skip bound, but one that kept climbing,
    # so the baseline stays where the run was healthy and every later step is flagged
    guard, base = _scaled_run(tmp_path, [1.35 ** max(0, step - 60) for step in range(120)])
    flagged = sorted({f.step for f in guard.spike_findings})
    first = flagged[0]
    assert 60 < first <= 70
    assert flagged == list(range(first, 120))  # no step of the climb goes unflagged
    levels = sorted({f.step for f in guard.spike_findings if f.new_level})
    assert len(levels) >= 5  # (runs of 9: the skip bound still holds)
    window = guard.spikes.detector.windows["loss"].values
    assert max(window) < math.log(2 * base)  # the baseline is the healthy steps'


def test_diagnose_says_a_rise_snapshot_is_part_of_a_sustained_rise(tmp_path):
    # an MLP under a linear warm-up with no cap: its loss climbs from 0.001 for a hundred
    # steps before the NaN, within its batch-to-batch spread; the first spike snapshot is
    # of a rise, and diagnose names it so
    guard, losses, _ = run_uncapped_warmup(
        {"directory": tmp_path, "patience": None, "loss_fn": nn.functional.mse_loss}
    )
    bad = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    spikes = [p for p in guard.snapshots if nbdebug.load_snapshot(p).kind == "spike"]
    snap = nbdebug.load_snapshot(spikes[0])
    s = snap.step
    assert s is not None and bad - s >= 50
    finding = snap.reason["spikes"][0]
    assert finding["signal"] == "loss" and finding["rise"] is not None
    # plain numpy: the last 8 losses' median is over 3x the median of the 128 before them,
    # while this step's own loss is within the largest of those 128 by less than 2x
    assert np.median(losses[s - 7 : s + 1]) > 3 * np.median(losses[s - 128 : s])
    assert losses[s] < 2 * max(losses[s - 128 : s])
    assert finding["value"] == pytest.approx(losses[s], rel=1e-6)
    st = nbdebug.diagnose(spikes[0], model=warmup_mlp, progress=False).cause.statement
    assert f"step {s} is part of a sustained rise of the loss, not a failing step" in st
    assert f"loss rose at step {s}" in st


def test_the_rise_test_can_be_turned_off_and_takes_a_bool():
    rng = np.random.default_rng(0)
    values = np.exp(
        np.concatenate([np.zeros(150), 0.1 * np.arange(1, 41)]) + rng.normal(0, 0.5, 190)
    )
    on = SpikeDetector(SpikeSettings())
    off = SpikeDetector(SpikeSettings(rise=False))
    assert any(f.rise is not None for f in _feed(on, values, np.ones(190)))
    assert not any(f.rise is not None for f in _feed(off, values, np.ones(190)))
    with pytest.raises(ValueError, match=r"^spike rise must be True or False; got 'yes'\.$"):
        NaNGuard(nn.Linear(2, 1), spike={"rise": "yes"})
    assert NaNGuard(nn.Linear(2, 1), spike={"rise": False}).spikes.detector.settings.rise is False


def test_a_hinge_loss_that_is_often_exactly_zero_is_no_spike():
    # a margin loss: 0 on 70 % of the batches (every triplet easy), a heavy-tailed positive
    # value on the others; the zeros are left out (no log), the window stays in log space
    rng = np.random.default_rng(3)
    hard = rng.random(3000) < 0.3
    losses = np.where(hard, np.exp(math.log(0.05) + 0.8 * rng.standard_normal(3000)), 0.0)
    det = SpikeDetector(SpikeSettings())
    assert _feed(det, losses, np.ones(3000)) == []
    assert det.windows["loss"].log
    # a batch 1000x the typical positive loss is still a spike
    assert [f.signal for f in det.score(_reading(3000, 50.0, 1.0))] == ["loss"]
