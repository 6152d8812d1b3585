"""The fix menu: the candidate fixes for a traced failing step, one per kind, module and
rows, chosen from the origin, the op-level probe and what the step carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...core.optable import OpFamily
from ...core.trace import Event, Trace
from ...core.vocab import Phase
from .divergence import Diverged, Divergence
from .fix import Fix
from .fix_builtin import BuiltinFix
from .fix_combined import combined
from .fix_epsilon import EpsilonFix
from .fix_float32 import Float32Fix
from .fix_optim import ClipGradFix, LowerLRFix, ScalerFix
from .fix_optstate import EpsGroup, update_fixes
from .fix_pseudo import UpdateRecorded, WeightsCorrupted
from .fix_rows import DropRowsFix
from .rewrite import op_family

__all__ = ["MenuContext", "Probed", "menu"]


@dataclass(frozen=True)
class Probed:
    """A fixable operation the probe saw make a non-finite value."""

    module: str | None  # None: the loss
    family: OpFamily
    source: str | None  # "file.py:line"
    filename: str | None


@dataclass
class MenuContext:
    """What the menu is chosen from besides the trace."""

    has_optimizer: bool = False
    scaler_scale: float | None = None
    lr: float | None = None
    grad_norm_ref: float | None = None
    probed: list[Probed] = field(default_factory=list)
    sites: dict[str, str] = field(default_factory=dict)  # "file.py:line" -> its filename
    corrupted: list[str] = field(default_factory=list)
    earlier: str = ""
    directory: str | None = None  # the snapshot's directory
    earlier_snapshot: str | None = None  # the latest snapshot file there before this step
    divergence: Divergence | None = None
    builtins: list[str] = field(default_factory=list)  # the built-ins hand-written chains redo
    builtin_lines: list[str] = field(default_factory=list)
    builtin_dims: dict[str, Any] = field(default_factory=dict)  # the dim each chain used
    builtin_returns: set[str] = field(default_factory=set)  # chains closed on a `return`
    # "file.py:line" of an exp -> whether it feeds a softmax / log-sum-exp (True: a shift by
    # the maximum gives the same result) or a softplus (False: it does not)
    exp_lines: dict[str, bool] = field(default_factory=dict)
    casts: list[str] = field(default_factory=list)  # explicit casts to half precision seen
    out_of_range: list[int] = field(default_factory=list)  # batch rows no dtype can square
    eps_groups: list[EpsGroup] | None = None  # the optimizer's eps per group
    # the reason of a snapshot whose update made the weights non-finite and was not rolled
    # back: it holds the weights after that update
    update_recorded: Mapping[str, Any] | None = None


_HALF = ("float16", "bfloat16")

#: ``drop_rows`` when the rows are finite and the op that failed ran in half precision:
#: after running in float32 (valid values that overflow float16), before the update fixes.
FINITE_ROWS_LOCALITY = 3.5


def menu(trace: Trace | None, ctx: MenuContext) -> list[Fix]:
    """The candidate fixes for a traced failing step, one per kind, module and rows."""
    fixes: list[Fix] = []
    origin = trace.origin if trace is not None else None
    types = trace.module_types if trace is not None else {}
    if ctx.divergence is not None:
        fixes.append(Diverged(ctx.divergence))
    if ctx.update_recorded is not None:
        fixes.append(UpdateRecorded(ctx.update_recorded))
    elif ctx.corrupted:
        fixes.append(
            WeightsCorrupted(
                ctx.corrupted,
                earlier=ctx.earlier,
                directory=ctx.directory,
                snapshot=ctx.earlier_snapshot,
            )
        )
    half = trace is not None and (_half(trace) or bool(ctx.casts))
    if origin is not None:
        eps = _epsilons(origin, ctx, types)
        fixes += eps
        if ctx.builtins:
            module = None if origin.phase == Phase.LOSS else origin.module
            fixes.append(
                BuiltinFix(
                    ctx.builtins,
                    module,
                    lines=ctx.builtin_lines,
                    dims=ctx.builtin_dims,
                    returns=ctx.builtin_returns,
                )
            )
        fixes += combined(eps)
        fixes += _drop_rows(origin, ctx, trace)
    if half:
        fixes += _float32s(origin, types)
    if ctx.has_optimizer and _grads_finite(trace) and not ctx.corrupted:
        if ctx.grad_norm_ref is not None and ctx.grad_norm_ref > 0:
            fixes.append(ClipGradFix(ctx.grad_norm_ref))
        fixes.append(LowerLRFix(0.1, lr=ctx.lr))
    fixes += update_fixes(trace, ctx.has_optimizer and not ctx.corrupted, ctx.lr, ctx.eps_groups)
    if ctx.scaler_scale is not None and ctx.scaler_scale > 1.0:
        fixes.append(ScalerFix(max(1.0, ctx.scaler_scale / 2**8)))
    return fixes


def _drop_rows(origin: Event, ctx: MenuContext, trace: Trace | None) -> list[DropRowsFix]:
    """The origin's rows (a loss origin has none: the batch rows out of any dtype's range);
    after ``float32`` when those rows are finite and the op ran in half precision."""
    rows = list(origin.samples) or ctx.out_of_range
    if not rows:
        return []
    drop = DropRowsFix(rows)
    ran_half = origin.dtype in _HALF or bool(ctx.casts)
    if ran_half and trace is not None and _batch_finite(trace):
        drop.locality = FINITE_ROWS_LOCALITY
    return [drop]


def _epsilons(origin: Event, ctx: MenuContext, types: dict[str, str]) -> list[EpsilonFix]:
    """One epsilon per (module, family): the root op's, its chain's, the probe's finds;
    ordered with the probe's first-executed operation first."""
    module = None if origin.phase == Phase.LOSS else origin.module
    cands: list[Probed] = []
    if origin.phase != Phase.INPUT:
        fam = op_family(origin.op)
        if fam:
            cands.append(Probed(module, fam, origin.source, None))
        for link in origin.chain:
            f = op_family(link.op)
            if f:
                cands.append(Probed(module, f, None, None))
    cands += ctx.probed
    fixes: dict[tuple[str | None, str], EpsilonFix] = {}
    for c in cands:
        seen = fixes.get((c.module, c.family))
        if seen is not None:
            # keep the first source, add the filename a probe found
            seen.source = seen.source or c.source
            seen.filename = seen.filename or c.filename
            continue
        filename = c.filename or (ctx.sites.get(c.source) if c.source else None)
        fixes[(c.module, c.family)] = EpsilonFix(
            c.module,
            c.family,
            source=c.source,
            filename=filename,
            module_type=types.get(c.module or "", ""),
        )
    probed = [(p.module, p.family) for p in ctx.probed]
    eps = []
    for fx in fixes.values():
        if fx.family == OpFamily.EXP and fx.source is not None:
            safe = ctx.exp_lines.get(fx.source)
            if safe is False:
                continue  # an exp that feeds a softplus: its built-in is the fix, no shift
            fx.shift_safe = safe
        eps.append(fx)
    for i, fx in enumerate(eps):
        key = (fx.module, fx.family)
        fx.order = probed.index(key) if key in probed else len(probed) + i
    return eps


