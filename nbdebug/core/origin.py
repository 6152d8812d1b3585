"""Where a NaN/Inf was *produced*: the four rules of DESIGN.md, and the op-level replay.

:func:`locate` reads the records of an exact pass and returns the origin event (or the
backward candidates that a replay must decide between). :func:`replay_forward`,
:func:`replay_backward` and :func:`replay_loss` run one module (or the loss function)
again under a :class:`torch.overrides.TorchFunctionMode` that watches every torch call
and names the first one that turned values without NaN (or Inf) into NaN (or Inf), and
the user's ``file.py:line`` that called it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from .batch import named_tensors
from .recorder import Recorder, clone_structure
from .stats import IDX_NNAN, row_dim, vector_is_finite

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP_DIRS = (_TORCH_DIR, _OWN_DIR, os.path.dirname(os.__file__))


@dataclass
class Located:
    """The outcome of :func:`locate`."""

    event: int | None = None  # index into the raw events
    call: int = -1  # the module call to replay (-1: none / the loss)
    candidates: list[int] = field(default_factory=list)  # backward: calls to try in order
    param: str | None = None
    corrupted: bool = False  # the param/buffer was non-finite before the pass
    module: str | None = None  # set when the producing code is not the event's module
    kind: str = "nan"  # "nan" or "inf"


def _kind(v: Any) -> str:
    return "nan" if v[IDX_NNAN] > 0 else "inf"


def locate(rec: Recorder, bad_params: dict[str, list[str]]) -> Located:
    """Apply the origin rules to the raw events of an exact pass."""
    raw = rec.raw
    for i, r in enumerate(raw):
        if vector_is_finite(r.vector):
            continue
        kind = _kind(r.vector)
        if r.phase == "input":
            return Located(event=i, kind=kind)
        if r.phase == "forward":
            return _forward(rec, i, bad_params, kind)
        if r.phase == "loss":
            return Located(event=i, kind=kind)
        return _backward(rec, i, kind)
    return Located()


def _forward(rec: Recorder, i: int, bad_params: dict[str, list[str]], kind: str) -> Located:
    call = rec.calls[rec.raw[i].call]
    param = _bad_param(call.module, bad_params)
    if call.inputs_finite:
        return Located(event=i, call=call.call, param=param, corrupted=param is not None, kind=kind)
    # the inputs already held the value: the code of an enclosing module produced it
    a = call.parent
    while a >= 0 and not rec.calls[a].inputs_finite:
        a = rec.calls[a].parent
    if a < 0:
        return Located(event=i, kind=kind)
    anc = rec.calls[a]
    bad = [e for e in anc.output_events if not vector_is_finite(rec.raw[e].vector)]
    if bad:
        p = _bad_param(anc.module, bad_params)
        return Located(event=bad[0], call=a, param=p, corrupted=p is not None, kind=kind)
    return Located(event=i, call=a, module=anc.module, kind=kind)


def _bad_param(module: str, bad_params: dict[str, list[str]]) -> str | None:
    names = bad_params.get(module)
    return names[0] if names else None


def _backward(rec: Recorder, i: int, kind: str) -> Located:
    r = rec.raw[i]
    if r.kind == "param_grad":
        calls = [c.call for c in rec.calls if c.module == r.module]
        return Located(event=i, call=calls[-1] if calls else -1, param=r.param, kind=kind)
    # all events of this gradient tensor were emitted together, consumers first
    same = [j for j in range(i, len(rec.raw)) if rec.raw[j].vector is r.vector]
    consumers = [rec.raw[j].call for j in same if rec.raw[j].kind == "grad_input"]
    if consumers:
        # innermost consumer first: a container's child did the work more often than
        # the container's own code
        order = sorted(consumers, key=lambda c: -rec.calls[c].depth)
        first = order[0]
        ev = next(j for j in same if rec.raw[j].call == first and rec.raw[j].kind == "grad_input")
        return Located(event=ev, call=first, candidates=order, kind=kind)
    # consumed by code outside any child module: the producer's parent
    prod = rec.raw[i].call
    parent = rec.calls[prod].parent if prod >= 0 else -1
    if parent >= 0:
        return Located(
            event=i, call=parent, candidates=[parent], module=rec.calls[parent].module, kind=kind
        )
    return Located(event=i, kind=kind)


# ---------------------------------------------------------------------- replay
def _has(t: Any, kind: str) -> bool:
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
        return False
    if t.numel() == 0:
        return False
    with torch._C.DisableTorchFunction():
        return bool(torch.isnan(t).any()) if kind == "nan" else bool(torch.isinf(t).any())


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in named_tensors(obj)]


def op_name(func: Any) -> str:
    """``torch.log``, ``Tensor.__truediv__``, ``torch.nn.functional.softmax``."""
    try:
        name = resolve_name(func)
    except Exception:  # pragma: no cover - exotic callables
        name = None
    if not name:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if name.startswith("torch.Tensor."):
        name = name[len("torch.") :]
    return name


def user_source() -> str | None:
    """``file.py:line`` of the code that called the current torch operation.

    The innermost frame outside torch, the standard library and nbdebug, when it is
    inside the replayed module; when the operation was called by one of torch's own
    modules (``nn.Linear``), the line of that module in torch (``torch/nn/modules/linear.py:125``).
    """
    f = sys._getframe(1)
    torch_frame = None
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_OWN_DIR):
            if f.f_code.co_name in (
                "replay_forward",
                "replay_backward",
                "replay_loss",
                "compute_loss",
            ):
                break  # left the replayed code
        elif fn.startswith(_TORCH_DIR):
            if (
                torch_frame is None
                and not fn.endswith(("overrides.py", "_tensor.py"))
                and "/utils/" not in fn
            ):
                torch_frame = f
        elif not fn.startswith(_SKIP_DIRS) and not fn.startswith("<frozen"):
            return f"{_cell_name(fn) or os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    if torch_frame is not None:
        rel = os.path.relpath(torch_frame.f_code.co_filename, os.path.dirname(_TORCH_DIR))
        return f"{rel}:{torch_frame.f_lineno}"
    return None


def _cell_name(filename: str) -> str | None:
    """``"Cell In[3]"`` for code typed in a notebook or IPython cell, as IPython names it."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    shell = ipython.get_ipython()
    number = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return f"Cell In[{number}]" if number is not None else None


