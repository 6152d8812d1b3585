"""Live training objects as the plain data a snapshot stores, and back.

:func:`to_plain` turns tensors, containers and numpy values into what
``torch.load(weights_only=True)`` accepts; :func:`environment` records versions and
hardware; objects that code must rebuild (the loss, the optimizer class) are stored by
import path (:func:`object_name`) and imported back by
:func:`import_object` (outside ``torch`` only when the caller trusts the file).

The file layout itself (the field table, validation, atomic writes) lives in
:mod:`nbdebug.core.snapshot.format` and :mod:`nbdebug.core.snapshot.archive`.
"""

from __future__ import annotations

import importlib
import json
import platform
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..._version import __version__
from ..text import dtype_name
from .format import IMPORT_PATH, SnapshotError

#: module prefixes whose objects may be imported by name without ``trust_recipe``
TRUSTED_MODULES = ("torch",)

# --------------------------------------------------------------------------- plain data

_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def to_plain(obj: Any, path: str, dropped: list[str], *, clone: bool) -> Any:
    """``obj`` as data that ``torch.load(weights_only=True)`` accepts.

    Tensors are detached (subclasses stored as plain tensors; copied with ``clone``, so
    that a view of a whole data set stores only its own elements), numpy arrays become
    tensors, containers are converted item by item (a namedtuple becomes a tuple). The
    ``path`` (``"inputs['x']"``) of every value that cannot be stored is appended to
    ``dropped`` and the value is stored as ``None``.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach() if obj.requires_grad else obj  # (an op saved per batch tensor)
        if type(t) is not torch.Tensor:  # subclasses are pickled by class name
            t = t.as_subclass(torch.Tensor)
        if clone:  # a batch can be a view of a whole data set: store only its own elements
            t = t.clone()
        return t
    if isinstance(obj, _PLAIN):
        if type(obj) in _PLAIN:
            return obj
        # subclasses (TorchVersion, IntEnum, ...) are pickled by class name: exact types
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, bytes):
            return bytes(obj)
        return obj
    if isinstance(obj, np.ndarray):
        try:
            return torch.from_numpy(obj.copy())
        except TypeError:
            dropped.append(path)
            return None
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                dropped.append(f"{path}[{k!r}]")
                continue
            out[k] = to_plain(v, f"{path}[{k!r}]", dropped, clone=clone)
        return out
    if isinstance(obj, (tuple, list)):
        items = [to_plain(v, f"{path}[{i}]", dropped, clone=clone) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)  # namedtuple -> tuple
    if isinstance(obj, (set, frozenset)):
        return {to_plain(v, path, dropped, clone=clone) for v in obj if isinstance(v, _PLAIN)}
    dropped.append(path)
    return None


def _copy_one(
    t: torch.Tensor, into: Callable[[torch.Tensor], torch.Tensor | None] | None
) -> torch.Tensor:
    buffer = into(t) if into is not None else None
    return t.to("cpu", copy=True) if buffer is None else buffer.copy_(t)


def cpu_copy(
    obj: Any,
    memo: dict[Any, torch.Tensor] | None = None,
    *,
    into: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
) -> Any:
    """``obj`` (tensors in dicts, lists and tuples) with every tensor copied to the CPU, so
    that it can be written while training goes on. Tensors that share memory (tied
    weights) stay shared in the copy. ``into(t)``: a CPU tensor of ``t``'s shape and
    dtype to copy ``t`` into (a buffer reused), or ``None`` for a new one."""
    if isinstance(obj, torch.Tensor) and memo is None:  # one tensor: nothing to share with
        return _copy_one(obj.detach() if obj.requires_grad else obj, into)
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        t = obj.detach() if obj.requires_grad else obj
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            str(t.device),
        )
        if key not in memo:
            memo[key] = _copy_one(t, into)
        return memo[key]
    if isinstance(obj, dict):
        return {k: cpu_copy(v, memo, into=into) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v, memo, into=into) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_copy(v, memo, into=into) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (tensors in dicts, lists and tuples) with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_device(v, device) for v in obj)
    return obj


def environment(model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Versions and hardware: torch, python, numpy, platform, CUDA, the model's devices
    and dtypes."""
    env: dict[str, Any] = {
        "nbdebug": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "num_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": dtype_name(torch.get_default_dtype()),
    }
    if model is not None:
        tensors = [*model.parameters(), *model.buffers()]
        env["devices"] = sorted({str(t.device) for t in tensors})
        env["dtypes"] = sorted({dtype_name(t.dtype) for t in tensors})
        cuda = [d for d in env["devices"] if d.startswith("cuda")]
        if cuda and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(torch.device(cuda[0]))
    return env


# --------------------------------------------------------------------------- import paths


