"""Gradients that reach only part of a step: an unused output of a multi-output autograd
node (its gradient is ``None``), a parameter accumulated several times in one backward
(reentrant activation checkpointing), and a target that carries a graph of its own. Each
expected value is computed in plain torch on a copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from state import assert_unchanged, fingerprint
from torch import nn
from torch.utils.checkpoint import checkpoint

import nbdebug


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


# ---------------------------------------------------------------------- unused outputs
class TwoOut(torch.autograd.Function):
    """Two outputs of one node; its backward takes a missing gradient as zero."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> tuple:  # type: ignore[override]
        return x * 2, x * 3

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, ga: torch.Tensor | None, gb: torch.Tensor | None
    ) -> torch.Tensor:  # type: ignore[override]
        return (0 if ga is None else ga * 2) + (0 if gb is None else gb * 3)


class Split(nn.Module):
    """Returns two outputs of one autograd node (``how``), of which the parent uses one.
    ``bad_grad``: its backward makes a NaN (sqrt at 0) though its forward is finite."""

    def __init__(self, how: str, bad_grad: bool = False) -> None:
        super().__init__()
        self.how, self.bad_grad = how, bad_grad

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.bad_grad:
            x = x + torch.sqrt(x * 0)
        if self.how == "chunk":
            return x.chunk(2, dim=1)
        return TwoOut.apply(x)


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN where x < 0


class Uses(nn.Module):
    def __init__(self, how: str, *, bad_grad: bool = False, nan_after: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.split = Split(how, bad_grad)
        self.out = nn.Linear(2 if how == "chunk" else 4, 3)
        self.post = Log() if nan_after else nn.Identity()

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, _unused = self.split(self.inp(x))
        return a, self.post(self.out(a))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts(x)[1]


@pytest.mark.parametrize("how", ["chunk", "function"])
def test_an_unused_output_of_a_multi_output_node_gets_no_gradient_event(how: str) -> None:
    """Autograd calls the hook of the unused output with ``None``: no gradient reached
    it, so no event; the used one's event and the parameters' are plain torch's."""
    torch.manual_seed(0)
    model = Uses(how)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(model)
    a, out = ref.parts(x)
    a.retain_grad()
    loss = F.cross_entropy(out, y)
    loss.backward()
    assert a.grad is not None and ref.inp.weight.grad is not None

    tr = nbdebug.trace(model, x, y, F.cross_entropy)
    assert tr.origin is None and _close(tr.loss, loss.item())
    grads = [e for e in tr.events if e.module == "split" and e.kind == "grad_output"]
    assert [e.name for e in grads] == ["output[0]"]
    assert _close(grads[0].stats.norm, a.grad.norm().item())
    pf = tr.params_frame()
    assert _close(pf.loc["inp.weight", "grad_norm"], ref.inp.weight.grad.norm().item())


@pytest.mark.parametrize("how", ["chunk", "function"])
def test_an_unused_output_in_the_exact_pass(how: str) -> None:
    """A NaN made after the split (log of a negative) runs the exact pass, whose own
    hooks see the ``None`` gradient too: the origin is found, no event for the unused
    output."""
    torch.manual_seed(0)
    model = Uses(how, nan_after=True)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    assert not torch.isfinite(model(x)).all()  # the model does make a NaN
    tr = nbdebug.trace(model, x, y, F.cross_entropy)
    assert tr.origin is not None
    assert (tr.origin.phase, tr.origin.module, tr.origin.op) == ("forward", "post", "torch.log")
    names = [e.name for e in tr.events if e.module == "split" and e.kind == "grad_output"]
    assert names == ["output[0]"]


def test_a_backward_origin_in_a_module_with_an_unused_output() -> None:
    """The NaN is made in the split's own backward (sqrt at 0): the replay that copies
    the gradients reaching its outputs gets ``None`` for the unused one and still names
    the op."""
    torch.manual_seed(0)
    model = Uses("chunk", bad_grad=True)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    assert ref.inp.weight.grad is not None and ref.inp.weight.grad.isnan().all()
    tr = nbdebug.trace(model, x, y, F.cross_entropy)
    assert tr.origin is not None
    assert (tr.origin.phase, tr.origin.module, tr.origin.op) == ("backward", "split", "torch.sqrt")


# ---------------------------------------------------------------------- reentrant checkpoints
class Shared(nn.Module):
    """One block shared by three layers, each under a reentrant checkpoint: the block's
    parameters are accumulated once per layer, in three backward passes."""

    def __init__(self, *, aux_nan: bool = False) -> None:
        super().__init__()
        self.blk = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)
        self.aux = Log() if aux_nan else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.aux is not None:
            self.aux(-x.abs() - 1)  # a NaN the loss does not use: the exact pass runs
        for _ in range(3):
            x = torch.tanh(checkpoint(self.blk, x, use_reentrant=True))
        return self.out(x)


