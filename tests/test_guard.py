"""core.guard: NaNGuard in real training loops, its actions, the GradScaler rules, the
context-manager and decorator forms, and replay of the snapshots it writes."""

from __future__ import annotations

import copy
import math
import pickle
import random
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import nbdebug
from nbdebug import NaNGuard
from nbdebug.core import guard as guardmod
from nbdebug.core.guard import NonFiniteError, last_error
from nbdebug.core.snapshot import load_snapshot

mse = nn.functional.mse_loss


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g) * 3
    y = x @ torch.randn(8, 1, generator=g) * 5
    return x, y


def _batches(x: torch.Tensor, y: torch.Tensor, bs: int = 16):
    step = 0
    while True:
        i = (step * bs) % len(x)
        yield step, x[i : i + bs], y[i : i + bs]
        step += 1


def _bad(model: nn.Module, loss: torch.Tensor) -> bool:
    tensors = (
        [loss]
        + [p for p in model.parameters()]
        + [p.grad for p in model.parameters() if p.grad is not None]
    )
    return not all(bool(torch.isfinite(t).all()) for t in tensors)


def _linear(model: nn.Module, name: str) -> nn.Linear:
    m = model.get_submodule(name)
    assert isinstance(m, nn.Linear)
    return m


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _origin_key(tr) -> tuple:
    o = tr.origin
    assert o is not None, tr
    return (o.phase, o.module, o.kind, o.name, o.samples, o.param, o.op)


# --------------------------------------------------------------------------- end to end


def test_divergence_end_to_end(tmp_path):
    """A learning rate that makes training diverge: the guard fires at the first bad step,
    the snapshot replays to the origin a direct trace finds, and skipping keeps the weights."""
    x, y = _data()
    torch.manual_seed(0)
    init = _mlp()

    # oracle: the same run without a guard; find the first non-finite step by brute force
    oracle = copy.deepcopy(init)
    opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    first_bad = None
    for step, xb, yb in _batches(x, y):
        snapshot_of_oracle = copy.deepcopy(oracle)
        loss = mse(oracle(xb), yb)
        loss.backward()
        if _bad(oracle, loss):
            first_bad, bad_batch, bad_model = step, (xb, yb), snapshot_of_oracle
            break
        opt.step()
        opt.zero_grad()
        assert step < 200, "the oracle run did not diverge"
    assert first_bad is not None and first_bad > 3

    # guarded run
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # the NaN path alone: the spike detector (on by default) would also snapshot the
    # growing loss before the NaN (tests/test_spike.py)
    guard = NaNGuard(
        model, opt, directory=tmp_path / "snaps", loss_fn=mse, patience=None, spike=False
    )
    for step, xb, yb in _batches(x, y):
        loss = mse(model(xb), yb)
        loss.backward()
        before = _state(model)
        ok = guard.check(loss, inputs=xb, target=yb, step=step)
        if ok:
            opt.step()
        opt.zero_grad()
        if not ok:
            break
    assert step == first_bad and guard.ok is False
    # skip: the weights after the bad step are those before it (and the oracle's)
    assert _same_state(_state(model), before)
    assert _same_state(before, _state(bad_model))
    assert all(p.grad is None for p in model.parameters())

    # exactly one snapshot, named after the step, holding that step's batch and weights
    assert [p.name for p in guard.snapshots] == [f"step-{first_bad:09d}.nbsnap"]
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [
        f"step-{first_bad:09d}.nbsnap"
    ]
    snap = nbdebug.load_snapshot(guard.snapshots[0], _mlp)
    assert snap.step == first_bad and snap.reason["kind"] in ("loss", "grad")
    assert torch.equal(snap.inputs, bad_batch[0]) and torch.equal(snap.target, bad_batch[1])
    assert _same_state(snap.model_state, before)
    h = snap.history_frame()
    assert h["step"].tolist() == list(range(first_bad + 1))
    assert bool(h["skipped"].iloc[-1]) and not h["skipped"].iloc[:-1].any()
    assert h["loss"].iloc[:-1].map(math.isfinite).all() and not math.isfinite(h["loss"].iloc[-1])
    assert h["lr"].eq(0.5).all()

    # replay reproduces the origin that tracing the oracle's model on that batch finds
    replay = snap.trace()
    direct = nbdebug.trace(bad_model, bad_batch[0], target=bad_batch[1], loss_fn=mse)
    assert _origin_key(replay) == _origin_key(direct)
    assert replay.loss is not None and direct.loss is not None
    assert replay.loss == direct.loss or (math.isnan(replay.loss) and math.isnan(direct.loss))


