"""Snapshot files: everything needed to replay one training step, saved when it failed.

A snapshot is one file (``step-000048213.nbsnap``) written by :func:`save_snapshot`
(usually through :class:`~nbdebug.NaNGuard`). It is a ``torch.save`` zip archive holding
one dictionary of tensors and plain Python values:

``format``, ``version``
    ``"nbdebug-snapshot"`` and :data:`FORMAT_VERSION`.
``step``, ``time``, ``reason``
    The training step, the wall-clock time (seconds since the epoch) and why it was
    written (``{"kind": ..., "message": ..., ...}``).
``model_state``, ``model_class``, ``model_training``
    The model's ``state_dict``, its class as ``"module:qualname"`` and its train flag.
``inputs``, ``target``
    The batch (tensors, tuples, lists, dicts of them).
``optimizer``, ``optimizer_class``, ``optimizer_params``, ``scaler``, ``scheduler``,
``scheduler_class``
    ``state_dict()`` of each (or ``None``), and for the optimizer the model parameter
    name behind each of its parameter indices.
``rng``
    torch (CPU and CUDA), numpy and Python RNG states at the start of the step.
``history``
    The guard's rolling history (list of dicts).
``environment``
    torch / python / numpy versions, platform, devices and dtypes of the parameters.
``recipe``, ``loss_fn``
    How to rebuild the model (``{"factory": "package.module:factory", "kwargs": {...}}``)
    and the loss (``{"name": "module:qualname", ...}``), when known.
``dropped``
    Paths of values that could not be stored as plain data (and were stored as ``None``).

Loading goes through ``torch.load(..., weights_only=True)``: no code from the file runs.
The model architecture comes from the caller, or from the recorded recipe when the caller
opts in with ``trust_recipe=True``.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import re
import time
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .batch import describe
from .snapshot_format import (
    _BATCH_KEYS,
    _REQUIRED,
    _ZIP_MAGIC,
    FORMAT,
    FORMAT_VERSION,
    SUFFIX,
    SnapshotError,
    _plain,
    _to_device,
    _trusted,
    atomic_save,
    build_loss,
    environment,
    import_object,
    loss_spec,
    object_name,
    parse_recipe,
    rng_from_payload,
    rng_to_payload,
    unique_path,
)
from .state import RngState
from .text import first_line

# --------------------------------------------------------------------------- saving


def save_snapshot(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    inputs: Any = None,
    target: Any = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    scheduler: Any = None,
    step: int | None = None,
    reason: Mapping[str, Any] | str | None = None,
    history: list[Mapping[str, Any]] | None = None,
    recipe: Any = None,
    loss_fn: Any = None,
    rng: RngState | None = None,
) -> Path:
    """Write one snapshot file atomically and return its path.

    Parameters
    ----------
    path : str or PathLike
        The file to write. A directory (an existing one, or a name without a suffix such
        as ``"snapshots"``) gets a new ``step-000000012.nbsnap`` file in it. Parent
        directories are created.
    model : torch.nn.Module
        Its ``state_dict()`` (parameters and buffers, on their devices), class name and
        train flag are stored.
    inputs, target : tensor, tuple, list or dict of tensors, optional
        The batch (copied, detached).
    optimizer, scaler, scheduler : optional
        Their ``state_dict()`` is stored (``scaler`` a ``torch.amp.GradScaler``).
    step : int, optional
    reason : dict or str, optional
        Why the snapshot was written: ``{"kind": ..., "message": ..., ...}`` (plain values).
    history : list of dict, optional
        Rolling history rows (``step``, ``loss``, ``grad_norm``, ...).
    recipe : str, (str, dict) or dict, optional
        ``"package.module:factory"`` (+ JSON kwargs) that rebuilds the model.
    loss_fn : callable, optional
        Stored by import path when it has one (see :func:`loss_spec`).
    rng : RngState, optional
        RNG states to store (default: the current ones).

    Returns
    -------
    pathlib.Path
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__qualname__}.")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise TypeError(f"step must be an int or None; got {type(step).__qualname__}.")
    if isinstance(path, (str, os.PathLike)):
        target_path = Path(path)
    else:
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__qualname__}.")
    if target_path.is_dir() or not target_path.suffix:
        target_path = unique_path(target_path, None if step is None else int(step))
    if isinstance(reason, str):
        reason = {"kind": "manual", "message": reason}
    reason = dict(reason or {"kind": "manual", "message": "written by save_snapshot"})
    reason.setdefault("kind", "manual")
    reason.setdefault("message", str(reason["kind"]))

    dropped: list[str] = []
    names = {id(p): n for n, p in model.named_parameters()}
    opt_params = None
    if optimizer is not None:
        opt_params = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    payload: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": None if step is None else int(step),
        "time": time.time(),
        "reason": _plain(reason, "reason", dropped, clone=False),
        "model_state": _plain(dict(model.state_dict()), "model_state", dropped, clone=False),
        "model_class": object_name(type(model))
        or f"{type(model).__module__}:{type(model).__qualname__}",
        "model_training": bool(model.training),
        "inputs": _plain(inputs, "inputs", dropped, clone=True),
        "target": _plain(target, "target", dropped, clone=True),
        "optimizer": _plain(optimizer.state_dict(), "optimizer", dropped, clone=False)
        if optimizer is not None
        else None,
        "optimizer_class": _class_name(optimizer),
        "optimizer_params": opt_params,
        "scaler": _plain(scaler.state_dict(), "scaler", dropped, clone=False)
        if scaler is not None
        else None,
        "scheduler": _plain(scheduler.state_dict(), "scheduler", dropped, clone=False)
        if scheduler is not None
        else None,
        "scheduler_class": _class_name(scheduler),
        "rng": rng_to_payload(rng if rng is not None else RngState.capture()),
        "history": [_plain(dict(h), "history", dropped, clone=False) for h in (history or [])],
        "environment": _plain(environment(model), "environment", dropped, clone=False),
        "recipe": parse_recipe(recipe),
        "loss_fn": _plain(loss_spec(loss_fn), "loss_fn", dropped, clone=False),
        "dropped": dropped,
    }
    return atomic_save(payload, target_path)


