"""Snapshot files: everything needed to replay one training step, saved when it failed.

A snapshot is one file (``step-000048213.nbsnap``) written by :func:`save_snapshot`
(usually through :class:`~nbdebug.NaNGuard`): a ``torch.save`` zip archive holding one
dictionary of tensors and plain Python values (the model state, the batch, the optimizer,
scaler and scheduler states, the RNG states, the guard's history, versions, how to
rebuild the model and the loss). Its fields, their types and defaults are the table
:data:`nbdebug.core.snapshot_format.FIELDS`, which also says how to add one.

This module captures (:func:`save_snapshot`), loads (:func:`load_snapshot`,
:meth:`Snapshot.from_payload`), replays (:meth:`Snapshot.trace`) and lists
(:func:`list_snapshots`) snapshots.

Loading goes through ``torch.load(..., weights_only=True)``: no code from the file runs.
The model architecture comes from the caller, or from the recorded recipe when the caller
opts in with ``trust_recipe=True``.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .batch import check_flag, describe
from .snapshot_data import (
    build_loss,
    environment,
    import_object,
    is_trusted,
    loss_spec,
    object_name,
    to_device,
    to_plain,
)
from .snapshot_format import (
    FORMAT_VERSION,
    SUFFIX,
    SnapshotError,
    atomic_save,
    build_payload,
    parse_recipe,
    read_archive,
    read_payload,
    rng_from_payload,
    rng_to_payload,
    snapshot_attributes,
    unique_path,
    validate_payload,
)
from .state import RngState
from .text import count_text, first_line, shorten

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
    state_dict: Mapping[str, torch.Tensor] | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
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
    state_dict, optimizer_state_dict : dict, optional
        Stored instead of ``model.state_dict()`` / ``optimizer.state_dict()``: e.g. the
        whole state gathered from a sharded (FSDP2) model.
    write : callable, optional
        ``write(payload, path) -> path`` writes the finished dictionary (default:
        :func:`~nbdebug.core.snapshot_format.atomic_save`, now; the guard's
        ``async_save`` copies it to the CPU and writes it on a background thread).
    **fields
        Values of further fields of the snapshot table
        (:data:`nbdebug.core.snapshot_format.FIELDS`), by key; stored as plain data.

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
    values: dict[str, Any] = {
        "step": None if step is None else int(step),
        "time": time.time(),
        "reason": to_plain(reason, "reason", dropped, clone=False),
        "model_state": to_plain(
            dict(state_dict if state_dict is not None else model.state_dict()),
            "model_state",
            dropped,
            clone=False,
        ),
        "model_class": object_name(type(model))
        or f"{type(model).__module__}:{type(model).__qualname__}",
        "model_training": bool(model.training),
        "module_training": {
            name: m.training for name, m in model.named_modules() if m.training != model.training
        },
        "inputs": to_plain(inputs, "inputs", dropped, clone=True),
        "target": to_plain(target, "target", dropped, clone=True),
        "optimizer": to_plain(
            dict(optimizer_state_dict)
            if optimizer_state_dict is not None
            else optimizer.state_dict(),
            "optimizer",
            dropped,
            clone=False,
        )
        if optimizer is not None
        else None,
        "optimizer_class": _class_name(optimizer),
        "optimizer_params": opt_params,
        "scaler": to_plain(scaler.state_dict(), "scaler", dropped, clone=False)
        if scaler is not None
        else None,
        "scheduler": to_plain(scheduler.state_dict(), "scheduler", dropped, clone=False)
        if scheduler is not None
        else None,
        "scheduler_class": _class_name(scheduler),
        "rng": rng_to_payload(rng if rng is not None else RngState.capture()),
        "history": [to_plain(dict(h), "history", dropped, clone=False) for h in (history or [])],
        "environment": to_plain(environment(model), "environment", dropped, clone=False),
        "recipe": parse_recipe(recipe),
        "loss_fn": to_plain(loss_spec(loss_fn), "loss_fn", dropped, clone=False),
    }
    for key, value in fields.items():
        if key in values or key == "dropped":
            raise TypeError(
                f"save_snapshot() writes the field {key!r} from its own arguments; "
                "it cannot be given by keyword."
            )
        values[key] = to_plain(value, key, dropped, clone=True)
    values["dropped"] = dropped
    return (write or atomic_save)(build_payload(values), target_path)


def _class_name(obj: Any) -> str | None:
    if obj is None:
        return None
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


# --------------------------------------------------------------------------- loading


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
    model: Any, recipe: Mapping[str, Any] | None, where: Path, *, trust_recipe: bool
) -> torch.nn.Module | None:
    if model is None:
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


def _check_map_location(map_location: Any) -> None:
    """One sentence for a ``map_location`` torch.load would fail on (before the file is
    read, so that the error names the argument, not the file)."""
    if callable(map_location) or isinstance(map_location, dict):
        return
    expected = (
        "map_location expects a device (a str such as 'cpu' or 'cuda:0', or a "
        "torch.device), a dict or a callable"
    )
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"{expected}; got {type(map_location).__name__} {map_location!r}.")
    try:
        dev = torch.device(map_location)
    except RuntimeError:
        raise ValueError(f"{expected}; got {map_location!r}, which is not a device.") from None
    if dev.type == "meta":
        raise ValueError(
            f"{expected}; got {map_location!r}: tensors on the meta device hold no values to "
            "replay."
        )
    if dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"map_location expects a device this machine has; got {map_location!r} ({e})."
            ) from None


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
    _check_map_location(map_location)
    check_flag(trust_recipe, "trust_recipe")
    payload = read_archive(path, map_location=map_location)  # checks the path's type first
    where = Path(path)
    snap = Snapshot.from_payload(payload, where, trust_recipe=trust_recipe)
    caller_rng = RngState.capture()  # building a model draws initial weights
    try:
        built = _build_model(model, snap.recipe, where, trust_recipe=trust_recipe)
    finally:
        caller_rng.restore()
    if built is not None:
        check_state_fits(built, snap.model_state, str(where))
        snap.model = built
        snap.reset_model()
    return snap


def autocast_state(device_type: str, *, backward: bool = False) -> dict[str, Any] | None:
    """The active autocast state of ``device_type`` as the snapshot's ``autocast`` field
    (``{"device_type": ..., "dtype": "bfloat16"}``, with ``"backward": True`` when the
    step's backward ran inside the block too), or ``None`` when autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    state: dict[str, Any] = {"device_type": device_type, "dtype": str(dtype).replace("torch.", "")}
    if backward:
        state["backward"] = True
    return state


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype=dtype)`` runs on this machine (CUDA
    bfloat16 needs an Ampere or newer GPU)."""
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return False
    if device_type == "cuda" and dtype == torch.bfloat16:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        return dtype in (torch.bfloat16, torch.float16)
    return True


#: what a replay of a step under an autocast dtype this machine lacks can do instead
IN_FLOAT32 = (
    "replay it in float32 with snap.trace(autocast=False) (nbdebug.check and nbdebug.debug "
    "take that trace)"
)


def replay_autocast(
    spec: Mapping[str, Any] | None, device: torch.device, *, instead: str = IN_FLOAT32
) -> Any:
    """The autocast context a replay on ``device`` runs in: the recorded dtype (``spec``,
    the ``autocast`` field) on ``device``'s type; a null context for ``None``. A dtype the
    device lacks is a SnapshotError whose sentence ends with ``instead``."""
    import contextlib

    if spec is None:
        return contextlib.nullcontext()
    name = str(spec["dtype"])
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not autocast_supported(device.type, dtype):
        raise SnapshotError(
            f"this snapshot's step ran under {name} autocast ({spec['device_type']}); "
            f"expected a {device.type} device that supports {name} autocast, found one that "
            f"does not: replay on such a machine, or {instead}."
        )
    return torch.autocast(device.type, dtype=dtype)


def replay_contexts(
    spec: Mapping[str, Any] | None, device: torch.device, *, instead: str = IN_FLOAT32
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The context factories a replay of a step recorded under ``spec`` (the ``autocast``
    field) runs its forward and loss in, and its backward in: the backward outside
    autocast, as training loops and trainers run it, unless the step ran it inside the
    block (``spec["backward"]``). Raises the SnapshotError of :func:`replay_autocast`
    now, for a dtype this machine lacks."""
    import contextlib

    replay_autocast(spec, device, instead=instead)

    def forward() -> Any:
        return replay_autocast(spec, device)

    backward = forward if spec is not None and spec.get("backward") else contextlib.nullcontext
    return forward, backward


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


