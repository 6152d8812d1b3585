"""Origin cases found by probing: a shared module whose *first* call made a parameter's
gradient non-finite, a backward replay that must not ask for gradients the step never
computed, a loss made infinite from an intended mask, a NaN made in the loss's own
backward, and torch functions that ``resolve_name`` cannot name.

Every expectation is worked out in plain torch in the test: :func:`forward_root` and
:func:`backward_root` watch the torch calls of a plain run with a ``TorchFunctionMode``
(and, for the backward, hooks on the autograd nodes those calls made) and report the
first call that made a non-finite value, with the line of this file that called it.
"""

from __future__ import annotations

import copy
import inspect
import os
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from state import assert_unchanged, fingerprint
from torch import nn
from torch.overrides import TorchFunctionMode

import nbdebug
from nbdebug.core.trace.ops import op_name

HERE = os.path.basename(__file__)

#: (name of the torch function, ``test_origin_unseen_cases.py:N`` of its caller here)
Call = tuple[str, str | None]


def _line_here() -> str | None:
    for fr in reversed(traceback.extract_stack()):
        if fr.filename == __file__ and fr.name not in ("_line_here", "__torch_function__"):
            return f"{HERE}:{fr.lineno}"
    return None


def _finite(ts: Sequence[object]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if isinstance(t, torch.Tensor))


def _tensors(out: object) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else [out]
    return [t for t in items if isinstance(t, torch.Tensor)]


class _Calls(TorchFunctionMode):
    """Every top-level torch call: its name, caller line, inputs' and output's finiteness,
    and the autograd node of each output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Call, bool, bool, list[torch.Tensor]]] = []
        self.nodes: dict[object, Call] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name: Call = (getattr(func, "__name__", str(func)), _line_here())
        inputs = [*args, *kwargs.values()]
        outs = _tensors(out)
        self.calls.append((name, _finite(inputs), _finite(outs), inputs))
        for t in outs:
            if t.grad_fn is not None:
                self.nodes.setdefault(t.grad_fn, name)
        return out


def forward_root(run: Callable[[], object]) -> Call | None:
    """The first torch call of ``run()`` (no grad) with finite inputs and a non-finite
    output."""
    with torch.no_grad(), _Calls() as spy:
        run()
    return next((n for n, fin_in, fin_out, _ in spy.calls if fin_in and not fin_out), None)


def backward_root(run: Callable[[], torch.Tensor]) -> Call | None:
    """The forward call whose autograd node, first in the backward of ``run()`` (a scalar
    loss), received finite gradients and sent a non-finite one."""
    with _Calls() as spy:
        loss = run()
    found: list[Call] = []

    def hook(node: object) -> Callable[..., None]:
        def h(grad_inputs: Sequence[object], grad_outputs: Sequence[object]) -> None:
            if not found and _finite(grad_outputs) and not _finite(grad_inputs):
                found.append(spy.nodes[node])

        return h

    handles = [n.register_hook(hook(n)) for n in spy.nodes]  # type: ignore[attr-defined]
    try:
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def base(op: str | None) -> str:
    return (op or "").rsplit(".", 1)[-1]


# ------------------------------------------------------- a module called more than once
class Gated(nn.Module):
    """Uses ``fn(w)`` only in the call whose ``gate`` is true."""

    def __init__(self, w: list[float], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))
        self.fn = fn

    def forward(self, x: torch.Tensor, gate: bool) -> torch.Tensor:
        if gate:
            return x * self.fn(self.w)  # GATED
        return x * 2.0


class Shared(nn.Module):
    def __init__(
        self, w: list[float], fn: Callable[[torch.Tensor], torch.Tensor], gated_call: int
    ) -> None:
        super().__init__()
        self.s = Gated(w, fn)
        self.fc = nn.Linear(3, 3)
        self.gated_call = gated_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            x = self.s(x, i == self.gated_call)
            if i == 0:
                x = self.fc(x)
        return x


def _gated_line() -> str:
    lines, start = inspect.getsourcelines(Gated.forward)
    return f"{HERE}:{start + next(i for i, s in enumerate(lines) if '# GATED' in s)}"


def _shared_case(
    w: list[float], fn: Callable[[torch.Tensor], torch.Tensor], gated_call: int
) -> None:
    torch.manual_seed(0)
    model = Shared(w, fn, gated_call)
    x = torch.rand(4, 3) + 0.5
    plain = copy.deepcopy(model)
    root = backward_root(lambda: plain(x).sum())
    # plain torch: a finite forward; only the weight s.w gets a non-finite gradient,
    # made by ``fn``
    assert torch.isfinite(model(x)).all()
    assert not torch.isfinite(plain.s.w.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in plain.fc.parameters())
    assert root == (fn.__name__, _gated_line())
    before = fingerprint(model)
    o = nbdebug.trace(model, x, loss_fn=lambda out: out.sum()).origin
    assert_unchanged(before, model)
    assert o is not None
    assert (str(o.phase), o.module, o.param) == ("backward", "s", "s.w")
    assert (base(o.op), o.source) == (root[0], root[1])


def test_param_gradient_made_by_the_first_call_of_a_shared_module() -> None:
    _shared_case([1.0, 0.0, 4.0], torch.sqrt, gated_call=0)  # d sqrt(w) / dw at w = 0: inf


def test_param_gradient_made_by_a_middle_call_of_a_shared_module() -> None:
    _shared_case([0.5, 1.0, 0.25], torch.asin, gated_call=1)  # d asin(w) / dw at 1: inf


# ------------------------------------------- no gradient the step did not compute
class Ang(nn.Module):
    """The parent's own code after its child: ``asin`` of 1 has an infinite derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.asin(self.fc(x))