class SharedRaw(nn.Module):
    """A parameter used in three reentrant checkpointed segments of plain code (no
    module called inside them) and once outside (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.out = nn.Linear(4, 3)

    def seg(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = checkpoint(self.seg, x, use_reentrant=True)
        return self.out(x @ self.w.t())


@pytest.mark.parametrize("make", [Shared, SharedRaw, lambda: Shared(aux_nan=True)])
def test_a_parameter_accumulated_in_several_backwards_reports_its_whole_gradient(make) -> None:
    """params_frame's grad_norm and the one param_grad event of each parameter are
    ``p.grad.norm()`` of a plain backward; the input's gradient event is ``x.grad``; the
    user's own ``.grad`` is put back."""
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(5, 4, requires_grad=True), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    F.cross_entropy(ref(xr), y).backward()
    for p in model.parameters():  # the user's gradients of an earlier step
        p.grad = torch.full_like(p, 0.5)
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, y, F.cross_entropy)
    assert_unchanged(before, model)
    assert x.grad is None
    # the aux NaN model: the exact pass gives the events, the origin is the unused log
    assert (tr.origin is not None) == (getattr(model, "aux", None) is not None)
    pf = tr.params_frame()
    for name, p in ref.named_parameters():
        assert p.grad is not None
        assert _close(pf.loc[name, "grad_norm"], p.grad.norm().item()), name
        events = [e for e in tr.events if e.kind == "param_grad" and e.param == name]
        assert len(events) == 1 and _close(events[0].stats.norm, p.grad.norm().item())
    assert xr.grad is not None
    (x_event,) = [e for e in tr.events if e.kind == "grad_input" and e.module == ""]
    assert _close(x_event.stats.norm, xr.grad.norm().item())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(h) + torch.sqrt(h * 0)  # finite forward, NaN gradient


class BadGrad(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blk = Block()
        self.out = nn.Linear(4, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = checkpoint(self.blk, x, use_reentrant=True) if self.reentrant else self.blk(x)
        return self.out(x)


def test_a_backward_origin_under_reentrant_checkpoints_is_the_plain_one() -> None:
    """The exact pass holding gradients places a parameter's event where its gradient
    turned non-finite: the origin is the one found without checkpointing."""
    torch.manual_seed(0)
    plain = BadGrad(reentrant=False)
    ck = copy.deepcopy(plain)
    ck.reentrant = True
    x, y = torch.randn(5, 4, requires_grad=True), torch.randint(0, 3, (5,))
    found = []
    for model in (plain, ck):
        tr = nbdebug.trace(model, x, y, F.cross_entropy)
        assert tr.origin is not None
        found.append((tr.origin.phase, tr.origin.module, tr.origin.op))
        names = [e.param for e in tr.events if e.kind == "param_grad"]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert found[0] == found[1] == ("backward", "blk", "torch.sqrt")


# ---------------------------------------------------------------------- targets with a graph
class LogStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(x))  # NaN where the linear is negative


@pytest.mark.parametrize("student_type", [nn.Linear, LogStudent])
def test_a_target_computed_with_a_graph_is_left_alone(student_type: type) -> None:
    """Distillation without no_grad: the trace's backward stops at the target, so the
    teacher gets no .grad and the graph behind the target is not freed (the exact pass
    of a NaN step runs its backward again)."""
    torch.manual_seed(0)
    teacher = nn.Linear(4, 3)
    student = nn.Linear(4, 3) if student_type is nn.Linear else LogStudent()
    x = torch.randn(5, 4)
    target = teacher(x)
    ref = copy.deepcopy(student)
    plain = F.mse_loss(ref(x), target.detach())
    plain.backward()
    tr = nbdebug.trace(student, x, target, F.mse_loss)
    assert teacher.weight.grad is None and teacher.bias.grad is None
    assert target.grad_fn is not None and target.requires_grad
    if student_type is LogStudent:
        assert tr.origin is not None and tr.origin.op == "torch.log"
    else:
        assert tr.origin is None and _close(tr.loss, plain.item())
        pf = tr.params_frame()
        assert _close(pf.loc["weight", "grad_norm"], ref.weight.grad.norm().item())
    F.mse_loss(student(x), target).backward()  # the user's graph is intact
    assert teacher.weight.grad is not None


def test_a_target_in_a_container_and_a_leaf_target_get_no_gradient() -> None:
    """A dict target holding the teacher's output, and a leaf target that requires grad:
    neither the teacher nor the leaf gets a .grad, and the loss is plain torch's."""
    torch.manual_seed(0)
    teacher, student = nn.Linear(4, 3), nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    soft = torch.rand(5, 3, requires_grad=True)  # a leaf

    def loss_fn(out: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        return (
            F.mse_loss(out, t["teacher"])
            + F.mse_loss(out, t["soft"])
            + F.cross_entropy(out, t["hard"])
        )

    target = {"teacher": teacher(x), "soft": soft, "hard": y}
    plain = loss_fn(student(x), {k: v.detach() for k, v in target.items()})
    tr = nbdebug.trace(student, x, target, loss_fn)
    assert tr.origin is None and _close(tr.loss, plain.item())
    assert teacher.weight.grad is None and soft.grad is None
    assert target["teacher"].grad_fn is not None and target["soft"] is soft
