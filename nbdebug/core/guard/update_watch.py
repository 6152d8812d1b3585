"""The optimizer step as an origin: :class:`UpdateWatch` checks the optimizer update
after each passed ``guard.check()`` and catches, at its step, one that makes a weight or
an optimizer state tensor non-finite (a failure of kind ``"optimizer"``).

- Step pre/post hooks on the guard's optimizer (removed by ``guard.close()`` or with the
  guard); a ``check()`` that passes arms them for the coming ``optimizer.step()`` (a step
  no check armed costs one attribute read).
- After the step: the L2 norms of the parameters (:func:`..norms.norm_vector`: one call of
  the compiled statistics kernel per device on the CPU, else one fused
  ``torch._foreach_norm`` per device and dtype; half precision accumulated in float32),
  summed, read once. Every step
  for float16/bfloat16 parameters, where the optimizer's own arithmetic underflows (an
  ``eps`` below the dtype's smallest normal); all of them, with the state tensors that
  divide the update (:data:`DENOMINATORS`: ``exp_avg_sq``...), every
  :data:`STATE_EVERY`-th step, and with every state tensor every step with
  ``"rollback"`` (reading every weight costs 1-3 % of a CPU step: bench_guard's
  ResNet-18); a float32 update gone bad in between meets the next ``check()``'s
  forward. A NaN in any other state tensor (``exp_avg``, a momentum buffer) reaches the
  weights in its step; only an overflowing denominator (an update of 0) leaves them
  finite.
- Only when the sum is not finite: an element-wise look names the parameter, the state
  tensor (``exp_avg_sq``) and why (:class:`~nbdebug.core.vocab.UpdateFault`).
- ``check_update="rollback"`` copies the parameters and the state before each armed step
  (into buffers reused across steps): a bad update is undone exactly, and its snapshot holds
  the pre-step state and the gradients the step consumed (``update_grads``), so
  ``snap.trace()`` replays the update alone
  (:func:`nbdebug.core.guard.update_replay.with_update_origin`). Without it the
  failure is recorded and snapshotted, but cannot be undone: ``"skip"`` raises.

The snapshot's ``reason`` holds ``param``, ``state``, ``fault``, ``lr``, ``eps``,
``dtype`` and ``rolled_back``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..measure import exact_vector
from ..norms import norm_vector, plain_sums
from ..snapshot.write import TrainingObjects
from ..stats import finalize, has_nan, has_nonfinite
from ..trace.events import Event
from ..vocab import EventKind, FailureKind, Phase, UpdateFault
from .failure import record_error, streak_error

if TYPE_CHECKING:  # pragma: no cover
    from ..state import RngState
    from .guard import NaNGuard

__all__ = [
    "PreStep",
    "UpdateLook",
    "UpdateOrigin",
    "UpdateWatch",
    "check_update_mode",
    "look_update",
    "update_nonfinite",
]

_HALF = (torch.float16, torch.bfloat16)
#: state tensors that divide the update (where a 0/0 happens), most specific first
DENOMINATORS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta")
ROLLBACK = "rollback"
#: without rollback, the state tensors are read every this many watched steps (the
#: parameters every step): a NaN in the state reaches the weights at once, only an
#: overflowing second moment (Inf, an update of 0) leaves them finite
STATE_EVERY = 10


def check_update_mode(value: object) -> None:
    """Refuse a ``check_update`` that is not ``True``, ``False``, ``None`` or ``"rollback"``."""
    if value is None or isinstance(value, bool) or value == ROLLBACK:
        return
    raise ValueError(f"check_update must be True, False, None or 'rollback'; got {value!r}.")


# ---------------------------------------------------------------------- the tensors
def _entries(opt: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, str | None, torch.Tensor]]:
    """``(param, state key or None, tensor)`` for every parameter, then every tensor of its
    state, in the optimizer's order."""
    for g in opt.param_groups:
        for p in g["params"]:
            yield p, None, p
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    yield p, k, v


def update_nonfinite(
    opt: torch.optim.Optimizer,
    *,
    state: bool = True,
    half_only: bool = False,
    keys: tuple[str, ...] | None = None,
    sums: dict[int, torch.Tensor] | None = None,
) -> bool:
    """Whether a parameter (or, with ``state``, a floating state tensor) of ``opt`` may
    hold NaN/Inf: the norms of each device's tensors in one call (half precision
    accumulated in float32), their sum read once; ``half_only``: only the float16/bfloat16
    parameters (and their state); ``keys``: only these state tensors (``None``: all). ``True`` can
    also mean finite values whose squares overflow (the element-wise :func:`look_update`
    tells); ``False`` means finite. ``sums``: filled with each ``exp_avg_sq``'s sum (by
    its parameter's ``id``; read with the rest, for the per-layer signals)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    second: list[tuple[int, torch.Tensor]] = []  # (id(param), exp_avg_sq): summed
    for g in opt.param_groups:
        for p in g["params"]:
            if half_only and p.dtype not in _HALF:
                continue  # (before its state is looked at: this runs at every step)
            watched = [p]
            if state:
                for k, v in opt.state.get(p, {}).items():
                    if k == "exp_avg_sq" and sums is not None and isinstance(v, torch.Tensor):
                        second.append((id(p), v.detach()))
                    elif keys is None or k in keys:
                        watched.append(v)
            for t in watched:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    groups.setdefault(t.device, []).append(t.detach())
    # the statistics engine's norms: one kernel call per device on the CPU, else one
    # fused norm per dtype (half precision accumulated in float32)
    totals = [norm_vector(ts, device=dev, dtype=torch.float32).sum() for dev, ts in groups.items()]
    if second and sums is not None:  # finite sums of v mean a finite v
        v_sums = plain_sums([v for _, v in second])
        sums.update((key, s) for (key, _), s in zip(second, v_sums))
        totals += [s.float() for s in v_sums]
    if not totals:
        return False
    first = totals[0].device
    total = torch.stack([v.to(first) for v in totals]).sum()
    return not math.isfinite(float(total))


@dataclass
class PreStep:
    """A copy of an optimizer's parameters and state tensors before a step, into buffers
    reused while the layout (tensors, shapes, dtypes) stays the same."""

    layout: list[tuple[int, str | None, torch.Size, torch.dtype, torch.device]] = dataclasses.field(
        default_factory=list
    )
    copies: list[torch.Tensor] = dataclasses.field(default_factory=list)
    others: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def capture(self, opt: torch.optim.Optimizer) -> None:
        """Copy every parameter and state tensor of ``opt`` now."""
        entries = list(_entries(opt))
        layout = [(id(p), k, t.shape, t.dtype, t.device) for p, k, t in entries]
        src = [t.detach() for _, _, t in entries]
        if layout != self.layout:
            self.layout, self.copies = layout, [t.clone() for t in src]
        elif src:
            try:
                torch._foreach_copy_(self.copies, src)
            except (RuntimeError, TypeError):  # tensors on several devices
                for c, t in zip(self.copies, src):
                    c.copy_(t)
        self.others = {
            id(p): {
                k: v for k, v in opt.state.get(p, {}).items() if not isinstance(v, torch.Tensor)
            }
            for g in opt.param_groups
            for p in g["params"]
        }

    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The copied state tensors of parameter ``p`` by key."""
        return {k: c for (i, k, *_), c in zip(self.layout, self.copies) if i == id(p) and k}

    def restore(self, opt: torch.optim.Optimizer) -> None:
        """Put the copied parameters and state back into ``opt`` (in place; a state that
        did not exist before the step is removed)."""
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for (i, k, *_), c in zip(self.layout, self.copies):
                if k is None:
                    continue
                by_param.setdefault(i, {})[k] = c
            for g in opt.param_groups:
                for p in g["params"]:
                    self._restore_param(opt, p, by_param.get(id(p), {}))

    def _restore_param(
        self, opt: torch.optim.Optimizer, p: torch.Tensor, saved: dict[str, torch.Tensor]
    ) -> None:
        own = next(c for (i, k, *_), c in zip(self.layout, self.copies) if i == id(p) and not k)
        p.copy_(own)
        others = self.others.get(id(p), {})
        if not saved and not others:
            opt.state.pop(p, None)
            return
        st = opt.state[p]
        for k in [k for k in st if k not in saved and k not in others]:
            del st[k]
        for k, c in saved.items():
            cur = st.get(k)
            same = isinstance(cur, torch.Tensor) and cur.shape == c.shape and cur.dtype == c.dtype
            st[k] = cur.copy_(c) if same else c.clone()
        st.update(others)