def parse_recipe(recipe: Any, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Normalise a model recipe to ``{"factory": "package.module:factory", "kwargs": {...}}``
    (the ``recipe`` field).

    ``recipe`` is ``None``, an import path string (with ``kwargs`` as a JSON-serialisable
    mapping), a ``(path, kwargs)`` pair, or a ``{"factory": ..., "kwargs": ...}`` dict.
    """
    if recipe is None:
        if kwargs:
            raise ValueError("recipe_kwargs was given without a recipe.")
        return None
    if isinstance(recipe, (tuple, list)) and len(recipe) == 2:
        recipe, kwargs = recipe
    elif isinstance(recipe, Mapping):
        kwargs = recipe.get("kwargs") or {}
        recipe = recipe.get("factory")
    if not isinstance(recipe, str) or not IMPORT_PATH.match(recipe):
        raise ValueError(
            f"recipe must be an import path like 'package.module:factory'; got {recipe!r}."
        )
    kwargs = dict(kwargs or {})
    try:
        kwargs = json.loads(json.dumps(kwargs, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"recipe kwargs must be JSON-serialisable; got {kwargs!r} ({e}).") from e
    return {"factory": recipe, "kwargs": kwargs}


def import_object(spec: str) -> Any:
    """The object named by ``"package.module:qualname"`` (imports the module).

    Raises
    ------
    ValueError
        ``spec`` is not of that form, the module cannot be imported or has no such name.
    """
    if not isinstance(spec, str) or not IMPORT_PATH.match(spec):
        raise ValueError(f"expected an import path like 'package.module:factory'; got {spec!r}.")
    modname, qualname = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(modname)
    except Exception as e:  # ImportError, or the module raising while it is imported
        raise ValueError(
            f"cannot import module {modname!r} of {spec!r}: {type(e).__name__}: {e}"
        ) from e
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(
                f"module {modname!r} has no attribute {qualname!r} (from {spec!r})."
            ) from e
    return obj


def object_name(obj: Any) -> str | None:
    """``"module:qualname"`` when importing that name gives back ``obj``, else ``None``."""
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual:
        return None
    spec = f"{mod}:{qual}"
    if not IMPORT_PATH.match(spec):
        return None
    try:
        return spec if import_object(spec) is obj else None
    except ValueError:
        return None


def is_trusted(spec: str) -> bool:
    """Whether the import path ``spec`` lies in :data:`TRUSTED_MODULES` (``torch``), so
    that importing it needs no ``trust_recipe=True``."""
    mod = spec.split(":", 1)[0]
    return any(mod == m or mod.startswith(m + ".") for m in TRUSTED_MODULES)


def loss_spec(loss_fn: Any) -> dict[str, Any] | None:
    """How to rebuild ``loss_fn`` from a snapshot: ``{"name": "module:qualname", ...}``.

    A function stores its import path; an ``nn.Module`` loss stores its class path, its
    plain attributes (``reduction``, ``label_smoothing``, ...) and its state (``weight``).
    A lambda, a closure or a partial stores only its ``repr`` (``name`` is ``None``).
    """
    if loss_fn is None:
        return None
    if isinstance(loss_fn, torch.nn.Module):
        attrs = {
            k: v
            for k, v in vars(loss_fn).items()
            if not k.startswith("_")
            and k != "training"
            and isinstance(v, (bool, int, float, str, type(None)))
        }
        return {
            "name": object_name(type(loss_fn)),
            "module": True,
            "attrs": attrs,
            "state": {k: v.detach().clone() for k, v in loss_fn.state_dict().items()},
            "repr": repr(loss_fn)[:200],
        }
    return {"name": object_name(loss_fn), "module": False, "repr": repr(loss_fn)[:200]}


def build_loss(
    spec: Mapping[str, Any] | None, *, trust: bool = False, call: str = "snap.trace(loss_fn=...)"
) -> Any:
    """The loss function recorded by :func:`loss_spec` (``None`` when none was recorded);
    ``call`` is how the user passes one instead (named in the errors).

    Raises
    ------
    SnapshotError
        It was not importable (a lambda or closure), it lies outside ``torch`` and
        ``trust`` is false, or it cannot be rebuilt.
    """
    if not spec:
        return None
    name = spec.get("name")
    if not isinstance(name, str):
        raise SnapshotError(
            f"the snapshot's loss function {spec.get('repr', '?')} has no import path (a lambda, "
            f"closure or partial); pass it again: {call}."
        )
    if not is_trusted(name) and not trust:
        raise SnapshotError(
            f"the snapshot's loss function is {name!r}, outside torch: load the snapshot with "
            f"trust_recipe=True to import it, or pass {call}."
        )
    try:
        obj = import_object(name)
        if not spec.get("module"):
            return obj
        loss = obj()
        for k, v in dict(spec.get("attrs") or {}).items():
            setattr(loss, k, v)
        state = dict(spec.get("state") or {})
        for k, v in state.items():  # buffers such as CrossEntropyLoss.weight (None by default)
            if "." not in k and k not in loss._parameters:
                loss.register_buffer(k, v)
        if state:
            loss.load_state_dict(state)
        return loss
    except Exception as e:
        raise SnapshotError(
            f"cannot rebuild the snapshot's loss function {name!r} ({type(e).__name__}: {e}); "
            f"pass it again: {call}."
        ) from e
