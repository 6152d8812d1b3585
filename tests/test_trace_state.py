"""Debugging must not change what it debugs: state and hooks after nbdebug.trace()."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import bn_dropout_model, scenarios
from state import assert_unchanged, fingerprint, same_tensor
from torch import nn

import nbdebug


def test_state_preserved_with_batchnorm_dropout_and_existing_grads() -> None:
    model = bn_dropout_model()
    user_hook_calls = []
    model[1].register_forward_hook(lambda m, i, o: user_hook_calls.append(1))
    np.random.seed(3)
    random.seed(3)
    x = torch.randn(5, 3, 6, 6)
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, torch.tensor([0, 1, 2, 0, 1]), F.cross_entropy)
    assert tr.origin is None
    assert user_hook_calls  # the user's own hooks still ran
    assert_unchanged(before, model)


def test_state_preserved_on_failing_trace_with_replays() -> None:
    # a NaN makes the trace replay the step (exact pass, op-level replay): still no change
    model = bn_dropout_model()
    x = torch.randn(5, 3, 6, 6)
    x[2, 0, 1, 1] = float("nan")
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, torch.tensor([0, 1, 2, 0, 1]), F.cross_entropy)
    assert tr.origin is not None and tr.origin.phase == "input" and tr.origin.samples == [2]
    assert_unchanged(before, model)


@pytest.mark.parametrize("name", [s.name for s in scenarios()])
def test_every_scenario_leaves_the_model_as_it_was(name: str) -> None:
    s = next(s for s in scenarios() if s.name == name)
    before = fingerprint(s.model)
    inputs_before = [t.clone() for t in _tensors(s.inputs)]
    nbdebug.trace(s.model, s.inputs, s.target, s.loss_fn)
    assert_unchanged(before, s.model)
    for a, b in zip(inputs_before, _tensors(s.inputs)):
        assert same_tensor(a, b)
        assert b.grad is None


def _tensors(obj: Any) -> list[torch.Tensor]:
    from nbdebug.core.batch import named_tensors

    return [t for _, t in named_tensors(obj)]


class _Raises(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.fc = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        if self.where == "forward":
            raise ValueError("model failed")
        if self.where == "backward":
            return _FailingBackward.apply(h)
        return h


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


@pytest.mark.parametrize("where", ["forward", "backward", "target"])
def test_hooks_removed_and_state_restored_when_something_raises(where: str) -> None:
    model = _Raises(where)
    model.fc.weight.grad = torch.ones(3, 3)
    target = torch.tensor([0, 9, 1, 2]) if where == "target" else torch.tensor([0, 1, 1, 2])
    x = torch.randn(4, 3)
    before = fingerprint(model)
    with pytest.raises(nbdebug.TraceError) as info:
        nbdebug.trace(model, x, target, F.cross_entropy)
    assert info.value.trace is not None
    assert_unchanged(before, model)
    if where == "backward":
        assert "backward" in str(info.value)


def test_hooks_removed_on_bad_loss() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    before = fingerprint(model)
    with pytest.raises(ValueError):
        nbdebug.trace(model, x, loss_fn=lambda o: o)
    assert_unchanged(before, model)


def test_no_activation_kept_alive() -> None:
    import gc
    import weakref

    refs: list[Any] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            refs.append(weakref.ref(y))
            return y

    model = nn.Sequential(nn.Linear(4, 4), Spy(), nn.Linear(4, 1))
    tr = nbdebug.trace(model, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    gc.collect()
    assert refs and all(r() is None for r in refs)
    assert tr.events  # the trace holds statistics only


@pytest.mark.parametrize("nan", [False, True])
def test_no_hook_left_on_leaf_inputs(nan: bool) -> None:
    # a parametrized weight is a module *input* (its original is a leaf), and so is a batch
    # that requires grad: the trace's tensor hooks on them are removed like its module hooks
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(3, 4)), nn.Tanh(), spectral_norm(nn.Linear(4, 2)))
    x = torch.randn(5, 3, requires_grad=True)
    kept = torch.randn(5, 3, requires_grad=True)
    user_calls: list[int] = []
    kept.register_hook(lambda g: user_calls.append(1))
    if nan:
        with torch.no_grad():
            x[3, 1] = float("nan")
    before = fingerprint(model)
    for _ in range(3):
        tr = nbdebug.trace(model, (x,), loss_fn=lambda o: o.sum())
        nbdebug.trace(model, (kept,), loss_fn=lambda o: o.sum())
    assert (tr.origin is not None) == nan
    assert_unchanged(before, model)
    assert x._backward_hooks is None and x.grad is None
    assert len(kept._backward_hooks) == 1 and kept.grad is None
    # the trace's hooks are gone: the user's backward calls only the user's hook, once
    user_calls.clear()
    model(kept).sum().backward()
    assert user_calls == [1]


@pytest.mark.parametrize("nan", [False, True])
def test_a_batch_computed_by_another_model_keeps_its_graph(nan: bool) -> None:
    """trace(head, backbone(x)): the trace's backward stops at the batch. The backbone gets
    no .grad and its graph is not freed, so the user's own backward still runs, and the
    input-gradient event is still recorded."""
    torch.manual_seed(0)
    backbone = nn.Linear(3, 4)
    head = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if nan:
        with torch.no_grad():
            head[2].weight[0, 0] = float("nan")
    raw, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    feats = backbone(raw)
    tr = nbdebug.trace(head, feats, y, F.cross_entropy)
    assert (tr.origin is not None) == nan
    assert backbone.weight.grad is None and backbone.bias.grad is None
    assert feats.grad_fn is not None
    assert any(e.phase == "backward" and e.kind == "grad_input" for e in tr.events)
    F.cross_entropy(head(feats), y).backward()  # the graph behind feats is intact
    assert backbone.weight.grad is not None


def test_a_forward_that_changes_its_batch_in_place_sees_the_batch_as_given() -> None:
    """Every pass (the quick one, the exact one, the replays) starts from the batch as the
    user gave it, so the origin's rows are those of that batch, and the batch is left as
    it was."""

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(1, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.sub_(0.5)  # in place on its batch
            return self.fc(torch.log(x))

    x = torch.tensor([[0.2], [0.9], [0.4], [0.7], [0.6]])
    given = x.clone()
    tr = nbdebug.trace(Shift(), x, torch.zeros(5, dtype=torch.long), F.cross_entropy)
    assert tr.origin is not None and tr.origin.op == "torch.log"
    assert tr.origin.samples == [0, 2]  # 0.2 and 0.4 fall below 0.5
    assert torch.equal(x, given) and x._version == given._version


def test_a_forward_that_cannot_run_twice_is_named_as_such() -> None:
    """The first pass finds a NaN; the exact pass runs the forward again, which fails (it
    pops one step's noise from a list): the error says the model cannot be replayed, not
    that it is broken, and chains the model's own error."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.noise = [torch.zeros(2)]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.fc(x)) + self.noise.pop()

    with pytest.raises(nbdebug.TraceError, match=r"^the step ran once and needed") as info:
        nbdebug.trace(Noisy(), torch.randn(4, 3), loss_fn=lambda o: o.sum())
    assert "cannot be replayed" in str(info.value)
    assert "IndexError in <model> (Noisy) during the forward pass" in str(info.value)
    assert isinstance(info.value.__cause__, IndexError)
    assert info.value.trace is not None and info.value.trace.error == str(info.value)


@pytest.mark.parametrize("nan", [False, True])
def test_a_forward_that_writes_its_weight_is_left_as_one_forward_leaves_it(nan: bool) -> None:
    """A clamp inside forward writes fc.weight in place. A plain forward writes it once; the
    trace, whose NaN path runs the forward three times, leaves it written once too, and
    says so in its notes."""

    class Decay(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.fc.weight.mul_(0.5)
            return self.fc(x)

    torch.manual_seed(0)
    model = Decay()
    start = model.fc.weight.detach().clone()
    x = torch.randn(4, 3)
    if nan:
        x[2, 0] = float("nan")
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum())
    assert (tr.origin is not None) == nan
    assert torch.equal(model.fc.weight, start * 0.5)
    assert any("forward writes fc.weight in place" in n for n in tr.notes), tr.notes
    assert "note: the model's forward writes fc.weight" in repr(tr)


def _same_numpy_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_rng_capture_follows_numpy_draws_seeds_and_set_state() -> None:
    """The guard's cached numpy capture equals ``np.random.get_state()`` after draws
    (uniform and Gaussian, which leaves a cached twin), a reseed and ``set_state``."""
    from nbdebug.core.state import RngState

    saved = np.random.get_state()
    try:
        np.random.seed(3)
        steps = [
            lambda: None,
            lambda: np.random.rand(5),
            lambda: np.random.randn(),  # one of a pair: the twin is cached
            lambda: np.random.randn(),
            lambda: np.random.seed(11),
            lambda: np.random.set_state(saved),
            lambda: np.random.rand(700),  # past the 624-word block: the key is regenerated
        ]
        for change in steps:
            change()
            for _ in range(2):  # the second capture takes the cached path
                assert _same_numpy_state(RngState.capture().numpy, np.random.get_state())
    finally:
        np.random.set_state(saved)
