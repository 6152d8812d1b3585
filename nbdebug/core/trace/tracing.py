"""``nbdebug.trace()``: one forward + backward, recorded module by module.

The common case costs one quick pass: module hooks keep statistics on the device and the
host reads them once. Only when that pass saw a NaN/Inf does the trace replay the same
step (same buffers, same RNG) in exact mode to count NaN/Inf element-wise, find the batch
rows and the module that produced the value (:mod:`.locate`, intended masks set aside),
and then replays that one module, on its inputs as they were at the call, at the level of
torch operations to name the root op, its source line and the chain to the first NaN
(:mod:`.replay`). The events are built once, the origin's fields with them.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from ..batch import LossFn, check_inputs, check_loss_fn, check_materialized, check_model
from ..state import PreservedState, preserved
from ..stats import all_quick_complete
from ..text import fmt_bytes
from .assemble import Outcome, build_events, build_result
from .call import Amp, StepCall
from .failure import rerun_error
from .passes import detached, run_pass
from .recorder import Recorder, select_modules
from .records import RecordOptions
from .result import Trace, TraceError
from .search import find_origin
from .weights import WeightHealth, owned_weights

__all__ = ["trace", "trace_step"]


def trace(
    model: torch.nn.Module,
    inputs: object,
    target: object = None,
    loss_fn: LossFn | None = None,
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
    inputs: object,
    target: object = None,
    loss_fn: LossFn | None = None,
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
    inputs: object,
    target: object,
    loss_fn: LossFn | None,
    modules: str | Sequence[str] | None,
    keep: str | Sequence[str] | None,
    amp: Amp,
) -> Trace:
    model = check_model(model)
    check_materialized(model.named_modules())
    call = StepCall(model, check_inputs(inputs), detached(target), check_loss_fn(loss_fn), amp)
    kept = select_modules(model, keep, "keep")
    chosen = select_modules(model, modules, "modules")
    if chosen is not None and kept:
        chosen |= kept
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "trace() runs a backward pass, which torch.inference_mode() forbids: call it "
            "outside the inference_mode block."
        )
    keep_set = frozenset(kept or ())
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
        hold = False  # the quick pass held gradients: so does the exact pass
        if not health.bad:
            quick = RecordOptions(
                modules=None if chosen is None else frozenset(chosen), keep=keep_set
            )
            rec, out = run_pass(call, st, quick)
            written = st.keep_written()
            vectors = rec.host_vectors()
            if all_quick_complete(vectors) and rec.split_grads():
                rec, out = _holding(call, st, quick, (rec, out))
                vectors = rec.host_vectors()
            if all_quick_complete(vectors):
                events, _ = build_events(rec, vectors)
                out.notes += _written_note(written)
                return _with_kept(build_result(call, rec, events, None, out, health), rec.kept)
            # something is not finite (or overflowed float32 sums): replay the step exactly
            first_loss, hold = out.loss, rec.hold or rec.split_grads()
            st.reset_buffers()
        # (a parameter or buffer that is already non-finite makes the step need the exact
        # pass: the quick one is skipped)
        exact = RecordOptions(True, True, keep=keep_set, hold=hold)
        return _exact(call, st, health, exact, first_loss, written)


def _exact(
    call: StepCall,
    st: PreservedState,
    health: WeightHealth,
    options: RecordOptions,
    first_loss: float | None,
    written: list[str],
) -> Trace:
    """The exact pass and the origin search (the quick pass gave ``first_loss`` and saw
    the buffers ``written``; none ran when a weight was already non-finite)."""
    try:
        rec, out = run_pass(call, st, options)
        if health.bad:  # the exact pass was the step's first forward
            written = st.keep_written()
        rec, out = _holding(call, st, options, (rec, out))
    except TraceError as e:
        if health.bad:  # this was the step's first run: the model's own error
            raise
        raise rerun_error(e) from e.__cause__
    vectors = rec.host_vectors()
    out.notes += _written_note(written)
    unreplayed = _not_replayed_note(first_loss, out.loss)
    out.notes += unreplayed
    found = find_origin(call, st, rec, health.bad, out)
    events, origin = build_events(rec, vectors, found)
    tr = build_result(call, rec, events, origin, out, health, found)
    if unreplayed:
        tr.unreplayed_loss = first_loss
    return _with_kept(tr, rec.kept)


def _holding(
    call: StepCall, st: PreservedState, options: RecordOptions, ran: tuple[Recorder, Outcome]
) -> tuple[Recorder, Outcome]:
    """The pass ``ran``, or, when it saw a parameter's gradient accumulated more than once
    without holding gradients (:meth:`.recorder.Recorder.split_grads`), the same pass run
    again holding them (after the buffers and RNG are put back, as for any replay)."""
    if not ran[0].split_grads():
        return ran
    st.reset_buffers()
    return run_pass(call, st, dataclasses.replace(options, hold=True))


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
