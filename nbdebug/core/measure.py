"""Tensor statistics measured on the tensor's device, in the layout of :mod:`.stats`.

Two kernels share one result layout (a float64 vector, see ``VECTOR_LEN``):

* :func:`quick_parts` / :func:`assemble_quick` (:func:`quick_vector` for one tensor): the
  hot path. Four reductions (sum, sum of squares as a dot product, min, max; float32
  accumulation) plus a log10-magnitude histogram of at most ``HIST_SAMPLE`` evenly
  strided elements. It never synchronises with the host. A finite sum, min and max mean
  "no NaN/Inf" (they propagate NaN and carry +-inf), so NaN/Inf are never counted
  element-wise here.
* :func:`exact_vector`: for the exact pass. A finite sum costs it the quick kernel's
  reductions; otherwise it counts NaN and Inf element-wise and computes the moments over
  the *finite* elements only (float64 accumulation), so a single NaN does not hide the
  scale of everything else. Its histogram also comes from the sample: no full-size
  float64 copy.

:func:`nbdebug.core.stats.finalize` turns a host-side vector into statistics.
"""

from __future__ import annotations

import math
from enum import Enum
from types import ModuleType

import numpy as np
import torch

from . import kernels
from .stats import (
    HIST_BINS,
    HIST_HI,
    HIST_LO,
    HIST_SAMPLE,
    IDX_HIST0,
    IDX_MAX,
    IDX_MIN,
    IDX_NFIN,
    IDX_NINF,
    IDX_NNAN,
    IDX_NNZ,
    IDX_NORM,
    IDX_NUMEL,
    IDX_SUM,
    UNDERFLOW,
    VECTOR_LEN,
    TensorStats,
    as_real,
    finalize,
)


def _accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _sample(flat: torch.Tensor) -> torch.Tensor:
    n = flat.numel()
    if n <= HIST_SAMPLE:
        return flat
    return flat[:: math.ceil(n / HIST_SAMPLE)]


#: (sum, sum of squares, min, max, sample) as device tensors, or (row,) from the compiled
#: kernel, or () for an empty tensor
QuickParts = tuple[torch.Tensor, ...]


def flat_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a 1-D view in memory order (statistics do not depend on the order), or
    None when its elements do not fill a dense block (then only a copy can flatten it)."""
    if x.is_contiguous():
        return x.view(-1)
    order = sorted(range(x.dim()), key=lambda d: x.stride(d))
    expect = 1
    for d in order:
        if x.shape[d] != 1 and x.stride(d) != expect:
            return None
        expect *= x.shape[d]
    return x.as_strided((x.numel(),), (1,), x.storage_offset())


def _sum_squares(x: torch.Tensor, flat: torch.Tensor | None) -> torch.Tensor:
    # a dot product costs about a third of ``vector_norm`` on CPU; half precision types
    # are squared in float32 by ``vector_norm`` instead (``dot`` would accumulate in them)
    if flat is not None and x.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat)
    squares: torch.Tensor = torch.linalg.vector_norm(x, dtype=_accum_dtype(x)).square()
    return squares


def _sample_of(x: torch.Tensor, flat: torch.Tensor | None) -> torch.Tensor:
    """At most ``HIST_SAMPLE`` evenly strided elements, copied (the tensor may be
    modified in place after the hook that measures it)."""
    if flat is None:
        if x.numel() <= HIST_SAMPLE:
            return x.reshape(-1).clone()
        flat = x.reshape(-1)  # not dense: a copy cannot be avoided
    if flat.numel() <= HIST_SAMPLE:
        return flat.clone()
    return _sample(flat).contiguous()


#: :func:`quick_parts`'s default: look the compiled kernel up (:func:`kernels.compiled`)
class Lookup(Enum):
    """The default of :func:`quick_parts`' ``kernel``: look the compiled kernel up."""

    KERNEL = "kernel"


LOOKUP = Lookup.KERNEL