def _class_name(obj: Any) -> str | None:
    if obj is None:
        return None
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


# --------------------------------------------------------------------------- loading


def read_payload(
    path: str | os.PathLike[str], *, map_location: Any = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """The validated dictionary stored in a snapshot file (no code runs).

    Raises
    ------
    SnapshotError
        The file is missing, empty, not a torch zip archive, truncated or corrupt, not a
        snapshot, written by a newer nbdebug, or lacks a key.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__qualname__}.")
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except FileNotFoundError as e:
        raise SnapshotError(f"{p}: no such file.") from e
    except IsADirectoryError as e:
        raise SnapshotError(
            f"{p} is a directory, not a snapshot file (list_snapshots() lists one)."
        ) from e
    except OSError as e:
        raise SnapshotError(f"{p}: cannot read it ({first_line(e)}).") from e
    if not head:
        raise SnapshotError(f"{p} is empty (0 bytes): not a snapshot.")
    if head != _ZIP_MAGIC:
        raise SnapshotError(
            f"{p} is not a snapshot: it is not a torch.save zip archive (it starts with {head!r})."
        )
    if not zipfile.is_zipfile(p):  # no end-of-archive record: cut short while written or copied
        raise SnapshotError(f"{p} is truncated or corrupt: its zip archive has no end record.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        msg = str(e)
        if "Weights only load failed" in msg:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", msg)
            what = f" (such as {found.group(1)})" if found else ""
            raise SnapshotError(
                f"{p} holds Python objects other than tensors and plain containers{what}: it is "
                "corrupt or was not written by nbdebug, and is refused (loading it could run code)."
            ) from e
        if "central directory" in msg or "failed reading zip archive" in msg:
            raise SnapshotError(
                f"{p} is truncated or corrupt: its zip archive cannot be read."
            ) from e
        raise SnapshotError(f"{p} is corrupt: torch.load failed ({first_line(e)}).") from e
    return validate_payload(obj, p)


def validate_payload(obj: Any, path: Path | str = "<snapshot>") -> dict[str, Any]:
    """Check the structure of a loaded snapshot dictionary; raise :class:`SnapshotError`."""
    if not isinstance(obj, dict):
        raise SnapshotError(
            f"{path} is a torch file but not an nbdebug snapshot: it holds a {type(obj).__name__}, "
            "not a snapshot dictionary."
        )
    if obj.get("format") != FORMAT:
        keys = [k for k in list(obj)[:6] if isinstance(k, str)]
        raise SnapshotError(
            f"{path} is a torch file but not an nbdebug snapshot (no format {FORMAT!r} field; keys "
            f"{keys}{' ...' if len(obj) > 6 else ''}): a plain checkpoint? Load it with torch.load."
        )
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise SnapshotError(f"{path} has an invalid format version {version!r}.")
    if version > FORMAT_VERSION:
        raise SnapshotError(
            f"{path} was written by a newer nbdebug (snapshot format version {version}; this "
            f"nbdebug reads versions up to {FORMAT_VERSION}): upgrade nbdebug to load it."
        )
    missing = [k for k in (*_REQUIRED, *_BATCH_KEYS) if k not in obj]
    if missing:
        raise SnapshotError(
            f"{path} is an incomplete snapshot: it lacks {', '.join(map(repr, missing))}."
        )
    for key, types in _REQUIRED.items():
        v = obj[key]
        if isinstance(v, bool) and bool not in types:
            v = object()  # bool is an int, but not a step
        if not isinstance(v, types):
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise SnapshotError(
                f"{path} is corrupt: {key!r} should be {want}, got {type(obj[key]).__name__}."
            )
    try:
        _dt.datetime.fromtimestamp(float(obj["time"]))
    except (ValueError, OverflowError, OSError) as e:
        raise SnapshotError(
            f"{path} is corrupt: its time stamp {obj['time']!r} is not a date ({e})."
        ) from e
    bad = [
        k
        for k, v in obj["model_state"].items()
        if not isinstance(k, str) or not isinstance(v, torch.Tensor)
    ]
    if bad:
        raise SnapshotError(
            f"{path} is corrupt: model_state entries {bad[:5]} are not named tensors."
        )
    reason = obj["reason"]
    if not isinstance(reason.get("kind"), str) or not isinstance(reason.get("message"), str):
        raise SnapshotError(f"{path} is corrupt: its reason lacks a 'kind' and a 'message' string.")
    if not all(isinstance(h, dict) for h in obj["history"]):
        raise SnapshotError(f"{path} is corrupt: history rows are not dictionaries.")
    if obj["rng"] is not None:
        try:
            st = rng_from_payload(obj["rng"])
            st.cuda = None
            caller = RngState.capture()
            try:
                st.restore()  # the only full check of the generators' own formats
            finally:
                caller.restore()
        except Exception as e:
            raise SnapshotError(
                f"{path} is corrupt: its RNG state cannot be read ({first_line(e)})."
            ) from e
    recipe = obj["recipe"]
    if recipe is not None and (
        not isinstance(recipe.get("factory"), str) or not isinstance(recipe.get("kwargs"), dict)
    ):
        raise SnapshotError(
            f"{path} is corrupt: its recipe is not {{'factory': str, 'kwargs': dict}}."
        )
    if obj["optimizer"] is not None and not isinstance(obj["optimizer"].get("param_groups"), list):
        raise SnapshotError(f"{path} is corrupt: its optimizer state has no param_groups list.")
    return obj


def check_state_fits(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str = "the snapshot"
) -> None:
    """Raise :class:`SnapshotError` listing missing keys, unexpected keys and shape
    mismatches when ``state`` does not fit ``model``."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: snapshot {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("shape mismatches", shapes),
    ):
        if items:
            more = f" ... and {len(items) - 10} more" if len(items) > 10 else ""
            parts.append(f"{label}: {', '.join(items[:10])}{more}")
    raise SnapshotError(
        f"the model state in {what} does not fit the given {type(model).__name__}: "
        + "; ".join(parts)
        + "."
    )


