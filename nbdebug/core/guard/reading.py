"""What the guard reads of one step: :class:`StepReading` (loss, norms, learning rate,
scale, read with one host synchronisation by :meth:`StepMeter.measure`) and, on a bad step
only, the element-wise look at what is not finite (:meth:`StepMeter.inspect`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..norms import fused_norms, host_squares, host_total, total_norm
from ..parallel import local_tensor
from ..stats import count_nonfinite, has_nonfinite
from ..vocab import FailureKind

if TYPE_CHECKING:  # pragma: no cover
    from ..snapshot.write import Scaler
    from .agreement import Agreement
    from .signal_meter import SignalMeter

__all__ = ["Loss", "StepMeter", "StepReading"]

#: what ``check()`` takes as the step's loss
Loss = torch.Tensor | float | int | None


@dataclass(frozen=True)
class StepReading:
    """What :meth:`NaNGuard.measure_step` read of one step (one host read).

    Attributes
    ----------
    step : int
    loss : float or None
        ``None`` when the step passed no loss.
    grad_norm : float
        Total L2 norm of the gradients, unscaled (float64 when float32 overflowed).
    param_norm : float or None
        Total L2 norm of the weights (``None`` on steps that do not measure it).
    lr : float or None
        The first parameter group's learning rate.
    scale : float or None
        The GradScaler's scale (``None`` without an enabled scaler).
    scaled : bool
        Whether the gradients were still multiplied by ``scale`` when read.
    ranks : Agreement or None
        Distributed: every rank's local verdict on this step (set by ``NaNGuard.agree``;
        ``None`` for one process).
    """

    step: int
    loss: float | None
    grad_norm: float
    param_norm: float | None
    lr: float | None
    scale: float | None
    scaled: bool = False
    ranks: Agreement | None = None

    @property
    def loss_bad(self) -> bool:
        return self.loss is not None and not math.isfinite(self.loss)

    @property
    def grad_bad(self) -> bool:
        return not math.isfinite(self.grad_norm)

    @property
    def weights_bad(self) -> bool:
        return self.param_norm is not None and not math.isfinite(self.param_norm)

    @property
    def finite(self) -> bool:
        """Loss, total gradient norm and (when measured) weight norm are all finite."""
        return not (self.loss_bad or self.grad_bad or self.weights_bad)


#: per parameter name, its count of NaN and Inf elements
BadCounts = dict[str, dict[str, int]]


class StepMeter:
    """Reads a model's step: the guard's measuring instrument.

    Parameters
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer, optional
    scaler : torch.amp.GradScaler, optional
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: Scaler | None,
        params: Sequence[torch.nn.Parameter],
    ) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.params = list(params)
        devices = {p.device for p in self.params}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        #: the per-layer signals, read with the step (``NaNGuard(signals=...)``)
        self.signals: SignalMeter | None = None

    # ------------------------------------------------------------------ parts
    def exact_norm(self, tensors: Sequence[torch.Tensor]) -> float:
        """The norm in float64: finite elements whose float32 sum of squares overflowed
        (a diverging run, |x| ~ 1e19) still give a finite norm. Only when float32 said inf."""
        with torch.no_grad():
            ts = [t.detach() for t in tensors]
            return float(total_norm(ts, device=self.device, dtype=torch.float64))

    def scaler_unscaled(self) -> bool:
        """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last update."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if self.optimizer is None or not isinstance(states, dict):
            return False
        stage = states.get(id(self.optimizer), {}).get("stage")
        return getattr(stage, "name", "") == "UNSCALED"

    def scale_info(self) -> tuple[torch.Tensor | float | None, bool]:
        """(the scaler's scale as a tensor or float or None, whether grads are still scaled)."""
        sc = self.scaler
        if sc is None or not getattr(sc, "is_enabled", lambda: True)():
            return None, False
        scale = getattr(sc, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            scale = float(sc.get_scale())
        return scale, not self.scaler_unscaled()

    def loss_tensor(self, loss: Loss) -> torch.Tensor | float:
        """The loss for the step's host read: a 0-d float32 tensor on the guard's device,
        or, for a CPU tensor or a number, its value (read now: no synchronisation)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"loss must be a scalar; got a tensor of shape {tuple(loss.shape)}."
                )
            if loss.device.type == "cpu":
                return loss.item()
            return loss.detach().reshape(()).to(self.device, torch.float32)
        if loss is None:
            return 0.0
        if isinstance(loss, (int, float)):
            return float(loss)
        raise TypeError(
            f"loss must be a scalar tensor, a float or None; got {type(loss).__qualname__}."
        )

    def grads(self) -> list[torch.Tensor]:
        # an FSDP2 gradient is a DTensor: this rank measures its own shard, no collective
        grads = [local_tensor(g) for g in (p.grad for p in self.params) if g is not None]
        if any(g.is_sparse for g in grads):  # nn.Embedding(sparse=True)
            grads = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        return grads

    def total_of(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | float:
        """The total norm of ``tensors``: a float read on the host on the CPU with the
        compiled kernel (:func:`..norms.host_squares`), else a 0-d tensor on the device."""
        squares = host_squares(tensors) if self.device.type == "cpu" else None
        if squares is not None:
            return host_total(squares)
        return total_norm(tensors, device=self.device)

    def local_params(self) -> list[torch.Tensor]:
        return [local_tensor(p) for p in self.params]

    # ------------------------------------------------------------------ reading
    def measure(
        self, loss: Loss, *, step: int, measure_params: bool = True, signals: bool = False
    ) -> StepReading:
        """Read the step (see :meth:`NaNGuard.measure_step`); ``signals``: also measure
        and record the per-layer signals (:attr:`signals`), in the same host read."""
        loss_t = self.loss_tensor(loss)
        grads = self.grads()
        scale, scaled = self.scale_info()
        dev = self.device
        sig = self.signals.collect(grads, dev) if signals and self.signals is not None else None
        with torch.no_grad():
            parts = [loss_t, self.total_of(grads) if sig is None else sig.grad_total]
            if measure_params:
                pt = sig.param_total if sig is not None else None  # measured with the signals
                parts.append(self.total_of(self.local_params()) if pt is None else pt)
        if isinstance(scale, torch.Tensor):
            parts.append(scale.detach().reshape(()).to(dev, torch.float32))
        lr: Any = None
        if self.optimizer is not None and self.optimizer.param_groups:
            lr = self.optimizer.param_groups[0].get("lr")
            if isinstance(lr, torch.Tensor):
                parts.append(lr.detach().reshape(()).to(dev, torch.float32))
        head, tail = host_read(parts, sig.values if sig is not None else None)
        values = iter(head)
        loss_v = next(values)
        gnorm = next(values)
        pnorm: float | None = next(values) if measure_params else None
        if isinstance(scale, torch.Tensor):
            scale = next(values)
        if isinstance(lr, torch.Tensor):
            lr = next(values)
        if math.isinf(gnorm):
            gnorm = self.exact_norm(grads)
        if pnorm is not None and math.isinf(pnorm):
            pnorm = self.exact_norm(self.local_params())
        if scale is not None and scaled and scale > 0 and math.isfinite(gnorm):
            gnorm = gnorm / scale
        if sig is not None and self.signals is not None:
            self.signals.record(sig, tail, step=step, scale=scale if scaled else None)
        return StepReading(
            step=step,
            loss=loss_v if loss is not None else None,
            grad_norm=gnorm,
            param_norm=pnorm,
            lr=float(lr) if isinstance(lr, (int, float)) else None,
            scale=scale if scale is None else float(scale),
            scaled=scaled,
        )

    @torch.no_grad()
    def inspect(self, reading: StepReading) -> tuple[FailureKind | None, dict[str, Any]]:
        """Element-wise look at what is not finite (only on a bad step): the failure kind
        and the detail (``nonfinite_weights``, ``nonfinite_grads``, ``grad_norms`` and
        ``param_norms`` per parameter)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        pnorm, gnorm, scale = reading.param_norm, reading.grad_norm, reading.scale
        weights: BadCounts = {}
        if pnorm is None or not math.isfinite(pnorm):
            weights = _bad_of(
                [(names.get(id(p), "?"), local_tensor(p).detach()) for p in self.params]
            )
        with_grad = [
            (names.get(id(p), "?"), local_tensor(p.grad)) for p in self.params if p.grad is not None
        ]
        bad_grads = _bad_of(with_grad) if not math.isfinite(gnorm) else {}
        grad_norms = {}
        if with_grad:
            norms = fused_norms([g for _, g in with_grad], dtype=torch.float64).tolist()
            div = scale if scale is not None and scale > 0 and self.scaler is not None else 1.0
            grad_norms = {n: v / div for (n, _), v in zip(with_grad, norms)}
        weight_norms = fused_norms([t.detach() for t in self.local_params()], dtype=torch.float64)
        detail: dict[str, Any] = {
            "nonfinite_weights": weights,
            "nonfinite_grads": bad_grads,
            "grad_norms": grad_norms,
            "param_norms": dict(
                zip([names.get(id(p), "?") for p in self.params], weight_norms.tolist())
            ),
        }
        if weights:
            return FailureKind.WEIGHTS, detail
        if reading.loss_bad:
            return FailureKind.LOSS, detail
        if bad_grads:
            return FailureKind.GRAD, detail
        return None, detail  # a norm overflowed but every element is finite


def _bad_of(pairs: Sequence[tuple[str, torch.Tensor]]) -> BadCounts:
    out = {}
    for name, t in pairs:
        if has_nonfinite(t):  # (one pass over the finite ones; counted only where not)
            n_nan, n_inf = count_nonfinite(t)
            out[name] = {"nan": n_nan, "inf": n_inf}
    return out


def host_read(
    items: Sequence[torch.Tensor | float], tail: torch.Tensor | None
) -> tuple[list[float], list[float]]:
    """The values of ``items`` (0-d float32 tensors on one device, or numbers already on
    the host) and of the 1-D ``tail``, with one host read for all the tensors: (the
    items' values in order, the tail's)."""
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    parts = [torch.stack(tensors)] if tensors else []
    if tail is not None and tail.numel():
        parts.append(tail)
    flat: list[float] = []
    if parts:  # the one host synchronisation
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
    at = len(tensors)
    it = iter(flat[:at])
    return [next(it) if isinstance(t, torch.Tensor) else float(t) for t in items], flat[at:]