def test_nan_in_the_batch_replays_to_the_input(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = NaNGuard(model, opt, directory=tmp_path, loss_fn=mse)
    x, y = _data(64)
    for step, xb, yb in _batches(x, y):
        if step == 2:
            xb = xb.clone()
            xb[3, 5] = float("nan")
            xb[11, 0] = float("nan")
        loss = mse(model(xb), yb)
        loss.backward()
        ok = guard.check(loss, inputs=xb, target=yb, step=step)
        if ok:
            opt.step()
        opt.zero_grad()
        if step == 2:
            break
    assert not ok and len(guard.snapshots) == 1
    snap = load_snapshot(guard.snapshots[0], model)
    assert snap.reason["kind"] == "loss"
    assert set(snap.reason["nonfinite_grads"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    tr = snap.trace()
    assert tr.origin is not None and tr.origin.phase == "input" and tr.origin.samples == [3, 11]
    assert _origin_key(tr) == _origin_key(
        nbdebug.trace(model, snap.inputs, target=snap.target, loss_fn=mse)
    )


def test_corrupted_weight_is_named_and_replays(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    guard = NaNGuard(model, directory=tmp_path, loss_fn=mse)
    x, y = _data(16)
    with torch.no_grad():
        _linear(model, "2").weight[0, 7] = float("inf")
    loss = mse(model(x), y)
    loss.backward()
    assert guard.check(loss, inputs=x, target=y, step=40) is False
    snap = load_snapshot(guard.snapshots[0], _mlp)
    assert snap.reason["kind"] == "weights"
    assert snap.reason["nonfinite_weights"] == {"2.weight": {"nan": 0, "inf": 1}}
    assert snap.reason["message"] == "non-finite weights at step 40: 2.weight (0 NaN, 1 Inf)"
    tr = snap.trace()
    assert tr.origin is not None and tr.origin.module == "2" and tr.origin.param == "2.weight", tr
    assert _origin_key(tr) == _origin_key(nbdebug.trace(model, x, target=y, loss_fn=mse))


# --------------------------------------------------------------------------- actions


def _bad_step(model: nn.Module, guard: NaNGuard, step: int, *, bad: bool = True) -> bool:
    x = torch.randn(4, 8)
    if bad:
        x[1, 2] = float("nan")
    loss = mse(model(x), torch.zeros(4, 1))
    loss.backward()
    return guard.check(loss, inputs=x, target=torch.zeros(4, 1), step=step)


def _bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("action", ["skip", "continue"])
def test_a_skipped_step_puts_back_the_batchnorm_statistics_its_forward_wrote(tmp_path, action):
    """A NaN batch writes NaN into BatchNorm's running statistics during the forward, before
    the guard sees the loss: a skipped step puts them back, and the snapshot holds them as
    they were at the start of the step (so the replay does not blame earlier weights)."""
    model = _bn_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = NaNGuard(
        model, opt, directory=tmp_path, on_nonfinite=action, loss_fn=nn.functional.cross_entropy
    )
    torch.manual_seed(1)
    for step in range(5):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        if step == 3:
            x[4, 1] = float("nan")
            before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("1.")}
        with guard.step(x, y) as s:
            s.loss = nn.functional.cross_entropy(model(x), y)
            s.loss.backward()
        assert s.ok == (step != 3)
        if step == 3:
            after = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("1.")}
    bn = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    if action == "skip":
        assert all(torch.equal(before[k], after[k]) for k in bn)  # as if the batch never came
    else:  # the step was not skipped: what it wrote stays
        assert torch.isnan(after["1.running_mean"]).all() and after["1.num_batches_tracked"] == 4
    [path] = guard.writer.paths
    snap = load_snapshot(path, _bn_net)
    assert snap.reason["buffers_written"] == bn
    assert snap.reason["buffers_restored"] == (action == "skip")
    saved = snap.model.state_dict()
    assert all(torch.equal(saved[k], before[k]) for k in bn)
    d = nbdebug.diagnose(snap, progress=False)
    assert d.cause.kind == "drop_rows" and d.cause.rows == [4] and d.cause.finite


def test_skip_clears_grads_so_even_an_unconditional_step_keeps_weights(tmp_path):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    guard = NaNGuard(model, opt, directory=tmp_path)
    before = _state(model)
    assert _bad_step(model, guard, 0) is False
    opt.step()  # the user ignored the answer
    assert _same_state(_state(model), before)
    assert opt.state_dict()["state"] == {}  # Adam never saw the step


def test_patience_raise_and_continue(tmp_path):
    model = _mlp()
    guard = NaNGuard(model, directory=tmp_path / "a", patience=2)
    assert _bad_step(model, guard, 10) is False
    assert _bad_step(model, guard, 11) is False
    assert _bad_step(model, guard, 12, bad=False) is True  # streak broken
    assert _bad_step(model, guard, 13) is False
    assert _bad_step(model, guard, 14) is False
    with pytest.raises(NonFiniteError) as info:
        _bad_step(model, guard, 15)
    err = info.value
    assert (
        err.step == 13
        and err.path == guard.snapshots[2]
        and err.path.name == "step-000000013.nbsnap"
    )
    assert err.reason["kind"] == "loss" and "3 non-finite steps in a row (patience=2)" in str(err)
    assert last_error() is err and guardmod.last_error() is err
    assert len(guard.snapshots) == 5 and all(p.is_file() for p in guard.snapshots)
    assert [h["nonfinite"] for h in guard.history] == ["loss", "loss", None, "loss", "loss", "loss"]
    back = pickle.loads(pickle.dumps(err))
    assert (back.step, back.path, str(back)) == (err.step, err.path, str(err))

    # "raise": at once, gradients cleared, the snapshot on the error
    model = _mlp()
    guard = NaNGuard(model, directory=tmp_path / "b", on_nonfinite="raise")
    with pytest.raises(
        NonFiniteError,
        match=r"non-finite loss \(nan\) at step 3; non-finite gradients in 0.weight \(256 "
        r"NaN, 0 Inf\), .*Snapshot: .*step-000000003.nbsnap",
    ) as info:
        _bad_step(model, guard, 3)
    assert info.value.path == tmp_path / "b" / "step-000000003.nbsnap" and info.value.path.is_file()  # type: ignore[union-attr]
    assert all(p.grad is None for p in model.parameters())

    # "continue": only records; gradients left for inspection; never raises with patience=None
    model = _mlp()
    guard = NaNGuard(
        model, directory=tmp_path / "c", on_nonfinite="continue", patience=None, max_snapshots=2
    )
    for s in range(4):
        assert _bad_step(model, guard, s) is False
    assert all(p.grad is not None for p in model.parameters())
    assert len(guard.snapshots) == 2 and len(list((tmp_path / "c").iterdir())) == 2  # capped
    assert [h["skipped"] for h in guard.history] == [False] * 4


def test_history_is_measured_right(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NaNGuard(model, opt, directory=tmp_path, history=3, param_norm_every=1)
    x, y = _data(64)
    expected = []
    for step, xb, yb in _batches(x, y):
        loss = mse(model(xb), yb)
        loss.backward()
        grads = torch.cat([_grad(p).reshape(-1) for p in model.parameters()])
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        expected.append((step * 10, loss.item(), grads.norm().item(), params.norm().item()))
        assert guard.check(loss, inputs=xb, target=yb, step=step * 10)
        opt.step()
        opt.zero_grad()
        if step == 4:
            break
    assert len(guard.history) == 3  # rolling
    for row, (s, lv, gn, pn) in zip(guard.history, expected[-3:]):
        assert row["step"] == s and row["loss"] == pytest.approx(lv, rel=1e-6)
        assert row["grad_norm"] == pytest.approx(gn, rel=1e-5) and row[
            "param_norm"
        ] == pytest.approx(pn, rel=1e-5)
        assert row["lr"] == 0.01 and row["scale"] is None and row["skipped"] is False
    df = guard.history_frame()
    assert df["step"].tolist() == [20, 30, 40] and not guard.snapshots
    # the next step number defaults to one more than the last
    loss = mse(model(x[:4]), y[:4])
    loss.backward()
    guard.check(loss)
    assert guard.history[-1]["step"] == 41


def test_param_norm_cadence_and_bad_steps_measure_it(tmp_path):
    model = _mlp()
    guard = NaNGuard(model, directory=tmp_path, param_norm_every=3, patience=None)
    for s in range(7):
        _bad_step(model, guard, s, bad=s == 4)
        model.zero_grad()
    measured = [h["param_norm"] is not None for h in guard.history]
    # checks 0, 3, 6 by cadence, and the bad step 4
    assert measured == [True, False, False, True, True, False, True]
    total = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm().item()
    assert guard.history[4]["param_norm"] == pytest.approx(total, rel=1e-6)
    with pytest.raises(ValueError, match="param_norm_every must be a positive int"):
        NaNGuard(model, param_norm_every=0)


class _Count(TorchFunctionMode):
    READS: ClassVar[set[str]] = {
        "item",
        "tolist",
        "__bool__",
        "__float__",
        "__int__",
        "numpy",
        "cpu",
        "__index__",
    }

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name != "__get__":  # attribute reads such as p.grad
            self.ops.append(name)
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class _KernelCalls:
    """The compiled kernel's module with its calls counted (by name)."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


#: the kernel calls and foreach ops of checks 0 and 1 (the parameters are measured every
#: 10th check): the gradients' norms, the weights' norms, the update ratio's copy and update
FUSED = {
    # the default: the update ratio measures against the rewind window's copy (none yet)
    ("compiled", "auto"): ([["moments_many", "moments_many"], ["moments_many"]], {}),
    ("eager", "auto"): ([[], []], {"_foreach_norm": (2, 1)}),
    # its own copy: copied with the weights' norms in one pass, the update read at check 1
    ("compiled", 10): ([["moments_many", "copy_sq_many"], ["diff_sq_many", "moments_many"]], {}),
    ("eager", 10): (
        [[], []],
        {"_foreach_norm": (2, 2), "_foreach_copy_": (1, 0), "_foreach_sub_": (0, 1)},
    ),
}


@pytest.mark.parametrize(("engine", "every"), list(FUSED))
def test_one_fused_host_read_per_healthy_step(tmp_path, monkeypatch, engine, every):
    from nbdebug.core import kernels

    module = kernels.compiled()
    if engine == "compiled" and module is None:
        pytest.skip("the compiled kernel is not built here (make setup builds it)")
    counted = _KernelCalls(module)
    monkeypatch.setattr(kernels, "compiled", lambda: counted if engine == "compiled" else None)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])  # 24 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NaNGuard(model, opt, directory=tmp_path, signals={"update_every": every})
    loss = model(torch.randn(4, 16)).pow(2).mean()
    loss.backward()
    calls, ops = FUSED[engine, every]
    for step in (0, 1):
        counted.calls.clear()
        with _Count() as c:
            assert guard.check(loss, step=step)
        # not one read per parameter: on the CPU, where a read costs no synchronisation,
        # the loss is read at once (item) and the kernel's sums of squares of the
        # gradients (and at check 0 of the weights) are the host's (numpy); the device
        # values left (the update ratio's copy and update) are read together (tolist);
        # without the kernel every norm is among those
        if engine == "eager":
            expected = ["item", "tolist"]
        elif every == 10:
            expected = ["item", "numpy", "tolist"]
        else:
            expected = ["item", "numpy"] + ["numpy"] * (step == 0)
        assert c.reads == expected, c.reads
        steady = [op for op in c.ops if op != "empty_like"]  # the copy's buffer, made once
        assert len(steady) < 20, c.ops  # fused: no op per parameter
        assert counted.calls == calls[step], counted.calls
        for op, counts in ops.items():
            assert c.ops.count(op) == counts[step], (op, c.ops)
        if engine == "compiled":
            assert "_foreach_norm" not in c.ops


def test_healthy_check_changes_nothing(tmp_path):
    model = _mlp()
    model.eval()
    x, y = _data(8)
    mse(model(x), y).backward()
    grads = {n: _grad(p).clone() for n, p in model.named_parameters()}
    before = _state(model)
    versions = [p._version for p in model.parameters()]
    rng = torch.get_rng_state()
    guard = NaNGuard(model, directory=tmp_path / "never")
    assert guard.check(mse(model(x), y).detach(), inputs=x, target=y)
    assert _same_state(before, _state(model)) and versions == [
        p._version for p in model.parameters()
    ]
    assert all(torch.equal(grads[n], _grad(p)) for n, p in model.named_parameters())
    assert not model.training and torch.equal(rng, torch.get_rng_state())
    assert not (tmp_path / "never").exists()  # the directory appears with the first snapshot


# --------------------------------------------------------------------------- GradScaler


def test_gradscaler_overflow_is_not_a_failure_until_the_scale_collapses(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = NaNGuard(
        model, opt, scaler=scaler, directory=tmp_path, scaler_patience=4, patience=None
    )
    x, y = _data(16)

    def step(i: int, overflow: bool) -> bool:
        loss = mse(model(x), y)
        scaler.scale(loss).backward()
        if overflow:
            _grad(_linear(model, "0").weight)[0, 0] = float("inf")
        ok = guard.check(loss, inputs=x, target=y, step=i)
        if ok:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        return ok

    twin = copy.deepcopy(model)
    mse(twin(x), y).backward()
    unscaled = torch.cat([_grad(p).reshape(-1) for p in twin.parameters()]).norm().item()
    assert step(0, False)
    row = guard.history[-1]
    # recorded unscaled, with the scale of that step
    assert row["scale"] == 2.0**10 and row["grad_norm"] == pytest.approx(unscaled, rel=1e-4)
    before = _state(model)
    for i in range(1, 4):  # three overflows: the scaler skips them, the guard lets it
        assert step(i, True)
        assert guard.history[-1]["skipped"] is True and guard.history[-1]["nonfinite"] is None
    assert _same_state(before, _state(model)) and scaler.get_scale() == 2.0**7
    assert not guard.snapshots
    assert step(4, True) is False  # the fourth in a row: the scale is collapsing
    snap = load_snapshot(guard.snapshots[0], _mlp)
    assert snap.reason["kind"] == "scale" and "4 overflow steps in a row" in snap.reason["message"]
    assert snap.scaler_state is not None and snap.scaler_state["scale"] == 2.0**7
    assert snap.history_frame()["scale"].tolist() == [2.0**10, 2.0**10, 2.0**9, 2.0**8, 2.0**7]

    # a scale below min_scale is a failure too
    scaler2 = torch.amp.GradScaler("cpu", init_scale=0.5)
    guard2 = NaNGuard(model, opt, scaler=scaler2, directory=tmp_path / "low", min_scale=1.0)
    loss = mse(model(x), y)
    scaler2.scale(loss).backward()
    assert guard2.check(loss, step=0) is False
    reason = load_snapshot(guard2.snapshots[0]).reason
    assert (
        reason["kind"] == "scale" and "the scale fell to 0.5 (< min_scale=1)" in reason["message"]
    )


def test_gradscaler_nan_loss_is_a_failure(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    guard = NaNGuard(model, opt, scaler=scaler, directory=tmp_path)
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    loss = mse(model(x), torch.zeros(4, 1))
    scaler.scale(loss).backward()
    assert guard.check(loss, inputs=x, step=0) is False
    assert load_snapshot(guard.snapshots[0]).reason["kind"] == "loss"


# --------------------------------------------------------------------------- other forms


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.fc(x))))


def test_context_manager_steps_when_finite_and_replays_the_dropout(tmp_path):
    torch.manual_seed(0)
    model = Dropper()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NaNGuard(model, opt, directory=tmp_path, loss_fn=mse)
    x, y = _data(16)
    before = _state(model)
    with guard.step(x, y, step=0) as s:
        s.loss = mse(model(x), y)
        s.loss.backward()
    assert s.ok is True and not _same_state(before, _state(model))  # stepped
    assert all(p.grad is None for p in model.parameters())  # and zeroed

    xb = x.clone()
    xb[:, 0] = 1e30  # finite input, overflows to inf inside fc -> relu -> dropout -> out
    before = _state(model)
    with guard.step(xb, y, step=1) as s:
        s.loss = mse(model(xb), y)
        s.loss.backward()
        recorded = s.loss.item()
    assert s.ok is False and _same_state(before, _state(model))
    assert "ok=False" in repr(s)
    # the replay draws the same dropout mask: same loss as the failing step
    snap = load_snapshot(guard.snapshots[0], Dropper)
    tr = snap.trace()
    assert tr.loss == recorded or (math.isnan(tr.loss) and math.isnan(recorded))
    h = snap.history_frame()
    assert h["step"].tolist() == [0, 1] and h["skipped"].tolist() == [False, True]

    with pytest.raises(ValueError, match=r"set s\.loss"), guard.step(x, y) as s:
        pass
    with pytest.raises(RuntimeError, match="boom"), guard.step(x, y) as s:
        raise RuntimeError("boom")  # an error in the block propagates, nothing is checked


def test_decorated_step_function(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NaNGuard(model, opt, directory=tmp_path)

    @guard.wrap
    def train_step(batch, labels):
        loss = mse(model(batch), labels)
        loss.backward()
        return loss, "extra"

    x, y = _data(16)
    out = train_step(x, y)
    assert out[1] == "extra" and guard.ok is True
    xb = x.clone()
    xb[5] = float("nan")
    train_step(labels=y, batch=xb)
    assert guard.ok is False and train_step.__name__ == "train_step"
    snap = load_snapshot(guard.snapshots[0])
    torch.testing.assert_close(snap.inputs, xb, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(snap.target, y) and snap.step == 1

    @guard.wrap(inputs="b", target=None)
    def other(a, b):
        loss = model(b).pow(2).mean()
        loss.backward()
        return loss

    other(0, x)
    assert guard.ok is True and guard.history[-1]["step"] == 2


def test_recipe_and_loss_stored_for_replay(tmp_path):
    model = nn.Linear(8, 1)
    guard = NaNGuard(
        model,
        directory=tmp_path,
        loss_fn=nn.MSELoss(reduction="sum"),
        recipe="torch.nn:Linear",
        recipe_kwargs={"in_features": 8, "out_features": 1},
    )
    x = torch.randn(4, 8)
    x[2, 2] = float("inf")
    y = torch.zeros(4, 1)
    loss = nn.MSELoss(reduction="sum")(model(x), y)
    loss.backward()
    assert not guard.check(loss, inputs=x, target=y)
    snap = load_snapshot(guard.snapshots[0], trust_recipe=True)
    assert isinstance(snap.model, nn.Linear) and snap.model is not model
    assert (
        snap.loss_fn_spec is not None
        and snap.loss_fn_spec["name"] == "torch.nn.modules.loss:MSELoss"
    )
    tr = snap.trace()  # no arguments: model from the recipe, loss from its import path
    assert tr.origin is not None and tr.origin.phase == "input" and tr.origin.samples == [2]
    assert not math.isfinite(tr.loss)


def test_bad_arguments(tmp_path):
    model = _mlp()
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        NaNGuard("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer must be"):
        NaNGuard(model, "adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        NaNGuard(model, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="patience must be"):
        NaNGuard(model, patience=-1)
    with pytest.raises(ValueError, match="history must be"):
        NaNGuard(model, history=0)
    with pytest.raises(ValueError, match="recipe must be an import path"):
        NaNGuard(model, recipe="my model")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ValueError, match=r"directory must be a directory .* is an existing file"):
        NaNGuard(model, directory=afile)
    with pytest.raises(ValueError, match=r"directory must be a directory .* is under .*afile, a"):
        NaNGuard(model, directory=afile / "snaps")
    assert afile.read_text() == "mine"
    guard = NaNGuard(model, directory=tmp_path)
    with pytest.raises(ValueError, match=r"loss must be a scalar; got a tensor of shape \(4, 1\)"):
        guard.check(torch.zeros(4, 1))
    with pytest.raises(TypeError, match="loss must be a scalar tensor, a float or None"):
        guard.check("0.3")
    assert nbdebug.NaNGuard is NaNGuard and nbdebug.NonFiniteError is NonFiniteError
    assert "NaNGuard(Sequential" in repr(guard)


def test_half_sparse_and_grouped_norms(tmp_path):
    """fp16 gradients whose norm overflows fp16, sparse embedding gradients, and the
    per-device grouping path give the exact total norm."""
    model = nn.Sequential(nn.Linear(4, 4).half(), nn.Linear(4, 2))
    guard = NaNGuard(model, directory=tmp_path)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1000.0)  # the squares (1e6) overflow fp16: summed in float32
    assert guard.check(torch.tensor(1.0))
    assert guard.history[-1]["grad_norm"] == pytest.approx(1000.0 * math.sqrt(30), rel=1e-6)
    guard._one_device = False  # the path taken when parameters live on several devices
    assert guard.check(torch.tensor(1.0))
    assert guard.history[-1]["grad_norm"] == pytest.approx(1000.0 * math.sqrt(30), rel=1e-6)
    assert not guard.snapshots

    emb = nn.Embedding(10, 3, sparse=True)
    g2 = NaNGuard(emb, directory=tmp_path / "e")
    emb(torch.tensor([1, 2, 2])).sum().backward()
    assert _grad(emb.weight).is_sparse
    assert g2.check(torch.tensor(0.5))
    assert g2.history[-1]["grad_norm"] == pytest.approx(
        _grad(emb.weight).to_dense().norm().item(), rel=1e-6
    )


# --------------------------------------------------------------------------- collaborators
class _Recorder(guardmod.StepChecks):
    """A StepChecks double: records what the guard hands it, adds one field to the row."""

    def __init__(self) -> None:
        self.calls: list[tuple[guardmod.StepReading, bool]] = []
        self.attached: list[object] = []

    def attach(self, guard):
        self.attached.append(guard)

    def run(self, guard, reading, *, failing):
        self.calls.append((reading, failing))
        return {"seen": reading.step}


def test_core_guard_runs_an_injected_step_checks_object(tmp_path):
    from nbdebug import GuardChecks

    model = _mlp()
    rec = _Recorder()
    guard = guardmod.NaNGuard(model, directory=tmp_path, checks=rec, patience=None)
    assert rec.attached == [guard] and guard.checks is rec
    assert _bad_step(model, guard, 0, bad=False) and _bad_step(model, guard, 1) is False
    (r0, f0), (r1, f1) = rec.calls
    assert (r0.step, f0, r1.step, f1) == (0, False, 1, True)
    assert r0.grad_norm == guard.history[0]["grad_norm"] and math.isnan(r1.loss)
    assert [h["seen"] for h in guard.history] == [0, 1]
    # the health checks from the core import path: a GuardChecks object
    model.zero_grad()
    checked = guardmod.NaNGuard(model, directory=tmp_path, checks=GuardChecks(every=1))
    assert _bad_step(model, checked, 0, bad=False)
    assert checked.history[-1]["checks"] == [] and checked.checks.calls == 1
    # one guard class: checks=True means the health checks whatever the import path
    assert isinstance(guardmod.NaNGuard(model, directory=tmp_path, checks=True).checks, GuardChecks)
    assert guardmod.NaNGuard(model, directory=tmp_path, checks=False).checks is None
    assert nbdebug.NaNGuard is guardmod.NaNGuard
    g = nbdebug.NaNGuard(model, directory=tmp_path, checks={"every": 7, "clip_norm": 2})
    assert (g.checks.every, g.checks.clip_norm) == (7, 2.0)


def test_a_guard_checks_object_serves_one_guard(tmp_path):
    from nbdebug import GuardChecks

    checks = GuardChecks(every=3)
    NaNGuard(_mlp(), directory=tmp_path, checks=checks)
    with pytest.raises(ValueError, match="already serves another NaNGuard"):
        NaNGuard(_mlp(), directory=tmp_path, checks=checks)
    with pytest.raises(ValueError, match=r"checks\['every'\] must be a positive int"):
        GuardChecks(every=0)


def test_measure_step_reads_without_changing_the_guard(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NaNGuard(model, opt, directory=tmp_path)
    x, y = _data(8)
    loss = mse(model(x), y)
    loss.backward()
    reading = guard.measure_step(loss, step=7)
    total = torch.cat([_grad(p).reshape(-1) for p in model.parameters()]).norm().item()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm().item()
    assert reading.step == 7 and reading.loss == pytest.approx(loss.item(), rel=1e-6)
    assert reading.grad_norm == pytest.approx(total, rel=1e-5)
    assert reading.param_norm == pytest.approx(weights, rel=1e-5)
    assert reading.lr == 0.05 and reading.scale is None and reading.finite
    assert guard.measure_step(None, step=8, measure_params=False).param_norm is None
    assert not guard.history and guard.ok is None and guard._next_step == 0
    # the decision on a reading: a finite one goes on; the scaler rules need a scaler
    assert guard.decide(reading).kind is None
    assert guard.agree(reading) is reading  # one process: its own reading


def test_guard_options_are_grouped_and_still_readable(tmp_path):
    guard = NaNGuard(_mlp(), directory=tmp_path, patience=3, on_nonfinite="continue")
    assert guard.options.failure == guardmod.FailureOptions(patience=3, on_nonfinite="continue")
    assert (guard.patience, guard.on_nonfinite, guard.max_snapshots) == (3, "continue", 20)
    assert guard.directory == tmp_path and guard.snapshots is guard.writer.paths
    with pytest.raises(ValueError, match="max_snapshots must be a positive int or None"):
        guardmod.GuardOptions.from_settings(max_snapshots=0)


def test_buffer_copies_follow_a_model_moved_to_another_dtype():
    from nbdebug.core.state import BufferCopies

    model = _bn_net()
    first = BufferCopies.capture(model)
    model.double()  # re-casts every buffer to float64
    again = BufferCopies.capture(model, first)
    copies = {key: saved for _, key, _, saved, _ in again.entries}
    assert copies["running_mean"].dtype == torch.float64
    assert again.written(model) == []
    model[1].running_mean.fill_(float("nan"))
    assert again.written(model) == ["1.running_mean"]
    again.restore()
    assert torch.equal(model[1].running_mean, torch.zeros(16, dtype=torch.float64))


def test_nan_gradients_with_no_loss_given_are_not_called_a_finite_loss(tmp_path) -> None:
    # a trainer callback that cannot see the loss (computed outside the model) passes None
    model = _mlp()
    guard = NaNGuard(model, directory=tmp_path, on_nonfinite="continue")
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    mse(model(x), torch.zeros(4, 1)).backward()
    assert guard.check(None, inputs=x, target=torch.zeros(4, 1), step=2) is False
    text = nbdebug.load_snapshot(guard.snapshots[0], model=_mlp).reason["message"]
    assert text.startswith("non-finite gradients at step 2 with no loss given to the guard: ")
    assert "finite loss" not in text


class PyRandomNet(nn.Module):
    """Draws from Python's and numpy's RNGs in its forward (LayerDrop style)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 1)
        self.draws: list[tuple[float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        u, v = random.random(), float(np.random.rand())
        self.draws.append((u, v))
        return self.b(torch.log(h) if u < 0.5 else h)


def test_the_replay_draws_the_failing_steps_python_and_numpy_numbers(tmp_path) -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(0)
    m = PyRandomNet()
    guard = NaNGuard(m, directory=tmp_path, loss_fn=mse)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    for step in range(20):
        loss = mse(m(x), y)
        loss.backward()
        if not guard.check(loss, inputs=x, target=y, step=step):
            break
        m.zero_grad()
    failing = m.draws[-1]
    assert failing[0] < 0.5  # the log branch made the NaN
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=PyRandomNet)
    tr = snap.trace()
    assert snap.model.draws[0] == failing and tr.origin is not None


def test_a_snapshot_that_cannot_be_written_still_skips_the_step(tmp_path) -> None:
    model, snaps = _mlp(), tmp_path / "snaps"
    guard = NaNGuard(model, directory=snaps, patience=None)
    if snaps.is_dir():
        snaps.rmdir()
    snaps.write_text("a file took the directory's place")  # the disk fails at the bad step
    with pytest.warns(RuntimeWarning, match=r"snapshot of step 1 could not be written .*skip"):
        assert _bad_step(model, guard, 1) is False
    assert all(p.grad is None for p in model.parameters()) and guard.ok is False
    assert guard.snapshots == [] and guard.history[-1]["skipped"] is True


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("scaler_patience", "abc", r"scaler_patience must be a positive int; got 'abc'"),
        ("scaler_patience", -3, r"scaler_patience must be a positive int; got -3"),
        ("min_scale", "low", r"min_scale must be a finite number >= 0; got 'low'"),
        ("min_scale", float("nan"), r"min_scale must be a finite number >= 0; got nan"),
    ],
)
def test_scaler_options_name_themselves(tmp_path, option, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        NaNGuard(_mlp(), directory=tmp_path, **{option: value})


def test_an_error_after_the_snapshot_limit_says_no_snapshot_was_written(tmp_path) -> None:
    model = _mlp()
    guard = NaNGuard(model, directory=tmp_path, on_nonfinite="raise", max_snapshots=1)
    with pytest.raises(NonFiniteError, match=r"Snapshot: .*step-000000001\.nbsnap$"):
        _bad_step(model, guard, 1)
    model.zero_grad()
    assert _bad_step(model, guard, 2, bad=False) is True  # ends the streak
    model.zero_grad()
    with pytest.raises(NonFiniteError, match=r"No snapshot was written \(max_snapshots") as e:
        _bad_step(model, guard, 3)
    assert e.value.path is None and "Snapshot: None" not in str(e.value)


def test_an_optimizer_over_another_model_is_refused_before_anything_is_made(tmp_path):
    model, other = nn.Linear(3, 2), nn.Linear(3, 3)
    hooks = dict(model._forward_hooks)
    with pytest.raises(ValueError, match=r"^the optimizer holds 2 parameter\(s\), none of them"):
        nbdebug.NaNGuard(
            model,
            torch.optim.SGD(other.parameters(), lr=0.1),
            directory=tmp_path / "snaps",
            checks=True,
        )
    assert not (tmp_path / "snaps").exists() and dict(model._forward_hooks) == hooks
    # one parameter outside the model beside the model's own is fine
    temperature = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    assert nbdebug.NaNGuard(model, opt, directory=tmp_path / "snaps").optimizer is opt
