"""Per-layer signals of NaNGuard (nbdebug.core.guard.signals / signal_meter): every value
checked against plain torch, worked out by hand around the optimizer step."""

from __future__ import annotations

import copy
import gc
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbdebug
from nbdebug.core.guard import NaNGuard
from nbdebug.core.guard.signals import LayerSignals, SignalSettings, signal_settings
from nbdebug.core.snapshot import load_snapshot
from nbdebug.core.snapshot.archive import atomic_save, read_archive

EVERY = {"update_every": 1, "adam_every": 1}


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def guard_of(model: nn.Module, opt: Any, tmp_path: Path, signals: Any = True, **kw: Any):
    return NaNGuard(
        model, opt, directory=tmp_path, signals=signals, rewind=False, spike=False, **kw
    )


def run(steps: int, tmp_path: Path, signals: Any = EVERY, bad: int | None = None, **kw: Any):
    """Train ``steps`` steps; per step what plain torch says (grad norms, Adam lag from
    the optimizer state, update ratio around optimizer.step())."""
    model, opt = make()
    guard = guard_of(model, opt, tmp_path, signals, on_nonfinite="continue", **kw)
    want: list[dict[str, Any]] = []
    for i in range(steps):
        x, y = batch(i)
        if i == bad:
            x = x.clone()
            x[0, 0] = math.nan
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ps = list(model.parameters())
        row: dict[str, Any] = {"grad": [float(torch.linalg.vector_norm(p.grad)) for p in ps]}
        lag = []
        for p in ps:
            st = opt.state.get(p)
            if not st:
                lag.append(math.nan)
                continue
            bc = 1 - opt.param_groups[0]["betas"][1] ** float(st["step"])
            v_hat = st["exp_avg_sq"] / bc
            lag.append(float(p.grad.pow(2).mean() / v_hat.mean()))
        row["lag"] = lag
        before = [p.detach().clone() for p in ps]
        if guard.check(loss, inputs=x, target=y, step=i) and i != bad:
            opt.step()
        opt.zero_grad()
        row["ratio"] = [
            float(torch.linalg.vector_norm(p.detach() - b) / torch.linalg.vector_norm(b))
            for p, b in zip(ps, before)
        ]
        want.append(row)
    return guard, model, want


def test_grad_norms_update_ratio_and_adam_lag_match_plain_torch(tmp_path):
    guard, model, want = run(5, tmp_path)
    sig = guard.signals
    assert isinstance(sig, LayerSignals)
    assert sig.names == [n for n, _ in model.named_parameters()]
    assert sig.steps.tolist() == [0, 1, 2, 3, 4] and sig.steps.dtype == np.int64
    for a in (sig.grad_norm, sig.update_ratio, sig.adam_lag):
        assert a.dtype == np.float32 and a.shape == (5, 4)
    np.testing.assert_allclose(sig.grad_norm, [w["grad"] for w in want], rtol=1e-5)
    # the update ratio of a step is read at the next check: the last one is not yet
    np.testing.assert_allclose(sig.update_ratio[:4], [w["ratio"] for w in want[:4]], rtol=1e-4)
    assert np.isnan(sig.update_ratio[4]).all()
    # Adam's lag: no state before the first step, then mean(g^2) / mean(v_hat)
    assert np.isnan(sig.adam_lag[0]).all()
    np.testing.assert_allclose(sig.adam_lag[1:], [w["lag"] for w in want[1:]], rtol=1e-4)
    assert 1e-4 < float(np.nanmedian(sig.update_ratio)) < 1  # a step of lr 1e-2


