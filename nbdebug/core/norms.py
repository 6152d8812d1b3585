"""L2 norms of many tensors at once: one fused kernel per (device, dtype) group.

The one home of "norm of every parameter / gradient": :func:`nbdebug.trace`'s parameter
health, :class:`nbdebug.NaNGuard`'s total gradient and weight norms, and the
health checks all call these.

>>> device_norms([w, b])              # [tensor(3.1), tensor(0.2)]: on their devices, no sync
>>> total_norm(grads, device=dev)     # tensor(4.5): one 0-d tensor on ``dev``, no sync
>>> fused_norms([w, b])               # array([3.1, 0.2]): float64, one host read per device
>>> norm_vector(grads, device=dev)    # tensor([3.1, 0.2]): one 1-D float32 vector on ``dev``
>>> copy_norms(copies, weights, device=dev)   # copies the weights, returns their norms
>>> update_norms(copies, weights, device=dev) # the norms of copies - weights

On the CPU, with the compiled kernel (:mod:`nbdebug.core.kernels`), each of these is one
call over torch's intra-op threads for the whole list (the statistics engine of the trace
uses the same kernel); elsewhere fused ``torch._foreach_*`` ops, one per device and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from . import kernels
from .measure import FLOATING, flat_view

__all__ = [
    "copy_norms",
    "device_norms",
    "fused_norms",
    "host_squares",
    "host_total",
    "norm_vector",
    "plain_sums",
    "total_norm",
    "update_norms",
]


def _groups(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


_DOT_DTYPES = (torch.float32, torch.float64)


def _dot_norm(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)  # a view of a contiguous tensor, else a copy
    return torch.dot(flat, flat).sqrt() if flat.numel() else flat.new_zeros(())


def _kernel_norms(ts: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor] | None:
    """The compiled kernel's norms of CPU tensors of one floating dtype, in one call over
    torch's intra-op threads (measured faster than a dot product per tensor on the
    parameter lists of an MLP, a TransformerEncoder and GPT-2 at 1 and 2 threads); None
    without the kernel or for a tensor it cannot read."""
    fused = kernels.compiled()
    if fused is None or ts[0].dtype not in FLOATING:
        return None
    flats = [t if t.is_contiguous() else flat_view(t) for t in ts]
    if any(f is None for f in flats):
        return None
    wide = torch.float64 in (dtype, ts[0].dtype)
    norms = fused.moments_many(flats, wide)[:, 1].sqrt()
    return list(norms.to(dtype or ts[0].dtype).unbind())


def device_norms(
    tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """The L2 norm of each tensor, as 0-d tensors on that tensor's device (no host sync).

    Parameters
    ----------
    tensors : sequence of Tensor
        Dense tensors, any devices and dtypes (detach them first when they require grad).
    dtype : torch.dtype, optional
        Accumulate and return in this dtype (``torch.float64``: finite elements whose
        float32 sum of squares would overflow still give a finite norm). Default: each
        tensor's own dtype.

    Returns
    -------
    list of Tensor
        One 0-d tensor per input, in input order. One ``torch._foreach_norm`` per
        (device, dtype) group; a dtype it does not support falls back to
        ``torch.linalg.vector_norm`` in float64. float32 and float64 tensors on CPU (and no
        ``dtype``) take one call of the compiled kernel per group
        (:mod:`nbdebug.core.kernels`), or without it a dot product of each with itself.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for (dev, dt), idx in _groups(tensors).items():
        ts = [tensors[i] for i in idx]
        ns: list[torch.Tensor]
        # with ``dtype=``, the fused ``_foreach_norm`` per group: the guard's norms take the
        # kernel through :func:`norm_vector`, and this is its fallback (and float64 reads)
        fused = _kernel_norms(ts, dtype) if dev.type == "cpu" and dtype is None else None
        if fused is not None:
            ns = fused
        elif dtype is None and dev.type == "cpu" and dt in _DOT_DTYPES:
            # on CPU a dot product of the flat tensor with itself reads it once, as fast
            # as a sum (at 2 threads a third faster than _foreach_norm)
            ns = [_dot_norm(t) for t in ts]
        else:
            try:
                ns = (
                    list(torch._foreach_norm(ts))
                    if dtype is None
                    else list(torch._foreach_norm(ts, 2, dtype=dtype))
                )
            except (RuntimeError, TypeError):
                ns = [torch.linalg.vector_norm(t.double()) for t in ts]
                if dtype is not None:
                    ns = [n.to(dtype) for n in ns]
        for i, n in zip(idx, ns):
            out[i] = n
    return [n for n in out if n is not None]


