"""Large-model options of ``nbdebug.trace``: ``modules=`` name patterns, ``keep=``
activations, a GPT-2 architecture (from a config, random init, no download) and the
NaN path on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.core.measure import tensor_stats

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


def _gpt2(n_layer: int = 2) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=4,
        vocab_size=97,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()  # dropout off: steps comparable
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(6, 8), nn.ReLU()),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
        nn.Linear(8, 1),
    )
    return model, torch.randn(5, 6)


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def test_gpt2_trace_records_every_module_and_parameter() -> None:
    model, batch = _gpt2()
    before = fingerprint(model)
    tr = nbdebug.trace(model, batch)
    assert_unchanged(before, model)
    assert tr.healthy and tr.origin is None
    with torch.no_grad():
        assert tr.loss == pytest.approx(float(model(**batch).loss), rel=1e-5)
    forward = {e.module for e in tr.events if e.phase == "forward"}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= forward
    grads = {e.param: e for e in tr.events if e.kind == "param_grad"}
    named = dict(model.named_parameters())
    # measured after the backward, in place of the ~100 hooks on its critical path:
    # the values are still the ones of this step
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    for name in ("transformer.h.1.mlp.c_fc.weight", "transformer.wte.weight"):
        g = named[name].grad
        assert g is not None
        s = tensor_stats(g)
        assert grads[name].stats.norm == pytest.approx(s.norm, rel=1e-4)
        assert grads[name].stats.max == pytest.approx(s.max, rel=1e-5)
        assert grads[name].stats.min == pytest.approx(s.min, rel=1e-5)
    model.zero_grad(set_to_none=True)


def test_gpt2_nan_weight_names_the_parameter() -> None:
    model, batch = _gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 5] = float("nan")
    before = fingerprint(model)
    tr = nbdebug.trace(model, batch)
    assert_unchanged(before, model)
    assert tr.origin is not None
    assert tr.origin.module == "transformer.h.1.mlp.c_fc"
    assert tr.origin.param == "transformer.h.1.mlp.c_fc.weight"
    info = next(p for p in tr.params if p.name == "transformer.h.1.mlp.c_fc.weight")
    assert info.n_nan == 1
    # nothing before the corrupted block holds a NaN
    first = tr.first_nonfinite
    assert first is not None and first.phase == "forward"
    assert first.module.startswith("transformer.h.1.mlp")


def test_modules_patterns_restrict_the_recording() -> None:
    model, batch = _gpt2(3)
    before = fingerprint(model)
    tr = nbdebug.trace(model, batch, modules="transformer.h.1.*")
    assert_unchanged(before, model)
    mods = {e.module for e in tr.events if e.phase in ("forward", "backward")}
    assert "transformer.h.1" in mods and "transformer.h.1.attn.c_attn" in mods
    assert all(m == "transformer.h.1" or m.startswith("transformer.h.1.") for m in mods)
    params = {e.param for e in tr.events if e.kind == "param_grad"}
    assert "transformer.h.1.ln_1.weight" in params
    assert all(p.startswith("transformer.h.1.") for p in params)
    # the batch and the loss are always there
    assert {e.phase for e in tr.events} == {"input", "forward", "loss", "backward"}
    full = nbdebug.trace(model, batch)
    same = [e for e in full.events if e.module == "transformer.h.1.mlp.c_fc"]
    got = [e for e in tr.events if e.module == "transformer.h.1.mlp.c_fc"]
    assert [e.kind for e in got] == [e.kind for e in same]
    for a, b in zip(got, same):
        assert a.stats.norm == pytest.approx(b.stats.norm, rel=1e-6)


def test_modules_several_patterns_and_plain_names() -> None:
    model, x = _mlp()
    tr = nbdebug.trace(model, x, loss_fn=_mse, modules=["0.0", "2"])
    assert {e.module for e in tr.events if e.phase == "forward"} == {"0.0", "2"}


@pytest.mark.parametrize("option", ["modules", "keep"])
def test_a_pattern_matching_nothing_is_one_clear_sentence(option: str) -> None:
    model, x = _mlp()
    before = fingerprint(model)
    with pytest.raises(ValueError) as err:
        nbdebug.trace(model, x, loss_fn=_mse, **{option: ["0.*", "encoder.*"]})
    msg = str(err.value)
    assert msg.startswith(f"{option}='encoder.*' matches no module of Sequential")
    assert "'0.0'" in msg and msg.count(". ") == 0
    assert_unchanged(before, model)
    for bad, said in (([3], "got int 3 among them"), (3, "got int 3."), (b"0", "got bytes")):
        with pytest.raises(TypeError, match=rf"{option}= expects module name patterns") as info:
            nbdebug.trace(model, x, loss_fn=_mse, **{option: bad})
        assert said in str(info.value)
    with pytest.raises(ValueError, match=rf"{option}= got an empty list: give at least one"):
        nbdebug.trace(model, x, loss_fn=_mse, **{option: []})
    assert_unchanged(before, model)


def test_keep_keeps_exactly_the_named_activations_with_their_memory() -> None:
    model, x = _mlp()
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, loss_fn=_mse, keep=["0.0", "1"])
    assert_unchanged(before, model)
    assert set(tr.kept) == {"0.0", "1"}
    with torch.no_grad():
        h = model[0][0](x)
        expected1 = model[1](model[0][1](h))
    assert torch.equal(tr.kept["0.0"], h)
    assert torch.equal(tr.kept["1"], expected1)
    assert not tr.kept["1"].requires_grad
    assert tr.kept_bytes == (5 * 8 + 5 * 8) * 4
    assert any("kept 2 activation tensors (keep=): 320 B" in n for n in tr.notes)
    # nothing is kept unless asked for
    assert nbdebug.trace(model, x, loss_fn=_mse).kept == {}


def test_keep_copies_survive_in_place_changes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(3, 4)
    tr = nbdebug.trace(model, x, loss_fn=_mse, keep="0")
    with torch.no_grad():
        assert torch.equal(tr.kept["0"], model[0](x))  # before the in-place ReLU
    assert (tr.kept["0"] < 0).any()


def test_keep_outside_modules_is_recorded_too() -> None:
    model, x = _mlp()
    tr = nbdebug.trace(model, x, loss_fn=_mse, modules="0.*", keep="2")
    mods = {e.module for e in tr.events if e.phase == "forward"}
    assert mods == {"0", "0.0", "0.1", "2"}
    assert set(tr.kept) == {"2"}


@pytest.mark.parametrize("bad", ["weight", "input"])
def test_keep_is_honoured_on_the_nan_path(bad: str) -> None:
    # a NaN weight sends the trace straight to the exact pass (no quick pass); a NaN in
    # the batch is found by the quick pass first: both keep what keep= names
    model, x = _mlp()
    if bad == "weight":
        with torch.no_grad():
            model[1][0].weight[2, 3] = float("nan")
    else:
        x = x.clone()
        x[4, 1] = float("nan")
    before = fingerprint(model)
    tr = nbdebug.trace(model, x, loss_fn=_mse, keep="0.0")
    assert_unchanged(before, model)
    assert tr.origin is not None
    if bad == "weight":
        assert (tr.origin.module, tr.origin.param) == ("1.0", "1.0.weight")
    else:
        assert (tr.origin.phase, tr.origin.samples) == ("input", [4])
    assert set(tr.kept) == {"0.0"}
    with torch.no_grad():
        assert torch.allclose(tr.kept["0.0"], model[0][0](x), rtol=0, atol=0, equal_nan=True)
    assert tr.kept_bytes == 5 * 8 * 4


def test_keep_keeps_every_call_of_a_module_and_a_tuple_output_under_its_name() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(3, 3)
            self.rnn = nn.GRU(3, 3, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.shared(self.shared(x))
            out, last = self.rnn(h.unsqueeze(1))
            return out.sum() + last.sum()

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(4, 3)
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o, keep=["shared", "rnn"])
    assert set(tr.kept) == {"shared", "shared#2", "rnn", "rnn:output[1]"}
    with torch.no_grad():
        once = model.shared(x)
        twice = model.shared(once)
        out, last = model.rnn(twice.unsqueeze(1))
    assert torch.equal(tr.kept["shared"], once) and torch.equal(tr.kept["shared#2"], twice)
    assert torch.equal(tr.kept["rnn"], out) and torch.equal(tr.kept["rnn:output[1]"], last)
    assert "kept 4 activation tensors" in " ".join(tr.notes)


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


@pytest.mark.parametrize("modules", [None, "0", "3"])
def test_a_forward_error_names_the_module_that_raised_whatever_modules_records(
    modules: str | None,
) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _Boom(), nn.Linear(4, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(nbdebug.TraceError, match=r"^ValueError in 2 \(_Boom\) during the forward"):
        nbdebug.trace(m, x, y, F.cross_entropy, modules=modules)
    try:
        nbdebug.trace(m, x, y, F.cross_entropy, modules=modules)
    except nbdebug.TraceError as e:
        assert e.module == "2"
        text = str(e)
    tail = {
        None: "Executed modules up to: 1.",
        "0": "Recorded modules (modules=) executed up to: 0.",
        "3": "No recorded module (modules=) had finished.",  # 0 and 1 did, unrecorded
    }[modules]
    assert text.endswith(tail)
