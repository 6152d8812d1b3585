"""``nbdebug.trace()``: one forward + backward, recorded module by module.

The common case costs one quick pass: module hooks keep statistics on the device and the
host reads them once. Only when that pass saw a NaN/Inf does the trace replay the same
step (same buffers, same RNG) in exact mode to count NaN/Inf element-wise, find the batch
rows and the module that produced the value, and then replays that one module at the
level of torch operations to name the op and the source line.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .batch import (
    LossError,
    batch_size,
    call_model,
    check_inputs,
    check_model,
    compute_loss,
    describe,
    named_tensors,
)
from .events import Event, ParamInfo
from .hooks import HookSet, hookable_modules
from .norms import fused_norms
from .origin import Located, OpFinding, locate, replay_backward, replay_forward, replay_loss
from .recorder import Recorder, clone_structure
from .result import Trace, TraceError
from .state import PreservedState, RngState, preserved
from .stats import finalize_many, quick_is_complete, tensor_stats
from .text import dtype_name, qualified_name

__all__ = ["Trace", "TraceError", "trace"]


def trace(
    model: torch.nn.Module,
    inputs: Any,
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
) -> Trace:
    """Run one forward and backward pass of ``model`` on ``inputs`` and record every
    module's output, the loss, every gradient and every parameter's gradient.

    Parameters
    ----------
    model : torch.nn.Module
        Traced as it is (train or eval mode); nothing about it is changed.
    inputs : Tensor, tuple/list or dict
        ``model(x)``, ``model(*inputs)`` or ``model(**inputs)``. Rows along the first
        dimension of the first tensor are the batch rows reported in ``Event.samples``.
    target : optional
        Passed to ``loss_fn(output, target)``.
    loss_fn : callable, optional
        ``loss_fn(output, target)`` or ``loss_fn(output)``. Without it the loss is
        ``output["loss"]``, ``output.loss`` or the output itself when it is a scalar.

    Returns
    -------
    Trace
        ``.events``, ``.origin`` (where the first NaN/Inf was produced), ``.loss``,
        ``.to_frame()``, ``.params_frame()``.

    Raises
    ------
    TypeError, ValueError
        For a non-module model, an empty or malformed batch, no loss or a non-scalar loss.
    TraceError
        When the model, the loss function or the backward raises; carries the partial
        trace (``err.trace``) and chains the original exception.

    Examples
    --------
    >>> tr = nbdebug.trace(model, x, target=y, loss_fn=F.cross_entropy)
    >>> tr.origin.module, tr.origin.op, tr.origin.source, tr.origin.samples
    ('norm', 'Tensor.__truediv__', 'model.py:12', [3])
    """
    model = check_model(model)
    check_inputs(inputs)
    bs = batch_size(inputs)
    with _gc_paused(), preserved(model) as st:
        health = _ParamHealth.measure(model, st.params)
        rec, out = _run(model, inputs, target, loss_fn, st, exact=False)
        vectors = rec.host_vectors()
        if all(quick_is_complete(v) for v in vectors) and not health.bad:
            events = _events(rec, vectors)
            return _result(model, inputs, rec, events, None, out, health)
        # something is not finite (or overflowed float32 sums): replay the step exactly
        st.reset_buffers()
        rec, out = _run(model, inputs, target, loss_fn, st, exact=True, capture=True)
        events = _events(rec, rec.host_vectors())
        loc = locate(rec, health.bad)
        origin = _resolve(model, inputs, target, loss_fn, st, rec, loc, events, out, bs)
        return _result(model, inputs, rec, events, origin, out, health)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """A trace allocates thousands of small records; letting the cyclic collector run
    full collections over a torch-sized heap in the middle of that costs more than the
    trace itself. Pause it for the duration and restore its previous state."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------- passes
@dataclasses.dataclass
class _Outcome:
    loss: float | None
    output: Any = None  # exact pass only: the model output, for the loss replay
    notes: list[str] = dataclasses.field(default_factory=list)


