"""``nbdebug.trace()``: one forward + backward, recorded module by module.

The common case costs one quick pass: module hooks keep statistics on the device and the
host reads them once. Only when that pass saw a NaN/Inf does the trace replay the same
step (same buffers, same RNG) in exact mode to count NaN/Inf element-wise, find the batch
rows and the module that produced the value (:mod:`.origin`, intended masks set aside),
and then replays that one module, on its inputs as they were at the call, at the level of
torch operations to name the root op, its source line and the chain to the first NaN
(:mod:`.origin_ops`). The events are built once, the origin's fields with them.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from .batch import (
    LossError,
    batch_size,
    call_model,
    check_inputs,
    check_loss_fn,
    check_materialized,
    check_model,
    compute_loss,
    describe,
    named_tensors,
)
from .capture import CallCapture, copy_arguments
from .events import Chain, Event, ParamInfo
from .hooks import HookSet, hookable_modules
from .origin import Located, MaskInfo, batch_masks, inf_count, locate, nan_count
from .origin_ops import OpFinding, replay_backward, replay_forward, replay_loss
from .recorder import RawEvent, Recorder, select_modules
from .result import Trace, TraceError
from .state import AutocastState, PreservedState, preserved
from .stats import all_quick_complete, finalize_many
from .text import dtype_name, fmt_bytes, qualified_name
from .weights import WeightHealth, owned_weights

__all__ = ["Trace", "TraceError", "trace", "trace_step"]

#: a context manager factory a pass's forward and loss run in (a recorded step's autocast)
Amp = Callable[[], AbstractContextManager[Any]]


def trace(
    model: torch.nn.Module,
    inputs: Any,
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    *,
    modules: str | Sequence[str] | None = None,
    keep: str | Sequence[str] | None = None,
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
        Passed to ``loss_fn(output, target)``; its tensors are recorded after the batch's
        (``phase="input"``, ``kind="target"``), so a NaN label is found as a bad batch.
    loss_fn : callable, optional
        ``loss_fn(output, target)`` or ``loss_fn(output)``. Without it the loss is
        ``output["loss"]``, ``output.loss`` or the output itself when it is a scalar.

    modules : str or sequence of str, optional
        Record only the modules whose names match one of these ``fnmatch`` patterns
        (``"transformer.h.3.*"``; a pattern ending in ``.*`` also matches the module it
        names), with their parameters' gradients; the batch and the loss are always
        recorded. For very large models. When the step holds a NaN/Inf, the exact pass
        that locates the origin still records every module.
    keep : str or sequence of str, optional
        Keep a detached copy of the outputs of the modules matching these patterns in
        ``Trace.kept`` (for the detail view; opt-in: these copies are the only tensors a
        trace keeps, and their size is in ``Trace.kept_bytes`` and the notes). Kept
        modules are recorded even when ``modules`` does not name them.

    Returns
    -------
    Trace
        ``.events``, ``.origin`` (where the first NaN/Inf was produced), ``.loss``,
        ``.to_frame()``, ``.params_frame()``.

    Raises
    ------
    TypeError, ValueError
        For a non-module model, a model on the meta device, an empty or malformed batch, a
        loss_fn that is not callable, no loss or a non-scalar loss.
    RuntimeError
        Inside ``torch.inference_mode()``, where no backward can run.
    TraceError
        When the model, the loss function or the backward raises; carries the partial
        trace (``err.trace``) and chains the original exception.

    Examples
    --------
    >>> tr = nbdebug.trace(model, x, target=y, loss_fn=F.cross_entropy)
    >>> tr.origin.module, tr.origin.op, tr.origin.source, tr.origin.samples
    ('norm', 'Tensor.__truediv__', 'model.py:12', [3])
    """
    return _traced(model, inputs, target, loss_fn, modules, keep, nullcontext)


