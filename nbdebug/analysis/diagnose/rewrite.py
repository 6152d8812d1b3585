"""The epsilon fix's torch function mode: the fixable operation families and
:class:`RewriteMode`, which rewrites the arguments of one family's calls in a replay.

The families (:data:`FAMILIES`) are the operations an epsilon or a clamp can make finite:
``div`` (a denominator at 0), ``log`` and ``sqrt`` (an input at or below 0), ``exp`` (an
overflow) and ``softmax`` (a fully masked row).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from ...core.batch import named_tensors
from ...core.optable import OpFamily, op_row
from ...core.stats import has_nan, has_nonfinite
from ...core.trace.frames import user_frame
from ...core.trace.ops import composite_body

__all__ = [
    "FAMILIES",
    "RewriteMode",
    "caller_line",
    "default_eps",
    "func_family",
    "op_family",
    "underflows",
]

#: The fixable families, in the order the probe looks for them: the operations of
#: :data:`nbdebug.core.optable.OP_TABLE` marked ``eps_fixable`` in these families.
FAMILIES: tuple[OpFamily, ...] = (
    OpFamily.DIV,
    OpFamily.LOG,
    OpFamily.SQRT,
    OpFamily.EXP,
    OpFamily.SOFTMAX,
)

_RECIPROCALS = ("reciprocal", "reciprocal_")
_REVERSED = ("__rtruediv__", "__rdiv__", *_RECIPROCALS)


def op_family(op: str | None) -> OpFamily | None:
    """The fixable family of an operation name (``"Tensor.__truediv__"`` -> ``"div"``,
    ``"torch.log"`` -> ``"log"``, ``"torch.nn.functional.softmax"`` -> ``"softmax"``), or
    ``None`` when an epsilon or clamp cannot fix it (its row in
    :data:`~nbdebug.core.optable.OP_TABLE` is not ``eps_fixable``)."""
    row = op_row(op)
    return row.family if row is not None and row.eps_fixable else None


def func_family(func: Callable[..., Any]) -> OpFamily | None:
    """:func:`op_family` of a torch callable (as a torch function mode receives it)."""
    try:
        name = resolve_name(func) or getattr(func, "__name__", "")
    except Exception:  # pragma: no cover - exotic callables
        name = getattr(func, "__name__", "")
    return op_family(name)


def default_eps(dtype: torch.dtype) -> float:
    """The epsilon used for ``dtype``: 1e-6, or 1e-3 in half precision (1e-6 is below
    float16's normal range and its reciprocal above its maximum)."""
    return 1e-3 if dtype in (torch.float16, torch.bfloat16) else 1e-6


def caller_line() -> tuple[str, int] | None:
    """(filename, line) of the innermost frame of the user's code
    (:func:`nbdebug.core.trace.frames.user_frame`) that called the current torch
    operation."""
    f = user_frame(sys._getframe(1))
    return (f.f_code.co_filename, f.f_lineno) if f is not None else None


def underflows(out: object) -> bool:
    """Whether a row (the last dimension) of an ``exp`` result is all zeros: a softmax
    written by hand then divides 0 by 0."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.numel() == 0:
        return False
    return bool((out == 0).all(dim=-1).any())


def _away_from_zero(d: torch.Tensor, eps: float) -> torch.Tensor:
    """``d + eps`` where ``d >= 0`` and ``d - eps`` where ``d < 0``."""
    return d + torch.where(d < 0, -eps, eps).to(d.dtype)


def _floating(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class RewriteMode(TorchFunctionMode):
    """Rewrites the arguments of one family of torch operations:

    * ``div``: a tensor denominator ``d`` becomes ``d + eps`` (``d - eps`` where ``d < 0``);
    * ``log``, ``sqrt``: the input becomes ``x.clamp_min(eps)``;
    * ``exp``: where the result overflows, ``exp(x - max(x))`` over the last dimension;
    * ``softmax``: rows that come out NaN with every score ``-inf`` (fully masked)
      become zeros.

    ``calls`` counts the rewritten calls; ``lines`` collects the callers' ``(file, line)``.
    """

    def __init__(self, family: OpFamily, eps: float | None = None):
        super().__init__()
        self.family = family
        self.eps = eps
        self.calls = 0
        self.lines: list[tuple[str, int]] = []

    def _eps(self, t: torch.Tensor) -> float:
        return self.eps if self.eps is not None else default_eps(t.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func_family(func) != self.family:
            body = composite_body(func)
            if body is None:
                return func(*args, **kwargs)
            # a composite (F.normalize, attention): its own ops, where the trace's root is
            with self:
                return body(*args, **kwargs)
        rewrite = {
            OpFamily.DIV: self._div,
            OpFamily.LOG: self._clamped,
            OpFamily.SQRT: self._clamped,
            OpFamily.EXP: self._exp,
            OpFamily.SOFTMAX: self._softmax,
        }[self.family]
        return rewrite(func, list(args), dict(kwargs))

    def _note(self) -> None:
        self.calls += 1
        where = caller_line()
        if where is not None and where not in self.lines:
            self.lines.append(where)

    def _div(self, func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("rounding_mode") is not None:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _RECIPROCALS:
            d = args[0]
            if _floating(d):
                self._note()
                return 1.0 / _away_from_zero(d, self._eps(d))
            return func(*args, **kwargs)
        pos = 0 if name in _REVERSED else 1
        key = "other" if "other" in kwargs else None
        d = kwargs[key] if key else (args[pos] if len(args) > pos else None)
        if isinstance(d, torch.Tensor) and d.is_floating_point():
            new = _away_from_zero(d, self._eps(d))
            if key:
                kwargs[key] = new
            else:
                args[pos] = new
            self._note()
        return func(*args, **kwargs)

    def _clamped(self, func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        key = "input" if "input" in kwargs else None
        x = kwargs[key] if key else args[0]
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            new = x.clamp_min(self._eps(x))
            if key:
                kwargs[key] = new
            else:
                args[0] = new
            self._note()
        return func(*args, **kwargs)

    def _exp(self, func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if (
            isinstance(x, torch.Tensor)
            and not has_nonfinite(x)
            and (has_nonfinite(out) or underflows(out))
        ):
            self._note()
            if x.dim() == 0:
                return torch.exp(x.clamp_max(math.log(torch.finfo(x.dtype).max)))
            return torch.exp(x - x.detach().amax(dim=-1, keepdim=True))
        return out

    def _softmax(self, func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        # NaN where no input was NaN = a fully masked row
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input", kwargs.get("query"))
        outs = [t for _, t in named_tensors(out)]
        if not outs or not has_nan(outs[0]):
            return out
        o = outs[0]
        scores = x if isinstance(x, torch.Tensor) and x.shape == o.shape else None
        made = torch.isnan(o)
        if scores is not None:
            # a fully masked row: every score -inf (a row with a +inf score overflowed:
            # zeroing it would hide the overflow, not fix a mask)
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            dim = dim if isinstance(dim, int) else -1
            made = made & torch.isneginf(scores).all(dim=dim, keepdim=True)
        if not bool(made.any()):
            return out
        self._note()
        if scores is not None:
            # the masked rows' scores made finite first, so that the backward through
            # them is 0, not NaN (softmax's backward reads its output)
            safe = torch.where(made, torch.zeros_like(scores), scores)
            if args:
                args[0] = safe
            else:
                kwargs = {**kwargs, "input": safe}
            o = func(*args, **kwargs)
            o = o if isinstance(o, torch.Tensor) else next(t for _, t in named_tensors(o))
        fixed = torch.where(made, torch.zeros_like(o), o)
        return fixed if isinstance(out, torch.Tensor) else (fixed, *out[1:])