def _run(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    *,
    exact: bool,
    capture: bool = False,
) -> tuple[Recorder, _Outcome]:
    rec = Recorder(model, exact=exact, batch_size=batch_size(inputs), capture=capture)
    st.clear_grads()
    outcome = _Outcome(None)
    stage = "forward"
    output: Any = None
    with HookSet() as hooks:
        rec.install(hooks, st.params)
        try:
            rec.record_batch(inputs)
            with torch.enable_grad():
                output = call_model(model, inputs)
                stage = "loss"
                loss = compute_loss(output, target, loss_fn)
                rec.record_loss(loss)
                outcome.loss = float(loss.detach().float().cpu())
                if exact:
                    outcome.output = clone_structure(output)
                stage = "backward"
                rec.recomputing = True
                note = _backward(loss, st, inputs)
                if note:
                    outcome.notes.append(note)
        except LossError:
            raise
        except Exception as e:
            raise _trace_error(model, inputs, target, rec, stage, e, output) from e
    return rec, outcome


def _backward(loss: torch.Tensor, st: PreservedState, inputs: Any) -> str:
    """``loss.backward()`` without leaving a trace on the user's tensors: the parameters'
    ``.grad`` were detached by :meth:`PreservedState.clear_grads` (and are put back on
    exit), the batch's leaf tensors get their ``.grad`` back here. A plain ``backward()``
    (rather than ``torch.autograd.grad``) also works through reentrant activation
    checkpointing. Returns a note when there is nothing to differentiate."""
    if not loss.requires_grad:
        if any(p.requires_grad for p in st.params):
            return (
                "the loss does not depend on any parameter through autograd, so the backward "
                "pass was skipped: gradients are cut somewhere (torch.no_grad, .detach(), or "
                "torch.utils.checkpoint(use_reentrant=True) on inputs that do not require grad)"
            )
        return "no parameter or input requires grad: the backward pass was skipped"
    batch = [t for _, t in named_tensors(inputs) if t.is_leaf and t.requires_grad]
    saved = [t.grad for t in batch]
    for t in batch:
        t.grad = None
    try:
        loss.backward()
    finally:
        for t, g in zip(batch, saved):
            t.grad = g
    return ""


def _trace_error(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    rec: Recorder,
    stage: str,
    e: Exception,
    output: Any,
) -> TraceError:
    done = [c.module or "<model>" for c in rec.calls if c.done]
    upto = f" Executed modules up to: {done[-1]}." if done else " No module finished."
    try:
        partial = _partial(model, inputs, rec)
    except Exception:  # pragma: no cover - never hide the user's error behind ours
        partial = None
    err = f"{type(e).__name__}: {e}"
    module: str | None = None
    if stage == "forward":
        module = rec.calls[rec.stack[-1]].module if rec.stack else None
        if module == "" and len(rec.calls) == 1 and isinstance(e, TypeError):
            how = (
                "model(**inputs)"
                if isinstance(inputs, dict)
                else "model(*inputs)"
                if isinstance(inputs, (tuple, list))
                else "model(x)"
            )
            msg = (
                f"the model rejected the batch: it was called as {how} with {describe(inputs)} "
                f"and raised {err}"
            )
        else:
            where = module or "<model>"
            mtype = rec.types.get(module or "", "")
            msg = f"{type(e).__name__} in {where} ({mtype}) during the forward pass: {e}.{upto}"
    elif stage == "loss":
        msg = (
            f"the loss function raised {err} (output {describe(output)}, target "
            f"{describe(target)})."
            f"{upto}"
        )
    else:
        grads = [r.module or "<model>" for r in rec.raw if r.phase == "backward"]
        last = f" Gradients computed up to: {grads[-1]}." if grads else ""
        msg = f"{err} during the backward pass.{last}"
    if partial is not None:
        partial.error = msg
    return TraceError(msg, trace=partial, module=module)


