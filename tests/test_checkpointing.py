"""Debugging under activation checkpointing (issue 33, item 3).

The hooks of a trace create no autograd state (a tensor saved for backward by a hook in
the first run but not in the recomputation makes non-reentrant checkpointing raise
``CheckpointError``), and they behave the same in the recomputation: the trace, a guard's
snapshot, its replay and ``diagnose`` name the origin as they would without checkpointing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from state import assert_unchanged, fingerprint
from torch import nn
from torch.utils.checkpoint import checkpoint

import nbdebug


class Block(nn.Module):
    """``Linear -> nn.ReLU() -> Linear``: module activations (a functional relu would hide
    a hook that saves a tensor: the ReLU module's own hooks run inside the region too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class Net(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=self.reentrant)
        return x


def _sq(o: torch.Tensor) -> torch.Tensor:
    return o.pow(2).mean()


def _blocks(reentrant: bool, where: str = "blocks.1.a") -> Net:
    torch.manual_seed(0)
    model = Net(reentrant)
    with torch.no_grad():
        model.get_submodule(where).weight[0, 0] = float("nan")  # type: ignore[index]
    return model


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("where", ["blocks.0.a", "blocks.1.a", "blocks.1.b", "blocks.2.b"])
def test_checkpointed_blocks_name_the_nan_weight(reentrant: bool, where: str) -> None:
    model = _blocks(reentrant, where)
    x = torch.randn(4, 8, requires_grad=reentrant)  # reentrant checkpointing needs it
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, loss_fn=_sq)
    assert_unchanged(before, model)
    assert x.grad is None
    assert tr.origin is not None
    assert (tr.origin.phase, tr.origin.module) == ("forward", where)
    assert tr.origin.param == f"{where}.weight"
    assert tr.origin.op == "torch.nn.functional.linear"
    # the recomputation inside the backward adds no forward events
    loss_at = next(e.index for e in tr.events if e.phase == "loss")
    assert all(e.phase != "forward" for e in tr.events[loss_at:])


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_backward_origin(reentrant: bool) -> None:
    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x - x) + x  # finite forward, NaN gradient at 0

    class Net2(Net):
        def __init__(self) -> None:
            super().__init__(reentrant)
            self.blocks[1].act = Sqrt()  # type: ignore[assignment]

    torch.manual_seed(0)
    model = Net2()
    x = torch.randn(4, 8, requires_grad=reentrant)
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, loss_fn=_sq)
    assert_unchanged(before, model)
    assert tr.origin is not None
    assert (tr.origin.phase, tr.origin.module, tr.origin.op) == (
        "backward",
        "blocks.1.act",
        "torch.sqrt",
    )


def test_hooks_save_nothing_for_autograd() -> None:
    """The exact pass's hooks (finiteness of each input, element-wise statistics, input
    copies) run under ``no_grad``: the tensors autograd saves in a traced forward are the
    model's own. Counted with ``saved_tensors_hooks`` around a trace of a model whose NaN
    weight makes the exact pass run, against the same count for a plain forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    x = torch.randn(4, 8, requires_grad=True)
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).pow(2).mean()
        plain = len(shapes)
        shapes.clear()

        class Counting(nn.Module):
            """Counts the forward passes of the trace (quick, exact and any capture)."""

            def __init__(self) -> None:
                super().__init__()
                self.inner = model
                self.calls = 0

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                self.calls += 1
                out: torch.Tensor = self.inner(x)
                return out

        wrapped = Counting()
        tr = nbdebug.trace(wrapped, x, loss_fn=lambda o: o.pow(2).mean())
    assert tr.origin is not None and tr.origin.module == "inner.2"
    # each forward with grad enabled saves what the plain forward saves, no more
    assert len(shapes) % plain == 0 and len(shapes) // plain <= wrapped.calls


def test_guard_snapshot_replay_and_diagnose_under_checkpointing(tmp_path: Path) -> None:
    model = _blocks(False, "blocks.1.b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, loss_fn=_sq)
    x = torch.randn(4, 8)
    loss = _sq(model(x))
    loss.backward()
    assert guard.check(loss, inputs=x) is False
    snap = nbdebug.load_snapshot(guard.snapshots[0], lambda: Net(False))
    tr = snap.trace(loss_fn=_sq)
    assert tr.origin is not None and tr.origin.module == "blocks.1.b"
    assert tr.origin.param == "blocks.1.b.weight"
    dg = nbdebug.diagnose(snap, loss_fn=_sq, progress=False)
    assert dg.cause is not None and dg.cause.module == "blocks.1.b"


# --------------------------------------------------------------------------- transformers


def _llama(reentrant: bool) -> Any:
    transformers = pytest.importorskip("transformers", reason="the hf test extra is not installed")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    mlp = model.model.layers[1].mlp
    mlp.adapter = Adapter()
    plain_forward = type(mlp).forward

    class WithAdapter(type(mlp)):  # type: ignore[misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.adapter(plain_forward(self, x))
            return out

    mlp.__class__ = WithAdapter
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


class Adapter(nn.Module):
    """A residual adapter whose gate is a zero over zero."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        gate = (h - h) / (h - h)
        return x + gate * x


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_enable's rename
@pytest.mark.parametrize("reentrant", [False, True])
def test_llama_with_gradient_checkpointing_names_the_adapter(reentrant: bool) -> None:
    model = _llama(reentrant)
    assert model.is_gradient_checkpointing
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    before = fingerprint(model)
    tr = nbdebug.trace(model, {"input_ids": ids, "labels": ids})
    assert_unchanged(before, model)
    assert tr.origin is not None
    assert (tr.origin.phase, tr.origin.module) == ("forward", "model.layers.1.mlp.adapter")
    assert tr.origin.op == "Tensor.div"
    assert tr.origin.source is not None and tr.origin.source.startswith("test_checkpointing.py:")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_llama_guard_snapshot_replays_under_gradient_checkpointing(tmp_path: Path) -> None:
    model = _llama(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    out = model(**batch)
    out.loss.backward()
    assert guard.check(out.loss, inputs=batch) is False
    snap = nbdebug.load_snapshot(guard.snapshots[0], lambda: _llama(False))
    tr = snap.trace()
    assert tr.origin is not None and tr.origin.module == "model.layers.1.mlp.adapter"
    assert tr.origin.op == "Tensor.div"
