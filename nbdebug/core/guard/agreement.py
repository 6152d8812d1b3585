"""Distributed training: every rank of a process group takes the same decision on a step.

:class:`NaNGuard` builds a :class:`RankAgreement` when ``torch.distributed`` is initialised
(or ``process_group=`` is given). Its :meth:`RankAgreement.agree` is one tiny
``all_reduce(MAX)`` per step: each rank writes what it read as non-finite *locally* (a bit
set: loss, gradients, weights) and its step number into its own slot of a
``2 * world_size`` float64 tensor, so after the reduction every rank knows every rank's
verdict, the step of every rank, and skips when any rank saw a non-finite value.

With a GradScaler, inf/NaN gradients under a finite loss stay the scaler's business and are
not agreed: under DDP every rank's scaler sees the same all-reduced gradients and skips the
same step (under FSDP2 use ``ShardedGradScaler``, which all-reduces its overflow flag).

The rule for a NaN that appears before versus after DDP's gradient all-reduce
------------------------------------------------------------------------------
``DistributedDataParallel`` averages the gradients of all ranks inside ``backward()``, before
``guard.check()`` runs:

* a NaN/Inf produced **before** that all-reduce (in one rank's batch, forward, loss or
  backward) reaches the gradients of **every** rank through it (NaN + x = NaN): every rank
  sees non-finite gradients locally (``local_first=True`` everywhere). The loss is not
  all-reduced, so the culprit is the rank whose own *loss* (or weights) was non-finite;
  when every loss is finite (a NaN born in one rank's backward) the gradients cannot tell,
  all ranks are named, and :func:`nbdebug.compare_ranks` replays each rank's batch to find
  the one that produces it;
* a NaN/Inf that appears **after** or **outside** the all-reduce (a loss that is only
  logged, weights changed by a local operation, the loss of a ``ddp.no_sync()``
  micro-batch when that loss is what ``check()`` gets) is seen by that rank only
  (``local_first=True`` there, ``False`` on the others, which learn it through the
  agreement): the culprit is that rank. A NaN *gradient* of a ``no_sync()`` micro-batch,
  checked after the last (synced) backward, has been all-reduced by then: every rank sees
  it, and the snapshot holds the batch given to ``check()``.

Either way every rank returns ``False`` from ``check()`` for that step and each writes its
own snapshot (``step-000000003-rank1.nbsnap``) with its own batch.

With FSDP2 (``torch.distributed.fsdp.fully_shard``) parameters and gradients are
``DTensor`` shards: each rank measures its own shard (:func:`local_tensor`), never through
a collective, and the same ``MAX`` reduction makes the verdict hold for the whole model.

No hang
-------
Every collective of the agreement waits at most ``timeout`` seconds. A rank that exited,
crashed or stopped calling ``check()`` makes the others raise :class:`RankError` naming it:
on a timeout or a broken connection each waiting rank records itself in the process
group's rendezvous store (out of band, no collective) and the ranks missing there are the
ones named. At construction the guards of all ranks meet through the same store, so a guard
created on some ranks only, ranks with different models (names, shapes, dtypes of the
parameters) or differently configured guards are each a clear error, never a hang.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..vocab import FailureKind
from .replicas import (
    ReplicaMismatch,
    fingerprint,
    first_mismatch,
    replicated_parameters,
    structure,
    structure_difference,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup, Work
    from torch.distributed.distributed_c10d import Store

    from .options import DistributedOptions

#: Bits of the local verdict that each rank contributes to the agreement.
KIND_BITS: dict[FailureKind, int] = {
    FailureKind.LOSS: 1,
    FailureKind.GRAD: 2,
    FailureKind.WEIGHTS: 4,
}
#: Seconds the agreement waits for the other ranks when the guard is given none.
DEFAULT_TIMEOUT = 300.0

#: The snapshot fields (rows of :data:`nbdebug.core.snapshot.format.FIELDS`) a rank's
#: snapshot of a failing step fills from :meth:`Agreement.record`.
SNAPSHOT_FIELDS = (
    "rank",
    "world_size",
    "local_first",
    "culprit_ranks",
    "rank_kinds",
    "fingerprints",
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "KIND_BITS",
    "SNAPSHOT_FIELDS",
    "Agreement",
    "RankAgreement",
    "RankError",
    "culprit_ranks",
    "kinds_of",
    "local_bits",
]

_SEQUENCE: dict[tuple[int, ...], int] = {}  # guards created per process group in this process


class RankError(RuntimeError):
    """The ranks of a distributed run cannot agree: one did not answer within the timeout,
    they are at different steps, or their guards or models differ.

    Attributes
    ----------
    ranks : list of int
        The ranks named (those that did not answer, or that differ).
    step : int or None
    """

    def __init__(self, message: str, *, ranks: Sequence[int] = (), step: int | None = None):
        super().__init__(message)
        self.ranks = list(ranks)
        self.step = step

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (_rebuild_rank_error, (str(self), self.ranks, self.step))


def _rebuild_rank_error(message: str, ranks: list[int], step: int | None) -> RankError:
    return RankError(message, ranks=ranks, step=step)


def kinds_of(bits: int) -> list[FailureKind]:
    """The kinds (``"loss"``, ``"grad"``, ...) set in a verdict's bits."""
    return [k for k, b in KIND_BITS.items() if bits & b]