def test_unmeasured_steps_are_nan_and_the_cadence_is_kept(tmp_path):
    signals = {"update_every": 3, "adam_every": 2}
    guard, _, want = run(7, tmp_path, signals=signals, check_update=False)
    sig = guard.signals
    measured = [i for i in range(7) if not np.isnan(sig.update_ratio[i]).all()]
    assert measured == [0, 3]  # step 6 was armed: its ratio comes with the next check
    np.testing.assert_allclose(sig.update_ratio[3], want[3]["ratio"], rtol=1e-4)
    lag_steps = [i for i in range(7) if not np.isnan(sig.adam_lag[i]).all()]
    assert lag_steps == [2, 4, 6]  # step 0 is due too, but Adam has no state yet
    np.testing.assert_allclose(sig.adam_lag[4], want[4]["lag"], rtol=1e-4)
    assert np.isfinite(sig.grad_norm).all()  # every step


def test_adam_lag_comes_from_the_update_watchs_read_of_the_state(tmp_path, monkeypatch):
    """The update watch reads the optimizer state after every 10th step: the check after
    it measures Adam's lag from that read (no pass over exp_avg_sq of its own)."""
    from nbdebug.core.guard import signal_meter

    own: list[int] = []
    plain = signal_meter.plain_sums
    monkeypatch.setattr(signal_meter, "plain_sums", lambda ts: own.append(len(ts)) or plain(ts))
    guard, _, want = run(13, tmp_path, signals={"adam_every": 50})
    sig = guard.signals
    lag_steps = [i for i in range(13) if not np.isnan(sig.adam_lag[i]).all()]
    assert lag_steps == [1, 11]  # after the watch's reads at steps 0 and 10
    for i in lag_steps:
        np.testing.assert_allclose(sig.adam_lag[i], want[i]["lag"], rtol=1e-4)
    assert own == []  # every sum of v came with the update watch's read


def test_the_ring_keeps_the_newest_steps(tmp_path):
    guard, _, want = run(6, tmp_path, signals={**EVERY, "ring": 3})
    sig = guard.signals
    assert len(sig) == 3 and sig.steps.tolist() == [3, 4, 5]
    np.testing.assert_allclose(sig.grad_norm, [w["grad"] for w in want[3:]], rtol=1e-5)
    np.testing.assert_allclose(sig.update_ratio[:2], [w["ratio"] for w in want[3:5]], rtol=1e-4)
    assert "signals 3/3 steps x 4 parameters" in repr(guard)


def test_sgd_has_no_adam_lag_and_a_skipped_step_no_update(tmp_path):
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, tmp_path, EVERY)
    for i in range(3):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if i != 1 and guard.check(loss, step=i):
            opt.step()
        elif i == 1:
            guard.check(loss, step=i)  # checked, but the loop does not step
        opt.zero_grad()
    sig = guard.signals
    assert np.isnan(sig.adam_lag).all()
    assert (sig.update_ratio[1] == 0).all() and (sig.update_ratio[0] > 0).all()


def test_module_logits_are_recorded_and_the_hooks_removed(tmp_path):
    model, opt = make()
    guard = guard_of(model, opt, tmp_path, {"modules": ["2"]})
    head = model[2]
    twin = copy.deepcopy(model)  # a copy's forward (its hooks were copied) is not counted
    outs = []
    head.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    for i in range(3):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        twin(x * 100)
        loss.backward()
        guard.check(loss, step=i)
        opt.step()
        opt.zero_grad()
    sig = guard.signals
    assert sig.modules == ["2"] and sig.max_logit.shape == (3, 1)
    np.testing.assert_allclose(sig.max_logit[:, 0], [float(o.max()) for o in outs], rtol=1e-6)
    lse = [float(torch.logsumexp(o, -1).max()) for o in outs]
    np.testing.assert_allclose(sig.logsumexp[:, 0], lse, rtol=1e-6)
    assert len(head._forward_hooks) == 2  # the guard's and the test's
    guard.close()
    assert len(head._forward_hooks) == 1
    # a guard that is dropped without close() takes its hooks with it
    guard2 = guard_of(model, opt, tmp_path, {"modules": ["0", "2"]})
    assert len(head._forward_hooks) == 2 and len(model[0]._forward_hooks) == 1
    del guard2
    gc.collect()
    assert len(head._forward_hooks) == 1 and not model[0]._forward_hooks


