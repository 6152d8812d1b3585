"""Calling conventions shared by everything that takes a batch.

``inputs`` is a tensor (``model(x)``), a tuple/list (``model(*inputs)``) or a dict
(``model(**inputs)``). The loss is ``loss_fn(output, target)`` when ``target`` is given,
else ``loss_fn(output)``; with no ``loss_fn``: ``output["loss"]``, ``output.loss``, or
the output itself when it is a scalar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias, cast

import torch

from .text import dtype_name

#: a batch: a tensor (``model(x)``), a tuple/list (``model(*inputs)``) or a dict
#: (``model(**inputs)``) of tensors and other arguments
Batch: TypeAlias = "torch.Tensor | Sequence[object] | Mapping[str, object]"
#: ``loss_fn(output, target)`` or ``loss_fn(output)``: a scalar tensor (checked)
LossFn: TypeAlias = Callable[..., object]


def check_flag(value: object, name: str) -> bool:
    """``value`` when it is a bool; else one TypeError naming the option ``name`` (a dtype
    or a string in place of ``True`` would otherwise be taken as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}.")
    return value


def check_model(model: object) -> torch.nn.Module:
    """The module to debug. A ``torch.compile``'d model is debugged through the module it
    wraps (``_orig_mod``: same parameters, run eagerly), so the compiler neither traces
    nbdebug's hooks nor recompiles for them."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module; got "
            f"{type(model).__module__}.{type(model).__qualname__}."
        )
    return uncompiled(model)


def check_materialized(modules: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Refuse a model (``model.named_modules()``) whose lazy modules (``nn.LazyLinear``
    ...) have not run yet: their first forward would give them parameters, and debugging
    must not change the model."""
    for name, m in modules:
        for key, t in (*m._parameters.items(), *m._buffers.items()):
            if t is not None and torch.nn.parameter.is_lazy(t):
                where = f"{name}.{key}" if name else key
                raise ValueError(
                    f"the model's {where} ({type(m).__name__}) is not initialized yet: "
                    "expected a model whose lazy modules have run once; call it on a batch "
                    "first (model(x)) so they get their shapes, then debug it."
                )


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model._orig_mod`` for a ``torch.compile``'d module, else ``model``."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module):
        return inner
    return model


def check_inputs(inputs: object) -> Batch:
    """Validate the batch structure and that it is not empty."""
    if isinstance(inputs, torch.Tensor):
        if inputs.numel() == 0:
            raise ValueError(
                f"the batch is empty: expected a non-empty tensor, got shape {tuple(inputs.shape)}."
            )
        return inputs
    if isinstance(inputs, (tuple, list, Mapping)):
        if isinstance(inputs, Mapping):
            odd = next((k for k in inputs if not isinstance(k, str)), None)
            if odd is not None:
                raise TypeError(
                    "a dict batch is passed as keyword arguments, model(**inputs), so its keys "
                    f"must be argument names (str); got the key {odd!r} "
                    f"({type(odd).__name__}). Pass a tuple for positional arguments."
                )
        if len(inputs) == 0:
            raise ValueError(
                f"the batch is empty: expected a tensor, or a non-empty "
                f"tuple/list/dict of inputs, got an empty {type(inputs).__name__}."
            )
        tensors = list(iter_tensors(inputs))
        if tensors and all(t.numel() == 0 for t in tensors):
            raise ValueError(
                f"the batch is empty: every tensor in it has no elements (shapes "
                f"{[tuple(t.shape) for t in tensors]})."
            )
        return inputs
    raise TypeError(
        "inputs must be a tensor (model(x)), a tuple/list (model(*inputs)) or a dict "
        f"(model(**inputs)); got {type(inputs).__qualname__}."
    )


def call_model(model: torch.nn.Module, inputs: object) -> object:
    """Run ``model`` on ``inputs`` with the calling conventions above."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def iter_tensors(obj: object, prefix: str = "") -> Iterator[torch.Tensor]:
    """The tensors of :func:`named_tensors`, without their names."""
    for _, t in named_tensors(obj, prefix):
        yield t


def named_tensors(obj: object, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a nested tuple/list/dict/dataclass-like output.

    Names read like Python: ``"output"``, ``"output[1]"``, ``"output['logits']"``. This
    runs in every hook, so the common shapes (a tensor, a tuple of tensors) take the
    shortest path.
    """
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    out: list[tuple[str, torch.Tensor]] = []
    _collect(obj, prefix, out)
    return out


