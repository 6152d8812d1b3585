"""Which parameters the per-row gradients are taken over, and how many rows at once.

The rule: the whole model when the per-row gradients of :data:`MIN_ROWS` rows (or of
the whole batch when it is smaller), one gradient of every trainable parameter per row at
its dtype's size, fit in the memory budget; else the origin layer's parameters (the
module where the step went wrong: at a spike, the module of the parameter that crossed
its threshold first in the guard's per-layer signals; else where :func:`nbdebug.trace`
finds the first NaN produced; else the module whose parameter's gradient norm is
largest). Rows then go through in chunks of as many as fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...core.text import count_text

__all__ = ["MIN_ROWS", "Scope", "choose_scope", "layer_parameters"]

#: the whole model is blamed when this many rows' gradients fit in the budget
MIN_ROWS = 8


@dataclass(frozen=True)
class Scope:
    """The parameters of the per-row gradients: their names, the module they belong to
    (``""``: the whole model), why, and how many rows go through at once."""

    names: tuple[str, ...]
    layer: str
    why: str
    chunk: int


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _bytes(params: dict[str, torch.nn.Parameter], names: tuple[str, ...]) -> int:
    return sum(params[n].numel() * params[n].element_size() for n in names)


def layer_parameters(model: torch.nn.Module, layer: str) -> tuple[str, ...]:
    """The trainable parameters of the module ``layer`` (and its children); ``""``: all.

    Raises
    ------
    ValueError
        ``layer`` is not a module of ``model``, or it holds no trainable parameter.
    """
    params = _trainable(model)
    if layer == "":
        names = tuple(params)
    else:
        if layer not in dict(model.named_modules()):
            raise ValueError(
                f"layer must name a module of the model, as in model.named_modules(); "
                f"{layer!r} is not one."
            )
        names = tuple(n for n in params if n.startswith(layer + "."))
    if not names:
        where = "the model" if layer == "" else f"the module {layer!r}"
        raise ValueError(f"{where} has no trainable parameter: no gradient to blame rows for.")
    return names


def choose_scope(
    model: torch.nn.Module,
    rows: int,
    memory: int,
    layer: str | None,
    origin: Callable[[], str | None],
) -> Scope:
    """The parameters to blame (``layer`` given, else the rule of the module docstring,
    with ``origin()`` asked only when the whole model does not fit)."""
    params = _trainable(model)
    if layer is not None:
        names = layer_parameters(model, layer)
        why = "the whole model (layer='')" if layer == "" else f"{layer!r} (layer=)"
    else:
        names = layer_parameters(model, "")
        need = _bytes(params, names) * min(rows, MIN_ROWS)
        why = "the whole model"
        if need > memory:
            found = origin()
            over = f"{min(rows, MIN_ROWS)} rows' gradients of the whole model exceed the budget"
            if found:
                names, layer = layer_parameters(model, found), found
                why = f"the origin layer {found!r} ({over})"
            else:
                why = f"the whole model, one row at a time ({over}; no origin layer known)"
    size = max(_bytes(params, names), 1)
    chunk = max(1, min(rows, memory // size))
    what = count_text(sum(params[n].numel() for n in names), "parameter")
    return Scope(names, layer or "", f"{why}: {what}", chunk)
