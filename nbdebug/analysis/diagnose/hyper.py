"""Optimizer hyper-parameters outside their usual range, read from the optimizer's
``param_groups``: a momentum of 1 or more (the velocity grows whatever the gradient) and a
weight decay whose step ``lr * weight_decay`` reaches 1 (the decay alone flips the weights'
sign, or grows them past ``2``). Each comes with a usual value, which the replays over
steps try (:mod:`.replay_plans`) and the advice of a diverged run names (:mod:`.advice`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...core.text import fmt_num

__all__ = ["SANE_MOMENTUM", "OddHyper", "odd_hyperparameters"]

#: The momentum proposed for one of 1 or more (SGD's usual value).
SANE_MOMENTUM = 0.9
#: The decay per step (``lr * weight_decay``) of the weight decay proposed instead.
SANE_DECAY_STEP = 1e-3


@dataclass(frozen=True)
class OddHyper:
    """One hyper-parameter of one parameter group outside its usual range.

    Attributes
    ----------
    group : int
        The index in ``optimizer.param_groups``.
    key : str
        ``"momentum"`` or ``"weight_decay"``.
    value, sane : float
        The group's value and the usual one proposed.
    why : str
        Why ``value`` breaks the run, in words.
    optimizer : str
        The optimizer's class name.
    """

    group: int
    key: str
    value: float
    sane: float
    why: str
    optimizer: str

    def change(self) -> str:
        """``"SGD momentum 1.3 -> 0.9"``."""
        return f"{self.optimizer} {self.key} {fmt_num(self.value)} -> {fmt_num(self.sane)}"

    def code(self) -> str:
        """The change as a line of code."""
        at = f"optimizer.param_groups[{self.group}][{self.key!r}]"
        return f"{at} = {self.sane:g}  # was {self.value:g}"


def _number(v: object) -> float | None:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def _decoupled(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether the group's weight decay shrinks the weights by ``lr * weight_decay`` a step
    whatever the gradient: SGD's (added to the raw gradient), AdamW's and any decoupled one."""
    return isinstance(opt, (torch.optim.SGD, torch.optim.AdamW)) or bool(
        group.get("decoupled_weight_decay", False)
    )


def _sane_decay(lr: float) -> float:
    """The power of ten at or below ``SANE_DECAY_STEP / lr``."""
    return 10.0 ** math.floor(math.log10(SANE_DECAY_STEP / lr))


def _of_group(opt: torch.optim.Optimizer, i: int, g: dict[str, Any]) -> list[OddHyper]:
    name = type(opt).__name__
    out = []
    mom = _number(g.get("momentum"))
    if mom is not None and mom >= 1.0:
        why = (
            f"{name} momentum={mom:g} is 1 or more: the velocity is multiplied by {mom:g} every "
            "step whatever the gradient, so the updates grow without bound"
        )
        out.append(OddHyper(i, "momentum", mom, SANE_MOMENTUM, why, name))
    wd, lr = _number(g.get("weight_decay")), _number(g.get("lr"))
    decays = wd is not None and lr is not None and wd > 0 and lr > 0 and _decoupled(opt, g)
    if decays and wd is not None and lr is not None and lr * wd >= 1.0:
        factor = 1.0 - lr * wd
        grow = " (more than 1 in size: they grow)" if factor < -1.0 else ""
        why = (
            f"{name} weight_decay={wd:g} at lr={lr:g}: the decay alone multiplies the "
            f"weights by 1 - lr*weight_decay = {factor:.3g} every step{grow}, and "
            "clipping the gradient does not reach it"
        )
        out.append(OddHyper(i, "weight_decay", wd, _sane_decay(lr), why, name))
    return out


def odd_hyperparameters(opt: torch.optim.Optimizer | None) -> list[OddHyper]:
    """The hyper-parameters of ``opt``'s parameter groups outside their usual range."""
    if opt is None:
        return []
    return [o for i, g in enumerate(opt.param_groups) for o in _of_group(opt, i, g)]