@dataclass
class OpFinding:
    op: str | None = None
    source: str | None = None
    rows: list[int] = field(default_factory=list)
    note: str = ""
    reproduced: bool = False


class _Spy(TorchFunctionMode):
    """Watches torch calls: the first that made ``kind`` (and the first that made an Inf)
    from inputs without it; in backward mode it also maps autograd nodes to calls."""

    def __init__(self, kind: str, batch_size: int | None, *, nodes: bool = False):
        super().__init__()
        self.kind = kind
        self.batch_size = batch_size
        self.found: OpFinding | None = None
        self.first_inf: tuple[str, str | None] | None = None
        self.nodes: dict[Any, tuple[str, str | None]] | None = {} if nodes else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = _tensors(out)
        if not outs:
            return out
        if self.nodes is not None:
            for t in outs:
                if t.grad_fn is not None and t.grad_fn not in self.nodes:
                    self.nodes[t.grad_fn] = (op_name(func), user_source())
        if self.found is None:
            ins = [t for t in _tensors((args, kwargs)) if not isinstance(t, torch.nn.Parameter)]
            if (
                self.kind == "nan"
                and self.first_inf is None
                and any(_has(t, "inf") for t in outs)
                and not any(_has(t, "inf") or _has(t, "nan") for t in ins)
            ):
                self.first_inf = (op_name(func), user_source())
            bad_out = [t for t in outs if _has(t, self.kind)]
            if bad_out and not any(_has(t, self.kind) for t in ins):
                self.found = OpFinding(
                    op_name(func), user_source(), _rows(bad_out[0], self.batch_size)
                )
        return out


