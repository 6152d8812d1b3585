"""The workbench: copies of one training step, reset before each replay, and the replay
of the whole step (forward, loss, backward, clipping, ``optimizer.step()``) with a fix."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ...core.batch import batch_size, call_model, compute_loss, named_tensors
from ...core.norms import total_norm
from ...core.optable import OpFamily
from ...core.snapshot import ResolvedStep, replay_contexts
from ...core.state import PreservedState, unique_parameters
from ...core.stats import has_nonfinite
from ...core.text import first_line
from ...core.trace import Trace, trace_step
from .fix import ContextFactory, FixLike, Replay
from .fix_builtin import BuiltinMode, step_scope
from .menu import Probed
from .probe import ProbeMode
from .result import StepOutcome

__all__ = ["Workbench", "copy_training", "training_step"]


def copy_training(
    step: ResolvedStep, purpose: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """Copies of ``step``'s model and optimizer (one ``deepcopy``, so the optimizer's state
    stays keyed by the copied parameters) for ``purpose``; a ``TypeError`` that says so
    when the model cannot be copied."""
    try:
        return copy.deepcopy((step.model, step.optimizer))
    except Exception as e:
        raise TypeError(
            f"cannot copy the {type(step.model).__qualname__} (and its optimizer) for "
            f"{purpose}: {type(e).__name__}: {e}."
        ) from e


class Workbench:
    """Copies of one training step, reset before each replay.

    The model and optimizer are deep-copied together (so the copy's optimizer holds the
    copy's parameters); the copies' weights, buffers, gradients, train flags and the
    optimizer state are put back before every replay, and the RNG set to the step's.
    Nothing here holds a reference the user's objects could be written through.

    With ``autocast`` (the default) every replay's forward and loss (and every trace of
    the step) run under the step's recorded autocast state (a snapshot's ``autocast``
    field), on the model's device type, as :meth:`nbdebug.Snapshot.trace` replays it.
    ``steps`` optimizer steps are replayed on the batch per :meth:`run`.
    """

    def __init__(self, step: ResolvedStep, *, steps: int = 1, autocast: bool = True):
        self.model, self.optimizer = copy_training(step, "the replays")
        self.inputs = _detached(step.inputs)
        self.target = _detached(step.target)
        self.loss_fn = step.loss_fn
        self.steps = steps
        self.batch_size = batch_size(step.inputs)
        self.scaler_state = step.scaler_state
        self.rng = step.rng
        self.params = unique_parameters(self.model)
        self.device = next((p.device for p in self.params), torch.device("cpu"))
        self.autocast = step.autocast if autocast else None
        # a dtype this machine lacks: one SnapshotError, now
        self.autocast_context, self.backward_context = replay_contexts(
            self.autocast, self.device, instead="call nbdebug.diagnose(..., autocast=False)"
        )
        self._saved_params = [p.detach().clone() for p in self.params]
        self._opt_saved = _OptimizerState.capture(self.optimizer)
        for p in self.params:
            p.grad = None
        self.rng.restore()
        self._state = PreservedState.capture(self.model)

    def reset(self) -> None:
        """Put the copies back as the step had them."""
        with torch.no_grad():
            for p, saved in zip(self.params, self._saved_params):
                if p.shape != saved.shape or p.dtype != saved.dtype:
                    p.data = saved.clone()
                else:
                    p.copy_(saved)
        self._state.restore()  # buffers, RNG, grads (None), requires_grad, train flags
        if self._opt_saved is not None:
            self._opt_saved.restore()

    def replay(self) -> Replay:
        """A fresh :class:`Replay` over the copies."""
        return Replay(
            model=self.model,
            optimizer=self.optimizer,
            inputs=self.inputs,
            target=self.target,
            loss_fn=self.loss_fn,
            scaler=self._scaler(),
            batch_size=self.batch_size,
        )

    def contexts(self, r: Replay) -> tuple[ContextFactory, ContextFactory]:
        """The forward's and the backward's context factories for a replay: the step's
        autocast state, none when a fix turned it off (``r.autocast``)."""
        if not r.autocast:
            return nullcontext, nullcontext
        return self.autocast_context, self.backward_context

    def _scaler(self) -> torch.amp.GradScaler | None:
        if self.scaler_state is None:
            return None
        s = torch.amp.GradScaler(self.device.type)
        s.load_state_dict(copy.deepcopy(self.scaler_state))
        return s

    def run(self, fix: FixLike | None = None) -> StepOutcome:
        """Reset the copies and replay the whole step with ``fix`` applied."""
        t0 = time.perf_counter()
        out = StepOutcome()
        try:
            self.reset()
            r = self.replay()
            with ExitStack() as stack:
                if fix is not None:
                    stack.enter_context(fix.apply(r))
                if r.lr_factor != 1.0 and r.optimizer is not None:
                    _scale_lr(r.optimizer, r.lr_factor)
                forward, backward = self.contexts(r)
                for _ in range(self.steps):
                    step_out = training_step(r, forward, backward)
                    if out.loss is None:
                        out = step_out
                    else:  # later steps: all must stay finite; loss and norm are the last's
                        out.then(step_out)
        except Exception as e:
            out.error = first_line(e, 300)
        out.seconds = time.perf_counter() - t0
        return out

    def trace(self, fix: FixLike | None = None) -> Trace:
        """:func:`nbdebug.trace` of the step on the copies, with ``fix`` applied."""
        self.reset()
        r = self.replay()
        try:
            with fix.apply(r) if fix is not None else nullcontext():
                forward, backward = self.contexts(r)
                return trace_step(
                    r.model, r.inputs, r.target, r.loss_fn, forward=forward, backward=backward
                )
        finally:
            self.reset()

    def probe(
        self, module: str | None, families: Sequence[OpFamily]
    ) -> tuple[list[Probed], dict[str, str]]:
        """Run the forward (and the loss) once with ``module`` (``None``: the loss) watched:
        the fixable operations whose output holds a kind of non-finite value that their
        inputs did not hold, and the filename of every ``"file.py:line"`` that called a
        fixable operation (a backward origin's line made finite values in the forward: its
        snippet needs the file all the same)."""
        self.reset()
        r = self.replay()
        found: list[Probed] = []
        sites: dict[str, str] = {}

        def watch() -> ProbeMode:
            return ProbeMode(module, found, families, sites)

        try:
            with torch.no_grad(), self.autocast_context():
                watched = (
                    r.around_loss(watch) if module is None else r.around_forward(module, watch)
                )
                with watched:
                    compute_loss(call_model(r.model, r.inputs), r.target, r.loss_fn)
        except Exception:
            pass  # a probe is a hint; the replays decide
        finally:
            self.reset()
        return found, sites

    def recognise(self) -> BuiltinMode:
        """Run the forward and the loss once under a dry :class:`BuiltinMode`: the
        hand-written chains it recognises (``.found``, ``.lines``) and the explicit casts
        to half precision (``.casts``)."""
        self.reset()
        r = self.replay()
        mode = BuiltinMode(dry=True)
        try:
            with torch.no_grad(), self.autocast_context(), step_scope(r, lambda: mode):
                compute_loss(call_model(r.model, r.inputs), r.target, r.loss_fn)
        except Exception:
            pass  # a look at the step is a hint; the replays decide
        finally:
            self.reset()
        return mode

    def nonfinite_state(self) -> list[str]:
        """Parameters and floating buffers of the step's weights that hold NaN/Inf."""
        self.reset()
        named = [
            *self.model.named_parameters(),
            *((n, b) for n, b in self.model.named_buffers() if b.is_floating_point()),
        ]
        return [n for n, t in named if has_nonfinite(t)]


