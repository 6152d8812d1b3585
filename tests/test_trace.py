"""nbdebug.trace(): the public scenario suite, calling conventions, tables, bad input."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from models import LossInside, by_name, scenarios
from torch import nn

import nbdebug
from nbdebug.core.batch import LossError

SCENARIOS = {s.name: s for s in scenarios()}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_origin_scenarios(name: str) -> None:
    s = by_name(name)
    tr = nbdebug.trace(s.model, s.inputs, s.target, s.loss_fn)
    if s.phase is None:
        assert tr.origin is None
        assert tr.first_nonfinite is None
        assert tr.healthy
        return
    o = tr.origin
    assert o is not None, f"{name}: no origin; first non-finite {tr.first_nonfinite}"
    assert (o.phase, o.module) == (s.phase, s.module), f"{name}: got {o!r}"
    if s.samples is not None:
        assert o.samples == s.samples
    if s.op is not None:
        assert o.op is not None and s.op in o.op, f"{name}: op {o.op}"
        expected = (
            "torch/nn/modules/"
            if isinstance(s.model.get_submodule(s.module), nn.Linear)
            else "models.py:"
        )
        assert o.source is not None and o.source.startswith(expected), o.source
        # the chain starts at the root op and ends where the origin's kind of value is made
        assert o.chain and (o.chain[0].op, o.chain[0].source) == (o.op, o.source)
        if o.stats.n_nan:
            assert o.chain[-1].value == "NaN"
    if s.param is not None:
        assert o.param == s.param
    # the origin is an event of the trace (jump-to-origin needs its index)
    assert tr.events[o.index].phase == o.phase
    assert tr.first_nonfinite is not None
    assert tr.first_nonfinite.index <= o.index or o.phase in ("forward", "backward")


def test_origin_source_line_points_at_the_producing_code() -> None:
    import inspect

    import models

    s = by_name("zero_over_zero_norm")
    tr = nbdebug.trace(s.model, s.inputs, s.target, s.loss_fn)
    lines, start = inspect.getsourcelines(models.Normalize.forward)
    div_line = start + next(i for i, line in enumerate(lines) if "/" in line)
    assert tr.origin is not None
    assert tr.origin.source == f"models.py:{div_line}"


def test_first_nonfinite_is_the_first_event_holding_nan() -> None:
    s = by_name("parent_code")
    tr = nbdebug.trace(s.model, s.inputs, s.target, s.loss_fn)
    first = tr.first_nonfinite
    assert first is not None and first.module == "child"
    assert all(e.finite for e in tr.events[: first.index])
    assert tr.origin is not None and tr.origin.module == ""


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_target_is_the_origin_not_the_loss(bad: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    y[4, 0] = bad
    tr = nbdebug.trace(model, x, target=y, loss_fn=F.mse_loss)
    o = tr.origin
    assert o is not None
    assert (o.phase, o.kind, o.name, o.samples) == ("input", "target", "target", [4])
    assert not math.isfinite(tr.loss)
    # the batch's own tensors come first, and a finite target is recorded as well
    assert [(e.kind, e.name) for e in tr.events[:2]] == [("input", "x"), ("target", "target")]
    assert "the target (input), row 4" in repr(tr)
    assert tr.masks == []  # an Inf in the target reaches only the loss: never a mask
    [f] = [f for f in nbdebug.check(tr) if f.code == "nonfinite_input"]
    assert f.where == "row 4 of input target" and f.rows == [4]
    pairs = nbdebug.trace(model, x, target=(y, y.clone()), loss_fn=lambda o, t: F.mse_loss(o, t[1]))
    assert [e.name for e in pairs.events if e.kind == "target"] == ["target[0]", "target[1]"]
    assert pairs.origin is not None and pairs.origin.name == "target[0]"


def test_an_inf_the_forward_absorbs_but_the_backward_multiplies_is_bad_data() -> None:
    class GRUNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(8, 16, batch_first=True)
            self.fc = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.gru(x)[0]).mean((1, 2))

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    x[1, 2, 0] = float("inf")  # the gates saturate: every output stays finite
    tr = nbdebug.trace(GRUNet(), x, target=torch.zeros(3), loss_fn=F.mse_loss)
    assert tr.loss is not None and math.isfinite(tr.loss)
    o = tr.origin
    assert o is not None and (o.phase, o.name, o.samples) == ("input", "x", [1])
    assert tr.masks == []
    assert "backward of gru turns it into NaN: bad data, not a mask" in o.note


def test_events_cover_every_module_phase_and_parameter() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    tr = nbdebug.trace(model, x, y, F.mse_loss)
    phases = [e.phase for e in tr.events]
    assert phases[0] == "input"
    assert phases.index("loss") > max(i for i, p in enumerate(phases) if p == "forward")
    forward = [e.module for e in tr.events if e.phase == "forward"]
    assert forward == ["0", "1.0", "1.1", "1", ""]  # completion order: children first
    grads = {e.param for e in tr.events if e.kind == "param_grad"}
    assert grads == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        ev = next(e for e in tr.events if e.param == name)
        # the gradient statistics are those of the real gradient
        g = torch.autograd.grad(F.mse_loss(model(x), y), p)[0]
        assert ev.stats.norm == pytest.approx(float(g.norm()), rel=1e-5)
    # backward events go from the output back to the input
    back = [e.module for e in tr.events if e.kind == "grad_output"]
    assert back.index("") < back.index("1") < back.index("1.1") < back.index("0")
    # forward statistics match the tensor
    out0 = model[0](x).detach()
    ev = next(e for e in tr.events if e.phase == "forward" and e.module == "0")
    assert ev.stats.norm == pytest.approx(float(out0.norm()), rel=1e-5)
    assert ev.stats.mean == pytest.approx(float(out0.mean()), abs=1e-5)
    assert ev.stats.std == pytest.approx(float(out0.std(unbiased=False)), rel=1e-4)
    assert ev.stats.min == pytest.approx(float(out0.min()))
    assert ev.stats.max == pytest.approx(float(out0.max()))
    assert ev.shape == (5, 8) and ev.dtype == "float32"
    assert ev.hist.counts.sum() + ev.hist.n_zero == 40


def test_multi_output_tuple_dict_integer_and_none_gradients() -> None:
    class Multi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lstm = nn.LSTM(4, 3, batch_first=True)
            self.head = nn.Linear(3, 2)
            self.unused = nn.Linear(2, 2)  # its parameters get no gradient

        def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> dict:
            h, (_hn, _cn) = self.lstm(self.emb(tokens))
            return {"logits": self.head(h[:, -1]), "lengths": lengths}

    model = Multi()
    tokens = torch.randint(0, 10, (4, 6))
    tr = nbdebug.trace(
        model, (tokens, torch.full((4,), 6)), loss_fn=lambda o: o["logits"].pow(2).mean()
    )
    names = {(e.module, e.name) for e in tr.events if e.phase == "forward"}
    assert ("lstm", "output[0]") in names and ("lstm", "output[1][1]") in names
    assert ("", "output['logits']") in names and ("", "output['lengths']") in names
    ints = next(e for e in tr.events if e.phase == "input" and e.dtype == "int64")
    assert ints.stats.max <= 9
    pf = tr.params_frame()
    assert pf.loc["unused.weight", "grad_norm"] is None or np.isnan(
        pf.loc["unused.weight", "grad_norm"]
    )
    assert pf.loc["head.weight", "grad_norm"] > 0


@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "dict"])
def test_calling_conventions(form: str) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            return self.fc(a if b is None else a + b)

    a, b = torch.randn(4, 3), torch.randn(4, 3)
    inputs = {"tensor": a, "tuple": (a, b), "list": [a, b], "dict": {"a": a, "b": b}}[form]
    tr = nbdebug.trace(Two(), inputs, torch.zeros(4, 1), F.mse_loss)
    assert tr.loss is not None and tr.loss > 0
    assert tr.batch_size == 4


def test_loss_conventions() -> None:
    x = torch.randn(4, 4)
    labels = torch.tensor([0, 1, 2, 0])
    # output["loss"]
    m = LossInside()
    tr = nbdebug.trace(m, {"x": x, "labels": labels})
    assert tr.loss == pytest.approx(float(F.cross_entropy(m.fc(x), labels).detach()), rel=1e-6)

    class WithAttr(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor):
            class Out:
                pass

            o = Out()
            o.loss = self.fc(x).mean()  # type: ignore[attr-defined]
            return o

    assert nbdebug.trace(WithAttr(), x).loss is not None
    scalar = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    tr = nbdebug.trace(nn.Sequential(scalar, _Mean()), x)  # scalar output
    assert tr.loss is not None
    tr = nbdebug.trace(nn.Linear(4, 2), x, loss_fn=lambda o: o.sum())  # loss_fn(output)
    assert tr.loss is not None


class _Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean()


def test_exact_loss_value() -> None:
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    tr = nbdebug.trace(model, x, y, F.mse_loss)
    assert tr.loss == pytest.approx(float(F.mse_loss(model(x), y).detach()), rel=1e-6)


def test_frames_and_repr() -> None:
    s = by_name("zero_over_zero_norm")
    tr = nbdebug.trace(s.model, s.inputs, s.target, s.loss_fn)
    df = tr.to_frame()
    assert isinstance(df, pd.DataFrame) and len(df) == len(tr.events)
    assert df["is_origin"].sum() == 1
    assert df.loc[tr.origin.index, "module"] == "0"  # type: ignore[union-attr]
    assert {"norm", "mean", "std", "min", "max", "absmax", "zero_frac", "n_nan", "n_inf"} <= set(
        df.columns
    )
    pf = tr.params_frame()
    assert list(pf.index) == [n for n, _ in s.model.named_parameters()]
    assert {"norm", "grad_norm", "ratio", "n_nan", "n_inf", "grad_n_nan", "grad_n_inf"} <= set(
        pf.columns
    )
    text = repr(tr)
    assert "Sequential" in text and "NaN produced in 0" in text and "div" in text
    assert len(text.splitlines()) <= 5


def test_ratio_matches_norms() -> None:
    model = nn.Linear(6, 3)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    tr = nbdebug.trace(model, x, y, F.mse_loss)
    pf = tr.params_frame()
    g = torch.autograd.grad(F.mse_loss(model(x), y), model.weight)[0]
    assert pf.loc["weight", "norm"] == pytest.approx(float(model.weight.detach().norm()), rel=1e-6)
    assert pf.loc["weight", "ratio"] == pytest.approx(
        float(g.norm() / model.weight.detach().norm()), rel=1e-5
    )


def test_each_parameter_gradient_is_measured_and_dropped_as_the_backward_goes() -> None:
    """The trace keeps the user's ``.grad`` aside; the pass's own gradients are measured once
    accumulated and dropped, so no second full set of gradients is held (while the
    gradient reaches the first layer, the last layer's new gradient is already gone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    F.mse_loss(model(x), y).backward()  # the user's gradients, from an earlier step
    theirs = {n: p.grad for n, p in model.named_parameters()}
    ref = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    seen: list[object] = []
    model[1].register_full_backward_hook(lambda m, gi, go: seen.append(model[2].weight.grad))
    tr = nbdebug.trace(model, x, y, F.mse_loss)
    assert seen == [None]  # 2.weight's new gradient was measured and dropped already
    assert all(p.grad is theirs[n] for n, p in model.named_parameters())
    got = {e.param: e.stats for e in tr.events if e.kind == "param_grad"}
    for (n, _), g in zip(model.named_parameters(), ref):
        assert got[n].norm == pytest.approx(float(g.norm()), rel=1e-5)
        assert got[n].mean == pytest.approx(float(g.mean()), rel=1e-4, abs=1e-7)


# ---------------------------------------------------------------------- bad input
def test_bad_inputs_raise_one_clear_sentence() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        nbdebug.trace(lambda x: x, torch.randn(2, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        nbdebug.trace(model, torch.randn(0, 3), loss_fn=lambda o: o.sum())
    with pytest.raises(ValueError, match="empty"):
        nbdebug.trace(model, (), loss_fn=lambda o: o.sum())
    with pytest.raises(TypeError, match="tensor"):
        nbdebug.trace(model, "not a batch")
    with pytest.raises(LossError, match=r"scalar.*\(2, 2\)"):
        nbdebug.trace(model, torch.randn(2, 3), loss_fn=lambda o: o)
    with pytest.raises(ValueError, match=r"no loss.*Tensor\(2, 2\)"):
        nbdebug.trace(model, torch.randn(2, 3))
    with pytest.raises(nbdebug.TraceError, match="rejected the batch"):
        nbdebug.trace(model, (torch.randn(2, 3), torch.randn(2, 3)), loss_fn=lambda o: o.sum())
    # refused before the model runs
    calls: list[int] = []
    model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(TypeError, match="loss_fn must be callable or None; got str"):
        nbdebug.trace(model, torch.randn(2, 3), torch.tensor([0, 1]), "cross_entropy")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"model\(\*\*inputs\), so its keys must be .*key 0 \(int\)"
    ):
        nbdebug.trace(model, {0: torch.randn(2, 3)}, loss_fn=lambda o: o.sum())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the inference_mode"):
        nbdebug.trace(model, torch.randn(2, 3), loss_fn=lambda o: o.sum())
    assert calls == []
    with pytest.raises(ValueError, match="on the meta device"):
        nbdebug.trace(nn.Linear(3, 2, device="meta"), torch.randn(2, 3), loss_fn=lambda o: o.sum())
    # lazy modules that never ran: their first forward would give them parameters
    for lazy, where in ((nn.LazyLinear(2), "0.weight"), (nn.LazyBatchNorm1d(), "0.weight")):
        net = nn.Sequential(lazy, nn.Linear(2, 1))
        net[0].register_forward_hook(lambda *a: calls.append(1))
        with pytest.raises(
            ValueError, match=rf"{where} \({type(lazy).__name__}\) is not initialized"
        ):
            nbdebug.trace(net, torch.randn(4, 2), loss_fn=lambda o: o.sum())
        assert calls == [] and nn.parameter.is_lazy(net[0].weight)


def test_model_raising_gives_trace_error_with_partial_trace() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("kaboom")

    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), Boom()))
    with pytest.raises(nbdebug.TraceError) as info:
        nbdebug.trace(model, torch.randn(2, 3), loss_fn=lambda o: o.sum())
    err = info.value
    assert err.module == "1.1"
    assert "1.1 (Boom)" in str(err) and "kaboom" in str(err)
    assert "Executed modules up to: 1.0" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert err.trace is not None
    assert [e.module for e in err.trace.events if e.phase == "forward"] == ["0", "1.0"]


