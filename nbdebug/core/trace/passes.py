"""The passes of a trace over its :class:`.call.StepCall`.

:func:`run_pass` runs the step
once with a :class:`.recorder.Recorder`'s hooks; :func:`capture_calls` runs it once more
to copy the inputs and incoming gradients of a few module calls for the backward replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..batch import Batch, LossError, call_model, compute_loss, named_tensors
from ..state import AutocastState, PreservedState
from ..vocab import Phase
from .assemble import Outcome
from .call import StepCall
from .capture import CallCapture, copy_arguments
from .failure import trace_error
from .hooks import HookSet, hookable_modules
from .recorder import Recorder
from .records import Args, Kwargs, RecordOptions

__all__ = ["Captured", "capture_calls", "detached", "fresh", "run_backward", "run_pass"]


def run_pass(
    call: StepCall, st: PreservedState, options: RecordOptions
) -> tuple[Recorder, Outcome]:
    """Run the step once under a recorder's hooks; a failure raises a ``TraceError`` that
    carries the partial trace."""
    rec = Recorder(call.model, options, batch_size=call.batch_size, walk=st.modules)
    st.clear_grads()
    outcome = Outcome(None)
    stage = Phase.FORWARD
    output: object = None
    with HookSet() as hooks:
        rec.install(hooks, st.params)
        try:
            batch = fresh(call.inputs)
            rec.record_batch(batch, call.target)
            with torch.enable_grad():
                with call.autocast():
                    output = call_model(call.model, batch)
                    stage = Phase.LOSS
                    loss = compute_loss(output, call.target, call.loss_fn)
                    outcome.autocast = AutocastState.capture()
                rec.record_loss(loss)
                outcome.loss = float(loss.detach().float().cpu())
                if options.exact:
                    # the object the model returned (a ModelOutput stays one: loss_fn may
                    # read out.logits), its tensors copied
                    outcome.output = copy_arguments(output)
                # the output is not needed past the loss: holding it through the backward
                # would keep what autograd frees as it goes (logits, a key/value cache)
                output = None
                stage = Phase.BACKWARD
                rec.recomputing = True
                note = run_backward(loss, st)
                rec.finish_backward()
                if note:
                    outcome.notes.append(note)
        except LossError:
            raise
        except Exception as e:
            raise trace_error(call, rec, stage, e, output) from e
    return rec, outcome


def fresh(inputs: Batch) -> Batch:
    """The batch for one pass: clones of its tensors (leaves of their own that require grad
    where the user's do) and a copy of any other object in it (a cache the model extends in
    place). So every pass starts from the batch as the user gave it, even when the forward
    changes its batch in place; the backward stops at the batch, leaving the user's
    tensors' ``.grad`` and any graph behind them (a batch computed by another model)
    untouched; and the user's objects are never changed."""
    copied: Batch = copy_arguments(inputs, clone_tensors=True, leaves=True)
    return copied


def detached(target: object) -> object:
    """The target as every pass and replay uses it: cut from any graph behind it (a
    target computed by another model without ``no_grad``, as in distillation), so the
    backward neither reaches that model's ``.grad`` nor frees its graph, and never writes
    a ``.grad`` of the user's own. A tensor is detached (same storage, no copy); a
    container holding one that requires grad is copied with its tensors detached clones
    (:func:`.capture.copy_arguments`); anything else is passed as it is."""
    if isinstance(target, torch.Tensor):
        return target.detach() if target.requires_grad else target
    if any(t.requires_grad for _, t in named_tensors(target)):
        return copy_arguments(target)
    return target


def run_backward(loss: torch.Tensor, st: PreservedState) -> str:
    """``loss.backward()`` without leaving a trace on the user's tensors: the parameters'
    ``.grad`` were detached by :meth:`PreservedState.clear_grads` (and are put back on
    exit), the batch is the pass's own (:func:`fresh`) and the target cut from its graph
    (:func:`detached`, when the trace starts). A plain ``backward()``
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


#: a module call's inputs as at the call, and the gradients that reached its outputs
Captured = tuple[CallCapture, dict[str, torch.Tensor]]


def capture_calls(call: StepCall, st: PreservedState, calls: set[int]) -> dict[int, Captured]:
    """Replay the step once more and copy, for the given module calls, their inputs as
    at the call (and the RNG state then) and the gradients arriving at their outputs."""
    st.reset_buffers()
    st.clear_grads()
    counter = [0]
    got: dict[int, Captured] = {}
    stack: list[int] = []
    hooks = HookSet()  # the module hooks and the tensor hooks on outputs

    def pre(module: torch.nn.Module, args: Args, kwargs: Kwargs) -> None:
        c = counter[0]
        counter[0] += 1
        stack.append(c)
        if c in calls:
            got[c] = (CallCapture.take(args, kwargs), {})

    def post(module: torch.nn.Module, args: Args, kwargs: Kwargs, output: object) -> None:
        c = stack.pop()
        if c in got:
            grads = got[c][1]
            for name, t in named_tensors(output, "output"):
                if t.requires_grad:
                    hooks.tensor_hook(t, _keeper(grads, name))

    with hooks, torch.enable_grad():
        for m in hookable_modules(call.model):
            # as the recorder: inputs before the user's pre-hooks, which the replay of
            # ``module(*args)`` runs again
            hooks.add(m.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            hooks.add(m.register_forward_hook(post, with_kwargs=True))
        _, loss = call.forward(fresh(call.inputs))
        run_backward(loss, st)
    return got


def _keeper(grads: dict[str, torch.Tensor], name: str) -> Callable[[torch.Tensor | None], None]:
    def keep(g: torch.Tensor | None) -> None:
        if g is not None:  # None: no gradient reached this output (an unused one)
            grads[name] = g.detach().clone()

    return keep
