"""How the guard measures the per-layer signals (:class:`SignalMeter`): on the device,
read with the guard's one host read per step, kept in a ring of float32 arrays.

Each ``check()``:

- **gradient norm** of every parameter, every step: the per-parameter norms the guard's
  total gradient norm is made of (:func:`..norms.norm_vector`: on the CPU one call of the
  compiled kernel that the trace's statistics engine uses, else one
  ``torch._foreach_norm`` per device and dtype; the total is that vector's norm), so it
  costs no extra pass;
- **update ratio** ``||w_after - w_before|| / ||w_before||`` on every ``update_every``-th
  check: that check copies the weights into one buffer kept for it and takes their norms
  in the same pass (:func:`..norms.copy_norms`); the next check, after the optimizer
  step, takes the norm of each copy minus the weight it finds
  (:func:`..norms.update_norms`: both read once, nothing written, with the kernel). The
  ratio of step ``t`` is
  thus read at step ``t + 1`` (the newest row's is NaN until then). No optimizer hook: it
  works for any optimizer, wrapped or not, with a closure or not (a trainer's check runs
  inside it), and a skipped update reads as 0. The copy is at most ``copy_budget``
  bytes: a larger model is measured in consecutive parts, one per measuring check;
- **Adam's lag** on every ``adam_every``-th check, for parameters whose optimizer state
  holds ``exp_avg_sq`` and ``step`` (Adam, AdamW, NAdam, RAdam, ...):
  ``mean(g^2) / mean(v_hat)`` over the parameter's elements, with ``g`` the gradient
  being checked and ``v_hat = exp_avg_sq / (1 - beta2^step)`` the bias-corrected second
  moment before this step's update. It is ``||g||^2 (1 - beta2^step) / sum(v)``: the
  gradient norm is already there, so the lag costs one reduction over ``v`` (a fused
  ``torch._foreach_norm(v, 1)``; a sum per tensor on the CPU) and the bias correction is
  applied on the host. About 1
  while the second moment follows the gradient; large when the gradient outgrows what
  Adam's normaliser expects (the lag before a spike). A mean of element-wise ratios
  would be dominated by elements whose ``v`` is still ~0;
- on the named modules, their output's largest element and largest log-sum-exp over the
  last dimension, kept on the device by forward hooks on those modules only.

Gradients still multiplied by a GradScaler's scale are divided by it (the lag by its
square) on the host. Nothing here writes to a parameter, a gradient or the optimizer.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..norms import (
    copy_norms,
    host_squares,
    host_total,
    norm_vector,
    plain_sums,
    update_norms,
)
from ..parallel import local_tensor
from .signals import SIGNAL_NAMES, UPDATE_EVERY, LayerSignals, SignalSettings

if TYPE_CHECKING:  # pragma: no cover
    from .options import GuardOptions
    from .reading import StepMeter
    from .writer import SnapshotWriter

__all__ = ["SharedCopies", "SignalMeter", "SignalRead"]


class SharedCopies(Protocol):
    """Copies of the weights someone else keeps (the rewind window's, taken when an
    optimizer step returns): the update ratio measures against them instead of a copy of
    its own."""

    @property
    def taken(self) -> int: ...  # copies taken so far: a new one when it moves

    @property
    def active(self) -> bool: ...  # taking copies on its cadence now

    def param_copies(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None: ...


@dataclass
class SignalRead:
    """What one check measured on the device, before the host read.

    Attributes
    ----------
    grad_total : Tensor or float
        The total gradient norm (0-d, float32), the norm of the per-parameter norms; a
        float when :attr:`host` holds them.
    values : Tensor
        1-D float32: the per-parameter gradient norms (unless :attr:`host` holds them),
        then the update ratios and Adam lags measured, then two values per watched module.
    param_total : Tensor or None
        The total weight norm, on a check that measured the weights (else ``None``).
    host : ndarray or None
        The per-parameter gradient norms already on the host (float64: on the CPU with
        the compiled kernel, :func:`..norms.host_squares`), ahead of :attr:`values`.
    """

    grad_total: torch.Tensor | float
    values: torch.Tensor
    param_total: torch.Tensor | None = None
    host: np.ndarray | None = None
    segments: list[tuple[str, list[int]]] = field(default_factory=list)
    armed: bool = False
    adam: list[AdamTerm] = field(default_factory=list)


#: no device values (a check whose only signals are the host's gradient norms)
_EMPTY = torch.zeros(0)


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    logits = getattr(output, "logits", None)  # a transformers ModelOutput
    return logits if isinstance(logits, torch.Tensor) else None


class ModuleWatch:
    """Forward hooks on the named modules: the largest output element and the largest
    log-sum-exp over the last dimension of the step's calls, kept on the device."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str]) -> None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            some = ", ".join(repr(n) for n in list(modules)[1:8])
            raise ValueError(
                f"signals modules must name modules of the model (as in "
                f"model.named_modules(), e.g. {some}); got {missing[0]!r}."
            )
        self.names = list(names)
        self.stats: list[torch.Tensor | None] = [None] * len(self.names)
        ref = weakref.ref(self)
        self.handles = [
            modules[n].register_forward_hook(_hook(ref, i, modules[n]))
            for i, n in enumerate(self.names)
        ]
        weakref.finalize(self, _remove, list(self.handles))

    def update(self, i: int, output: Any) -> None:
        out = _first_tensor(output)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not out.numel():
            return
        with torch.no_grad():
            o = out.detach()
            if o.device.type == "cpu" and o.dtype not in (torch.float32, torch.float64):
                o = o.float()
            lse = torch.logsumexp(o, -1).amax() if o.dim() else o
            st = torch.stack([o.amax().float(), lse.float()])
            prev = self.stats[i]
            self.stats[i] = st if prev is None else torch.maximum(prev, st.to(prev.device))

    def take(self, device: torch.device) -> torch.Tensor:
        """The step's values (2 per module, NaN for a module not called) on ``device``;
        starts the next step."""
        stats = [
            torch.full((2,), math.nan, device=device) if s is None else s.to(device)
            for s in self.stats
        ]
        out = torch.cat(stats)
        self.stats = [None] * len(self.names)
        return out

    def remove(self) -> None:
        _remove(self.handles)


