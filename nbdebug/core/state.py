"""Debugging must not change what it debugs.

:class:`PreservedState` records what a forward + backward can change on a model and in
the process (buffers such as BatchNorm running statistics, ``.grad``, ``requires_grad``,
train/eval flags, the parameters' tensor-hook dicts, the torch / CUDA / numpy /
Python RNG states) and puts it back. Parameters themselves are not copied (models can be
large): nothing nbdebug runs writes to them, and :meth:`restore` checks their version
counters to prove it.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .text import qualified_name


def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass(frozen=True)
class AutocastState:
    """Which device types ran under ``torch.autocast`` at a moment, with their dtypes:
    taken at a module call (or the loss) so that a replay of it runs as it ran, whatever
    autocast is active around the replay."""

    on: tuple[tuple[str, torch.dtype], ...] = ()

    @classmethod
    def capture(cls) -> AutocastState:
        return cls(
            tuple(
                (d, torch.get_autocast_dtype(d))
                for d in _autocast_devices()
                if torch.is_autocast_enabled(d)
            )
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Autocast exactly as captured: on with its dtype where it was on, off elsewhere."""
        now = AutocastState.capture()
        if now == self:
            yield
            return
        dtypes = dict(self.on)
        with ExitStack() as stack:
            for d in _autocast_devices():
                dtype = dtypes.get(d)
                if dtype is not None:
                    stack.enter_context(torch.autocast(d, dtype=dtype))
                elif torch.is_autocast_enabled(d):
                    stack.enter_context(torch.autocast(d, enabled=False))
            yield


#: bytes of numpy's MT19937 state struct (624 uint32 words, then the position)
_MT_BYTES = 624 * 4 + 4


class _NumpyGlobalState:
    """``np.random.get_state()`` at a fraction of its cost (it takes ~25 us, and the
    guard captures it at every step): when the global generator's state struct holds the
    same bytes as at the last capture, and that capture had no cached Gaussian (a drawn
    normal's twin, which alone changes without the struct), the state is the last one
    (its tuple is returned again: never changed in place)."""

    def __init__(self) -> None:
        self._raw: bytes | None = None
        self._state: Any = None
        # the global bit generator last seen and its state struct's address (``ctypes``
        # builds a new interface object per access: looked up once per generator)
        self._bg: Any = None
        self._address: int | None = None

    def _struct(self) -> bytes | None:
        """The MT19937 state struct of the global generator (``None``: another one)."""
        bg = np.random.get_bit_generator()  # type: ignore[attr-defined]
        if bg is not self._bg:
            self._bg = bg  # held: its struct stays at this address
            mt = type(bg).__name__ == "MT19937"
            self._address = int(bg.ctypes.state_address) if mt else None
        if self._address is None:
            return None
        return ctypes.string_at(self._address, _MT_BYTES)

    def capture(self) -> Any:
        raw = self._struct()
        if raw is not None and raw == self._raw:
            return self._state
        state: Any = np.random.get_state()
        self._raw, self._state = None, state
        if raw is not None and _layout_matches(state, raw) and not state[3]:
            self._raw = raw  # the next unchanged struct returns this state
        return state


def _layout_matches(state: Any, raw: bytes) -> bool:
    """Whether ``raw`` holds the key and position of the legacy ``state`` tuple."""
    key = np.frombuffer(raw[: 624 * 4], dtype="<u4")
    pos = int.from_bytes(raw[624 * 4 :], "little", signed=True)
    return state[0] == "MT19937" and pos == state[2] and bool(np.array_equal(key, state[1]))


_NUMPY = _NumpyGlobalState()


@dataclass
class RngState:
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    numpy: Any
    python: Any

    @classmethod
    def capture(cls) -> RngState:
        cuda = None
        if torch.cuda.is_initialized():  # (initialised: available, and cheaper to ask)
            cuda = torch.cuda.get_rng_state_all()
        return cls(torch.get_rng_state(), cuda, _NUMPY.capture(), random.getstate())

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
    # ``model.named_modules()`` as captured: one walk, reused by whoever holds the state
    modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    # parameters the forward itself writes in place, with their values after one forward
    written: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def capture(cls, model: torch.nn.Module) -> PreservedState:
        st = cls(model)
        seen: set[int] = set()
        # one walk over the modules (a model of 1,000+ modules takes milliseconds a walk):
        # parameters in ``model.parameters()`` order, buffers, train/eval flags
        st.modules = list(model.named_modules())
        for _, m in st.modules:
            st.training[id(m)] = m.training
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    st.params.append(p)
            for key, b in m._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    st.buffers.append((m, key, b, b.detach().clone()))
        for p in st.params:
            st.grads[id(p)] = p.grad
            st.requires_grad[id(p)] = p.requires_grad
            st.versions[id(p)] = p._version
            st.post_hooks[id(p)] = (
                getattr(p, "_post_accumulate_grad_hooks", None),
                p._backward_hooks,
            )
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
                put_back(owner, key, buf, saved)
        if self.rng is not None:
            self.rng.restore()

    def restore(self) -> None:
        self.reset_buffers()
        with torch.no_grad():
            for p, after_one in self.written:
                p.copy_(after_one)
        for p in self.params:
            p.grad = self.grads[id(p)]
            if p.requires_grad != self.requires_grad[id(p)]:
                p.requires_grad_(self.requires_grad[id(p)])
            post, backward = self.post_hooks[id(p)]
            if hasattr(p, "_post_accumulate_grad_hooks"):
                p._post_accumulate_grad_hooks = post
            if p._backward_hooks is not backward and not p._backward_hooks:
                p._backward_hooks = backward
        for _, m in self.modules:
            flag = self.training.get(id(m))
            if flag is not None and m.training != flag:
                m.training = flag

    def changed_parameters(self) -> list[str]:
        """Names of parameters written to since :meth:`capture` (by the model's own forward:
        a clamp or a decay inside ``forward``; nbdebug writes none)."""
        ids = {id(p): n for n, p in self.model.named_parameters()}
        return [
            ids[id(p)] for p in self.params if p._version != self.versions[id(p)] and id(p) in ids
        ]

    def keep_written(self) -> list[str]:
        """After one forward: the parameters it wrote in place, whose values now (as one
        forward leaves them) :meth:`restore` puts back, so the passes that follow do not
        leave them written twice. Values before that forward are not kept (that would copy
        every parameter on every trace); the following passes start from these."""
        if all(p._version == self.versions[id(p)] for p in self.params):
            return []  # the common case, without a walk over the modules for names
        names = self.changed_parameters()
        by_name = dict(self.model.named_parameters())
        self.written = [(by_name[n], by_name[n].detach().clone()) for n in names]
        return names