def quick_parts(t: torch.Tensor, kernel: ModuleType | Lookup | None = LOOKUP) -> QuickParts:
    """The hot path: three reductions (sum, sum of squares, min and max in one) and a strided
    sample of ``t``, left on its device.

    No host synchronisation, no float64 pass and no per-tensor assembly:
    :func:`assemble_quick` stacks the parts of all tensors of a pass at once. The sum
    and the sum of squares accumulate in float32 for float32 and lower precision
    tensors; a value that overflows float32 there is re-measured by the exact kernel
    (see :func:`quick_is_complete`). The share of zeros and the histogram come from the
    sample (exact up to ``HIST_SAMPLE`` elements): counting zeros exactly costs as much
    as the three reductions together.

    A dense CPU tensor takes the compiled kernel when it was built
    (:mod:`nbdebug.core.kernels`): the same numbers in one pass and one call, and the
    sample's histogram with them, returned as ``(row,)`` (see :func:`kernel_args`) instead
    of the eager ``(sum, sum of squares, min, max, sample)``. ``kernel``: the kernel's
    module or None (eager), looked up once by a caller measuring many tensors; by default
    it is looked up here.
    """
    # a floating strided tensor is read as it is (the hot path: no detached copy of the
    # tensor object); anything else is made real and dense first
    x = t if t.layout == torch.strided and t.dtype in FLOATING else as_real(t)
    if x.numel() == 0:
        return ()
    if x.device.type == "cpu":
        fused = kernels.compiled() if isinstance(kernel, Lookup) else kernel
        if fused is not None:
            flat = x if x.is_contiguous() else flat_view(x.detach())
            if flat is not None:
                return (fused.quick_stats(flat, *kernel_args()),)
    x = x.detach()
    flat = flat_view(x)
    lo, hi = torch.aminmax(x)  # one pass for both (one dispatch fewer per tensor)
    return (
        x.sum(dtype=_accum_dtype(x)),
        _sum_squares(x, flat),
        lo,
        hi,
        _sample_of(x, flat),
    )


FLOATING = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


_KERNEL_ARGS: list[tuple[int, int, float, float, torch.Tensor, float]] = []


def kernel_args() -> tuple[int, int, float, float, torch.Tensor, float]:
    """The compiled kernel's arguments after the tensor: ``HIST_SAMPLE``, ``HIST_BINS``,
    ``HIST_LO``, ``HIST_HI``, its bin table and :data:`UNDERFLOW` (below which it sums a
    tensor's squares in float64). The bin table, int32 ``[256, 2]``: for each biased float32
    exponent ``e``, the bin of the magnitude ``2**(e - 127)`` and the mantissa bits from
    which magnitudes of that exponent fall into the next bin (``2**23``: none). Bins are
    wider than an octave, so an octave holds at most one edge. The kernel bins float
    samples with it (no logarithm), by the edges ``10**(HIST_LO + k * width)`` that the
    eager histogram's ``floor((log10|x| - HIST_LO) / width)`` draws (the two can differ
    by a rounding at an edge)."""
    if not _KERNEL_ARGS:
        width = (HIST_HI - HIST_LO) / HIST_BINS
        if width < math.log10(2):  # pragma: no cover - a change to the bins above
            raise ValueError(f"the bin table needs bins of at least an octave, got {width}")
        table = np.zeros((256, 2), dtype=np.int32)
        table[:, 1] = 1 << 23
        for e in range(1, 255):
            low = 2.0 ** (e - 127)
            b = min(max(math.floor((math.log10(low) - HIST_LO) / width), 0), HIST_BINS - 1)
            table[e, 0] = b
            if b + 1 < HIST_BINS:
                edge = 10.0 ** (HIST_LO + (b + 1) * width)
                f = np.float32(edge)
                if float(f) < edge:
                    f = np.nextafter(f, np.float32(np.inf))
                if float(f) < 2 * low:
                    table[e, 1] = int(np.asarray(f).view(np.int32)) & 0x7FFFFF
        _KERNEL_ARGS.append(
            (
                HIST_SAMPLE,
                HIST_BINS,
                HIST_LO,
                HIST_HI,
                torch.from_numpy(table).contiguous(),
                UNDERFLOW,
            )
        )
    return _KERNEL_ARGS[0]


