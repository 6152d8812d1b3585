"""The cause of the first NaN/Inf of a trace, named from its origin's structured facts
(``Event.op``, ``Event.chain``, ``Event.param``): a log of a non-positive value, an exp
overflow, a division by zero, a float16 overflow, or another op."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.optable import OpFamily, base_name, op_family
from ...core.text import fmt_num, rows_text
from ...core.trace.events import Event
from ...core.trace.result import Trace
from ...core.vocab import EventKind, Phase
from .base import (
    FP16_MAX,
    Finding,
    TraceView,
    exp_limit,
    is_floating,
    is_output,
    module_label,
)
from .codes import CheckCode


def root_op(o: Event) -> str | None:
    """The operation that made the origin's first non-finite value: the root of its chain
    (``o.chain[0].op``), else the event's own ``op``."""
    return o.chain[0].op if o.chain else o.op


# --------------------------------------------------------------------------- the origin
@dataclass
class _Origin:
    """What every origin finding says: where, the evidence, the op, the rows."""

    event: Event
    where: str
    made_by: str | None
    families: set[OpFamily | None]
    evidence: dict[str, object] = field(default_factory=dict)

    @property
    def rows(self) -> str:
        """``" (rows 1, 2)"`` or ``""``."""
        return f" ({rows_text(self.event.samples)})" if self.event.samples else ""

    @property
    def common(self) -> dict[str, Any]:
        o = self.event
        return {"event": o.index, "module": o.module, "param": o.param, "rows": list(o.samples)}

    def finding(self, code: CheckCode, advice: str, fix: str = "") -> Finding:
        return Finding(code, "error", self.where, self.evidence, advice, fix=fix, **self.common)


def origin_findings(view: TraceView) -> list[Finding]:
    """Name the cause of the first non-finite value (forward, loss or backward origin)."""
    tr = view.trace
    o = tr.origin
    if o is None:
        return _unlocated(view, tr)
    if o.phase == Phase.INPUT:
        return []  # the data checks name the rows (nonfinite_input)
    bad_params = {p.name for p in tr.params if p.n_nan or p.n_inf}
    if o.param and (o.param in bad_params or o.corrupted):
        return []  # nonfinite_weight names it
    made_by = root_op(o)
    facts = _Origin(o, where_of(view, o), made_by, {op_family(o.op), op_family(made_by)})
    facts.evidence = {"n_nan": o.stats.n_nan, "n_inf": o.stats.n_inf, "phase": o.phase}
    if o.op:
        facts.evidence["op"] = o.op
    if o.source:
        facts.evidence["source"] = o.source
    if facts.families & {OpFamily.LOG, OpFamily.SQRT}:
        return [_log_finding(facts)]
    if OpFamily.EXP in facts.families:
        return [_exp_finding(view, facts)]
    if OpFamily.DIV in facts.families:
        facts.evidence["threshold"] = "denominator == 0"
        advice = (
            f"{made_by} divided by zero{facts.rows} (0/0 gives NaN, x/0 Inf): add an epsilon "
            "to the denominator or clamp it."
        )
        return [
            facts.finding(
                CheckCode.DIVISION_BY_ZERO, advice, "x / (d + 1e-6)  # or d.clamp_min(1e-6)"
            )
        ]
    # a backward origin ran in the dtype of its module's forward (an fp16 matmul's weight
    # gradient overflows in float16, then lands in the float32 .grad)
    ran = o.dtype if o.phase != Phase.BACKWARD or o.dtype == "float16" else view.ran_in(o.module)
    if fp16_overflow(view, o, ran):
        return [_fp16_finding(view, facts)]
    note = f" ({o.note})" if o.note else ""
    advice = (
        f"{made_by or 'this module'} produced the first non-finite value{facts.rows}{note}; "
        "step into it."
    )
    return [facts.finding(CheckCode.NONFINITE_ORIGIN, advice)]