def _build_model(
    model: Any, payload: Mapping[str, Any], where: Path, *, trust_recipe: bool
) -> torch.nn.Module | None:
    if model is None:
        recipe = payload["recipe"]
        if recipe is None or not trust_recipe:
            return None
        spec = recipe["factory"]
        try:
            factory = import_object(spec)
            built = factory(**recipe["kwargs"])
        except Exception as e:
            raise SnapshotError(f"the recipe {spec!r} of {where} failed: {first_line(e)}") from e
        if not isinstance(built, torch.nn.Module):
            raise SnapshotError(
                f"the recipe {spec!r} of {where} returned {type(built).__qualname__}, "
                f"not an nn.Module."
            )
        return built
    if isinstance(model, torch.nn.Module):
        try:
            return copy.deepcopy(model)  # the caller's model stays as it is
        except Exception as e:
            raise TypeError(
                f"cannot copy the given {type(model).__qualname__} ({first_line(e)}); pass a "
                "zero-argument factory instead: load_snapshot(path, model=lambda: MyNet())."
            ) from e
    if callable(model):
        built = model()
        if not isinstance(built, torch.nn.Module):
            raise TypeError(
                f"the model factory returned {type(built).__qualname__}; expected a "
                f"torch.nn.Module."
            )
        return built
    raise TypeError(
        f"model must be a torch.nn.Module, a zero-argument factory returning one, or "
        f"None; got {type(model).__qualname__}."
    )


