"""Spikes and skips that cannot hide: a spike is a transient, a run of more than 8 flagged
steps in a row is a new level. Under ``on_spike="skip"`` the skipped steps count toward
that run, so a lasting level shift (targets in other units, a loss summed instead of
averaged, inputs rescaled) is admitted and the run keeps training, while a real divergence
is still flagged, snapshotted and skipped until it stops on a non-finite step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from models import run_uncapped_warmup
from torch import nn

import nbdebug
from nbdebug.core.guard import NaNGuard, NonFiniteError
from nbdebug.core.guard.spike import MIN_WINDOW, SpikeDetector, SpikeSettings

Batch = tuple[torch.Tensor, torch.Tensor, float]
Shift = Callable[[int, torch.Tensor, torch.Tensor], Batch]


def _targets_x4(step: int, x: torch.Tensor, y: torch.Tensor) -> Batch:
    return x, (y * 4 if step >= 60 else y), 1.0


def _loss_summed(step: int, x: torch.Tensor, y: torch.Tensor) -> Batch:
    return x, y, (10.0 if step >= 50 else 1.0)  # reduction="sum" over 10 terms from 50 on


def _inputs_x3(step: int, x: torch.Tensor, y: torch.Tensor) -> Batch:
    return (x * 3, y * 3, 1.0) if step >= 50 else (x, y, 1.0)


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.01)


def _adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=3e-3)


def _train(shift: Shift, make_opt, tmp_path=None, steps: int = 140):
    """The same loop with and without the guard: 20 fixed batches of a linear teacher, an
    MLP, the shift applied from its step on. Returns the (unscaled) losses and the guard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = make_opt(model)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 1, generator=g)
    data = [(x, x @ w) for x in (torch.randn(32, 10, generator=g) for _ in range(20))]
    guard = None
    if tmp_path is not None:
        guard = NaNGuard(model, opt, directory=tmp_path, on_spike="skip", loss_fn=F.mse_loss)
    losses, caught = [], []
    for step in range(steps):
        x, y, k = shift(step, *data[step % 20])
        loss = F.mse_loss(model(x), y) * k
        loss.backward()
        losses.append(loss.item() / k)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ok = guard is None or guard.check(loss, inputs=x, target=y, step=step)
        caught += [str(m.message) for m in seen if str(m.message).startswith("nbdebug:")]
        if ok:
            opt.step()
        opt.zero_grad()
    return losses, guard, caught


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize(
    "shift, make_opt, at",
    [(_targets_x4, _sgd, 60), (_loss_summed, _adam, 50), (_inputs_x3, _adam, 50)],
    ids=["targets-x4-sgd", "loss-summed-adam", "inputs-x3-adam"],
)
def test_skip_admits_a_lasting_level_shift_and_keeps_training(tmp_path, shift, make_opt, at):
    plain, _, _ = _train(shift, make_opt)
    losses, guard, caught = _train(shift, make_opt, tmp_path)
    assert guard is not None
    rows = list(guard.history)
    # the shift is flagged: its first MIN_WINDOW steps are skipped, the next one is the
    # new level (its findings say so) and goes on, and nothing after it is flagged
    flagged = sorted({f.step for f in guard.spike_findings})
    assert flagged == list(range(at, at + MIN_WINDOW + 1)), flagged
    skipped = [r["step"] for r in rows if r["skipped"]]
    assert skipped == list(range(at, at + MIN_WINDOW))
    assert all(r["skip_reason"].startswith("spike in ") for r in rows if r["skipped"])
    assert max(r["skips_in_row"] for r in rows) == MIN_WINDOW
    assert all(s["new_level"] for s in rows[at + MIN_WINDOW]["spikes"])
    assert not any(s["new_level"] for r in rows[at : at + MIN_WINDOW] for s in r["spikes"])
    # one sentence for the first skip, one for the stop of the skips
    assert len(caught) == 2, caught
    assert f"spiked at step {at}" in caught[0] and "its update is skipped" in caught[0]
    assert f"9 steps in a row (steps {at} to {at + 8}, 8 updates skipped)" in caught[1]
    assert "taken as a new level" in caught[1] and f"step {at + 8}'s update goes on" in caught[1]
    assert [p.name for p in guard.snapshots] == [f"step-{at:09d}.nbsnap"]
    # it keeps training: the guarded run is the plain run less at most MIN_WINDOW updates,
    # so its last 20 losses are within 1.25x of the plain run's 20 losses MIN_WINDOW steps
    # earlier (the same number of updates after the shift; 25 % for the batches falling on
    # other updates), and within 1.5x of the plain run's last 20; frozen weights (the bug)
    # would leave it near the loss at the shift, 10x to 100x these
    late = _mean(losses[-20:])
    assert late <= 1.25 * _mean(plain[-20 - MIN_WINDOW : -MIN_WINDOW])
    assert late <= 1.5 * _mean(plain[-20:])
    assert late < plain[at] / 10


