"""Tensor statistics: the layout of a statistics vector, its host-side reading, and the
finite/NaN/Inf counting every part of nbdebug uses.

A statistics vector (float64, ``VECTOR_LEN`` entries, one per measured tensor) is made on
the tensor's device by :mod:`nbdebug.core.measure` and read by the host once per trace:
:func:`finalize` / :func:`finalize_many` turn it into :class:`TensorStats` and
:class:`Histogram`; :func:`vector_is_finite` and :func:`all_quick_complete` judge it.

:func:`count_nonfinite`, :func:`has_nonfinite`, :func:`has_nan` and
:func:`is_finite_number` are the one home of "is this finite" for tensors and numbers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

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


#: Below this magnitude a float32 square underflows (or loses its precision: float32's
#: smallest normal number is 1.2e-38), so a float32 sum of squares of a tensor whose
#: largest element is this small reads 0, the norm of a vanishing gradient as that of a
#: zero one: such a tensor's squares are summed in float64 instead (from the sample in
#: the eager quick pass, over every element in the exact kernel and the compiled one).
UNDERFLOW = 1e-18


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
        Mean and population standard deviation of the finite elements. ``std`` comes from
        the sum and the sum of squares (accumulated in float32 for float32 and lower
        precision tensors), so it carries their rounding: where ``|mean|`` exceeds ``std``
        by more than about 1,000 times it is approximate (0 exactly when all elements are
        equal).
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

    @property
    def norm_as_is(self) -> float:
        """The L2 norm of the whole tensor: NaN when it holds NaN, inf when it holds Inf
        (``norm`` is that of its finite elements, 0 when there is none)."""
        if self.n_nan:
            return math.nan
        if self.n_inf:
            return math.inf
        return self.norm

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


def row_flags(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Boolean vector over ``dim``: True where the slice holds a NaN or Inf (element-wise)."""
    x = as_real(t)
    bad = ~torch.isfinite(x)
    return bad.movedim(dim, 0).reshape(x.shape[dim], -1).any(dim=1)


def quick_is_complete(v: np.ndarray) -> bool:
    """Whether a quick vector can stand as it is: the tensor was finite and its float32
    sum and norm did not overflow (else the exact, float64 kernel must measure it)."""
    return all_quick_complete([v])


def _matrix(vectors: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
    # a matrix of vectors as it is (stacking its rows again costs ~2 us a row)
    if isinstance(vectors, np.ndarray):
        return vectors if vectors.ndim == 2 else vectors.reshape(1, -1)
    return np.vstack(list(vectors))


def all_quick_complete(vectors: np.ndarray | Sequence[np.ndarray]) -> bool:
    """:func:`quick_is_complete` for every vector (rows of a matrix, or a list), at once."""
    if not len(vectors):
        return True
    m = _matrix(vectors)
    complete = _finite_rows(m) & np.isfinite(m[:, IDX_SUM]) & np.isfinite(m[:, IDX_NORM])
    return bool(np.all(complete))


def nan_count(v: np.ndarray) -> float:
    """NaN elements counted in a host statistics vector (-1: not counted, a quick one)."""
    return float(v[IDX_NNAN])


def inf_count(v: np.ndarray) -> float:
    """Inf elements counted in a host statistics vector (-1: not counted, a quick one)."""
    return float(v[IDX_NINF])


def vector_is_finite(v: np.ndarray) -> bool:
    """Whether a finalized-quick or exact host vector describes an all-finite tensor."""
    return bool(_finite_rows(np.asarray(v).reshape(1, -1))[0])


def _finite_rows(m: np.ndarray) -> np.ndarray:
    """Per row of stacked vectors: all finite. Counted (exact) vectors by their NaN/Inf
    counts, quick ones (counts left at -1) by a finite min and max."""
    counted = m[:, IDX_NNAN] >= 0
    with np.errstate(invalid="ignore"):
        rows: np.ndarray = np.where(
            counted,
            (m[:, IDX_NNAN] == 0) & (m[:, IDX_NINF] == 0),
            np.isfinite(m[:, IDX_MIN]) & np.isfinite(m[:, IDX_MAX]),
        )
    return rows


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
        # equal extremes: every finite element is the same, whatever the sums round to
        std = 0.0 if mn == mx else math.sqrt(var)
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


def finalize_many(
    vectors: np.ndarray | Sequence[np.ndarray],
) -> list[tuple[TensorStats, Histogram]]:
    """:func:`finalize` for many vectors (rows of a matrix, or a list) at once."""
    if not len(vectors):
        return []
    m = _matrix(vectors)
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
        std = np.where(n_fin > 0, np.where(mn == mx, 0.0, np.sqrt(var)), np.nan)
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


# ---------------------------------------------------------------------- finite counting
def _floating(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` detached as a real floating tensor (complex by magnitude), or None for an
    integer, boolean or empty tensor (which hold no NaN/Inf)."""
    if t.numel() == 0:
        return None
    if t.is_complex():
        return t.detach().abs()
    return t.detach() if t.is_floating_point() else None


def count_nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """``(n_nan, n_inf)``: NaN and +-Inf elements of ``t``, counted element-wise (a complex
    tensor by its magnitude; integer and boolean tensors hold none). Synchronises with the
    device; torch function modes are bypassed (safe inside one)."""
    with torch._C.DisableTorchFunction():
        x = _floating(t)
        if x is None:
            return 0, 0
        return int(torch.isnan(x).sum()), int(torch.isinf(x).sum())


def has_nonfinite(t: object) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` is a tensor holding a NaN or an Inf (False for anything else)."""
    if not isinstance(t, torch.Tensor):
        return False
    with torch._C.DisableTorchFunction():
        x = _floating(t)
        return x is not None and not bool(torch.isfinite(x).all())


def has_nan(t: object) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` is a tensor holding a NaN (False for anything else)."""
    if not isinstance(t, torch.Tensor):
        return False
    with torch._C.DisableTorchFunction():
        x = _floating(t)
        return x is not None and bool(torch.isnan(x).any())


def is_finite_number(x: object) -> bool:
    """Whether ``x`` is a real number (a Python or numpy int/float, a one-element tensor)
    that is finite; False for None, booleans, strings, NaN and +-Inf."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex() or x.dtype == torch.bool:
            return False
        return math.isfinite(float(x.detach().reshape(())))
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        return False
    return math.isfinite(float(x))
