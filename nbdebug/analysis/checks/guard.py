"""The health checks a :class:`~nbdebug.NaNGuard` runs on its live model: :class:`GuardChecks`,
and the resolver that makes ``NaNGuard(checks=True)`` (or a number of steps, or a dict)
mean them.

Core never imports analysis: the guard calls whatever
:class:`~nbdebug.core.guard.StepChecks` it is given, and turns the other ``checks=`` forms
into one through the resolver :func:`register` hands core
(:func:`nbdebug.core.guard.register_checks`); ``import nbdebug`` arranges that
:func:`register` runs when a guard first needs it (:mod:`nbdebug.core.sources`). Both ways::

    guard = nbdebug.NaNGuard(model, opt, checks=GuardChecks(every=50, clip_norm=1.0))
    guard = nbdebug.NaNGuard(model, opt, checks=True)   # or 50, or {"every": 50, "clip_norm": 1.0}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

from ...core.guard import GuardView, StepChecks, StepReading, register_checks
from .base import (
    CHECK_EVERY,
    Band,
    CheckFamily,
    Finding,
    check_clip_norm,
    position,
    skipped,
)
from .codes import CheckCode
from .forward import weight_findings
from .grad import grad_findings, history_grad_findings, live_param_infos
from .optim import (
    adam_findings,
    adam_moments,
    clip_findings,
    lr_findings,
    optimizer_params,
    scaler_findings,
)

__all__ = [
    "FAMILIES",
    "GuardChecks",
    "guard_findings",
    "parse_checks",
    "recorded_findings",
    "register",
    "resolve_checks",
]


def parse_checks(checks: object) -> dict[str, Any] | None:
    """``NaNGuard(checks=...)``: ``True`` (every ``CHECK_EVERY`` steps), a positive int (every
    that many steps), or ``{"every": int, "clip_norm": float}``; ``False``/``None``/``0``: off."""
    if checks is None or checks is False or (isinstance(checks, int) and checks == 0):
        return None
    if checks is True:
        return {"every": CHECK_EVERY, "clip_norm": None}
    if isinstance(checks, int) and not isinstance(checks, bool):
        if checks < 1:
            raise ValueError(
                f"checks must be True, a positive number of steps or a dict; got {checks!r}."
            )
        return {"every": checks, "clip_norm": None}
    if isinstance(checks, Mapping):
        unknown = set(checks) - {"every", "clip_norm"}
        if unknown:
            raise ValueError(
                f"checks accepts the keys 'every' and 'clip_norm'; got {sorted(unknown)}."
            )
        every = checks.get("every", CHECK_EVERY)
        clip = checks.get("clip_norm")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checks['every'] must be a positive int; got {every!r}.")
        return {"every": every, "clip_norm": check_clip_norm(clip, "checks['clip_norm']")}
    raise ValueError(f"checks must be True, a positive number of steps or a dict; got {checks!r}.")


@dataclass
class GuardChecks(StepChecks):
    """The cheap health checks (no forward) every ``every`` guarded steps and on every
    failing one, recorded in the guard's history row: ``row["checks"]`` (warnings and
    errors; information once per guard) and the Adam moments in ``row["adam"]``.

    Parameters
    ----------
    every : int
        Check every this many steps (``CHECK_EVERY``, 50, by default).
    clip_norm : float, optional
        The ``max_norm`` of your gradient clipping (for the clipping checks).

    Attributes
    ----------
    calls : int
        Steps seen so far.
    last_step : int or None
        The step of the last check (schedule findings are reported once).

    Examples
    --------
    >>> guard = NaNGuard(model, opt, checks=GuardChecks(every=10, clip_norm=1.0))
    """

    every: int = CHECK_EVERY
    clip_norm: float | None = None
    calls: int = field(default=0, init=False, repr=False)
    last_step: int | None = field(default=None, init=False, repr=False)
    _seen: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)
    _guard: GuardView | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parse_checks({"every": self.every, "clip_norm": self.clip_norm})  # validates
        if self.clip_norm is not None:
            self.clip_norm = float(self.clip_norm)

    @classmethod
    def from_option(cls, checks: object) -> GuardChecks | None:
        """A ``GuardChecks`` from the ``checks=`` forms of :func:`parse_checks`
        (``None`` when off); a ``GuardChecks`` passes through."""
        if isinstance(checks, GuardChecks):
            return checks
        opts = parse_checks(checks)
        return None if opts is None else cls(**opts)

    def attach(self, guard: GuardView) -> None:
        """One guard per ``GuardChecks``: it keeps that guard's cadence and records."""
        if self._guard is not None and self._guard is not guard:
            raise ValueError(
                "this GuardChecks already serves another NaNGuard: give each guard its own."
            )
        self._guard = guard

    def run(self, guard: GuardView, reading: StepReading, *, failing: bool) -> dict[str, Any]:
        """Every ``every`` calls (and on a failing step) run :func:`guard_findings`; returns
        ``{"checks": [...], "adam": {...}}`` for the step's history row, ``{}`` otherwise.
        Never raises: a failing check is recorded as an info finding."""
        n = self.calls
        self.calls += 1
        if n % self.every and not failing:
            return {}
        out: dict[str, Any] = {}
        try:
            moments = None
            if guard.optimizer is not None:
                moments = adam_moments(optimizer_params(guard.optimizer, guard.model))
                if moments:
                    out["adam"] = moments
            findings = guard_findings(
                guard,
                reading=reading,
                clip_norm=self.clip_norm,
                since_step=self.last_step,
                moments=moments,
            )
        except Exception as e:  # a diagnosis aid must never stop the training loop
            findings = [
                Finding(
                    CheckCode.CHECK_SKIPPED,
                    "info",
                    "guard checks",
                    {"error": f"{type(e).__name__}: {e}"[:300]},
                    "not checked: the health checks failed on this step.",
                )
            ]
        self.last_step = reading.step
        keep = []
        for f in findings:
            if f.severity == "info":
                key = (f.code, f.where)
                if f.code == "check_skipped" or key in self._seen:
                    continue
                self._seen.add(key)
            keep.append(f.to_dict())
        out["checks"] = keep
        return out


