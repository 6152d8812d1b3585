"""Where a NaN/Inf was *produced*: the four rules of DESIGN.md at the level of modules,
and intended masks.

:func:`batch_masks` tells which batch tensors are intended additive masks (only ``-inf``
or ``+inf`` in them, and the model keeps rows finite that such a value reaches).
:func:`locate` reads the records of an exact pass and returns the origin event (or the
backward candidates that a replay must decide between), treating mask tensors, and
module outputs that a replay showed to be masks, as finite. The operation inside the
module is found by :mod:`nbdebug.core.trace.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..stats import nan_count, row_dim, vector_is_finite
from ..vocab import EventKind, NonFinite, Phase
from .recorder import Recorder

__all__ = ["Located", "MaskInfo", "batch_masks", "locate"]


@dataclass
class Located:
    """The outcome of :func:`locate`."""

    event: int | None = None  # index into the raw events
    call: int = -1  # the module call to replay (-1: none / the loss)
    candidates: list[int] = field(default_factory=list)  # backward: calls to try in order
    param: str | None = None
    corrupted: bool = False  # the param/buffer was non-finite before the pass
    module: str | None = None  # set when the producing code is not the event's module
    kind: NonFinite = NonFinite.NAN  # the value looked for
    loss: bool = False  # backward: the loss's own backward made it (the model's output grad)


@dataclass
class MaskInfo:
    """Slots (tensors of the exact pass) known to hold intended masks."""

    slots: set[int] = field(default_factory=set)
    batch: list[int] = field(default_factory=list)  # raw input events judged masks
    lenient: bool = False  # the batch holds a mask: its derived -inf tensors are masks too

    def clean(self, rec: Recorder, s: int) -> bool:
        slot = rec.slots[s]
        if slot.finite or s in self.slots:
            return True
        return self.lenient and not slot.has_nan and not slot.from_output

    def fed_to_backward(self, rec: Recorder, loc: Located) -> list[int]:
        """The batch "masks" that the module of a backward origin consumed itself: an Inf
        that the forward absorbed (a GRU's gates saturate) but that the backward
        multiplies by a zero gradient is bad data, not a mask."""
        if loc.event is None or loc.call < 0 or rec.raw[loc.event].phase != Phase.BACKWARD:
            return []
        consumed = set(rec.calls[loc.call].input_slots)
        return [i for i in self.batch if rec.raw[i].slot in consumed]

    def unmask(self, rec: Recorder, events: list[int]) -> None:
        """No longer take these batch events for masks."""
        for i in events:
            self.batch.remove(i)
            self.slots.discard(rec.raw[i].slot)
        self.lenient = bool(self.batch)

    def mask_inputs(self, rec: Recorder, call: int) -> tuple[int, ...]:
        """Positions of a call's inputs that are masks (non-finite but clean)."""
        return tuple(
            i
            for i, s in enumerate(rec.calls[call].input_slots)
            if not rec.slots[s].finite and self.clean(rec, s)
        )


def batch_masks(rec: Recorder) -> MaskInfo:
    """Batch tensors whose only non-finite values are infinities and that the model
    consumes as a mask: some row holding such a value keeps a finite model output (or the
    model's output is finite). A NaN in the batch is never a mask."""
    info = MaskInfo()
    model_call = next((c for c in rec.calls if c.parent < 0), None)
    outputs = [rec.raw[e] for e in model_call.output_events] if model_call is not None else []
    if not outputs:
        return info
    bad_rows: set[int] = set()
    rows_known = False
    all_finite = True
    for r in outputs:
        if row_dim(r.shape, rec.batch_size) is not None:
            rows_known = True
            bad_rows.update(r.samples if not vector_is_finite(r.host) else ())
        all_finite = all_finite and vector_is_finite(r.host)
    for i, r in enumerate(rec.raw):
        if r.kind != EventKind.INPUT or vector_is_finite(r.host) or nan_count(r.host) > 0:
            continue  # (a target reaches only the loss: its Inf is never a mask)
        if all_finite:
            used = True
        elif rows_known and rec.batch_size:
            rows = r.samples or list(range(rec.batch_size))
            used = any(row not in bad_rows for row in rows)
        else:
            used = False
        if used:
            info.batch.append(i)
            info.slots.add(r.slot)
    info.lenient = bool(info.batch)
    return info


def locate(rec: Recorder, bad_params: dict[str, list[str]], masks: MaskInfo) -> Located:
    """Apply the origin rules to the raw events of an exact pass."""
    raw = rec.raw
    for i, r in enumerate(raw):
        if vector_is_finite(r.host):
            continue
        kind = NonFinite.NAN if nan_count(r.host) > 0 else NonFinite.INF
        if r.phase == Phase.INPUT:
            if i in masks.batch:
                continue
            return Located(event=i, kind=kind)
        if r.phase == Phase.FORWARD:
            if r.slot in masks.slots:
                continue
            return _forward(rec, i, bad_params, kind, masks)
        if r.phase == Phase.LOSS:
            return Located(event=i, kind=kind)
        return _backward(rec, i, kind)
    return Located()


def _inputs_clean(rec: Recorder, call: int, masks: MaskInfo) -> bool:
    return all(masks.clean(rec, s) for s in rec.calls[call].input_slots)


def _forward(
    rec: Recorder, i: int, bad_params: dict[str, list[str]], kind: NonFinite, masks: MaskInfo
) -> Located:
    call = rec.calls[rec.raw[i].call]
    param = _bad_param(rec, call.module, bad_params)
    if _inputs_clean(rec, call.call, masks):
        return Located(event=i, call=call.call, param=param, corrupted=param is not None, kind=kind)
    # the inputs already held the value: the code of an enclosing module produced it
    a = call.parent
    while a >= 0 and not _inputs_clean(rec, a, masks):
        a = rec.calls[a].parent
    if a < 0:
        return Located(event=i, kind=kind)
    anc = rec.calls[a]
    bad = [
        e
        for e in anc.output_events
        if not vector_is_finite(rec.raw[e].host) and rec.raw[e].slot not in masks.slots
    ]
    if bad:
        p = _bad_param(rec, anc.module, bad_params)
        return Located(event=bad[0], call=a, param=p, corrupted=p is not None, kind=kind)
    return Located(event=i, call=a, module=anc.module, kind=kind)


def _bad_param(rec: Recorder, module: str, bad_params: dict[str, list[str]]) -> str | None:
    """The first non-finite parameter or buffer ``module``'s own code reads: its own, or
    one of a submodule that was never called in the step (a ``ParameterDict``, or a plain
    module holding weights that the parent's forward reads as ``self.block.scale``)."""
    names = bad_params.get(module)
    if names:
        return names[0]
    called = {c.module for c in rec.calls}
    prefix = f"{module}." if module else ""
    for owner, names in bad_params.items():
        if not owner.startswith(prefix) or owner in called:
            continue
        # no module between ``module`` and the owner was called: ``module`` reads it
        parts = owner[len(prefix) :].split(".")
        path = [prefix + ".".join(parts[:k]) for k in range(1, len(parts))]
        if names and not any(p in called for p in path):
            return names[0]
    return None


def _backward(rec: Recorder, i: int, kind: NonFinite) -> Located:
    r = rec.raw[i]
    if r.kind == EventKind.PARAM_GRAD:
        # a module called more than once: any of its calls may have made the gradient;
        # the replay tries them, the last first
        calls = [c.call for c in reversed(rec.calls) if c.module == r.module]
        return Located(
            event=i, call=calls[0] if calls else -1, candidates=calls, param=r.param, kind=kind
        )
    # all events of this gradient tensor were emitted together, consumers first
    same = [j for j in range(i, len(rec.raw)) if rec.raw[j].vector is r.vector]
    consumers = [rec.raw[j].call for j in same if rec.raw[j].kind == EventKind.GRAD_INPUT]
    if consumers:
        # innermost consumer first: a container's child did the work more often than
        # the container's own code
        order = sorted(consumers, key=lambda c: -rec.calls[c].depth)
        first = order[0]
        ev = next(
            j for j in same if rec.raw[j].call == first and rec.raw[j].kind == EventKind.GRAD_INPUT
        )
        return Located(event=ev, call=first, candidates=order, kind=kind)
    # consumed by code outside any child module: the producer's parent
    prod = rec.raw[i].call
    parent = rec.calls[prod].parent if prod >= 0 else -1
    if parent >= 0:
        return Located(
            event=i, call=parent, candidates=[parent], module=rec.calls[parent].module, kind=kind
        )
    # the gradient of the model's output, non-finite as it arrives: the loss made it
    loss = prod >= 0 and r.kind == EventKind.GRAD_OUTPUT and rec.calls[prod].module == ""
    return Located(event=i, kind=kind, loss=loss)
