"""One replay of a step, recorded: every torch operation's floating outputs in call order
(a ``TorchFunctionMode``), each module's output (forward hooks) and each parameter's
gradient, with the module, the operation and the user's source line.

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

from ...core.batch import LossFn, call_model, compute_loss, named_tensors
from ...core.snapshot import ResolvedStep, replay_contexts
from ...core.state import RngState
from ...core.trace.frames import user_source
from ...core.trace.hooks import HookSet, hookable_named_modules
from ...core.trace.ops import op_name
from ...core.vocab import Phase
from .config import ReplayConfig

__all__ = ["Level", "OpRecord", "Recording", "record_step"]

#: what a record stands for: one torch operation, or one module's output
Level = str
OP: Level = "op"
MODULE: Level = "module"


@dataclass
class OpRecord:
    """One recorded value: ``phase`` (forward, loss, backward), ``level`` (``"op"`` or
    ``"module"``), the innermost module running, the operation (``Tensor.div``; a module's
    output is ``"output"``, a gradient ``"grad of weight"``), the source line, and the
    value (a detached CPU copy)."""

    phase: Phase
    level: Level
    module: str
    op: str
    source: str | None
    value: torch.Tensor

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
                Phase(r["phase"]), r["level"], r["module"], r["op"], r["source"] or None, r["value"]
            )
            for r in data["rows"]
        ]
        return cls(str(data["label"]), records, data["error"] or None, bool(data["compiled"]))


class _OpSpy(TorchFunctionMode):
    """Records the floating tensor outputs of every torch call of the replayed code (a
    mode is off while its handler runs: the calls a torch function makes inside itself,
    and those of the recording, are not seen)."""

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
        # the user's line; none for an op of torch's own modules (the module names it)
        self.out.add_all(OP, op_name(func), result, user_source(fallback="") or None)
        return result


class _Sink:
    """Where the hooks and the mode write: the module stack and the records."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.stack: list[str] = []
        self.phase = Phase.FORWARD

    def add_all(self, level: Level, op: str, obj: object, source: str | None) -> None:
        module = self.stack[-1] if self.stack else ""
        with torch._C.DisableTorchFunction():  # the mode does not record the recording
            for name, t in named_tensors(obj, ""):
                if not t.is_floating_point() or t.layout != torch.strided:
                    continue
                label = op if not name else f"{op}{name}"
                value = t.detach().to("cpu", copy=True)
                record = OpRecord(self.phase, level, module, label, source, value)
                self.recording.records.append(record)


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
            _record_grads(model, sink)
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
        sink.add_all(MODULE, "loss", loss.detach(), None)
        if loss.requires_grad:
            with backward():
                loss.backward()


def _install(hooks: HookSet, model: torch.nn.Module, sink: _Sink) -> None:
    for name, m in hookable_named_modules(model):

        def pre(module: torch.nn.Module, args: object, name: str = name) -> None:
            sink.stack.append(name)

        def post(module: torch.nn.Module, args: object, output: object) -> None:
            sink.add_all(MODULE, "output", output, None)
            if sink.stack:
                sink.stack.pop()

        hooks.add(m.register_forward_pre_hook(pre))
        hooks.add(m.register_forward_hook(post))


def _record_grads(model: torch.nn.Module, sink: _Sink) -> None:
    """Each parameter's gradient, the last module's first (the order backward runs)."""
    for mname, m in reversed(hookable_named_modules(model)):
        for pname, p in m.named_parameters(recurse=False):
            if p.grad is not None:
                sink.stack.append(mname)
                sink.add_all(MODULE, f"grad of {pname}", p.grad, None)
                sink.stack.pop()


def _cast(obj: object, dtype: torch.dtype) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj
