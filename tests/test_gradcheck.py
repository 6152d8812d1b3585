"""nbdebug.gradcheck / gradcheck_modules: planted backward bugs are caught and pointed at the
right (output, input) pair; kinks and float precision are told apart from wrong backwards;
nothing the user passed is changed; bad input gets one clear sentence."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.analysis.gradcheck import GradcheckResult, PairCheck, gradcheck, gradcheck_modules

f64 = torch.float64


# --------------------------------------------------------------------------- planted bugs


class Square(torch.autograd.Function):
    """x**2; ``bug`` picks a wrong backward."""

    bug = ""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareWrongSign(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return -2 * x * g


class SquareMissingFactor2(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x * g


class MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g


class MatMulTransposed(MatMul):
    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b, a.t() @ g  # b not transposed (b is square, so the shapes still fit)


class AddBias(torch.autograd.Function):
    """x (N, C) + b (C,), b broadcast over the rows."""

    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, g):
        return g, g.sum(0)


class AddBiasNotSummed(AddBias):
    @staticmethod
    def backward(ctx, g):
        # the broadcast dimension is not summed: only the first row's gradient reaches b
        # (autograd cannot repair this one, unlike a gradient of the un-reduced shape)
        return g, g[0]


class Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x


class MulIgnoresSecond(Mul):
    @staticmethod
    def backward(ctx, g):
        _, y = ctx.saved_tensors
        return g * y, None


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=f64).requires_grad_()

    return {
        "square": (r(5),),
        "matmul": (r(2, 3), r(3, 3)),
        "bias": (r(4, 3), r(3)),
        "mul": (r(3, 2), r(3, 2)),
    }[name]


BUGS = [
    # (buggy fn, correct fn, inputs, the input whose pair must fail, a phrase of the hint)
    (SquareWrongSign.apply, Square.apply, "square", "input[0]", "wrong sign"),
    (SquareMissingFactor2.apply, Square.apply, "square", "input[0]", "0.5 times the true gradient"),
    (MatMulTransposed.apply, MatMul.apply, "matmul", "input[0]", ""),
    (AddBiasNotSummed.apply, AddBias.apply, "bias", "input[1]", ""),
    (MulIgnoresSecond.apply, Mul.apply, "mul", "input[1]", "no gradient"),
]


@pytest.mark.parametrize(("buggy", "correct", "data", "wrong_input", "hint"), BUGS)
def test_planted_bug_is_caught_at_the_right_pair(buggy, correct, data, wrong_input, hint):
    inputs = _inputs(data)
    res = gradcheck(buggy, *inputs)
    assert isinstance(res, GradcheckResult)
    assert not res.ok
    assert res.verdict == "backward is wrong"
    assert [(p.output, p.input) for p in res.failures] == [("output", wrong_input)]
    bad = res.pair("output", wrong_input)
    assert bad.verdict == "backward is wrong" and not bad.close
    # the other inputs' pairs pass
    for p in res.pairs:
        if p.input != wrong_input:
            assert p.verdict == "ok" and p.close, p.message
    # the worst element really is out of tolerance, and its indices address real elements
    r, c = bad.worst
    a, n = bad.analytic[r, c], bad.numerical[r, c]
    assert abs(a - n) > bad.atol + bad.rtol * abs(n)
    j = dict(zip([f"input[{i}]" for i in range(len(inputs))], inputs))[wrong_input]
    at = bad.worst_input_index
    assert at is not None and len(at) == j.ndim
    assert all(0 <= i < s for i, s in zip(at, j.shape))
    assert bad.message.startswith("backward is wrong:")
    assert wrong_input in bad.message
    assert hint in bad.message
    # the correct version passes
    ok = gradcheck(correct, *inputs)
    assert ok.ok and ok.verdict == "ok"
    assert all(p.close for p in ok.pairs)
    assert ok.max_abs_error < 1e-6


def test_jacobians_match_torch_autograd_functional():
    a, b = _inputs("matmul")
    res = gradcheck(MatMulTransposed.apply, a, b)
    ja, jb = torch.autograd.functional.jacobian(lambda x, y: x @ y, (a, b))
    # J[r, c] = d out.flat[r] / d in.flat[c]: the numerical Jacobian is the true one,
    # the analytic one is what the (buggy) backward gives
    np.testing.assert_allclose(
        res.pair(input="input[0]").numerical, ja.reshape(6, 6).numpy(), atol=1e-8
    )
    np.testing.assert_allclose(
        res.pair(input="input[1]").numerical, jb.reshape(6, 9).numpy(), atol=1e-8
    )
    np.testing.assert_allclose(
        res.pair(input="input[1]").analytic, jb.reshape(6, 9).numpy(), atol=1e-12
    )
    wrong = torch.autograd.functional.jacobian(lambda x: MatMulTransposed.apply(x, b), a).reshape(
        6, 6
    )
    np.testing.assert_allclose(res.pair(input="input[0]").analytic, wrong.numpy(), atol=1e-12)


class ScaledSin(torch.autograd.Function):
    factor = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return ScaledSin.factor * x.cos() * g


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 5),
    m=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    factor=st.sampled_from([-1.0, 0.5, 1.1, 2.0]),
)
def test_property_true_jacobian_passes_and_scaled_backward_fails(n, m, seed, factor):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g, dtype=f64).requires_grad_()
    w = torch.randn(m, 3, generator=g, dtype=f64).requires_grad_()

    def fn(a, b):
        return torch.tanh(a @ b) * 2

    res = gradcheck(fn, x, w)
    assert res.verdict == "ok"
    ja, jb = torch.autograd.functional.jacobian(fn, (x, w))
    np.testing.assert_allclose(
        res.pair(input="input[0]").analytic, ja.reshape(n * 3, n * m).numpy(), atol=1e-12
    )
    np.testing.assert_allclose(
        res.pair(input="input[1]").numerical, jb.reshape(n * 3, m * 3).numpy(), atol=1e-7
    )

    ScaledSin.factor = factor
    try:
        bad = gradcheck(ScaledSin.apply, x)
    finally:
        ScaledSin.factor = 1.0
    expected = "backward is wrong" if bool((x.detach().cos().abs() > 0.05).any()) else None
    if expected:
        assert bad.verdict == expected
        assert f"{factor:.4g} times the true gradient" in bad.message or "wrong sign" in bad.message
    assert gradcheck(ScaledSin.apply, x).verdict == "ok"


def test_to_frame_and_repr():
    res = gradcheck(MatMulTransposed.apply, *_inputs("matmul"))
    df = res.to_frame()
    assert list(df["input"]) == ["input[0]", "input[1]"]
    assert list(df["verdict"]) == ["backward is wrong", "ok"]
    for col in (
        "max_abs_error",
        "max_rel_error",
        "worst_output",
        "worst_input",
        "analytic",
        "numerical",
        "message",
    ):
        assert col in df.columns
    row = df.iloc[0]
    p = res.pairs[0]
    assert row["analytic"] == p.analytic[p.worst] and row["numerical"] == p.numerical[p.worst]
    text = repr(res)
    assert "ok=False" in text and "d output / d input[0]" in text and "\n" not in text
    assert "<table" in res._repr_html_()


# --------------------------------------------------------------------------- verdicts


def test_relu_at_exactly_zero_is_a_non_differentiable_point():
    x = torch.tensor([0.0, 1.5, -2.0], dtype=f64, requires_grad=True)
    res = gradcheck(torch.relu, x)
    p = res.pairs[0]
    assert p.verdict == "non-differentiable point"
    assert res.ok  # no evidence of a wrong backward
    assert res.failures == []
    assert p.worst_input_index == (0,)
    assert "kink" in p.message and "input[0][0] = 0" in p.message
    # away from 0 the same function passes
    assert (
        gradcheck(torch.relu, torch.tensor([0.5, 1.5, -2.0], dtype=f64, requires_grad=True)).verdict
        == "ok"
    )


def test_kink_within_eps_is_found_with_a_smaller_step():
    x = torch.tensor([3e-7, 1.0], dtype=f64, requires_grad=True)
    res = gradcheck(torch.relu, x)
    assert res.pairs[0].verdict == "non-differentiable point"
    assert "within eps" in res.pairs[0].message


def test_a_wrong_backward_at_a_kink_is_still_wrong():
    class BadRelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clamp(min=0)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return -g * (x >= 0)  # sign flipped

    x = torch.tensor([0.0, 1.0, 2.0], dtype=f64, requires_grad=True)
    assert gradcheck(BadRelu.apply, x).verdict == "backward is wrong"


def test_float32_inputs_pass_in_float64_and_fail_in_float32():
    x = torch.tensor([0.3, -1.2, 2.5, 0.9], requires_grad=True)  # float32
    res = gradcheck(torch.sin, x)
    p = res.pairs[0]
    assert res.dtype == "float64"
    assert p.close and p.max_abs_error < 1e-6
    assert p.verdict == "float32 precision"
    assert p.native_dtype == "float32"
    assert p.native_max_abs_error is not None and p.native_max_abs_error > 1e-3
    assert res.ok
    assert "passes in float64" in p.message and "float32" in p.message
    # the same check without the float32 re-run just passes
    assert gradcheck(torch.sin, x, native_check=False).verdict == "ok"


def test_rounding_inside_the_function_is_float32_precision():
    x = torch.tensor([0.3, -1.2, 2.5, 0.9], dtype=f64, requires_grad=True)
    res = gradcheck(lambda t: (t.float() ** 3).double(), x)
    p = res.pairs[0]
    assert not p.close
    assert p.verdict == "float32 precision"
    assert res.ok
    assert "shrinks as eps grows" in p.message


def test_wrong_backward_in_float32_is_still_wrong():
    x = torch.tensor([0.3, -1.2, 2.5, 0.9], requires_grad=True)
    res = gradcheck(SquareWrongSign.apply, x)
    assert res.verdict == "backward is wrong"


# --------------------------------------------------------------------------- sampling, fast mode


def test_large_inputs_and_outputs_are_sampled_and_still_caught():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, generator=g, dtype=f64).requires_grad_()
    res = gradcheck(SquareWrongSign.apply, x, max_elements=16)
    p = res.pairs[0]
    assert res.sampled and p.sampled
    assert p.analytic.shape == (16, 16)
    assert any("random subset of 16" in n for n in res.notes)
    # elementwise function: the rows the sampled inputs move are among the checked rows
    assert set(p.cols.tolist()) <= set(p.rows.tolist())
    assert res.verdict == "backward is wrong"
    again = gradcheck(SquareWrongSign.apply, x, max_elements=16)
    assert np.array_equal(again.pairs[0].cols, p.cols)  # seeded
    other = gradcheck(SquareWrongSign.apply, x, max_elements=16, random_state=1)
    assert not np.array_equal(other.pairs[0].cols, p.cols)
    assert gradcheck(Square.apply, x, max_elements=16).ok


def test_fast_mode_checks_random_projections():
    a, b = _inputs("matmul")
    res = gradcheck(MatMulTransposed.apply, a, b, fast=True)
    assert all(p.mode == "projections" and p.analytic.shape == (1, 4) for p in res.pairs)
    assert [p.input for p in res.failures] == ["input[0]"]
    assert gradcheck(MatMul.apply, a, b, fast=True).verdict == "ok"


@pytest.mark.parametrize("fast", [False, True])
def test_each_verdict_names_its_pair_once(fast):
    """The message names the pair as "d output... / d input...", whatever the verdict and the
    mode (fast mode once read "d d output / d input[0]")."""
    x = torch.tensor([0.3, -1.2, 2.5, 0.9], dtype=f64, requires_grad=True)
    cases = {
        "backward is wrong": SquareWrongSign.apply,
        "float32 precision": lambda t: (t.float() ** 3).double(),
    }
    for verdict, fn in cases.items():
        p = gradcheck(fn, x, fast=fast).pairs[0]
        assert p.verdict == verdict
        assert "d d " not in p.message
        assert p.message.count("d output") == 1, p.message
        where = "random projection" if fast else "d output["
        assert where in p.message, p.message


# --------------------------------------------------------------------------- second order


def test_second_order_finds_a_backward_that_is_not_differentiable_correctly():
    class SquareDetached(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x.detach() * g  # right values, but its own gradient wrt x is lost

    x = torch.randn(4, dtype=f64, requires_grad=True)
    first = gradcheck(SquareDetached.apply, x)
    assert first.ok and first.verdict == "ok"
    res = gradcheck(SquareDetached.apply, x, second_order=True)
    assert [(p.order, p.output, p.input) for p in res.failures] == [
        (2, "grad input[0]", "input[0]")
    ]
    assert res.pair("grad input[0]", "grad_output", order=2).verdict == "ok"
    good = gradcheck(Square.apply, x, second_order=True)
    assert good.ok and sum(p.order == 2 for p in good.pairs) == 2


def test_second_order_of_a_once_differentiable_backward_is_reported():
    from torch.autograd.function import once_differentiable

    class Once(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    res = gradcheck(Once.apply, torch.randn(3, dtype=f64, requires_grad=True), second_order=True)
    assert not res.ok
    assert res.second_order_error is not None and "second order" in res.second_order_error


# --------------------------------------------------------------------------- modules


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, -(g.t() @ x)  # the weight gradient has the wrong sign


class BrokenLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.3)

    def forward(self, x):
        return LinearFn.apply(x, self.weight)


def test_wrt_params_and_both():
    layer = BrokenLinear(4, 3)
    x = torch.randn(2, 4)
    res = gradcheck(layer, x, wrt="params")
    assert [p.input for p in res.pairs] == ["weight"]
    assert res.verdict == "backward is wrong"
    both = gradcheck(layer, x.clone().requires_grad_(), wrt="both")
    assert {p.input: p.verdict for p in both.pairs} == {
        "input[0]": "float32 precision",
        "weight": "backward is wrong",
    }
    good = gradcheck(nn.Linear(4, 3), x, wrt="params", native_check=False)
    assert good.verdict == "ok" and [p.input for p in good.pairs] == ["weight", "bias"]


def test_the_module_and_tensors_are_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), BrokenLinear(6, 3)).train()
    first = model[0]
    assert isinstance(first, nn.Linear)
    first.weight.grad = torch.full_like(first.weight, 0.5)
    model[1].weight.requires_grad_(False)
    model[2].eval()  # mixed train/eval flags must survive too
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(1))
    x = torch.randn(5, 4, requires_grad=True)
    x_before = x.detach().clone()
    before = fingerprint(model)
    rng = torch.get_rng_state()

    res = gradcheck(model, x, wrt="both")
    assert res.verdict == "backward is wrong"
    assert [p.input for p in res.failures] == ["3.weight"]
    df = gradcheck_modules(model, x, rows=3)
    assert (df["passed"] == False).sum() == 1  # noqa: E712

    assert_unchanged(before, model)
    assert (
        torch.equal(x.detach(), x_before)
        and x.grad is None
        and x.requires_grad
        and x.dtype == torch.float32
    )
    assert torch.equal(torch.get_rng_state(), rng)
    assert model[0].weight.dtype == torch.float32


def test_in_place_operations_in_fn():
    x = torch.randn(6, dtype=f64, requires_grad=True)
    x_before = x.detach().clone()
    res = gradcheck(nn.ReLU(inplace=True), x)
    assert res.verdict == "ok"
    assert torch.equal(x.detach(), x_before)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
    df = gradcheck_modules(model, torch.randn(4, 3))
    assert list(df["passed"]) == [True, True, True], list(df["reason"])


def test_module_passed_as_bound_forward_runs_on_a_copy():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()
    x = torch.randn(4, 3, requires_grad=True)
    before = fingerprint(model)
    res = gradcheck(model.forward, x, native_check=False)
    assert res.ok and res.dtype == "float64"
    assert_unchanged(before, model)


class OneHot(nn.Module):
    def forward(self, idx):
        return nn.functional.one_hot(idx, 10).to(torch.float32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.onehot = OneHot()
        self.fc1 = nn.Linear(14, 8)
        self.act = nn.Tanh()
        self.broken = BrokenLinear(8, 6)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(6, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, idx):
        h = torch.cat([self.embed(idx), self.onehot(idx)], dim=1)
        return self.out(self.drop(self.broken(self.act(self.fc1(h)))))


def test_module_sweep_finds_the_one_broken_layer():
    torch.manual_seed(0)
    model = Net().train()
    idx = torch.randint(0, 10, (16,))
    calls = []
    df = gradcheck_modules(model, idx, rows=2, progress=lambda d, t, n: calls.append((d, t, n)))
    assert list(df.columns) == [
        "module",
        "type",
        "passed",
        "verdict",
        "max_error",
        "seconds",
        "reason",
    ]
    by = df.set_index("module")
    assert list(df.loc[df["passed"] == False, "module"]) == ["broken"]  # noqa: E712
    assert by.loc["broken", "verdict"] == "backward is wrong"
    assert "weight" in by.loc["broken", "reason"]
    for name in ("embed", "fc1", "act", "drop", "out"):
        assert by.loc[name, "passed"] is True, (name, by.loc[name, "reason"])
    assert by.loc["onehot", "passed"] is None
    assert "no floating-point input or parameter" in by.loc["onehot", "reason"]
    assert (
        by.loc["unused", "passed"] is None
        and by.loc["unused", "reason"] == "not called in the forward pass"
    )
    assert (df["seconds"] >= 0).all()
    results = df.attrs["results"]
    assert set(results) == {"embed", "fc1", "act", "broken", "drop", "out"}
    assert results["fc1"].pairs[0].input_shape == (2, 14)  # the first 2 rows reached it
    assert [p.input for p in results["embed"].pairs] == ["weight"]  # integer input: a constant
    assert [c[0] for c in calls] == list(range(1, len(df) + 1)) and all(
        c[1] == len(df) for c in calls
    )


def test_module_sweep_treats_non_finite_float_inputs_as_constants():
    class MaskedSoftmax(nn.Module):
        def forward(self, x, mask):
            return torch.softmax(x + mask, dim=-1)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.soft = MaskedSoftmax()

        def forward(self, x, mask):
            return self.soft(self.proj(x), mask=mask)

    mask = torch.zeros(3, 4)
    mask[:, -1] = float("-inf")
    df = gradcheck_modules(Masked(), (torch.randn(3, 4), mask), rows=2)
    assert list(df["module"]) == ["proj", "soft"]
    assert list(df["passed"]) == [True, True], list(df["reason"])
    res = df.attrs["results"]["soft"]
    assert [p.input for p in res.pairs] == ["input[0]"]  # the -inf mask (a keyword) is a constant
    finite = gradcheck_modules(Masked(), (torch.randn(3, 4), torch.zeros(3, 4)), rows=2)
    assert [p.input for p in finite.attrs["results"]["soft"].pairs] == ["input[0]", "mask"]


def test_module_sweep_bad_input():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        gradcheck_modules(lambda x: x, torch.randn(2, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows must be a positive int"):
        gradcheck_modules(nn.Linear(3, 3), torch.randn(2, 3), rows=0)

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x)[:, 10]

    boom = Boom().train()
    x = torch.randn(4, 3)
    before = fingerprint(boom)
    with pytest.raises(
        ValueError, match=r"the model raised IndexError .*Executed modules up to: a\."
    ) as e:
        gradcheck_modules(boom, x)
    assert "\n" not in str(e.value)
    assert_unchanged(before, boom)  # no hook left behind, flags as before


# --------------------------------------------------------------------------- bad input


def _one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".") and len(msg) < 400, msg
    return msg


@pytest.mark.parametrize("x", [torch.tensor([1, 2, 3]), torch.tensor([True, False])])
def test_integer_and_boolean_inputs(x):
    with pytest.raises(TypeError) as e:
        gradcheck(torch.sin, x)
    msg = _one_sentence(e)
    assert "integer or boolean" in msg and str(x.dtype).replace("torch.", "") in msg


def test_inputs_that_do_not_require_grad():
    with pytest.raises(ValueError) as e:
        gradcheck(torch.sin, torch.randn(3))
    assert "requires_grad" in _one_sentence(e)
    with pytest.raises(ValueError) as e:
        gradcheck(nn.Linear(3, 2), torch.randn(2, 3))
    assert "wrt='params'" in _one_sentence(e)
    with pytest.raises(ValueError) as e:
        gradcheck(torch.sin)
    assert "no inputs" in _one_sentence(e)
    # an empty input would check nothing: refused rather than reported as a pass
    with pytest.raises(ValueError) as e:
        gradcheck(torch.sin, torch.empty(0, 3, dtype=torch.float64, requires_grad=True))
    assert "is empty (input[0]: (0, 3))" in _one_sentence(e)


class _DropsOne(ScaledSin):
    """ScaledSin's forward; a backward that drops one element's gradient."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        d = x.cos()
        d.view(-1)[7] = 0.0  # one element's gradient dropped
        return g * d


def test_a_gradient_dropped_for_one_element_is_not_called_missing():
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    r = gradcheck(_DropsOne.apply, x)
    assert r.verdict == "backward is wrong"
    assert "gives 0 at 1 of 256 Jacobian entries for input[0]" in r.message
    assert "no gradient for input[0]" not in r.message
    # with every element dropped it is "no gradient"
    r = gradcheck(lambda t: _DropsOne.apply(t) * 0 + t.detach().sin(), x)
    assert "no gradient for input[0]" in r.message


@pytest.mark.parametrize("fn", [lambda x: float(x.sum()), lambda x: [1, 2], lambda x: x.argmax()])
def test_function_returning_a_non_tensor(fn):
    with pytest.raises(TypeError) as e:
        gradcheck(fn, torch.randn(3, dtype=f64, requires_grad=True))
    msg = _one_sentence(e)
    assert "tensor" in msg and "returned" in msg


def test_non_deterministic_function():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    with pytest.raises(ValueError) as e:
        gradcheck(model, torch.randn(3, 4, requires_grad=True))
    msg = _one_sentence(e)
    assert "not deterministic" in msg and "dropout" in msg and "eval()" in msg
    assert gradcheck(model.eval(), torch.randn(3, 4, requires_grad=True), native_check=False).ok


