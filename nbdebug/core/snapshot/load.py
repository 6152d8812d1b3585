"""Loading a snapshot file: :func:`load_snapshot` reads it (no code from the file runs),
builds the model from the caller's module or factory (or, when the caller trusts the file,
its recorded recipe) and loads the stored state into it."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..batch import check_flag
from ..state import RngState
from ..text import first_line
from .archive import open_snapshot_file
from .data import import_object
from .format import SnapshotError, validate_payload
from .snapshot import Snapshot

__all__ = ["MapLocation", "ModelSource", "check_state_fits", "load_snapshot"]

#: what ``load_snapshot(model=...)`` takes: a module (copied) or a zero-argument factory
ModelSource = torch.nn.Module | Callable[[], torch.nn.Module]
#: ``torch.load``'s ``map_location``
MapLocation = str | torch.device | dict[str, str] | Callable[..., object]


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
    model: object, recipe: Mapping[str, Any] | None, where: Path, *, trust_recipe: bool
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
        try:
            built = model()
        except Exception as e:  # the caller's code: its own error, told where it happened
            note = getattr(e, "add_note", None)  # (Python 3.11+)
            if note is not None:
                note(
                    f"nbdebug: raised by the model factory "
                    f"{getattr(model, '__qualname__', model)!r} while building the model "
                    "for a snapshot (load_snapshot(path, model=...))."
                )
            raise
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


def _check_map_location(map_location: object) -> None:
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
    model: ModelSource | None = None,
    *,
    trust_recipe: bool = False,
    map_location: MapLocation = "cpu",
    modules: str | Sequence[str] | None = None,
) -> Snapshot:
    """Load a snapshot file; no code from the file runs.

    Of a safetensors snapshot (format 5 on) only the header is read here: the history,
    the reason, the batch, the RNG states and the tensor table (dtypes, shapes, non-finite
    counts and norms of the weights). The model state is read when used (by the model
    given here, by ``snap.model_state``), the optimizer state by ``snap.build_optimizer()``
    only; each tensor's bytes are checked against the checksum recorded at write time.

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
    modules : str or sequence of str, optional
        Module names or ``fnmatch`` patterns (``"transformer.h.3"``, ``"encoder.*"``).
        Without a model, ``snap.model_state`` holds (and reads) only these modules'
        tensors. With a model the replay runs the whole forward, so every weight is read;
        the patterns are then what ``snap.trace()`` records.

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
    patterns = [modules] if isinstance(modules, str) else modules
    if patterns is not None and not all(isinstance(m, str) for m in patterns):
        raise TypeError(f"modules must be a str or a sequence of str; got {modules!r}.")
    payload, store = open_snapshot_file(path, map_location=map_location)  # path type first
    where = Path(path)
    checked = validate_payload(payload, where)
    caller_rng = RngState.capture()  # building a model draws initial weights
    try:
        built = _build_model(model, checked["recipe"], where, trust_recipe=trust_recipe)
    finally:
        caller_rng.restore()
    snap = Snapshot(checked, where, built, trust_recipe=trust_recipe, store=store, modules=patterns)
    if built is not None:
        # a safetensors file says its shapes in the header: a model that does not fit is
        # refused before a weight is read
        state = (
            {k: torch.empty(e.shape, device="meta") for k, e in snap.state_entries().items()}
            if store is not None
            else snap.model_state
        )
        check_state_fits(built, state, str(where))
        snap.reset_model()
    return snap