def _unlocated(view: TraceView, tr: Trace) -> list[Finding]:
    """Non-finite values whose origin the trace did not find."""
    first = tr.first_nonfinite
    if first is None or first.phase == Phase.INPUT:
        return []
    return [
        Finding(
            CheckCode.NONFINITE_ORIGIN,
            "error",
            where_of(view, first),
            {"n_nan": first.stats.n_nan, "n_inf": first.stats.n_inf},
            "non-finite values appear here but their origin was not found; step through the "
            "events before it.",
            event=first.index,
            module=first.module,
            rows=list(first.samples),
        )
    ]


def _log_finding(facts: _Origin) -> Finding:
    """``log_of_nonpositive``: a log or a root of a value <= 0, or its derivative at 0."""
    op, rows = facts.made_by or "log/sqrt", facts.rows
    back = facts.event.phase == Phase.BACKWARD
    facts.evidence["threshold"] = "input <= 0" if not back else "input == 0 (infinite derivative)"
    if op_family(facts.made_by) == OpFamily.SQRT:
        # a square root's input must be >= 0 by construction: clamping it hides the bug
        # and zeroes the gradient of the clamped rows (lesson 02's exercise shows it)
        advice = (
            f"{op} received a negative value{rows}: make its input non-negative by "
            "construction, e.g. F.softplus(x) + 1e-6 for a scale or variance (or "
            "x.square() before a root); clamping stops the gradient of those rows."
            if not back
            else f"the derivative of {op} is infinite at 0{rows}: add a small constant "
            "inside the root, torch.sqrt(x + 1e-12), e.g. for a norm of a zero row."
        )
        fix = "F.softplus(x) + 1e-6" if not back else "torch.sqrt(x + 1e-12)"
    else:
        advice = (
            f"{op} received a value <= 0{rows}: clamp its input first, e.g. "
            f"torch.log(x.clamp_min(1e-12)), "
            "or compute in log space (log_softmax instead of log(softmax))."
            if not back
            else f"the derivative of {op} is infinite at 0{rows}: clamp its input away "
            "from 0 (x.clamp_min(1e-12)) before the call, also behind torch.where."
        )
        fix = "torch.log(x.clamp_min(1e-12))"
    return facts.finding(CheckCode.LOG_OF_NONPOSITIVE, advice, fix)


def _exp_finding(view: TraceView, facts: _Origin) -> Finding:
    """``exp_overflow_risk`` (error): an exp that overflowed."""
    o = facts.event
    inp = view.input_of(o) if o.phase == Phase.FORWARD else None
    if inp is not None and inp.finite:
        facts.evidence["input_absmax"] = inp.stats.absmax
    facts.evidence["threshold"] = exp_limit(o.dtype)
    advice = (
        f"{facts.made_by} overflowed{facts.rows}: exp(x) is infinite for x > "
        f"{exp_limit(o.dtype):.4g} in {o.dtype}; "
        "subtract the max first (torch.logsumexp, softmax) or clamp x."
    )
    return facts.finding(
        CheckCode.EXP_OVERFLOW_RISK, advice, "torch.exp(x - x.amax(dim=-1, keepdim=True))"
    )


def _fp16_finding(view: TraceView, facts: _Origin) -> Finding:
    """``fp16_overflow_risk`` (error) with what reached the origin."""
    o, ev = facts.event, facts.evidence
    inp = view.input_of(o) if o.phase == Phase.FORWARD else None
    if inp is not None and inp.finite:
        ev["input_absmax"] = inp.stats.absmax
    largest = largest_reaching(view, o) if o.phase == Phase.FORWARD else None
    value = largest if largest is not None and largest > FP16_MAX else None
    if value is not None:
        ev["reached_absmax"] = value
    ev["threshold"] = FP16_MAX
    return fp16_overflow_finding(
        facts.where,
        ev,
        facts.made_by,
        facts.rows,
        value,
        to_nan=bool(o.stats.n_nan),
        **facts.common,
    )