def assemble_quick(parts: list[QuickParts], numels: list[int]) -> np.ndarray:
    """Statistics vectors (rows) of many tensors from their :func:`quick_parts`, all on
    one device, with one transfer to the host per dtype among them. NaN/Inf counts are
    left at -1 (not counted): a finite sum, min and max mean there are none (see
    :func:`vector_is_finite`)."""
    n = len(parts)
    rows = np.zeros((n, 4 + HIST_BINS + 3))
    live = [i for i in range(n) if parts[i]]
    dead = [i for i in range(n) if not parts[i]]
    # one group per dtype: stacking tensors of mixed dtypes takes torch's slow path (about
    # 10x per tensor; an integer batch measured in float64 among float32 activations), and
    # float64 samples make :func:`sample_hist` bin all of its samples in float64
    # (the form of the parts, eager or compiled, is part of the key)
    groups: dict[tuple[int, torch.dtype, torch.dtype], list[int]] = {}
    for i in live:
        groups.setdefault((len(parts[i]), parts[i][0].dtype, parts[i][-1].dtype), []).append(i)
    for idx in groups.values():
        rows[idx] = eager_rows([parts[i] for i in idx]).cpu().numpy()
    out = rows_to_vectors(rows, numels, dead)
    eager = [i for i in live if len(parts[i]) > 1]
    if eager:
        rescue_tiny_norms([parts[i] for i in eager], eager, out)
    return out


def eager_rows(parts: list[QuickParts]) -> torch.Tensor:
    """Float64 ``(len(parts), 4 + HIST_BINS + 3)`` on the parts' device, the compiled
    kernel's row layout (``[sum, sum of squares, min, max, histogram]``), from the
    :func:`quick_parts` of tensors of one dtype and form, with device ops only."""
    if len(parts[0]) == 1:  # compiled: one float64 row each, histogram included
        return torch.stack([p[0] for p in parts])
    # one stack per kind of scalar (4 stacks, not one per tensor), float64 on arrival
    scal = torch.stack([torch.stack([p[j] for p in parts]).to(torch.float64) for j in range(4)], 1)
    return torch.cat([scal, sample_hist([p[-1] for p in parts])], 1)


def rows_to_vectors(rows: np.ndarray, numels: list[int], dead: list[int]) -> np.ndarray:
    """Statistics vectors (``VECTOR_LEN`` columns) from host rows in the kernel's layout
    (see :func:`eager_rows`); the rows ``dead`` are of empty tensors (not read). NaN/Inf
    counts are left at -1 (not counted), the share of zeros is scaled up from the
    sample."""
    n = len(rows)
    out = np.zeros((n, VECTOR_LEN))
    out[:, IDX_NNAN] = out[:, IDX_NINF] = out[:, IDX_NFIN] = -1.0
    out[:, IDX_NUMEL] = numels
    out[:, IDX_SUM] = rows[:, 0]
    with np.errstate(invalid="ignore"):
        out[:, IDX_NORM] = np.sqrt(rows[:, 1])
    out[:, IDX_MIN] = rows[:, 2]
    out[:, IDX_MAX] = rows[:, 3]
    hs = rows[:, 4:]
    out[:, IDX_HIST0:] = hs
    zero_share = hs[:, HIST_BINS] / np.maximum(hs[:, HIST_BINS + 2], 1)
    out[:, IDX_NNZ] = out[:, IDX_NUMEL] * (1.0 - zero_share)
    if dead:
        out[dead] = 0.0
        out[dead, IDX_NUMEL] = [numels[i] for i in dead]
        out[dead, IDX_MIN] = out[dead, IDX_MAX] = np.nan
        out[dead, IDX_NFIN] = -1.0
    return out