_PLAIN = (int, float, bool, str, type(None), tuple)


@dataclass
class _OptimizerState:
    """The optimizer's state and hyper-parameters, put back in place (no new tensors
    unless a shape or dtype changed) before each replay."""

    optimizer: torch.optim.Optimizer
    state: list[tuple[torch.Tensor, dict[str, object]]]
    groups: list[dict[str, object]]

    @classmethod
    def capture(cls, opt: torch.optim.Optimizer | None) -> _OptimizerState | None:
        if opt is None:
            return None
        state = [(p, {k: _keep(v) for k, v in st.items()}) for p, st in opt.state.items()]
        groups = [{k: _keep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return cls(opt, state, groups)

    def restore(self) -> None:
        opt = self.optimizer
        saved = dict(self.state)
        for p in [p for p in opt.state if p not in saved]:
            del opt.state[p]
        with torch.no_grad():
            for p, st0 in self.state:
                st = opt.state[p]
                for k in [k for k in st if k not in st0]:
                    del st[k]
                for k, v in st0.items():
                    st[k] = _put(st.get(k), v)
            for g, g0 in zip(opt.param_groups, self.groups):
                for k, v in g0.items():
                    g[k] = _put(g.get(k), v)


def _keep(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return v if isinstance(v, _PLAIN) else copy.deepcopy(v)


def _put(cur: object, saved: object) -> object:
    if isinstance(saved, torch.Tensor):
        if (
            isinstance(cur, torch.Tensor)
            and cur.shape == saved.shape
            and cur.dtype == saved.dtype
            and cur.device == saved.device
        ):
            return cur.copy_(saved)
        return saved.clone()
    return saved if isinstance(saved, _PLAIN) else copy.deepcopy(saved)


def _detached(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_detached(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _scale_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    for g in opt.param_groups:
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor):
            lr.mul_(factor)
        elif isinstance(lr, (int, float)):
            g["lr"] = lr * factor


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together (:func:`nbdebug.core.norms.total_norm`,
    accumulated in float64 so that finite values never overflow): NaN when one holds a
    NaN, inf when one holds an Inf."""
    if not tensors:
        return 0.0
    ts = [t.detach() for t in tensors]
    return float(total_norm(ts, device=ts[0].device, dtype=torch.float64))


def training_step(
    r: Replay, autocast: ContextFactory = nullcontext, backward: ContextFactory = nullcontext
) -> StepOutcome:
    """One training step on the replay's copies; the forward and the loss run inside
    ``autocast()`` (the step's autocast state), the backward inside ``backward()`` (the
    same state when the step ran its backward in the block, else none), the update
    after it."""
    out = StepOutcome()
    params = unique_parameters(r.model)
    for p in params:
        p.grad = None
    with torch.enable_grad():
        with autocast():
            output = call_model(r.model, r.inputs)
            out.forward = not any(has_nonfinite(t) for _, t in named_tensors(output))
            loss = compute_loss(output, r.target, r.loss_fn)
        out.loss = float(loss.detach().float())
        out.loss_finite = math.isfinite(out.loss)
        if loss.requires_grad:
            with backward():
                (r.scaler.scale(loss) if r.scaler is not None else loss).backward()
    opt = r.optimizer
    if r.scaler is not None and opt is not None:
        r.scaler.unscale_(opt)
    gnorm = _norm([p.grad for p in params if p.grad is not None])
    out.backward = math.isfinite(gnorm)
    if r.clip_norm is not None and out.backward:
        torch.nn.utils.clip_grad_norm_(params, r.clip_norm)
        gnorm = min(gnorm, r.clip_norm)
    out.grad_norm = gnorm
    if opt is None:
        return out
    if r.scaler is not None:
        r.scaler.step(opt)
        r.scaler.update()
    else:
        opt.step()
    out.weight_norm = _norm(params)
    out.update = math.isfinite(out.weight_norm)
    return out
