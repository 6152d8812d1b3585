"""One place that holds hook handles and removes them all, in ``finally``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import TracebackType

import torch
from torch.utils.hooks import RemovableHandle


class HookSet:
    """Collects the handles returned by ``register_*_hook`` calls and removes every one
    of them on :meth:`close` (or on leaving the ``with`` block, also when it raises).

    >>> with HookSet() as hooks:
    ...     for m in model.modules():
    ...         hooks.add(m.register_forward_hook(fn))
    ...     model(x)
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        # tensors that had no hook dictionary before a tensor_hook: given none back
        self._fresh: list[weakref.ref[torch.Tensor]] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle

    def tensor_hook(
        self, t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> RemovableHandle:
        """``t.register_hook(fn)``, undone on :meth:`close` like the module hooks: a hook on
        a leaf (a batch tensor, a parametrization's original) would otherwise outlive the
        pass and run in the user's next backward. A tensor that had no hook dictionary
        before gets none back. The tensor itself is held weakly."""
        if t._backward_hooks is None:
            self._fresh.append(weakref.ref(t))
        return self.add(t.register_hook(fn))

    def close(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._fresh:
            t = self._fresh.pop()()
            if t is not None and not t._backward_hooks:
                t._backward_hooks = None

    def __len__(self) -> int:
        return len(self._handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def hookable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.modules()`` without TorchScript modules, which take no Python hooks (they
    run as one opaque step inside their parent)."""
    return [m for _, m in hookable_named_modules(model)]


def hookable_named_modules(
    model: torch.nn.Module, walk: list[tuple[str, torch.nn.Module]] | None = None
) -> list[tuple[str, torch.nn.Module]]:
    """``model.named_modules()`` (or ``walk``, a list of it already made) without
    TorchScript modules (see :func:`hookable_modules`)."""
    import torch

    named = model.named_modules() if walk is None else walk
    return [(n, m) for n, m in named if not isinstance(m, torch.jit.ScriptModule)]
