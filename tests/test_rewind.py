"""The guard's rewind window (NaNGuard(rewind=K)): the states it keeps equal a hand-kept
copy taken at the start of the right step, each step's batch, RNG state and learning
rate are recorded, refreshes reuse their buffers, snapshots hold the window and older
files load without one; nothing of the run changes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.core.guard import rewind as keeper_module
from nbdebug.core.guard.rewind import DEFAULT_EVERY, check_rewind, state_estimate
from nbdebug.core.snapshot import atomic_save, load_snapshot, read_archive
from nbdebug.core.snapshot.rewind import RewindWindow
from nbdebug.core.text import fmt_bytes
from nbdebug.figures.report import snapshot_facts


class Net(nn.Module):
    """BatchNorm (buffers the forward writes) and dropout (the RNG matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def batches(steps: int, bad: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    out = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(steps)]
    if bad is not None:
        out[bad][0][0, 0] = float("nan")
    return out


def train(
    tmp_path: Path,
    steps: int,
    *,
    bad: int | None = None,
    guard: bool = True,
    each: Any = None,
    **options: Any,
) -> tuple[nn.Module, nbdebug.NaNGuard | None, dict[int, dict[str, Any]]]:
    """Train ``Net`` with Adam and a StepLR, keeping by hand (plain torch) the state at
    the start of every step; ``each(t, guard, kept)`` runs after each check."""
    data = batches(steps, bad)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = None
    if guard:
        g = nbdebug.NaNGuard(
            model, opt, scheduler=sched, directory=tmp_path / "snaps", spike=False, **options
        )
    kept: dict[int, dict[str, Any]] = {}
    for t, (x, y) in enumerate(data):
        kept[t] = {
            "model": copy.deepcopy(model.state_dict()),
            "opt": copy.deepcopy(opt.state_dict()),
            "sched": copy.deepcopy(sched.state_dict()),
            "rng": torch.get_rng_state(),
            "lr": [g_["lr"] for g_ in opt.param_groups],
        }
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        kept[t]["loss"] = loss.item()
        kept[t]["grad_norm"] = float(
            torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        )
        ok = g.check(loss, inputs=x, target=y, step=t) if g is not None else True
        if each is not None:
            each(t, g, kept)
        if ok:
            opt.step()
        opt.zero_grad()
        sched.step()
    return model, g, kept


def assert_state_is(window: RewindWindow, kept: dict[str, Any]) -> None:
    assert list(window.model_state) == list(kept["model"])
    for k, v in kept["model"].items():
        assert torch.equal(window.model_state[k], v), k
    assert window.optimizer_state is not None
    want = kept["opt"]
    assert window.optimizer_state["param_groups"] == want["param_groups"]
    assert sorted(window.optimizer_state["state"]) == sorted(want["state"])
    for idx, entry in want["state"].items():
        for key, v in entry.items():
            assert torch.equal(window.optimizer_state["state"][idx][key], v), (idx, key)
    assert window.scheduler_state == kept["sched"]


def expected_start(t: int, k: int) -> int:
    """The step a window holding step ``t`` starts at: the copy is taken after the
    optimizer steps of steps 0, k, 2k, ... (each time the window is k steps long), so
    windows start at 1, k + 1, 2k + 1, ..."""
    return 1 + k * ((t - 1) // k)


def test_the_window_state_and_steps_equal_a_hand_kept_copy(tmp_path):
    k, seen, data = 3, [], batches(11)  # what train() draws (not drawn during it)

    def each(t: int, guard: nbdebug.NaNGuard, kept: dict[int, dict[str, Any]]) -> None:
        assert guard.rewind is not None
        window = guard.rewind.current()
        if t == 0:  # no optimizer step has taken the copy yet
            assert window is None
            return
        assert window is not None
        s = expected_start(t, k)
        assert window.start_step == s
        assert [r.step for r in window.steps] == list(range(s, t + 1))
        assert_state_is(window, kept[s])
        for r in window.steps:
            assert r.stored and r.ids is None
            assert torch.equal(r.inputs, data[r.step][0])
            assert torch.equal(r.target, data[r.step][1])
            assert torch.equal(r.rng.torch_cpu, kept[r.step]["rng"])
            assert r.lr == kept[r.step]["lr"]
            assert r.loss == pytest.approx(kept[r.step]["loss"], rel=1e-6)
            assert r.grad_norm == pytest.approx(kept[r.step]["grad_norm"], rel=1e-5)
        seen.append(t)

    train(tmp_path, 11, each=each, rewind=k)
    assert seen == list(range(1, 11))


def test_a_refresh_reuses_its_buffers(tmp_path):
    pointers: list[list[int]] = []

    def each(t: int, guard: nbdebug.NaNGuard, kept: dict[int, dict[str, Any]]) -> None:
        assert guard.rewind is not None
        window = guard.rewind.current()
        if window is not None and window.steps[0].step == t:  # a refresh
            pointers.append([v.data_ptr() for v in window.model_state.values()])

    _, guard, _ = train(tmp_path, 9, each=each, rewind=2)
    assert guard is not None and guard.rewind is not None
    assert len(pointers) == 4  # windows starting at steps 1, 3, 5, 7
    assert all(p == pointers[0] for p in pointers)
    assert guard.rewind.state.allocations == 1


def test_a_window_copies_its_batches_into_the_buffers_of_the_window_before(tmp_path):
    full: list[set[int]] = []  # the batch buffers of each window, once it is k steps long
    data = batches(9)

    def each(t: int, guard: nbdebug.NaNGuard, kept: dict[int, dict[str, Any]]) -> None:
        assert guard.rewind is not None
        window = guard.rewind.current()
        if window is not None and len(window.steps) == 2:
            full.append(
                {p for r in window.steps for p in (r.inputs.data_ptr(), r.target.data_ptr())}
            )
            for r in window.steps:  # and they hold this window's batches
                assert torch.equal(r.inputs, data[r.step][0])
                assert torch.equal(r.target, data[r.step][1])

    train(tmp_path, 9, each=each, rewind=2)
    assert len(full) == 4 and all(len(p) == 4 for p in full)
    assert full[1] == full[0] and full[2] == full[0] and full[3] == full[0]


def test_the_snapshot_holds_the_window(tmp_path):
    k, bad = 4, 7
    _, guard, kept = train(tmp_path, 9, bad=bad, rewind=k, loss_fn=F.cross_entropy)
    assert guard is not None and len(guard.snapshots) == 1
    snap = load_snapshot(guard.snapshots[0])
    opened = snap.bytes_read  # the fields read when the file is opened (batch, RNG)
    s = expected_start(bad, k)  # 5
    # the state copy (the model's state and Adam's state tensors, in plain torch) and
    # the three batches (6 x 4 float32 inputs, 6 int64 targets)
    state = [*kept[s]["model"].values()]
    state += [v for e in kept[s]["opt"]["state"].values() for v in e.values()]
    nbytes = sum(t.numel() * t.element_size() for t in state) + 3 * (6 * 4 * 4 + 6 * 8)
    assert snap.rewind_summary() == (
        f"state at the start of step {s}, steps {s}..{bad} (3; 3 batches stored), "
        f"{fmt_bytes(nbytes)}"
    )
    assert snap.bytes_read == opened  # the summary comes from the header
    assert dict(snapshot_facts(snap))["rewind"] == snap.rewind_summary()
    assert "rewind window: state at the start of step 5" in repr(snap)
    window = snap.rewind
    assert snap.bytes_read > opened
    assert window is not None and window.start_step == s
    assert_state_is(window, kept[s])
    assert [r.step for r in window.steps] == [5, 6, 7]
    assert torch.isnan(window.steps[-1].inputs[0, 0])  # the failing batch, last
    assert torch.equal(window.steps[0].rng.torch_cpu, kept[5]["rng"])
    assert window.nbytes == nbytes


def test_an_older_file_loads_without_a_window(tmp_path):
    _, guard, _ = train(tmp_path, 6, bad=5, rewind=2)
    assert guard is not None
    raw = read_archive(guard.snapshots[0])
    assert raw["rewind"] is not None
    del raw["rewind"]
    raw["version"] = 6
    old = atomic_save(raw, tmp_path / "old.nbsnap")
    snap = load_snapshot(old)
    assert snap.version == 6 and snap.rewind is None and snap.rewind_summary() is None
    assert "rewind" not in dict(snapshot_facts(snap))


def test_without_rewind_the_snapshot_has_no_window(tmp_path):
    _, guard, _ = train(tmp_path, 4, bad=3, rewind=False)
    assert guard is not None and guard.rewind is None and "rewind off" in repr(guard)
    assert load_snapshot(guard.snapshots[0]).rewind is None


def test_a_skipped_step_ends_the_window(tmp_path):
    starts: dict[int, int | None] = {}

    def each(t: int, guard: nbdebug.NaNGuard, kept: dict[int, dict[str, Any]]) -> None:
        assert guard.rewind is not None
        window = guard.rewind.current()
        starts[t] = None if window is None else window.start_step

    train(tmp_path, 9, bad=4, each=each, rewind=3, patience=None)
    # windows from 1 and 4 (step 4 skipped); step 5 has none; the copy after step 5's
    # optimizer step starts the next at 6
    assert starts == {0: None, 1: 1, 2: 1, 3: 1, 4: 4, 5: None, 6: 6, 7: 6, 8: 6}


def test_the_run_is_unchanged(tmp_path):
    plain, _, _ = train(tmp_path / "a", 10, guard=False)
    guarded, guard, _ = train(tmp_path / "b", 10, rewind=2)
    assert guard is not None and guard.rewind is not None and guard.rewind.window is not None
    for (name, a), b in zip(plain.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), name


def test_auto_is_on_when_the_state_fits_the_budget(tmp_path, monkeypatch):
    model = nn.Linear(10, 10)
    opt = torch.optim.Adam(model.parameters())
    # 110 float32 weights, and Adam's two moments of them before its first step
    assert state_estimate(model, opt) == 110 * 4 * 3
    monkeypatch.setattr(keeper_module, "rewind_budget", lambda: 110 * 4 * 3)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path)
    assert guard.rewind is not None and guard.rewind.every == DEFAULT_EVERY
    assert "rewind every 8 steps (~1.3 KiB)" in repr(guard)
    monkeypatch.setattr(keeper_module, "rewind_budget", lambda: 110 * 4 * 3 - 1)
    assert nbdebug.NaNGuard(model, opt, directory=tmp_path).rewind is None
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert state_estimate(model, sgd) == 110 * 4 * 2
    assert nbdebug.NaNGuard(model, directory=tmp_path).rewind is None  # no optimizer


def test_a_large_batch_is_not_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(keeper_module, "BATCH_LIMIT", 6 * 4 * 4 - 1)  # below the inputs
    rec: dict[int, Any] = {}

    def each(t: int, guard: nbdebug.NaNGuard, kept: dict[int, dict[str, Any]]) -> None:
        assert guard.rewind is not None
        window = guard.rewind.current()
        if window is not None:
            rec[t] = window.steps[-1]

    train(tmp_path, 3, each=each, rewind=2)
    assert not rec[2].stored and rec[2].inputs is None and rec[2].target is None
    assert rec[2].lr == [0.005]  # the rest is kept


def test_with_ids_a_large_batch_keeps_only_its_indices(tmp_path, monkeypatch):
    monkeypatch.setattr(keeper_module, "IDS_ONLY_ABOVE", 10)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, rewind=2, spike=False)
    for t in range(3):
        x = torch.randn(3, 4)
        loss = model(x).sum()
        loss.backward()
        assert guard.check(loss, inputs=x, step=t, ids=[3 * t, 3 * t + 1, 3 * t + 2])
        assert guard.rewind is not None
        window = guard.rewind.current()  # before the optimizer step refreshes it
        opt.step()
        opt.zero_grad()
    assert window is not None and [r.step for r in window.steps] == [1, 2]
    assert [r.ids for r in window.steps] == [[3, 4, 5], [6, 7, 8]]
    assert not any(r.stored for r in window.steps)
    assert all(r.inputs is None for r in window.steps)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("always", ValueError, r"rewind must be a number of steps >= 1, 'auto', or "
         r"0/None/False \(off\); got 'always'\."),
        (-1, ValueError, r"got -1\."),
        (2.5, TypeError, r"got float 2\.5\."),
    ],
)  # fmt: skip
def test_a_bad_rewind_option_is_one_sentence(tmp_path, value, error, match):
    with pytest.raises(error, match=match):
        nbdebug.NaNGuard(nn.Linear(2, 2), directory=tmp_path, rewind=value)


def test_rewind_steps_need_the_optimizer(tmp_path):
    with pytest.raises(ValueError, match=r"rewind=3 needs the optimizer .*; got none\."):
        nbdebug.NaNGuard(nn.Linear(2, 2), directory=tmp_path, rewind=3)


def test_the_option_values():
    assert [check_rewind(v) for v in (None, False, 0, True, 5, "auto")] == [
        None, None, None, DEFAULT_EVERY, 5, "auto",
    ]  # fmt: skip


def test_a_lightning_run_keeps_the_window(tmp_path):
    L = pytest.importorskip("lightning", reason="the nbdebug[lightning] extra is not installed")
    from nbdebug.integrations.lightning import NaNGuardCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(torch.log(x))))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Keep(L.Callback):
        """The hand-kept copy: the state at the start of every training step."""

        def __init__(self) -> None:
            self.kept: dict[int, dict[str, Any]] = {}

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            self.kept[int(trainer.global_step)] = {
                "model": copy.deepcopy(module.state_dict()),
                "opt": copy.deepcopy(trainer.optimizers[0].state_dict()),
                "sched": None,
            }

    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(24, 4, generator=g) + 0.5, torch.randn(24, 1, generator=g)
    x[4 * 4 + 1, 2] = -1.0  # log(-1): NaN at step 4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    cb, keep = NaNGuardCallback(directory=tmp_path, rewind=2, spike=False), Keep()
    L.Trainer(
        max_steps=6,
        callbacks=[cb, keep],
        logger=False,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    ).fit(Tiny(), loader)
    (path,) = cb.guard.snapshots
    window = load_snapshot(path).rewind
    assert window is not None and window.start_step == expected_start(4, 2) == 3
    assert [r.step for r in window.steps] == [3, 4]
    assert_state_is(window, keep.kept[3])
    assert torch.equal(window.steps[-1].inputs, x[16:20])


def test_a_failing_copy_warns_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, rewind=1, spike=False)
    model.state_dict = lambda: {"w": object()}  # type: ignore[assignment,method-assign]
    loss = model(torch.ones(1, 4)).sum()
    loss.backward()
    assert guard.check(loss)
    with pytest.warns(RuntimeWarning, match="rewind window could not copy the training state"):
        opt.step()  # the copy fails inside the step's hook; the step itself is done
    assert guard.rewind is not None and guard.rewind.current() is None
    assert guard.check(model(torch.ones(1, 4)).sum())  # and no copy is armed again


def test_the_hooks_go_with_the_guard(tmp_path):
    import gc

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(opt._optimizer_step_post_hooks)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, rewind=2)
    assert len(opt._optimizer_step_post_hooks) > before
    guard.close()
    del guard
    gc.collect()
    assert len(opt._optimizer_step_post_hooks) == before


def test_state_copy_refills_in_place_and_reallocates_on_a_new_shape():
    from nbdebug.core.guard.statecopy import StateCopy

    copies = StateCopy()
    a, b, c = torch.arange(3.0), torch.ones(2, 2), torch.tensor([7], dtype=torch.int64)
    first = copies.fill([a, b], [c])
    assert [t.tolist() for t in first] == [[0.0, 1.0, 2.0], [[1.0, 1.0], [1.0, 1.0]], [7]]
    assert copies.nbytes == 3 * 4 + 4 * 4 + 8 and copies.allocations == 1
    a.add_(1)  # the copies are copies
    assert first[0].tolist() == [0.0, 1.0, 2.0]
    again = copies.fill([a, b], [c])
    assert all(x is y for x, y in zip(first, again)) and again[0].tolist() == [1.0, 2.0, 3.0]
    copies.fill([a, b.flatten()], [c])  # a shape changed: new buffers
    assert copies.allocations == 2
    copies.wait()  # nothing to wait for on the CPU
    copies.hold()


