"""The fixes of a failed optimizer update (an origin with phase ``"optimizer"``):
``optimizer_eps`` (an eps that the optimizer state's dtype can hold), ``state_float32``
(the update and the optimizer state in float32) and ``reset_state`` (the non-finite
optimizer state started afresh). Each changes the replay's copy of the optimizer for the
block and is verified, like every fix, by replaying the whole step and its update."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...core.stats import has_nonfinite
from ...core.trace import Trace
from ...core.vocab import FixKind, Phase
from .fix import Fix, Replay
from .fix_optim import LowerLRFix

__all__ = [
    "EpsGroup",
    "OptimizerEpsFix",
    "ResetStateFix",
    "StateFloat32Fix",
    "eps_groups",
    "update_fixes",
    "valid_eps",
]

_HALF = (torch.float16, torch.bfloat16)
_HALF_NAMES = ("float16", "bfloat16")
#: the eps a dtype whose smallest normal is far below it gets (torch.optim.Adam's default)
DEFAULT_EPS = 1e-8


def valid_eps(dtype: torch.dtype) -> float:
    """The eps proposed for optimizer state of ``dtype``: the smallest power of ten at or
    above its smallest normal number, and at least ``1e-8`` (float16: ``1e-4``)."""
    tiny = torch.finfo(dtype).tiny
    return max(DEFAULT_EPS, 10.0 ** math.ceil(math.log10(tiny)))


def _optimizer(replay: Replay, what: str) -> torch.optim.Optimizer:
    if replay.optimizer is None:
        raise ValueError(f"no optimizer to step: {what} changes nothing here.")
    return replay.optimizer


def _group_dtype(opt: torch.optim.Optimizer, group: dict[str, Any]) -> torch.dtype:
    """The dtype of the group's parameters and state with the largest smallest normal."""
    dtypes = {p.dtype for p in group["params"] if p.is_floating_point()}
    for p in group["params"]:
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim():
                dtypes.add(v.dtype)
    return max(dtypes or {torch.float32}, key=lambda d: torch.finfo(d).tiny)


def _half_trace(trace: Trace) -> bool:
    return any(p.dtype in _HALF_NAMES for p in trace.params)


@dataclass(frozen=True)
class EpsGroup:
    """One parameter group's ``eps`` and the dtype it is judged in (that of its parameters
    and state with the largest smallest normal)."""

    eps: float
    dtype: str
    optimizer: str

    @property
    def tiny(self) -> float:
        return float(torch.finfo(getattr(torch, self.dtype)).tiny)

    @property
    def below_normal(self) -> bool:
        """``eps`` is below the smallest normal number of the dtype (0 included): where
        the state is 0 the update divides 0 by 0."""
        return self.eps < self.tiny


def eps_groups(opt: torch.optim.Optimizer | None) -> list[EpsGroup]:
    """The ``eps`` of every parameter group that has a numeric one, with its dtype."""
    if opt is None:
        return []
    out = []
    for g in opt.param_groups:
        eps = g.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            continue
        dtype = str(_group_dtype(opt, g)).replace("torch.", "")
        out.append(EpsGroup(float(eps), dtype, type(opt).__name__))
    return out


class OptimizerEpsFix(Fix):
    """Every parameter group whose ``eps`` is below the smallest normal number of its
    state's dtype gets :func:`valid_eps` of that dtype for the update (``eps=1e-8`` rounds
    to 0 in float16, ``eps=0`` is no eps in any dtype, and a zero gradient entry then
    divides 0 by 0).

    Parameters
    ----------
    groups : list of EpsGroup, optional
        The optimizer's eps per group (:func:`eps_groups`): the fix applies when one is
        below the smallest normal of its dtype. Without it: when the weights are in half
        precision.

    Examples
    --------
    >>> from nbdebug.analysis.diagnose.fix_optstate import OptimizerEpsFix
    >>> nbdebug.diagnose(snap, fixes=[OptimizerEpsFix()])
    """

    kind = FixKind.OPTIMIZER_EPS
    locality = 0.5  # one hyper-parameter of the update

    def __init__(self, groups: list[EpsGroup] | None = None) -> None:
        super().__init__()
        self.changes: list[tuple[float, float, str]] = []  # (old, new, dtype) per group
        self.groups = None if groups is None else list(groups)
        self.optimizer = self.groups[0].optimizer if self.groups else "Adam"

    def applies(self, trace: Trace) -> bool:
        if self.groups is not None:
            return any(g.below_normal for g in self.groups)
        return _half_trace(trace)

    def why_not(self, trace: Trace | None) -> str:
        if not self.groups:
            if self.groups is not None:
                return "the optimizer has no eps: there is none to raise."
            return (
                "the weights are not in half precision: eps=1e-8 is a normal number of their dtype."
            )
        said = ", ".join(
            f"eps={g.eps:g} in {g.dtype} (smallest normal {g.tiny:.3g})" for g in self.groups[:3]
        )
        return f"every optimizer eps is a normal number of its dtype: {said}."

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        opt = _optimizer(replay, "an optimizer eps")
        old: list[tuple[dict[str, Any], float]] = []
        changes = []
        for g in opt.param_groups:
            eps = g.get("eps")
            if not isinstance(eps, (int, float)) or isinstance(eps, bool):
                continue
            dtype = _group_dtype(opt, g)
            if eps < torch.finfo(dtype).tiny:
                old.append((g, float(eps)))
                g["eps"] = valid_eps(dtype)
                changes.append((float(eps), g["eps"], str(dtype).replace("torch.", "")))
        if not old:
            raise ValueError(
                "every eps of the optimizer is a normal number of its state's dtype: "
                "there is none to raise."
            )
        self.changes = changes
        try:
            yield
        finally:
            for g, eps in old:
                g["eps"] = eps

    def describe(self) -> str:
        if not self.changes:
            return "an optimizer eps that the state's dtype can hold"
        old, new, dtype = self.changes[0]
        tiny = torch.finfo(getattr(torch, dtype)).tiny
        return f"optimizer eps {old:g} -> {new:g} (the smallest normal {dtype} is {tiny:.3g})"

    def action(self) -> str:
        return f"raising the {self.describe().removeprefix('optimizer ')}"

    def snippet(self) -> str:
        new = self.changes[0][1] if self.changes else valid_eps(torch.float16)
        return (
            f"optimizer = torch.optim.{self.optimizer}(model.parameters(), lr=lr, eps={new:g})"
            "  # eps must be a normal number of the state's dtype"
        )