def _diverging(guard_dir) -> tuple[NaNGuard, NonFiniteError | None]:
    """The uncapped warm-up run under ``on_spike="skip"``: the guard and the error that
    stopped it (``None``: it never stopped)."""
    guard, _, error = run_uncapped_warmup(
        {"directory": guard_dir, "on_spike": "skip", "history": 2000}, stop_at_nonfinite=False
    )
    return guard, error


def test_a_diverging_run_is_still_flagged_snapshotted_and_skipped_until_it_stops(tmp_path):
    guard, error = _diverging(tmp_path)
    assert error is not None and str(error).startswith("2 non-finite steps in a row")
    rows = list(guard.history)
    bad = next(r["step"] for r in rows if r["nonfinite"])
    flagged = [r["step"] for r in rows if r.get("spikes") and r["step"] < bad]
    assert flagged and bad - flagged[0] >= 3  # flagged well before the non-finite step
    first = nbdebug.load_snapshot(tmp_path / f"step-{flagged[0]:09d}.nbsnap")
    assert first.reason["kind"] == "spike" and first.reason["action"] == "skip"
    # every flagged step but a new level's is skipped, to the end: a run that keeps
    # growing is flagged again after each new level, so the skips never stop for good
    spike_rows = [r for r in rows if r.get("spikes")]
    levels = [r["step"] for r in spike_rows if r["spikes"][0]["new_level"]]
    assert all(r["skipped"] for r in spike_rows if r["step"] not in levels)
    assert not any(r["skipped"] for r in rows if r["step"] in levels)
    assert len(spike_rows) - len(levels) >= 2 * MIN_WINDOW
    assert max(r["skips_in_row"] for r in rows if not r["nonfinite"]) <= MIN_WINDOW
    assert any(r["skipped"] for r in rows if bad - 20 <= r["step"] < bad)  # still skipping


def test_a_burst_shorter_than_a_level_is_skipped_and_kept_out_of_the_window(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = NaNGuard(model, directory=tmp_path, on_spike="skip")
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    g = torch.Generator().manual_seed(0)
    noise = (1.0 + 0.05 * torch.randn(60, generator=g)).tolist()
    scales = noise[:40] + [50.0] * MIN_WINDOW + noise[40:]  # 8 flagged steps: no level
    oks = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step, s in enumerate(scales):
            loss = F.mse_loss(model(x), y) * s
            loss.backward()
            oks.append(guard.check(loss, inputs=x, target=y, step=step))
            model.zero_grad()
    assert oks == [True] * 40 + [False] * MIN_WINDOW + [True] * 20
    assert len([m for m in seen if "nbdebug" in str(m.message)]) == 1  # the first skip only
    # no optimizer: every loss is the untrained model's times its scale
    base = F.mse_loss(model(x), y).item()
    window = guard.spikes.detector.windows["loss"].values
    assert len(window) == 60 and max(window) < 2 * base  # the burst's 50x stayed out


@pytest.mark.parametrize("warmup", [-5, 0, 7])
def test_a_warmup_under_8_steps_is_one_sentence(warmup):
    with pytest.raises(
        ValueError,
        match=rf"^spike warmup must be at least 8 steps \(the detector is silent until its "
        rf"window holds 8 steps, .*\); got {warmup}\.$",
    ):
        NaNGuard(nn.Linear(2, 1), spike={"warmup": warmup})


def test_a_warmup_of_8_raises_no_threshold_and_one_above_the_window_ends_when_full():
    assert SpikeSettings(warmup=8).warmup == 8
    # warmup 8: sqrt(max(1, 8 / n)) is 1 from the 8 steps the detector needs on
    assert SpikeDetector(SpikeSettings(z=6, warmup=8)).threshold(8) == pytest.approx(6.0)
    # window 16 with the default warmup 32: the window never holds 32 steps, so the
    # raise ends when it is full (sqrt(16 / 8) at 8 steps, 1 at 16), not 6 * sqrt(2) forever
    det = SpikeDetector(SpikeSettings(z=6, window=16))
    assert det.threshold(8) == pytest.approx(6.0 * math.sqrt(2.0))
    assert det.threshold(16) == pytest.approx(6.0)
