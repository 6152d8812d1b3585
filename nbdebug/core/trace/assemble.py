"""The records of a pass made into a :class:`.result.Trace`: every event built once, the
origin's fields with it (:class:`Found`, decided before any event is built)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..batch import describe
from ..state import AutocastState
from ..stats import Histogram, TensorStats, finalize_many
from ..text import dtype_name, qualified_name
from ..vocab import EventKind
from .call import StepCall
from .columns import Row
from .events import Chain, Event, ParamInfo
from .recorder import Recorder
from .records import PHASE_OF
from .result import Trace
from .weights import WeightHealth

__all__ = ["Found", "Outcome", "build_events", "build_result", "partial_trace"]


@dataclass
class Outcome:
    """What one pass gave besides its records."""

    loss: float | None
    output: object = None  # exact pass only: the model output, for the loss replay
    notes: list[str] = field(default_factory=list)
    autocast: AutocastState = field(default_factory=AutocastState)  # the loss's, for its replay


@dataclass
class Found:
    """The origin, decided before any event is built."""

    event: int  # index into the raw events (-1: no origin, only masks to report)
    module: str | None = None  # the producing module, when not the event's own
    op: str | None = None
    source: str | None = None
    chain: Chain = field(default_factory=Chain)
    note: str = ""
    param: str | None = None
    rows: list[int] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    mask_events: list[int] = field(default_factory=list)  # batch tensors
    corrupted: bool = False  # the parameter or buffer ``param`` was non-finite before the step


def build_events(
    rec: Recorder, vectors: np.ndarray, found: Found | None = None
) -> tuple[list[Event], Event | None]:
    """Every event, built once; the origin's op, source, chain and note are part of its
    construction. When the producing module is not the event's own (a parent's code),
    the origin is its own record with the same index."""
    events = []
    origin: Event | None = None
    # straight from the rows: no RawEvent object per event
    for i, (row, (stats, hist)) in enumerate(zip(rec.raw.rows, finalize_many(vectors))):
        ev = _event(i, row, stats, hist)
        if found is not None and i == found.event >= 0:
            origin = _origin(ev, found, rec)
            if found.module is None:
                ev = origin
        events.append(ev)
    return events, origin


def _origin(ev: Event, found: Found, rec: Recorder) -> Event:
    """The origin's own record: ``ev`` with the op, source, chain and note found."""
    module = ev.module if found.module is None else found.module
    return dataclasses.replace(
        ev,
        module=module,
        module_type=ev.module_type if found.module is None else rec.types.get(module, ""),
        samples=list(ev.samples) or list(found.rows),
        op=found.op,
        source=found.source,
        chain=found.chain,
        note=found.note,
        param=found.param or ev.param,
        corrupted=found.corrupted,
    )


def _event(i: int, row: Row, stats: TensorStats, hist: Histogram) -> Event:
    kind, module, name, shape, dtype, call, depth, module_type, _, samples, param, _ = row
    return Event(
        index=i,
        phase=PHASE_OF[kind],
        module=module,
        kind=kind,
        name=name,
        shape=shape,
        dtype=dtype,
        stats=stats,
        hist=hist,
        samples=list(samples),
        call=call,
        depth=depth,
        module_type=module_type,
        param=param,
    )


def build_result(
    call: StepCall,
    rec: Recorder,
    events: list[Event],
    origin: Event | None,
    out: Outcome,
    health: WeightHealth,
    found: Found | None = None,
) -> Trace:
    """The trace of an exact or quick pass: its events, origin, parameters and notes."""
    params, n_params = _params(rec, events, health)
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
        model_name=type(call.model).__name__,
        batch_size=call.batch_size,
        n_params=n_params,
        batch=describe(call.inputs),
        module_types=dict(rec.types),
        notes=out.notes + (found.masks if found is not None else []),
        masks=list(found.masks) if found is not None else [],
        mask_events=list(found.mask_events) if found is not None else [],
        call=call,
    )


def _params(
    rec: Recorder, events: list[Event], health: WeightHealth
) -> tuple[list[ParamInfo], int]:
    """One record per parameter (shared ones once), and their number of elements."""
    grads = {e.param: e for e in events if e.kind == EventKind.PARAM_GRAD}
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
    return params, n_params


def partial_trace(call: StepCall, rec: Recorder) -> Trace:
    """What a pass that raised had recorded, as a trace (no origin, no parameters)."""
    events, _ = build_events(rec, rec.host_vectors())
    first = next((e for e in events if not e.finite), None)
    return Trace(
        events=events,
        origin=None,
        first_nonfinite=first,
        loss=None,
        params=[],
        model_name=type(call.model).__name__,
        batch_size=call.batch_size,
        n_params=sum(p.numel() for p in call.model.parameters()),
        batch=describe(call.inputs),
        module_types=dict(rec.types),
        call=call,
    )