def _hook(ref: weakref.ref[ModuleWatch], i: int, target: torch.nn.Module) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        watch = ref()
        if watch is not None and module is target:  # not a deep copy of the module
            watch.update(i, output)

    return hook


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


@dataclass(frozen=True)
class AdamTerm:
    """One parameter's part of Adam's lag: its index, its second moment, ``beta2`` and
    the optimizer's step count (a float, or in ``step_tensor`` when it lives on the
    device: then it is read with the step)."""

    index: int
    exp_avg_sq: torch.Tensor
    beta2: float
    step: float | None
    step_tensor: torch.Tensor | None = None


def adam_terms(
    optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor]
) -> list[AdamTerm]:
    """The parameters with a gradient and an Adam-like state (``exp_avg_sq``, ``step``,
    the group's ``betas``), in parameter order."""
    if optimizer is None:
        return []
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for i, p in enumerate(params):
        state, group = optimizer.state.get(p), group_of.get(id(p))
        if not state or group is None or p.grad is None or p.grad.is_sparse:
            continue
        v, step, betas = state.get("exp_avg_sq"), state.get("step"), group.get("betas")
        if not isinstance(v, torch.Tensor) or step is None or not betas:
            continue
        on_device = isinstance(step, torch.Tensor) and step.device.type != "cpu"
        host_step = None if on_device else float(step)
        device_step = step if on_device else None
        out.append(AdamTerm(i, local_tensor(v), float(betas[1]), host_step, device_step))
    return out