def _partial(model: torch.nn.Module, inputs: Any, rec: Recorder) -> Trace:
    events = _events(rec, rec.host_vectors())
    first = next((e for e in events if not e.finite), None)
    return Trace(
        events=events,
        origin=None,
        first_nonfinite=first,
        loss=None,
        params=[],
        model_name=type(model).__name__,
        batch_size=batch_size(inputs),
        n_params=sum(p.numel() for p in model.parameters()),
        batch=describe(inputs),
        module_types=dict(rec.types),
    )


# ---------------------------------------------------------------------- origin
def _resolve(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    rec: Recorder,
    loc: Located,
    events: list[Event],
    out: _Outcome,
    bs: int | None,
) -> Event | None:
    if loc.event is None:
        return None
    modules = dict(model.named_modules())
    finding = OpFinding()
    event_index = loc.event
    phase = rec.raw[loc.event].phase
    try:
        if phase == "forward" and loc.call >= 0:
            cap = rec.calls[loc.call].capture
            if cap is not None:
                st.reset_buffers()
                finding = replay_forward(modules[rec.calls[loc.call].module], cap, loc.kind, bs)
        elif phase == "loss":
            finding = replay_loss(loss_fn, out.output, target, loc.kind, bs)
        elif phase == "backward" and (loc.candidates or loc.call >= 0):
            cands = loc.candidates or [loc.call]
            caps = _capture(model, inputs, target, loss_fn, st, set(cands))
            for c in cands:
                if c not in caps:
                    continue
                st.reset_buffers()
                f = replay_backward(
                    modules[rec.calls[c].module], caps[c][0], caps[c][1], loc.kind, bs
                )
                if f.reproduced:
                    finding = f
                    if c != loc.call:
                        event_index = next(
                            (
                                j
                                for j, r in enumerate(rec.raw)
                                if r.call == c
                                and r.kind == "grad_input"
                                and r.vector is rec.raw[loc.event].vector
                            ),
                            event_index,
                        )
                        loc = dataclasses.replace(loc, call=c)
                    break
    except Exception as e:  # the replay is a diagnosis aid: never fail the trace for it
        finding = OpFinding(note=f"op-level replay failed: {type(e).__name__}: {e}")
    origin = events[event_index]
    if loc.module is not None and loc.module != origin.module:
        origin = dataclasses.replace(
            origin, module=loc.module, module_type=rec.types.get(loc.module, ""), kind=origin.kind
        )
        events_note = (
            f"made by the code of {loc.module or '<model>'} itself, outside its submodules"
        )
        finding.note = "; ".join(x for x in (events_note, finding.note) if x)
    origin.op = finding.op
    origin.source = finding.source
    origin.param = loc.param or origin.param
    if loc.corrupted and not finding.note:
        finding.note = f"the parameter or buffer {loc.param} already held non-finite values"
    origin.note = finding.note
    if not origin.samples and finding.rows:
        origin.samples = finding.rows
    return origin