def resolve_checks(checks: object) -> StepChecks | None:
    """The ``checks=`` option as a :class:`~nbdebug.core.guard.StepChecks`: a
    ``StepChecks`` object as it is, ``True`` / a number of steps / a dict as a new
    :class:`GuardChecks` (see :func:`parse_checks`), ``False``/``None``/``0``: off."""
    if isinstance(checks, StepChecks):
        return checks
    return GuardChecks.from_option(checks)


def register() -> None:
    """Make ``NaNGuard(checks=True | int | dict)`` mean :class:`GuardChecks` (called by the
    source ``import nbdebug`` adds to :mod:`nbdebug.core.sources`)."""
    register_checks(resolve_checks)


def guard_findings(
    guard: GuardView,
    *,
    reading: StepReading | None = None,
    clip_norm: float | None = None,
    since_step: int | None = None,
    moments: dict[str, list[float]] | None = None,
) -> list[Finding]:
    """The cheap checks (no forward) on what a :class:`NaNGuard` has: the model's weights and
    ``.grad`` (non-finite, vanishing/exploding ratios), the total gradient norm against the
    history, the optimizer's state, the learning rate, clipping and the scaler's scale.

    With ``reading`` (the step just read, whose row is the last of the history) the
    history before it is the reference, and schedule findings older than ``since_step`` are
    left out; ``moments`` are the Adam moments when already measured (:func:`adam_moments`).
    """
    model = guard.model
    rows: list[dict[str, Any]] = [dict(r) for r in guard.history]
    past = rows[:-1] if reading is not None and rows else rows
    current = rows[-1] if rows else {}
    recorded = current.get("step")
    step = reading.step if reading is not None else recorded if isinstance(recorded, int) else None
    grad_norm = reading.grad_norm if reading is not None else _num(current.get("grad_norm"))
    scale = reading.scale if reading is not None else _num(current.get("scale"))
    params = live_param_infos(model)
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    out: list[Finding] = []
    out += weight_findings(params)
    if any(p.grad_norm is not None for p in params) or not params:
        out += grad_findings(params, module_types=types)
    else:
        out.append(
            skipped(
                ["nonfinite_gradient", "vanishing_gradient", "exploding_gradient"],
                "no parameter has a .grad (call the checks after backward)",
            )
        )
    out += history_grad_findings(past, grad_norm)
    opt = guard.optimizer
    if opt is not None:
        out += adam_findings(optimizer_params(opt, model), past, moments=moments)
    sched = lr_findings(rows)
    if since_step is not None:
        sched = [f for f in sched if f.step is None or f.step > since_step]
    out += sched
    out += clip_findings(rows, clip_norm)
    if guard.scaler is not None:
        out += scaler_findings(rows, scale)
    for f in out:
        if f.step is None:
            f.step = step
    return out


def _num(v: object) -> float | None:
    if v is None or isinstance(v, bool) or not isinstance(v, (SupportsFloat, str)):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def recorded_findings(rows: list[dict[str, Any]], live: list[Finding]) -> list[Finding]:
    """Findings a guard recorded in its history (``row["checks"]``), once per (code, where)
    with the first and last step, unless a live check found the same thing."""
    seen = {(f.code, f.where) for f in live}
    acc: dict[tuple[str, str], Finding] = {}
    for r in rows:
        for d in r.get("checks") or []:
            if not isinstance(d, Mapping) or "code" not in d:
                continue
            key = (str(d.get("code")), str(d.get("where", "")))
            if key in seen:
                continue
            step = r.get("step")
            f = acc.get(key)
            if f is None:
                try:
                    f = Finding.from_dict(d)
                except (TypeError, ValueError):
                    continue
                f.step = step if isinstance(step, int) else f.step
                f.evidence["first_step"] = step
                f.evidence["times"] = 0
                f.position = position(Band.RECORDED, step if isinstance(step, int) else 0)
                acc[key] = f
            f.evidence["last_step"] = step
            f.evidence["times"] += 1
    for f in acc.values():
        f.advice = f"recorded by the guard at step {f.evidence['first_step']}: {f.advice}"
    return list(acc.values())


#: What a guard recorded, for :func:`nbdebug.check` of its history or snapshot.
FAMILIES = (
    # codes: whatever the guard recorded (no code of its own)
    CheckFamily((), ("history",), lambda ctx: recorded_findings(ctx.history or [], ctx.found)),
)