def _stacked(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d tensors as one float32 vector on ``device`` (empty for none)."""
    if not values:
        return torch.zeros(0, device=device)
    f32 = torch.float32
    return torch.stack(
        [v if v.device == device and v.dtype == f32 else v.to(device, f32) for v in values]
    )


def _partition(params: Sequence[torch.Tensor], budget: int | None) -> list[list[int]]:
    """The parameter indices in consecutive parts of at most ``budget`` bytes (a larger
    parameter is a part alone; ``None``: one part)."""
    parts: list[list[int]] = []
    size = 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if not parts or (budget is not None and size + nbytes > budget):
            parts.append([])
            size = 0
        parts[-1].append(i)
        size += nbytes
    return parts


def _lags(
    terms: Sequence[AdamTerm],
    vsums: np.ndarray,
    device_steps: np.ndarray | None,
    grad_norms: np.ndarray,
) -> np.ndarray:
    """Adam's lag of each term on the host: ``mean(g^2) / mean(v_hat)`` =
    ``||g||^2 (1 - beta2^step) / sum(v)`` (``grad_norms``: unscaled, per parameter)."""
    it = iter(device_steps if device_steps is not None else ())
    steps = np.array([t.step if t.step is not None else next(it) for t in terms])
    beta2 = np.array([t.beta2 for t in terms])
    g = grad_norms[[t.index for t in terms]].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lags: np.ndarray = (g * g * (1.0 - beta2**steps) / vsums).astype(np.float32)
    return lags


class SignalMeter:
    """The per-layer signals of one guard: measures them (:meth:`collect`, on the
    device), records what the host read (:meth:`record`) into a ring of
    ``settings.ring`` steps, and shows it (:meth:`view`)."""

    def __init__(
        self,
        settings: SignalSettings,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        params: Sequence[torch.nn.Parameter],
    ) -> None:
        self.settings = settings
        self.optimizer = optimizer
        self.params = list(params)
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names.get(id(p), f"<parameter {i}>") for i, p in enumerate(self.params)]
        self.watch = ModuleWatch(model, settings.modules) if settings.modules else None
        cap, n_p, n_m = settings.ring, len(self.params), len(settings.modules)
        self._steps = np.zeros(cap, np.int64)
        self._arrays = {s: np.full((cap, n_p), np.nan, np.float32) for s in SIGNAL_NAMES}
        self._modules = np.full((cap, n_m, 2), np.nan, np.float32)
        self._count = 0  # rows written so far (the next row is _count % ring)
        self._checks = 0
        self._adam_last: int | None = None  # the check that last measured Adam's lag
        #: ``sum(exp_avg_sq)`` per parameter (by ``id``), read by the update watch after
        #: the optimizer step this check follows (:meth:`offer_sums`), or ``None``
        self._offer: dict[int, torch.Tensor] | None = None
        #: the parts whose weights one measuring check copies (at most ``copy_budget``
        #: bytes each; one part when they all fit), measured in turn
        self._chunks = _partition(self.params, settings.copy_budget)
        self._cursor = 0
        self._chunk: list[int] = []  # the part of the armed check
        self._weights: list[torch.Tensor] | None = None  # its weights at that check
        self._weight_norms: torch.Tensor | None = None
        self._pending: int | None = None  # the row (as a count) whose update ratio is due
        self._shared: SharedCopies | None = None  # (share_copies) the copies measured against
        self._seen = 0  # the shared copy last armed (its ``taken``)
        self._owned = True  # whether ``_weights`` is the meter's own buffer
        every = settings.update_every
        #: the own copy's cadence (``"auto"``: :data:`UPDATE_EVERY` unless shared)
        self._update_every: int | None = (
            UPDATE_EVERY if every == "auto" else every if isinstance(every, int) else None
        )

    @classmethod
    def create(
        cls,
        options: GuardOptions,
        meter: StepMeter,
        writer: SnapshotWriter | None = None,
    ) -> SignalMeter | None:
        """The signals the options ask for (``None``: ``signals=False``) of the model,
        optimizer and parameters of the guard's ``meter``; the snapshots of ``writer``
        hold their ring as the field ``"signals"``."""
        settings = options.checks.signal_settings
        if settings is None:
            return None
        signals = cls(settings, meter.model, meter.optimizer, meter.params)
        if writer is not None:
            writer.set_field("signals", signals.field)
        return signals

    # ------------------------------------------------------------------ measuring
    def _due(self, every: int | None) -> bool:
        return every is not None and self._checks % every == 0

    def offer_sums(self, sums: dict[int, torch.Tensor] | None) -> None:
        """``sum(exp_avg_sq)`` of each parameter (by ``id``; 0-d, on its device) as the
        update watch read it after an optimizer step (``None``: another step began): the
        next check measures Adam's lag from them instead of reading the state again."""
        self._offer = sums

    def _adam_due(self, offered: dict[int, torch.Tensor] | None) -> bool:
        """Adam's lag is measured on a check that follows the update watch's read of the
        state (no pass of its own), and at least every ``adam_every`` checks."""
        every = self.settings.adam_every
        if every is None:
            return False
        last = self._adam_last
        return offered is not None or last is None or self._checks - last >= every

    def _state_sums(
        self, terms: Sequence[AdamTerm], offered: dict[int, torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """``sum(v)`` of each term: the update watch's where it offered them, else one
        pass over ``v`` here."""
        got = offered or {}
        sums = [got.get(id(self.params[t.index])) for t in terms]
        missing = [i for i, v in enumerate(sums) if v is None]
        if missing:
            for i, v in zip(missing, plain_sums([terms[i].exp_avg_sq for i in missing])):
                sums[i] = v
        return [v for v in sums if v is not None]

    @torch.no_grad()
    def collect(self, grads: Sequence[torch.Tensor], device: torch.device) -> SignalRead:
        """Measure this check's signals on the device (no host sync). ``grads``: the
        gradients of the parameters that have one, in parameter order."""
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        offered, self._offer = self._offer, None
        update = self._update(device)  # before the weights are copied again below
        squares = host_squares(grads) if device.type == "cpu" else None
        parts: list[torch.Tensor] = []
        if squares is not None:  # on the host already: no torch op to combine them
            read = SignalRead(host_total(squares), _EMPTY, host=np.sqrt(squares))
        else:
            gvec = norm_vector(grads, device=device, dtype=torch.float32)
            read = SignalRead(torch.linalg.vector_norm(gvec), gvec)
            parts.append(gvec)
        read.segments.append(("grad_norm", idx))
        if update is not None and self._weight_norms is not None:
            parts.append(update / self._weight_norms)
            read.segments.append(("update_ratio", list(self._chunk)))
        sharing = self.sharing  # (once per check: it reads the window's history rows)
        shared = self._shared_copy() if sharing else None
        if shared is not None:
            self._arm_shared(shared, device)
            read.armed = True
        elif not sharing and self._due(self._update_every) and self._chunks:
            read.param_total = self._arm(device)
            read.armed = True
        elif update is not None and len(self._chunks) > 1:
            self._weights = None  # a part's copy lives from its check to the next only
        if self._adam_due(offered):
            read.adam = adam_terms(self.optimizer, self.params)
            self._adam_last = self._checks
        if read.adam:  # sum(v) per parameter (one pass over v), and device step counts
            parts.append(_stacked(self._state_sums(read.adam, offered), device))
            read.segments.append(("adam_lag", [t.index for t in read.adam]))
            steps = [t.step_tensor for t in read.adam if t.step_tensor is not None]
            if steps:
                parts.append(_stacked(steps, device))
                read.segments.append(("adam_step", [t.index for t in read.adam if t.step is None]))
        if self.watch is not None:
            parts.append(self.watch.take(device))
            read.segments.append(("modules", []))
        if parts:
            read.values = torch.cat(parts) if len(parts) > 1 else parts[0]
        return read

    def _update(self, device: torch.device) -> torch.Tensor | None:
        """The norms of the armed part's ``w_before - w_after`` (its copy against the
        weights now; the meter's own copy may be overwritten), or ``None``."""
        if self._pending is None or not self._weights:
            return None
        now = [local_tensor(self.params[i]) for i in self._chunk]
        if self._owned:
            return update_norms(self._weights, now, device=device, dtype=torch.float32)
        before, self._weights = self._weights, None  # the keeper's: read once, not held
        if self._shared is None or self._shared.taken != self._seen:
            return None  # refilled since (not on the keeper's cadence; never measured stale)
        return update_norms(before, now, device=device, dtype=torch.float32, scratch=False)

    # ------------------------------------------------------------------ shared copies
    def share_copies(self, source: SharedCopies) -> None:
        """With ``update_every="auto"``, measure the update ratio against ``source``'s
        copies (the rewind window's): on the check after each new copy (its cadence), with
        no copy of the meter's own, while the source is :attr:`~SharedCopies.active` (a
        window held by a spike is not refreshed: meanwhile the meter copies the weights
        itself every :data:`UPDATE_EVERY` checks, so the update ratio stays measured while
        a run grows). An explicit ``update_every`` keeps its own copies."""
        if self.settings.update_every != "auto":
            return
        self._shared, self._seen = source, source.taken
        self._weights = self._weight_norms = None
        self._pending = None

    @property
    def sharing(self) -> bool:
        """Whether the update ratio reads shared copies (:meth:`share_copies`)."""
        return self._shared is not None and self._shared.active

    def _shared_copy(self) -> list[torch.Tensor] | None:
        """The copies of a new shared copy since the last check (``None``: none new)."""
        src = self._shared
        if src is None or src.taken == self._seen:
            return None
        self._seen = src.taken
        return src.param_copies(self.params)

    def _arm_shared(self, copies: list[torch.Tensor], device: torch.device) -> None:
        """Arm the update ratio on a shared copy of every weight (their norms now)."""
        self._weights, self._owned = copies, False
        self._chunk = list(range(len(self.params)))
        self._weight_norms = norm_vector(copies, device=device, dtype=torch.float32)

    def _arm(self, device: torch.device) -> torch.Tensor | None:
        """Copy the next part's weights and take their norms (in one pass with the
        compiled kernel); the total weight norm when the part is all of them."""
        chunk = self._chunks[self._cursor % len(self._chunks)]
        self._cursor += 1
        weights = [local_tensor(self.params[i]) for i in chunk]  # (under no_grad)
        if self._weights is None or not self._owned or chunk != self._chunk:
            self._owned = True
            self._weights = None
            self._weights = [
                torch.empty_like(w, memory_format=torch.contiguous_format) for w in weights
            ]
        self._chunk = chunk
        self._weight_norms = copy_norms(self._weights, weights, device=device, dtype=torch.float32)
        whole = len(self._chunks) == 1
        return torch.linalg.vector_norm(self._weight_norms) if whole else None

    def record(
        self, read: SignalRead, values: Sequence[float], *, step: int, scale: float | None
    ) -> None:
        """Put the values of ``read`` (``read.host``, then ``values``: its device values
        as read) in the ring as step ``step``; ``scale``: the GradScaler scale the
        gradients were still multiplied by."""
        cap = self.settings.ring
        row = self._count % cap
        self._steps[row] = step
        chunks: dict[str, np.ndarray] = {}
        if read.host is not None and not len(values):  # a step with the gradients' norms only
            chunks["grad_norm"] = read.host
        else:
            arr = np.asarray(values, dtype=np.float64)
            if read.host is not None:
                arr = np.concatenate((read.host, arr))
            at = 0
            for name, idx in read.segments:
                n = 2 * len(self.settings.modules) if name == "modules" else len(idx)
                chunks[name] = arr[at : at + n]
                at += n
        norms = chunks["grad_norm"]
        if scale is not None and scale > 0 and scale != 1.0:
            norms = norms / scale
        grad = self._arrays["grad_norm"]
        with_grad = read.segments[0][1]
        if len(with_grad) == len(self.params):  # (in order: every parameter has one)
            grad[row] = norms
        else:
            grad[row] = np.nan
            grad[row, with_grad] = norms
        self._arrays["update_ratio"][row] = np.nan  # (measured at the next check)
        self._arrays["adam_lag"][row] = np.nan
        if self.watch is not None:
            self._modules[row] = np.nan
        pending = self._pending
        if "update_ratio" in chunks and pending is not None and self._count - pending < cap:
            part = dict(read.segments)["update_ratio"]  # the part armed at that check
            self._arrays["update_ratio"][pending % cap, part] = chunks["update_ratio"]
        if read.adam:
            self._arrays["adam_lag"][row, [t.index for t in read.adam]] = _lags(
                read.adam, chunks["adam_lag"], chunks.get("adam_step"), grad[row]
            )
        if "modules" in chunks:
            self._modules[row] = chunks["modules"].reshape(-1, 2)
        self._pending = self._count if read.armed else None
        self._count += 1
        self._checks += 1

    # ------------------------------------------------------------------ views
    def _order(self) -> np.ndarray:
        cap = self.settings.ring
        n = min(self._count, cap)
        start = self._count - n
        return (np.arange(start, self._count) % cap).astype(np.int64)

    def view(self) -> LayerSignals:
        """The ring as :class:`LayerSignals` (a copy, oldest step first)."""
        order = self._order()
        mods = self._modules[order]
        return LayerSignals.from_arrays(
            self.names,
            self._steps[order],
            *(self._arrays[s][order] for s in SIGNAL_NAMES),
            modules=list(self.settings.modules),
            max_logit=mods[:, :, 0],
            logsumexp=mods[:, :, 1],
        )

    def field(self) -> dict[str, Any]:
        """The snapshot field ``"signals"``: the ring as plain data (arrays become the
        file's tensors) with the settings it was measured under."""
        sig = self.view()
        return {
            "names": sig.names,
            "steps": sig.steps,
            **{s: sig.signal(s) for s in SIGNAL_NAMES},
            "modules": sig.modules,
            "max_logit": sig.max_logit,
            "logsumexp": sig.logsumexp,
            "ring": self.settings.ring,
            "update_every": self.settings.update_every,
            "copy_budget": self.settings.copy_budget,
            "adam_every": self.settings.adam_every,
        }

    @property
    def nbytes(self) -> int:
        """Host bytes of the ring and device bytes of the weight copy."""
        ring = self._steps.nbytes + self._modules.nbytes
        ring += sum(a.nbytes for a in self._arrays.values())
        copy = sum(w.numel() * w.element_size() for w in self._weights or ()) if self._owned else 0
        return int(ring + copy)

    def summary(self) -> str:
        """``signals 37/500 steps x 148 parameters (1.2 MiB)``, for the guard's repr."""
        n = min(self._count, self.settings.ring)
        return (
            f"signals {n}/{self.settings.ring} steps x {len(self.names)} parameters "
            f"({self.nbytes / 2**20:.1f} MiB)"
        )

    def close(self) -> None:
        """Remove the forward hooks and free the weight copy."""
        if self.watch is not None:
            self.watch.remove()
        self._weights = self._weight_norms = None
        self._pending = None
