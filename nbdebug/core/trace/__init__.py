"""Tracing one training step: module hooks, events, statistics and the origin of a NaN.

:func:`trace` runs one forward and backward pass with a hook on every module and returns a
:class:`Trace` (one :class:`Event` per module call and gradient, one :class:`ParamInfo` per
parameter); when a value went non-finite, the origin module is replayed op by op and its
event carries the root operation and the :class:`Chain` of :class:`ChainLink` to the NaN.
"""

from .call import StepCall
from .events import Chain, ChainLink, Event, ParamInfo
from .result import Trace, TraceError
from .tracing import trace, trace_step

__all__ = [
    "Chain",
    "ChainLink",
    "Event",
    "ParamInfo",
    "StepCall",
    "Trace",
    "TraceError",
    "trace",
    "trace_step",
]
