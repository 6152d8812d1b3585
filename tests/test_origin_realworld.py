"""The origin on the kinds of NaN bugs people report: Hugging Face models with additive
masks and caches, custom autograd Functions, composites (nn.MultiheadAttention),
underflow-then-divide (Sinkhorn), an infinite derivative found through the backward,
and a propagator after the root. Each case asserts phase, module, root op, chain and rows.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from torch import nn

import nbdebug

HERE = os.path.basename(__file__)


def line_of(obj: object, text: str) -> str:
    """``test_origin_realworld.py:N`` of the first line of ``obj``'s source holding ``text``."""
    lines, start = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    return f"{HERE}:{start + next(i for i, line in enumerate(lines) if text in line)}"


def nan_rows(t: torch.Tensor) -> list[int]:
    return torch.nonzero(~torch.isfinite(t).flatten(1).all(1)).flatten().tolist()


def chain_ops(ev: nbdebug.Event) -> list[tuple[str, str]]:
    return [(link.op, link.value) for link in ev.chain]


# ---------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers", reason="the hf test extra is not installed")
    transformers.logging.set_verbosity_error()
    return transformers


def bert_mask(batch: int, seq: int) -> torch.Tensor:
    """A 4-D additive mask: row 0 pads its last key, row 1 its last two, row 2 is an
    empty document (every key masked)."""
    mask = torch.zeros(batch, 1, seq, seq)
    mask[0, :, :, seq - 1] = float("-inf")
    mask[1, :, :, seq - 2 :] = float("-inf")
    mask[2] = float("-inf")
    return mask


def test_bert_additive_mask_is_a_mask_and_the_empty_row_softmax_is_the_origin(hf) -> None:
    torch.manual_seed(0)
    cfg = hf.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        attn_implementation="eager",
    )
    model = hf.BertModel(cfg)
    ids = torch.randint(0, 50, (4, 6))
    mask = torch.cat([bert_mask(3, 6), torch.zeros(1, 1, 6, 6)])
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert nan_rows(plain) == [2]  # rows 0 and 1 stay finite despite their -inf padding
    tr = nbdebug.trace(
        model,
        {"input_ids": ids, "attention_mask": mask},
        loss_fn=lambda o: o.last_hidden_state.pow(2).mean(),
    )
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module) == ("forward", "encoder.layer.0.attention.self")
    assert o.samples == [2]
    assert o.op is not None and "softmax" in o.op
    assert chain_ops(o) == [(o.op, "NaN")]
    assert o.source is not None and o.source.startswith("modeling_bert.py:")
    assert tr.masks == ["batch holds -inf in `attention_mask`, used as a mask"]
    assert any("attention_mask" in n for n in tr.notes)
    assert "replay" not in o.note


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpt2_with_cache_replays_the_attention_on_the_cache_as_at_the_call(hf, dtype) -> None:
    torch.manual_seed(0)
    cfg = hf.GPT2Config(
        vocab_size=50,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        attn_implementation="eager",
    )
    model = hf.GPT2LMHeadModel(cfg).to(dtype)
    ids = torch.randint(0, 50, (3, 8))
    mask = torch.triu(torch.full((8, 8), float("-inf")), 1).expand(3, 1, 8, 8).clone()
    mask[0, :, 1:, 0] = float("-inf")  # row 0 also pads its first token
    mask[2] = float("-inf")  # row 2: nothing to attend to
    batch = {"input_ids": ids, "attention_mask": mask.to(dtype), "labels": ids, "use_cache": True}
    tr = nbdebug.trace(model, batch)
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module) == ("forward", "transformer.h.0.attn")
    assert o.samples == [2]
    assert o.op is not None and "softmax" in o.op, o.note
    assert o.source is not None and o.source.startswith("modeling_gpt2.py:")
    assert chain_ops(o) == [(o.op, "NaN")]
    assert "failed" not in o.note and "inconclusive" not in o.note
    assert tr.masks and "attention_mask" in tr.masks[0]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values
def test_a_cache_passed_in_the_batch_is_not_extended_by_the_trace(hf) -> None:
    torch.manual_seed(0)
    cfg = hf.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    model = hf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    before = cache.get_seq_length()
    keys = [layer.keys.clone() for layer in cache.layers]
    nxt = torch.randint(0, 50, (2, 3))
    tr = nbdebug.trace(model, {"input_ids": nxt, "past_key_values": cache, "labels": nxt})
    assert tr.loss is not None and tr.healthy
    assert cache.get_seq_length() == before
    assert all(torch.equal(k, layer.keys) for k, layer in zip(keys, cache.layers))


# ---------------------------------------------------------------------- custom Functions
class ProdFn(torch.autograd.Function):
    """Product of each row; its backward divides the product by the input (0/0 at 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.prod(dim=1, keepdim=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        prod = x.prod(dim=1, keepdim=True)
        return grad * prod / x


class Prod(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ProdFn.apply(x)


def test_custom_function_backward_is_named_with_its_source_line() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Prod(), nn.Linear(1, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3))
        model[0].bias.zero_()
    x = torch.rand(4, 3) + 0.5
    x[1, 2] = 0.0
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module) == ("backward", "1")
    assert o.op == "ProdFn.backward"
    assert o.source == line_of(ProdFn.backward, "/ x")
    assert o.samples == [1]
    assert chain_ops(o) == [("ProdFn.backward", "NaN")]


def test_a_function_defined_inside_a_function_is_named_as_its_code_reads() -> None:
    def make() -> nn.Module:
        class LocalFn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x: torch.Tensor) -> torch.Tensor:
                return x.clone()

            @staticmethod
            def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
                return grad.log()  # log of a negative gradient: NaN

        class Local(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return LocalFn.apply(x)

        return nn.Sequential(nn.Linear(3, 3), Local(), nn.Linear(3, 1))

    model = make()
    with torch.no_grad():
        model[2].weight.fill_(-1.0)
    tr = nbdebug.trace(model, torch.randn(4, 3), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module) == ("backward", "1"), tr
    assert o.op == "LocalFn.backward"  # not "test_....<locals>.make.<locals>.LocalFn"


# ---------------------------------------------------------------------- composites
class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h, _ = self.attn(x, x, x, key_padding_mask=pad)
        return self.out(h)


def test_multihead_attention_names_the_softmax_inside_and_the_users_line() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8)
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[0, 3] = True
    pad[1] = True  # row 1: every key padded
    model = MaskedAttention()
    tr = nbdebug.trace(model, (x, pad), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module) == ("forward", "attn")
    assert o.samples == [1]
    assert o.op is not None and "softmax" in o.op
    assert "multi_head_attention_forward" not in o.op
    assert o.source == line_of(MaskedAttention.forward, "self.attn(")
    assert chain_ops(o) == [(o.op, "NaN")]


class SDPA(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, q, q)


def test_scaled_dot_product_attention_is_descended_through_its_math_path() -> None:
    torch.manual_seed(0)
    q = torch.randn(3, 2, 4, 8)
    q[2] = torch.rand(2, 4, 8) * 1e20  # q @ k^T overflows to +inf in row 2: inf - inf in softmax
    model = nn.Sequential(nn.Identity(), SDPA())
    tr = nbdebug.trace(model, q, loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module, o.samples) == ("forward", "1", [2])
    assert o.op is not None and "scaled_dot_product_attention" not in o.op
    assert o.chain[0].value == "inf" and o.chain[-1].value == "NaN"
    assert "softmax" in o.chain[-1].op
    assert o.source == line_of(SDPA.forward, "scaled_dot_product_attention")


# ---------------------------------------------------------------------- propagators
class Sinkhorn(nn.Module):
    """Entropic optimal transport; exp(-C/eps) underflows to 0 for a far-away point."""

    def forward(self, cost: torch.Tensor) -> torch.Tensor:
        kernel = torch.exp(-cost / 0.05)
        a = torch.full(cost.shape[:2], 1.0 / cost.shape[1])
        b = torch.full((cost.shape[0], cost.shape[2]), 1.0 / cost.shape[2])
        v = torch.ones_like(b)
        for _ in range(3):
            u = a / (kernel @ v.unsqueeze(-1)).squeeze(-1)
            v = b / (kernel.transpose(1, 2) @ u.unsqueeze(-1)).squeeze(-1)
        return u.unsqueeze(-1) * kernel * v.unsqueeze(1)


class Transport(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.anchors = nn.Parameter(torch.randn(6, 4))
        self.sinkhorn = Sinkhorn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cost = torch.cdist(self.proj(x), self.anchors.expand(x.shape[0], -1, -1))
        return self.sinkhorn(cost)


def test_sinkhorn_underflow_then_divide_names_the_division_as_root() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4)
    x[1] *= 100  # row 1 is far from every anchor: its kernel underflows to 0
    tr = nbdebug.trace(Transport(), x, loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module, o.samples) == ("forward", "sinkhorn", [1])
    assert o.op == "Tensor.div"
    assert o.source == line_of(Sinkhorn.forward, "u = a /")
    assert o.chain[0].value == "inf"
    assert (o.chain[-1].op, o.chain[-1].value) == ("Tensor.matmul", "NaN")
    assert o.chain[-1].source == line_of(Sinkhorn.forward, "v = b /")
    assert "Inf made by Tensor.div" in tr.summary() and "NaN by Tensor.matmul" in tr.summary()


class RowNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(1, keepdim=True))


def test_sqrt_at_a_zero_row_found_through_the_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), RowNorm(), nn.Linear(1, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3))
        model[0].bias.zero_()
    x = torch.rand(4, 3) + 0.1
    x[2] = -1.0  # ReLU makes row 2 exactly zero
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module, o.samples) == ("backward", "2", [2])
    assert o.op == "torch.sqrt"
    assert o.source == line_of(RowNorm.forward, "torch.sqrt")
    ops = chain_ops(o)
    assert ops[0] == ("torch.sqrt", "inf") and ops[-1] == ("Tensor.mul", "NaN")


class DivideThenProject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.child = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h / (h - h)
        return self.child(h)


def test_propagator_after_the_root_is_in_the_chain_not_the_op() -> None:
    torch.manual_seed(0)
    tr = nbdebug.trace(DivideThenProject(), torch.randn(3, 4), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module, o.samples) == ("forward", "", [0, 1, 2])
    assert o.op == "Tensor.div"
    div = line_of(DivideThenProject.forward, "h / (h - h)")
    child = line_of(DivideThenProject.forward, "self.child(h)")
    assert o.source == div
    assert [link.op for link in o.chain] == ["Tensor.div", "torch.nn.functional.linear"]
    assert str(o.chain) == "Tensor.div (inf) -> torch.nn.functional.linear (NaN)"
    assert o.chain[-1].source == child
    assert (
        f"Inf made by Tensor.div at {div}, NaN by torch.nn.functional.linear at {child}"
        in tr.summary()
    )


# ---------------------------------------------------------------------- masks
class MaskBuilder(nn.Module):
    """Turns a 0/1 padding matrix into an additive -inf mask (an intended mask)."""

    def forward(self, keep: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(keep).masked_fill(keep == 0, float("-inf"))


class Pool(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores + mask, dim=-1)


class MaskedPooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 1)
        self.masker = MaskBuilder()
        self.pool = Pool()

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = self.masker(keep)
        w = self.pool(self.score(x).squeeze(-1), mask)
        return (w.unsqueeze(-1) * x).sum(1)


def test_a_mask_made_by_a_module_is_not_the_origin() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4)
    keep = torch.ones(3, 5)
    keep[0, 4] = 0
    keep[2] = 0  # row 2: every position masked
    tr = nbdebug.trace(MaskedPooling(), (x, keep), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module, o.samples) == ("forward", "pool", [2])
    assert o.op == "torch.softmax"
    assert o.source == line_of(Pool.forward, "torch.softmax")
    assert "masker outputs infinite values used as a mask" in tr.masks


class AddBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.fc(x + bias)


def test_batch_inf_that_reaches_every_output_row_is_the_origin() -> None:
    x = torch.randn(4, 4)
    bias = torch.zeros(4, 4)
    bias[1, 2] = float("-inf")
    bias[3, 0] = float("-inf")
    tr = nbdebug.trace(AddBias(), (x, bias), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.name, o.samples) == ("input", "inputs[1]", [1, 3])
    assert tr.masks == []


def test_nan_in_the_batch_is_always_the_origin_even_beside_a_mask() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4)
    x[0, 1, 2] = float("nan")
    keep = torch.ones(3, 5)
    keep[1, 3] = 0
    tr = nbdebug.trace(MaskedPooling(), (x, keep), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.name, o.samples) == ("input", "inputs[0]", [0])


# ---------------------------------------------------------------------- bad input
class Flaky(nn.Module):
    """Divides by zero only on its first two calls (state outside its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x / 0.0 if self.calls <= 2 else x


def test_a_forward_that_cannot_be_replayed_gets_a_note_not_a_wrong_op() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Flaky(), nn.Linear(3, 1))
    tr = nbdebug.trace(model, torch.randn(4, 3), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module) == ("forward", "1")
    assert o.samples == [0, 1, 2, 3]
    assert o.op is None and o.source is None and len(o.chain) == 0
    assert "depends on state outside its inputs" in o.note