def trace_step(
    model: torch.nn.Module,
    inputs: Any,
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    *,
    forward: Amp = nullcontext,
    backward: Amp = nullcontext,
) -> Trace:
    """:func:`trace` of a recorded training step: every pass runs its forward and its
    loss inside ``forward()`` and its backward inside ``backward()`` (a step's autocast
    state: a training loop runs the backward after the ``torch.autocast`` block, and on
    CPU a backward inside the block runs its matmuls in the half type too). The op-level
    replays of the origin take the state their call ran in."""
    with backward():
        return _traced(model, inputs, target, loss_fn, None, None, forward)


def _traced(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[..., Any] | None,
    modules: str | Sequence[str] | None,
    keep: str | Sequence[str] | None,
    amp: Amp,
) -> Trace:
    model = check_model(model)
    check_materialized(model.named_modules())
    check_inputs(inputs)
    check_loss_fn(loss_fn)
    bs = batch_size(inputs)
    kept_names = select_modules(model, keep, "keep")
    chosen = select_modules(model, modules, "modules")
    if chosen is not None and kept_names:
        chosen |= kept_names
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "trace() runs a backward pass, which torch.inference_mode() forbids: call it "
            "outside the inference_mode block."
        )
    with _gc_paused(), preserved(model) as st:
        if any(p.is_meta for p in st.params):
            raise ValueError(
                "the model's parameters are on the meta device (shapes without values): "
                "expected a model with its weights, e.g. after model.to_empty(device=...) and "
                "loading a state dict."
            )
        health = WeightHealth.measure(owned_weights(st.modules))
        written: list[str] = []
        first_loss: float | None = None  # the quick pass's, when the exact pass follows
        if not health.bad:
            rec, out = _run(
                model,
                inputs,
                target,
                loss_fn,
                st,
                amp,
                exact=False,
                modules=chosen,
                keep=kept_names,
            )
            written = st.keep_written()
            vectors = rec.host_vectors()
            if all_quick_complete(vectors):
                events, _ = _events(rec, vectors)
                out.notes += _written_note(written)
                return _with_kept(_result(model, inputs, rec, events, None, out, health), rec.kept)
            # something is not finite (or overflowed float32 sums): replay the step exactly
            first_loss = out.loss
            st.reset_buffers()
        # (a parameter or buffer that is already non-finite makes the step need the exact
        # pass: the quick one is skipped)
        try:
            rec, out = _run(
                model, inputs, target, loss_fn, st, amp, exact=True, capture=True, keep=kept_names
            )
        except TraceError as e:
            if health.bad:  # this was the step's first run: the model's own error
                raise
            raise _rerun_error(e) from e.__cause__
        vectors = rec.host_vectors()
        if health.bad:  # the exact pass was the step's first forward
            written = st.keep_written()
        out.notes += _written_note(written)
        unreplayed = _not_replayed_note(first_loss, out.loss)
        out.notes += unreplayed
        found = _find_origin(model, inputs, target, loss_fn, st, amp, rec, health.bad, out, bs)
        events, origin = _events(rec, vectors, found)
        tr = _result(model, inputs, rec, events, origin, out, health, found)
        if unreplayed:
            tr.unreplayed_loss = first_loss
        return _with_kept(tr, rec.kept)


def _not_replayed_note(first: float | None, exact: float | None) -> list[str]:
    """A step whose first pass gave a non-finite loss and whose exact pass (run again on
    the same batch, buffers and RNG) a finite one: its forward does not replay."""
    if first is None or exact is None or math.isfinite(first) or not math.isfinite(exact):
        return []
    return [
        f"the step's first pass gave a non-finite loss ({first}), but the exact pass that "
        f"locates the origin, run again on the same batch, buffers and RNG, gave {exact:.6g}: "
        "the forward depends on state outside its inputs (a call counter, a cache, a "
        "non-deterministic kernel), so the NaN/Inf is not in these events and no origin is "
        "named"
    ]


def _written_note(names: list[str]) -> list[str]:
    if not names:
        return []
    return [
        f"the model's forward writes {', '.join(names)} in place: left as one forward leaves "
        "it (the passes after the first started from that value)"
    ]