def test_bad_target_gives_trace_error_naming_the_loss() -> None:
    model = nn.Linear(3, 4)
    with pytest.raises(nbdebug.TraceError, match="loss function raised") as info:
        nbdebug.trace(model, torch.randn(2, 3), torch.tensor([0, 7]), F.cross_entropy)
    assert info.value.__cause__ is not None


def test_no_backward_when_nothing_requires_grad() -> None:
    model = nn.Linear(3, 1).requires_grad_(False)
    tr = nbdebug.trace(model, torch.randn(4, 3), loss_fn=lambda o: o.mean())
    assert not any(e.phase == "backward" for e in tr.events)
    assert any("backward pass was skipped" in n for n in tr.notes)
    assert all(not p.requires_grad for p in model.parameters())
    # a trace without a backward is not called "healthy": its repr carries the reason
    assert tr.summary() == "no NaN/Inf in the forward; no backward ran (see notes)"
    assert "note: no parameter or input requires grad" in repr(tr)
    detached = nbdebug.trace(nn.Linear(3, 2), torch.randn(4, 3), loss_fn=lambda o: o.argmax())
    assert "no backward ran" in detached.summary()
    assert "the loss does not depend on any parameter" in repr(detached)


def test_many_modules_trace_and_frame() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(667)])
    assert sum(1 for _ in model.modules()) > 2000
    tr = nbdebug.trace(model, torch.randn(2, 4), loss_fn=lambda o: o.sum())
    assert len(tr.to_frame()) == len(tr.events) > 4000


def test_source_in_an_ipython_cell_reads_like_ipython() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell(
        "import torch, nbdebug\n"
        "from torch import nn\n"
        "class N(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x / x.sum(1, keepdim=True)\n"
        "m = nn.Sequential(nn.Linear(3, 3), N())\n"
        "with torch.no_grad():\n"
        "    m[0].weight.zero_(); m[0].bias.zero_()\n"
        "tr = nbdebug.trace(m, torch.randn(2, 3), loss_fn=lambda o: o.sum())\n",
        store_history=True,
    )
    tr = shell.user_ns["tr"]
    count = shell.execution_count - 1
    assert tr.origin.source == f"Cell In[{count}]:5"


def test_huge_finite_activations_keep_a_finite_norm() -> None:
    class Huge(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e20  # finite in float32, but x**2 overflows float32

    model = nn.Sequential(nn.Linear(3, 3), Huge())
    x = torch.randn(4, 3)
    tr = nbdebug.trace(model, x, loss_fn=lambda o: (o * 1e-20).sum())
    assert tr.origin is None and tr.first_nonfinite is None
    ev = next(e for e in tr.events if e.phase == "forward" and e.module == "1")
    expected = float(torch.linalg.vector_norm(model(x).detach().double()))
    assert ev.stats.norm == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=reentrant)
            return x

    model = Net()
    x = torch.randn(4, 8, requires_grad=reentrant)  # reentrant checkpointing needs it
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.pow(2).mean())
    loss_at = next(e.index for e in tr.events if e.phase == "loss")
    # the recomputation inside the backward adds no forward events
    assert all(e.phase != "forward" for e in tr.events[loss_at:])
    assert [e.module for e in tr.events if e.phase == "forward"].count("blocks.1.a") == 1
    # gradients inside the checkpointed blocks, and every parameter's, are recorded
    assert any(e.kind == "grad_output" and e.module == "blocks.1.a" for e in tr.events)
    grads = dict(zip(*zip(*[(p.name, p.grad_norm) for p in tr.params])))
    import copy

    twin = copy.deepcopy(model)
    twin(x.detach().clone().requires_grad_(reentrant)).pow(2).mean().backward()
    expected = twin.blocks[1].a.weight.grad.norm()
    assert grads["blocks.1.a.weight"] == pytest.approx(float(expected), rel=1e-5)
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        model.blocks[1].a.weight[0, 0] = float("nan")
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.pow(2).mean())
    assert tr.origin is not None and (tr.origin.phase, tr.origin.module) == (
        "forward",
        "blocks.1.a",
    )
    assert tr.origin.param == "blocks.1.a.weight"


