"""GradcheckOptions: every bad option gets one sentence saying what was expected and what was
given, and gradcheck / gradcheck_modules pass their keywords through it; the tolerance
``atol + rtol * |numerical|`` is the rule that decides which elements pass."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from nbdebug.analysis.gradcheck import GradcheckOptions, PairCheck, gradcheck, gradcheck_modules
from nbdebug.analysis.gradcheck.verdicts import (
    BACKWARD_WRONG,
    FLOAT32_PRECISION,
    NON_DIFFERENTIABLE,
    OK,
    SKIPPED,
    VERDICTS,
    out_of_tolerance,
    score,
    tolerance,
    tolerance_ratio,
)
from nbdebug.figures.gradcheck import VERDICT_COLOR

f64 = torch.float64

# --------------------------------------------------------------------------- validate()

BAD = [
    # (option, bad value, what the sentence must say is expected)
    ("eps", 0, "eps must be > 0 and finite"),
    ("eps", -1e-6, "eps must be > 0 and finite"),
    ("eps", math.inf, "eps must be > 0 and finite"),
    ("eps", math.nan, "eps must be > 0 and finite"),
    ("eps", "1e-6", "eps must be > 0 and finite"),
    ("eps", True, "eps must be > 0 and finite"),
    ("atol", -1.0, "atol must be a finite number >= 0"),
    ("atol", math.inf, "atol must be a finite number >= 0"),
    ("atol", None, "atol must be a finite number >= 0"),
    ("rtol", math.nan, "rtol must be a finite number >= 0"),
    ("rtol", "0.1", "rtol must be a finite number >= 0"),
    ("wrt", "weights", "wrt must be one of ('inputs', 'params', 'both')"),
    ("wrt", None, "wrt must be one of ('inputs', 'params', 'both')"),
    ("max_elements", 0, "max_elements must be a positive int"),
    ("max_elements", -3, "max_elements must be a positive int"),
    ("max_elements", 2.5, "max_elements must be a positive int"),
    ("max_elements", True, "max_elements must be a positive int"),
    ("random_state", -1, "random_state must be an int >= 0"),
    ("random_state", 1.5, "random_state must be an int >= 0"),
    ("random_state", None, "random_state must be an int >= 0"),
    ("fixed_seed", -2, "fixed_seed must be an int >= 0 or None"),
    ("fixed_seed", "0", "fixed_seed must be an int >= 0 or None"),
    ("second_order", 1, "second_order must be True or False"),
    ("fast", "yes", "fast must be True or False"),
    ("native_check", None, "native_check must be True or False"),
    ("all_float", 0, "all_float must be True or False"),
    ("param_recurse", "no", "param_recurse must be True or False"),
]


@pytest.mark.parametrize(("name", "value", "expected"), BAD, ids=lambda v: repr(v))
def test_each_bad_option_is_one_sentence_with_what_was_expected_and_given(name, value, expected):
    options = GradcheckOptions(**{name: value})
    with pytest.raises(ValueError) as e:
        options.validate()
    msg = str(e.value)
    assert msg == f"{expected}; got {value!r}.", msg
    assert "\n" not in msg


def test_good_options_validate_and_are_frozen():
    options = GradcheckOptions()
    assert options.validate() is options
    for good in (
        GradcheckOptions(eps=1, atol=0, rtol=0.0, max_elements=1, random_state=0),
        GradcheckOptions(eps=np.float32(1e-3), max_elements=np.int64(7), fixed_seed=3),
        GradcheckOptions(wrt="both", second_order=True, fast=True, native_check=False),
    ):
        assert good.validate() is good
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.eps = 1.0  # type: ignore[misc]


def test_module_sweep_options():
    base = GradcheckOptions(eps=2e-6, atol=3e-5, rtol=4e-3, max_elements=9, random_state=5)
    sweep = base.for_module_sweep()
    assert (sweep.wrt, sweep.all_float, sweep.param_recurse, sweep.native_check) == (
        "both",
        True,
        False,
        False,
    )
    assert sweep.fixed_seed == 5  # one dropout mask, from the sweep's seed
    assert (sweep.eps, sweep.atol, sweep.rtol, sweep.max_elements, sweep.random_state) == (
        2e-6,
        3e-5,
        4e-3,
        9,
        5,
    )
    assert base.wrt == "inputs" and base.fixed_seed is None  # base unchanged
    assert sweep.validate() is sweep


def test_gradcheck_and_the_sweep_reject_bad_options_with_the_same_sentence():
    x = torch.randn(3, dtype=f64, requires_grad=True)
    for kw in ({"rtol": -1.0}, {"eps": math.nan}, {"max_elements": 0}, {"fast": "yes"}):
        with pytest.raises(ValueError) as want:
            GradcheckOptions(**kw).validate()  # type: ignore[arg-type]
        with pytest.raises(ValueError) as got:
            gradcheck(torch.sin, x, **kw)  # type: ignore[arg-type]
        assert str(got.value) == str(want.value)
        with pytest.raises(ValueError) as got_sweep:
            gradcheck_modules(nn.Linear(3, 2), torch.randn(2, 3), **kw)  # type: ignore[arg-type]
        assert str(got_sweep.value) == str(want.value)
    with pytest.raises(ValueError, match=r"^native_check must be True or False; got 1\.$"):
        gradcheck(torch.sin, x, native_check=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^random_state must be an int >= 0; got -1\.$"):
        gradcheck_modules(nn.Linear(3, 2), torch.randn(2, 3), random_state=-1)


def test_gradcheck_keywords_reach_the_check():
    x = torch.randn(6, dtype=f64, requires_grad=True)
    res = gradcheck(torch.sin, x, eps=2e-6, atol=3e-5, rtol=4e-3, max_elements=4)
    assert (res.eps, res.atol, res.rtol, res.wrt) == (2e-6, 3e-5, 4e-3, "inputs")
    p = res.pairs[0]
    assert (p.atol, p.rtol) == (3e-5, 4e-3)
    assert p.cols.size == 4 and p.sampled and res.sampled  # max_elements=4 of 6 inputs
    other = gradcheck(torch.sin, x, max_elements=4, random_state=1).pairs[0]
    seeds = {
        tuple(gradcheck(torch.sin, x, max_elements=4, random_state=s).pairs[0].cols)
        for s in range(6)
    }
    assert len(seeds) > 1 and tuple(other.cols) in seeds  # the seed picks the subset
    fast = gradcheck(torch.sin, x, fast=True)
    assert fast.fast and not fast.second_order
    assert {(p.mode, p.order) for p in fast.pairs} == {("projections", 1)}
    second = gradcheck(torch.sin, x, second_order=True)
    assert second.second_order and not second.fast
    assert {(p.mode, p.order) for p in second.pairs} == {("elements", 1), ("elements", 2)}
    x32 = torch.randn(3, requires_grad=True)
    assert gradcheck(torch.sin, x32).pairs[0].native_dtype == "float32"
    assert gradcheck(torch.sin, x32, native_check=False).pairs[0].native_dtype is None
    lin = nn.Linear(3, 2).double()
    both = gradcheck(lin, torch.randn(2, 3, dtype=f64, requires_grad=True), wrt="both")
    assert [p.input for p in both.pairs] == ["input[0]", "weight", "bias"]
    df = gradcheck_modules(
        nn.Sequential(nn.Linear(4, 3)),
        torch.randn(2, 4),
        eps=2e-6,
        atol=3e-5,
        rtol=4e-3,
        max_elements=5,
    )
    (sweep,) = df.attrs["results"].values()
    assert (sweep.eps, sweep.atol, sweep.rtol, sweep.wrt) == (2e-6, 3e-5, 4e-3, "both")
    assert max(p.cols.size for p in sweep.pairs) == 5  # the 12 weights: 5 of them


# --------------------------------------------------------------------------- the tolerance


def test_tolerance_is_atol_plus_rtol_times_abs_numerical():
    n = np.array([0.0, -2.0, 4.0])
    np.testing.assert_allclose(tolerance(n, 1e-3, 0.1), [1e-3, 0.201, 0.401], rtol=1e-15)
    assert tolerance(-5.0, 0.5, 0.2) == pytest.approx(1.5)
    assert tolerance(np.zeros((2, 3)), 0.25, 9.0).shape == (2, 3)


def test_an_element_on_the_tolerance_passes_and_one_beyond_fails():
    # atol=0.5, rtol=0.25 (exact in binary): tolerances 1.0, 1.5 and 0.5
    n = np.array([[2.0, -4.0, 0.0]])
    on = np.array([[3.0, -5.5, 0.5]])
    assert not out_of_tolerance(on, n, 0.5, 0.25).any()
    beyond = on + np.array([[0.0, -1e-9, 0.0]])
    assert list(out_of_tolerance(beyond, n, 0.5, 0.25)[0]) == [False, True, False]
    assert out_of_tolerance(np.array([np.nan]), np.array([1.0]), 0.5, 0.25).all()

    def pair(a: np.ndarray) -> PairCheck:
        p = PairCheck(
            output="output",
            input="input[0]",
            analytic=a,
            numerical=n,
            rows=np.array([0]),
            cols=np.arange(3),
            output_shape=(1,),
            input_shape=(3,),
            atol=0.5,
            rtol=0.25,
        )
        score(p)
        return p

    p = pair(on)
    assert p.close and p.verdict == OK and p.ok
    np.testing.assert_allclose(tolerance_ratio(p), [[1.0, 1.0, 1.0]])
    q = pair(beyond)
    assert not q.close and q.verdict == BACKWARD_WRONG and q.worst == (0, 1)
    assert tolerance_ratio(q)[0, 1] > 1.0


class _Scaled(torch.autograd.Function):
    """y = 1000 x, with a backward ``factor`` times the true one."""

    factor = 1.0

    @staticmethod
    def forward(ctx, x):
        return 1000.0 * x

    @staticmethod
    def backward(ctx, g):
        return 1000.0 * _Scaled.factor * g


@pytest.mark.parametrize(
    ("factor", "passes"), [(1 + 5e-4, True), (1 - 5e-4, True), (1 + 2e-3, False)]
)
def test_gradcheck_applies_the_relative_tolerance(factor, passes, monkeypatch):
    # |error| = 1000 * |factor - 1| is far above atol=0 but within rtol * |1000| when
    # |factor - 1| <= rtol: the tolerance scales with the numerical derivative
    monkeypatch.setattr(_Scaled, "factor", factor)
    x = torch.randn(3, dtype=f64, requires_grad=True)
    res = gradcheck(_Scaled.apply, x, atol=0.0, rtol=1e-3)
    p = res.pairs[0]
    assert p.close is passes and res.ok is passes
    assert p.close == (not out_of_tolerance(p.analytic, p.numerical, p.atol, p.rtol).any())
    assert p.max_abs_error == pytest.approx(1000 * abs(factor - 1), rel=1e-3)


# --------------------------------------------------------------------------- verdict names


def test_verdict_names_have_one_home():
    assert VERDICTS == (OK, BACKWARD_WRONG, NON_DIFFERENTIABLE, FLOAT32_PRECISION)
    assert set(VERDICT_COLOR) == {*VERDICTS, SKIPPED}

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 3), nn.ReLU()

        def forward(self, x):
            return self.used(x)

    df = gradcheck_modules(Half(), torch.randn(2, 3))
    assert list(df["module"]) == ["used", "unused"]
    assert list(df["verdict"]) == [OK, SKIPPED]  # "unused" is not called


def test_an_unknown_keyword_names_itself_and_the_allowed_ones():
    x = torch.randn(3, dtype=f64, requires_grad=True)
    with pytest.raises(
        TypeError, match=r"gradcheck\(\) got an unexpected keyword argument 'tol'.*eps"
    ):
        gradcheck(torch.sin, x, tol=1e-3)
    with pytest.raises(TypeError, match="'all_float'"):  # the sweep's own field is not public
        gradcheck(torch.sin, x, all_float=True)
    with pytest.raises(TypeError, match=r"gradcheck_modules\(\) got .* 'wrt'.*rows, eps"):
        gradcheck_modules(nn.Linear(3, 2), torch.randn(2, 3), wrt="both")
    import nbdebug

    with pytest.raises(TypeError, match=r"check\(\) got an unexpected keyword argument 'x'"):
        nbdebug.check(nn.Linear(3, 2), x=torch.randn(2, 3))
    res = gradcheck(torch.sin, x)
    assert res.ok and res.summary().startswith("gradcheck of sin: ok, 1 pairs agree")