def local_bits(*, loss: bool, grad: bool, weights: bool) -> int:
    """One rank's verdict bits (:data:`KIND_BITS`): what it read as non-finite itself."""
    flags = {FailureKind.LOSS: loss, FailureKind.GRAD: grad, FailureKind.WEIGHTS: weights}
    return sum(KIND_BITS[k] for k, bad in flags.items() if bad)


def culprit_ranks(bits: Sequence[int]) -> list[int]:
    """The ranks that caused a bad step, from every rank's verdict bits: those whose loss or
    weights were non-finite (not all-reduced by DDP, so they point at the rank); when there
    are none, every rank whose gradients were non-finite."""
    own = [
        r
        for r, b in enumerate(bits)
        if b & (KIND_BITS[FailureKind.LOSS] | KIND_BITS[FailureKind.WEIGHTS])
    ]
    return own or [r for r, b in enumerate(bits) if b]


@dataclass
class Agreement:
    """The outcome of one step's agreement.

    Attributes
    ----------
    bits : list of int
        Every rank's local verdict (see :data:`KIND_BITS`), in rank order.
    rank, world_size : int
    """

    bits: list[int]
    rank: int
    world_size: int
    replicas: ReplicaMismatch | None = None
    checked_replicas: bool = False

    @property
    def any_bad(self) -> bool:
        return any(self.bits)

    @property
    def local_first(self) -> bool:
        """This rank saw a non-finite value itself, before the agreement's collective."""
        return bool(self.bits[self.rank])

    @property
    def culprits(self) -> list[int]:
        return culprit_ranks(self.bits)

    def record(self, named: Sequence[tuple[str, torch.Tensor]] = ()) -> dict[str, Any]:
        """What the snapshot stores (its :data:`SNAPSHOT_FIELDS`): plain values, and the
        :func:`fingerprint` of the replicated parameters ``named`` (``{"names": [...],
        "values": (n, 2) int64 tensor}``) so that :func:`nbdebug.compare_ranks` compares
        replicas without their tensors."""
        pairs = replicated_parameters(named)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_first": self.local_first,
            "culprit_ranks": self.culprits,
            "rank_kinds": {str(r): kinds_of(b) for r, b in enumerate(self.bits)},
            "fingerprints": {
                "names": [n for n, _ in pairs],
                "values": fingerprint([p for _, p in pairs]),
            },
        }

    def message(self, step: int) -> str:
        culprits = self.culprits
        what = ", ".join(
            f"rank {r}: non-finite {'/'.join(kinds_of(self.bits[r]))}" for r in culprits
        )
        return (
            f"another rank was not finite at step {step} ({what}); this rank's (rank "
            f"{self.rank}) loss, gradients and weights are finite: every rank skips this step"
        )