def _float32s(origin: Event | None, types: dict[str, str]) -> list[Float32Fix]:
    """The origin module and up to two of its parents in float32, then the whole model."""
    mods: list[str] = []
    if origin is not None and origin.phase in (Phase.FORWARD, Phase.BACKWARD) and origin.module:
        parts = origin.module.split(".")
        mods = [".".join(parts[:i]) for i in range(len(parts), 0, -1)][:3]
    fixes = [Float32Fix(m, depth=m.count(".") + 1, module_type=types.get(m, "")) for m in mods]
    fixes.append(Float32Fix("", depth=0, module_type=types.get("", "")))
    return fixes


def _grads_finite(trace: Trace | None) -> bool:
    if trace is None:
        return True
    if any(p.grad_n_nan or p.grad_n_inf for p in trace.params):
        return False
    return not any(e.phase == Phase.BACKWARD and not e.finite for e in trace.events)


def _batch_finite(trace: Trace) -> bool:
    """The batch and the target hold no NaN/Inf."""
    return all(e.finite for e in trace.events if e.phase == Phase.INPUT)


def _half(trace: Trace) -> bool:
    if any(p.dtype in _HALF for p in trace.params):
        return True
    return any(e.dtype in _HALF for e in trace.events if e.phase == Phase.FORWARD)