def test_reentrant_checkpoint_without_grad_inputs_says_the_gradient_is_cut() -> None:
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.fc, x, use_reentrant=True)

    with pytest.warns(UserWarning):
        tr = nbdebug.trace(Net(), torch.randn(2, 4), loss_fn=lambda o: o.sum())
    assert any("use_reentrant=True" in n for n in tr.notes)


def test_sparse_embedding_gradients() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 1))
    tokens = torch.randint(0, 10, (5, 3))
    tr = nbdebug.trace(model, tokens, loss_fn=lambda o: o.sum())
    assert tr.healthy
    g = torch.autograd.grad(model(tokens).sum(), model[0].weight)[0].coalesce()
    emb = next(p for p in tr.params if p.name == "0.weight")
    assert emb.grad_norm == pytest.approx(float(g.values().norm()), rel=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script itself is deprecated
def test_torchscript_submodules_are_traced_around() -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = nn.Sequential(nn.Linear(4, 4), scripted, nn.Linear(4, 1))
    tr = nbdebug.trace(model, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert [e.module for e in tr.events if e.phase == "forward"] == ["0", "2", ""]
    assert all(p.grad_norm is not None for p in tr.params)
    sweep = nbdebug.gradcheck_modules(model, torch.randn(3, 4))
    assert "0" in set(sweep["module"])


def test_compiled_model_is_traced_through_the_module_it_wraps() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    tr = nbdebug.trace(compiled, torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert tr.origin is not None and tr.origin.module == "0" and tr.origin.param == "0.weight"
    assert tr.model_name == "Sequential"


class _NaNOnThirdCall(nn.Module):
    """A forward with state outside its inputs: NaN on its third call only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        return h * float("nan") if self.calls == 3 else h


def test_a_nan_step_whose_exact_pass_replays_finite_is_not_called_healthy():
    m = _NaNOnThirdCall()
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1])
    m(x), m(x)
    tr = nbdebug.trace(m, x, y, F.cross_entropy)  # its first pass is the third call
    assert tr.origin is None and math.isnan(tr.unreplayed_loss) and not tr.healthy
    assert tr.summary().startswith("the step's loss was nan but its replay was finite")
    assert any("depends on state outside its inputs" in n for n in tr.notes)
    healthy = nbdebug.trace(_NaNOnThirdCall(), x, y, F.cross_entropy)
    assert healthy.healthy and healthy.unreplayed_loss is None