def _capture(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    calls: set[int],
) -> dict[int, tuple[tuple[Any, Any, Any], dict[str, torch.Tensor]]]:
    """Replay the step once more and copy, for the given module calls, their inputs (and
    the RNG state at the call) and the gradients arriving at their outputs."""
    st.reset_buffers()
    st.clear_grads()
    counter = [0]
    got: dict[int, tuple[tuple[Any, Any, Any], dict[str, torch.Tensor]]] = {}
    stack: list[int] = []

    def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        c = counter[0]
        counter[0] += 1
        stack.append(c)
        if c in calls:
            got[c] = ((clone_structure(args), clone_structure(kwargs), RngState.capture()), {})

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        c = stack.pop()
        if c in got:
            grads = got[c][1]
            for name, t in named_tensors(output, "output"):
                if t.requires_grad:
                    t.register_hook(
                        lambda g, name=name: grads.__setitem__(name, g.detach().clone())
                    )

    with HookSet() as hooks, torch.enable_grad():
        for m in hookable_modules(model):
            hooks.add(m.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.add(m.register_forward_hook(post, with_kwargs=True))
        output = call_model(model, inputs)
        loss = compute_loss(output, target, loss_fn)
        _backward(loss, st, inputs)
    return got


# ---------------------------------------------------------------------- results
def _events(rec: Recorder, vectors: list[np.ndarray]) -> list[Event]:
    events = []
    for i, (r, (stats, hist)) in enumerate(zip(rec.raw, finalize_many(vectors))):
        events.append(
            Event(
                index=i,
                phase=r.phase,
                module=r.module,
                kind=r.kind,
                name=r.name,
                shape=r.shape,
                dtype=r.dtype,
                stats=stats,
                hist=hist,
                samples=list(r.samples),
                call=r.call,
                depth=r.depth,
                module_type=r.module_type,
                param=r.param,
            )
        )
    return events


@dataclasses.dataclass
class _ParamHealth:
    norms: dict[int, float]
    counts: dict[int, tuple[int, int]]
    bad: dict[str, list[str]]  # module -> its non-finite parameters and buffers

    @classmethod
    def measure(cls, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> _ParamHealth:
        tensors: list[tuple[str, str, torch.Tensor, bool]] = []
        for mname, m in model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                tensors.append((mname, qualified_name(mname, pname), p, True))
            for bname, b in m.named_buffers(recurse=False):
                if b is not None and (b.is_floating_point() or b.is_complex()):
                    tensors.append((mname, qualified_name(mname, bname), b, False))
        norms: dict[int, float] = {}
        counts: dict[int, tuple[int, int]] = {}
        bad: dict[str, list[str]] = {}
        if not tensors:
            return cls(norms, counts, bad)
        values = fused_norms([t.detach() for _, _, t, _ in tensors])
        for (mname, qual, t, _), n in zip(tensors, values):
            norms[id(t)] = float(n)
            if not np.isfinite(n):
                s = tensor_stats(t)
                counts[id(t)] = (s.n_nan, s.n_inf)
                if s.n_nan or s.n_inf:
                    bad.setdefault(mname, []).append(qual)
        return cls(norms, counts, bad)


def _result(
    model: torch.nn.Module,
    inputs: Any,
    rec: Recorder,
    events: list[Event],
    origin: Event | None,
    out: _Outcome,
    health: _ParamHealth,
) -> Trace:
    grads = {e.param: e for e in events if e.kind == "param_grad"}
    params: list[ParamInfo] = []
    seen: set[int] = set()
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            qual = qualified_name(mname, pname)
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = grads.get(qual)
            n_nan, n_inf = health.counts.get(id(p), (0, 0))
            params.append(
                ParamInfo(
                    name=qual,
                    module=mname,
                    shape=tuple(p.shape),
                    dtype=dtype_name(p.dtype),
                    requires_grad=p.requires_grad,
                    norm=health.norms.get(id(p), float("nan")),
                    grad_norm=None if g is None else g.stats.norm,
                    n_nan=n_nan,
                    n_inf=n_inf,
                    grad_n_nan=0 if g is None else g.stats.n_nan,
                    grad_n_inf=0 if g is None else g.stats.n_inf,
                )
            )
    first = next((e for e in events if not e.finite), None)
    if origin is None and first is None and health.bad:
        # corrupted weights that no event saw (e.g. an unused parameter)
        names = sorted(n for group in health.bad.values() for n in group)
        out.notes.append(f"non-finite parameters or buffers: {names}")
    return Trace(
        events=events,
        origin=origin,
        first_nonfinite=first,
        loss=out.loss,
        params=params,
        model_name=type(model).__name__,
        batch_size=batch_size(inputs),
        n_params=sum(p.numel() for p in model.parameters()),
        batch=describe(inputs),
        module_types=dict(rec.types),
        notes=out.notes,
    )
