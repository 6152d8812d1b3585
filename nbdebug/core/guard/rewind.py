"""The guard's rewind window (``NaNGuard(..., rewind=K)``): :class:`RewindKeeper` keeps
what replaying the last steps needs, one in-memory copy of the model, optimizer,
scheduler and scaler states, refreshed every ``K`` steps, plus every step since (its
batch, RNG states, learning rates, loss and gradient norm). A snapshot holds it in its
``rewind`` field (:class:`~nbdebug.core.snapshot.rewind.RewindWindow`).

When the copy is taken
----------------------
At a step boundary where the weights and the optimizer state agree: when
``optimizer.step()`` returns (a step post-hook), the weights and the optimizer state are
those the coming step starts from (its forward only reads them). ``check()`` of step
``t`` (after its backward, before its optimizer step) would be consistent too (the
start of ``t``: nothing has changed them since the forward), but on CUDA the optimizer
step would then have to wait for the copy; taken after it, the copy runs on a side
stream into pinned host memory while the next forward and backward run (they only read
the weights; the buffers, which the forward writes, are copied on the current stream
ahead of it), and only the next update waits for it (from the next ``check()`` on, or
the optimizer step's pre-hook; long done by then). The scheduler, the scaler and the
learning rates are read at the next ``check()``, after ``scheduler.step()`` and
``scaler.update()``: the window starts at that step. Refreshed every ``K`` steps, the
window holds the failing step and the 0 to ``K - 1`` steps before it; but a window in
which the spike detector flagged a step is not refreshed (up to ``4 * K`` steps), so a run
that has begun to grow keeps the state from before it, the state a diagnosis replays from.

A step whose update the guard skipped (``check()`` returned ``False``) ends the window:
a new copy is taken at the next optimizer step.

Memory: the copy is the model's ``state_dict()`` and the optimizer's state tensors once
(tied tensors once), allocated at the first refresh and reused by every later one; plus
each step's batch (a CPU copy, into the buffers of the window before; only its dataset ``ids``
when they are given and the batch is over :data:`IDS_ONLY_ABOVE`; nothing above
:data:`BATCH_LIMIT`).
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..parallel import is_dtensor
from ..snapshot.data import cpu_copy, to_plain
from ..snapshot.rewind import RewindStep, RewindWindow, window_to_payload
from ..state import RngState
from ..text import fmt_bytes
from .statecopy import BatchBuffers, StateCopy, tensor_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .guard import NaNGuard
    from .history import HistoryRow
    from .reading import StepReading
    from .stepstart import StepStart
    from .verdict import Verdict

__all__ = [
    "BATCH_LIMIT",
    "BUDGET_CAP",
    "BUDGET_SHARE",
    "COPY_SHARE",
    "DEFAULT_EVERY",
    "IDS_ONLY_ABOVE",
    "MAX_EVERY",
    "RewindKeeper",
    "check_rewind",
    "rewind_budget",
    "state_estimate",
]

#: ``rewind="auto"`` (and ``True``): the state copy is refreshed every this many steps at
#: least; on the CPU the cadence then grows until the copy, amortised, costs at most
#: :data:`COPY_SHARE` of a step (measured: the copy's time against the time between checks),
#: up to :data:`MAX_EVERY` steps
DEFAULT_EVERY = 8
COPY_SHARE = 0.0025
MAX_EVERY = 64
#: ``rewind="auto"`` is on when the state fits ``min(BUDGET_CAP, BUDGET_SHARE *
#: available RAM)``: the copy doubles the training state held on the host, and a
#: snapshot write copies it once more; 2 GiB holds GPT-2 124M with Adam (1.5 GiB) and
#: keeps a refresh near a tenth of a second of memory bandwidth
BUDGET_CAP = 2 * 2**30
BUDGET_SHARE = 0.25
#: a step's batch above this many bytes is not kept (``stored=False``)
BATCH_LIMIT = 64 * 2**20
#: with ``ids=`` given, a batch above this many bytes keeps only its dataset indices
IDS_ONLY_ABOVE = 2**20


def check_rewind(value: object) -> int | str | None:
    """The ``rewind`` option as ``"auto"``, a number of steps, or ``None`` (off).

    Raises
    ------
    TypeError, ValueError
        Anything else, in one sentence."""
    expected = "rewind must be a number of steps >= 1, 'auto', or 0/None/False (off)"
    if value is None or value is False or (value == 0 and isinstance(value, int)):
        return None
    if value is True:
        return DEFAULT_EVERY
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"{expected}; got {value!r}.")
        return value
    if not isinstance(value, int):
        raise TypeError(f"{expected}; got {type(value).__qualname__} {value!r}.")
    if value < 0:
        raise ValueError(f"{expected}; got {value!r}.")
    return value


def state_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state copy: the model's ``state_dict()`` and the optimizer's state;
    an optimizer that holds none yet counts twice the parameters with ``betas`` (Adam's
    two moments), once without (a momentum)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    if optimizer.state:
        return total + tensor_bytes(list(optimizer.state.values()))
    params = int(
        sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    )
    return total + params * (2 if "betas" in optimizer.defaults else 1)


def rewind_budget() -> int:
    """The memory ``rewind="auto"`` allows: ``min(BUDGET_CAP, BUDGET_SHARE * available
    RAM)`` (the cap alone where the available memory cannot be read)."""
    available = None
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        try:
            import psutil

            available = int(psutil.virtual_memory().available)
        except ImportError:
            pass
    if available is None:
        return BUDGET_CAP
    return min(BUDGET_CAP, int(BUDGET_SHARE * available))


class RewindKeeper:
    """The rewind window of one guard (see the module docstring)."""

    def __init__(
        self,
        every: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        cuda: bool = False,
    ) -> None:
        self.every = every
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.state = StateCopy(cuda=cuda)
        #: the guard's step start (its ``rng``: the RNG states at the start of the step)
        self.start: StepStart | None = None
        #: the memory the state copy is expected to take (:func:`state_estimate`)
        self.estimate = 0
        self.window: RewindWindow | None = None
        self._buffers = BatchBuffers()  # the batches of the window before, reused
        #: the guard's history rows: a window whose steps were flagged as spikes is held
        self.history: Sequence[HistoryRow] = ()
        #: (the newest history row :attr:`spiked` looked at, whether a row of the window was
        #: flagged): each call reads only the rows added since (reset with the window)
        self._spike_scan: tuple[HistoryRow | None, bool] | None = None
        self._armed = False  # the next optimizer step takes the copy
        self.auto = False  # rewind="auto": the cadence adapts to the copy's cost (CPU)
        self._last_check: float | None = None
        self._step_s: list[float] = []  # the last times between two checks
        self._fresh = False  # it did: the next check starts a window
        # the copy's layout: model state names, optimizer state (index, key) of each
        # tensor copied, its other values; the copies in that order
        self._layout: tuple[list[str], list[tuple[Any, str]], list[tuple[Any, str, Any]]] | None
        self._layout = None
        self._copies: list[torch.Tensor] = []
        #: copies taken so far; the copy of each tensor by :meth:`_index`'s key
        self.taken = 0
        self._copy_of: dict[tuple[Any, ...], torch.Tensor] = {}
        ref = weakref.ref(self)

        def after_step(*_: object) -> None:
            keeper = ref()
            if keeper is not None and keeper._armed:
                try:
                    keeper._take_if_settled()
                except Exception as e:  # the training step must not fail for the window
                    keeper.give_up(e)

        def before_step(*_: object) -> None:
            keeper = ref()
            if keeper is not None:
                keeper.hold_update()

        hooks = [optimizer.register_step_post_hook(after_step)]
        if cuda:
            hooks.append(optimizer.register_step_pre_hook(before_step))
        for h in hooks:
            weakref.finalize(self, h.remove)
        self._hooks = hooks

    def close(self) -> None:
        """Remove the keeper's optimizer hooks (the guard's :meth:`close`); the window
        taken so far stays readable."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @classmethod
    def create(cls, option: object, guard: NaNGuard) -> RewindKeeper | None:
        """The keeper of ``guard`` the option asks for (``None``: off; ``"auto"``: on when
        the state fits :func:`rewind_budget`), joined to its snapshot writer.

        Raises
        ------
        ValueError
            A number of steps without an optimizer (the window is taken at its steps)."""
        every = check_rewind(option)
        model, optimizer = guard.model, guard.optimizer
        if every is None or (every == "auto" and optimizer is None):
            return None
        if optimizer is None:
            raise ValueError(
                f"rewind={option!r} needs the optimizer (NaNGuard(model, optimizer, ...)): the "
                "window's copy is taken when optimizer.step() returns; got none."
            )
        if any(is_dtensor(p) for p in model.parameters()):  # its state_dict gathers
            if every == "auto":
                return None
            raise ValueError(
                f"rewind={option!r} needs a model whose parameters are whole on this rank; "
                "got sharded (DTensor, FSDP2) parameters: use rewind=False."
            )
        estimate = state_estimate(model, optimizer)
        if every == "auto":
            if estimate > rewind_budget():
                return None
            every = DEFAULT_EVERY
        cuda = any(p.is_cuda for p in model.parameters())
        keeper = cls(int(every), model, optimizer, guard.scheduler, guard.scaler, cuda=cuda)
        keeper.start, keeper.estimate, keeper.history = guard.start, estimate, guard.history
        keeper.auto = option in ("auto", True) and not cuda
        guard.writer.rewind = keeper.payload
        if guard.meter.signals is not None and not cuda:  # host copies of host weights
            guard.meter.signals.share_copies(keeper)  # the update ratio reads this copy
        return keeper

    # ------------------------------------------------------------------ the copy
    def _take(self) -> None:
        """Copy the model and optimizer state tensors (the optimizer step just ended)."""
        self._armed = False
        t0, refill = time.perf_counter(), self._layout is not None  # the first one allocates
        model_state = self.model.state_dict()
        memo: dict[tuple[Any, ...], int] = {}
        sources: list[torch.Tensor] = []
        order = [self._index(t, memo, sources) for t in model_state.values()]
        n_model = len(sources)
        slots: list[tuple[Any, str]] = []
        plain: list[tuple[Any, str, Any]] = []
        for idx, entry in self.optimizer.state_dict()["state"].items():
            for key, v in entry.items():
                if isinstance(v, torch.Tensor):
                    slots.append((idx, key))
                    order.append(self._index(v, memo, sources))
                else:
                    plain.append((idx, key, copy.deepcopy(v)))
        # on CUDA the model's buffers (not its parameters) are copied on the current
        # stream: the next forward writes them (BatchNorm's running statistics)
        params = {p.data_ptr() for p in self.model.parameters()}
        volatile = [
            i
            for i, t in enumerate(sources[:n_model])
            if self.state.cuda and t.is_cuda and t.data_ptr() not in params
        ]
        steady = sorted(set(range(len(sources))) - set(volatile))
        filled = self.state.fill([sources[i] for i in steady], [sources[i] for i in volatile])
        where = dict(zip(steady + volatile, filled))
        self._layout = (list(model_state), slots, plain)
        self._copies = [where[i] for i in order]
        self._copy_of = {key: where[i] for key, i in memo.items()}
        self.taken += 1
        self._drop_window()
        self._fresh = True
        if self.auto and refill:
            self._adapt(time.perf_counter() - t0)

    def _adapt(self, copy_s: float) -> None:
        """``rewind="auto"`` on the CPU: refresh every so many steps that the copy that just
        took ``copy_s`` seconds costs at most :data:`COPY_SHARE` of a step, amortised
        (between :data:`DEFAULT_EVERY` and :data:`MAX_EVERY`)."""
        if len(self._step_s) < 3:
            return
        step_s = sorted(self._step_s)[len(self._step_s) // 2]
        need = math.ceil(copy_s / (COPY_SHARE * step_s)) if step_s > 0 else MAX_EVERY
        self.every = max(DEFAULT_EVERY, min(MAX_EVERY, need))

    def give_up(self, error: Exception) -> None:
        """Stop keeping the window (its copy failed), with a warning."""
        self.every, self.window, self._armed, self._fresh = 0, None, False, False
        self._spike_scan = None
        warnings.warn(
            f"nbdebug: the rewind window could not copy the training state "
            f"({type(error).__name__}: {error}); the guard goes on without it.",
            RuntimeWarning,
            stacklevel=2,
        )

    def hold_update(self) -> None:
        """On CUDA, make the coming optimizer update wait for the copy still running
        (called by ``check()`` and before each optimizer step; once per copy)."""
        self.state.hold()

    @property
    def active(self) -> bool:
        """Whether the keeper takes copies on its cadence: not given up, and its window
        not held by a spike (:attr:`spiked`)."""
        return self.every > 0 and not self.spiked

    def param_copies(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The last copy of each of ``params`` (as they were when the optimizer step that
        took it returned), or ``None`` (no copy yet, or a parameter not in it). The keeper
        refills them at its next refresh: only read them, and not after ``taken`` moved."""
        if not self.taken or self.every <= 0:
            return None
        out = [self._copy_of.get(self._key(p)) for p in params]
        return None if any(c is None for c in out) else [c for c in out if c is not None]

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)

    @staticmethod
    def _index(t: torch.Tensor, memo: dict[tuple[Any, ...], int], out: list[torch.Tensor]) -> int:
        key = RewindKeeper._key(t)
        if key not in memo:
            memo[key] = len(out)
            out.append(t.detach())
        return memo[key]

    def _start(self, step: int) -> RewindWindow:
        """The window whose state the last copy holds, starting at ``step`` (the scheduler,
        scaler and learning rates read now)."""
        assert self._layout is not None
        names, slots, plain = self._layout
        copies = iter(self._copies)
        model_state = {name: next(copies) for name in names}
        state: dict[Any, dict[str, Any]] = {}
        for idx, key in slots:
            state.setdefault(idx, {})[key] = next(copies)
        for idx, key, v in plain:
            state.setdefault(idx, {})[key] = v
        groups = copy.deepcopy(self.optimizer.state_dict()["param_groups"])
        return RewindWindow(
            start_step=step,
            model_state=model_state,
            optimizer_state={"state": state, "param_groups": groups},
            scheduler_state=_state_of(self.scheduler),
            scaler_state=_state_of(self.scaler),
            steps=[],
            nbytes=self.state.nbytes,
        )

    # ------------------------------------------------------------------ each step
    def record(
        self,
        reading: StepReading,
        verdict: Verdict,
        batch: tuple[Any, Any],
        ids: Sequence[int] | None,
        last_ok: bool | None,
    ) -> None:
        """Note step ``reading.step`` (called by ``check()`` before it acts on
        ``verdict``): start a window when the copy was just taken, end it when the last
        check returned ``False`` (``last_ok``: its update was skipped), add the step (its
        RNG states at its start: ``start.rng``), and arm the copy when the window is
        ``every`` steps long (on a step the guard lets through)."""
        self.hold_update()
        now = time.perf_counter()
        if self._last_check is not None:
            self._step_s = [*self._step_s[-7:], now - self._last_check]
        self._last_check = now
        if self._fresh:
            self._fresh = False
            self._drop_window()
            self.window = self._start(reading.step)
        elif last_ok is False:
            self._drop_window()
        if self.window is not None and len(self.window.steps) >= 4 * self.every:
            self._drop_window()  # no optimizer step took the copy: the memory stays bounded
        if self.window is not None:
            rng = self.start.rng if self.start is not None else RngState.capture()
            self._add(self.window, reading, batch, ids, rng)
        passed = verdict.kind is None and self.every > 0
        if passed and (self.window is None or len(self.window.steps) >= self.every):
            self._armed = True

    def _take_if_settled(self) -> None:
        """Take the armed copy (the optimizer step just ended) unless the spike detector
        flagged a step of the window, this one included: a run that has begun to grow
        keeps the state from before it (up to ``4 * every`` steps), so that a diagnosis
        replays from a healthy state."""
        if self.spiked:
            self._armed = False  # the next check arms it again
            return
        self._take()

    @property
    def spiked(self) -> bool:
        """Whether the spike detector flagged a step of the current window (it is held:
        not refreshed while it lasts)."""
        window = self.window
        if window is None:
            return False
        scan = self._spike_scan
        if scan is not None and scan[1]:
            return True
        seen = scan[0] if scan is not None else None
        newest: HistoryRow | None = None
        found = False
        first = window.start_step
        for r in reversed(self.history):  # the window's rows are the last ones
            newest = r if newest is None else newest
            if r["step"] < first:
                break
            if r.get("spikes"):
                found = True
                break
            if r is seen:  # looked at before (and again now: a row is flagged as it ends)
                break
        self._spike_scan = (newest, found)
        return found

    def _add(
        self,
        window: RewindWindow,
        reading: StepReading,
        batch: tuple[Any, Any],
        ids: Sequence[int] | None,
        rng: RngState,
    ) -> None:
        size = tensor_bytes(list(batch))
        stored = size <= BATCH_LIMIT and (ids is None or size <= IDS_ONLY_ABOVE)
        inputs = target = None
        if stored:
            dropped: list[str] = []
            take = self._buffers.take
            inputs = cpu_copy(to_plain(batch[0], "inputs", dropped, clone=False), into=take)
            target = cpu_copy(to_plain(batch[1], "target", dropped, clone=False), into=take)
            window.nbytes += size
        lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        window.steps.append(
            RewindStep(
                step=reading.step,
                inputs=inputs,
                target=target,
                stored=stored,
                ids=None if ids is None else [int(i) for i in ids],
                rng=rng,
                lr=lr,
                loss=reading.loss,
                grad_norm=reading.grad_norm,
            )
        )

    def _drop_window(self) -> None:
        """End the window (if any): its batches' buffers are reused by the next one."""
        if self.window is not None:
            self._buffers.reuse(self.window)
        self.window = None
        self._spike_scan = None

    # ------------------------------------------------------------------ views
    def current(self) -> RewindWindow | None:
        """The window as it stands (``None`` before the first copy; after a skipped
        update until the next one), its copy complete. Its state tensors and batches are
        the keeper's buffers, refilled by the next refreshes: copy what is to be kept."""
        if self.window is not None:
            self.state.wait()
        return self.window

    def payload(self, step: int) -> dict[str, Any] | None:
        """The snapshot's ``rewind`` field for a snapshot of ``step`` (the window's last
        step; ``None`` when the window does not reach it)."""
        window = self.current()
        if window is None or not window.steps or window.steps[-1].step != step:
            return None
        return window_to_payload(window)

    @property
    def nbytes(self) -> int:
        """The memory held: the state copy and the stored batches."""
        return self.window.nbytes if self.window is not None else self.state.nbytes

    def summary(self) -> str:
        """``"rewind every 8 steps (1.4 GiB)"`` (the memory held; before the first copy,
        its estimate), for the guard's repr."""
        held = self.nbytes
        size = fmt_bytes(held) if held else f"~{fmt_bytes(self.estimate)}"
        return f"rewind every {self.every} steps ({size})"

    def __repr__(self) -> str:
        return f"RewindKeeper({self.summary()}, window {self.window!r})"


def _state_of(obj: Any) -> dict[str, Any] | None:
    """A deep copy of ``obj.state_dict()`` (``None`` without ``obj``; a state that
    cannot be copied is not kept)."""
    if obj is None:
        return None
    try:
        state: dict[str, Any] = copy.deepcopy(obj.state_dict())
        return state
    except Exception:
        return None
