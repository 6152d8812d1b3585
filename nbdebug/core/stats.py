"""Tensor statistics computed on the tensor's device, read by the host once per trace.

Two kernels share one result layout (a float64 vector, see ``VECTOR_LEN``):

* :func:`quick_vector`: the hot path. Four reductions (row sums, norm, aminmax,
  count_nonzero) plus a log10-magnitude histogram of at most ``HIST_SAMPLE`` evenly
  strided elements. It never synchronises with the host. A finite min and max mean
  "no NaN/Inf" (both propagate NaN and carry +-inf), so NaN/Inf are never counted
  element-wise here.
* :func:`exact_vector`: element-wise, for tensors that hold non-finite values. Counts
  NaN and Inf, and computes the moments over the *finite* elements only, so a single
  NaN does not hide the scale of everything else.

:func:`finalize` turns a host-side vector into :class:`TensorStats` and :class:`Histogram`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

#: log10|x| histogram: ``HIST_BINS`` bins over ``[HIST_LO, HIST_HI)``, out-of-range values
#: clamped into the end bins; exact zeros and non-finite values are counted apart.
HIST_BINS = 32
HIST_LO = -8.0
HIST_HI = 8.0
HIST_EDGES = np.linspace(HIST_LO, HIST_HI, HIST_BINS + 1)
#: The quick kernel draws its histogram from at most this many evenly strided elements.
HIST_SAMPLE = 1024

# Layout of a statistics vector: the index of each entry (public: the recorder and the
# origin finder read single entries of the vectors they hold).
IDX_NUMEL, IDX_SUM, IDX_NORM, IDX_MIN, IDX_MAX, IDX_NNZ, IDX_NNAN, IDX_NINF, IDX_NFIN = range(9)
#: first of the ``HIST_BINS`` histogram counts
IDX_HIST0 = 9
IDX_HZERO = IDX_HIST0 + HIST_BINS
IDX_HNONFIN = IDX_HZERO + 1
IDX_HTOTAL = IDX_HNONFIN + 1
VECTOR_LEN = IDX_HTOTAL + 1


@dataclass(slots=True)
class TensorStats:
    """Summary of one tensor. Moments are over the finite elements.

    Complex tensors are summarised by their absolute value, integer and boolean tensors as
    float64.

    Attributes
    ----------
    numel : int
        Number of elements.
    norm : float
        L2 norm of the finite elements.
    mean, std : float
        Mean and population standard deviation of the finite elements.
    min, max, absmax : float
        Extremes of the finite elements (NaN when there is none).
    zero_frac : float
        Share of exact zeros; for finite tensors of more than ``HIST_SAMPLE`` elements
        it is estimated from the evenly strided histogram sample.
    n_nan, n_inf : int
        Counts of NaN and of +-Inf elements (exact).

    Examples
    --------
    >>> ev = tr.events[3]
    >>> ev.stats.norm, ev.stats.n_nan, ev.stats.finite
    (12.18, 32, False)
    """

    numel: int
    norm: float
    mean: float
    std: float
    min: float
    max: float
    absmax: float
    zero_frac: float
    n_nan: int
    n_inf: int

    @property
    def finite(self) -> bool:
        return self.n_nan == 0 and self.n_inf == 0

    @property
    def n_nonfinite(self) -> int:
        return self.n_nan + self.n_inf

    def as_dict(self) -> dict[str, float]:
        return {
            "norm": self.norm,
            "mean": self.mean,
            "std": self.std,
            "min": self.min,
            "max": self.max,
            "absmax": self.absmax,
            "zero_frac": self.zero_frac,
            "n_nan": self.n_nan,
            "n_inf": self.n_inf,
        }

    def __repr__(self) -> str:
        bad = f", n_nan={self.n_nan}, n_inf={self.n_inf}" if not self.finite else ""
        return (
            f"TensorStats(norm={self.norm:.4g}, mean={self.mean:.4g}, std={self.std:.4g}, "
            f"min={self.min:.4g}, max={self.max:.4g}, zero_frac={self.zero_frac:.3f}{bad})"
        )


@dataclass(slots=True)
class Histogram:
    """Counts of log10|x| in the fixed bins ``edges`` (``len(edges) == len(counts) + 1``).

    Attributes
    ----------
    counts : numpy.ndarray of int64, shape (32,)
        Non-zero finite values per bin of ``edges`` (values outside the range are counted
        in the end bins).
    edges : numpy.ndarray of float64, shape (33,)
        ``HIST_EDGES``: log10|x| from -8 to 8 in steps of 0.5.
    n_zero, n_nonfinite : int
        Exact zeros and NaN/Inf values, counted apart from the bins.
    total : int
        Number of values counted (all elements, or the sample).
    sampled : bool
        True when the counts come from an evenly strided sample of ``total`` elements
        rather than from the whole tensor.

    Examples
    --------
    >>> h = tr.events[3].hist
    >>> centres = (h.edges[:-1] + h.edges[1:]) / 2   # draw h.counts over these
    """

    counts: np.ndarray
    n_zero: int
    n_nonfinite: int
    total: int
    sampled: bool

    @property
    def edges(self) -> np.ndarray:
        return HIST_EDGES

    def __repr__(self) -> str:
        return (
            f"Histogram({HIST_BINS} bins of log10|x|, total={self.total}, zeros={self.n_zero}, "
            f"nonfinite={self.n_nonfinite}, sampled={self.sampled})"
        )


def as_real(t: torch.Tensor) -> torch.Tensor:
    """The tensor to summarise: detached, floating (complex -> abs, int/bool -> float64);
    a sparse tensor (e.g. an ``nn.Embedding(sparse=True)`` gradient) by its stored values."""
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    elif t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        return t.abs()
    if not t.is_floating_point():
        return t.to(torch.float64)
    return t


def _accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _sample(flat: torch.Tensor) -> torch.Tensor:
    n = flat.numel()
    if n <= HIST_SAMPLE:
        return flat
    return flat[:: math.ceil(n / HIST_SAMPLE)]


def row_dim(shape: torch.Size | tuple[int, ...], batch_size: int | None) -> int | None:
    """The dimension that indexes batch rows: 0 when it has the batch size, else the first
    dimension that does (sequence-first layouts), else None."""
    if not batch_size or not shape:
        return None
    if shape[0] == batch_size:
        return 0
    for d, n in enumerate(shape):
        if n == batch_size:
            return d
    return None


QuickParts = tuple  # (sum, norm, min, max, sample): device tensors


def quick_parts(t: torch.Tensor) -> QuickParts:
    """The hot path: four reductions (sum, norm, min, max) and a strided sample of ``t``,
    left on its device.

    No host synchronisation, and no per-tensor assembly: :func:`assemble_quick` stacks
    the parts of all tensors of a pass at once. The share of zeros and the histogram come
    from the sample (exact up to ``HIST_SAMPLE`` elements): counting zeros exactly costs
    as much as the four reductions together.
    """
    x = as_real(t)
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return ()
    acc = _accum_dtype(x)
    # a copy: the tensor may be modified in place after this hook
    sample = flat.clone() if flat.numel() <= HIST_SAMPLE else _sample(flat).contiguous()
    return (
        flat.sum(dtype=acc),
        torch.linalg.vector_norm(flat, dtype=acc),
        flat.amin(),
        flat.amax(),
        sample,
    )


def assemble_quick(parts: list[QuickParts], numels: list[int]) -> np.ndarray:
    """Statistics vectors (rows) of many tensors from their :func:`quick_parts`, all on
    one device, with one transfer to the host. NaN/Inf counts are left at -1 (not
    counted): a finite min and max mean there are none (see :func:`vector_is_finite`)."""
    n = len(parts)
    out = np.zeros((n, VECTOR_LEN))
    out[:, IDX_NNAN] = out[:, IDX_NINF] = out[:, IDX_NFIN] = -1.0
    live = [i for i in range(n) if parts[i]]
    for i in range(n):
        out[i, IDX_NUMEL] = numels[i]
        if not parts[i]:
            out[i, IDX_MIN] = out[i, IDX_MAX] = np.nan
            out[i, IDX_NNAN] = out[i, IDX_NINF] = 0.0
    if not live:
        return out
    scal = torch.stack([x for i in live for x in parts[i][:4]]).to(torch.float64)
    samples = [parts[i][4] for i in live]
    lengths = torch.tensor([s.numel() for s in samples], device=samples[0].device)
    cat = torch.cat([s.reshape(-1) for s in samples]).to(torch.float32)
    seg = torch.repeat_interleave(torch.arange(len(live), device=cat.device), lengths)
    hist = _segment_hist(cat, seg, len(live))
    host = torch.cat([scal.reshape(-1), hist.reshape(-1)]).cpu().numpy()
    sc = host[: 4 * len(live)].reshape(len(live), 4)
    hs = host[4 * len(live) :].reshape(len(live), HIST_BINS + 3)
    rows = np.asarray(live)
    out[rows, IDX_SUM] = sc[:, 0]
    out[rows, IDX_NORM] = sc[:, 1]
    out[rows, IDX_MIN] = sc[:, 2]
    out[rows, IDX_MAX] = sc[:, 3]
    out[rows, IDX_HIST0:] = hs
    # zeros: scaled up from the sample
    zero_share = hs[:, HIST_BINS] / np.maximum(hs[:, HIST_BINS + 2], 1)
    out[rows, IDX_NNZ] = out[rows, IDX_NUMEL] * (1.0 - zero_share)
    return out


def _segment_hist(values: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Per-segment [counts..., n_zero, n_nonfinite, total] of log10|values|."""
    width = HIST_BINS + 3
    mag = values.abs()
    fin = torch.isfinite(mag)
    nz = fin & (mag > 0)
    logs = torch.log10(torch.where(nz, mag, torch.ones_like(mag)))
    b = ((logs - HIST_LO) * (HIST_BINS / (HIST_HI - HIST_LO))).floor().clamp_(0, HIST_BINS - 1)
    b = torch.where(nz, b, torch.where(fin, HIST_BINS, HIST_BINS + 1))
    flat_idx = seg * width + b.to(torch.int64)
    counts = torch.zeros(n * width, dtype=torch.float64, device=values.device)
    counts.index_add_(0, flat_idx, torch.ones_like(values, dtype=torch.float64))
    counts = counts.reshape(n, width)
    counts[:, HIST_BINS + 2] = counts[:, : HIST_BINS + 2].sum(1)
    return counts


