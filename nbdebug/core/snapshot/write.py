"""Writing a snapshot: :func:`save_snapshot` turns the live training objects of one step
(:class:`TrainingObjects`) and its batch into the plain data of the field table
(:data:`nbdebug.core.snapshot.format.FIELDS`) and writes it atomically."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..batch import uncompiled
from ..state import RngState
from .archive import atomic_save, unique_path
from .data import environment, loss_spec, object_name, parse_recipe, to_plain
from .format import build_payload
from .rngdata import rng_to_payload

__all__ = ["Scaler", "Scheduler", "TrainingObjects", "compile_settings", "save_snapshot"]


@runtime_checkable
class Scheduler(Protocol):
    """A learning-rate scheduler as a snapshot sees it: its state."""

    def state_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class Scaler(Protocol):
    """A ``torch.amp.GradScaler`` as the guard and the snapshot see it."""

    def state_dict(self) -> dict[str, Any]: ...

    def get_scale(self) -> float: ...


@dataclass(frozen=True)
class TrainingObjects:
    """The live objects of one training step whose state a snapshot stores.

    Attributes
    ----------
    model : torch.nn.Module
        Its ``state_dict()`` (parameters and buffers, on their devices), class name and
        train flags are stored.
    optimizer : torch.optim.Optimizer, optional
    scheduler : a learning-rate scheduler, optional
    scaler : torch.amp.GradScaler, optional
        Their ``state_dict()`` is stored.
    model_state, optimizer_state : dict, optional
        Stored instead of ``model.state_dict()`` / ``optimizer.state_dict()``: e.g. the
        whole state gathered from a sharded (FSDP2) model.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Scheduler | None = None
    scaler: Scaler | None = None
    model_state: Mapping[str, torch.Tensor] | None = None
    optimizer_state: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module; got {type(self.model).__qualname__}."
            )


#: keywords of :func:`save_snapshot` that take a live object and write the field(s) it
#: produces (every other keyword is a field of the table, given as plain data)
PRODUCED = ("optimizer", "scheduler", "scaler", "recipe", "loss_fn", "rng")


def save_snapshot(
    path: str | os.PathLike[str],
    model: torch.nn.Module | TrainingObjects,
    inputs: Any = None,
    target: Any = None,
    *,
    step: int | None = None,
    reason: Mapping[str, Any] | str | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    write: Callable[[dict[str, Any], Path], Path] | None = None,
    **fields: Any,
) -> Path:
    """Write one snapshot file atomically and return its path.

    Parameters
    ----------
    path : str or PathLike
        The file to write. A directory (an existing one, or a name without a suffix such
        as ``"snapshots"``) gets a new ``step-000000012.nbsnap`` file in it. Parent
        directories are created.
    model : torch.nn.Module or TrainingObjects
        The model (its state, class name and train flags are stored), or the model with
        its optimizer, scheduler and scaler. A ``torch.compile``'d model is stored as the
        module it wraps, with its compile settings in the field ``compiled``
        (:func:`compile_settings`).
    inputs, target : tensor, tuple, list or dict of tensors, optional
        The batch (copied, detached).
    step : int, optional
    reason : dict or str, optional
        Why the snapshot was written: ``{"kind": ..., "message": ..., ...}`` (plain values).
    history : list of dict, optional
        Rolling history rows (``step``, ``loss``, ``grad_norm``, ...).
    write : callable, optional
        ``write(payload, path) -> path`` writes the finished dictionary (default:
        :func:`~nbdebug.core.snapshot.archive.atomic_save`, now; the guard's
        ``async_save`` copies it to the CPU and writes it on a background thread).
    **fields
        ``optimizer=``, ``scheduler=``, ``scaler=`` (live objects, with a plain ``model``:
        their ``state_dict()`` is stored), ``recipe=`` (``"package.module:factory"``, a
        ``(path, kwargs)`` pair or a dict), ``loss_fn=`` (stored by import path, see
        :func:`~nbdebug.core.snapshot.data.loss_spec`), ``rng=`` (an ``RngState``;
        default: the current states); any other keyword is a further field of the table
        (:data:`nbdebug.core.snapshot.format.FIELDS`) by key, stored as plain data.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    TypeError
        A keyword is not a snapshot field (or one written from the arguments above), or
        its value has a type the field does not accept.
    ValueError
        A value its field's check refuses (the check the reader runs: e.g. an ``autocast``
        state without its ``device_type``).
    """
    objects = _objects(model, fields)
    compiled = compile_settings(objects.model)
    if compiled is not None:  # the state and class are those of the module it wraps
        objects = dataclasses.replace(objects, model=uncompiled(objects.model))
        fields.setdefault("compiled", compiled)
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise TypeError(f"step must be an int or None; got {type(step).__qualname__}.")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__qualname__}.")
    target_path = Path(path)
    if target_path.is_dir() or not target_path.suffix:
        target_path = unique_path(target_path, None if step is None else int(step))
    recipe, loss_fn = fields.pop("recipe", None), fields.pop("loss_fn", None)
    rng: RngState | None = fields.pop("rng", None)
    dropped: list[str] = []
    values: dict[str, Any] = {
        "step": None if step is None else int(step),
        "time": time.time(),
        "reason": to_plain(_reason(reason), "reason", dropped, clone=False),
        **_model_values(objects, dropped),
        "inputs": to_plain(inputs, "inputs", dropped, clone=True),
        "target": to_plain(target, "target", dropped, clone=True),
        **_training_values(objects, dropped),
        "rng": rng_to_payload(rng if rng is not None else RngState.capture()),
        "history": [to_plain(dict(h), "history", dropped, clone=False) for h in (history or [])],
        "environment": to_plain(environment(objects.model), "environment", dropped, clone=False),
        "recipe": parse_recipe(recipe),
        "loss_fn": to_plain(loss_spec(loss_fn), "loss_fn", dropped, clone=False),
    }
    for key, value in fields.items():
        if key in values or key in ("dropped", "layout"):
            raise TypeError(
                f"save_snapshot() writes the field {key!r} from its own arguments; "
                "it cannot be given by keyword."
            )
        values[key] = to_plain(value, key, dropped, clone=True)
    values["dropped"] = dropped
    values["layout"] = "safetensors"
    return (write or atomic_save)(build_payload(values), target_path)