@dataclass
class RankAgreement:
    """One guard's view of its process group (built by :meth:`create`).

    Attributes
    ----------
    group : torch.distributed.ProcessGroup
    rank, world_size : int
        This process's rank in ``group`` and the group's size.
    timeout : float
        Seconds every collective of the agreement waits before :class:`RankError`.
    check_replicas_every : int or None
    """

    group: ProcessGroup
    rank: int
    world_size: int
    global_ranks: list[int]
    timeout: float
    check_replicas_every: int | None
    device: torch.device
    store: Store | None
    prefix: str
    replica_findings: list[ReplicaMismatch] = field(default_factory=list)
    options: dict[str, object] = field(default_factory=dict)  # compared when the ranks meet

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        named: Sequence[tuple[str, torch.Tensor]],
        settings: DistributedOptions,
        agreed: Mapping[str, object],
    ) -> RankAgreement | None:
        """The agreement for ``settings.process_group`` (``None``: the model's DDP group or
        the default group when ``torch.distributed`` is initialised; ``False``: none).
        ``None`` is returned for a single-process run. Meets the other ranks' guards (see
        the module docstring) and raises a clear error when they differ: in their models,
        in ``check_replicas_every`` or in ``agreed`` (the guard options that decide what a
        step's check does, as plain data). Over all the ranks of the run, the agreement's
        collectives run on a process group of their own (made here, once every rank's guard
        is known to exist), not on the one DDP averages gradients on."""
        import torch.distributed as dist

        group = _group_of(model, settings)
        if group is None:
            return None
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                "process_group: create the guard only on the group's ranks, or pass the group "
                "this rank belongs to."
            )
        device = _device_of(group)
        world = dist.get_world_size(group)
        if world == 1:
            return None
        global_ranks = list(dist.get_process_group_ranks(group))
        key = tuple(global_ranks)
        seq = _SEQUENCE.get(key, 0)
        _SEQUENCE[key] = seq + 1
        timeout = settings.timeout
        self = cls(
            group=group,
            rank=rank,
            world_size=world,
            global_ranks=global_ranks,
            timeout=float(timeout if timeout is not None else DEFAULT_TIMEOUT),
            check_replicas_every=settings.check_replicas_every,
            device=device,
            store=_default_store(),
            options=dict(agreed),
            prefix=f"nbdebug/guard/{'-'.join(map(str, global_ranks))}/{seq}",
        )
        self._meet(structure(named))
        if len(global_ranks) == dist.get_world_size():
            # every rank is here (the meeting proved it): a group of the agreement's own,
            # so that its collectives never pair with DDP's gradient all-reduces (a rank
            # that leaves out a check() then meets the others' next check: different step
            # numbers, a RankError, where gloo would abort on mismatched sizes)
            self.group = dist.new_group(global_ranks)
        return self

    # ------------------------------------------------------------------ meeting
    def _meet(self, mine: list[list[Any]]) -> None:
        """Every rank posts its model structure and options in the store, then reads the
        others': a guard missing on a rank, or differences, raise here."""
        if self.store is None:
            return
        options: dict[str, object] = {"check_replicas_every": self.check_replicas_every}
        options.update(self.options)
        info: dict[str, Any] = {"structure": mine, "options": options}
        self.store.set(f"{self.prefix}/meet/{self.rank}", json.dumps(info))
        missing = self._wait_keys("meet", time.monotonic() + self.timeout)
        if missing:
            present = [r for r in range(self.world_size) if r not in missing]
            raise RankError(
                f"NaNGuard was created on rank(s) {present} but not on rank(s) {missing} within "
                f"{self.timeout:g} s: create the guard on every rank of the process group (the "
                "agreement is a collective every rank joins), or pass process_group=False.",
                ranks=missing,
            )
        posts = {
            r: json.loads(self.store.get(f"{self.prefix}/meet/{r}"))
            for r in range(self.world_size)
            if r != self.rank
        }
        # no rank raises before every rank has read the others' posts: the rank hosting the
        # store may exit on its error, and a rank still reading would then get "Connection
        # reset by peer" instead of the same clear error
        self.store.set(f"{self.prefix}/read/{self.rank}", "1")
        self._wait_keys("read", time.monotonic() + self.timeout)
        for r, theirs in posts.items():
            diff = structure_difference(mine, theirs["structure"])
            if diff is not None:
                raise RankError(
                    "the ranks' models differ: "
                    + diff.format(me=f"rank {self.rank}", them=f"rank {r}")
                    + "; every rank must guard the same model.",
                    ranks=[r],
                )
            for name, value in options.items():
                other = theirs["options"].get(name)
                if other != value:
                    raise RankError(
                        f"the ranks' guards differ: {name}={value!r} on rank {self.rank} but "
                        f"{other!r} on rank {r}; give every rank the same options (they decide "
                        "what every rank does with a bad step).",
                        ranks=[r],
                    )

    def _wait_keys(self, what: str, deadline: float, step: int | None = None) -> list[int]:
        """Poll the store until every rank posted ``what`` (or the deadline); the missing
        ranks."""
        keys = {
            r: f"{self.prefix}/{what}/{r}" if step is None else f"{self.prefix}/{what}/{step}/{r}"
            for r in range(self.world_size)
        }
        missing = list(keys)
        store = self.store
        assert store is not None  # polled only when the ranks have a store
        while True:
            missing = [r for r in missing if not store.check([keys[r]])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.01)

    # ------------------------------------------------------------------ per step
    def _wait(self, work: Work, step: int, what: str, started: float) -> None:
        try:
            work.wait(timeout=_dt.timedelta(seconds=self.timeout))
        except RuntimeError as e:  # a timeout, or a peer that closed its connection
            raise self._no_answer(step, what, e, started) from e

    def agree(self, step: int, bits: int) -> Agreement:
        """One ``all_reduce(MAX)``: every rank's verdict bits and step number."""
        import torch.distributed as dist

        t = torch.zeros(2 * self.world_size, dtype=torch.float64, device=self.device)
        t[self.rank] = float(bits)
        t[self.world_size + self.rank] = float(step) + 1.0  # +1: step 0 differs from "absent"
        started = time.monotonic()
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(work, step, "the agreement", started)
        values = t.tolist()
        steps = [int(v) - 1 for v in values[self.world_size :]]
        if len(set(steps)) > 1:
            by = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
            odd = [r for r, s in enumerate(steps) if s != steps[self.rank]]
            raise RankError(
                f"the ranks called NaNGuard.check() for different steps ({by}): a rank skipped a "
                "check() call or numbers its steps differently; every rank must check every "
                "step with the same step number.",
                ranks=odd,
                step=step,
            )
        out = Agreement(
            bits=[int(v) for v in values[: self.world_size]],
            rank=self.rank,
            world_size=self.world_size,
        )
        return out

    def due(self, step: int) -> bool:
        """Whether the replica check runs at ``step``."""
        n = self.check_replicas_every
        return n is not None and step % n == 0

    def compare_replicas(
        self, step: int, named: Sequence[tuple[str, torch.Tensor]]
    ) -> ReplicaMismatch | None:
        """One ``all_gather`` of :func:`fingerprint` of the replicated parameters; the first
        that differs as a finding (also kept in :attr:`replica_findings`)."""
        import torch.distributed as dist

        pairs = replicated_parameters(named)
        mine = fingerprint([p for _, p in pairs]).to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        started = time.monotonic()
        work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        self._wait(work, step, "the replica check", started)
        found = first_mismatch(step, [n for n, _ in pairs], [g.cpu() for g in gathered])
        if found is not None:
            self.replica_findings.append(found)
        return found

    def _no_answer(self, step: int, what: str, err: BaseException, started: float) -> RankError:
        """Name the ranks that did not join a collective: each rank that waited in vain
        posts itself in the store; the ranks missing there after the timeout are named."""
        text = str(err).strip()
        cause = f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"
        if self.store is None:
            return RankError(
                f"NaNGuard.check() at step {step}: a rank did not answer {what} within "
                f"{self.timeout:g} s ({cause}).",
                step=step,
            )
        try:
            self.store.set(f"{self.prefix}/stuck/{step}/{self.rank}", "1")
            missing = self._wait_keys("stuck", started + self.timeout + 1.0, step)
        except Exception as e:  # the store's host (usually rank 0) is gone too
            return RankError(
                f"NaNGuard.check() at step {step}: a rank did not answer {what} within "
                f"{self.timeout:g} s ({cause}), and the rendezvous store is unreachable too "
                f"({type(e).__name__}): the rank hosting it (usually rank 0) may have exited.",
                step=step,
            )
        answered = [r for r in range(self.world_size) if r not in missing]
        return RankError(
            f"NaNGuard.check() at step {step}: rank(s) {missing} did not answer {what} within "
            f"{self.timeout:g} s (rank(s) {answered} did): a rank that exited, crashed or stopped "
            f"calling check() ({cause}).",
            ranks=missing,
            step=step,
        )

    def __repr__(self) -> str:
        return (
            f"RankAgreement(rank {self.rank} of {self.world_size}, timeout={self.timeout:g} s, "
            f"check_replicas_every={self.check_replicas_every})"
        )