def plain_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The sum of each non-negative tensor (Adam's ``exp_avg_sq``), 0-d on its device, no
    sync: one fused L1 norm per device and dtype (on the CPU a plain sum per tensor is
    faster)."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.sum() for t in tensors]
    return list(torch._foreach_norm(list(tensors), 1))


def total_norm(
    tensors: Sequence[torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The L2 norm of all ``tensors`` together, as a 0-d ``dtype`` tensor on ``device``,
    without a host sync (0 for no tensors)."""
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    total: torch.Tensor = torch.linalg.vector_norm(norm_vector(tensors, device=device, dtype=dtype))
    return total


def _kernel_for(tensors: Sequence[torch.Tensor]) -> ModuleType | None:
    """The compiled kernel for a list of CPU tensors (it checks them itself: a layout,
    dtype or device it cannot read raises, and the caller falls back on fused torch ops)."""
    fused = kernels.compiled()
    return fused if fused is not None and tensors[0].device.type == "cpu" else None


def _as_vector(sq: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    out = sq.sqrt().to(dtype)
    return out if device.type == "cpu" else out.to(device)


#: what the kernel raises for a tensor it cannot read (not contiguous, not a float, ...)
_UNREADABLE = (RuntimeError, TypeError)


def host_squares(tensors: Sequence[torch.Tensor]) -> np.ndarray | None:
    """The sum of squares of each CPU tensor, as a float64 array on the host: one call of
    the compiled kernel and no torch op besides (on the CPU reading a value costs no
    synchronisation, and each op's dispatch costs more than these sums of a step's
    gradients take to combine on the host). ``None`` without the kernel, for tensors
    elsewhere or one it cannot read (the caller then uses :func:`norm_vector`)."""
    if not tensors:
        return np.zeros(0)
    fused = _kernel_for(tensors)
    if fused is None:
        return None
    try:
        moments: np.ndarray = fused.moments_many(list(tensors), False).numpy()
    except _UNREADABLE:
        return None
    return moments[:, 1]


def host_total(squares: np.ndarray) -> float:
    """The norm of all the tensors together from :func:`host_squares`' sums (a plain
    sum: numpy's costs more on a few values, and ``math.fsum`` raises where the sum
    overflows; inf then, as the float32 norms say)."""
    return math.sqrt(sum(squares.tolist()))


def norm_vector(
    tensors: Sequence[torch.Tensor], *, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The L2 norm of each tensor, as one 1-D ``dtype`` vector on ``device`` (no host
    sync): on the CPU one call of the compiled kernel for all of them (squares
    accumulated in float64 when ``dtype`` is), else :func:`device_norms` stacked."""
    if not tensors:
        return torch.zeros(0, dtype=dtype, device=device)
    fused = _kernel_for(tensors)
    if fused is not None:
        try:
            sq = fused.moments_many(list(tensors), dtype == torch.float64)[:, 1]
            return _as_vector(sq, device, dtype)
        except _UNREADABLE:
            pass
    norms = device_norms(tensors, dtype=dtype)
    return torch.stack([n if n.device == device else n.to(device) for n in norms])


def copy_norms(
    copies: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Copy each tensor into its buffer in ``copies`` (same shapes and dtypes) and return
    the tensors' L2 norms as in :func:`norm_vector`: one pass over each tensor with the
    compiled kernel, a ``torch._foreach_copy_`` and a norm otherwise."""
    fused = _kernel_for(tensors) if copies else None
    if fused is not None:
        try:
            sq = fused.copy_sq_many(list(copies), list(tensors), dtype == torch.float64)
            return _as_vector(sq, device, dtype)
        except _UNREADABLE:  # (checked before anything is copied)
            pass
    if copies:
        torch._foreach_copy_(list(copies), list(tensors))
    return norm_vector(tensors, device=device, dtype=dtype)


def update_norms(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    scratch: bool = True,
) -> torch.Tensor:
    """The L2 norm of each ``before - after`` as in :func:`norm_vector` (an update: a
    weight's copy against the weight now). With the compiled kernel both are read once and
    nothing is written; otherwise ``before`` is overwritten with the difference (a fused
    ``torch._foreach_sub_``) when ``scratch``, else the difference is a new tensor."""
    fused = _kernel_for(before) if before else None
    if fused is not None:
        try:
            sq = fused.diff_sq_many(list(before), list(after), dtype == torch.float64)
            return _as_vector(sq, device, dtype)
        except _UNREADABLE:
            pass
    if not scratch and before:
        return norm_vector(
            torch._foreach_sub(list(before), list(after)), device=device, dtype=dtype
        )
    if before:
        torch._foreach_sub_(list(before), list(after))
    return norm_vector(before, device=device, dtype=dtype)


def fused_norms(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None) -> np.ndarray:
    """The L2 norm of each tensor as a float64 numpy array: :func:`device_norms`, then
    one host read per device.

    Parameters
    ----------
    tensors : sequence of Tensor
    dtype : torch.dtype, optional
        As in :func:`device_norms`.

    Returns
    -------
    numpy.ndarray, shape (len(tensors),), float64
    """
    out = np.empty(len(tensors))
    if not len(tensors):
        return out
    norms = device_norms(tensors, dtype=dtype)
    by_dev: dict[torch.device, list[int]] = {}
    for i, n in enumerate(norms):
        by_dev.setdefault(n.device, []).append(i)
    for idx in by_dev.values():
        out[idx] = torch.stack([norms[i].double() for i in idx]).cpu().numpy()
    return out