# ---------------------------------------------------------------------- the look
@dataclass
class UpdateLook:
    """What an element-wise look at a non-finite update found (the origin's facts): the
    parameter (as in ``model.named_parameters()``), the state tensor involved
    (``"exp_avg_sq"`` or ``None``), the fault, the non-finite tensor after the update (the
    state tensor for a state fault, else the parameter), the group's ``lr`` and ``eps``,
    the dtype the fault is judged in, and the optimizer's class name."""

    param: str
    state: str | None
    fault: UpdateFault
    tensor: torch.Tensor
    lr: float | None
    eps: float | None
    dtype: str
    optimizer: str

    def why(self) -> str:
        """The fault in words."""
        dt = getattr(torch, self.dtype)
        fi = torch.finfo(dt)
        f = self.fault
        if f == UpdateFault.EPS_BELOW_NORMAL:
            return (
                f"eps={self.eps:g} is below the smallest normal {self.dtype} ({fi.tiny:.3g}), "
                f"so 0/0 where {self.state or 'the denominator'} is 0"
            )
        if f == UpdateFault.LR_OVERFLOW:
            return f"the learning rate ({self.lr:.3g}) times the update overflowed {self.dtype}"
        if f == UpdateFault.STATE_NONFINITE:
            return f"its {self.state} already held NaN/Inf before the step"
        if f == UpdateFault.STATE_OVERFLOW:
            return f"its {self.state} overflowed {self.dtype} (max {fi.max:.3g})"
        return "a 0/0 in the update"

    def message(self, step: int | None) -> str:
        """The failure's sentence."""
        what = f"{self.param}'s {self.state}" if self.state and self.tensor_is_state else self.param
        at = "" if step is None else f" at step {step}"
        return f"the {self.optimizer} step{at} made {what} non-finite: {self.why()}"

    @property
    def tensor_is_state(self) -> bool:
        return self.fault in (UpdateFault.STATE_NONFINITE, UpdateFault.STATE_OVERFLOW)

    def reason(self, step: int, action: str, rolled_back: bool) -> dict[str, Any]:
        """The snapshot's ``reason`` (plain data)."""
        return {
            "kind": FailureKind.OPTIMIZER,
            "message": self.message(step),
            "step": step,
            "param": self.param,
            "state": self.state,
            "fault": self.fault,
            "lr": self.lr,
            "eps": self.eps,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "action": action,
            "rolled_back": rolled_back,
        }

    def event(self, index: int) -> UpdateOrigin:
        """The origin event (phase ``"optimizer"``)."""
        stats, hist = finalize(exact_vector(self.tensor).cpu().numpy())
        module = self.param.rsplit(".", 1)[0] if "." in self.param else ""
        return UpdateOrigin(
            index=index,
            phase=Phase.OPTIMIZER,
            module=module,
            kind=EventKind.UPDATE,
            name=self.state if self.tensor_is_state and self.state else self.param,
            shape=tuple(self.tensor.shape),
            dtype=str(self.tensor.dtype).replace("torch.", ""),
            stats=stats,
            hist=hist,
            op=f"{self.optimizer}.step",
            param=self.param,
            note=self.message(None),
            state=self.state,
            fault=self.fault,
        )


@dataclass(repr=False)
class UpdateOrigin(Event):
    """An origin in the optimizer step (``phase="optimizer"``, ``kind="update"``): an
    :class:`~nbdebug.core.trace.Event` with the state tensor involved (``state``,
    ``"exp_avg_sq"`` or ``None``) and why (``fault``, an
    :class:`~nbdebug.core.vocab.UpdateFault`); ``param`` names the parameter, ``op`` the
    optimizer's step (``"Adam.step"``)."""

    state: str | None = None
    fault: UpdateFault | None = None


def _number(v: object) -> float | None:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _classify(
    p: torch.Tensor,
    group: dict[str, Any],
    state: dict[str, Any],
    before: dict[str, torch.Tensor] | None,
) -> tuple[UpdateFault, str | None, torch.dtype]:
    """The fault, the state key involved and the dtype it is judged in."""
    floating = {
        k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    denom = next((k for k in DENOMINATORS if k in floating), None)
    dtype = floating[denom].dtype if denom else p.dtype
    was = [k for k, v in (before or {}).items() if v.is_floating_point() and has_nonfinite(v)]
    if was:
        return UpdateFault.STATE_NONFINITE, was[0], floating.get(was[0], p).dtype
    eps = _number(group.get("eps"))
    if eps is not None and eps < torch.finfo(dtype).tiny and has_nan(p):
        return UpdateFault.EPS_BELOW_NORMAL, denom, dtype
    bad = [k for k, v in floating.items() if k != "step" and has_nonfinite(v)]
    if bad:
        nan = any(has_nan(floating[k]) for k in bad)
        fault = (
            UpdateFault.STATE_NONFINITE if nan and before is None else UpdateFault.STATE_OVERFLOW
        )
        return fault, bad[0], floating[bad[0]].dtype
    lr = _number(group.get("lr"))
    if bool(torch.isinf(p).any()) or (lr is not None and abs(lr) > torch.finfo(p.dtype).max):
        # finite state and gradients: only a step too large makes an Inf (and inf * 0 a NaN)
        return UpdateFault.LR_OVERFLOW, None, p.dtype
    return UpdateFault.ZERO_OVER_ZERO, denom, dtype


def look_update(
    opt: torch.optim.Optimizer, names: dict[int, str], pre: PreStep | None = None
) -> UpdateLook | None:
    """The first parameter in ``opt``'s order whose value or state is non-finite after
    its step, and why (``pre``: the state before the step, when it was copied);
    ``None`` when everything is finite."""
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            st = opt.state.get(p, {})
            bad_state = [k for k, v in st.items() if k != "step" and has_nonfinite(v)]
            if not has_nonfinite(p) and not bad_state:
                continue
            before = pre.state_of(p) if pre is not None else None
            fault, key, dtype = _classify(p, g, st, before)
            shown = st[key] if key and fault in _STATE_FAULTS and key in st else p
            return UpdateLook(
                param=names.get(id(p), f"param_groups[{gi}][{pi}]"),
                state=key,
                fault=fault,
                tensor=shown.detach(),
                lr=_number(g.get("lr")),
                eps=_number(g.get("eps")),
                dtype=str(dtype).replace("torch.", ""),
                optimizer=type(opt).__name__,
            )
    return None


_STATE_FAULTS = (UpdateFault.STATE_NONFINITE, UpdateFault.STATE_OVERFLOW)


# ---------------------------------------------------------------------- the watch
def _hook(ref: weakref.ReferenceType[UpdateWatch], after: bool) -> Callable[..., None]:
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        watch = ref()
        if watch is not None:
            watch.after_step(opt) if after else watch.before_step(opt)

    return hook


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class UpdateWatch:
    """The guard's watch over its optimizer's steps (see the module docstring).

    Attributes
    ----------
    rollback : bool
        A pre-step copy is kept, so a bad update is undone.
    streak : int
        Bad updates in a row.
    watched : int
        Optimizer steps watched so far.
    """

    def __init__(self, guard: NaNGuard, optimizer: torch.optim.Optimizer, rollback: bool):
        self.guard = weakref.ref(guard)
        self.rollback = rollback
        self.pre = PreStep()
        self.streak = 0
        self.watched = 0  # steps watched
        self._armed: tuple[int, tuple[Any, Any], RngState] | None = None
        self._pending: tuple[int, tuple[Any, Any], RngState] | None = None
        ref = weakref.ref(self)
        self.handles = [
            optimizer.register_step_pre_hook(_hook(ref, after=False)),
            optimizer.register_step_post_hook(_hook(ref, after=True)),
        ]
        weakref.finalize(self, _remove, self.handles)

    @classmethod
    def create(cls, guard: NaNGuard) -> UpdateWatch | None:
        """The watch ``guard``'s options ask for (``None``: off, or no optimizer)."""
        mode = guard.options.checks.check_update
        if not mode or guard.optimizer is None:
            return None
        return cls(guard, guard.optimizer, rollback=mode == ROLLBACK)

    def arm(self, step: int, batch: tuple[Any, Any], rng: RngState) -> None:
        """Watch the coming optimizer step, that of the checked ``step``."""
        self._armed = (step, batch, rng)

    def close(self) -> None:
        """Remove the hooks from the optimizer."""
        _remove(self.handles)
        self._armed = self._pending = None

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        self._pending, self._armed = self._armed, None
        guard = self.guard()
        if guard is not None and guard.meter.signals is not None:
            guard.meter.signals.offer_sums(None)  # what the last step left is changing
        if self._pending is not None and self.rollback:
            self.pre.capture(opt)

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        pending, self._pending = self._pending, None
        guard = self.guard()
        if pending is None or guard is None:
            return
        full = self.rollback or self.watched % STATE_EVERY == 0
        self.watched += 1
        # of the state, the tensors that divide the update (a NaN elsewhere reaches the
        # weights in its step); with rollback, all of them
        keys = None if self.rollback else DENOMINATORS
        signals = guard.meter.signals
        sums: dict[int, torch.Tensor] | None = {} if full and signals is not None else None
        bad = update_nonfinite(opt, state=full, half_only=not full, keys=keys, sums=sums)
        if signals is not None and sums:
            signals.offer_sums(sums)  # the next check's Adam lag reads no state of its own
        look = look_update(opt, _names(guard)) if bad else None
        if look is None:
            self.streak = 0
            return
        self._fail(guard, opt, pending, look)

    def _fail(
        self,
        guard: NaNGuard,
        opt: torch.optim.Optimizer,
        pending: tuple[int, tuple[Any, Any], RngState],
        look: UpdateLook,
    ) -> None:
        step, batch, rng = pending
        action = guard.options.failure.on_nonfinite
        rolled = self.rollback and action != "continue"
        grads = None
        if self.rollback:
            look = look_update(opt, _names(guard), self.pre) or look  # knows the state before
        if rolled:
            names = _names(guard)
            grads = {
                names[id(p)]: p.grad.detach().clone()
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None and id(p) in names
            }
            look.tensor = look.tensor.clone()
            self.pre.restore(opt)
        reason = look.reason(step, action, rolled)
        path = self._write(guard, step, reason, batch, rng, grads)
        _mark_row(guard, step, path, rolled)
        guard.ok = False
        self.streak += 1
        patience = guard.options.failure.patience
        cannot_skip = action == "skip" and not rolled
        message = reason["message"]
        if cannot_skip:
            message += "; the update cannot be undone without NaNGuard(check_update='rollback')"
        too_many = patience is not None and self.streak > patience
        if action == "raise" or cannot_skip or too_many:
            err = streak_error(
                message,
                (path, step, reason),
                raised=action == "raise" or cannot_skip,
                streak=self.streak,
                patience=patience,
            )
            raise record_error(err)

    def _write(
        self,
        guard: NaNGuard,
        step: int,
        reason: dict[str, Any],
        batch: tuple[Any, Any],
        rng: RngState,
        grads: dict[str, torch.Tensor] | None,
    ) -> Any:
        objects = TrainingObjects(guard.model, guard.optimizer, guard.scheduler, guard.scaler)
        writer = guard.writer
        writer.set_field("update_grads", grads)
        try:
            return writer.write(objects, step, reason, batch, rng=rng, history=list(guard.history))
        except OSError as e:  # a full or unwritable disk: the step is still handled
            warnings.warn(
                f"nbdebug: the snapshot of step {step} could not be written to "
                f"{writer.directory} ({type(e).__name__}: {e}).",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        finally:
            writer.set_field("update_grads", None)


def _names(guard: NaNGuard) -> dict[int, str]:
    return {id(p): n for n, p in guard.model.named_parameters()}


def _mark_row(guard: NaNGuard, step: int, path: Any, rolled: bool) -> None:
    """The step's history row records the failure (and the skipped update)."""
    rows = [r for r in guard.history if r.get("step") == step]
    if not rows:
        return
    row = rows[-1]
    row["nonfinite"] = FailureKind.OPTIMIZER
    if path is not None:
        row["snapshot"] = str(path)
    if not rolled:
        return
    row["skipped"] = True
    skips = guard.skips
    skips.total += 1
    skips.in_row += 1
    skips.last_kind, skips.last_reason, skips.last_step = (
        FailureKind.OPTIMIZER,
        "non-finite optimizer update",
        step,
    )
    row["skip_reason"] = skips.last_reason
    row["skips"], row["skips_in_row"] = skips.total, skips.in_row
