"""Replays run as the step ran under torch.autocast: the forward and the loss in the
recorded dtype, the backward outside the block unless the step ran it inside (on CPU a
backward inside ``autocast(float16)`` runs its matmuls in float16 too), and the op-level
replay of a module under the autocast state of its call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nbdebug


class HalfSqrt(torch.autograd.Function):
    """sqrt whose backward divides by the output: Inf where the output is 0."""

    @staticmethod
    def forward(ctx, x):
        y = x.clamp_min(0).sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g / (2 * y)


class Act(nn.Module):
    def forward(self, x):
        return HalfSqrt.apply(x)


class Net(nn.Module):
    """``a`` runs in float16 under autocast; the head is kept in float32 (autocast off)
    with a tiny weight and a large input, so its weight gradient overflows float16 only
    when the backward runs inside the block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.act = Act()
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.head.weight.mul_(1e-5)

    def forward(self, x):
        s = self.act(self.a(x))
        with torch.autocast("cpu", enabled=False):
            return self.head(s.float() * 1e5)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _grads_finite(model):
    return {n: bool(torch.isfinite(p.grad).all()) for n, p in model.named_parameters()}


def test_a_step_whose_backward_ran_after_the_autocast_block_replays_its_backward_outside(
    tmp_path,
):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp_path, loss_fn=F.mse_loss, autocast=torch.float16
    )
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    loss.backward()  # after the block, as training loops and trainers do
    real = _grads_finite(model)
    assert real["head.weight"] and not real["a.weight"]  # the step: a's backward made Inf
    assert not guard.check(loss, inputs=x, target=y, step=0)
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=Net)
    assert snap.autocast == {"device_type": "cpu", "dtype": "float16"}
    tr = snap.trace()
    assert (tr.origin.phase, tr.origin.module, tr.origin.op) == (
        "backward",
        "act",
        "HalfSqrt.backward",
    )
    head = {e.param: e.finite for e in tr.events if e.kind == "param_grad" and e.module == "head"}
    assert head == {"head.weight": True, "head.bias": True}  # as in the step
    # diagnose replays it the same way
    dg = nbdebug.diagnose(guard.snapshots[0], model=Net)
    assert (dg.trace.origin.module, dg.trace.origin.op) == ("act", "HalfSqrt.backward")


def test_a_check_inside_the_block_records_that_the_backward_ran_there_and_replays_it_so(
    tmp_path,
):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, loss_fn=F.mse_loss)
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
        loss.backward()  # inside the block: the head's weight gradient overflows too
        assert not _grads_finite(model)["head.weight"]
        assert not guard.check(loss, inputs=x, target=y, step=0)
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=Net)
    assert snap.autocast == {"device_type": "cpu", "dtype": "float16", "backward": True}
    tr = snap.trace()
    head = {e.param: e.finite for e in tr.events if e.kind == "param_grad" and e.module == "head"}
    assert head["head.weight"] is False  # replayed as it ran: inside the block
    assert not torch.is_autocast_enabled("cpu")


def test_the_whole_model_float32_fix_turns_autocast_off_for_the_backward_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = _batch()
    x[3] = 3e4

    def loss_fn(o, t):
        return F.mse_loss(o.float(), t)

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.float16):  # the caller's autocast
        dg = nbdebug.diagnose(model, x, y, loss_fn, optimizer=opt)
    rows = {(r.kind, r.module): r for r in dg.results}
    whole = rows[("float32", "")]
    assert whole.finite and whole.outcome.backward  # float32 throughout, as the fix says
    assert dg.results[0] is whole
    assert all(p.grad is None for p in model.parameters())


class Inner(nn.Module):
    """Enters autocast inside its own forward (as accelerate's wrapped forward does)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = self.a(x)
        return self.b(h.float() - h.float())


def test_the_op_level_replay_runs_a_module_under_the_autocast_state_of_its_call():
    torch.manual_seed(0)
    m = Inner()
    with torch.no_grad():
        m.a.weight.fill_(1.0)
    x = torch.randn(5, 4)
    x[1] = 40000.0  # 160000 > 65504: Inf in float16 only
    tr = nbdebug.trace(m, x, torch.tensor([0, 1, 2, 0, 1]), F.cross_entropy)
    o = tr.origin
    assert (o.module, o.dtype, o.samples) == ("a", "float16", [1])
    assert o.op == "torch.nn.functional.linear"
    assert "inconclusive" not in (o.note or "")


def test_a_parameter_gradient_origin_names_no_batch_rows_even_where_a_weight_size_equals_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # 2.weight: (2, 8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)  # batch of 8
    x[3] = 3e4  # the bad row: its float16 backward overflows in 2.weight's gradient

    def loss_fn(o, t):
        return F.mse_loss(o.float(), t)

    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(model, x, y, loss_fn)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        dg = nbdebug.diagnose(model, x, y, loss_fn, optimizer=opt)
    o = tr.origin
    assert (o.kind, o.param, o.shape) == ("param_grad", "2.weight", (2, 8))
    assert o.samples == []  # not the weight's columns 1 and 5
    assert "rows" not in tr.summary()
    assert all(r.kind != "drop_rows" for r in dg.results)