def quick_vector(t: torch.Tensor) -> np.ndarray:
    """Quick statistics vector of one tensor (for tests and one-off use)."""
    return assemble_quick([quick_parts(t)], [t.numel()])[0]


def exact_vector(t: torch.Tensor) -> torch.Tensor:
    """Element-wise statistics vector (NaN/Inf counted, moments over finite elements)."""
    x = as_real(t)
    dev = x.device
    if x.numel() == 0:
        return empty_vector(dev)
    flat = x.reshape(-1)
    nan = torch.isnan(flat)
    fin = torch.isfinite(flat)
    n_nan = nan.sum().to(torch.float64)
    n_fin = fin.sum().to(torch.float64)
    n_inf = (flat.numel() - n_nan - n_fin).to(torch.float64)
    vals = flat[fin]
    if vals.numel():
        # float64 accumulation: finite values near 1e19 square past float32's range
        total = vals.sum(dtype=torch.float64)
        norm = torch.linalg.vector_norm(vals, dtype=torch.float64)
        mn, mx = torch.aminmax(vals)
        mn, mx = mn.to(torch.float64), mx.to(torch.float64)
    else:
        total = norm = torch.zeros((), dtype=torch.float64, device=dev)
        mn = mx = torch.full((), float("nan"), dtype=torch.float64, device=dev)
    nnz = (fin & (flat != 0)).sum().to(torch.float64) + (flat.numel() - n_fin)
    head = torch.stack(
        [
            total.new_tensor(float(x.numel())),
            total,
            norm,
            mn,
            mx,
            nnz,
            n_nan,
            n_inf,
            n_fin,
        ]
    )
    hist = _segment_hist(
        flat.to(torch.float64), torch.zeros(flat.numel(), dtype=torch.int64, device=dev), 1
    )
    return torch.cat([head, hist[0]])