class StateFloat32Fix(Fix):
    """The update in float32: the half-precision parameters, their gradients and their
    optimizer state are cast to float32 for the optimizer step (the state stays float32),
    the parameters cast back after it, as mixed precision's float32 master weights do.

    Examples
    --------
    >>> from nbdebug.analysis.diagnose.fix_optstate import StateFloat32Fix
    >>> nbdebug.diagnose(snap, fixes=[StateFloat32Fix()])
    """

    kind = FixKind.STATE_FLOAT32
    locality = 3.0  # the update, not the step's forward

    def applies(self, trace: Trace) -> bool:
        return _half_trace(trace)

    def why_not(self, trace: Trace | None) -> str:
        return "the weights are not in half precision: the optimizer state is already wide."

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        opt = _optimizer(replay, "the optimizer state's dtype")
        half = [p for g in opt.param_groups for p in g["params"] if p.dtype in _HALF]
        if not half:
            raise ValueError("no parameter is in half precision: the update is already float32.")
        low = {id(p): p.dtype for p in half}

        def widen(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for p in half:
                p.data = p.data.float()
                if p.grad is not None:
                    p.grad = p.grad.float()
                st = o.state.get(p, {})
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dtype in _HALF:
                        st[k] = v.float()

        def narrow(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            for p in half:
                p.data = p.data.to(low[id(p)])
                if p.grad is not None:
                    p.grad = p.grad.to(low[id(p)])

        handles = [opt.register_step_pre_hook(widen), opt.register_step_post_hook(narrow)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def describe(self) -> str:
        return "the update and the optimizer state in float32 (float32 master weights)"

    def snippet(self) -> str:
        return (
            "model.float()  # float32 weights and optimizer state\n"
            "with torch.autocast(device_type, dtype=torch.float16):  # half precision forward\n"
            "    loss = loss_fn(model(x), y)"
        )


class ResetStateFix(Fix):
    """The optimizer state of every parameter whose state holds NaN/Inf is dropped for
    the step, so the optimizer starts it afresh (Adam: zero moments, step 0).

    Examples
    --------
    >>> from nbdebug.analysis.diagnose.fix_optstate import ResetStateFix
    >>> nbdebug.diagnose(snap, fixes=[ResetStateFix()])
    """

    kind = FixKind.RESET_STATE
    locality = 1.5  # the state of a few parameters

    def __init__(self) -> None:
        super().__init__()
        self.params: list[str] = []

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        opt = _optimizer(replay, "resetting the optimizer state")
        names = {id(p): n for n, p in replay.model.named_parameters()}
        bad = [
            p
            for p, st in opt.state.items()
            if any(isinstance(v, torch.Tensor) and has_nonfinite(v) for v in st.values())
        ]
        if not bad:
            raise ValueError("no optimizer state tensor holds NaN/Inf: there is none to reset.")
        self.params = [names.get(id(p), "?") for p in bad]
        saved = {p: opt.state.pop(p) for p in bad}
        try:
            yield
        finally:
            for p, st in saved.items():
                opt.state[p] = st

    def describe(self) -> str:
        which = ", ".join(self.params[:3]) + (" ..." if len(self.params) > 3 else "")
        return f"the non-finite optimizer state started afresh ({which or 'its parameters'})"

    def snippet(self) -> str:
        name = self.params[0] if self.params else "name"
        return (
            "params = dict(model.named_parameters())\n"
            f"optimizer.state[params[{name!r}]].clear()  # or reload it from an earlier checkpoint"
        )


def update_fixes(
    trace: Trace | None,
    has_optimizer: bool,
    lr: float | None = None,
    groups: list[EpsGroup] | None = None,
) -> list[Fix]:
    """The update's fixes for a failing step whose forward and backward are finite (or
    whose origin is the optimizer step): they change only the update. A learning rate
    above 1 also gets one lowered to at most 1 (a step size that overflowed the weights'
    dtype is many orders of magnitude too large, more than ``lower_lr``'s x0.1);
    ``groups``: the optimizer's eps per group (:func:`eps_groups`)."""
    if not has_optimizer:
        return []
    if trace is not None and trace.first_nonfinite is not None:
        o = trace.origin
        if o is None or o.phase != Phase.OPTIMIZER:
            return []
    fixes: list[Fix] = [OptimizerEpsFix(groups), ResetStateFix(), StateFloat32Fix()]
    if lr is not None and math.isfinite(lr) and lr > 1.0:
        fixes.append(LowerLRFix(10.0 ** -math.ceil(math.log10(lr)), lr=lr))
    return fixes