class SqrtMatmul(nn.Module):
    """A leaf module: ``sqrt(x @ w)`` at 0 has an infinite derivative; ``w`` holds a
    zero, so an input gradient (which the batch does not want) would be ``inf * 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[1.0, 1.0], [1.0, -1.0], [1.0, 0.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x @ self.w)


def _no_nan_case(model: nn.Module, x: torch.Tensor) -> nbdebug.Event:
    plain = copy.deepcopy(model)
    root = backward_root(lambda: plain(x).sum())
    grads = [p.grad for p in plain.parameters() if p.grad is not None]
    # plain torch: the step's gradients hold an Inf and no NaN
    assert not _finite(grads) and not any(bool(g.isnan().any()) for g in grads)
    # and asking for the batch's gradient too would have made a NaN
    xs = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(copy.deepcopy(model)(xs).sum(), [xs])
    assert bool(gx.isnan().any())
    assert root is not None
    o = nbdebug.trace(model, x, loss_fn=lambda out: out.sum()).origin
    assert o is not None and str(o.phase) == "backward"
    assert base(o.op) == root[0]
    assert [str(link.value) for link in o.chain] == ["inf"]
    assert "NaN" not in o.note
    return o


def test_backward_replay_of_a_parent_asks_no_gradient_of_the_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Ang(), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].fc.weight.copy_(torch.eye(2))
        model[0].fc.bias.zero_()
    x = torch.rand(3, 2) * 0.5 + 0.1
    x[0, 1] = 1.0
    o = _no_nan_case(model, x)
    assert o.module == "0" and o.samples == [0]


def test_backward_replay_of_a_leaf_with_a_bad_weight_gradient_asks_none_of_the_batch() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 3.0]])  # row 0: sqrt(1 - 1 + 0)
    o = _no_nan_case(nn.Sequential(SqrtMatmul()), x)
    assert o.module == "0" and o.param == "0.w"


# ------------------------------------------------------ a loss made inf by a mask
class MaskedLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        allowed = torch.tensor([True, True, False])
        return self.fc(x).masked_fill(~allowed, float("-inf"))


def nll_by_hand(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(F.log_softmax(out, -1).gather(1, y[:, None])).mean()


def _mask_loss_case(loss_fn: Callable[..., torch.Tensor]) -> tuple[nbdebug.Trace, Call]:
    torch.manual_seed(0)
    model = MaskedLogits()
    x, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])  # row 1's label is masked
    with torch.no_grad():
        out = model(x)
    # plain torch: the model's only non-finite values are the -inf of the masked class,
    # and the loss is inf
    assert torch.isneginf(out[:, 2]).all() and torch.isfinite(out[:, :2]).all()
    assert torch.isinf(loss_fn(out, y))
    # the loss's first call that turned the mask into a non-finite value
    with torch.no_grad(), _Calls() as spy:
        loss_fn(out, y)
    first = next(
        n for n, _, fin_out, ins in spy.calls if not fin_out and any(t is out for t in ins)
    )
    tr = nbdebug.trace(model, x, y, loss_fn)
    assert tr.origin is not None
    assert (str(tr.origin.phase), tr.origin.module) == ("loss", "")
    return tr, first


def test_loss_made_inf_from_an_intended_mask_names_the_loss_op() -> None:
    tr, first = _mask_loss_case(F.cross_entropy)
    assert first[0] == "cross_entropy"
    assert tr.origin is not None and base(tr.origin.op) == "cross_entropy"
    assert any("mask" in n for n in tr.notes)


def test_hand_written_loss_made_inf_from_a_mask_names_its_first_op_on_the_mask() -> None:
    tr, first = _mask_loss_case(nll_by_hand)
    assert tr.origin is not None
    assert (base(tr.origin.op), tr.origin.source) == first == ("log_softmax", first[1])
    assert first[1] is not None and first[1] == line_of(nll_by_hand, "log_softmax")


def line_of(obj: object, text: str) -> str:
    lines, start = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    return f"{HERE}:{start + next(i for i, line in enumerate(lines) if text in line)}"


# ------------------------------------------------------- the loss's own backward
def rmse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(((o - t) ** 2).mean())


def robust(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    d = (o - t).abs()
    return torch.where(d < 1, 0.5 * d**2, torch.sqrt(d)).mean()


class RootAbs(nn.Module):
    """A loss module: ``|d| ** 0.5`` has an infinite derivative at 0."""

    def forward(self, o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (o - t).abs().pow(0.5).mean()


def _loss_backward_case(
    loss_fn: Callable[..., torch.Tensor], rows: Sequence[int], out_dim: int
) -> nbdebug.Event:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, out_dim))
    x = torch.randn(4, 2)
    with torch.no_grad():
        t = model(x) + 5.0
        t[list(rows)] = model(x)[list(rows)]  # perfect predictions in these rows
    plain = copy.deepcopy(model)
    root = backward_root(lambda: loss_fn(plain(x), t))
    # plain torch: a finite loss whose backward made the gradient of the model's output
    # non-finite (every parameter gradient then follows)
    assert torch.isfinite(loss_fn(plain(x), t))
    assert root is not None
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, t, loss_fn)
    assert_unchanged(before, model)
    o = tr.origin
    assert o is not None
    assert (str(o.phase), o.module) == ("backward", "")
    assert (base(o.op), o.source) == root
    assert "loss's backward" in o.note
    return o


def test_nan_made_in_the_loss_backward_names_the_loss_op() -> None:
    o = _loss_backward_case(rmse, rows=[0, 1, 2, 3], out_dim=2)
    # sqrt's derivative at 0 is inf; the backward of ``** 2`` multiplies it by d = 0
    assert (str(o.chain[0].value), str(o.chain[-1].value)) == ("inf", "NaN")


def test_hidden_nan_of_a_where_in_the_loss_names_the_unselected_branch() -> None:
    o = _loss_backward_case(robust, rows=[2], out_dim=1)
    assert o.samples == [2]
    assert "hidden NaN" in o.note


def test_nan_made_in_the_backward_of_a_loss_module() -> None:
    o = _loss_backward_case(RootAbs(), rows=[1, 3], out_dim=1)
    assert o.samples == [1, 3]


# --------------------------------------------------- torch functions resolve_name misses
def test_torch_functions_resolve_name_cannot_name_get_their_public_name() -> None:
    for func in (torch._weight_norm, torch._cast_Half):
        assert torch.overrides.resolve_name(func) is None  # what this test is about
        assert getattr(torch, func.__name__) is func
        assert op_name(func) == f"torch.{func.__name__}"
    assert op_name(torch.sqrt) == "torch.sqrt"


def test_weight_norm_origin_names_torch_weight_norm_and_the_torch_line() -> None:
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(3, 2)), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].parametrizations.weight.original1[1].zero_()  # 0 / ||0||: NaN
    x = torch.randn(5, 3)
    # plain torch: torch._weight_norm is the first call with finite inputs and NaN out
    with torch.no_grad(), _Calls() as spy:
        model(x)
    names = [n[0] for n, fin_in, fin_out, _ in spy.calls if fin_in and not fin_out]
    assert names[:1] == ["_weight_norm"]
    # torch's line that ran it: only torch's code called it
    lines, start = inspect.getsourcelines(parametrizations._WeightNorm.forward)
    line = start + next(i for i, s in enumerate(lines) if "_weight_norm(" in s)
    o = nbdebug.trace(model, x, loss_fn=lambda out: out.sum()).origin
    assert o is not None and str(o.phase) == "forward"
    assert o.op == "torch._weight_norm"
    assert o.source == f"torch/nn/utils/parametrizations.py:{line}"


class ToHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._cast_Half(x).float()  # TO_HALF: 1e5 overflows float16


def test_an_internal_torch_function_root_gets_its_torch_name_and_user_line() -> None:
    model = nn.Sequential(nn.Linear(2, 2), ToHalf())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 2.0], [1e5, 1.0]])
    root = forward_root(lambda: model(x))
    assert root == ("_cast_Half", line_of(ToHalf.forward, "TO_HALF"))
    o = nbdebug.trace(model, x, loss_fn=lambda out: out.sum()).origin
    assert o is not None
    assert (str(o.phase), o.module, o.samples) == ("forward", "1", [1])
    assert (o.op, o.source) == ("torch._cast_Half", root[1])