def test_a_guarded_run_trains_exactly_as_an_unguarded_one(tmp_path):
    def train(guarded: bool) -> list[torch.Tensor]:
        model, opt = make()
        guard = guard_of(model, opt, tmp_path, {**EVERY, "modules": ["0", "2"]})
        if not guarded:
            guard.close()
            guard = None
        for i in range(4):
            x, y = batch(i)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if guard is None or guard.check(loss, step=i):
                opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))


def test_the_snapshot_holds_the_signals_and_an_older_file_reads_none(tmp_path):
    guard, model, _ = run(5, tmp_path, signals=EVERY, bad=3)
    names = [n for n, _ in model.named_parameters()]
    (path,) = guard.snapshots
    snap = load_snapshot(path)
    sig, live = snap.signals, guard.signals
    assert isinstance(sig, LayerSignals)
    assert sig.steps.tolist() == [0, 1, 2, 3] and sig.names == live.names == names
    np.testing.assert_array_equal(sig.grad_norm, live.grad_norm[:4])
    np.testing.assert_array_equal(sig.adam_lag, live.adam_lag[:4])
    assert not np.isfinite(sig.grad_norm[3]).all()  # the NaN step's gradients
    np.testing.assert_array_equal(sig.update_ratio[:2], live.update_ratio[:2])
    assert snap.signals_data["update_every"] == 1
    # a file of the previous format version, which had no "signals" field
    raw = read_archive(path)
    old = {k: v for k, v in raw.items() if k not in ("signals", "rewind")}
    old["version"] = 6
    atomic_save(old, tmp_path / "old.nbsnap")
    assert load_snapshot(tmp_path / "old.nbsnap").signals is None
    # and one written with the signals off
    model2, opt2 = make()
    off = guard_of(model2, opt2, tmp_path / "off", False)
    assert off.signals is None and "signals" not in repr(off)
    path2 = nbdebug.save_snapshot(tmp_path / "plain.nbsnap", model2)
    assert load_snapshot(path2).signals is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", "signals must be True, False, a dict of settings .* got 'yes'"),
        ({"ring": 0}, "signals ring must be a positive int; got 0"),
        (
            {"update_every": 1.5},
            r"signals update_every must be a positive int, 'auto' or None \(off\); got 1.5\.",
        ),
        ({"rng": 5}, "signals got the unknown setting 'rng'; its settings are ring, "),
        ({"modules": [3]}, r"signals modules must be a list of module names \(str\); got \[3\]"),
        ({"modules": ["head"]}, "signals modules must name modules of the model .* got 'head'"),
    ],
)
def test_a_bad_signals_option_is_one_sentence(tmp_path, value, message):
    model, opt = make()
    with pytest.raises(ValueError, match=message):
        guard_of(model, opt, tmp_path, value)


def test_settings_and_arrays_are_checked():
    assert signal_settings(True) == SignalSettings()
    assert signal_settings(False) is None and signal_settings(None) is None
    assert signal_settings({"modules": "head"}).modules == ("head",)
    with pytest.raises(ValueError, match=r"grad_norm must have shape .* = \(2, 1\); got \(2, 2\)"):
        LayerSignals.from_arrays(
            ["w"], [0, 1], np.zeros((2, 2)), np.zeros((2, 1)), np.zeros((2, 1))
        )
    sig = LayerSignals.from_arrays(
        ["w", "b"], [4, 5], [[1, 2], [3, 4]], np.full((2, 2), np.nan), [[0, 0], [1, 1]]
    )
    df = sig.frame()
    assert list(df.columns) == ["step", "parameter", "signal", "value"] and len(df) == 12
    got = df[(df.step == 5) & (df.parameter == "b") & (df.signal == "grad_norm")].value
    assert got.tolist() == [4.0]