def empty_vector(device: torch.device) -> torch.Tensor:
    v = torch.zeros(VECTOR_LEN, dtype=torch.float64, device=device)
    v[IDX_MIN] = v[IDX_MAX] = float("nan")
    v[IDX_NNAN] = v[IDX_NINF] = 0.0
    return v


def row_flags(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Boolean vector over ``dim``: True where the slice holds a NaN or Inf (element-wise)."""
    x = as_real(t)
    bad = ~torch.isfinite(x)
    return bad.movedim(dim, 0).reshape(x.shape[dim], -1).any(dim=1)


def quick_is_complete(v: np.ndarray) -> bool:
    """Whether a quick vector can stand as it is: the tensor was finite and its float32
    sum and norm did not overflow (else the exact, float64 kernel must measure it)."""
    return vector_is_finite(v) and bool(np.isfinite(v[IDX_SUM]) and np.isfinite(v[IDX_NORM]))


def vector_is_finite(v: np.ndarray) -> bool:
    """Whether a finalized-quick or exact host vector describes an all-finite tensor."""
    if v[IDX_NNAN] >= 0:
        return v[IDX_NNAN] == 0 and v[IDX_NINF] == 0
    return bool(np.isfinite(v[IDX_MIN]) and np.isfinite(v[IDX_MAX]))


def finalize(v: np.ndarray) -> tuple[TensorStats, Histogram]:
    """Host-side conversion of one statistics vector."""
    numel = int(v[IDX_NUMEL])
    counted = v[IDX_NNAN] >= 0
    if counted:
        n_nan, n_inf, n_fin = int(v[IDX_NNAN]), int(v[IDX_NINF]), int(v[IDX_NFIN])
    else:
        # quick vector: only reached for finite tensors (callers re-run the exact kernel
        # for the others); keep NaN-propagating moments honest if one slips through.
        n_nan = n_inf = 0
        n_fin = numel
    total, norm = float(v[IDX_SUM]), float(v[IDX_NORM])
    mn, mx = float(v[IDX_MIN]), float(v[IDX_MAX])
    if n_fin:
        mean = total / n_fin
        var = max(norm * norm / n_fin - mean * mean, 0.0)
        std = math.sqrt(var)
    else:
        mean = std = float("nan")
    absmax = max(abs(mn), abs(mx)) if n_fin else float("nan")
    zero_frac = (numel - float(v[IDX_NNZ])) / numel if numel else 0.0
    stats = TensorStats(
        numel=numel,
        norm=norm,
        mean=mean,
        std=std,
        min=mn,
        max=mx,
        absmax=absmax,
        zero_frac=zero_frac,
        n_nan=n_nan,
        n_inf=n_inf,
    )
    counts = v[IDX_HIST0:IDX_HZERO].astype(np.int64)
    total_h = int(v[IDX_HTOTAL])
    hist = Histogram(
        counts=counts,
        n_zero=int(v[IDX_HZERO]),
        n_nonfinite=int(v[IDX_HNONFIN]),
        total=total_h,
        sampled=total_h < numel,
    )
    return stats, hist


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Exact statistics of one tensor (synchronises; for tests and one-off use)."""
    return finalize(exact_vector(t).cpu().numpy())[0]


def finalize_many(vectors: list[np.ndarray]) -> list[tuple[TensorStats, Histogram]]:
    """:func:`finalize` for many vectors at once (numpy over the stacked matrix)."""
    if not vectors:
        return []
    m = np.vstack(vectors)
    numel = m[:, IDX_NUMEL]
    counted = m[:, IDX_NNAN] >= 0
    n_nan = np.where(counted, m[:, IDX_NNAN], 0.0)
    n_inf = np.where(counted, m[:, IDX_NINF], 0.0)
    n_fin = np.where(counted, m[:, IDX_NFIN], numel)
    total, norm, mn, mx = m[:, IDX_SUM], m[:, IDX_NORM], m[:, IDX_MIN], m[:, IDX_MAX]
    with np.errstate(invalid="ignore", divide="ignore"):
        safe = np.maximum(n_fin, 1)
        mean = np.where(n_fin > 0, total / safe, np.nan)
        var = np.maximum(norm * norm / safe - mean * mean, 0.0)
        std = np.where(n_fin > 0, np.sqrt(var), np.nan)
        absmax = np.where(n_fin > 0, np.maximum(np.abs(mn), np.abs(mx)), np.nan)
        zero_frac = np.where(numel > 0, (numel - m[:, IDX_NNZ]) / np.maximum(numel, 1), 0.0)
    counts = m[:, IDX_HIST0:IDX_HZERO].astype(np.int64)
    hz, hn, ht = (
        m[:, IDX_HZERO].astype(np.int64),
        m[:, IDX_HNONFIN].astype(np.int64),
        m[:, IDX_HTOTAL].astype(np.int64),
    )
    cols = zip(
        numel.astype(np.int64).tolist(),
        norm.tolist(),
        mean.tolist(),
        std.tolist(),
        mn.tolist(),
        mx.tolist(),
        absmax.tolist(),
        zero_frac.tolist(),
        n_nan.astype(np.int64).tolist(),
        n_inf.astype(np.int64).tolist(),
        hz.tolist(),
        hn.tolist(),
        ht.tolist(),
    )
    out = []
    for i, (ne, nr, me, sd, lo, hi, am, zf, na, ni, z, nf, tt) in enumerate(cols):
        out.append(
            (
                TensorStats(ne, nr, me, sd, lo, hi, am, zf, na, ni),
                Histogram(counts[i], z, nf, tt, tt < ne),
            )
        )
    return out