def load_snapshot(
    path: str | os.PathLike[str],
    model: Any = None,
    *,
    trust_recipe: bool = False,
    map_location: Any = "cpu",
) -> Snapshot:
    """Load a snapshot file; no code from the file runs.

    Parameters
    ----------
    path : str or PathLike
    model : torch.nn.Module or callable, optional
        The architecture: a module (copied; the given one is never changed) or a
        zero-argument factory. The stored ``state_dict`` is loaded into it.
    trust_recipe : bool
        With no ``model``, import and call the recorded ``"package.module:factory"`` recipe
        (this runs that code: only for files you trust). Without either, ``snap.model`` is
        ``None``; the state, batch, history and reason are still there.
    map_location : str, torch.device or callable
        Passed to ``torch.load``: where the tensors go (``"cpu"`` loads a GPU snapshot on a
        CPU-only machine).

    Returns
    -------
    Snapshot

    Raises
    ------
    SnapshotError
        A missing, truncated, corrupt, foreign or newer-format file, or a state that does
        not fit the model (missing/unexpected keys and shape mismatches listed).
    """
    payload = read_payload(path, map_location=map_location)
    where = Path(path)
    caller_rng = RngState.capture()  # building a model draws initial weights
    try:
        built = _build_model(model, payload, where, trust_recipe=trust_recipe)
    finally:
        caller_rng.restore()
    snap = Snapshot(payload, where, built, trust_recipe=trust_recipe)
    if built is not None:
        check_state_fits(built, payload["model_state"], str(where))
        snap.reset_model()
    return snap


HISTORY_COLUMNS = ("step", "loss", "grad_norm", "param_norm", "lr", "scale", "skipped")


def history_frame(rows: list[dict[str, Any]]) -> Any:
    """History rows (dicts) as a DataFrame with :data:`HISTORY_COLUMNS` first."""
    import pandas as pd

    df = pd.DataFrame.from_records(rows) if rows else pd.DataFrame()
    for c in HISTORY_COLUMNS:
        if c not in df.columns:
            df[c] = pd.Series([None] * len(df), dtype=object)
    for c in ("loss", "grad_norm", "param_norm", "lr", "scale"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    df["skipped"] = df["skipped"].fillna(False).astype(bool)
    first = list(HISTORY_COLUMNS)
    return df[first + [c for c in df.columns if c not in first]].reset_index(drop=True)


class Snapshot:
    """One training step saved by :func:`save_snapshot`; see :func:`load_snapshot`.

    Attributes
    ----------
    path : pathlib.Path
    step : int or None
    reason : dict
        ``"kind"`` (``"loss"``, ``"grad"``, ``"weights"``, ``"scale"``, ``"manual"``),
        ``"message"``, and what the guard measured (``loss``, ``grad_norm``,
        ``nonfinite_grads``, ``grad_norms`` per parameter, ...).
    model : torch.nn.Module or None
        The rebuilt model holding the stored state (a copy; ``None`` without ``model=``
        or a trusted recipe).
    model_state : dict of str to Tensor
    inputs, target
        The batch as stored (on ``map_location``).
    history : list of dict
    environment : dict
    time : float
        When it was written (seconds since the epoch).
    recipe, loss_fn_spec : dict or None
    optimizer_state, scaler_state, scheduler_state : dict or None
    rng : dict or None
        Stored RNG states (see :meth:`restore_rng`).
    """

    def __init__(
        self,
        payload: dict[str, Any],
        path: Path | None = None,
        model: torch.nn.Module | None = None,
        *,
        trust_recipe: bool = False,
    ):
        self.path = path
        self.version: int = payload["version"]
        self.step: int | None = payload["step"]
        self.time: float = float(payload["time"])
        self.reason: dict[str, Any] = payload["reason"]
        self.model = model
        self.model_state: dict[str, torch.Tensor] = payload["model_state"]
        self.model_class: str | None = payload["model_class"]
        self.model_training: bool = payload["model_training"]
        self.inputs = payload["inputs"]
        self.target = payload["target"]
        self.optimizer_state: dict[str, Any] | None = payload["optimizer"]
        self.optimizer_class: str | None = payload["optimizer_class"]
        self.optimizer_params: list[str | None] | None = payload["optimizer_params"]
        self.scaler_state: dict[str, Any] | None = payload["scaler"]
        self.scheduler_state: dict[str, Any] | None = payload["scheduler"]
        self.scheduler_class: str | None = payload["scheduler_class"]
        self.rng: dict[str, Any] | None = payload["rng"]
        self.history: list[dict[str, Any]] = payload["history"]
        self.environment: dict[str, Any] = payload["environment"]
        self.recipe: dict[str, Any] | None = payload["recipe"]
        self.loss_fn_spec: dict[str, Any] | None = payload["loss_fn"]
        self.dropped: list[str] = payload["dropped"]
        self.trust_recipe = trust_recipe

    # ----------------------------------------------------------------- views
    @property
    def kind(self) -> str:
        return str(self.reason.get("kind", ""))

    @property
    def message(self) -> str:
        return str(self.reason.get("message", ""))

    @property
    def datetime(self) -> _dt.datetime:
        return _dt.datetime.fromtimestamp(self.time)

    def history_frame(self) -> Any:
        """The guard's history as a DataFrame: one row per step, columns ``step``, ``loss``,
        ``grad_norm``, ``param_norm``, ``lr``, ``scale`` (floats; NaN where not recorded),
        ``skipped`` (bool), then any other recorded columns (``nonfinite``, ``time``)."""
        return history_frame(self.history)

    def param_norms(self) -> dict[str, float]:
        """L2 norm (computed in float64) of every floating tensor of the stored model state."""
        out = {}
        for k, v in self.model_state.items():
            if v.is_floating_point() or v.is_complex():
                x = v.detach().abs() if v.is_complex() else v.detach()
                out[k] = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        return out

    # ----------------------------------------------------------------- replay
    def reset_model(self) -> torch.nn.Module:
        """Load the stored state into :attr:`model` again and set its train flag."""
        model = self._need_model()
        model.load_state_dict(self.model_state)
        model.train(self.model_training)
        return model

    def _need_model(self) -> torch.nn.Module:
        if self.model is not None:
            return self.model
        hint = ""
        if self.recipe is not None:
            hint = (
                f", or trust_recipe=True to build it with the recorded recipe "
                f"{self.recipe['factory']!r}"
            )
        raise SnapshotError(
            f"this snapshot was loaded without a model: give load_snapshot(path, "
            f"model=...) (a module or a "
            f"zero-argument factory for {self.model_class}){hint}."
        )

    def loss_fn(self) -> Any:
        """The recorded loss function, rebuilt (``None`` when none was recorded)."""
        return build_loss(self.loss_fn_spec, trust=self.trust_recipe)

    def restore_rng(self) -> None:
        """Set the global torch / CUDA / numpy / Python RNGs to the stored states."""
        if self.rng is None:
            return
        st = rng_from_payload(self.rng)
        if st.cuda is not None and not (
            torch.cuda.is_available() and len(st.cuda) == torch.cuda.device_count()
        ):
            st.cuda = None
        st.restore()

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the failing step over :attr:`model`'s parameters, with its state
        (moments, step counts) and hyper-parameters loaded. ``torch.optim`` classes are
        imported directly; others need ``trust_recipe=True``."""
        model = self._need_model()
        if (
            self.optimizer_state is None
            or self.optimizer_class is None
            or self.optimizer_params is None
        ):
            raise SnapshotError("this snapshot holds no optimizer state.")
        if not _trusted(self.optimizer_class) and not self.trust_recipe:
            raise SnapshotError(
                f"the optimizer class {self.optimizer_class!r} lies outside torch: "
                f"load with trust_recipe=True."
            )
        try:
            cls = import_object(self.optimizer_class)
            named = dict(model.named_parameters())
            names = iter(self.optimizer_params)
            groups = []
            for g in self.optimizer_state["param_groups"]:
                hyper = {k: v for k, v in g.items() if k != "params"}
                groups.append({**hyper, "params": [named[str(next(names))] for _ in g["params"]]})
            opt = cls(groups)
            opt.load_state_dict(self.optimizer_state)
            return opt
        except Exception as e:
            raise SnapshotError(
                f"cannot rebuild the optimizer {self.optimizer_class!r}: {first_line(e)}"
            ) from e

    def trace(self, loss_fn: Any = None) -> Any:
        """Replay the failing step: reload the stored weights and train flag, set the RNGs
        to the step's states, and run :func:`nbdebug.trace` on the stored batch (moved to
        the model's device). The caller's RNG states are put back afterwards.

        Parameters
        ----------
        loss_fn : callable, optional
            Overrides the recorded loss function.

        Returns
        -------
        nbdebug.Trace
        """
        from .trace import trace as _trace

        model = self.reset_model()
        if loss_fn is None:
            loss_fn = self.loss_fn()
        if loss_fn is None and self.target is not None:
            raise SnapshotError(
                "this snapshot recorded no loss function but has a target: pass "
                "snap.trace(loss_fn=...)."
            )
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        inputs = _to_device(self.inputs, device)
        target = _to_device(self.target, device)
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = loss_fn.to(device)
        caller = RngState.capture()
        try:
            self.restore_rng()
            return _trace(model, inputs, target=target, loss_fn=loss_fn)
        finally:
            caller.restore()

    def __repr__(self) -> str:
        model = (
            type(self.model).__qualname__
            if self.model is not None
            else f"{self.model_class} (not built)"
        )
        name = self.path.name if self.path is not None else "<memory>"
        return (
            f"Snapshot({name}: step {self.step}, {self.kind}: {self.message[:120]}; model {model}, "
            f"batch {describe(self.inputs)}, history {len(self.history)} rows)"
        )


# --------------------------------------------------------------------------- listing


def list_snapshots(directory: str | os.PathLike[str]) -> Any:
    """The snapshot files in ``directory``, oldest step first.

    Returns
    -------
    pandas.DataFrame
        Columns ``path`` (str), ``step`` (Int64), ``kind``, ``reason`` (the message),
        ``time`` (datetime64) and ``error`` (why a file could not be read, else ``None``).
        Tensors are memory-mapped, not read.
    """
    import pandas as pd

    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"directory must be a str or os.PathLike; got {type(directory).__qualname__}."
        )
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d} is not a directory.")
    rows: list[tuple[Any, ...]] = []
    for p in sorted(d.glob(f"*{SUFFIX}")):
        try:
            payload = read_payload(p, map_location="cpu", mmap=True)
        except SnapshotError as e:
            rows.append((str(p), None, None, None, pd.NaT, str(e)))
            continue
        t = pd.Timestamp(_dt.datetime.fromtimestamp(float(payload["time"])))
        reason = payload["reason"]
        rows.append((str(p), payload["step"], reason["kind"], reason["message"], t, None))
    df = pd.DataFrame.from_records(
        rows, columns=["path", "step", "kind", "reason", "time", "error"]
    )
    df["step"] = df["step"].astype("Int64")
    df["time"] = pd.to_datetime(df["time"])
    return df.sort_values(["step", "path"], na_position="last").reset_index(drop=True)


__all__ = [
    "FORMAT_VERSION",
    "Snapshot",
    "SnapshotError",
    "list_snapshots",
    "load_snapshot",
    "save_snapshot",
]