def _with_kept(tr: Trace, kept: dict[str, torch.Tensor]) -> Trace:
    if kept:
        tr.kept = kept
        tr.notes.append(
            f"kept {len(kept)} activation tensor{'s' if len(kept) != 1 else ''} (keep=): "
            f"{fmt_bytes(tr.kept_bytes)}"
        )
    return tr


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
    autocast: AutocastState = dataclasses.field(
        default_factory=AutocastState
    )  # the loss's, for its replay


def _run(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    amp: Amp,
    *,
    exact: bool,
    capture: bool = False,
    modules: set[str] | None = None,
    keep: set[str] | None = None,
) -> tuple[Recorder, _Outcome]:
    rec = Recorder(
        model,
        exact=exact,
        batch_size=batch_size(inputs),
        capture=capture,
        modules=modules,
        keep=keep,
        walk=st.modules,
    )
    st.clear_grads()
    outcome = _Outcome(None)
    stage = "forward"
    output: Any = None
    with HookSet() as hooks:
        rec.install(hooks, st.params)
        try:
            batch = _fresh(inputs)
            rec.record_batch(batch, target)
            with torch.enable_grad():
                with amp():
                    output = call_model(model, batch)
                    stage = "loss"
                    loss = compute_loss(output, target, loss_fn)
                    outcome.autocast = AutocastState.capture()
                rec.record_loss(loss)
                outcome.loss = float(loss.detach().float().cpu())
                if exact:
                    # the object the model returned (a ModelOutput stays one: loss_fn may
                    # read out.logits), its tensors copied
                    outcome.output = copy_arguments(output)
                # the output is not needed past the loss: holding it through the backward
                # would keep what autograd frees as it goes (logits, a key/value cache)
                output = None
                stage = "backward"
                rec.recomputing = True
                note = _backward(loss, st)
                if note:
                    outcome.notes.append(note)
        except LossError:
            raise
        except Exception as e:
            raise _trace_error(model, inputs, target, rec, stage, e, output) from e
    return rec, outcome


def _fresh(inputs: Any) -> Any:
    """The batch for one pass: clones of its tensors (leaves of their own that require grad
    where the user's do) and a copy of any other object in it (a cache the model extends in
    place). So every pass starts from the batch as the user gave it, even when the forward
    changes its batch in place; the backward stops at the batch, leaving the user's
    tensors' ``.grad`` and any graph behind them (a batch computed by another model)
    untouched; and the user's objects are never changed."""
    return copy_arguments(inputs, clone_tensors=True, leaves=True)


