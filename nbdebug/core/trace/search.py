"""The origin search: the module-level rules (:mod:`.locate`), then the op-level replay
(:mod:`.replay`) of the one module they name. A module whose non-finite output the
replay shows to be an intended mask is set aside and the rules are applied again."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..batch import Batch, named_tensors
from ..state import PreservedState
from ..stats import inf_count, nan_count
from ..vocab import EventKind, NonFinite, Phase
from .assemble import Found, Outcome
from .call import StepCall
from .locate import Located, MaskInfo, batch_masks, locate
from .passes import capture_calls
from .recorder import Recorder
from .records import RawEvent
from .replay import LossStep, replay_backward, replay_forward, replay_loss, replay_loss_backward
from .spy import OpFinding

__all__ = ["find_origin"]

_MAX_MASK_ROUNDS = 8


@dataclass
class _Search:
    """What one origin search reads: the step, its preserved state, the exact pass."""

    call: StepCall
    st: PreservedState
    rec: Recorder
    out: Outcome
    modules: dict[str, torch.nn.Module]


def find_origin(
    call: StepCall,
    st: PreservedState,
    rec: Recorder,
    bad_params: dict[str, list[str]],
    out: Outcome,
) -> Found | None:
    """The origin of the exact pass ``rec`` (``bad_params``: module -> names of its
    parameters and buffers that were non-finite before the step), or only the masks to
    report (``event=-1``), or None."""
    search = _Search(call, st, rec, out, dict(call.model.named_modules()))
    masks = batch_masks(rec)
    batch_texts = {
        i: _batch_mask_text(rec.raw[i], t) for i, t in _mask_tensors(rec, masks, call.inputs)
    }
    texts = list(batch_texts.values())
    unmasked = ""
    for round_ in range(_MAX_MASK_ROUNDS):
        loc = locate(rec, bad_params, masks)
        if loc.event is None:
            break
        fed = masks.fed_to_backward(rec, loc)
        if fed:
            masks.unmask(rec, fed)
            texts = [batch_texts[i] for i in masks.batch if i in batch_texts]
            unmasked = _unmasked_text(rec, loc, fed)
            continue
        event_index = loc.event
        try:
            finding, event_index, loc = _replay(search, loc, masks)
        except Exception as e:  # the replay is a diagnosis aid: never fail the trace for it
            finding = OpFinding(note=_failed_note(rec, loc, e))
        if finding.mask and round_ < _MAX_MASK_ROUNDS - 1:
            made = rec.calls[loc.call]
            masks.slots.update(made.output_slots)
            masks.slots.add(rec.raw[event_index].slot)
            texts.append(f"{made.module or '<model>'} outputs infinite values used as a mask")
            continue
        found = _found(rec, loc, event_index, finding, texts)
        found.note = "; ".join(x for x in (unmasked, found.note) if x)
        found.mask_events = [i for i in masks.batch if i in batch_texts]
        return found
    batch = [i for i in masks.batch if i in batch_texts]
    return Found(event=-1, masks=texts, mask_events=batch) if texts else None


def _unmasked_text(rec: Recorder, loc: Located, fed: list[int]) -> str:
    module = rec.calls[loc.call].module or "<model>"
    names = ", ".join(f"`{rec.raw[i].name}`" for i in fed)
    made = "NaN" if loc.kind == NonFinite.NAN else "Inf"
    return (
        f"the Inf in {names} did not reach the model's output, but the backward of "
        f"{module} turns it into {made}: bad data, not a mask"
    )


def _replay(search: _Search, loc: Located, masks: MaskInfo) -> tuple[OpFinding, int, Located]:
    """The op-level replay of the located module (or of the loss): its finding, and the
    event and location it is for (a backward candidate may replace the first)."""
    rec, bs = search.rec, search.call.batch_size
    event_index = loc.event
    assert event_index is not None
    phase = rec.raw[event_index].phase
    if phase == Phase.FORWARD and loc.call >= 0:
        call = rec.calls[loc.call]
        if call.capture is None:
            return OpFinding(note=_NOT_RECORDED.format(call.module or "<model>")), event_index, loc
        search.st.reset_buffers()
        module = search.modules[call.module]
        f = replay_forward(module, call.capture, loc.kind, bs, masks.mask_inputs(rec, loc.call))
        return _checked(f, rec, loc.call), event_index, loc
    if phase == Phase.LOSS:
        f = replay_loss(_loss_step(search), loc.kind, bs, _output_masks(rec, masks))
        return f, event_index, loc
    if phase == Phase.BACKWARD and loc.loss:
        made = rec.raw[event_index].call
        names = {r.name for r in rec.raw if r.call == made and r.kind == EventKind.GRAD_OUTPUT}
        return replay_loss_backward(_loss_step(search), names, loc.kind, bs), event_index, loc
    if phase == Phase.BACKWARD and (loc.candidates or loc.call >= 0):
        return _replay_backward(search, loc, event_index)
    return OpFinding(), event_index, loc


def _loss_step(search: _Search) -> LossStep:
    step, out = search.call, search.out
    return LossStep(step.loss_fn, out.output, step.target, out.autocast)


def _output_masks(rec: Recorder, masks: MaskInfo) -> set[str]:
    """The model's outputs (``named_tensors(output, "output")`` names) holding masks."""
    model = next((c for c in rec.calls if c.parent < 0), None)
    if model is None:
        return set()
    events = [rec.raw[e] for e in model.output_events]
    return {r.name for r in events if not rec.slots[r.slot].finite and masks.clean(rec, r.slot)}