def _collect(obj: object, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
        return
    kind = type(obj)
    if kind is tuple or kind is list:
        for i, v in enumerate(cast("Sequence[object]", obj)):
            _collect(v, f"{prefix}[{i}]", out)
    elif kind is dict:
        if obj:
            for k, v in cast("dict[object, object]", obj).items():
                _collect(v, f"{prefix}[{k!r}]", out)
    elif obj is None or kind in (int, float, bool, str):
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, f"{prefix}[{k!r}]", out)
    elif isinstance(obj, (tuple, list)):
        fields = getattr(obj, "_fields", None)
        for i, v in enumerate(obj):
            _collect(v, f"{prefix}.{fields[i]}" if fields else f"{prefix}[{i}]", out)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            _collect(getattr(obj, k, None), f"{prefix}.{k}", out)


def batch_size(inputs: object) -> int | None:
    """The first dimension of the first tensor with at least one dimension."""
    for t in iter_tensors(inputs):
        if t.ndim >= 1:
            return int(t.shape[0])
    return None


def describe(obj: object) -> str:
    """Short description of a batch or an output: ``"Tensor(16, 10) float32"``."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{tuple(obj.shape)} {dtype_name(obj.dtype)}"
    if isinstance(obj, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(describe(v) for v in obj)
        return f"({inner})" if isinstance(obj, tuple) else f"[{inner}]"
    return type(obj).__qualname__


def check_loss_fn(loss_fn: object) -> LossFn | None:
    """``loss_fn`` itself: None or a callable, refused before anything runs."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None; got {type(loss_fn).__qualname__}.")
    return loss_fn  # type: ignore[return-value]  # None or callable, checked above


class LossError(ValueError):
    """No loss could be found, or it is not a scalar tensor (a bad input, not a model error)."""


def own_target(target: object) -> object:
    """``target`` with its tensors cloned (in a tuple, list or dict too; other objects as
    they are): what a loss may write in place. A clone stays in the autograd graph of
    the tensor it copies (a target that requires grad is cut by the caller)."""
    if isinstance(target, torch.Tensor):
        return target.clone()
    if isinstance(target, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in target):
        items = [own_target(t) for t in target]
        kind: Any = type(target)
        if hasattr(target, "_fields"):  # a namedtuple
            return kind(*items)
        return kind(items) if kind in (tuple, list) else items
    if isinstance(target, dict) and any(isinstance(t, torch.Tensor) for t in target.values()):
        return {k: own_target(v) for k, v in target.items()}
    return target


def compute_loss(
    output: object, target: object = None, loss_fn: LossFn | None = None
) -> torch.Tensor:
    """The scalar loss of ``output`` under the conventions above. ``loss_fn`` gets its
    own copy of the target's tensors (:func:`own_target`): a loss that writes its target
    in place (``target[target < 0] = 0``) changes neither the user's tensor nor the
    target the next pass or replay starts from.

    Raises
    ------
    LossError (a ValueError)
        When no loss can be found, or the loss is not a scalar tensor.
    """
    if loss_fn is not None:
        loss = loss_fn(output, own_target(target)) if target is not None else loss_fn(output)
        source = f"loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)}"
    elif isinstance(output, Mapping) and "loss" in output:
        loss, source = output["loss"], "output['loss']"
    elif (attr := getattr(output, "loss", None)) is not None and not isinstance(
        output, torch.Tensor
    ):
        loss, source = attr, "output.loss"
    elif isinstance(output, torch.Tensor) and output.numel() == 1:
        loss, source = output, "the model's scalar output"
    else:
        hint = " (a target was given but no loss_fn)" if target is not None else ""
        raise LossError(
            "no loss to differentiate: expected loss_fn=..., an output with a 'loss' entry or "
            f"attribute, or a scalar output; the model returned {describe(output)}{hint}."
        )
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"the loss must be a scalar tensor; {source} returned {type(loss).__qualname__}."
        )
    if loss.numel() != 1:
        raise LossError(
            f"the loss must be a scalar tensor; {source} returned a tensor of shape "
            f"{tuple(loss.shape)} "
            "(reduce it, e.g. with .mean())."
        )
    return loss.reshape(())
