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
HIST_SAMPLE = 4096

# Layout of a statistics vector.
_NUMEL, _SUM, _NORM, _MIN, _MAX, _NNZ, _NNAN, _NINF, _NFIN = range(9)
_HIST0 = 9
_HZERO = _HIST0 + HIST_BINS
_HNONFIN = _HZERO + 1
_HTOTAL = _HNONFIN + 1
VECTOR_LEN = _HTOTAL + 1


@dataclass(frozen=True)
class TensorStats:
    """Summary of one tensor. Moments are over the finite elements.

    ``norm`` is the L2 norm, ``std`` the population standard deviation,
    ``zero_frac`` the share of exact zeros; ``n_nan`` / ``n_inf`` count non-finite
    elements. Complex tensors are summarised by their absolute value, integer and boolean
    tensors as float64.
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


@dataclass(frozen=True)
class Histogram:
    """Counts of log10|x| in the fixed bins ``edges`` (``len(edges) == len(counts) + 1``).

    ``sampled`` is True when the counts come from an evenly strided sample of
    ``total`` elements rather than from the whole tensor.
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
    """The tensor to summarise: detached, floating (complex -> abs, int/bool -> float64)."""
    t = t.detach()
    if t.is_complex():
        return t.abs()
    if not t.is_floating_point():
        return t.to(torch.float64)
    return t


def _accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _hist(sample: torch.Tensor) -> torch.Tensor:
    """[counts..., n_zero, n_nonfinite, total] of a 1-D sample, on its device."""
    s = sample.to(torch.float32)
    mag = s.abs()
    fin = torch.isfinite(mag)
    nz = fin & (mag > 0)
    logs = torch.log10(torch.where(nz, mag, torch.ones_like(mag)))
    idx = ((logs - HIST_LO) * (HIST_BINS / (HIST_HI - HIST_LO))).floor().clamp_(0, HIST_BINS - 1)
    counts = torch.zeros(HIST_BINS, dtype=torch.float64, device=s.device)
    counts.index_add_(0, idx.to(torch.int64), nz.to(torch.float64))
    n_zero = (fin & (mag == 0)).sum().to(torch.float64)
    n_nonfin = (~fin).sum().to(torch.float64)
    total = torch.tensor([float(s.numel())], dtype=torch.float64, device=s.device)
    return torch.cat([counts, n_zero.reshape(1), n_nonfin.reshape(1), total])


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


def quick_vector(t: torch.Tensor) -> torch.Tensor:
    """Statistics vector of ``t`` on its device, without a host synchronisation.

    NaN/Inf counts are left at -1 ("not counted"): :func:`finalize` reads a finite min
    and max as zero non-finite elements and otherwise reports the tensor as needing an
    exact pass.
    """
    x = as_real(t)
    dev = x.device
    if x.numel() == 0:
        return empty_vector(dev)
    acc = _accum_dtype(x)
    flat = x.reshape(-1)
    total = flat.sum(dtype=acc).to(torch.float64)
    norm = torch.linalg.vector_norm(flat, dtype=acc).to(torch.float64)
    mn, mx = torch.aminmax(flat)
    nnz = torch.count_nonzero(flat).to(torch.float64)
    head = torch.stack(
        [
            total.new_tensor(float(x.numel())),
            total,
            norm,
            mn.to(torch.float64),
            mx.to(torch.float64),
            nnz,
            total.new_tensor(-1.0),
            total.new_tensor(-1.0),
            total.new_tensor(-1.0),
        ]
    )
    return torch.cat([head, _hist(_sample(flat))])


def exact_vector(t: torch.Tensor) -> torch.Tensor:
    """Element-wise statistics vector (NaN/Inf counted, moments over finite elements)."""
    x = as_real(t)
    dev = x.device
    if x.numel() == 0:
        return empty_vector(dev)
    acc = _accum_dtype(x)
    flat = x.reshape(-1)
    nan = torch.isnan(flat)
    fin = torch.isfinite(flat)
    n_nan = nan.sum().to(torch.float64)
    n_fin = fin.sum().to(torch.float64)
    n_inf = (flat.numel() - n_nan - n_fin).to(torch.float64)
    vals = flat[fin]
    if vals.numel():
        total = vals.sum(dtype=acc).to(torch.float64)
        norm = torch.linalg.vector_norm(vals, dtype=acc).to(torch.float64)
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
    return torch.cat([head, _hist(flat)])


def empty_vector(device: torch.device) -> torch.Tensor:
    v = torch.zeros(VECTOR_LEN, dtype=torch.float64, device=device)
    v[_MIN] = v[_MAX] = float("nan")
    v[_NNAN] = v[_NINF] = 0.0
    return v


def row_flags(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Boolean vector over ``dim``: True where the slice holds a NaN or Inf (element-wise)."""
    x = as_real(t)
    bad = ~torch.isfinite(x)
    return bad.movedim(dim, 0).reshape(x.shape[dim], -1).any(dim=1)


def vector_is_finite(v: np.ndarray) -> bool:
    """Whether a finalized-quick or exact host vector describes an all-finite tensor."""
    if v[_NNAN] >= 0:
        return v[_NNAN] == 0 and v[_NINF] == 0
    return bool(np.isfinite(v[_MIN]) and np.isfinite(v[_MAX]))


def finalize(v: np.ndarray) -> tuple[TensorStats, Histogram]:
    """Host-side conversion of one statistics vector."""
    numel = int(v[_NUMEL])
    counted = v[_NNAN] >= 0
    if counted:
        n_nan, n_inf, n_fin = int(v[_NNAN]), int(v[_NINF]), int(v[_NFIN])
    else:
        # quick vector: only reached for finite tensors (callers re-run the exact kernel
        # for the others); keep NaN-propagating moments honest if one slips through.
        n_nan = n_inf = 0
        n_fin = numel
    total, norm = float(v[_SUM]), float(v[_NORM])
    mn, mx = float(v[_MIN]), float(v[_MAX])
    if n_fin:
        mean = total / n_fin
        var = max(norm * norm / n_fin - mean * mean, 0.0)
        std = math.sqrt(var)
    else:
        mean = std = float("nan")
    absmax = max(abs(mn), abs(mx)) if n_fin else float("nan")
    zero_frac = (numel - float(v[_NNZ])) / numel if numel else 0.0
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
    counts = v[_HIST0:_HZERO].astype(np.int64)
    total_h = int(v[_HTOTAL])
    hist = Histogram(
        counts=counts,
        n_zero=int(v[_HZERO]),
        n_nonfinite=int(v[_HNONFIN]),
        total=total_h,
        sampled=total_h < numel,
    )
    return stats, hist


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Exact statistics of one tensor (synchronises; for tests and one-off use)."""
    return finalize(exact_vector(t).cpu().numpy())[0]
