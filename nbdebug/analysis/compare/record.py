"""One replay of a step, recorded: every torch operation's floating outputs in call order
(a ``TorchFunctionMode``), each module's output (forward hooks) and each parameter's
gradient, with the module, the operation and the user's source line.

Each record also carries the precision its value was computed in (``OpRecord.precision``):
the coarsest floating dtype along its history, not only its own dtype. A torch call's
outputs inherit the coarsest precision of its floating inputs (so ``h.to(torch.float32)``
of a bfloat16 ``h``, and every float32 op downstream of it, was computed in bfloat16); the
model's parameters, buffers and batch are computed in their own dtypes; a module's output
that no recorded call made (a compiled replay) inherits its inputs', parameters' and
buffers'; a gradient inherits the coarsest precision of the forward and the loss of its
replay (the backward runs through their ops).

A compiled replay records at module boundaries only: the operations inside a compiled
graph are not torch calls that a mode sees. Every recorded value is a CPU copy, so a
recording holds the step's activations once: it is made for the one failing step.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ...core.batch import LossFn, call_model, compute_loss, named_tensors
from ...core.snapshot import ResolvedStep, replay_contexts
from ...core.state import RngState
from ...core.trace.frames import user_source
from ...core.trace.hooks import HookSet, hookable_named_modules
from ...core.trace.ops import op_name
from ...core.vocab import Phase
from .config import ReplayConfig

__all__ = ["Level", "OpRecord", "Recording", "coarser", "eps_of", "record_step"]

#: what a record stands for: one torch operation, or one module's output
Level = str
OP: Level = "op"
MODULE: Level = "module"


@dataclass
class OpRecord:
    """One recorded value: ``phase`` (forward, loss, backward), ``level`` (``"op"`` or
    ``"module"``), the innermost module running, the operation (``Tensor.div``; a module's
    output is ``"output"``, a gradient ``"grad of weight"``), the source line, the
    value (a detached CPU copy), and the precision it was computed in (the coarsest
    floating dtype along its history, module docs; default: the value's own dtype)."""

    phase: Phase
    level: Level
    module: str
    op: str
    source: str | None
    value: torch.Tensor
    precision: torch.dtype | None = None

    def __post_init__(self) -> None:
        self.precision = coarser(self.precision, self.value.dtype)

    def key(self) -> tuple[str, str, str]:
        return (self.level, self.module, self.op)


@dataclass
class Recording:
    """The records of one replay, in the order they were made; ``error`` when the replay
    raised (the records up to there are kept)."""

    label: str
    records: list[OpRecord] = field(default_factory=list)
    error: str | None = None
    compiled: bool = False

    def save(self, path: str | Path) -> Path:
        """Write the recording (tensors and plain values only: it loads with
        ``torch.load(weights_only=True)``) to compare a later replay with it
        (``compare_replays(..., b="reference.pt")``)."""
        rows = [
            {
                "phase": str(r.phase),
                "level": r.level,
                "module": r.module,
                "op": r.op,
                "source": r.source or "",
                "value": r.value,
                "precision": str(r.precision).removeprefix("torch."),
            }
            for r in self.records
        ]
        out = Path(path)
        payload: dict[str, object] = {
            "label": self.label,
            "rows": rows,
            "error": self.error or "",
            "compiled": self.compiled,
        }
        torch.save(payload, out)
        return out

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        """A recording written by :meth:`save`."""
        data: dict[str, Any] = torch.load(Path(path), weights_only=True)
        records = [
            OpRecord(
                Phase(r["phase"]),
                r["level"],
                r["module"],
                r["op"],
                r["source"] or None,
                r["value"],
                _dtype_named(r.get("precision", "")),
            )
            for r in data["rows"]
        ]
        return cls(str(data["label"]), records, data["error"] or None, bool(data["compiled"]))


def eps_of(dtype: torch.dtype | None) -> float:
    """The machine epsilon of a floating dtype; 0 for anything else (exact)."""
    return float(torch.finfo(dtype).eps) if dtype is not None and dtype.is_floating_point else 0.0


def coarser(p: torch.dtype | None, q: torch.dtype | None) -> torch.dtype | None:
    """The lower precision (larger epsilon) of two dtypes; a non-floating dtype or None
    counts as exact (the other one wins)."""
    if q is None or not q.is_floating_point:
        return p
    if p is None or not p.is_floating_point:
        return q
    return q if eps_of(q) > eps_of(p) else p


def _dtype_named(name: object) -> torch.dtype | None:
    value = getattr(torch, str(name), None) if name else None
    return value if isinstance(value, torch.dtype) else None


class _OpSpy(TorchFunctionMode):
    """Records the floating tensor outputs of every torch call of the replayed code (a
    mode is off while its handler runs: the calls a torch function makes inside itself,
    and those of the recording, are not seen), each with the precision it inherits from
    the call's inputs."""

    def __init__(self, out: _Sink) -> None:
        super().__init__()
        self.out = out

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        result = func(*args, **(kwargs or {}))
        inherited = self.out.precision_of((args, kwargs))
        name = op_name(func)
        if name == "Tensor.__setitem__" and args and isinstance(args[0], torch.Tensor):
            self.out.inherit(args[0], inherited)  # written in place: returns None
        # the user's line; none for an op of torch's own modules (the module names it)
        self.out.add_all(OP, name, result, user_source(fallback="") or None, inherited)
        return result


class _Sink:
    """Where the hooks and the mode write: the module stack, the records, and the
    precision each tensor made so far was computed in."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.stack: list[str] = []
        self.phase = Phase.FORWARD
        self.made_in: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.coarsest: torch.dtype | None = None  # of every record so far

    def precision_of(self, obj: object) -> torch.dtype | None:
        """The coarsest precision among the floating tensors of ``obj`` (nested)."""
        out: torch.dtype | None = None
        with torch._C.DisableTorchFunction():
            for leaf in tree_leaves(obj):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    out = coarser(out, self.made_in.get(leaf, leaf.dtype))
        return out

    def inherit(self, t: torch.Tensor, inherited: torch.dtype | None) -> torch.dtype | None:
        """Record that ``t`` was computed in ``inherited`` too; its precision now."""
        with torch._C.DisableTorchFunction():
            p = coarser(coarser(self.made_in.get(t), t.dtype), inherited)
            self.made_in[t] = p
        return p

    def add_all(
        self,
        level: Level,
        op: str,
        obj: object,
        source: str | None,
        inherited: torch.dtype | None = None,
    ) -> None:
        module = self.stack[-1] if self.stack else ""
        with torch._C.DisableTorchFunction():  # the mode does not record the recording
            for name, t in named_tensors(obj, ""):
                if not t.is_floating_point() or t.layout != torch.strided:
                    continue
                label = op if not name else f"{op}{name}"
                value = t.detach().to("cpu", copy=True)
                precision = self.inherit(t, inherited)
                self.coarsest = coarser(self.coarsest, precision)
                record = OpRecord(self.phase, level, module, label, source, value, precision)
                self.recording.records.append(record)

    def add_output(self, module: torch.nn.Module, args: object, output: object) -> None:
        """A module's output; a tensor no recorded call made (a compiled replay) inherits
        the precision of the module's inputs, parameters and buffers."""
        with torch._C.DisableTorchFunction():
            tensors = [t for _, t in named_tensors(output, "") if t.is_floating_point()]
            known = all(t in self.made_in for t in tensors)
            inherited = None
            if not known:
                own = [*module.parameters(), *module.buffers()]
                inherited = self.precision_of((args, own))
        self.add_all(MODULE, "output", output, None, inherited)


def record_step(step: ResolvedStep, config: ReplayConfig) -> Recording:
    """Replay ``step`` once under ``config`` on a copy of its model and record it. The
    global RNG state is the step's during the replay and the caller's after it."""
    if config.reference is not None:
        ref = Recording.load(config.reference)
        ref.label = f"{config.label} ({ref.label})"
        return ref
    rec = Recording(config.label, compiled=config.compile)
    model = copy.deepcopy(step.model)
    inputs, target = copy.deepcopy(step.inputs), copy.deepcopy(step.target)
    if config.dtype is not None:
        model.to(config.dtype)
        inputs, target = _cast(inputs, config.dtype), _cast(target, config.dtype)
    sink = _Sink(rec)
    before = RngState.capture()
    step.rng.restore()
    try:
        with HookSet() as hooks:
            _install(hooks, model, sink)
            runner = model
            if config.compile:  # an OptimizedModule wrapping the copy
                runner = cast(torch.nn.Module, torch.compile(model, backend=config.backend))
            batch = (inputs, target, step.loss_fn)
            replay_forward(runner, batch, sink, autocast_of(step, config), not config.compile)
            sink.phase = Phase.BACKWARD
            _record_grads(model, sink, sink.coarsest)
    except Exception as e:
        rec.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        before.restore()
    return rec


def autocast_of(
    step: ResolvedStep, config: ReplayConfig
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The autocast contexts of a replay: the step's recorded autocast (a snapshot's) when
    ``config`` keeps the model's dtypes, none when it casts them. A SnapshotError when this
    machine lacks the recorded autocast dtype."""
    spec = step.autocast if config.dtype is None else None
    device = next((p.device for p in step.model.parameters()), torch.device("cpu"))
    return replay_contexts(spec, device, instead="compare with a=ReplayConfig(dtype=...)")


def replay_forward(
    model: torch.nn.Module,
    batch: tuple[object, object, LossFn | None],
    sink: _Sink,
    contexts: tuple[Callable[[], Any], Callable[[], Any]],
    ops: bool,
) -> None:
    """Forward, loss and backward of the step, in the autocast ``contexts`` (forward and
    loss, backward); the torch calls of the forward and the loss recorded one by one when
    ``ops``. (Named so that the source lines of :func:`user_source` stop at this frame.)"""
    inputs, target, loss_fn = batch
    forward, backward = contexts
    spy = _OpSpy(sink) if ops else contextlib.nullcontext()
    with torch.enable_grad():
        with forward(), spy:
            output = call_model(model, inputs)
            sink.phase = Phase.LOSS
            loss = compute_loss(output, target, loss_fn)
        sink.add_all(MODULE, "loss", loss, None)
        if loss.requires_grad:
            with backward():
                loss.backward()


def _install(hooks: HookSet, model: torch.nn.Module, sink: _Sink) -> None:
    for name, m in hookable_named_modules(model):

        def pre(module: torch.nn.Module, args: object, name: str = name) -> None:
            sink.stack.append(name)

        def post(module: torch.nn.Module, args: object, output: object) -> None:
            sink.add_output(module, args, output)
            if sink.stack:
                sink.stack.pop()

        hooks.add(m.register_forward_pre_hook(pre))
        hooks.add(m.register_forward_hook(post))


def _record_grads(model: torch.nn.Module, sink: _Sink, forward: torch.dtype | None) -> None:
    """Each parameter's gradient, the last module's first (the order backward runs),
    computed in the coarsest precision of the ``forward`` and the loss."""
    for mname, m in reversed(hookable_named_modules(model)):
        for pname, p in m.named_parameters(recurse=False):
            if p.grad is not None:
                sink.stack.append(mname)
                sink.add_all(MODULE, f"grad of {pname}", p.grad, None, forward)
                sink.stack.pop()


def _cast(obj: object, dtype: torch.dtype) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj
