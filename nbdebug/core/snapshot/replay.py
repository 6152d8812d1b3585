"""Replaying a step under the autocast state it ran in: the snapshot's ``autocast`` field,
read from the live step (:func:`autocast_state`) and turned back into the contexts a
replay runs its forward, loss and backward in (:func:`replay_contexts`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .format import SnapshotError

__all__ = [
    "IN_FLOAT32",
    "autocast_state",
    "autocast_supported",
    "replay_autocast",
    "replay_contexts",
]


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

    replay_autocast(spec, device, instead=instead)

    def forward() -> Any:
        return replay_autocast(spec, device)

    backward = forward if spec is not None and spec.get("backward") else contextlib.nullcontext
    return forward, backward
