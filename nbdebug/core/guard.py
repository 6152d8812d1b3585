"""A training-loop sentinel: :class:`NaNGuard` checks every step and writes a snapshot
of the first step whose loss, gradients or weights are not finite.

Three forms, all sharing one :meth:`NaNGuard.check`::

    guard = nbdebug.NaNGuard(model, optimizer, directory="snapshots")

    # 1. explicit: you keep your loop as it is
    for step, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=step):   # False: non-finite
            optimizer.step()
        optimizer.zero_grad()

    # 2. a guarded step: the guard steps the optimizer when the step is finite, and
    #    zeroes the gradients
    for step, (x, y) in enumerate(loader):
        with guard.step(x, y, step=step) as s:
            s.loss = loss_fn(model(x), y)
            s.loss.backward()

    # 3. a decorated step function returning the loss after its backward
    @guard.wrap
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

With a ``torch.amp.GradScaler``, pass it as ``scaler=`` and step through it::

    scaler.scale(loss).backward()
    if guard.check(loss, inputs=x, target=y, step=step):   # pass the unscaled loss
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()

Inf/NaN gradients with a finite loss are then the scaler's business (it skips the step
and lowers its scale): they are recorded as skipped, not reported, until the scale
collapses (below ``min_scale``, or ``scaler_patience`` overflows in a row).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .batch import check_model
from .distributed import (
    KIND_BITS,
    REMOTE_KIND,
    RankAgreement,
    local_tensor,
    unwrap_data_parallel,
)
from .snapshot import save_snapshot
from .snapshot_format import parse_recipe, unique_path
from .state import RngState, unique_parameters

ACTIONS = ("skip", "raise", "continue")

_last: NonFiniteError | None = None


# The health checks live in nbdebug.analysis, above core in the layering: core never
# imports them. nbdebug.analysis.checks registers its (parse, run) pair here when it is
# imported, and ``nbdebug.NaNGuard`` imports it along with this module.
_HEALTH_CHECKS: tuple[Callable[..., Any], Callable[..., Any]] | None = None


def register_health_checks(parse: Callable[..., Any], run: Callable[..., Any]) -> None:
    """Called by :mod:`nbdebug.analysis.checks`: how ``NaNGuard(checks=...)`` validates its
    option and runs the cheap checks on a step."""
    global _HEALTH_CHECKS
    _HEALTH_CHECKS = (parse, run)


def _health_checks() -> tuple[Callable[..., Any], Callable[..., Any]]:
    if _HEALTH_CHECKS is None:
        raise RuntimeError(
            "NaNGuard(checks=...) needs nbdebug's health checks: use nbdebug.NaNGuard, or "
            "import nbdebug.analysis.checks first."
        )
    return _HEALTH_CHECKS


class NonFiniteError(RuntimeError):
    """A guarded training step was not finite and the guard was told to stop.

    Attributes
    ----------
    path : pathlib.Path or None
        The snapshot of the first bad step of the current run of bad steps (``None``
        only when ``max_snapshots`` was exhausted).
    step : int
        That step.
    reason : dict
        ``"kind"`` (``"loss"``, ``"grad"``, ``"weights"``, ``"scale"``) and ``"message"``,
        with the measured values.
    """

    def __init__(self, message: str, *, path: Path | None, step: int, reason: dict[str, Any]):
        super().__init__(message)
        self.path = path
        self.step = step
        self.reason = reason

    def __reduce__(self) -> Any:
        return (_rebuild_error, (str(self), self.path, self.step, self.reason))


def _rebuild_error(
    message: str, path: Path | None, step: int, reason: dict[str, Any]
) -> NonFiniteError:
    return NonFiniteError(message, path=path, step=step, reason=reason)


def last_error() -> NonFiniteError | None:
    """The last :class:`NonFiniteError` a guard raised in this process (or, failing
    that, the one IPython stored in ``sys.last_exc`` / ``sys.last_value``)."""
    if _last is not None:
        return _last
    for name in ("last_exc", "last_value"):
        err = getattr(sys, name, None)
        if isinstance(err, NonFiniteError):
            return err
    return None


def _fmt(v: float | None) -> str:
    if v is None:
        return "None"
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class GuardedStep:
    """What ``with guard.step(...) as s:`` yields: set ``s.loss`` in the block; after the
    block ``s.ok`` tells whether the step was finite (and the optimizer stepped)."""

    def __init__(self, guard: NaNGuard, inputs: Any, target: Any, step: int | None):
        self.guard = guard
        self.inputs = inputs
        self.target = target
        self.step = step
        self.loss: Any = None
        self.ok: bool | None = None

    def __repr__(self) -> str:
        return f"GuardedStep(step={self.step}, ok={self.ok})"


class NaNGuard:
    """Watch a training loop; on the first non-finite step write a snapshot file.

    Parameters
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer, optional
        Its state goes into the snapshot; its first group's learning rate into the history.
    scaler : torch.amp.GradScaler, optional
        Gradients are measured unscaled; overflow steps the scaler skips are not failures.
    scheduler : optional
        A learning-rate scheduler; its state goes into the snapshot.
    directory : str or PathLike
        Where snapshots go (created on the first one): ``step-000048213.nbsnap``.
    patience : int or None
        How many consecutive bad steps are tolerated under ``"skip"``/``"continue"``: the
        next one in a row raises :class:`NonFiniteError`. ``None``: never raise.
    on_nonfinite : {"skip", "raise", "continue"}
        ``"skip"``: clear the gradients (``p.grad = None``, so even an unconditional
        ``optimizer.step()`` leaves the weights as they were) and return ``False``.
        ``"raise"``: clear the gradients and raise :class:`NonFiniteError`.
        ``"continue"``: only record (snapshot, history) and return ``False``.
    history : int
        Length of the rolling history kept and stored in snapshots.
    loss_fn : callable, optional
        The loss, stored by import path (``torch.nn.functional.cross_entropy``, an
        ``nn.CrossEntropyLoss()``) so that ``snap.trace()`` replays without arguments.
    recipe : str, optional
        ``"package.module:factory"`` that builds the model, with ``recipe_kwargs`` (JSON):
        lets ``load_snapshot(path, trust_recipe=True)`` rebuild it.
    recipe_kwargs : dict, optional
    min_scale : float
        With a scaler: a scale below this is a failure (``kind="scale"``).
    scaler_patience : int
        With a scaler: this many overflow-skipped steps in a row is a failure.
    max_snapshots : int or None
        At most this many snapshot files per guard (later bad steps are only recorded).
    checks : bool, int or dict
        Health checks (:func:`nbdebug.check`'s cheap ones, no extra forward) every 50 steps
        (``True``), every ``checks`` steps (an int) or ``{"every": n, "clip_norm": c}``, and
        on a failing step; their findings go into the history row (``"checks"``).
    param_norm_every : int
        Measure the total parameter norm every this many checks (and on every bad step);
        other history rows hold ``None``. Reading all weights is a pass over memory as
        long as the gradient check itself: every 10th step keeps the guard near 1 % of a
        step. ``1``: every step.
    process_group : torch.distributed.ProcessGroup, None or False
        Distributed training (see :mod:`nbdebug.core.distributed`): every rank's ``check()``
        joins one tiny ``all_reduce`` so that all ranks skip a step that any rank found
        non-finite, and each writes its own snapshot (``step-000000003-rank1.nbsnap``).
        ``None``: a DDP model's group, else the default group when ``torch.distributed`` is
        initialised; ``False``: no agreement (this rank decides alone). A DDP/DataParallel
        wrapper is unwrapped: snapshots hold the inner module's state.
    check_replicas_every : int or None
        Distributed: every this many steps compare a fingerprint of every parameter across
        the ranks (one ``all_gather``); the first that differs is a
        :class:`~nbdebug.core.distributed.ReplicaMismatch` finding (a warning, the history
        row's ``"replicas"``, :attr:`replica_findings`). ``None``: off.
    timeout : float, optional
        Distributed: seconds every collective of the agreement waits for the other ranks
        (default 300) before raising :class:`~nbdebug.core.distributed.RankError` naming the
        rank(s) that did not answer.

    Attributes
    ----------
    history : collections.deque of dict
        ``step``, ``loss``, ``grad_norm`` (unscaled), ``param_norm`` (see
        ``param_norm_every``), ``lr``, ``scale``,
        ``skipped``, ``nonfinite`` (the failure kind or ``None``), ``time``.
    snapshots : list of pathlib.Path
    ok : bool or None
        Result of the last check.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scaler: Any = None,
        scheduler: Any = None,
        directory: str | os.PathLike[str] = "nbdebug-snapshots",
        patience: int | None = 1,
        on_nonfinite: str = "skip",
        history: int = 500,
        loss_fn: Callable[..., Any] | None = None,
        recipe: str | None = None,
        recipe_kwargs: dict[str, Any] | None = None,
        min_scale: float = 1.0,
        scaler_patience: int = 20,
        max_snapshots: int | None = 20,
        checks: bool | int | dict[str, Any] = False,
        param_norm_every: int = 10,
        process_group: Any = None,
        check_replicas_every: int | None = None,
        timeout: float | None = None,
    ):
        wrapper = model
        self.model = check_model(
            unwrap_data_parallel(model) if isinstance(model, torch.nn.Module) else model
        )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or None; got {type(optimizer).__qualname__}."
            )
        if scaler is not None and not (
            hasattr(scaler, "state_dict") and hasattr(scaler, "get_scale")
        ):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler or None; got {type(scaler).__qualname__}."
            )
        if scheduler is not None and not hasattr(scheduler, "state_dict"):
            raise TypeError(
                f"scheduler must have a state_dict() (an LR scheduler); got {type(scheduler).__qualname__}."
            )
        if on_nonfinite not in ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {ACTIONS}; got {on_nonfinite!r}.")
        if patience is not None and (
            isinstance(patience, bool) or not isinstance(patience, int) or patience < 0
        ):
            raise ValueError(f"patience must be a non-negative int or None; got {patience!r}.")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive int; got {history!r}.")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"directory must be a str or os.PathLike; got {type(directory).__qualname__}."
            )
        if max_snapshots is not None and (not isinstance(max_snapshots, int) or max_snapshots < 1):
            raise ValueError(
                f"max_snapshots must be a positive int or None; got {max_snapshots!r}."
            )
        if (
            isinstance(param_norm_every, bool)
            or not isinstance(param_norm_every, int)
            or param_norm_every < 1
        ):
            raise ValueError(f"param_norm_every must be a positive int; got {param_norm_every!r}.")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__qualname__}.")
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.directory = Path(directory)
        self.patience = patience
        self.on_nonfinite = on_nonfinite
        self.loss_fn = loss_fn
        self.recipe = parse_recipe(recipe, recipe_kwargs)
        self.min_scale = float(min_scale)
        self.scaler_patience = int(scaler_patience)
        self.max_snapshots = max_snapshots
        self.param_norm_every = param_norm_every
        self._checks = 0
        self.checks = checks
        if checks:  # validated by the health checks, which register themselves (see below)
            _health_checks()[0](checks)

        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.snapshots: list[Path] = []
        self.ok: bool | None = None
        self.bad_streak = 0
        self.scaler_streak = 0
        self._streak_first: tuple[Path | None, int, dict[str, Any]] | None = None
        self._next_step = 0

        self._params = unique_parameters(model)
        self._names = [n for n, _ in model.named_parameters()]
        seen = {id(p) for p in self._params}
        self._extra = []  # optimizer parameters outside the model: their gradients are cleared too
        if optimizer is not None:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        self._extra.append(p)
        devices = {p.device for p in self._params}
        self._device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        self._one_device = len(devices) <= 1
        self._rng_torch = torch.get_rng_state()  # state at the start of the coming step
        self._rng_cuda = self._cuda_rng()
        self.agreement = RankAgreement.create(
            wrapper,
            list(self.model.named_parameters()),
            process_group,
            timeout=timeout,
            check_replicas_every=check_replicas_every,
        )

    @property
    def replica_findings(self) -> list[Any]:
        """The replica check's findings so far (empty when it is off)."""
        return self.agreement.replica_findings if self.agreement is not None else []

    # ------------------------------------------------------------------ checking
    @staticmethod
    def _cuda_rng() -> list[torch.Tensor] | None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.get_rng_state_all()
        return None

    def _norm_total(
        self, tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """L2 norm of all ``tensors`` together, on ``self._device``, without a host sync."""
        if not tensors:
            return torch.zeros((), dtype=dtype, device=self._device)
        if self._one_device:
            norms = torch._foreach_norm(list(tensors), 2, dtype=dtype)
            return torch.linalg.vector_norm(torch.stack(norms))
        by_dev: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_dev.setdefault(t.device, []).append(t)
        parts = [
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts, 2, dtype=dtype))).to(
                self._device
            )
            for ts in by_dev.values()
        ]
        return torch.linalg.vector_norm(torch.stack(parts))

    def _exact_norm(self, tensors: Sequence[torch.Tensor]) -> float:
        """The norm in float64: finite elements whose float32 sum of squares overflowed
        (a diverging run, |x| ~ 1e19) still give a finite norm. Only when float32 said inf."""
        with torch.no_grad():
            return float(self._norm_total([t.detach() for t in tensors], torch.float64))

    def _scale_info(self) -> tuple[Any, bool]:
        """(the scaler's scale as a tensor or float or None, whether grads are still scaled)."""
        sc = self.scaler
        if sc is None or not getattr(sc, "is_enabled", lambda: True)():
            return None, False
        scale = getattr(sc, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            scale = float(sc.get_scale())
        scaled = True
        states = getattr(sc, "_per_optimizer_states", None)
        if self.optimizer is not None and isinstance(states, dict):
            stage = states.get(id(self.optimizer), {}).get("stage")
            scaled = getattr(stage, "name", "") != "UNSCALED"  # unscale_() already ran
        return scale, scaled

    def check(
        self,
        loss: Any,
        *,
        inputs: Any = None,
        target: Any = None,
        step: int | None = None,
    ) -> bool:
        """Check one step after its backward and before the optimizer step.

        Parameters
        ----------
        loss : Tensor (scalar) or float or None
            The step's loss (unscaled when a GradScaler is used).
        inputs, target : optional
            The batch; stored in the snapshot when the step is not finite.
        step : int, optional
            The step number (default: one more than the last).

        Returns
        -------
        bool
            ``True`` when loss and gradients are finite (go on and step the optimizer);
            ``False`` when they are not (a snapshot was written; see ``on_nonfinite``).

        Raises
        ------
        NonFiniteError
            ``on_nonfinite="raise"``, or more than ``patience`` bad steps in a row.
        """
        if step is None:
            step = self._next_step
        elif isinstance(step, bool) or not isinstance(step, int):
            try:
                step = int(step)
            except (TypeError, ValueError):
                raise TypeError(f"step must be an int; got {type(step).__qualname__}.") from None
        self._next_step = step + 1
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"loss must be a scalar; got a tensor of shape {tuple(loss.shape)}."
                )
            loss_t = loss.detach().reshape(()).to(self._device, torch.float32)
        elif loss is None:
            loss_t = torch.zeros((), dtype=torch.float32, device=self._device)
        elif isinstance(loss, (int, float)):
            loss_t = torch.tensor(float(loss), dtype=torch.float32, device=self._device)
        else:
            raise TypeError(
                f"loss must be a scalar tensor, a float or None; got {type(loss).__qualname__}."
            )

        grads = [local_tensor(g) for g in (p.grad for p in self._params) if g is not None]
        if any(g.is_sparse for g in grads):  # nn.Embedding(sparse=True)
            grads = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        scale, scaled = self._scale_info()
        measure_params = self._checks % self.param_norm_every == 0
        self._checks += 1
        with torch.no_grad():
            parts = [loss_t, self._norm_total(grads)]
            if measure_params:
                parts.append(self._norm_total([local_tensor(p) for p in self._params]))
        if isinstance(scale, torch.Tensor):
            parts.append(scale.detach().reshape(()).to(self._device, torch.float32))
        lr: Any = None
        if self.optimizer is not None and self.optimizer.param_groups:
            lr = self.optimizer.param_groups[0].get("lr")
            if isinstance(lr, torch.Tensor):
                parts.append(lr.detach().reshape(()).to(self._device, torch.float32))
        values = torch.stack(parts).tolist()  # the one host synchronisation
        loss_v = values[0] if loss is not None else None
        gnorm = values[1]
        pnorm: float | None = values[2] if measure_params else None
        i = 3 if measure_params else 2
        if isinstance(scale, torch.Tensor):
            scale = values[i]
            i += 1
        if isinstance(lr, torch.Tensor):
            lr = values[i]
        if math.isinf(gnorm):
            gnorm = self._exact_norm(grads)
        if pnorm is not None and math.isinf(pnorm):
            pnorm = self._exact_norm([local_tensor(p) for p in self._params])
        if scale is not None and scaled and scale > 0 and math.isfinite(gnorm):
            gnorm = gnorm / scale

        row: dict[str, Any] = {
            "step": step,
            "loss": loss_v,
            "grad_norm": gnorm,
            "param_norm": pnorm,
            "lr": float(lr) if isinstance(lr, (int, float)) else None,
            "scale": scale,
            "skipped": False,
            "nonfinite": None,
            "time": time.time(),
        }
        self.history.append(row)
        loss_bad = loss_v is not None and not math.isfinite(loss_v)
        kind: str | None = None
        detail: dict[str, Any] = {}
        if loss_bad or not math.isfinite(gnorm) or (pnorm is not None and not math.isfinite(pnorm)):
            kind, detail = self._diagnose(loss_bad, gnorm, pnorm, scale)
            if pnorm is None:  # a bad step: the weights are measured too
                pnorm = row["param_norm"] = math.sqrt(
                    sum(v * v for v in detail["param_norms"].values())
                )
        if kind == "grad" and scale is not None:
            # the scaler sees the inf/NaN gradients and skips this update itself
            kind = None
            row["skipped"] = True
            self.scaler_streak += 1
            if self.scaler_streak >= self.scaler_patience:
                kind = "scale"
                detail["message_extra"] = f"{self.scaler_streak} overflow steps in a row"
        elif scale is not None:
            self.scaler_streak = 0
        if kind is None and scale is not None and scale < self.min_scale:
            kind = "scale"
            detail["message_extra"] = (
                f"the scale fell to {_fmt(scale)} (< min_scale={self.min_scale:g})"
            )

        if self.agreement is not None:
            kind, detail = self._agree(step, kind, detail, row, gnorm, pnorm, scale)
            if kind is not None and pnorm is None:
                pnorm = row["param_norm"]

        if self.checks:  # health checks every N steps, recorded in row["checks"]
            _health_checks()[1](self, row, failing=kind is not None)

        if kind is None:
            self.bad_streak = 0
            self._streak_first = None
            self._rng_torch = torch.get_rng_state()
            self._rng_cuda = self._cuda_rng()
            self.ok = True
            return True
        return self._fail(kind, detail, row, step, loss_v, gnorm, pnorm, scale, inputs, target)

    def _agree(
        self,
        step: int,
        kind: str | None,
        detail: dict[str, Any],
        row: dict[str, Any],
        gnorm: float,
        pnorm: float | None,
        scale: Any,
    ) -> tuple[str | None, dict[str, Any]]:
        """Combine this rank's verdict with every other rank's (one all-reduce), and run
        the replica check when it is due."""
        assert self.agreement is not None
        agreement = self.agreement.agree(step, KIND_BITS.get(kind, 0) if kind else 0)
        if self.agreement.due(step):
            found = self.agreement.compare_replicas(step, list(self.model.named_parameters()))
            row["replicas"] = found.parameter if found is not None else "equal"
            if found is not None:
                import warnings

                warnings.warn(found.message, RuntimeWarning, stacklevel=4)
        row["rank"] = agreement.rank
        if not agreement.any_bad:
            return kind, detail
        if kind is None:
            kind = REMOTE_KIND
            detail = self._diagnose(False, gnorm, pnorm, scale)[1]
            detail["message_extra"] = agreement.message(step)
            if row["param_norm"] is None:
                row["param_norm"] = math.sqrt(sum(v * v for v in detail["param_norms"].values()))
        detail["distributed"] = agreement.record(list(self.model.named_parameters()))
        return kind, detail

    @torch.no_grad()
    def _diagnose(
        self, loss_bad: bool, gnorm: float, pnorm: float | None, scale: Any
    ) -> tuple[str | None, dict[str, Any]]:
        """Element-wise look at what is not finite (only on a bad step)."""
        names = {id(p): n for n, p in self.model.named_parameters()}

        def bad_of(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, int]]:
            out = {}
            for name, t in pairs:
                fin = torch.isfinite(t)
                if not bool(fin.all()):
                    n_nan = int(torch.isnan(t).sum())
                    out[name] = {"nan": n_nan, "inf": int(t.numel() - int(fin.sum()) - n_nan)}
            return out

        weights = {}
        if pnorm is None or not math.isfinite(pnorm):
            weights = bad_of(
                [(names.get(id(p), "?"), local_tensor(p).detach()) for p in self._params]
            )
        with_grad = [
            (names.get(id(p), "?"), local_tensor(p.grad))
            for p in self._params
            if p.grad is not None
        ]
        bad_grads = bad_of([(n, g) for n, g in with_grad]) if not math.isfinite(gnorm) else {}
        grad_norms = {}
        if with_grad:
            norms = torch.stack(
                torch._foreach_norm([g for _, g in with_grad], 2, dtype=torch.float64)
            ).tolist()
            div = (
                scale if isinstance(scale, float) and scale > 0 and self.scaler is not None else 1.0
            )
            grad_norms = {n: v / div for (n, _), v in zip(with_grad, norms)}
        detail: dict[str, Any] = {
            "nonfinite_weights": weights,
            "nonfinite_grads": bad_grads,
            "grad_norms": grad_norms,
            "param_norms": dict(
                zip(
                    [names.get(id(p), "?") for p in self._params],
                    torch.stack(
                        torch._foreach_norm(
                            [local_tensor(p).detach() for p in self._params],
                            2,
                            dtype=torch.float64,
                        )
                    ).tolist()
                    if self._params
                    else [],
                )
            ),
        }
        if weights:
            return "weights", detail
        if loss_bad:
            return "loss", detail
        if bad_grads:
            return "grad", detail
        return None, detail  # a norm overflowed but every element is finite

    def _message(
        self, kind: str, step: int, loss: float | None, gnorm: float, detail: dict[str, Any]
    ) -> str:
        def listing(d: dict[str, dict[str, int]]) -> str:
            items = [f"{n} ({v['nan']} NaN, {v['inf']} Inf)" for n, v in list(d.items())[:5]]
            more = f" and {len(d) - 5} more" if len(d) > 5 else ""
            return ", ".join(items) + more

        if kind == "weights":
            return f"non-finite weights at step {step}: {listing(detail['nonfinite_weights'])}"
        if kind == "loss":
            grads = detail["nonfinite_grads"]
            tail = f"; non-finite gradients in {listing(grads)}" if grads else ""
            return f"non-finite loss ({_fmt(loss)}) at step {step}{tail}"
        if kind == "grad":
            return (
                f"non-finite gradients at step {step} with a finite loss ({_fmt(loss)}): "
                f"{listing(detail['nonfinite_grads'])}"
            )
        if kind == REMOTE_KIND:
            return str(detail.get("message_extra", ""))
        return f"GradScaler scale collapsing at step {step}: {detail.get('message_extra', '')}"

    def _fail(
        self,
        kind: str,
        detail: dict[str, Any],
        row: dict[str, Any],
        step: int,
        loss: float | None,
        gnorm: float,
        pnorm: float | None,
        scale: Any,
        inputs: Any,
        target: Any,
    ) -> bool:
        message = self._message(kind, step, loss, gnorm, detail)
        detail.pop("message_extra", None)
        reason: dict[str, Any] = {
            "kind": kind,
            "message": message,
            "step": step,
            "loss": loss,
            "grad_norm": gnorm,
            "param_norm": pnorm,
            "scale": scale,
            "action": self.on_nonfinite,
            **detail,
        }
        row["nonfinite"] = kind
        row["skipped"] = self.on_nonfinite != "continue"
        path: Path | None = None
        if self.max_snapshots is None or len(self.snapshots) < self.max_snapshots:
            rng = RngState.capture()
            rng.torch_cpu = self._rng_torch
            rng.cuda = self._rng_cuda if self._rng_cuda is not None else rng.cuda
            dist_info = detail.get("distributed")
            path = save_snapshot(
                unique_path(self.directory, step, rank=dist_info["rank"] if dist_info else None),
                self.model,
                inputs,
                target,
                optimizer=self.optimizer,
                scaler=self.scaler,
                scheduler=self.scheduler,
                step=step,
                reason=reason,
                history=list(self.history),
                recipe=self.recipe,
                loss_fn=self.loss_fn,
                rng=rng,
            )
            self.snapshots.append(path)
        self.bad_streak += 1
        if self._streak_first is None:
            self._streak_first = (path, step, reason)
        if self.on_nonfinite != "continue":
            self.clear_grads()
        self.ok = False
        self._rng_torch = torch.get_rng_state()
        self._rng_cuda = self._cuda_rng()
        too_many = self.patience is not None and self.bad_streak > self.patience
        if self.on_nonfinite == "raise" or too_many:
            first_path, first_step, first_reason = self._streak_first
            if self.on_nonfinite == "raise":
                text = f"{message}. Snapshot: {first_path}"
            else:
                text = (
                    f"{self.bad_streak} non-finite steps in a row (patience={self.patience}); the first, "
                    f"step {first_step}: {first_reason['message']}. Snapshot: {first_path}"
                )
            err = NonFiniteError(text, path=first_path, step=first_step, reason=first_reason)
            global _last
            _last = err
            raise err
        return False

    def clear_grads(self) -> None:
        """Set every gradient of the model (and optimizer) to ``None``: an optimizer step
        then leaves those parameters unchanged."""
        for p in self._params:
            p.grad = None
        for p in self._extra:
            p.grad = None

    # ------------------------------------------------------------------ other forms
    @contextmanager
    def step(
        self, inputs: Any = None, target: Any = None, *, step: int | None = None
    ) -> Iterator[GuardedStep]:
        """A guarded training step (context manager).

        In the block do the forward and backward and set ``s.loss``. On leaving it the
        guard checks; when the step is finite it steps the optimizer (through the scaler,
        then ``scaler.update()``, when there is one); then it zeroes the gradients. The
        RNG state at the start of the block is what a replay uses.
        """
        s = GuardedStep(self, inputs, target, step)
        self._rng_torch = torch.get_rng_state()
        self._rng_cuda = self._cuda_rng()
        yield s
        self._finish(s)

    def _finish(self, s: GuardedStep) -> None:
        loss = s.loss
        if isinstance(loss, (tuple, list)) and loss:
            loss = loss[0]
        if loss is None:
            raise ValueError(
                "set s.loss inside the guarded step (with guard.step(...) as s: s.loss = ...)."
            )
        opt = self.optimizer
        try:
            s.ok = self.check(loss, inputs=s.inputs, target=s.target, step=s.step)
            if s.ok and opt is not None:
                if self.scaler is not None:
                    self.scaler.step(opt)
                    self.scaler.update()
                else:
                    opt.step()
        finally:
            if opt is not None:
                opt.zero_grad(set_to_none=True)

    def wrap(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        inputs: int | str = 0,
        target: int | str | None = 1,
    ) -> Any:
        """Decorator for a step function that does forward + backward and returns the loss
        (or a tuple starting with it): each call becomes a guarded step (see :meth:`step`).

        ``inputs`` / ``target`` name the function's parameters holding the batch (position
        or name; ``target=None`` for none). ``guard.ok`` tells whether the last call stepped.
        """

        def deco(f: Callable[..., Any]) -> Callable[..., Any]:
            sig = inspect.signature(f)
            params = list(sig.parameters)

            def pick(bound: inspect.BoundArguments, which: int | str | None) -> Any:
                if which is None:
                    return None
                name = params[which] if isinstance(which, int) and which < len(params) else which
                return bound.arguments.get(name) if isinstance(name, str) else None

            @functools.wraps(f)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                bound = sig.bind(*args, **kwargs)
                with self.step(pick(bound, inputs), pick(bound, target)) as s:
                    out = f(*args, **kwargs)
                    s.loss = out
                return out

            return wrapper

        return deco(fn) if fn is not None else deco

    # ------------------------------------------------------------------ views
    def history_frame(self) -> Any:
        """The rolling history as a DataFrame (same layout as ``Snapshot.history_frame()``)."""
        from .snapshot import history_frame

        return history_frame(list(self.history))

    def __repr__(self) -> str:
        last = self.history[-1] if self.history else None
        where = f"last step {last['step']} loss={_fmt(last['loss'])}" if last else "no step yet"
        return (
            f"NaNGuard({type(self.model).__qualname__}, on_nonfinite={self.on_nonfinite!r}, "
            f"patience={self.patience}, {where}, {len(self.snapshots)} snapshot(s) in {self.directory})"
        )


__all__ = ["NaNGuard", "NonFiniteError", "last_error"]
