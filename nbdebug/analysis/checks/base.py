"""What every health check shares: :class:`Finding`, :class:`Findings`, the thresholds
and a few small helpers. The codes are in :mod:`nbdebug.analysis.checks.codes`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Literal

from ...core.display import show as show_result
from ...core.text import fmt_num
from ...core.trace.events import Event
from ...core.trace.result import Trace
from ...core.vocab import EventKind, Phase
from .codes import SEVERITIES, CheckCode, Severity, allowed_severities, code_of

if TYPE_CHECKING:
    import pandas as pd

_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}

# --------------------------------------------------------------------------- thresholds
# data
#: A feature is constant when its std across the batch is at most this times max(1, |mean|).
CONSTANT_STD = 1e-6
#: constant_feature needs at least this many rows (fewer rows are constant by chance).
CONSTANT_MIN_ROWS = 8
#: unscaled_input: a floating input whose max - min exceeds this.
UNSCALED_RANGE = 1e4
# forward
#: exp(x) overflows above log(finfo.max): 11.09 in float16, 88.72 in float32/bfloat16.
EXP_LIMIT = {
    "float16": math.log(65504.0),
    "bfloat16": math.log(3.3895313892515355e38),
    "float32": math.log(3.4028234663852886e38),
    "float64": math.log(1.7976931348623157e308),
}


def exp_limit(dtype: str) -> float:
    """Where exp(x) overflows in ``dtype`` (float32's limit for other dtypes)."""
    return EXP_LIMIT.get(dtype, EXP_LIMIT["float32"])


#: exp_overflow_risk warns from this share of EXP_LIMIT: beyond half the limit exp(x)**2 (a
#: product of two exponentials, a variance of them) already overflows, and a sum of exps is
#: a factor exp(limit / 2) from it (1.8e19 in float32).
EXP_RISK_FRACTION = 0.5
#: The largest finite float16.
FP16_MAX = 65504.0
#: fp16_overflow_risk: activations above this share of FP16_MAX (a factor 2 from overflow).
FP16_RISK_FRACTION = 0.5
#: dead_relu: share of exact zeros after a ReLU above this.
DEAD_RELU_ZERO_FRAC = 0.9
#: saturated_activation: outputs within this of the bounds of tanh (-1, 1) or sigmoid (0, 1) ...
SATURATION_EPS = 1e-3
#: ... for more than this share of the elements.
SATURATION_SHARE = 0.5
# backward
#: vanishing_gradient: grad norm / weight norm below this (weights with ndim >= 2).
VANISHING_RATIO = 1e-5
#: exploding_gradient: grad norm / weight norm above this (weights with ndim >= 2) ...
EXPLODING_RATIO = 100.0
#: ... or a total gradient norm this many times the median of the recent history.
EXPLODING_HISTORY_FACTOR = 10.0
#: History-based checks need at least this many usable rows.
HISTORY_MIN_ROWS = 5
#: "Recent" history: the last this many rows.
HISTORY_WINDOW = 100
# optimizer and schedule
#: adam_state_outlier: log10 of a parameter's bias-corrected moment RMS this many sigma
#: from its recorded history.
ADAM_SIGMA = 3.0
#: A float16 Adam's eps must survive the cast to float16 (smallest subnormal 5.96e-8).
FP16_SMALLEST = 2.0**-24
#: lr_spike: the learning rate grows by more than this factor from one recorded step to the next ...
LR_SPIKE_RATIO = 2.0
#: ... from a steady or falling value of at least this share of the largest learning rate so
#: far (a warm-up is not a spike).
LR_SPIKE_MIN_SHARE = 0.1
#: lr_schedule_boundary is a warning when the loss rises by this factor (or is not finite)
#: within LR_BOUNDARY_WINDOW rows after the boundary; otherwise information.
LR_BOUNDARY_LOSS_RISE = 1.5
LR_BOUNDARY_WINDOW = 20
#: Relative tolerance under which two learning rates are equal.
LR_REL_TOL = 1e-9
#: grad_clip_always_on: the clip engaged in more than this share of the steps ...
CLIP_ALWAYS_SHARE = 0.9
#: ... over at least this many steps (also the minimum for grad_clip_never_on).
CLIP_MIN_STEPS = 20
#: A recorded gradient norm within this relative distance of max_norm was clipped.
CLIP_REL_TOL = 1e-3
#: grad_scaler_collapse: this many consecutive decreases of the scale ...
SCALER_FALLS = 5
#: ... or this many skipped steps among the last SCALER_WINDOW rows ...
SCALER_SKIPS = 5
SCALER_WINDOW = 20
#: ... is a warning; a scale below this is an error.
SCALER_MIN_SCALE = 1.0
# guard
#: NaNGuard(checks=True) runs the cheap checks every this many steps.
CHECK_EVERY = 50


# --------------------------------------------------------------------------- ordering
class Band(IntEnum):
    """Where a finding sorts within its severity (``Finding.position``): band by band,
    and inside a band by an offset (see :func:`position`). Findings with no position
    (optimizer state, clipping, the scaler) come last (``math.inf``)."""

    #: the trace; offset: the event index (a fraction falls between two events)
    TRACE = 0
    #: the traced step, with no event to point at (labels when there is no loss event)
    STEP = 1
    #: the model or the loss raised: after what the partial trace shows
    TRACE_ERROR = 2
    #: the training history (learning-rate schedule); offset: the history row
    HISTORY = 3
    #: findings a guard recorded in its history; offset: the step
    RECORDED = 4


#: Offsets inside a band stay below this (event indices, history rows, steps).
BAND_WIDTH = 1e12


def position(band: Band, offset: float = 0.0) -> float:
    """``Finding.position`` of ``offset`` inside ``band`` (``position(Band.TRACE, i)`` is
    event ``i``)."""
    return band * BAND_WIDTH + offset


#: Codes that name a cause sort before codes that name a symptom at the same position.
_CODE_RANK: dict[str, int] = {
    c: i
    for i, c in enumerate(
        (
            CheckCode.NONFINITE_INPUT,
            CheckCode.NONFINITE_WEIGHT,
            CheckCode.LABEL_OUT_OF_RANGE,
            CheckCode.LOG_OF_NONPOSITIVE,
            CheckCode.EXP_OVERFLOW_RISK,
            CheckCode.FP16_OVERFLOW_RISK,
            CheckCode.DIVISION_BY_ZERO,
            CheckCode.NONFINITE_ORIGIN,
            CheckCode.STATE_DICT_MISMATCH,
            CheckCode.NONFINITE_GRADIENT,
            CheckCode.TRACE_ERROR,
        )
    )
}


def check_clip_norm(value: object, name: str = "clip_norm") -> float | None:
    """The gradient-clipping threshold the run uses: None (not clipped) or a positive,
    finite number, as a float."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive finite number or None; got {value!r}.")
    return float(value)


@dataclass
class Finding:
    """One result of a health check.

    Attributes
    ----------
    code : CheckCode
        What was found (``"log_of_nonpositive"``, ...; the table is
        :data:`~nbdebug.analysis.checks.codes.CODES`). A ``str`` enum: it equals its string.
    severity : {"error", "warning", "info"}
        ``"error"``: something is already non-finite or will crash; ``"warning"``: a
        documented threshold was crossed; ``"info"``: context, or a check that could not
        apply and why. One of the severities the table lists for the code.
    where : str
        Human-readable place: a module, a parameter, the loss, batch rows, a step.
    evidence : dict
        The measured numbers that triggered it and the ``threshold``.
    advice : str
        One sentence.
    fix : str
        A short code snippet, where one helps (else ``""``).
    event : int or None
        Index in ``Trace.events`` to jump to.
    param : str or None
        Qualified parameter name to select.
    module : str or None
        Qualified module name (``""`` is the model itself).
    rows : list of int
        Batch rows concerned.
    step : int or None
        Training step (findings recorded by a guard's history).
    """

    code: CheckCode
    severity: Severity
    where: str
    evidence: dict[str, Any]
    advice: str
    fix: str = ""
    event: int | None = None
    param: str | None = None
    module: str | None = None
    rows: list[int] = field(default_factory=list)
    step: int | None = None
    position: float = field(default=math.inf, repr=False)

    def __post_init__(self) -> None:
        if self.severity not in _SEVERITY_RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}; got {self.severity!r}.")
        known = code_of(self.code)
        if known is not None:  # a code of the table (a recorded one may come from elsewhere)
            self.code = known
            if self.severity not in allowed_severities(known):
                raise ValueError(
                    f"a {known} finding is {' or '.join(allowed_severities(known))}; "
                    f"got {self.severity!r}."
                )
        if self.event is not None and self.position == math.inf:
            self.position = float(self.event)

    @property
    def sort_key(self) -> tuple[int, float, int, str]:
        return (
            _SEVERITY_RANK[self.severity],
            self.position,
            _CODE_RANK.get(self.code, 99),
            self.where,
        )

    @property
    def message(self) -> str:
        """``"error log_of_nonpositive at the loss: <advice>"``."""
        return f"{self.severity} {self.code} at {self.where}: {self.advice}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, float, list, dict): storable in a guard history and a snapshot."""
        d = asdict(self)
        d.pop("position")
        d["code"] = str(self.code)
        d["evidence"] = {k: _plain(v) for k, v in self.evidence.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        kw = {k: d[k] for k in _FIELDS if k in d}
        kw.setdefault("evidence", {})
        kw.setdefault("advice", "")
        kw["rows"] = list(kw.get("rows") or [])
        kw["evidence"] = dict(kw["evidence"] or {})
        return cls(**kw)

    def __repr__(self) -> str:
        ev = ", ".join(f"{k}={_short(v)}" for k, v in list(self.evidence.items())[:4])
        return f"Finding({self.severity} {self.code} at {self.where}: {ev})"


#: The fields of a stored finding (``Finding.to_dict``), in the order of the table view.
_FIELDS = (
    "code",
    "severity",
    "where",
    "evidence",
    "advice",
    "fix",
    "event",
    "param",
    "module",
    "rows",
    "step",
)
#: The columns of ``Findings.to_frame()``.
FRAME_COLUMNS: tuple[str, ...] = (
    "severity",
    "code",
    "where",
    "advice",
    "evidence",
    "event",
    "param",
    "module",
)
FRAME_COLUMNS += ("rows", "step")


def _plural(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


class Findings(list[Finding]):
    """A list of :class:`Finding`, sorted by severity then position in the trace, with a
    table view (what :func:`nbdebug.check` returns).

    Attributes
    ----------
    counts : dict of str to int
        Findings per severity (``"error"``, ``"warning"``, ``"info"``).
    ok : bool
        No error and no warning.

    Examples
    --------
    >>> found = nbdebug.check(model, inputs=x, target=y, loss_fn=F.cross_entropy)
    >>> found.summary(), found.to_frame()
    """

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = dict.fromkeys(SEVERITIES, 0)
        for f in self:
            out[f.severity] += 1
        return out

    @property
    def ok(self) -> bool:
        """No error and no warning (information only, or nothing)."""
        return not any(f.severity in ("error", "warning") for f in self)

    def summary(self) -> str:
        """One sentence: the counts and the first finding (``"1 error, 2 warnings: first
        log_of_nonpositive at the loss."``)."""
        c = self.counts
        head = f"{_plural(c['error'], 'error')}, {_plural(c['warning'], 'warning')}"
        head += f", {c['info']} info"
        if not self:
            return "no findings."
        return f"{head}: first {self[0].code} at {self[0].where}."

    def codes(self, severity: str | None = None) -> list[str]:
        return [f.code for f in self if severity is None or f.severity == severity]

    def of(self, code: str) -> list[Finding]:
        """The findings of one code."""
        return [f for f in self if f.code == code]

    def to_frame(self) -> pd.DataFrame:
        """One row per finding: severity, code, where, advice, evidence, event, param,
        module, rows, step."""
        import pandas as pd

        records = [
            tuple(str(f.code) if k == "code" else getattr(f, k) for k in FRAME_COLUMNS)
            for f in self
        ]
        return pd.DataFrame.from_records(records, columns=list(FRAME_COLUMNS))

    def show(self, **options: object) -> object:
        """The Checks panel for these findings (an ``ipywidgets`` widget)."""
        return show_result(self, **options)

    def __repr__(self) -> str:
        c = self.counts
        head = (
            f"Findings({_plural(c['error'], 'error')}, {_plural(c['warning'], 'warning')}, "
            f"{c['info']} info)"
        )
        return "\n".join([head, *(f"  {f!r}" for f in self)])


def sort_findings(findings: Iterable[Finding]) -> Findings:
    return Findings(sorted(findings, key=lambda f: f.sort_key))


def skipped(checks: Iterable[str], why: str, **evidence: object) -> Finding:
    """The info finding of checks that could not apply (``checks``: their codes, or names
    such as ``"forward"``)."""
    names = list(checks)
    return Finding(
        CheckCode.CHECK_SKIPPED,
        "info",
        ", ".join(names),
        {"checks": names, **evidence},
        f"not checked: {why}.",
    )


def module_label(module: str | None, module_type: str = "") -> str:
    name = "<model>" if module in ("", None) else str(module)
    return f"{name} ({module_type})" if module_type else name


def _short(v: object) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in list(v)[:4]) + (", ...]" if len(v) > 4 else "]")
    return fmt_num(v)


def _plain(v: object) -> object:
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars
        return v.item()  # type: ignore[attr-defined]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


# --------------------------------------------------------------------------- trace index
def is_floating(dtype: str) -> bool:
    """A floating dtype name (``"float32"``, ``"bfloat16"``...)."""
    return dtype.startswith(("float", "bfloat"))


def is_output(e: Event) -> bool:
    """A module's output in the forward pass."""
    return e.phase == Phase.FORWARD and e.kind == EventKind.OUTPUT


class TraceView:
    """Look-ups over one :class:`~nbdebug.core.trace.result.Trace` that several checks need."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.events: list[Event] = list(trace.events)
        self.types: dict[str, str] = dict(trace.module_types or {})
        self.param_event: dict[str, int] = {}
        for e in self.events:
            if e.kind == EventKind.PARAM_GRAD and e.param and e.param not in self.param_event:
                self.param_event[e.param] = e.index
        self.loss_event = next((e.index for e in self.events if e.phase == Phase.LOSS), None)
        # the model's own outputs: module "" at depth 0 (the last call of the model)
        outs = [e for e in self.events if is_output(e) and e.module == "" and e.depth == 0]
        last_call = max((e.call for e in outs), default=None)
        self.outputs = [e for e in outs if e.call == last_call]
        self.modules = set(self.types)

    def is_leaf(self, module: str) -> bool:
        prefix = module + "." if module else ""
        return not any(m != module and m.startswith(prefix) for m in self.modules)

    def input_of(self, event: Event) -> Event | None:
        """Approximate input of a leaf module's call: the last module output completed
        before the call (the trace records module outputs, not inputs), else the batch."""
        for e in reversed(self.events[: event.index]):
            if is_output(e) and e.call != event.call:
                return e
            if e.phase == Phase.INPUT:
                return e
        return None

    def output(self, name: str | None = None) -> Event | None:
        """The model output event (``name`` picks one of several, e.g. ``"output['logits']"``)."""
        if name is not None:
            return next((e for e in self.outputs if e.name == name), None)
        floating = [e for e in self.outputs if e.shape and is_floating(e.dtype)]
        return floating[0] if floating else (self.outputs[0] if self.outputs else None)

    def ran_in(self, module: str) -> str | None:
        """The dtype a module's forward produced (under autocast, the dtype it ran in): its
        first floating output, or None when it made none."""
        for e in self.events:
            if is_output(e) and e.module == module and is_floating(e.dtype):
                return str(e.dtype)
        return None

    def position_of_param(self, name: str) -> float:
        i = self.param_event.get(name)
        return math.inf if i is None else float(i)


# --------------------------------------------------------------------------- families
#: What a check family may need from its context, and what a skipped finding says when
#: it is missing (``CheckContext.missing`` gives a more precise reason where known).
Need = Literal["trace", "backward", "inputs", "optimizer", "history"]
NEEDS: dict[Need, str] = {
    "trace": "nothing was traced",
    "backward": "the trace stopped at an error before the backward",
    "inputs": "the batch is not available (pass inputs=)",
    "optimizer": "no optimizer (pass optimizer=)",
    "history": "no training history (pass history=, a NaNGuard, or check a guard's snapshot)",
}


@dataclass
class OptimParam:
    """One parameter as an optimizer sees it (a live optimizer's or a ``state_dict``'s)."""

    name: str
    hyper: dict[str, Any]
    state: Mapping[str, Any]
    dtype: str


#: A loss function as :func:`nbdebug.trace` takes it (a function or a module).
LossFn = Callable[..., Any]


@dataclass
class CheckContext:
    """Everything :func:`nbdebug.check` resolved its source into; check families read it.

    Attributes
    ----------
    trace : Trace or None
    view : TraceView or None
        Look-ups over ``trace``.
    inputs, target, loss_fn : optional
        The batch, the labels and the loss.
    mixed_precision : bool
        A GradScaler (float16 autocast) is in use.
    optimizer_params : list of OptimParam or None
        The optimizer's per-parameter state.
    history : list of dict or None
        A guard's rolling history rows.
    scale : float or None
        The scaler's current scale.
    clip_norm : float or None
    found : list of Finding
        Findings so far (resolution notes, then each family's in turn).
    missing : dict of str to str
        Why a need of ``NEEDS`` is missing, where resolution knows better than ``NEEDS``.
    """

    trace: Trace | None = None
    view: TraceView | None = None
    inputs: object = None
    target: object = None
    loss_fn: LossFn | None = None
    mixed_precision: bool = False
    optimizer_params: list[OptimParam] | None = None
    history: list[dict[str, Any]] | None = None
    scale: float | None = None
    clip_norm: float | None = None
    found: list[Finding] = field(default_factory=list)
    missing: dict[Need, str] = field(default_factory=dict)

    def has(self, need: Need) -> bool:
        """Whether the need (a key of ``NEEDS``) is available."""
        if need == "trace":
            return self.trace is not None
        if need == "backward":
            return self.trace is not None and not self.trace.error
        if need == "inputs":
            return self.inputs is not None
        if need == "optimizer":
            return self.optimizer_params is not None
        if need == "history":
            return bool(self.history)
        raise ValueError(f"unknown check need {need!r}; expected one of {sorted(NEEDS)}.")

    def why_missing(self, need: Need) -> str:
        return self.missing.get(need, NEEDS[need])


@dataclass(frozen=True)
class CheckFamily:
    """A group of health checks that share what they need.

    Attributes
    ----------
    codes : tuple of CheckCode
        The finding codes it can give (named in ``check_skipped`` when it cannot run).
    needs : tuple of Need
        Keys of ``NEEDS``: the family runs only when the context has them all.
    run : callable
        ``run(context) -> list[Finding]``.
    fallback : callable, optional
        What still applies when a need is missing (``fallback(context) -> list[Finding]``).
    """

    codes: tuple[CheckCode, ...]
    needs: tuple[Need, ...]
    run: Callable[[CheckContext], list[Finding]]
    fallback: Callable[[CheckContext], list[Finding]] | None = None

    def __post_init__(self) -> None:
        unknown = [n for n in self.needs if n not in NEEDS]
        if unknown:
            raise ValueError(f"unknown check needs {unknown}; expected some of {sorted(NEEDS)}.")


def run_families(ctx: CheckContext, families: Iterable[CheckFamily]) -> list[Finding]:
    """Run every family whose needs ``ctx`` has; one ``check_skipped`` finding per missing
    need, naming the codes of the families it held back. Returns ``ctx.found``."""
    held: dict[Need, list[str]] = {}
    for fam in families:
        missing = next((n for n in fam.needs if not ctx.has(n)), None)
        if missing is None:
            ctx.found += fam.run(ctx)
            continue
        codes = held.setdefault(missing, [])
        codes += [c for c in fam.codes if c not in codes]
        if fam.fallback is not None:
            ctx.found += fam.fallback(ctx)
    for need, codes in held.items():
        if codes:
            ctx.found.append(skipped(codes, ctx.why_missing(need)))
    return ctx.found
