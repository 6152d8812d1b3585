"""The snapshot file format: its constants, :class:`SnapshotError`, and the helpers that
turn training state into plain data (and back) and write a file atomically.

:mod:`nbdebug.core.snapshot` saves, loads and replays snapshots with these.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import os
import platform
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .state import RngState

FORMAT = "nbdebug-snapshot"
#: Version of the file layout this nbdebug writes; it reads this one and older ones.
FORMAT_VERSION = 1
SUFFIX = ".nbsnap"

_ZIP_MAGIC = b"PK\x03\x04"
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
# module prefixes whose objects may be imported by name without trust_recipe
_TRUSTED_MODULES = ("torch",)

_REQUIRED: dict[str, tuple[type, ...]] = {
    "step": (int, type(None)),
    "time": (float, int),
    "reason": (dict,),
    "model_state": (dict,),
    "model_class": (str, type(None)),
    "model_training": (bool,),
    "optimizer": (dict, type(None)),
    "optimizer_class": (str, type(None)),
    "optimizer_params": (list, type(None)),
    "scaler": (dict, type(None)),
    "scheduler": (dict, type(None)),
    "scheduler_class": (str, type(None)),
    "rng": (dict, type(None)),
    "history": (list,),
    "environment": (dict,),
    "recipe": (dict, type(None)),
    "loss_fn": (dict, type(None)),
    "dropped": (list,),
}
_BATCH_KEYS = ("inputs", "target")


class SnapshotError(Exception):
    """A snapshot file cannot be used: missing, truncated, corrupt, foreign, written by a
    newer nbdebug, or holding a model state that does not fit the given model. The message
    says which, and what was found.

    Examples
    --------
    >>> try:
    ...     snap = nbdebug.load_snapshot("step-000048213.nbsnap", model=make_model)
    ... except nbdebug.SnapshotError as e:
    ...     print(e)   # e.g. "... does not fit the model: missing keys ['head.bias'] ..."
    """


# --------------------------------------------------------------------------- helpers


def import_object(spec: str) -> Any:
    """The object named by ``"package.module:qualname"`` (imports the module).

    Raises
    ------
    ValueError
        ``spec`` is not of that form, the module cannot be imported or has no such name.
    """
    if not isinstance(spec, str) or not _SPEC.match(spec):
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
    if not _SPEC.match(spec):
        return None
    try:
        return spec if import_object(spec) is obj else None
    except ValueError:
        return None


def _trusted(spec: str) -> bool:
    mod = spec.split(":", 1)[0]
    return any(mod == m or mod.startswith(m + ".") for m in _TRUSTED_MODULES)


def parse_recipe(recipe: Any, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Normalise a model recipe to ``{"factory": "package.module:factory", "kwargs": {...}}``.

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
    if not isinstance(recipe, str) or not _SPEC.match(recipe):
        raise ValueError(
            f"recipe must be an import path like 'package.module:factory'; got {recipe!r}."
        )
    kwargs = dict(kwargs or {})
    try:
        kwargs = json.loads(json.dumps(kwargs, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"recipe kwargs must be JSON-serialisable; got {kwargs!r} ({e}).") from e
    return {"factory": recipe, "kwargs": kwargs}


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


def build_loss(spec: Mapping[str, Any] | None, *, trust: bool = False) -> Any:
    """The loss function recorded by :func:`loss_spec` (``None`` when none was recorded).

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
            "closure or partial); pass it again: snap.trace(loss_fn=...)."
        )
    if not _trusted(name) and not trust:
        raise SnapshotError(
            f"the snapshot's loss function is {name!r}, outside torch: load the snapshot with "
            "trust_recipe=True to import it, or pass snap.trace(loss_fn=...)."
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
            "pass it again: snap.trace(loss_fn=...)."
        ) from e


def rng_to_payload(rng: RngState) -> dict[str, Any]:
    """An :class:`RngState` as plain data (tensors, ints, floats)."""
    name, keys, pos, has_gauss, cached = rng.numpy
    version, state, gauss_next = rng.python
    return {
        "torch": rng.torch_cpu.clone(),
        "cuda": [t.clone() for t in rng.cuda] if rng.cuda is not None else None,
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": [int(version), [int(v) for v in state], gauss_next],
    }


def rng_from_payload(d: Mapping[str, Any]) -> RngState:
    """The inverse of :func:`rng_to_payload`."""
    npd = d["numpy"]
    keys = np.asarray(npd["keys"].numpy(), dtype=np.uint32)
    version, state, gauss_next = d["python"]
    return RngState(
        torch_cpu=d["torch"].to(torch.uint8).cpu(),
        cuda=[t.to(torch.uint8).cpu() for t in d["cuda"]] if d.get("cuda") is not None else None,
        numpy=(
            str(npd["name"]),
            keys,
            int(npd["pos"]),
            int(npd["has_gauss"]),
            float(npd["cached_gaussian"]),
        ),
        python=(int(version), tuple(int(v) for v in state), gauss_next),
    )


_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _plain(obj: Any, path: str, dropped: list[str], *, clone: bool) -> Any:
    """``obj`` as data that ``torch.load(weights_only=True)`` accepts; the paths of values
    that cannot be stored go to ``dropped`` and are stored as ``None``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
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
            out[k] = _plain(v, f"{path}[{k!r}]", dropped, clone=clone)
        return out
    if isinstance(obj, (tuple, list)):
        items = [_plain(v, f"{path}[{i}]", dropped, clone=clone) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)  # namedtuple -> tuple
    if isinstance(obj, (set, frozenset)):
        return {_plain(v, path, dropped, clone=clone) for v in obj if isinstance(v, _PLAIN)}
    dropped.append(path)
    return None


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj


def environment(model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Versions and hardware: torch, python, numpy, platform, CUDA, the model's devices
    and dtypes."""
    from .. import __version__

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
        "default_dtype": str(torch.get_default_dtype()).replace("torch.", ""),
    }
    if model is not None:
        tensors = [*model.parameters(), *model.buffers()]
        env["devices"] = sorted({str(t.device) for t in tensors})
        env["dtypes"] = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
        cuda = [d for d in env["devices"] if d.startswith("cuda")]
        if cuda and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(torch.device(cuda[0]))
    return env


def snapshot_name(step: int | None, rank: int | None = None) -> str:
    """File name of the snapshot of ``step``: ``step-000048213.nbsnap``; of one rank of a
    distributed run: ``step-000048213-rank1.nbsnap``."""
    tail = f"-rank{rank}{SUFFIX}" if rank is not None else SUFFIX
    if step is None:
        return "snapshot-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f") + tail
    return f"step-{step:09d}{tail}" if step >= 0 else f"step-m{-step:09d}{tail}"


#: ``...-rankN.nbsnap``: the rank of a distributed run's snapshot file, from its name.
RANK_NAME = re.compile(r"-rank(\d+)(?:-\d+)?\.nbsnap$")


def unique_path(
    directory: str | os.PathLike[str], step: int | None, *, rank: int | None = None
) -> Path:
    """A path in ``directory`` for the snapshot of ``step`` (of ``rank``) that no file
    holds yet."""
    d = Path(directory)
    base = d / snapshot_name(step, rank)
    path, n = base, 1
    while path.exists():
        path = base.with_name(f"{base.stem}-{n}{SUFFIX}")
        n += 1
    return path


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically: a temporary file in the same directory,
    flushed and fsynced, renamed over ``path``, then the directory fsynced. A crash at any
    point leaves either no file or the complete file under ``path`` (and never a
    temporary file after an exception)."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path