def rescue_tiny_norms(parts: list[QuickParts], rows: list[int], out: np.ndarray) -> None:
    """Eager rows (``out[rows[j]]`` measured from ``parts[j]``) whose largest element is
    below :data:`UNDERFLOW`: their float32 sum of squares rounded to 0 (or lost its
    precision), so their norm comes from their sample, squared in float64 (exact up to
    ``HIST_SAMPLE`` elements, scaled up past it). The compiled kernel squares such a
    tensor again in float64 itself."""
    at = np.asarray(rows)
    with np.errstate(invalid="ignore"):
        absmax = np.maximum(np.abs(out[at, IDX_MIN]), np.abs(out[at, IDX_MAX]))
    for j in np.flatnonzero((absmax > 0) & (absmax < UNDERFLOW)):
        i = rows[j]
        sample = parts[j][-1].detach().to(torch.float64)
        share = out[i, IDX_NUMEL] / max(sample.numel(), 1)
        out[i, IDX_NORM] = math.sqrt(float(sample.square().sum()) * share)


#: samples binned per kernel call in :func:`sample_hist` (bounds its temporaries to a few
#: MiB: a pass over thousands of samples otherwise allocates ~40 bytes per sampled
#: element at the end of the backward, when every gradient is resident)
HIST_CHUNK = 1 << 17


def sample_hist(samples: list[torch.Tensor]) -> torch.Tensor:
    """Float64 ``(len(samples), HIST_BINS + 3)``: per sample its bin counts of
    log10|x|, then its zeros, its NaN/Inf and its size. Samples are binned together, a
    chunk of about ``HIST_CHUNK`` elements per pass (all on one device); float64 samples
    are binned in float64, others in float32."""
    wide = any(s.dtype == torch.float64 for s in samples)
    dtype = torch.float64 if wide else torch.float32
    dev = samples[0].device
    out = torch.empty((len(samples), HIST_BINS + 3), dtype=torch.float64, device=dev)
    start = 0
    while start < len(samples):
        stop, size = start, 0
        while stop < len(samples) and (stop == start or size + samples[stop].numel() <= HIST_CHUNK):
            size += samples[stop].numel()
            stop += 1
        chunk = [
            c if c.dim() == 1 and c.dtype == dtype else c.reshape(-1).to(dtype)
            for c in samples[start:stop]
        ]
        # each element's row offset in the flat counts, built on the host (exact in
        # float32: at most HIST_CHUNK rows of HIST_BINS + 3 columns)
        offsets = np.repeat(
            np.arange(len(chunk), dtype=np.float32) * (HIST_BINS + 3), [c.numel() for c in chunk]
        )
        seg = torch.from_numpy(offsets).to(device=dev, dtype=dtype)
        out[start:stop] = _segment_hist(torch.cat(chunk), seg, len(chunk))
        start = stop
    return out