class OneShot(nn.Module):
    """Its forward draws from an iterator: a third call raises."""

    def __init__(self) -> None:
        super().__init__()
        self.values = iter([0.0, 0.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x * next(self.values))


def test_a_forward_that_raises_on_replay_gets_a_note() -> None:
    model = nn.Sequential(nn.Linear(3, 3), OneShot(), nn.Linear(3, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = nbdebug.trace(model, torch.randn(4, 3), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module) == ("forward", "1")
    assert o.op is None and "op-level replay failed" in o.note and "StopIteration" in o.note


def test_chain_reads_as_text_and_as_records() -> None:
    tr = nbdebug.trace(DivideThenProject(), torch.randn(2, 4), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None
    first = o.chain[0]
    assert first == "Tensor.div (inf)" and "div" in first
    assert first.op == "Tensor.div" and first.value == "inf"
    assert repr(o.chain).startswith("Chain(Tensor.div (inf) -> ")
    assert "chain=Tensor.div (inf) -> " in repr(o)


class LogAttention(nn.Module):
    """Self-attention whose weights go through a square root: finite forward, an
    infinite derivative where a weight is exactly 0 (a padded key)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        _, w = self.attn(x, x, x, key_padding_mask=pad)
        return torch.sqrt(w).sum(-1)


def test_backward_through_a_composite_names_the_elementary_operation() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    pad[1, 2] = True  # softmax gives an exact 0 weight in row 1: sqrt'(0) = inf
    tr = nbdebug.trace(LogAttention(), (x, pad), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None, tr
    assert (o.phase, o.module) == ("backward", "")
    assert o.op == "torch.sqrt" and o.samples == [1]
    assert o.source == line_of(LogAttention.forward, "torch.sqrt")
    assert o.chain[0].value == "inf" and o.chain[-1].value == "NaN"
    assert "multi_head_attention_forward" not in str(o.chain)
    assert "softmax" in str(o.chain)


def _standardise(module: nn.Module, args: tuple) -> tuple:
    h = args[0]
    return ((h - h.mean(1, keepdim=True)) / h.std(1, keepdim=True),)


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_nan_made_by_a_user_hook_belongs_to_the_hooked_call(kind: str) -> None:
    """A forward pre-hook on model[2] (or a forward hook on model[1]) standardises a tensor
    whose rows 2 and 3 are constant: 0/0. The call that ran the hook made the NaN, at the
    hook's line, not the Sequential around it."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        m[0].bias.zero_()
    x = torch.randn(6, 4)
    x[2] = 0.0
    x[3] = 0.0
    if kind == "pre":
        m[2].register_forward_pre_hook(_standardise)
    else:
        m[1].register_forward_hook(lambda mod, a, out: _standardise(mod, (out,))[0])
    tr = nbdebug.trace(m, x, loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None
    assert (o.phase, o.module, o.samples) == ("forward", "2" if kind == "pre" else "1", [2, 3])
    assert o.op == "Tensor.div" and o.source == line_of(_standardise, "/ h.std")
    assert len(m[2]._forward_pre_hooks) == (1 if kind == "pre" else 0)


def test_a_loss_fn_reading_a_model_output_attribute_is_replayed(hf) -> None:
    """The model returns a Hugging Face ModelOutput and loss_fn reads ``out.logits``: the
    loss replay gets the same kind of object (it got a plain dict, so the op and the
    source were lost behind an AttributeError)."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> SequenceClassifierOutput:
            return SequenceClassifierOutput(logits=self.fc(x))

    def loss_fn(out: SequenceClassifierOutput, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits, y)  # every label -100: 0/0

    tr = nbdebug.trace(Head(), torch.randn(5, 4), torch.full((5,), -100), loss_fn)
    o = tr.origin
    assert o is not None and o.phase == "loss"
    assert o.op == "cross_entropy_loss" and o.source == line_of(loss_fn, "cross_entropy(")
    assert "replay failed" not in (o.note or "")


class _WriteNaN(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(h).clone()
        out[[1, 3]] = float("nan")  # an index assignment writes the NaN
        return out


def test_a_nan_written_by_index_assignment_is_named_with_its_line() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), _WriteNaN(), nn.Linear(4, 2))
    tr = nbdebug.trace(m, torch.randn(6, 4), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module, o.samples) == ("forward", "1", [1, 3])
    assert o.op == "Tensor.__setitem__"
    assert o.source == line_of(_WriteNaN.forward, 'out[[1, 3]] = float("nan")')


def _normalise_grad(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
    g = grad_input[0]
    return (g / g.norm(dim=1, keepdim=True),)  # 0/0 for a row whose gradient is zero


def test_a_nan_made_by_a_full_backward_hook_is_named_by_the_hook() -> None:
    """torch runs a module's full backward hooks through its BackwardHookFunction: the
    origin names the user's hook and its definition, not torch's _functions.py, and does
    not call it a hidden NaN."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        m[0].bias.fill_(-10.0)  # every ReLU unit dead: zero gradients reach the hook
    m[1].register_full_backward_hook(_normalise_grad)
    tr = nbdebug.trace(m, torch.randn(6, 4), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module) == ("backward", "1")
    assert o.op == "_normalise_grad"
    assert o.source == line_of(_normalise_grad, "def _normalise_grad")
    assert "full backward hook _normalise_grad" in o.note and "hidden NaN" not in o.note


class _Sqrt(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h)


class _Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.j = torch.jit.script(_Sqrt())
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.j(self.a(x)))


def test_a_nan_made_inside_torchscript_names_no_op_rather_than_a_wrong_one() -> None:
    """A TorchScript submodule takes no Python hooks and runs no Python torch calls: the
    NaN it makes first shows in the parent's next call (the Linear), which did not make
    it. The origin names no op, with a note, never the Linear."""
    torch.manual_seed(0)
    tr = nbdebug.trace(_Scripted(), torch.randn(6, 4), loss_fn=lambda o: o.sum())
    o = tr.origin
    assert o is not None and (o.phase, o.module) == ("forward", "")
    assert o.op is None and o.source is None
    assert "code the op-level replay cannot see (a TorchScript module" in o.note
