"""One "state fingerprint" for every no-side-effects test: debugging never changes what
it debugs (DESIGN.md). :func:`fingerprint` records parameters and buffers (BatchNorm running
statistics included) with their identities, ``.grad`` (identity and value),
``requires_grad``, train/eval of every module, every hook dictionary of modules and
parameters, and the global torch, numpy and Python RNG states; :func:`assert_unchanged`
compares a model against one, bitwise (NaN equal to NaN).

>>> before = fingerprint(model)
>>> nbdebug.trace(model, x)
>>> assert_unchanged(before, model)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn


def hook_dicts(model: nn.Module) -> list[Any]:
    out = []
    for m in model.modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            d = getattr(m, attr, None)
            out.append((attr, None if d is None else dict(d)))
    for p in model.parameters():
        out.append(("p._backward_hooks", p._backward_hooks))
        out.append(("p._post_acc", getattr(p, "_post_accumulate_grad_hooks", None)))
    return out


def fingerprint(model: nn.Module, *, versions: bool = False) -> dict[str, Any]:
    """The state of ``model`` and of the global RNGs; ``versions=True`` also records each
    parameter's in-place version counter (for entry points that must not even write a
    parameter back)."""
    out = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "param_ids": {n: id(p) for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "buffer_ids": {n: id(b) for n, b in model.named_buffers()},
        "grads": {
            n: (None if p.grad is None else (id(p.grad), p.grad.clone()))
            for n, p in model.named_parameters()
        },
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": hook_dicts(model),
        "torch_rng": torch.get_rng_state().clone(),
        "np_rng": np.random.get_state()[1].copy(),
        "py_rng": random.getstate(),
    }
    if versions:
        out["versions"] = {n: p._version for n, p in model.named_parameters()}
    return out


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


def assert_unchanged(before: dict[str, Any], model: nn.Module) -> None:
    after = fingerprint(model, versions="versions" in before)
    for n, v in before["params"].items():
        assert same_tensor(v, after["params"][n]), f"parameter {n} changed"
    assert before["param_ids"] == after["param_ids"]
    for n, v in before["buffers"].items():
        assert same_tensor(v, after["buffers"][n]), f"buffer {n} changed"
    assert before["buffer_ids"] == after["buffer_ids"]
    for n, g in before["grads"].items():
        p = dict(model.named_parameters())[n]
        if g is None:
            assert p.grad is None, f".grad of {n} appeared"
        else:
            assert id(p.grad) == g[0] and same_tensor(p.grad, g[1]), f".grad of {n} changed"
    assert before["requires_grad"] == after["requires_grad"]
    assert before["training"] == after["training"]
    assert before["hooks"] == after["hooks"], "hook dictionaries changed"
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert np.array_equal(before["np_rng"], after["np_rng"])
    assert before["py_rng"] == after["py_rng"]
    if "versions" in before:
        assert before["versions"] == after["versions"], "a parameter was written in place"