def fp16_overflow(view: TraceView, o: Event, ran: str | None) -> bool:
    """Whether float16 made the first non-finite value of the origin ``o`` (``ran``: the
    dtype its module ran in). The evidence, any of:

    * an Inf in the origin's tensor, and its module ran in float16;
    * the root of its chain made an Inf, and the module ran in float16 (the Inf then
      became NaN within it, ``inf - inf``);
    * the root is a cast (``Tensor.to``, ``.half()``) that made an Inf from finite values
      and float16 came out of the call (``.half()`` itself, a submodule's output);
    * the module ran in float16, its root is an op that float16 autocast runs in float16
      (``linear``, ``matmul``, ``conv2d``...) and made NaN from finite inputs, and a
      finite value over 65504 reached the module (the cast inside the op made the Inf,
      ``inf*w + (-inf)*w`` the NaN).

    A NaN made by any other op (``acos`` of 2, a log of a negative value) is not.
    """
    if ran == "float16" and o.stats.n_inf:
        return True
    root = o.chain[0] if o.chain else None
    if o.phase != Phase.FORWARD or root is None:
        return False
    family = op_family(root.op)
    if root.value == "inf":
        return ran == "float16" or (
            family == OpFamily.CAST and (base_name(root.op) == "half" or _float16_within(view, o))
        )
    largest = largest_reaching(view, o)
    return (
        ran == "float16"
        and family == OpFamily.MATMUL
        and largest is not None
        and largest > FP16_MAX
    )


def fp16_overflow_finding(
    where: str,
    evidence: dict[str, object],
    made_by: str | None,
    in_rows: str,
    value: float | None = None,
    *,
    to_nan: bool = False,
    **common: Any,
) -> Finding:
    """The ``fp16_overflow_risk`` error: what overflowed (``value``, the largest finite
    value that reached it, against 65504, where it is known; ``to_nan``: the Inf it made
    became NaN; ``in_rows``: " (rows 1, 2)" or "") and the fix."""
    if value is not None:
        limit = f" ({fmt_num(value)} reached it, over 65504, the largest finite float16)"
    else:
        limit = " (largest finite value 65504)"
    nan = ", and the Inf became NaN" if to_nan else ""
    return Finding(
        CheckCode.FP16_OVERFLOW_RISK,
        "error",
        where,
        evidence,
        f"{made_by or 'this module'} overflowed float16{limit}{in_rows}{nan}: run it "
        "in float32 (autocast keeps reductions in float32), or scale its "
        "inputs or weights down.",
        fix="with torch.autocast('cuda', dtype=torch.bfloat16): ...  # or module.float()",
        **common,
    )


def _call_span(view: TraceView, o: Event) -> tuple[list[Event], Event | None]:
    """The outputs of a forward origin's submodules in its call (they complete just before
    it), and the event completed before that call, as :meth:`TraceView.input_of` has it (a
    module output or a batch tensor; ``None`` if neither)."""
    prefix = o.module + "." if o.module else ""
    inner: list[Event] = []
    for e in reversed(view.events[: o.index]):
        if is_output(e):
            if e.call == o.call:
                continue  # another output of the same call
            if e.module != o.module and e.module.startswith(prefix):
                inner.append(e)
                continue
            return inner, e
        return inner, e if e.phase == Phase.INPUT else None
    return inner, None


def largest_reaching(view: TraceView, o: Event) -> float | None:
    """The largest finite absolute value among the tensors that reached a forward origin
    (its input, the batch for the model itself, and its submodules' outputs in that call);
    ``None`` when none is known."""
    inner, before = _call_span(view, o)
    if o.module == "":
        inner += [e for e in view.events if e.phase == Phase.INPUT and e.kind == EventKind.INPUT]
    elif before is not None:
        inner.append(before)
    return max((e.stats.absmax for e in inner if e.finite and is_floating(e.dtype)), default=None)


def _float16_within(view: TraceView, o: Event) -> bool:
    """Whether a submodule of a forward origin returned float16 in the origin's call."""
    return any(e.dtype == "float16" for e in _call_span(view, o)[0])


def where_of(view: TraceView, e: Event) -> str:
    """Where an event is, in words: a module (its type), a parameter, the loss, an input."""
    if e.phase == Phase.LOSS:
        return "the loss"
    if e.phase == Phase.INPUT:
        return f"input {e.name}"
    base = module_label(e.module, e.module_type or view.types.get(e.module, ""))
    if e.param:
        return f"{base}, parameter {e.param}"
    return f"{base} ({e.phase})" if e.phase == Phase.BACKWARD else base
