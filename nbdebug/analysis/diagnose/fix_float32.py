"""The ``float32`` fix: one module (or the whole model) run in float32 with autocast off."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...core.batch import named_tensors
from ...core.vocab import FixKind
from .fix import Fix, Replay, forward_replaced
from .fix_builtin import half_cast

__all__ = ["Float32Fix", "NoHalfCasts"]

_HALF = (torch.float16, torch.bfloat16)


def _is_half(v: object) -> bool:
    return isinstance(v, torch.dtype) and v in _HALF


class NoHalfCasts(TorchFunctionMode):
    """The explicit casts to half precision made inside it (``x.half()``,
    ``x.bfloat16()``, ``x.to(torch.float16)``, ``x.type(torch.HalfTensor)``) leave the
    tensor in float32; ``calls`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not half_cast(name, args, kwargs):
            return func(*args, **kwargs)
        self.calls += 1
        if name != "to":
            return args[0]
        # .to(device, dtype): the move made, the dtype float32
        args = tuple(torch.float32 if _is_half(a) else a for a in args)
        kwargs = {k: torch.float32 if _is_half(v) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _cast_in(obj: Any) -> Any:
    """Every floating tensor of ``obj`` (a module's arguments) in float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast_in(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_cast_in(v) for v in obj)
    return obj


def _cast_out(obj: Any, like: torch.dtype) -> Any:
    """Every floating tensor of ``obj`` (a module's output) back in ``like``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(like) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast_out(v, like) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_cast_out(v, like) for v in obj)
    return obj


@contextmanager
def _float32_state(m: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """For the block: ``m``'s floating parameters and buffers in float32, and the
    optimizer's state tensors of those parameters too; put back on exit."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in [*m.parameters(), *m.buffers()]:
        if t.is_floating_point() and t.dtype != torch.float32:
            saved.append((t, t.data))
            t.data = t.data.float()
    opt_saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    if optimizer is not None:
        changed = {id(t) for t, _ in saved}
        for p, st in optimizer.state.items():
            if id(p) not in changed:
                continue
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                    opt_saved.append((st, k, v))
                    st[k] = v.float()
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data
        for st, k, v in opt_saved:
            st[k] = v


def _float32_forward(
    inner: Callable[..., Any], device_type: str, *, keep_float32: bool
) -> Callable[..., Any]:
    """``inner`` run on float32 arguments with autocast off and its own casts to half
    precision turned into no-ops; its output cast back to the dtype of its first floating
    argument (unless ``keep_float32``)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        like = next(
            (t.dtype for _, t in named_tensors((args, kwargs)) if t.is_floating_point()),
            None,
        )
        with torch.autocast(device_type, enabled=False), NoHalfCasts():
            out = inner(*_cast_in(args), **_cast_in(kwargs))
        return out if like is None or keep_float32 else _cast_out(out, like)

    return forward


class Float32Fix(Fix):
    """Run one module (``""``: the whole model) in float32 with autocast off: its
    parameters, buffers and floating inputs are cast to float32, the casts to half
    precision its forward makes itself (``.half()``, ``.to(torch.float16)``,
    ``.bfloat16()``) are no-ops, and its output is cast back to the dtype it had (the
    model's output stays float32).

    Parameters
    ----------
    module : str
        The module's qualified name; ``""``: the whole model.
    depth : int
        How deep the module is (``"a.b"``: 2): a deeper module is the more local change.
    module_type : str
        The module's class name, for the text.

    Examples
    --------
    >>> nbdebug.diagnose(snap, fixes=[nbdebug.Float32Fix("encoder.layers.0.norm1")])
    """

    kind = FixKind.FLOAT32

    def __init__(self, module: str = "", *, depth: int = 0, module_type: str = ""):
        super().__init__()
        self.module: str = module
        self.depth = depth
        self.module_type = module_type

    @property
    def rank_locality(self) -> float:
        if self.locality is not None:
            return float(self.locality)
        # a deeper module is more local; the whole model least
        return 3.0 if self.module == "" else 2.0 + 1.0 / (2.0 + self.depth)

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        m = replay.module(str(self.module))
        dev = next((t.device.type for t in [*m.parameters(), *m.buffers()]), "cpu")
        whole = self.module == ""
        forward = _float32_forward(m.forward, dev, keep_float32=whole)
        # the whole model: autocast off for the whole step (forward, loss, backward),
        # whatever the caller has around it
        off = torch.autocast(dev, enabled=False) if whole else nullcontext()
        if whole:
            replay.autocast = False
        with _float32_state(m, replay.optimizer), forward_replaced(m, lambda _: forward), off:
            yield

    def _where(self) -> str:
        if self.module == "":
            return "the whole model"
        return self.module + (f" ({self.module_type})" if self.module_type else "")

    def describe(self) -> str:
        return f"run {self._where()} in float32 instead of half precision (autocast off)"

    def action(self) -> str:
        return f"running {self._where()} in float32 instead of half precision"

    def snippet(self) -> str:
        if self.module == "":
            return "model = model.float()  # and drop torch.autocast / .half() around the step"
        return (
            f"model.get_submodule({self.module!r}).float()  # keep it out of half precision\n"
            "# and in its forward: drop .half() / .to(torch.float16); or "
            "with torch.autocast(device_type, enabled=False): x = x.float(); ..."
        )
