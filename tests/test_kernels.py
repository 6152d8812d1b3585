"""The compiled statistics kernel (nbdebug.core.kernels): built here once (about a minute),
then held to the eager statistics, tensor by tensor and trace by trace."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import nbdebug
from nbdebug import cli
from nbdebug.core import kernels, measure, stats

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and not os.environ.get("CXX"),
    reason="building the kernel needs a C++ compiler (c++ or $CXX)",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("nbdebug-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("NBDEBUG_CACHE", str(cache))
    mp.delenv(kernels.ENV, raising=False)
    assert not kernels.active()  # nothing is compiled unless asked
    lib = kernels.build()
    yield lib
    mp.undo()


@pytest.fixture
def compiled(built, monkeypatch):
    monkeypatch.setenv("NBDEBUG_CACHE", str(built.parent.parent.parent))
    assert kernels.active()
    return built


def eager_vector(t: torch.Tensor, monkeypatch) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setenv(kernels.ENV, "eager")
        assert not kernels.active()
        return measure.quick_vector(t)


def reference(t: torch.Tensor) -> tuple[float, float, float, float]:
    x = t.detach().double()
    return float(x.sum()), float(x.norm()), float(x.min()), float(x.max())


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# around the kernel's 16 lanes, its 2,048-element blocks and its 65,536-element tasks
SIZES = [1, 15, 16, 17, 1023, 1025, 2047, 2049, 65536 * 2 + 17, 300001]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_statistics_equal_float64_references_and_the_eager_ones(
    compiled, monkeypatch, dtype, threads
):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in SIZES:
            t = (torch.randn(n) * 3 + 0.5).to(dtype)
            v = measure.quick_vector(t)
            e = eager_vector(t, monkeypatch)
            total, norm, lo, hi = reference(t)
            assert v[stats.IDX_MIN] == lo and v[stats.IDX_MAX] == hi, (n, dtype)
            assert v[stats.IDX_SUM] == pytest.approx(total, rel=1e-5, abs=1e-4 * norm)
            assert v[stats.IDX_NORM] == pytest.approx(norm, rel=1e-5)
            # the sample, hence the histogram and the zero share, is the same elements
            np.testing.assert_array_equal(v[stats.IDX_HIST0 :], e[stats.IDX_HIST0 :])
            assert v[stats.IDX_NNZ] == e[stats.IDX_NNZ]
            assert stats.quick_is_complete(v)
    finally:
        torch.set_num_threads(before)


def test_the_compiled_kernel_takes_dense_cpu_tensors_and_leaves_the_rest_to_eager(compiled):
    x = torch.randn(8, 3, 16, 16)
    assert len(measure.quick_parts(x)) == 1  # compiled: one row, histogram included
    assert len(measure.quick_parts(x.transpose(0, 3))) == 1  # dense, permuted
    assert len(measure.quick_parts(x.to(memory_format=torch.channels_last))) == 1
    strided = x[:, :, ::2]
    assert len(measure.quick_parts(strided)) == 5  # not dense: eager
    assert len(measure.quick_parts(torch.arange(10))) == 1  # integers are measured as float64
    # a tensor that requires grad is read as it is, and no graph grows from the reading
    w = torch.randn(5, 7, requires_grad=True)
    (row,) = measure.quick_parts(w)
    assert row.grad_fn is None and not row.requires_grad
    assert (row[2].item(), row[3].item()) == (float(w.detach().min()), float(w.detach().max()))
    assert measure.quick_parts(torch.empty(0)) == ()
    for t in (x.transpose(0, 3), strided):
        _, norm, lo, hi = reference(t)
        v = measure.quick_vector(t)
        assert (v[stats.IDX_MIN], v[stats.IDX_MAX]) == (lo, hi)
        assert v[stats.IDX_NORM] == pytest.approx(norm, rel=1e-5)
    # a batch of mixed forms assembles into one matrix, each row in its place
    rows = measure.assemble_quick(
        [measure.quick_parts(strided), measure.quick_parts(x), ()], [strided.numel(), x.numel(), 0]
    )
    assert rows[0][stats.IDX_MAX] == float(strided.max())
    assert rows[1][stats.IDX_MAX] == float(x.max())
    assert np.isnan(rows[2][stats.IDX_MAX])


@pytest.mark.parametrize(
    "bad, finite_min, finite_max",
    [("nan", False, False), ("+inf", True, False), ("-inf", False, True), ("both", False, False)],
)
def test_nonfinite_tensors_are_never_taken_for_finite(compiled, bad, finite_min, finite_max):
    for n, at in ((10, 3), (300001, 123457)):
        t = torch.randn(n)
        if bad == "nan":
            t[at] = float("nan")
        elif bad == "+inf":
            t[at] = float("inf")
        elif bad == "-inf":
            t[at] = -float("inf")
        else:
            t[at], t[0] = float("inf"), -float("inf")
        v = measure.quick_vector(t)
        assert not stats.vector_is_finite(v) and not stats.quick_is_complete(v)
        assert np.isfinite(v[stats.IDX_MIN]) == finite_min
        assert np.isfinite(v[stats.IDX_MAX]) == finite_max
        if bad in ("+inf", "-inf"):  # one infinity: the extremes are torch.aminmax's
            assert (v[stats.IDX_MIN], v[stats.IDX_MAX]) == tuple(float(a) for a in torch.aminmax(t))


def test_float32_overflow_still_goes_to_the_exact_kernel(compiled):
    t = torch.full((4096,), 3e38)  # finite, but its float32 sum is not
    assert not stats.quick_is_complete(measure.quick_vector(t))


class _Net(nn.Module):
    def __init__(self, poison: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gru = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)
        self.poison = poison

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))  # (B, 8, 6, 6)
        seq = h.flatten(2).transpose(1, 2)  # (B, 36, 8)
        out, _ = self.gru(seq)
        y = self.head(out[:, -1])
        if self.poison:
            y = torch.log(y)  # NaN where y < 0
        return y


@pytest.mark.parametrize("poison", [False, True], ids=["healthy", "nan"])
def test_a_trace_reads_the_same_with_both_kernels(compiled, monkeypatch, poison):
    torch.manual_seed(3)
    model = _Net(poison)
    x = torch.randn(4, 3, 6, 6)
    target = torch.randn(4, 4)
    loss = nn.MSELoss()
    with_kernel = nbdebug.trace(model, x, target=target, loss_fn=loss)
    with monkeypatch.context() as m:
        m.setenv(kernels.ENV, "eager")
        eager = nbdebug.trace(model, x, target=target, loss_fn=loss)
    assert [(e.phase, e.module, e.name) for e in with_kernel.events] == [
        (e.phase, e.module, e.name) for e in eager.events
    ]
    for a, b in zip(with_kernel.events, eager.events):
        for key in ("min", "max", "n_nan", "n_inf"):
            assert getattr(a.stats, key) == getattr(b.stats, key) or (
                np.isnan(getattr(a.stats, key)) and np.isnan(getattr(b.stats, key))
            ), (a, key)
        assert a.stats.norm == pytest.approx(b.stats.norm, rel=1e-5, nan_ok=True)
        np.testing.assert_array_equal(a.hist.counts, b.hist.counts)
    if poison:
        assert with_kernel.origin is not None and eager.origin is not None
        assert (with_kernel.origin.module, with_kernel.origin.op) == (
            eager.origin.module,
            eager.origin.op,
        )
    else:
        assert with_kernel.origin is None and eager.origin is None


def test_eager_can_be_chosen_and_a_bad_choice_is_one_sentence(compiled, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "eager")
    assert not kernels.active() and len(measure.quick_parts(torch.ones(3))) == 5
    monkeypatch.setenv(kernels.ENV, "fast")
    expected = r"NBDEBUG_KERNELS expects 'compiled' or 'eager', got 'fast'"
    with pytest.raises(ValueError, match=expected):
        kernels.active()


def test_a_build_is_made_once_and_only_for_this_torch_and_cpu(compiled, monkeypatch):
    mtime = compiled.stat().st_mtime_ns
    assert kernels.build() == compiled and compiled.stat().st_mtime_ns == mtime
    assert kernels.build_dir() == compiled.parent
    # another PyTorch version names another directory, where nothing is built
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert kernels.build_dir() != compiled.parent
    assert not kernels.active() and len(measure.quick_parts(torch.ones(3))) == 5


def test_a_build_without_ninja_says_what_is_missing(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("NBDEBUG_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs ninja \(pip install ninja\), found none"):
        kernels.build()
    assert not kernels.active() and not any(tmp_path.rglob("*.so"))


def test_the_cli_builds_the_kernel_and_says_where(compiled, capsys):
    assert cli.main(["build-kernels"]) == 0
    assert capsys.readouterr().out.strip() == f"nbdebug kernels: {compiled}"


def test_the_kernel_refuses_what_it_cannot_measure(compiled):
    fused = kernels.compiled()
    assert fused is not None
    args = measure.kernel_args()
    for bad, expected in (
        (torch.empty(0), "non-empty contiguous CPU tensor"),
        (torch.randn(4, 4).t(), "non-empty contiguous CPU tensor"),
        (torch.arange(4), "quick_stats"),
    ):
        with pytest.raises(RuntimeError, match=expected):
            fused.quick_stats(bad, *args)
    with pytest.raises(RuntimeError, match="max_sample >= 1, got 0"):
        fused.quick_stats(torch.ones(4), 0, *args[1:])


def _definition_bins(v: np.ndarray) -> np.ndarray:
    """Counts by the histogram's definition, in float64: floor((log10|v| - LO) / width),
    clamped, then zeros and NaN/Inf."""
    a = np.abs(v.astype(np.float64))
    width = (stats.HIST_HI - stats.HIST_LO) / stats.HIST_BINS
    counts = np.zeros(stats.HIST_BINS + 2)
    finite = np.isfinite(a) & (a > 0)
    b = np.floor((np.log10(a[finite]) - stats.HIST_LO) / width).astype(np.int64)
    np.add.at(counts, np.clip(b, 0, stats.HIST_BINS - 1), 1)
    counts[stats.HIST_BINS] = np.sum(a == 0)
    counts[stats.HIST_BINS + 1] = np.sum(~np.isfinite(a))
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_compiled_histogram_bins_every_magnitude_as_defined(compiled, dtype):
    # every bin edge 10**(LO + k * width) and the floats on both sides of it (exact powers
    # of ten among them), magnitudes from denormals to 3e38, zeros and non-finite values
    width = (stats.HIST_HI - stats.HIST_LO) / stats.HIST_BINS
    edges = 10.0 ** (stats.HIST_LO + width * np.arange(-4, stats.HIST_BINS + 5))
    f = edges.astype(np.float32)
    near = np.concatenate([f, np.nextafter(f, np.float32(0)), np.nextafter(f, np.float32(np.inf))])
    wide = np.float32(10.0) ** np.linspace(-44, 38, 400, dtype=np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38], dtype=np.float32)
    values = np.concatenate([near, -near, wide, special]).astype(np.float32)
    for chunk in np.array_split(values, 3):  # each within one sample (<= HIST_SAMPLE)
        assert len(chunk) <= stats.HIST_SAMPLE
        t = torch.from_numpy(chunk.copy()).to(dtype)
        fused = kernels.compiled()
        assert fused is not None
        row = fused.quick_stats(t, *measure.kernel_args()).numpy()
        hist = row[4:]
        np.testing.assert_array_equal(hist[:-1], _definition_bins(t.numpy()))
        assert hist[-1] == len(chunk)


def test_the_kernel_refuses_a_bin_table_that_points_outside_its_bins(compiled):
    fused = kernels.compiled()
    assert fused is not None
    sample, bins, lo, hi, table, underflow = measure.kernel_args()
    bad = table.clone()
    bad[100, 0] = bins  # a bin past the last one
    with pytest.raises(RuntimeError, match="bin table names a bin out of range"):
        fused.quick_stats(torch.ones(4), sample, bins, lo, hi, bad, underflow)
    with pytest.raises(RuntimeError, match=r"int32 \[256, 2\] bin table"):
        fused.quick_stats(torch.ones(4), sample, bins, lo, hi, table[:10], underflow)
    assert torch.equal(table, measure.kernel_args()[4])  # the shared table is untouched


@pytest.mark.parametrize("scale", [1e-25, 1e-40])
def test_the_kernel_squares_tiny_tensors_in_float64(compiled, scale):
    """Float squares of values below stats.UNDERFLOW round to 0: the kernel sums them
    again in float64, so a vanishing tensor's norm is exact, not 0."""
    a = (np.random.default_rng(1).normal(size=70_000) * scale).astype(np.float32)
    row = kernels.compiled().quick_stats(torch.from_numpy(a), *measure.kernel_args()).numpy()
    assert row[1] == pytest.approx(float((a.astype(np.float64) ** 2).sum()), rel=1e-9)
    ordinary = kernels.compiled().quick_stats(torch.ones(8), *measure.kernel_args()).numpy()
    assert ordinary[1] == 8.0
