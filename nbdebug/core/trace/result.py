"""The result of :func:`nbdebug.trace`: :class:`Trace` and :class:`TraceError`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..display import show as show_result
from ..text import rows_text
from ..vocab import EventKind, Phase
from .call import StepCall
from .events import Event, ParamInfo

if TYPE_CHECKING:  # pragma: no cover - pandas is imported where a frame is made
    import pandas as pd

#: Columns of :meth:`Trace.params_frame` (``name`` becomes the index).
PARAMS_COLUMNS = (
    "name",
    "module",
    "shape",
    "dtype",
    "requires_grad",
    "norm",
    "grad_norm",
    "ratio",
    "n_nan",
    "n_inf",
    "grad_n_nan",
    "grad_n_inf",
)


def shown_grad_norm(p: ParamInfo) -> float | None:
    """The L2 norm of a parameter's gradient as it is: NaN when the gradient holds NaN, inf
    when it holds Inf (``ParamInfo.grad_norm`` is the norm of the finite elements)."""
    if p.grad_norm is None:
        return None
    if p.grad_n_nan:
        return math.nan
    if p.grad_n_inf:
        return math.inf
    return p.grad_norm


@dataclass
class Trace:
    """One forward + backward pass, recorded module by module.

    Attributes
    ----------
    events : list of Event
        In execution order: the batch (``"input"``), every module output
        (``"forward"``), the loss, then every gradient (``"backward"``).
    origin : Event or None
        Where the first non-finite value was *produced* (see DESIGN.md's four rules).
    first_nonfinite : Event or None
        The first event that holds any NaN/Inf.
    loss : float or None
    params : list of ParamInfo
    model_name : str
        Class name of the model.
    batch_size : int or None
    n_params : int
        Number of parameter elements.
    batch : str
        Short description of the batch (``"Tensor(16, 10) float32"``).
    error : str or None
        Set on the partial trace carried by :class:`TraceError`.
    masks : list of str
        Intended masks that were not taken for the origin: ``"batch holds -inf in
        `attention_mask`, used as a mask"`` (also in ``notes``).
    unreplayed_loss : float or None
        The non-finite loss of the step's first pass when the exact pass, run again on the
        same batch, buffers and RNG, was finite (a forward with state outside its inputs):
        the events are the exact pass's, and the trace is not healthy.
    mask_events : list of int
        The indices of the batch events (``phase="input"``) taken for intended masks: their
        -inf is not an origin, and the health checks do not call it bad data.
    notes : list of str
    kept : dict of str to Tensor
        Detached copies of the module outputs asked for with ``trace(..., keep=...)``,
        keyed by module name (``"module:output[1]"`` for the further outputs of a module
        returning several; ``"module#2"`` for the output of its second call, and so on);
        empty by default. Their size: ``kept_bytes``.
    call : StepCall or None
        The step the trace ran (model, batch, target, loss function, autocast), as
        references: what :func:`nbdebug.check`, :func:`nbdebug.debug` and the other
        consumers of a trace reuse instead of asking for them again. ``None`` for a trace
        built by hand.
    """

    events: list[Event]
    origin: Event | None
    first_nonfinite: Event | None
    loss: float | None
    params: list[ParamInfo]
    model_name: str
    batch_size: int | None = None
    n_params: int = 0
    batch: str = ""
    error: str | None = None
    module_types: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    mask_events: list[int] = field(default_factory=list)
    unreplayed_loss: float | None = None
    call: StepCall | None = field(default=None, repr=False, compare=False)

    @property
    def kept_bytes(self) -> int:
        """Memory held by ``kept`` (bytes)."""
        return sum(t.numel() * t.element_size() for t in self.kept.values())

    @property
    def healthy(self) -> bool:
        return self.first_nonfinite is None and self.error is None and self.unreplayed_loss is None

    @property
    def ok(self) -> bool:
        """The result protocol's verdict: the step is :attr:`healthy` (no NaN/Inf, no error,
        a step that replays)."""
        return self.healthy

    def show(self, **options: object) -> object:
        """The debugger's widget for this trace (what ``nbdebug.debug(trace)`` shows; an
        ``ipywidgets`` widget). ``backend=`` as for :func:`nbdebug.debug`."""
        return show_result(self, **options)

    def events_of(self, module: str, phase: Phase | str | None = None) -> list[Event]:
        """Events of one module (optionally of one phase)."""
        return [
            e for e in self.events if e.module == module and (phase is None or e.phase == phase)
        ]

    def to_frame(self) -> pd.DataFrame:
        """One row per event: index, phase, module, kind, name, shape, dtype, the stats,
        samples, op, source, and whether it is the origin."""
        import pandas as pd

        origin = self.origin.index if self.origin is not None else -1
        rows = []
        for e in self.events:
            s = e.stats
            rows.append(
                (
                    e.index,
                    str(e.phase),
                    e.module,
                    e.module_type,
                    str(e.kind),
                    e.name,
                    e.shape,
                    e.dtype,
                    s.norm,
                    s.mean,
                    s.std,
                    s.min,
                    s.max,
                    s.absmax,
                    s.zero_frac,
                    s.n_nan,
                    s.n_inf,
                    e.samples,
                    e.op,
                    e.source,
                    e.index == origin,
                )
            )
        columns = [
            "index",
            "phase",
            "module",
            "module_type",
            "kind",
            "name",
            "shape",
            "dtype",
            "norm",
            "mean",
            "std",
            "min",
            "max",
            "absmax",
            "zero_frac",
            "n_nan",
            "n_inf",
            "samples",
            "op",
            "source",
            "is_origin",
        ]
        return pd.DataFrame.from_records(rows, columns=columns).set_index("index")

    def params_frame(self) -> pd.DataFrame:
        """One row per parameter: name, module, shape, dtype, norm, grad_norm,
        grad/weight ratio, and non-finite counts of the weight and of its gradient.
        ``grad_norm`` is NaN for a gradient holding NaN and inf for one holding Inf (the
        norm of such a tensor), not the norm of its finite elements."""
        import pandas as pd

        rows = [
            (
                p.name,
                p.module,
                p.shape,
                p.dtype,
                p.requires_grad,
                p.norm,
                shown_grad_norm(p),
                p.ratio,
                p.n_nan,
                p.n_inf,
                p.grad_n_nan,
                p.grad_n_inf,
            )
            for p in self.params
        ]
        return pd.DataFrame.from_records(rows, columns=list(PARAMS_COLUMNS)).set_index("name")

    def summary(self) -> str:
        """One line: healthy, or where the NaN/Inf was produced."""
        if self.error:
            return f"error: {self.error}"
        o = self.origin
        if o is None:
            if self.masks and self.first_nonfinite is not None:
                return f"no NaN/Inf produced outside intended masks ({'; '.join(self.masks)})"
            if self.first_nonfinite is not None:
                return (
                    f"non-finite values first seen at {self.first_nonfinite.label} (origin "
                    f"not found)"
                )
            if self.unreplayed_loss is not None:
                return (
                    f"the step's loss was {self.unreplayed_loss} but its replay was finite: the "
                    "forward does not replay (see notes), no origin named"
                )
            if self.loss is not None and not any(e.phase == Phase.BACKWARD for e in self.events):
                return "no NaN/Inf in the forward; no backward ran (see notes)"
            return "healthy"
        kind = "NaN" if o.stats.n_nan else "Inf"
        if o.module:
            where = o.module
        elif o.phase == Phase.INPUT:
            where = "the target" if o.kind == EventKind.TARGET else "the batch"
        else:
            where = "the loss" if o.phase == Phase.LOSS else "<model>"
        bits: list[str] = [o.phase]
        made = o.chain.describe() if len(o.chain) > 1 else ""
        if o.op and not made:
            bits.append(o.op)
        if o.source and not made:
            bits.append(o.source)
        if o.param:
            bits.append(f"param {o.param}")
        rows = f", {rows_text(o.samples)}" if o.samples else ""
        made = f": {made}" if made else ""
        return f"{kind} produced in {where} ({', '.join(bits)}){made}{rows}"

    def __repr__(self) -> str:
        loss = (
            "None"
            if self.loss is None
            else (f"{self.loss:.6g}" if math.isfinite(self.loss) else str(self.loss))
        )
        lines = [
            f"Trace({self.model_name}: {len(self.events)} events, batch "
            f"{self.batch or '?'}, loss={loss})",
            f"  {self.summary()}",
        ]
        if self.origin is not None:
            lines.append(f"  origin: {self.origin!r}")
            if self.origin.note:
                lines.append(f"  note: {self.origin.note}")
        if self.masks:
            lines.append(f"  masks: {'; '.join(self.masks)}")
        lines += [f"  note: {n}" for n in self.notes if n not in self.masks]
        return "\n".join(lines)


class TraceError(RuntimeError):
    """The model (or the loss, or the backward) raised during :func:`nbdebug.trace`.

    The message names where ("ValueError in encoder.layers.2 (TransformerEncoderLayer)
    during the forward pass: ... Executed modules up to: encoder.layers.1"); the original
    exception is chained as ``__cause__``.

    Attributes
    ----------
    trace : Trace or None
        The partial trace up to the failure (its ``error`` is the message).
    module : str or None
        Qualified name of the module that raised (``None`` outside any module).

    Examples
    --------
    >>> try:
    ...     nbdebug.trace(model, x, y, F.cross_entropy)
    ... except nbdebug.TraceError as err:
    ...     print(err.module, len(err.trace.events))
    """

    def __init__(self, message: str, *, trace: Trace | None = None, module: str | None = None):
        super().__init__(message)
        self.trace = trace
        self.module = module
