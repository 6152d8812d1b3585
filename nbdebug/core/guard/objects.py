"""The training objects a guard is given, checked: the optimizer (over the model's
parameters), the GradScaler and the LR scheduler (:func:`training_objects`)."""

from __future__ import annotations

import torch

from ..snapshot.write import Scaler, Scheduler

__all__ = ["check_optimizer_of", "training_objects"]


def check_optimizer_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """An optimizer over none of the model's parameters is another model's (one over some
    parameters outside the model, such as a learned temperature, is fine)."""
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if own and held and not any(id(p) in own for p in held):
        raise ValueError(
            f"the optimizer holds {len(held)} parameter(s), none of them the model's: "
            "expected the optimizer built over this model's parameters (model.parameters())."
        )


def training_objects(
    optimizer: object, scaler: object, scheduler: object
) -> tuple[torch.optim.Optimizer | None, Scaler | None, Scheduler | None]:
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or None; got "
            f"{type(optimizer).__qualname__}."
        )
    if scaler is not None and not isinstance(scaler, Scaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None; got {type(scaler).__qualname__}."
        )
    if scheduler is not None and not isinstance(scheduler, Scheduler):
        raise TypeError(
            "scheduler must have a state_dict() (an LR scheduler); got "
            f"{type(scheduler).__qualname__}."
        )
    return optimizer, scaler, scheduler
