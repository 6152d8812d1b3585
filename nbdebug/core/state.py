"""Debugging must not change what it debugs.

:class:`PreservedState` records what a forward + backward can change on a model and in
the process (buffers such as BatchNorm running statistics, ``.grad``, ``requires_grad``,
train/eval flags, the parameters' tensor-hook dicts, the torch / CUDA / numpy /
Python RNG states) and puts it back. Parameters themselves are not copied (models can be
large): nothing nbdebug runs writes to them, and :meth:`restore` checks their version
counters to prove it.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class RngState:
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    numpy: Any
    python: Any

    @classmethod
    def capture(cls) -> RngState:
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return cls(torch.get_rng_state(), cuda, np.random.get_state(), random.getstate())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@dataclass
class PreservedState:
    model: torch.nn.Module
    # (owner module, key, the buffer object, a copy of its values)
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)
    requires_grad: dict[int, bool] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    post_hooks: dict[int, Any] = field(default_factory=dict)
    training: dict[int, bool] = field(default_factory=dict)
    rng: RngState | None = None
    params: list[torch.nn.Parameter] = field(default_factory=list)

    @classmethod
    def capture(cls, model: torch.nn.Module) -> PreservedState:
        st = cls(model)
        st.params = unique_parameters(model)
        for p in st.params:
            st.grads[id(p)] = p.grad
            st.requires_grad[id(p)] = p.requires_grad
            st.versions[id(p)] = p._version
            st.post_hooks[id(p)] = (
                getattr(p, "_post_accumulate_grad_hooks", None),
                p._backward_hooks,
            )
        seen: set[int] = set()
        for m in model.modules():
            for key, b in m._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    st.buffers.append((m, key, b, b.detach().clone()))
        st.training = {id(m): m.training for m in model.modules()}
        st.rng = RngState.capture()
        return st

    def clear_grads(self) -> None:
        """Detach the user's ``.grad`` tensors so a backward does not accumulate into them."""
        for p in self.params:
            p.grad = None

    def reset_buffers(self) -> None:
        """Put buffers and RNG back as captured (between two replays of the same step)."""
        with torch.no_grad():
            for owner, key, buf, saved in self.buffers:
                if owner._buffers.get(key) is not buf:  # the forward re-assigned it
                    owner._buffers[key] = buf
                if buf.shape != saved.shape:
                    buf.set_(saved.clone())  # type: ignore[call-overload]
                else:
                    buf.copy_(saved)
        if self.rng is not None:
            self.rng.restore()

    def restore(self) -> None:
        self.reset_buffers()
        for p in self.params:
            p.grad = self.grads[id(p)]
            if p.requires_grad != self.requires_grad[id(p)]:
                p.requires_grad_(self.requires_grad[id(p)])
            post, backward = self.post_hooks[id(p)]
            if hasattr(p, "_post_accumulate_grad_hooks"):
                p._post_accumulate_grad_hooks = post
            if p._backward_hooks is not backward and not p._backward_hooks:
                p._backward_hooks = backward
        for m in self.model.modules():
            flag = self.training.get(id(m))
            if flag is not None:
                m.training = flag

    def changed_parameters(self) -> list[str]:
        """Names of parameters written to since :meth:`capture` (should be none)."""
        ids = {id(p): n for n, p in self.model.named_parameters()}
        return [
            ids[id(p)] for p in self.params if p._version != self.versions[id(p)] and id(p) in ids
        ]


def unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@contextmanager
def preserved(model: torch.nn.Module):
    """Context manager: everything :class:`PreservedState` covers is put back on exit,
    also when the body raises."""
    st = PreservedState.capture(model)
    try:
        yield st
    finally:
        st.restore()
