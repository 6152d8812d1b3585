"""The optimizer step replayed alone: a snapshot whose step failed in the update (reason
kind ``"optimizer"``) gets the update as its trace's origin (:func:`with_update_origin`,
called by ``snap.trace()``): replayed from the stored pre-step state when the guard rolled
it back (:func:`replay_update`), else as the guard recorded it. The watch that catches
such an update is :mod:`nbdebug.core.guard.update_watch`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..vocab import FailureKind, UpdateFault
from .update_watch import PreStep, UpdateLook, look_update

if TYPE_CHECKING:  # pragma: no cover
    from ..snapshot.snapshot import Snapshot
    from ..trace.result import Trace

__all__ = ["replay_update", "with_update_origin"]


def replay_update(snap: Snapshot) -> UpdateLook | None:
    """Replay the snapshot's optimizer step alone: the stored pre-step weights and
    optimizer state, the stored gradients (``update_grads``), one ``optimizer.step()``
    on nbdebug's own model; the look at its result (``None``: it replayed finite). The
    stored weights are put back afterwards."""
    grads = snap.update_grads
    if not grads or snap.optimizer_state is None:
        return None
    model = snap.reset_model()
    try:
        opt = snap.build_optimizer()
        named = dict(model.named_parameters())
        for name, g in grads.items():
            if name in named:
                named[name].grad = g.to(device=named[name].device, dtype=named[name].dtype)
        pre = PreStep()
        pre.capture(opt)
        opt.step()
        look = look_update(opt, {id(p): n for n, p in named.items()}, pre)
        if look is not None:
            look.tensor = look.tensor.clone()  # the stored weights are put back below
        return look
    finally:
        for p in model.parameters():
            p.grad = None
        snap.reset_model()


def _recorded(snap: Snapshot) -> UpdateLook:
    """The origin as the guard recorded it (the update was not rolled back: no replay)."""
    r = snap.reason
    param = str(r.get("param", ""))
    tensor = snap.model_state.get(param)
    fault = UpdateFault(r.get("fault", UpdateFault.ZERO_OVER_ZERO))
    return UpdateLook(
        param=param,
        state=r.get("state"),
        fault=fault,
        tensor=tensor if isinstance(tensor, torch.Tensor) else torch.zeros(0),
        lr=r.get("lr"),
        eps=r.get("eps"),
        dtype=str(r.get("dtype", "float32")),
        optimizer=str(r.get("optimizer", "optimizer")),
    )


def with_update_origin(snap: Snapshot, tr: Trace) -> Trace:
    """``tr`` (a replay of ``snap``'s forward and backward) with the optimizer step as its
    origin when the snapshot's step failed in the update (reason kind ``"optimizer"``)
    and the trace found no earlier one: the update replayed alone from the stored
    pre-step state when the guard rolled it back, else the origin it recorded."""
    if snap.kind != FailureKind.OPTIMIZER or tr.origin is not None:
        return tr
    look = replay_update(snap)
    note = "the optimizer step replayed alone from the stored pre-step state"
    if look is None:
        look = _recorded(snap)
        note = "the optimizer step as the guard recorded it (the update was not rolled back)"
    origin = look.event(len(tr.events))
    return dataclasses.replace(
        tr,
        events=[*tr.events, origin],
        origin=origin,
        first_nonfinite=tr.first_nonfinite or origin,
        notes=[*tr.notes, f"{origin.note} ({note})"],
    )