def _backward(loss: torch.Tensor, st: PreservedState) -> str:
    """``loss.backward()`` without leaving a trace on the user's tensors: the parameters'
    ``.grad`` were detached by :meth:`PreservedState.clear_grads` (and are put back on
    exit), and the batch is the pass's own (:func:`_fresh`). A plain ``backward()``
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
    loss.backward()
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
    if rec.modules is None:
        upto = f" Executed modules up to: {done[-1]}." if done else " No module finished."
    else:  # only the modules= ones were followed
        upto = (
            f" Recorded modules (modules=) executed up to: {done[-1]}."
            if done
            else " No recorded module (modules=) had finished."
        )
    try:
        partial = _partial(model, inputs, rec)
    except Exception:  # pragma: no cover - never hide the user's error behind ours
        partial = None
    err = f"{type(e).__name__}: {e}"
    module: str | None = None
    if stage == "forward":
        module = rec.calls[rec.stack[-1]].module if rec.stack else None
        if rec.modules is not None:  # the module that raised may not be one recorded
            module = _raising_module(model, e) or module
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


def _raising_module(model: torch.nn.Module, e: BaseException) -> str | None:
    """The name of the innermost module of ``model`` whose code is in the traceback of
    ``e`` (found from the frames' ``self``), or None."""
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    tb = e.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _rerun_error(e: TraceError) -> TraceError:
    """The forward ran once, but failed when run again for the exact pass: say so (the
    model is not broken, it cannot be replayed)."""
    msg = (
        "the step ran once and needed nbdebug's exact pass (a NaN/Inf, or values beyond "
        "float32's range), but the model failed when run again for it (a forward that "
        "consumes state outside its inputs, such as a list it pops from, cannot be "
        f"replayed); the second run raised: {e}"
    )
    if e.trace is not None:
        e.trace.error = msg
    return TraceError(msg, trace=e.trace, module=e.module)


def _partial(model: torch.nn.Module, inputs: Any, rec: Recorder) -> Trace:
    events, _ = _events(rec, rec.host_vectors())
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
@dataclasses.dataclass
class _Found:
    """The origin, decided before any event is built."""

    event: int  # index into the raw events (-1: no origin, only masks to report)
    module: str | None = None  # the producing module, when not the event's own
    op: str | None = None
    source: str | None = None
    chain: Chain = dataclasses.field(default_factory=Chain)
    note: str = ""
    param: str | None = None
    rows: list[int] = dataclasses.field(default_factory=list)
    masks: list[str] = dataclasses.field(default_factory=list)
    mask_events: list[int] = dataclasses.field(default_factory=list)  # batch tensors


_MAX_MASK_ROUNDS = 8


def _find_origin(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    amp: Amp,
    rec: Recorder,
    bad_params: dict[str, list[str]],
    out: _Outcome,
    bs: int | None,
) -> _Found | None:
    """The module-level rules, then the op-level replay of the one module they name. A
    module whose non-finite output the replay shows to be an intended mask is set aside
    and the rules are applied again."""
    masks = batch_masks(rec)
    batch_texts = {i: _batch_mask_text(rec.raw[i], t) for i, t in _mask_tensors(rec, masks, inputs)}
    texts = list(batch_texts.values())
    unmasked = ""
    modules = dict(model.named_modules())
    for round_ in range(_MAX_MASK_ROUNDS):
        loc = locate(rec, bad_params, masks)
        if loc.event is None:
            break
        fed = masks.fed_to_backward(rec, loc)
        if fed:
            masks.unmask(rec, fed)
            texts = [batch_texts[i] for i in masks.batch if i in batch_texts]
            module = rec.calls[loc.call].module or "<model>"
            names = ", ".join(f"`{rec.raw[i].name}`" for i in fed)
            made = "NaN" if loc.kind == "nan" else "Inf"
            unmasked = (
                f"the Inf in {names} did not reach the model's output, but the backward of "
                f"{module} turns it into {made}: bad data, not a mask"
            )
            continue
        event_index = loc.event
        try:
            finding, event_index, loc = _replay(
                modules, inputs, target, loss_fn, st, amp, rec, loc, masks, out, bs, model
            )
        except Exception as e:  # the replay is a diagnosis aid: never fail the trace for it
            finding = OpFinding(note=_failed_note(rec, loc, e))
        if finding.mask and round_ < _MAX_MASK_ROUNDS - 1:
            call = rec.calls[loc.call]
            masks.slots.update(call.output_slots)
            masks.slots.add(rec.raw[event_index].slot)
            texts.append(f"{call.module or '<model>'} outputs infinite values used as a mask")
            continue
        found = _found(rec, loc, event_index, finding, texts)
        found.note = "; ".join(x for x in (unmasked, found.note) if x)
        found.mask_events = [i for i in masks.batch if i in batch_texts]
        return found
    batch = [i for i in masks.batch if i in batch_texts]
    return _Found(event=-1, masks=texts, mask_events=batch) if texts else None


def _replay(
    modules: dict[str, torch.nn.Module],
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    amp: Amp,
    rec: Recorder,
    loc: Located,
    masks: MaskInfo,
    out: _Outcome,
    bs: int | None,
    model: torch.nn.Module,
) -> tuple[OpFinding, int, Located]:
    event_index = loc.event
    assert event_index is not None
    phase = rec.raw[event_index].phase
    if phase == "forward" and loc.call >= 0:
        call = rec.calls[loc.call]
        if call.capture is None:
            return OpFinding(note=_NOT_RECORDED.format(call.module or "<model>")), event_index, loc
        st.reset_buffers()
        f = replay_forward(
            modules[call.module], call.capture, loc.kind, bs, masks.mask_inputs(rec, loc.call)
        )
        return _checked(f, rec, loc.call), event_index, loc
    if phase == "loss":
        f = replay_loss(loss_fn, out.output, target, loc.kind, bs, out.autocast)
        return f, event_index, loc
    if phase == "backward" and (loc.candidates or loc.call >= 0):
        cands = loc.candidates or [loc.call]
        caps = _capture(model, inputs, target, loss_fn, st, amp, set(cands))
        for c in cands:
            if c not in caps:
                continue
            st.reset_buffers()
            f = replay_backward(modules[rec.calls[c].module], caps[c][0], caps[c][1], loc.kind, bs)
            if f.reproduced:
                if c != loc.call:
                    event_index = next(
                        (
                            j
                            for j, r in enumerate(rec.raw)
                            if r.call == c
                            and r.kind == "grad_input"
                            and r.vector is rec.raw[event_index].vector
                        ),
                        event_index,
                    )
                    loc = dataclasses.replace(loc, call=c)
                return f, event_index, loc
    return OpFinding(), event_index, loc


def _failed_note(rec: Recorder, loc: Located, e: Exception) -> str:
    what = "the loss function"
    if loc.call >= 0:
        what = rec.calls[loc.call].module or "<model>"
    return (
        f"op-level replay failed: {what} raised {type(e).__name__}: {e} when run again on "
        "its inputs as recorded at the call (a forward with side effects or state outside "
        "its inputs cannot be replayed), so no operation is named."
    )


_NOT_RECORDED = (
    "op-level replay skipped: the inputs of {} were not recorded (they already held NaN), "
    "so the operation is not named."
)


def _checked(f: OpFinding, rec: Recorder, call: int) -> OpFinding:
    """A replay that does not give the recorded output names no operation: the forward
    depends on something besides its inputs (state its first run changed, a closure over
    external state), so an op found on other values could be the wrong one."""
    vecs = [rec.raw[e].vector for e in rec.calls[call].output_events]
    recorded = (int(sum(nan_count(v) for v in vecs)), int(sum(inf_count(v) for v in vecs)))
    if f.counts == recorded or f.mask:
        return f
    module = rec.calls[call].module or "<model>"
    return OpFinding(
        note=(
            f"op-level replay inconclusive: {module} run again on its recorded inputs gave "
            f"{f.counts[0]} NaN / {f.counts[1]} Inf where the traced pass had {recorded[0]} / "
            f"{recorded[1]}; its forward depends on state outside its inputs (a counter, a "
            "closure, a global), so no operation is named."
        )
    )


def _found(
    rec: Recorder, loc: Located, event_index: int, finding: OpFinding, masks: list[str]
) -> _Found:
    note = finding.note
    module = None
    if loc.module is not None and loc.module != rec.raw[event_index].module:
        module = loc.module
        own = f"made by the code of {loc.module or '<model>'} itself, outside its submodules"
        note = "; ".join(x for x in (own, note) if x)
    if loc.corrupted and not note:
        note = f"the parameter or buffer {loc.param} already held non-finite values"
    return _Found(
        event=event_index,
        module=module,
        op=finding.op,
        source=finding.source,
        chain=finding.chain,
        note=note,
        param=loc.param,
        rows=list(finding.rows),
        masks=masks,
    )


def _mask_tensors(rec: Recorder, masks: MaskInfo, inputs: Any) -> list[tuple[int, torch.Tensor]]:
    prefix = "x" if isinstance(inputs, torch.Tensor) else "inputs"
    tensors = dict(named_tensors(inputs, prefix))
    return [(i, tensors[rec.raw[i].name]) for i in masks.batch if rec.raw[i].name in tensors]


def _batch_mask_text(r: RawEvent, t: torch.Tensor) -> str:
    name = r.name
    if name.startswith("inputs[") and name.endswith("]"):
        name = name[len("inputs[") : -1].strip("'\"")
    neg, pos = bool(torch.isneginf(t).any()), bool(torch.isposinf(t).any())
    value = "-inf and +inf" if neg and pos else "-inf" if neg else "+inf"
    return f"batch holds {value} in `{name}`, used as a mask"


def _capture(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    st: PreservedState,
    amp: Amp,
    calls: set[int],
) -> dict[int, tuple[CallCapture, dict[str, torch.Tensor]]]:
    """Replay the step once more and copy, for the given module calls, their inputs as
    at the call (and the RNG state then) and the gradients arriving at their outputs."""
    st.reset_buffers()
    st.clear_grads()
    counter = [0]
    got: dict[int, tuple[CallCapture, dict[str, torch.Tensor]]] = {}
    stack: list[int] = []
    hooks = HookSet()  # the module hooks and the tensor hooks on outputs

    def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        c = counter[0]
        counter[0] += 1
        stack.append(c)
        if c in calls:
            got[c] = (CallCapture.take(args, kwargs), {})

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        c = stack.pop()
        if c in got:
            grads = got[c][1]
            for name, t in named_tensors(output, "output"):
                if t.requires_grad:
                    hooks.tensor_hook(
                        t, lambda g, name=name: grads.__setitem__(name, g.detach().clone())
                    )

    with hooks, torch.enable_grad():
        for m in hookable_modules(model):
            # as the recorder: inputs before the user's pre-hooks, which the replay of
            # ``module(*args)`` runs again
            hooks.add(m.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            hooks.add(m.register_forward_hook(post, with_kwargs=True))
        with amp():
            output = call_model(model, _fresh(inputs))
            loss = compute_loss(output, target, loss_fn)
        _backward(loss, st)
    return got


# ---------------------------------------------------------------------- results
def _events(
    rec: Recorder, vectors: np.ndarray, found: _Found | None = None
) -> tuple[list[Event], Event | None]:
    """Every event, built once; the origin's op, source, chain and note are part of its
    construction. When the producing module is not the event's own (a parent's code),
    the origin is its own record with the same index."""
    events = []
    origin: Event | None = None
    for i, (r, (stats, hist)) in enumerate(zip(rec.raw, finalize_many(vectors))):
        if found is not None and i == found.event >= 0:
            extra = {
                "op": found.op,
                "source": found.source,
                "chain": found.chain,
                "note": found.note,
                "param": found.param or r.param,
            }
            samples = list(r.samples) or list(found.rows)
            if found.module is None:
                origin = _event(i, r, stats, hist, samples=samples, **extra)
                events.append(origin)
                continue
            origin = _event(
                i,
                r,
                stats,
                hist,
                samples=samples,
                module=found.module,
                module_type=rec.types.get(found.module, ""),
                **extra,
            )
        events.append(_event(i, r, stats, hist))
    return events, origin


def _event(i: int, r: RawEvent, stats: Any, hist: Any, **fields: Any) -> Event:
    return Event(
        index=i,
        phase=r.phase,
        module=fields.pop("module", r.module),
        kind=r.kind,
        name=r.name,
        shape=r.shape,
        dtype=r.dtype,
        stats=stats,
        hist=hist,
        samples=fields.pop("samples", None) or list(r.samples),
        call=r.call,
        depth=r.depth,
        module_type=fields.pop("module_type", r.module_type),
        param=fields.pop("param", r.param),
        **fields,
    )


def _result(
    model: torch.nn.Module,
    inputs: Any,
    rec: Recorder,
    events: list[Event],
    origin: Event | None,
    out: _Outcome,
    health: WeightHealth,
    found: _Found | None = None,
) -> Trace:
    grads = {e.param: e for e in events if e.kind == "param_grad"}
    params: list[ParamInfo] = []
    seen: set[int] = set()
    n_params = 0
    for mname, m in rec.walk:
        for pname, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            n_params += p.numel()
            qual = qualified_name(mname, pname)
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
        n_params=n_params,
        batch=describe(inputs),
        module_types=dict(rec.types),
        notes=out.notes + (found.masks if found is not None else []),
        masks=list(found.masks) if found is not None else [],
        mask_events=list(found.mask_events) if found is not None else [],
    )