def _segment_hist(values: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Per-segment [counts..., n_zero, n_nonfinite, total] of log10|values|; ``offsets``
    holds each element's segment times ``HIST_BINS + 3`` (in ``values``' dtype)."""
    width = HIST_BINS + 3
    mag = values.abs()
    # in place on one temporary: log10 -> bin -> clamp (zeros' -inf and Inf clamp, NaN
    # stays), then zeros and NaN/Inf get their own columns
    b = torch.log10(mag).sub_(HIST_LO).mul_(HIST_BINS / (HIST_HI - HIST_LO))
    b = b.floor_().clamp_(0, HIST_BINS - 1)
    b = torch.where(mag > 0, b, HIST_BINS)
    b = torch.where(torch.isfinite(mag), b, HIST_BINS + 1)
    flat_idx = b.add_(offsets).to(torch.int32)
    counts = torch.bincount(flat_idx, minlength=n * width).to(torch.float64)
    counts = counts.reshape(n, width)
    counts[:, HIST_BINS + 2] = counts[:, : HIST_BINS + 2].sum(1)
    return counts


def quick_vector(t: torch.Tensor) -> np.ndarray:
    """Quick statistics vector of one tensor (for tests and one-off use)."""
    row: np.ndarray = assemble_quick([quick_parts(t)], [t.numel()])[0]
    return row


def exact_vector(t: torch.Tensor) -> torch.Tensor:
    """Statistics vector with NaN/Inf counted (moments over the finite elements).

    A finite float32 sum proves there is no NaN/Inf: such a tensor costs the quick
    kernel's four reductions. Otherwise NaN and Inf are counted element-wise, and the
    moments of the finite elements accumulate in float64 (finite values near 1e19 square
    past float32's range). The histogram, and for finite tensors the share of zeros,
    come from the strided sample as in :func:`quick_parts` (exact up to
    ``HIST_SAMPLE`` elements); no full-size float64 copy is made.
    """
    x = as_real(t)
    dev = x.device
    if x.numel() == 0:
        return empty_vector(dev)
    numel = x.numel()
    flat = flat_view(x)
    f64 = torch.float64
    total = x.sum(dtype=_accum_dtype(x))
    sample = _sample_of(x, flat)
    hist = sample_hist([sample.to(f64)])[0]  # binned in float64, as the reference does
    if bool(torch.isfinite(total)):
        sq = _sum_squares(x, flat).to(f64)
        mn, mx = (v.to(f64) for v in torch.aminmax(x))
        absmax = torch.maximum(mn.abs(), mx.abs())
        tiny = (absmax > 0) & (absmax < UNDERFLOW)
        if bool(tiny | ~torch.isfinite(sq)):  # one host read for both
            sq = torch.linalg.vector_norm(x, dtype=f64).square()
        norm = sq.sqrt()
        total = total.to(f64)
        n_nan = n_inf = torch.zeros((), dtype=f64, device=dev)
        n_fin = torch.full((), float(numel), dtype=f64, device=dev)
        share = hist[HIST_BINS] / hist[HIST_BINS + 2].clamp(min=1)
        nnz = numel * (1.0 - share)
    elif bool((n_nan := torch.isnan(x).sum().to(f64)) == numel):
        # all NaN (what a NaN turns every later tensor into): nothing else to measure
        total = norm = torch.zeros((), dtype=f64, device=dev)
        mn = mx = torch.full((), float("nan"), dtype=f64, device=dev)
        n_inf = n_fin = torch.zeros((), dtype=f64, device=dev)
        nnz = n_nan  # NaN is non-zero
    else:
        fin = torch.isfinite(x)
        n_fin = fin.sum().to(f64)
        n_inf = numel - n_nan - n_fin
        vals = torch.where(fin, x, 0)
        total = vals.sum(dtype=f64)
        norm = torch.linalg.vector_norm(vals, dtype=f64)
        del vals
        if bool(n_fin > 0):
            mn = torch.where(fin, x, math.inf).amin().to(f64)
            mx = torch.where(fin, x, -math.inf).amax().to(f64)
        else:
            mn = mx = torch.full((), float("nan"), dtype=f64, device=dev)
        nnz = torch.count_nonzero(x).to(f64)  # NaN and Inf are non-zero
    head = torch.stack(
        [total.new_tensor(float(numel)), total, norm, mn, mx, nnz, n_nan, n_inf, n_fin]
    )
    return torch.cat([head, hist])


def empty_vector(device: torch.device) -> torch.Tensor:
    v = torch.zeros(VECTOR_LEN, dtype=torch.float64, device=device)
    v[IDX_MIN] = v[IDX_MAX] = float("nan")
    v[IDX_NNAN] = v[IDX_NINF] = 0.0
    return v


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Exact statistics of one tensor (synchronises; for tests and one-off use)."""
    return finalize(exact_vector(t).cpu().numpy())[0]
