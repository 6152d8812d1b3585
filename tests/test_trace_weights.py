"""The weights' health in ``nbdebug.trace`` (``core/trace/weights.py``): the norms of the
parameters and floating buffers the step started with, their NaN/Inf counts, and a NaN/Inf
weight sending the step straight to the exact pass, wherever the weight is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.core.trace.weights import WeightHealth, owned_weights


class Net(nn.Module):
    """A BatchNorm that updates its buffers in the forward, a tied weight, an unused
    parameter and a late layer whose calls are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.mid = nn.Linear(8, 8)
        self.tied = nn.Linear(8, 8)
        self.tied.weight = self.mid.weight
        self.out = nn.Linear(8, 1)
        self.unused = nn.Linear(3, 3)
        self.calls = 0
        self.out.register_forward_pre_hook(lambda m, a: setattr(self, "calls", self.calls + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.inp(x)))
        return self.out(torch.tanh(self.tied(self.mid(h))))


def _net() -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().train()
    with torch.no_grad():
        model.bn.running_mean.uniform_(1.0, 2.0)
    return model, torch.randn(6, 5), torch.randn(6, 1)


def _norms_before(model: nn.Module) -> dict[str, float]:
    out = {n: float(p.detach().double().norm()) for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("modules", [None, "out", "bn"])
def test_weight_norms_are_those_the_step_started_with(modules: str | None) -> None:
    model, x, y = _net()
    want = _norms_before(model)
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, y, F.mse_loss, modules=modules)
    assert_unchanged(before, model)  # the BatchNorm's running stats are put back too
    assert tr.origin is None and tr.healthy
    pf = tr.params_frame()
    assert set(pf.index) == set(want)  # the tied weight once, the unused layer too
    for name, norm in want.items():
        assert pf.loc[name, "norm"] == pytest.approx(norm, rel=1e-6), name
    assert model.calls == 1  # one quick pass


def test_a_nan_weight_skips_the_quick_pass() -> None:
    model, x, y = _net()
    with torch.no_grad():
        model.out.weight[0, 3] = float("nan")
    calls: list[str] = []  # completed calls, in order
    for name in ("inp", "mid", "out"):
        getattr(model, name).register_forward_hook(lambda m, a, o, n=name: calls.append(n))
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, y, F.mse_loss)
    assert_unchanged(before, model)
    assert tr.origin is not None
    assert (tr.origin.module, tr.origin.param) == ("out", "out.weight")
    assert tr.origin.corrupted
    # the exact pass is the first pass (then the origin's replays)
    assert calls[:3] == ["inp", "mid", "out"] and calls[3:4] != ["inp"]
    pf = tr.params_frame()
    assert pf.loc["out.weight", "n_nan"] == 1
    assert pf.loc["mid.weight", "norm"] == pytest.approx(
        float(model.mid.weight.detach().double().norm()), rel=1e-6
    )


def test_the_exact_pass_starts_from_the_users_rng() -> None:
    # dropout before the bad layer: the exact pass sees the mask a plain step would
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1)).train()
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
    x = torch.randn(8, 4)
    state = torch.get_rng_state()
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum())
    assert torch.equal(torch.get_rng_state(), state)  # the user's RNG stream is untouched
    torch.set_rng_state(state)
    with torch.no_grad():
        want = model[1](model[0](x))
    got = next(e for e in tr.events if e.phase == "forward" and e.module == "1")
    assert got.stats.zero_frac == pytest.approx(float((want == 0).double().mean()))
    assert (tr.origin.module, tr.origin.param) == ("2", "2.weight")  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["unused", "outside_modules", "buffer"])
def test_a_nan_weight_or_buffer_is_found_wherever_it_is(where: str) -> None:
    # unused: no event sees it (a note names it); outside modules=: the exact pass records
    # every module; a buffer: named as the origin's
    model, x, y = _net()
    modules = None
    with torch.no_grad():
        if where == "unused":
            model.unused.weight[1, 1] = float("nan")
        elif where == "outside_modules":
            model.mid.bias[2] = float("nan")
            modules = "out"
        else:
            model.bn.running_mean[0] = float("nan")
            model.eval()  # eval mode: the BatchNorm reads its running statistics
    tr = nbdebug.trace(model, x, y, F.mse_loss, modules=modules)
    pf = tr.params_frame()
    if where == "unused":
        assert tr.origin is None
        assert pf.loc["unused.weight", "n_nan"] == 1
        assert any("non-finite parameters or buffers" in n for n in tr.notes)
        assert model.calls == 1  # the exact pass only
    elif where == "outside_modules":
        assert (tr.origin.module, tr.origin.param) == ("mid", "mid.bias")  # type: ignore[union-attr]
    else:
        assert (tr.origin.module, tr.origin.param) == ("bn", "bn.running_mean")  # type: ignore[union-attr]
        assert pf.loc["bn.weight", "n_nan"] == 0


def test_a_huge_finite_weight_is_not_taken_for_a_non_finite_one() -> None:
    # its float32 norm overflows, but it holds no NaN/Inf
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with torch.no_grad():
        model[1].weight.fill_(1e20)  # its squares overflow float32
    health = WeightHealth.measure(owned_weights(model.named_modules()))
    assert not health.bad
    tr = nbdebug.trace(model, torch.zeros(2, 3), loss_fn=lambda o: o.sum())
    pf = tr.params_frame()
    assert pf.loc["1.weight", "n_nan"] == 0 and pf.loc["1.weight", "n_inf"] == 0
    want = 3**0.5 * float(torch.tensor(1e20))
    assert pf.loc["1.weight", "norm"] == pytest.approx(want, rel=1e-9)  # not inf
    assert tr.origin is None


@pytest.mark.parametrize("container", ["dict", "list"])
def test_a_nan_weight_in_a_parameter_container_is_named(container: str) -> None:
    """A ParameterDict/ParameterList is never called: its parameters belong to the module
    that holds it and reads them, so a NaN among them is named as that module's parameter
    (rule 2), not blamed on the multiplication that reads it."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.block = nn.Module()
            if container == "dict":
                self.block.gains = nn.ParameterDict({"scale": nn.Parameter(torch.ones(4))})
            else:
                self.block.gains = nn.ParameterList([nn.Parameter(torch.ones(4))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = self.block.gains["scale"] if container == "dict" else self.block.gains[0]
            return self.fc(x) * g

    model = Scaled()
    qual = "block.gains.scale" if container == "dict" else "block.gains.0"
    with torch.no_grad():
        model.get_parameter(qual)[1] = float("nan")
    x = torch.randn(6, 4)
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module, o.param) == ("forward", "", qual)
    assert f"the parameter or buffer {qual} already held non-finite values" in o.note
    assert o.corrupted  # the fact is a field: nothing parses the note
    assert_unchanged(before, model)


def test_an_origin_made_by_the_step_is_not_corrupted_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    tr = nbdebug.trace(model, torch.randn(3, 4), loss_fn=lambda o: torch.log(o - o).sum())
    assert tr.origin is not None and tr.origin.phase == "loss" and not tr.origin.corrupted
    assert tr.origin.chain and tr.origin.chain[0].op == tr.origin.op  # the root is chain[0]