def _rows(t: torch.Tensor, batch_size: int | None) -> list[int]:
    d = row_dim(t.shape, batch_size)
    if d is None:
        return []
    with torch._C.DisableTorchFunction():
        bad = ~torch.isfinite(t.detach())
        return torch.nonzero(bad.movedim(d, 0).reshape(t.shape[d], -1).any(1)).flatten().tolist()


def _zero_where_bad(grads: Any, bad: torch.Tensor) -> bool:
    """Whether the incoming gradient is exactly zero wherever ``bad`` is non-finite."""
    with torch._C.DisableTorchFunction():
        mask = ~torch.isfinite(bad)
        for g in grads:
            if isinstance(g, torch.Tensor) and g.shape == bad.shape:
                return bool((g[mask] == 0).all())
    return False


def _inf_note(spy: _Spy) -> str:
    f = spy.found
    if spy.kind != "nan" or spy.first_inf is None or f is None or spy.first_inf[0] == f.op:
        return ""
    op, src = spy.first_inf
    return (
        f"{f.op} turned an Inf into NaN; the Inf was made by {op}"
        + (f" at {src}" if src else "")
        + "."
    )


def replay_forward(
    module: torch.nn.Module, capture: tuple[Any, Any, Any], kind: str, batch_size: int | None
) -> OpFinding:
    """Run ``module`` on its recorded inputs under the spy."""
    args, kwargs, rng = capture
    if rng is not None:
        rng.restore()
    spy = _Spy(kind, batch_size)
    with torch.enable_grad(), spy:
        module(*clone_structure(args), **clone_structure(kwargs))
    f = spy.found or OpFinding()
    f.reproduced = spy.found is not None
    f.note = _inf_note(spy)
    return f


def replay_loss(
    loss_fn: Any, output: Any, target: Any, kind: str, batch_size: int | None
) -> OpFinding:
    from .batch import compute_loss

    spy = _Spy(kind, batch_size)
    with torch.enable_grad(), spy:
        compute_loss(output, target, loss_fn)
    f = spy.found or OpFinding()
    f.reproduced = spy.found is not None
    f.note = _inf_note(spy)
    return f


def replay_backward(
    module: torch.nn.Module,
    capture: tuple[Any, Any, Any],
    grad_outputs: dict[str, torch.Tensor],
    kind: str,
    batch_size: int | None,
) -> OpFinding:
    """Run ``module`` forward and backward on its recorded inputs and incoming gradient;
    name the forward op whose backward turned a finite gradient into ``kind``.
    ``reproduced`` tells whether this module's backward made the value at all."""
    args, kwargs, rng = capture
    if rng is not None:
        rng.restore()
    args, kwargs = clone_structure(args), clone_structure(kwargs)
    leaves = []
    for t in _tensors((args, kwargs)):
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(True)
            leaves.append(t)
    leaves += [p for p in module.parameters() if p.requires_grad]
    spy = _Spy(kind, batch_size, nodes=True)
    with torch.enable_grad(), spy:
        out = module(*args, **kwargs)
    outs, grads = [], []
    for name, t in named_tensors(out, "output"):
        g = grad_outputs.get(name)
        if g is not None and t.requires_grad:
            outs.append(t)
            grads.append(g)
    finding = OpFinding()
    if not outs:
        return finding
    nodes = spy.nodes or {}
    handles = []

    def make_hook(node: Any):
        def hook(grad_inputs: Any, grad_outs: Any) -> None:
            if (
                finding.op is None
                and not any(_has(g, kind) for g in grad_outs)
                and any(_has(g, kind) for g in grad_inputs)
            ):
                finding.op, finding.source = nodes[node]
                bad = next(g for g in grad_inputs if _has(g, kind))
                finding.rows = _rows(bad, batch_size)
                if _zero_where_bad(grad_outs, bad):
                    finding.note = (
                        f"the backward of {finding.op} multiplied a zero gradient by a non-finite "
                        "local derivative (a hidden NaN, e.g. behind torch.where or a mask)."
                    )

        return hook

    for node in nodes:
        handles.append(node.register_hook(make_hook(node)))
    try:
        grads_in = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    finding.reproduced = any(g is not None and _has(g, kind) for g in grads_in)
    return finding
