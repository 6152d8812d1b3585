"""The records of one pass (:class:`.recorder.Recorder`): events, module calls and the
tensors seen in the exact pass, and what a pass records (:class:`RecordOptions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..vocab import EventKind, Phase
from .capture import CallCapture

__all__ = [
    "PHASE_OF",
    "Args",
    "CallRecord",
    "Kwargs",
    "Owner",
    "PostHook",
    "PreHook",
    "RawEvent",
    "RecordOptions",
    "Slot",
    "Vector",
    "host",
]

#: the phase of each kind of event
PHASE_OF: dict[EventKind, Phase] = {
    EventKind.INPUT: Phase.INPUT,
    EventKind.TARGET: Phase.INPUT,
    EventKind.OUTPUT: Phase.FORWARD,
    EventKind.LOSS: Phase.LOSS,
    EventKind.GRAD_OUTPUT: Phase.BACKWARD,
    EventKind.GRAD_INPUT: Phase.BACKWARD,
    EventKind.PARAM_GRAD: Phase.BACKWARD,
}

#: a statistics vector: the quick pass's measurement id in its engine
#: (:class:`..engine.QuickEngine`; -1: not measured yet), or the exact pass's host vector
Vector = int | np.ndarray


#: (call, kind, name): a module call that owns an event when a tensor's gradient arrives
Owner = tuple[int, EventKind, str]
#: a module's positional and keyword arguments as its hooks receive them
Args = tuple[object, ...]
Kwargs = dict[str, object]
PreHook = Callable[[torch.nn.Module, Args, Kwargs], None]
PostHook = Callable[[torch.nn.Module, Args, Kwargs, object], None]


@dataclass(frozen=True)
class RecordOptions:
    """What one pass records (:class:`Recorder`).

    ``exact``: element-wise statistics, rows and data flow (the slow path of a failing
    step); ``capture``: exact pass only, copy the inputs of the calls that may be the
    origin; ``modules``: names of the modules to record (None: all); ``keep``: names of
    the modules whose outputs are kept; ``hold``: a parameter's gradient may be
    accumulated more than once in the backward (reentrant activation checkpointing), so
    each parameter's event is measured from its whole ``.grad`` once the backward is over
    (a pass also switches this on itself when its forward calls a module with gradients
    disabled)."""

    exact: bool = False
    capture: bool = False
    modules: frozenset[str] | None = None
    keep: frozenset[str] = frozenset()
    hold: bool = False


def host(v: Vector) -> np.ndarray:
    """An exact pass's statistics vector, a host array (a quick pass's are measurement ids)."""
    if not isinstance(v, np.ndarray):  # pragma: no cover - an exact-pass reader on a quick id
        raise TypeError("expected an exact pass's host vector")
    return v


@dataclass(frozen=True)
class RawEvent:
    """One event of a pass, as a reader of its records sees it (made from a row of
    :class:`.columns.EventColumns`)."""

    phase: Phase
    kind: EventKind
    module: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    call: int
    depth: int
    module_type: str
    vector: Vector
    samples: list[int] = field(default_factory=list)
    param: str | None = None
    slot: int = -1  # exact mode: the tensor's slot

    @property
    def host(self) -> np.ndarray:
        """The exact pass's host vector of this event."""
        return host(self.vector)


@dataclass
class CallRecord:
    """One call of one module."""

    call: int
    module: str
    module_type: str
    depth: int
    parent: int
    input_slots: list[int] = field(default_factory=list)
    output_slots: list[int] = field(default_factory=list)
    inputs_finite: bool = True
    inputs_has_nan: bool = False
    output_events: list[int] = field(default_factory=list)
    done: bool = False
    capture: CallCapture | None = None  # the inputs as they were at the call


@dataclass
class Slot:
    """A tensor seen in the exact pass: who produced it and whether it was finite."""

    producer: int  # call id, or -1 for the batch / code outside any module
    finite: bool
    has_nan: bool
    consumers: list[int] = field(default_factory=list)
    grad_event: int = -1
    from_output: bool = False  # a module returned it (else: the batch or a module's own code)