#: The failures a snapshot's kind records, in words (:attr:`Snapshot.recorded_failure`).
_RECORDED = {
    "loss": "a non-finite loss",
    "grad": "non-finite gradients",
    "weights": "non-finite weights",
    "scale": "a collapsed GradScaler scale",
    "rank": "a non-finite value on another rank",
}


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
    version : int
        The format version of the file.

    Every field of the snapshot table (``nbdebug.core.snapshot_format.FIELDS``) is an
    attribute (fields newer than the file hold their defaults).
    """

    # one attribute per field of the snapshot table (snapshot_format.FIELDS), set by
    # __init__ from the payload; annotated here for type checkers
    step: int | None
    time: float
    reason: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    model_class: str | None
    model_training: bool
    module_training: dict[str, bool]
    inputs: Any
    target: Any
    optimizer_state: dict[str, Any] | None
    optimizer_class: str | None
    optimizer_params: list[str | None] | None
    scaler_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    scheduler_class: str | None
    rng: dict[str, Any] | None
    history: list[dict[str, Any]]
    environment: dict[str, Any]
    recipe: dict[str, Any] | None
    loss_fn_spec: dict[str, Any] | None
    dropped: list[str]
    rank: int | None
    world_size: int | None
    local_first: bool | None
    culprit_ranks: list[int]
    rank_kinds: dict[str, list[str]]
    fingerprints: dict[str, Any] | None
    trainer: dict[str, Any] | None
    autocast: dict[str, Any] | None

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
        for name, value in snapshot_attributes(payload).items():
            setattr(self, name, value)
        self.time = float(self.time)
        self.model = model
        self.trust_recipe = trust_recipe

    @classmethod
    def from_payload(
        cls,
        payload: Any,
        path: str | os.PathLike[str] | None = None,
        model: torch.nn.Module | None = None,
        *,
        trust_recipe: bool = False,
    ) -> Snapshot:
        """The snapshot held by a loaded snapshot dictionary (``torch.load`` of a file).

        The dictionary is checked against the field table
        (:func:`~nbdebug.core.snapshot_format.validate_payload`); the fields that an older
        format version lacks get their defaults.

        Parameters
        ----------
        payload : dict
        path : str or PathLike, optional
            Where it was read from (named in errors, kept as :attr:`path`).
        model : torch.nn.Module, optional
            The module to replay on, used as it is (:func:`load_snapshot` gives a copy).
        trust_recipe : bool
            As for :func:`load_snapshot`.

        Returns
        -------
        Snapshot

        Raises
        ------
        SnapshotError
            Not a snapshot dictionary, a newer format, a missing field or a corrupt value.
        """
        where = Path(path) if path is not None else None
        checked = validate_payload(payload, where if where is not None else "<snapshot>")
        return cls(checked, where, model, trust_recipe=trust_recipe)

    # ----------------------------------------------------------------- views
    @property
    def kind(self) -> str:
        return str(self.reason.get("kind", ""))

    @property
    def message(self) -> str:
        return str(self.reason.get("message", ""))

    @property
    def recorded_failure(self) -> str | None:
        """What the run recorded at this step, in words ("a non-finite loss at step 7");
        ``None`` for a snapshot written by hand (kind ``"manual"``) or of an unknown kind."""
        what = _RECORDED.get(self.kind)
        if what is None:
            return None
        return what if self.step is None else f"{what} at step {self.step}"

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
        """Load the stored state into :attr:`model` again, in the stored dtypes, and set
        its train flags: the model's, and those of the submodules whose flag differed
        (:attr:`module_training`, a BatchNorm frozen in eval).

        A model built in float32 for a step that ran with half-precision weights
        (``model.half()``, Lightning's ``precision="16-true"``) gets those weights in
        their own dtype (``load_state_dict`` alone would cast them to float32 and replay
        another step). The model is nbdebug's own (a copy or the factory's), never the
        caller's."""
        model = self._need_model()
        model.load_state_dict(self.model_state)
        own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            for name, stored in self.model_state.items():
                t = own.get(name)
                if t is not None and t.dtype != stored.dtype and stored.is_floating_point():
                    t.data = stored.to(device=t.device, copy=True)
        model.train(self.model_training)
        modules = dict(model.named_modules())
        for name, flag in self.module_training.items():
            if name in modules:
                modules[name].training = flag
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
        err = SnapshotError(
            f"this snapshot was loaded without a model: give load_snapshot(path, "
            f"model=...) (a module or a "
            f"zero-argument factory for {self.model_class}){hint}."
        )
        err.needs_model = True
        raise err

    def loss_fn(self) -> Any:
        """The recorded loss function, rebuilt (``None`` when none was recorded)."""
        return build_loss(self.loss_fn_spec, trust=self.trust_recipe)

    def replay_loss_fn(self, loss_fn: Any, call: str) -> Any:
        """``loss_fn`` when given, else the recorded one; a :class:`SnapshotError` naming
        ``call`` (how to pass one) when there is neither but the snapshot has a target."""
        if loss_fn is None:
            loss_fn = build_loss(self.loss_fn_spec, trust=self.trust_recipe, call=call)
        if loss_fn is None and self.target is not None:
            raise SnapshotError(
                f"this snapshot recorded no loss function but has a target: pass {call}."
            )
        return loss_fn

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
        if not is_trusted(self.optimizer_class) and not self.trust_recipe:
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

    def trace(self, loss_fn: Any = None, *, autocast: bool = True) -> Any:
        """Replay the failing step: reload the stored weights and train flag, set the RNGs
        to the step's states, and run :func:`nbdebug.trace` on the stored batch (moved to
        the model's device), under the step's autocast state (``self.autocast``: the
        same dtype, on the model's device type). The caller's RNG states are put back
        afterwards.

        Parameters
        ----------
        loss_fn : callable, optional
            Overrides the recorded loss function.
        autocast : bool
            ``False``: replay in the model's own dtypes even when the step ran under
            autocast.

        Raises
        ------
        TypeError
            An ``autocast`` that is not a bool (a dtype: the replay takes the recorded one).
        SnapshotError
            The step ran under an autocast dtype (bfloat16, float16) that this machine's
            device does not support.

        Returns
        -------
        nbdebug.Trace
        """
        from .trace import trace_step

        check_flag(autocast, "autocast")
        model = self.reset_model()
        loss_fn = self.replay_loss_fn(loss_fn, "snap.trace(loss_fn=...)")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        inputs = to_device(self.inputs, device)
        target = to_device(self.target, device)
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = loss_fn.to(device)
        forward, backward = replay_contexts(self.autocast if autocast else None, device)
        caller = RngState.capture()
        try:
            self.restore_rng()
            return trace_step(model, inputs, target, loss_fn, forward=forward, backward=backward)
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
            f"Snapshot({name}: step {self.step}, {self.kind}: {shorten(self.message)}; "
            f"model {model}, "
            f"batch {describe(self.inputs)}, history {count_text(len(self.history), 'row')})"
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
    "autocast_state",
    "list_snapshots",
    "load_snapshot",
    "replay_autocast",
    "replay_contexts",
    "save_snapshot",
]