def _replay_backward(
    search: _Search, loc: Located, event_index: int
) -> tuple[OpFinding, int, Located]:
    """Replay the backward candidates in order; the first whose backward makes the value
    is the origin (its own ``grad_input`` event when it is not the first candidate)."""
    rec = search.rec
    cands = loc.candidates or [loc.call]
    caps = capture_calls(search.call, search.st, set(cands))
    for c in cands:
        if c not in caps:
            continue
        search.st.reset_buffers()
        module = search.modules[rec.calls[c].module]
        param = _own_param(module, rec.raw[event_index]) if loc.param else None
        bs = search.call.batch_size
        f = replay_backward(module, caps[c][0], caps[c][1], loc.kind, bs, param)
        if not f.reproduced:
            continue
        if c != loc.call:
            vector = rec.raw[event_index].vector
            event_index = next(
                (
                    j
                    for j, r in enumerate(rec.raw)
                    if r.call == c and r.kind == EventKind.GRAD_INPUT and r.vector is vector
                ),
                event_index,
            )
            loc = dataclasses.replace(loc, call=c)
        return f, event_index, loc
    return OpFinding(), event_index, loc


def _own_param(module: torch.nn.Module, r: RawEvent) -> torch.Tensor | None:
    """The parameter of a parameter-gradient event, ``None`` when it is no event of
    ``module``'s own parameter (a batch gradient)."""
    if r.kind != EventKind.PARAM_GRAD:
        return None
    try:
        return module.get_parameter(r.name)
    except AttributeError:
        return None


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
    vecs = [rec.raw[e].host for e in rec.calls[call].output_events]
    recorded = (int(sum([nan_count(v) for v in vecs])), int(sum([inf_count(v) for v in vecs])))
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
) -> Found:
    note = finding.note
    module = None
    if loc.module is not None and loc.module != rec.raw[event_index].module:
        module = loc.module
        own = f"made by the code of {loc.module or '<model>'} itself, outside its submodules"
        note = "; ".join(x for x in (own, note) if x)
    if loc.loss:
        own = (
            "made in the loss's backward: the gradient reaching the model's output was "
            "already non-finite, nothing in the model made it"
        )
        note = "; ".join(x for x in (own, note) if x)
    if loc.corrupted and not note:
        note = f"the parameter or buffer {loc.param} already held non-finite values"
    return Found(
        event=event_index,
        module=module,
        op=finding.op,
        source=finding.source,
        chain=finding.chain,
        note=note,
        param=loc.param,
        rows=list(finding.rows),
        masks=masks,
        corrupted=loc.corrupted,
    )


def _mask_tensors(rec: Recorder, masks: MaskInfo, inputs: Batch) -> list[tuple[int, torch.Tensor]]:
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
