"""Errors of a traced step, told the torchinfo way: where it failed and what had run."""

from __future__ import annotations

import torch

from ..batch import describe
from ..vocab import Phase
from .assemble import partial_trace
from .call import StepCall
from .recorder import Recorder
from .result import TraceError

__all__ = ["raising_module", "rerun_error", "trace_error"]


def trace_error(
    call: StepCall, rec: Recorder, stage: Phase, e: Exception, output: object
) -> TraceError:
    """The ``TraceError`` of a pass that raised in ``stage`` (forward, loss or backward),
    with the partial trace and the modules that had run."""
    try:
        partial = partial_trace(call, rec)
    except Exception:  # pragma: no cover - never hide the user's error behind ours
        partial = None
    module: str | None = None
    if stage == Phase.FORWARD:
        module = rec.calls[rec.stack[-1]].module if rec.stack else None
        if rec.modules is not None:  # the module that raised may not be one recorded
            module = raising_module(call.model, e) or module
        msg = _forward_message(call, rec, module, e)
    elif stage == Phase.LOSS:
        msg = (
            f"the loss function raised {type(e).__name__}: {e} (output {describe(output)}, "
            f"target {describe(call.target)}).{_executed(rec)}"
        )
    else:
        # the columns: no event object is needed for this
        grads = [m for m, p in zip(rec.raw.modules(), rec.raw.phases()) if p == Phase.BACKWARD]
        last = f" Gradients computed up to: {grads[-1] or '<model>'}." if grads else ""
        msg = f"{type(e).__name__}: {e} during the backward pass.{last}"
    if partial is not None:
        partial.error = msg
    return TraceError(msg, trace=partial, module=module)


def _executed(rec: Recorder) -> str:
    """``" Executed modules up to: encoder.layers.2."``"""
    done = [c.module or "<model>" for c in rec.calls if c.done]
    if rec.modules is None:
        return f" Executed modules up to: {done[-1]}." if done else " No module finished."
    # only the modules= ones were followed
    if done:
        return f" Recorded modules (modules=) executed up to: {done[-1]}."
    return " No recorded module (modules=) had finished."


def _forward_message(call: StepCall, rec: Recorder, module: str | None, e: Exception) -> str:
    if module == "" and len(rec.calls) == 1 and isinstance(e, TypeError):
        inputs = call.inputs
        how = (
            "model(**inputs)"
            if isinstance(inputs, dict)
            else "model(*inputs)"
            if isinstance(inputs, (tuple, list))
            else "model(x)"
        )
        return (
            f"the model rejected the batch: it was called as {how} with {describe(inputs)} "
            f"and raised {type(e).__name__}: {e}"
        )
    where = module or "<model>"
    mtype = rec.types.get(module or "", "")
    return f"{type(e).__name__} in {where} ({mtype}) during the forward pass: {e}.{_executed(rec)}"


def raising_module(model: torch.nn.Module, e: BaseException) -> str | None:
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


def rerun_error(e: TraceError) -> TraceError:
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