def _objects(model: torch.nn.Module | TrainingObjects, fields: dict[str, Any]) -> TrainingObjects:
    """``model`` as :class:`TrainingObjects`, taking ``optimizer=`` / ``scheduler=`` /
    ``scaler=`` out of ``fields`` (given with a plain model)."""
    live = {k: fields.pop(k) for k in ("optimizer", "scheduler", "scaler") if k in fields}
    if isinstance(model, TrainingObjects):
        given = [k for k, v in live.items() if v is not None]
        if given:
            raise TypeError(
                f"save_snapshot() got {', '.join(given)} twice: in the TrainingObjects and by "
                "keyword."
            )
        return model
    return TrainingObjects(model, **live)


def _reason(reason: Mapping[str, Any] | str | None) -> dict[str, Any]:
    if isinstance(reason, str):
        reason = {"kind": "manual", "message": reason}
    out = dict(reason or {"kind": "manual", "message": "written by save_snapshot"})
    out.setdefault("kind", "manual")
    out.setdefault("message", str(out["kind"]))
    return out


def _model_values(objects: TrainingObjects, dropped: list[str]) -> dict[str, Any]:
    model = objects.model
    state = objects.model_state if objects.model_state is not None else model.state_dict()
    return {
        "model_state": to_plain(dict(state), "model_state", dropped, clone=False),
        "model_class": object_name(type(model))
        or f"{type(model).__module__}:{type(model).__qualname__}",
        "model_training": bool(model.training),
        "module_training": {
            name: m.training for name, m in model.named_modules() if m.training != model.training
        },
    }


def _training_values(objects: TrainingObjects, dropped: list[str]) -> dict[str, Any]:
    """The optimizer, scaler and scheduler fields."""
    opt, scaler, scheduler = objects.optimizer, objects.scaler, objects.scheduler
    names = {id(p): n for n, p in objects.model.named_parameters()}
    opt_state = opt_params = None
    if opt is not None:
        opt_params = [names.get(id(p)) for g in opt.param_groups for p in g["params"]]
        state = objects.optimizer_state
        opt_state = to_plain(
            dict(state) if state is not None else opt.state_dict(),
            "optimizer",
            dropped,
            clone=False,
        )

    def plain(obj: Scaler | Scheduler | None, key: str) -> Any:
        return to_plain(obj.state_dict(), key, dropped, clone=False) if obj is not None else None

    return {
        "optimizer": opt_state,
        "optimizer_class": class_name(opt),
        "optimizer_params": opt_params,
        "scaler": plain(scaler, "scaler"),
        "scheduler": plain(scheduler, "scheduler"),
        "scheduler_class": class_name(scheduler),
    }


def class_name(obj: object) -> str | None:
    """``"module:qualname"`` of ``obj``'s class (``None`` for ``None``)."""
    if obj is None:
        return None
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def compile_settings(model: torch.nn.Module) -> dict[str, Any] | None:
    """The snapshot field ``compiled`` of ``model``: ``{"backend": name}`` for a
    ``torch.compile``'d module (the wrapper ``torch.compile`` returns, or a module compiled
    in place by ``module.compile()``), ``None`` for an eager one. The back end's name is
    read from dynamo's wrappers (``None`` where this PyTorch does not show it)."""
    if type(model).__name__ == "OptimizedModule":
        callback = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    elif callable(getattr(model, "_compiled_call_impl", None)):
        cells = getattr(model._compiled_call_impl, "__closure__", None) or ()
        contexts = [c.cell_contents for c in cells if hasattr(c.cell_contents, "callback")]
        callback = getattr(contexts[0], "callback", None) if contexts else None
    else:
        return None
    for _ in range(8):  # the back end sits a few wrappers down
        name = getattr(callback, "compiler_name", None) or getattr(callback, "_compiler_name", None)
        if isinstance(name, str):
            return {"backend": name}
        callback = getattr(callback, "_torchdynamo_orig_backend", None)
    return {"backend": None}
