"""Tensor statistics against numpy, on random arrays with NaN/Inf sprinkled (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import nbdebug
from nbdebug.core import measure, stats
from nbdebug.core.measure import exact_vector, quick_vector, tensor_stats
from nbdebug.core.stats import (
    HIST_EDGES,
    HIST_SAMPLE,
    finalize,
    row_flags,
    vector_is_finite,
)

finite_floats = st.floats(-1e6, 1e6, allow_nan=False, width=32)
specials = st.sampled_from([np.nan, np.inf, -np.inf, 0.0])


@st.composite
def sprinkled(draw: st.DrawFn) -> np.ndarray:
    shape = draw(st.tuples(st.integers(1, 7), st.integers(1, 9)))
    a = draw(arrays(np.float32, shape, elements=finite_floats))
    n_special = draw(st.integers(0, a.size))
    idx = draw(st.lists(st.integers(0, a.size - 1), min_size=n_special, max_size=n_special))
    vals = draw(st.lists(specials, min_size=len(idx), max_size=len(idx)))
    flat = a.reshape(-1)
    for i, v in zip(idx, vals):
        flat[i] = v
    return a


def _expected(a: np.ndarray) -> dict[str, float]:
    a64 = a.astype(np.float64)
    fin = a64[np.isfinite(a64)]
    return {
        "n_nan": int(np.isnan(a64).sum()),
        "n_inf": int(np.isinf(a64).sum()),
        "norm": float(np.sqrt((fin**2).sum())) if fin.size else 0.0,
        "mean": float(fin.mean()) if fin.size else float("nan"),
        "std": float(fin.std()) if fin.size else float("nan"),
        "min": float(fin.min()) if fin.size else float("nan"),
        "max": float(fin.max()) if fin.size else float("nan"),
        "zero_frac": float((a64 == 0).sum() / a64.size),
    }


def _close(a: float, b: float, scale: float) -> bool:
    if np.isnan(b):
        return bool(np.isnan(a))
    return abs(a - b) <= 1e-4 * max(scale, 1.0)


@settings(max_examples=150, deadline=None)
@given(sprinkled())
def test_exact_stats_match_numpy(a: np.ndarray) -> None:
    s = tensor_stats(torch.from_numpy(a))
    e = _expected(a)
    scale = float(np.abs(a[np.isfinite(a)]).max()) if np.isfinite(a).any() else 1.0
    assert s.n_nan == e["n_nan"] and s.n_inf == e["n_inf"]
    assert s.finite == (e["n_nan"] == 0 and e["n_inf"] == 0)
    for k in ("norm", "mean", "min", "max"):
        assert _close(getattr(s, k), e[k], scale * (a.size if k == "norm" else 1)), (
            k,
            getattr(s, k),
            e[k],
        )
    if not np.isnan(e["std"]):
        assert abs(s.std - e["std"]) <= 1e-3 * max(scale, 1.0)
    assert s.zero_frac == pytest.approx(e["zero_frac"])
    assert (
        s.absmax == pytest.approx(max(abs(e["min"]), abs(e["max"])))
        if not np.isnan(e["min"])
        else True
    )


@settings(max_examples=150, deadline=None)
@given(sprinkled())
def test_quick_vector_agrees_on_finiteness_and_matches_finite_stats(a: np.ndarray) -> None:
    t = torch.from_numpy(a)
    q = quick_vector(t)
    assert vector_is_finite(q) == bool(np.isfinite(a).all())
    if np.isfinite(a).all():
        qs, _ = finalize(q)
        es, _ = finalize(exact_vector(t).numpy())
        for k in ("norm", "mean", "min", "max", "zero_frac"):
            assert getattr(qs, k) == pytest.approx(getattr(es, k), rel=1e-5, abs=1e-5)


@settings(max_examples=100, deadline=None)
@given(sprinkled())
def test_histogram_counts_every_element_once(a: np.ndarray) -> None:
    _, h = finalize(exact_vector(torch.from_numpy(a)).numpy())
    assert h.counts.sum() + h.n_zero + h.n_nonfinite == a.size == h.total
    mags = np.abs(a[np.isfinite(a) & (a != 0)]).astype(np.float64)
    expected = np.histogram(
        np.clip(np.log10(mags), HIST_EDGES[0], HIST_EDGES[-1] - 1e-9), HIST_EDGES
    )[0]
    assert np.array_equal(h.counts, expected)


@settings(max_examples=100, deadline=None)
@given(sprinkled())
def test_row_flags(a: np.ndarray) -> None:
    flags = row_flags(torch.from_numpy(a), 0).numpy()
    assert np.array_equal(flags, ~np.isfinite(a).all(axis=1))
    flags1 = row_flags(torch.from_numpy(a), 1).numpy()
    assert np.array_equal(flags1, ~np.isfinite(a).all(axis=0))


def test_dtypes_half_int_bool_complex_empty() -> None:
    h = torch.tensor([1.0, 60000.0, -2.0], dtype=torch.float16)
    assert tensor_stats(h).max == 60000.0
    i = torch.tensor([1, 2, 3])
    assert tensor_stats(i).mean == 2.0
    b = torch.tensor([True, False])
    assert tensor_stats(b).zero_frac == 0.5
    c = torch.tensor([3 + 4j])
    assert tensor_stats(c).norm == pytest.approx(5.0)
    e = torch.zeros(0, 3)
    s = tensor_stats(e)
    assert s.numel == 0 and s.finite
    assert vector_is_finite(quick_vector(e))


def test_quick_histogram_is_sampled_for_big_tensors() -> None:
    t = torch.randn(100_000)
    _, h = finalize(quick_vector(t))
    assert h.sampled and h.total <= HIST_SAMPLE + 1
    _, h2 = finalize(quick_vector(torch.randn(100)))
    assert not h2.sampled and h2.total == 100


def test_all_quick_complete_agrees_with_quick_is_complete_vector_by_vector():
    # quick vectors (counts not taken) and exact ones (counted), finite or not, with a
    # float32 sum or norm overflowed to inf
    def vec(t: torch.Tensor, counted: bool) -> np.ndarray:
        return measure.exact_vector(t).numpy() if counted else measure.quick_vector(t)

    cases = {
        "finite": torch.randn(50),
        "nan": torch.tensor([1.0, float("nan")]),
        "inf": torch.tensor([1.0, float("inf")]),
        "-inf": torch.tensor([-float("inf"), 2.0]),
        "overflowed": torch.full((4,), 3e38),
    }
    vectors = {(k, c): vec(t, c) for k, t in cases.items() for c in (False, True)}
    # complete: finite, and the sums did not overflow (the exact kernel sums in float64)
    for (case, counted), v in vectors.items():
        expected = case == "finite" or (case == "overflowed" and counted)
        assert stats.quick_is_complete(v) is expected, (case, counted)
        assert stats.vector_is_finite(v) is (case in ("finite", "overflowed")), (case, counted)
    assert stats.all_quick_complete([]) is True
    keys = list(vectors)
    rng = np.random.default_rng(0)
    for _ in range(200):
        pick = [keys[i] for i in rng.integers(0, len(keys), size=rng.integers(1, 6))]
        vs = [vectors[k] for k in pick]
        assert stats.all_quick_complete(vs) == all(stats.quick_is_complete(v) for v in vs), pick
        # the recorder hands its vectors over as one matrix: same answers
        assert stats.all_quick_complete(np.vstack(vs)) == stats.all_quick_complete(vs), pick
        got = stats.finalize_many(np.vstack(vs))
        for (got_st, h), v in zip(got, vs):
            want, want_h = stats.finalize(v)
            assert repr(got_st) == repr(want) and np.array_equal(h.counts, want_h.counts), pick
    assert stats.all_quick_complete(np.zeros((0, stats.VECTOR_LEN))) is True
    assert stats.finalize_many(np.zeros((0, stats.VECTOR_LEN))) == []


@pytest.mark.parametrize("scale", [1e-20, 1e-25, 1e-30, 1e-40])
@pytest.mark.parametrize("n", [500, 5000])
def test_norm_of_tiny_values_is_not_zero(scale: float, n: int) -> None:
    """Squares of float32 values below ~1e-19 round to 0 in float32: the norm of a
    vanishing tensor must not read as that of a zero one. The exact kernel squares in
    float64; the eager quick pass squares its sample in float64 (exact up to HIST_SAMPLE
    elements, an estimate past it), without sending the step to the exact pass."""
    a = (np.random.default_rng(0).normal(size=n) * scale).astype(np.float32)
    t = torch.from_numpy(a)
    want = float(np.sqrt((a.astype(np.float64) ** 2).sum()))
    assert want > 0
    assert tensor_stats(t).norm == pytest.approx(want, rel=1e-6)
    q = quick_vector(t)
    assert stats.all_quick_complete([q])
    got = finalize(q)[0].norm
    if n <= stats.HIST_SAMPLE:
        assert got == pytest.approx(want, rel=1e-6)
    else:
        assert got == pytest.approx(want, rel=0.1)


def test_a_tiny_gradient_is_measured_not_zeroed() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(5, 3)
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum() * 1e-25)
    model(x).sum().mul(1e-25).backward()
    pf = tr.params_frame()
    for name, p in model.named_parameters():
        want = float(p.grad.double().norm())
        assert pf.loc[name, "grad_norm"] == pytest.approx(want, rel=1e-5), name


def test_constant_tensors_have_std_zero() -> None:
    """All elements equal: std is 0 exactly, not what E[x^2] - mean^2 rounds to."""
    for value, n in ((0.1, 1), (1000.0, 4096), (3.3, 7)):
        t = torch.full((n,), value)
        assert tensor_stats(t).std == 0.0
        assert finalize(quick_vector(t))[0].std == 0.0


def test_finite_counting_is_one_set_of_helpers() -> None:
    """count_nonfinite / has_nonfinite / has_nan / is_finite_number: the one home of
    "is this finite" (complex by magnitude, integers hold none, modes bypassed)."""
    from torch.overrides import TorchFunctionMode

    from nbdebug.core.stats import count_nonfinite, has_nan, has_nonfinite, is_finite_number

    t = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), 0.0])
    assert count_nonfinite(t) == (1, 2)
    assert count_nonfinite(torch.arange(3)) == (0, 0)
    assert count_nonfinite(torch.tensor([complex(float("inf"), 0.0), 1j])) == (0, 1)
    assert count_nonfinite(torch.empty(0)) == (0, 0)
    assert has_nonfinite(t) and has_nan(t)
    assert has_nonfinite(torch.tensor([float("inf")])) and not has_nan(torch.tensor([float("inf")]))
    assert not has_nonfinite(torch.ones(3)) and not has_nonfinite("x") and not has_nan(None)

    class Seen(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
            Seen.calls += 1
            return func(*args, **(kwargs or {}))

    with Seen():
        assert count_nonfinite(t) == (1, 2) and has_nonfinite(t) and has_nan(t)
    assert Seen.calls == 0

    for good in (1, 1.5, np.float32(2.0), np.int64(3), torch.tensor(3.0), torch.tensor([4])):
        assert is_finite_number(good), good
    bad = (None, True, np.bool_(True), "1", float("nan"), -float("inf"), torch.ones(2), [1.0])
    for x in bad:
        assert not is_finite_number(x), x
