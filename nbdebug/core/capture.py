"""Inputs of a module call as they were at the call, for the op-level replay.

A module's arguments are more than tensors: a Hugging Face ``DynamicCache`` (or any
object holding state) is extended in place by the call, so replaying the module later
with the recorded object would see the state *after* the call. :func:`copy_arguments`
copies such objects (their tensors cloned, the object graph rebuilt) without touching the
user's; modules, functions and classes are shared, never copied.
"""

from __future__ import annotations

import copy
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .state import AutocastState, RngState

__all__ = [
    "CallCapture",
    "call_site",
    "clone_structure",
    "copy_arguments",
    "frame_kind",
    "source_text",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_PKG_DIR = os.path.dirname(_OWN_DIR)
_STDLIB_DIR = os.path.dirname(os.__file__)

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


def clone_structure(obj: Any) -> Any:
    """Detached copies of the tensors in a nested tuple/list/dict (other objects as they
    are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_structure(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [clone_structure(v) for v in obj]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def copy_arguments(obj: Any, *, clone_tensors: bool = True, leaves: bool = False) -> Any:
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
    return _copy(obj, (clone_tensors, leaves), {}, 0)


def _copy(obj: Any, clone: tuple[bool, bool], memo: dict[int, Any], depth: int) -> Any:
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


def frame_kind(filename: str) -> str:
    """``"nbdebug"``, ``"torch"``, ``"python"`` (the standard library, frozen modules) or
    ``"user"`` (everything else: the user's code and other libraries, ``transformers``)."""
    if filename.startswith(_PKG_DIR + os.sep):
        return "nbdebug"
    if filename.startswith(_TORCH_DIR + os.sep):
        return "torch"
    if filename.startswith("<frozen") or (
        filename.startswith(_STDLIB_DIR)
        and "site-packages" not in filename
        and "dist-packages" not in filename
    ):
        return "python"
    return "user"


def call_site() -> str | None:
    """``file.py:line`` of the user's code that called the current module: the first
    frame outside torch and the standard library, going outwards from the hook; ``None``
    when the module was called by torch's own code (``nn.Sequential``) straight from
    nbdebug."""
    f = sys._getframe(1)
    left = False  # left nbdebug's own hook frames
    while f is not None:
        kind = frame_kind(f.f_code.co_filename)
        if kind == "nbdebug":
            if left:
                return None
        elif kind == "user":
            return source_text(f.f_code.co_filename, f.f_lineno)
        else:
            left = True
        f = f.f_back  # type: ignore[assignment]
    return None


def source_text(filename: str, line: int) -> str:
    """``"model.py:83"``, or ``"Cell In[3]:5"`` for code typed in an IPython cell."""
    return f"{cell_name(filename) or os.path.basename(filename)}:{line}"


def cell_name(filename: str) -> str | None:
    """``"Cell In[3]"`` for code typed in a notebook or IPython cell, as IPython names it."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    shell = ipython.get_ipython()
    number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return f"Cell In[{number}]" if number is not None else None


@dataclass
class CallCapture:
    """One module call's inputs as they were at the call (copies), the RNG state, grad
    mode and autocast state then, and the user's line that made the call."""

    args: Any
    kwargs: Any
    rng: RngState | None
    grad_enabled: bool = True
    call_site: str | None = None
    autocast: AutocastState = field(default_factory=AutocastState)

    @classmethod
    def take(cls, args: Any, kwargs: Any) -> CallCapture:
        return cls(
            copy_arguments(args),
            copy_arguments(kwargs),
            RngState.capture(),
            torch.is_grad_enabled(),
            call_site(),
            AutocastState.capture(),
        )

    def fresh(self) -> tuple[Any, Any]:
        """New copies for one replay (a replay may mutate them), RNG put back as it was."""
        if self.rng is not None:
            self.rng.restore()
        return copy_arguments(self.args), copy_arguments(self.kwargs)