def test_other_bad_calls():
    x = torch.randn(3, dtype=f64, requires_grad=True)
    with pytest.raises(TypeError, match=r"pass Square\.apply"):
        gradcheck(Square, x)
    with pytest.raises(TypeError, match="must be a function"):
        gradcheck(42, x)
    with pytest.raises(TypeError, match=r"needs fn to be an nn\.Module"):
        gradcheck(torch.sin, x, wrt="params")
    with pytest.raises(ValueError, match="wrt must be one of"):
        gradcheck(torch.sin, x, wrt="weights")
    with pytest.raises(ValueError, match="eps must be > 0"):
        gradcheck(torch.sin, x, eps=0)
    with pytest.raises(ValueError, match="max_elements"):
        gradcheck(torch.sin, x, max_elements=0)
    with pytest.raises(TypeError, match="complex"):
        gradcheck(torch.sin, torch.randn(2, dtype=torch.complex64, requires_grad=True))
    with pytest.raises(ValueError, match="non-finite"):
        gradcheck(torch.sqrt, torch.tensor([-1.0, 1.0], dtype=f64, requires_grad=True))


def test_raising_function_and_backward_give_one_sentence():
    class BadBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward exploded\nwith a long story")

    x = torch.randn(3, dtype=f64, requires_grad=True)
    with pytest.raises(ValueError) as e:
        gradcheck(BadBackward.apply, x)
    msg = _one_sentence(e)
    assert "the backward of BadBackward.apply raised RuntimeError: backward exploded" in msg
    assert isinstance(e.value.__cause__, RuntimeError)

    def bad(t):
        raise KeyError("nope")

    with pytest.raises(ValueError, match="bad raised KeyError"):
        gradcheck(bad, x)