def put_back(owner: torch.nn.Module, key: str, buf: torch.Tensor, saved: torch.Tensor) -> None:
    """Make ``owner``'s buffer ``key`` the tensor ``buf`` again, holding ``saved``'s values
    (the forward may have re-assigned it or resized it). Call under ``torch.no_grad()``."""
    if owner._buffers.get(key) is not buf:
        owner._buffers[key] = buf
    if buf.shape != saved.shape:
        buf.set_(saved.clone())  # type: ignore[call-overload]
    else:
        buf.copy_(saved)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: always "written"
        return -1


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(a, b))


#: buffers of more elements than this (registered masks, rotary caches: constants) are
#: copied again only when their version counter moved; smaller ones at every capture
LARGE_BUFFER = 1 << 20


@dataclass
class BufferCopies:
    """A model's buffers as they were at one point (the start of a training step), for a
    guard that skips a step: the forward of a bad batch has already written BatchNorm's
    running statistics (NaN from a NaN batch) by the time the step is checked.

    BatchNorm's kernel writes its running statistics without moving the tensors' version
    counters, so every buffer of up to ``LARGE_BUFFER`` elements is copied at each
    capture (into the previous capture's copies: one ``torch._foreach_copy_``); larger
    ones only when their version moved or they were re-assigned.
    """

    # (owner module, key, the buffer object, a copy of its values, its version then)
    entries: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor, int]] = field(
        default_factory=list
    )

    @classmethod
    def capture(cls, model: torch.nn.Module, previous: BufferCopies | None = None) -> BufferCopies:
        old = {id(e[2]): e for e in previous.entries} if previous is not None else {}
        out = cls()
        seen: set[int] = set()
        refresh: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for m in model.modules():
            for key, b in m._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                v = _version(b)
                hit = old.get(id(b))
                reuse = (
                    hit is not None
                    and hit[2] is b
                    and (hit[3].shape, hit[3].dtype, hit[3].device) == (b.shape, b.dtype, b.device)
                )
                if reuse and hit is not None and b.numel() <= LARGE_BUFFER:
                    refresh[0].append(hit[3])
                    refresh[1].append(b.detach())
                    out.entries.append((m, key, b, hit[3], v))
                elif reuse and hit is not None and hit[4] == v >= 0:
                    out.entries.append((m, key, b, hit[3], v))
                else:
                    out.entries.append((m, key, b, b.detach().clone(), v))
        if refresh[0]:
            with torch.no_grad():
                torch._foreach_copy_(refresh[0], refresh[1])
        return out

    def _written(self) -> list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor, int]]:
        return [
            e
            for e in self.entries
            if e[0]._buffers.get(e[1]) is not e[2] or e[4] < 0 or not _same(e[2], e[3])
        ]

    def written(self, model: torch.nn.Module) -> list[str]:
        """Qualified names of the buffers whose values changed, or that were re-assigned,
        since the capture."""
        names = {id(m): n for n, m in model.named_modules()}
        return [qualified_name(names.get(id(e[0]), ""), e[1]) for e in self._written()]

    def restore(self) -> None:
        """Put the written buffers back as captured."""
        with torch.no_grad():
            for owner, key, buf, saved, _ in self._written():
                put_back(owner, key, buf, saved)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The captured values in the model for the block, the current ones back after."""
        now = [(o, k, o._buffers.get(k)) for o, k, *_ in self._written()]
        current = [(o, k, b, b.detach().clone()) for o, k, b in now if b is not None]
        self.restore()
        try:
            yield
        finally:
            with torch.no_grad():
                for owner, key, buf, saved in current:
                    put_back(owner, key, buf, saved)


def unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@contextmanager
def preserved(model: torch.nn.Module) -> Iterator[PreservedState]:
    """Context manager: everything :class:`PreservedState` covers is put back on exit,
    also when the body raises."""
    st = PreservedState.capture(model)
    try:
        yield st
    finally:
        st.restore()