def test_the_lightning_callback_passes_the_signals_through(tmp_path):
    L = pytest.importorskip("lightning")
    from nbdebug.integrations.lightning import NaNGuardCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make()[0]

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return F.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    x, y = batch(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    cb = NaNGuardCallback(directory=tmp_path, signals={**EVERY, "ring": 8})
    trainer = L.Trainer(
        max_steps=4,
        callbacks=[cb],
        logger=False,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    sig = cb.guard.signals
    assert len(sig) == 4 and np.isfinite(sig.grad_norm).all()
    assert np.isfinite(sig.update_ratio[:3]).all() and (sig.update_ratio[:3] > 0).all()


def test_scaled_gradients_are_read_unscaled(tmp_path):
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = guard_of(model, opt, tmp_path, EVERY, scaler=scaler)
    want = []
    for i in range(3):
        x, y = batch(i)
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        ps = list(model.parameters())
        g = [p.grad / scaler.get_scale() for p in ps]
        row = [float(torch.linalg.vector_norm(t)) for t in g]
        lag = [math.nan] * len(ps)
        for j, (p, t) in enumerate(zip(ps, g)):
            st = opt.state.get(p)
            if st:
                bc = 1 - 0.999 ** float(st["step"])
                lag[j] = float(t.pow(2).mean() / (st["exp_avg_sq"] / bc).mean())
        want.append((row, lag))
        guard.check(None, step=i)  # the gradients are still scaled here
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    sig = guard.signals
    np.testing.assert_allclose(sig.grad_norm, [w[0] for w in want], rtol=1e-5)
    np.testing.assert_allclose(sig.adam_lag[1:], [w[1] for w in want[1:]], rtol=1e-4)


def test_the_trainer_callbacks_refuse_a_bad_signals_option_when_made():
    pytest.importorskip("transformers")
    from nbdebug.integrations.hf import NaNGuardCallback as HFCallback

    with pytest.raises(ValueError, match="signals ring must be a positive int; got 0"):
        HFCallback(directory="x", signals={"ring": 0})


def test_a_model_over_the_copy_budget_is_measured_in_parts(tmp_path):
    # 4 parameters of 128, 32, 96 and 12 bytes; parts of <= 130 bytes: [0], [1, 2], [3]
    guard, _, want = run(7, tmp_path, signals={**EVERY, "copy_budget": 130})
    sig = guard.signals
    measured = ~np.isnan(sig.update_ratio)
    assert measured[:6].tolist() == [
        [True, False, False, False],
        [False, True, True, False],
        [False, False, False, True],
        [True, False, False, False],
        [False, True, True, False],
        [False, False, False, True],
    ]
    got = np.where(measured[:6], sig.update_ratio[:6], 0)
    np.testing.assert_allclose(
        got, np.where(measured[:6], [w["ratio"] for w in want[:6]], 0), rtol=1e-4
    )
    # the ring (500 steps: int64 + 3 x 4 float32) and the armed part's copy (parameter 0)
    assert guard.meter.signals is not None
    assert guard.meter.signals.nbytes == 500 * 8 + 3 * 500 * 4 * 4 + 128


@pytest.mark.parametrize("engine", ["compiled", "eager"])
def test_update_ratio_reads_the_rewind_windows_copy_with_update_every_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """``update_every="auto"`` with a rewind window: the check after each of the window's
    copies is measured against that copy (no weight copy of the signals' own), the
    values are plain torch's, and the window's copy is left as it was."""
    from nbdebug.core import kernels

    if engine == "compiled" and not kernels.active():
        pytest.skip("the compiled kernel is not built (nbdebug build-kernels)")
    monkeypatch.setenv(kernels.ENV, engine)
    model, opt = make()
    guard = NaNGuard(model, opt, directory=tmp_path, rewind=3, spike=False)
    signals = guard.meter.signals
    assert signals is not None and signals.sharing
    copied_after: list[int] = []  # the steps whose optimizer.step() took the window's copy
    weights_at_copy: list[torch.Tensor] = []
    ratios: list[list[float]] = []
    for i in range(14):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        taken = guard.rewind.taken
        assert guard.check(loss, inputs=x, target=y, step=i)
        opt.step()
        opt.zero_grad()
        if guard.rewind.taken > taken:
            copied_after.append(i)
            weights_at_copy = [p.detach().clone() for p in model.parameters()]
        elif copied_after and i == copied_after[-1] + 2:  # its update was just measured
            window = guard.rewind.current()
            assert window is not None  # the window's copy holds the weights it copied
            for (name, _), w in zip(model.named_parameters(), weights_at_copy):
                assert torch.equal(window.model_state[name], w), (i, name)
        ratios.append(
            [
                float(torch.linalg.vector_norm(p.detach() - b) / torch.linalg.vector_norm(b))
                for p, b in zip(model.parameters(), before)
            ]
        )
    sig = guard.signals
    measured = [i for i in range(len(sig)) if not np.isnan(sig.update_ratio[i]).all()]
    # the check after each copy (the last one's update is read by a check still to come)
    assert copied_after and measured == [s + 1 for s in copied_after if s + 2 < 14]
    for i in measured:
        np.testing.assert_allclose(sig.update_ratio[i], ratios[i], rtol=1e-4)
    assert (sig.update_ratio[measured] > 0).all()
    # no weight copy of its own: its bytes are the ring's alone
    ring_only = guard_of(*make(), tmp_path / "b", {"update_every": None})
    assert signals.nbytes == ring_only.meter.signals.nbytes


def test_an_explicit_update_every_keeps_its_own_copy_beside_the_rewind_window(
    tmp_path: Path,
) -> None:
    model, opt = make()
    guard = NaNGuard(model, opt, directory=tmp_path, rewind=3, signals={"update_every": 2})
    assert not guard.meter.signals.sharing
    for i in range(6):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        assert guard.check(loss, inputs=x, target=y, step=i)
        opt.step()
        opt.zero_grad()
    measured = [not np.isnan(r).all() for r in guard.signals.update_ratio]
    assert measured == [True, False, True, False, True, False]  # every 2nd (the last: pending)


def test_a_window_held_by_a_spike_hands_the_update_ratio_back_to_its_own_copy(
    tmp_path: Path,
) -> None:
    """The rewind window is not refreshed while it holds a spike; meanwhile the update
    ratio copies the weights itself (every 10th check), so it stays measured while a run
    grows, with plain torch's values."""
    model, opt = make()
    guard = NaNGuard(
        model, opt, directory=tmp_path, rewind=3, spike={"warmup": 8}, on_spike="ignore"
    )
    signals, keeper = guard.meter.signals, guard.rewind
    held: list[int] = []  # the checks made while the window was held by a spike
    ratios: list[list[float]] = []
    for i in range(40):
        x, y = batch(i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        shown = loss.detach() * (1e4 if i == 24 else 1.0)  # a loss spike, finite
        before = [p.detach().clone() for p in model.parameters()]
        if keeper.spiked:
            held.append(i)
        assert guard.check(shown, inputs=x, target=y, step=i)
        if i == 24:  # flagged: the window holds it, and the update ratio copies itself
            assert guard.history[-1]["spikes"] and keeper.spiked
            assert not keeper.active and not signals.sharing
        opt.step()
        opt.zero_grad()
        ratios.append(
            [
                float(torch.linalg.vector_norm(p.detach() - b) / torch.linalg.vector_norm(b))
                for p, b in zip(model.parameters(), before)
            ]
        )
    sig = guard.signals
    own = [i for i in held if i % 10 == 0]  # the own copy's cadence (checks 0, 10, 20, ...)
    assert own, held
    for i in own:  # measured from its own copy while the window was held
        np.testing.assert_allclose(sig.update_ratio[i], ratios[i], rtol=1e-4)
    assert not keeper.spiked and signals.sharing  # a window without the spike: shared again