def test_public_names():
    assert nbdebug.gradcheck is gradcheck
    assert nbdebug.gradcheck_modules is gradcheck_modules
    assert nbdebug.GradcheckResult is GradcheckResult
    res = gradcheck(Square.apply, torch.randn(2, dtype=f64, requires_grad=True))
    assert isinstance(res.pairs[0], PairCheck) and res.fn_name == "Square.apply"
    assert copy.deepcopy(res).pairs[0].verdict == "ok"


def test_module_sweep_names_modules_and_skips_those_fed_nan():
    """A module making NaN is named as "module 1 (Nan)"; the module after it, fed that NaN,
    is not blamed for it: it is skipped, saying its input already held NaN."""

    class Nan(nn.Module):
        def forward(self, x):
            return x * float("nan")

    model = nn.Sequential(nn.Linear(3, 3), Nan(), nn.Linear(3, 2)).double()
    df = gradcheck_modules(model, torch.randn(4, 3, dtype=f64), rows=2).set_index("module")
    assert df.loc["0", "passed"]
    assert df.loc["1", "reason"].startswith("could not be checked: module 1 (Nan) returned 6")
    assert "non-finite values in output" in df.loc["1", "reason"]
    assert df.loc["2", "reason"] == (
        "not checked: its inputs already hold 6 NaN (made before it, by an earlier module or "
        "the batch)"
    )
