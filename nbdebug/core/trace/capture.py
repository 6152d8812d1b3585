"""Inputs of a module call as they were at the call, for the op-level replay.

A module's arguments are more than tensors: a Hugging Face ``DynamicCache`` (or any
object holding state) is extended in place by the call, so replaying the module later
with the recorded object would see the state *after* the call. :func:`copy_arguments`
copies such objects (their tensors cloned, the object graph rebuilt) without touching the
user's; modules, functions and classes are shared, never copied.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch

from ..batch import named_tensors
from ..state import AutocastState, RngState
from .frames import call_site

__all__ = ["CallCapture", "clone_structure", "copy_arguments"]

_ATOMS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, slice)
_SHARED = (
    torch.nn.Module,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
)
_MAX_DEPTH = 8

T = TypeVar("T")


def clone_structure(obj: T) -> T:
    """Detached copies of the tensors in a nested tuple/list/dict (other objects as they
    are)."""
    return cast(T, _clone(obj))


def _clone(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_clone(v) for v in obj]
        kind: Any = type(obj)  # a tuple, a list or a named tuple
        return kind(*items) if hasattr(obj, "_fields") else kind(items)
    return obj


def copy_arguments(obj: T, *, clone_tensors: bool = True, leaves: bool = False) -> T:
    """A copy of ``obj`` that a call may mutate without changing ``obj``.

    Tensors are detached clones (``clone_tensors=True``) or the same tensors; with
    ``leaves=True`` a clone requires grad when its original does (a leaf of its own, so a
    backward through it stops there and leaves the original's ``.grad`` and graph alone);
    tuples,
    lists and dicts are rebuilt; other objects with a ``__dict__`` (caches, configs,
    dataclasses) are shallow-copied with their attributes copied the same way, shared
    references kept shared. Modules, functions and classes are shared. An object that
    cannot be copied is shared as it is.
    """
    return cast(T, _copy(obj, (clone_tensors, leaves), {}, 0))


def _copy(o: object, clone: tuple[bool, bool], memo: dict[int, object], depth: int) -> object:
    obj: Any = o  # any object graph: attributes and items are read dynamically
    if isinstance(obj, torch.Tensor):
        if not clone[0]:
            return obj
        hit = memo.get(id(obj))
        if hit is None:
            hit = obj.detach().clone()
            if clone[1] and obj.requires_grad:
                hit.requires_grad_()
            memo[id(obj)] = hit
        return hit
    if isinstance(obj, (*_ATOMS, *_SHARED)) or depth > _MAX_DEPTH:
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    kind = type(obj)
    if kind in (tuple, list) or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        items = [_copy(v, clone, memo, depth + 1) for v in obj]
        out: Any = kind(*items) if hasattr(obj, "_fields") else kind(items)
    elif kind is dict:
        out = {k: _copy(v, clone, memo, depth + 1) for k, v in obj.items()}
    elif isinstance(obj, np.ndarray):
        out = obj.copy()
    elif hasattr(obj, "__dict__") and not callable(obj):
        try:
            out = copy.copy(obj)
        except Exception:
            return obj
        memo[id(obj)] = out
        for k, v in vars(obj).items():
            try:
                setattr(out, k, _copy(v, clone, memo, depth + 1))
            except Exception:
                object.__setattr__(out, k, v)
        if isinstance(obj, (list, dict)):  # a container subclass: its items too
            if isinstance(obj, list):
                out[:] = [_copy(v, clone, memo, depth + 1) for v in obj]
            else:
                for k, v in obj.items():
                    out[k] = _copy(v, clone, memo, depth + 1)
        return out
    else:
        return obj
    memo[id(obj)] = out
    return out


@dataclass
class CallCapture:
    """One module call's inputs as they were at the call (copies), the RNG state, grad
    mode and autocast state then, the user's line that made the call, and which input
    tensors required grad then (``named_tensors((args, kwargs))`` names): the copies are
    detached, and a backward replay must ask for the gradients the step computed, no
    more (``x * 0`` has no input gradient to turn ``inf * 0`` into NaN when ``x`` is a
    batch tensor that wants none)."""

    args: tuple[object, ...]
    kwargs: dict[str, object]
    rng: RngState | None
    grad_enabled: bool = True
    call_site: str | None = None
    autocast: AutocastState = field(default_factory=AutocastState)
    wants_grad: frozenset[str] | None = None  # None: not known (every float input)

    @classmethod
    def take(cls, args: tuple[object, ...], kwargs: dict[str, object]) -> CallCapture:
        """Copies of a call's arguments, and the RNG, grad and autocast state, now."""
        return cls(
            copy_arguments(args),
            copy_arguments(kwargs),
            RngState.capture(),
            torch.is_grad_enabled(),
            call_site(),
            AutocastState.capture(),
            frozenset(n for n, t in named_tensors((args, kwargs)) if t.requires_grad),
        )

    def wanted_grad(self, name: str, t: torch.Tensor) -> bool:
        """Whether the input tensor ``name`` (of a :meth:`fresh` copy, ``named_tensors``
        name) required grad at the call (any float one when that was not recorded)."""
        if not (t.is_floating_point() or t.is_complex()):
            return False
        return self.wants_grad is None or name in self.wants_grad

    def fresh(self) -> tuple[tuple[object, ...], dict[str, object]]:
        """New copies for one replay (a replay may mutate them), RNG put back as it was."""
        if self.rng is not None:
            self.rng.restore()
        return copy_arguments(self.args), copy_arguments(self.kwargs)
