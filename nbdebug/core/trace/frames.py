"""Which stack frame is the user's code: one rule for nbdebug.

A frame runs nbdebug's own code, torch's, Python's (the standard library, frozen modules)
or the user's: everything else, other libraries such as ``transformers`` included (their
``site-packages`` files count as the user's code, even inside a system Python's library
folder). "The user's line" is the first frame outside torch's own files (and nbdebug's
and the standard library's), going outwards: :func:`user_frame`.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

from ..vocab import FrameKind

__all__ = ["call_site", "cell_name", "frame_kind", "source_text", "user_frame", "user_source"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STDLIB_DIR = os.path.dirname(os.__file__)
_MODULE_PY = os.path.join("nn", "modules", "module.py")
#: torch files that only pass a call on (dispatch, module calls, a parametrized
#: attribute's getter) and ``torch/utils`` (checkpointing, decorators): never "the line in
#: torch that ran the op"; ``torch/nn/utils/parametrizations.py`` (``weight_norm``'s
#: forward) is such a line
_TORCH_PLUMBING = (
    "overrides.py",
    "_tensor.py",
    _MODULE_PY,
    os.path.join("nn", "utils", "parametrize.py"),
)
_TORCH_UTILS = os.path.join(_TORCH_DIR, "utils") + os.sep
#: nbdebug frames that run the replayed code: past them a source search has left it
_REPLAY_FRAMES = frozenset(
    {
        "replay_forward",
        "replay_backward",
        "replay_loss",
        "replay_loss_backward",
        "run_backward_source",
        "compute_loss",
    }
)


def frame_kind(filename: str) -> FrameKind:
    """Whose code ``filename`` holds: nbdebug's, torch's, Python's (the standard library,
    frozen modules) or the user's (everything else, ``site-packages`` libraries too)."""
    if filename.startswith(_PKG_DIR + os.sep):
        return FrameKind.NBDEBUG
    if filename.startswith(_TORCH_DIR + os.sep):
        return FrameKind.TORCH
    if filename.startswith("<frozen") or (
        filename.startswith(_STDLIB_DIR)
        and "site-packages" not in filename
        and "dist-packages" not in filename
    ):
        return FrameKind.PYTHON
    return FrameKind.USER


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame of the user's code (:func:`frame_kind`), ``frame`` itself or one
    of its callers going outwards; ``None`` when there is none."""
    f = frame
    while f is not None:
        if frame_kind(f.f_code.co_filename) == FrameKind.USER:
            return f
        f = f.f_back
    return None


def call_site() -> str | None:
    """``file.py:line`` of the user's code that called the current module: the user's
    frame going outwards from the hook; ``None`` when the module was called by torch's
    own code (``nn.Sequential``) straight from nbdebug."""
    f = sys._getframe(1)
    while f is not None and frame_kind(f.f_code.co_filename) == FrameKind.NBDEBUG:
        f = f.f_back  # type: ignore[assignment]
    if f is None:
        return None
    found = user_frame(f)
    if found is None:
        return None
    # torch or Python frames between the hook and the user's code only: an nbdebug frame
    # between them means nbdebug itself called the module
    g: FrameType | None = f
    while g is not None and g is not found:
        if frame_kind(g.f_code.co_filename) == FrameKind.NBDEBUG:
            return None
        g = g.f_back
    return source_text(found.f_code.co_filename, found.f_lineno)


def user_source(fallback: str | None = None) -> str | None:
    """``file.py:line`` of the code that called the current torch operation: the user's
    frame (:func:`frame_kind`) inside the replayed code. When only torch's own code
    called it (a torch module replayed on its own), the user's line that called that
    module (``fallback``), else the torch module's line
    (``torch/nn/modules/linear.py:134``)."""
    f: FrameType | None = sys._getframe(1)
    torch_frame = None
    while f is not None:
        fn = f.f_code.co_filename
        kind = frame_kind(fn)
        if kind == FrameKind.NBDEBUG:
            if f.f_code.co_name in _REPLAY_FRAMES:
                break  # left the replayed code
        elif kind == FrameKind.TORCH:
            if not fn.endswith(_TORCH_PLUMBING) and not fn.startswith(_TORCH_UTILS):
                torch_frame = f  # the outermost one wins
        elif kind == FrameKind.USER:
            return source_text(fn, f.f_lineno)
        f = f.f_back
    if fallback is not None:
        return fallback
    if torch_frame is not None:
        rel = os.path.relpath(torch_frame.f_code.co_filename, os.path.dirname(_TORCH_DIR))
        return f"{rel}:{torch_frame.f_lineno}"
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
