"""Torch operations by name, and composite torch functions opened up.

:func:`op_name` names a torch callable as a chain shows it (``torch.log``,
``Tensor.div``; :mod:`nbdebug.core.optable` gives its family); :func:`composite_body`
gives a composite function written in Python (``F.normalize``,
``F.multi_head_attention_forward``, ``scaled_dot_product_attention``'s math path) with its
body visible to a ``TorchFunctionMode``, so the op named is the elementary one.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import resolve_name

from ..text import code_name

__all__ = ["composite_body", "descendable", "op_name", "shadow"]

_COMPOSITE_MODULES = ("torch.nn.functional", "torch.functional")


def op_name(func: object) -> str:
    """``torch.log``, ``Tensor.div``, ``torch.nn.functional.softmax``."""
    try:
        name: str | None = resolve_name(func)
    except Exception:  # pragma: no cover - exotic callables
        name = None
    if not name:
        name = _torch_attribute(func) or code_name(func)
    if name.startswith("torch.Tensor."):
        name = name[len("torch.") :]
    return name


def _torch_attribute(func: object) -> str | None:
    """``torch.X`` for a function of torch's namespace that ``resolve_name`` does not
    know (``torch._weight_norm``, whose ``__qualname__`` is the internal
    ``_VariableFunctionsClass._weight_norm``)."""
    name = getattr(func, "__name__", None)
    if getattr(func, "__module__", None) != "torch" or not isinstance(name, str):
        return None
    return f"torch.{name}" if getattr(torch, name, None) is func else None


#: a torch callable as a ``TorchFunctionMode`` receives it
TorchCallable = Callable[..., object]

_SHADOWS: dict[object, TorchCallable] = {}


def _false(*_args: object, **_kwargs: object) -> bool:
    return False


def descendable(func: object) -> bool:
    """Whether ``func`` is a composite torch function whose body a mode can be shown."""
    if func is F.scaled_dot_product_attention:
        return True
    return (
        isinstance(func, types.FunctionType)
        and getattr(func, "__module__", "") in _COMPOSITE_MODULES
        and any(n.startswith("has_torch_function") for n in func.__code__.co_names)
    )


def composite_body(func: object) -> TorchCallable | None:
    """For a composite torch function written in Python (``F.normalize``,
    ``F.multi_head_attention_forward``, ``scaled_dot_product_attention``'s math path): a
    function running its body with the operations inside it visible to a
    ``TorchFunctionMode`` (call it inside the mode); ``None`` for any other function."""
    return shadow(func) if descendable(func) else None


def shadow(func: object) -> TorchCallable:
    """``func`` with its own ``__torch_function__`` dispatch switched off, so that under
    the mode its body runs and the operations inside it are seen one by one."""
    if func is F.scaled_dot_product_attention:
        return _sdpa_math
    hit = _SHADOWS.get(func)
    if hit is None:
        if not isinstance(func, types.FunctionType):
            raise TypeError(f"not a composite torch function: {func!r}")
        g = dict(func.__globals__)
        for n in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
            g[n] = _false
        body = types.FunctionType(
            func.__code__, g, func.__name__, func.__defaults__, func.__closure__
        )
        body.__kwdefaults__ = func.__kwdefaults__
        _SHADOWS[func] = hit = body
    return hit


def _sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The math path of ``scaled_dot_product_attention`` as its documentation writes it
    (the fused kernels hide the softmax that a fully masked row turns into NaN)."""
    n_q, n_k = query.size(-2), key.size(-2)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    bias = torch.zeros(n_q, n_k, dtype=query.dtype, device=query.device)
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(diagonal=0)
        bias = bias.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = attn_mask + bias
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    weights = query @ key.transpose(-2, -1) * factor
    weights = weights + bias
    weights = torch.softmax(weights, dim=-1)
    if dropout_p > 0:
        weights = torch.dropout(weights, dropout_p, train=True)
    return weights @ value