def _group_of(model: torch.nn.Module, settings: DistributedOptions) -> ProcessGroup | None:
    """The process group the guard agrees over (``None``: no agreement), checked."""
    process_group, every = settings.process_group, settings.check_replicas_every
    if process_group is False:
        return None
    import torch.distributed as dist

    if not dist.is_available():  # a torch built without distributed support
        if process_group is not None or every is not None:
            raise RuntimeError(
                "process_group= / check_replicas_every= need torch.distributed, which this "
                "torch build does not include."
            )
        return None
    if process_group is None:
        group = getattr(model, "process_group", None)  # a DDP wrapper's group
        if group is not None:
            return group  # type: ignore[no-any-return]
        if dist.is_initialized():
            return dist.group.WORLD
        if every is not None:
            raise ValueError(
                "check_replicas_every needs a distributed run: torch.distributed is "
                "not initialised and no process_group= was given."
            )
        return None
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # type: ignore[comparison-overlap]
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given "
            "process_group (dist.new_group() returned NON_GROUP_MEMBER here): create the "
            "guard with the group this rank belongs to, or process_group=False."
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD "
            f"or dist.new_group(...)), None or False; got {type(process_group).__qualname__}."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "process_group= was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) first."
        )
    return process_group


def _device_of(group: ProcessGroup) -> torch.device:
    """Where the agreement's tensors live: the CPU for gloo, this GPU for nccl."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(
        f"process_group has backend {backend!r}: the guard's agreement runs on 'gloo' "
        "(CPU) or 'nccl' (CUDA) groups."
    )


def _default_store() -> Store | None:
    """The rendezvous store of the default process group (``None`` when torch does not
    expose it): the out-of-band channel the guards meet through."""
    import torch.distributed as dist

    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        store: Store = get()
    except Exception:
        return None
    return store