def test_inspect_shows_the_window_in_one_line(tmp_path, capsys):
    from nbdebug.cli import main

    _, guard, _ = train(tmp_path, 6, bad=5, rewind=4)
    assert guard is not None
    assert main(["inspect", str(guard.snapshots[0]), "--no-replay"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("rewind")]
    # copies after the optimizer steps of steps 0 and 4: the window starts at step 5
    assert len(lines) == 1 and "state at the start of step 5, steps 5..5 (1; 1 batches" in lines[0]


def _spiking_run(tmp_path, steps: int, spiking) -> tuple[Any, list, list]:
    """A steady linear regression under ``NaNGuard(rewind=4)``, its loss shown 1000x on the
    steps where ``spiking(t)``: (the guard, each step's window start, each step's window
    length)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp_path, rewind=4, spike={"z": 6, "window": 16, "warmup": 8}
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    starts, lengths = [], []
    for t in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        shown = loss.detach() * (1000.0 if spiking(t) else 1.0)
        if guard.check(shown, inputs=x, target=y):
            opt.step()
        opt.zero_grad()
        w = guard.rewind.current()
        starts.append(w.start_step if w is not None else None)
        lengths.append(len(w.steps) if w is not None else 0)
    return guard, starts, lengths


def test_a_window_with_a_spike_is_held_so_the_state_stays_from_before_it(tmp_path):
    # a steady loss, then from step 20 on a loss 1000x the usual: every step a spike
    guard, starts, _ = _spiking_run(tmp_path, 30, lambda t: t >= 20)
    flagged = [r["step"] for r in guard.history if r.get("spikes")]
    assert flagged and flagged[0] == 20  # the detector saw the jump (plain arithmetic: 1000x)
    held = starts[20]
    assert held is not None and held <= 20, starts
    # while the spikes go on the window is not refreshed: its state is from before step 20
    assert all(s == held for s in starts[20:]), starts
    assert len(guard.rewind.current().steps) == 30 - held
    guard.close()


def test_a_held_window_is_refreshed_again_once_its_spikes_are_behind_it(tmp_path):
    # three spikes (steps 20-22), then a steady run: the window holding them stays (up to
    # 4 * rewind steps), then the copies go on from after the spikes
    guard, starts, lengths = _spiking_run(tmp_path, 60, lambda t: 20 <= t <= 22)
    assert [r["step"] for r in guard.history if r.get("spikes")] == [20, 21, 22]
    held = starts[20]
    assert held is not None and held <= 20
    assert all(s == held for s in starts[20:30]), starts  # held past the spikes
    assert starts[-1] is not None and starts[-1] > 22, starts  # then refreshed again,
    assert max(lengths[-12:]) <= 4, lengths  # every 4 steps as before the spikes
    guard.close()


def test_auto_refreshes_so_the_copy_costs_a_quarter_percent_of_a_step(tmp_path):
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    auto = nbdebug.NaNGuard(model, opt, directory=tmp_path, rewind="auto").rewind
    fixed = nbdebug.NaNGuard(model, opt, directory=tmp_path, rewind=8).rewind
    assert auto is not None and auto.auto and fixed is not None and not fixed.auto
    auto._step_s = [0.1, 0.1, 0.12, 0.1, 0.09]  # median 0.1 s a step
    auto._adapt(0.01)  # a 10 ms copy: 0.25 % of 0.1 s is 0.25 ms, so every 40 steps
    assert auto.every == 40
    auto._adapt(1e-5)  # a cheap copy: never below the default
    assert auto.every == keeper_module.DEFAULT_EVERY
    auto._adapt(10.0)  # a very dear one: never above the cap
    assert auto.every == keeper_module.MAX_EVERY
    auto.close()
    fixed.close()
