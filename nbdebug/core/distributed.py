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
from typing import Any

import torch

#: Bits of the local verdict that each rank contributes to the agreement.
KIND_BITS: dict[str, int] = {"loss": 1, "grad": 2, "weights": 4}
#: The kind of a step that another rank found non-finite (this rank's values were finite).
REMOTE_KIND = "rank"
#: Seconds the agreement waits for the other ranks when the guard is given none.
DEFAULT_TIMEOUT = 300.0

#: The snapshot fields (rows of :data:`nbdebug.core.snapshot_format.FIELDS`) a rank's
#: snapshot of a failing step fills from :meth:`Agreement.record`.
SNAPSHOT_FIELDS = (
    "rank",
    "world_size",
    "local_first",
    "culprit_ranks",
    "rank_kinds",
    "fingerprints",
)

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

    def __reduce__(self) -> Any:
        return (_rebuild_rank_error, (str(self), self.ranks, self.step))


def _rebuild_rank_error(message: str, ranks: list[int], step: int | None) -> RankError:
    return RankError(message, ranks=ranks, step=step)


def kinds_of(bits: int) -> list[str]:
    """The kinds (``"loss"``, ``"grad"``, ...) set in a verdict's bits."""
    return [k for k, b in KIND_BITS.items() if bits & b]


def culprit_ranks(bits: Sequence[int]) -> list[int]:
    """The ranks that caused a bad step, from every rank's verdict bits: those whose loss or
    weights were non-finite (not all-reduced by DDP, so they point at the rank); when there
    are none, every rank whose gradients were non-finite."""
    own = [r for r, b in enumerate(bits) if b & (KIND_BITS["loss"] | KIND_BITS["weights"])]
    return own or [r for r, b in enumerate(bits) if b]


def unwrap_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` (same parameter
    objects), else ``model``: snapshots hold its state, replayable without the wrapper."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (FSDP2 parameters and gradients), else ``t``:
    measuring it needs no collective."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 shard)."""
    return isinstance(t, torch.Tensor) and hasattr(t, "placements") and hasattr(t, "full_tensor")


def full_tensors(obj: Any) -> Any:
    """``obj`` (a state dict, nested dicts/lists) with every ``DTensor`` replaced by the
    whole tensor (``full_tensor()``, an all-gather: every rank of the mesh must call this
    together, on the same structure) on the CPU, so that a snapshot of a sharded model
    holds the whole model, replayable without a process group."""
    if is_dtensor(obj):
        return obj.full_tensor().detach().cpu()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(full_tensors(v) for v in obj)
    return obj


def is_replicated(t: torch.Tensor) -> bool:
    """Whether every rank holds the same values for ``t``: a plain tensor (data parallel)
    or a ``DTensor`` replicated over its mesh (not a shard)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return True
    return all(type(p).__name__ == "Replicate" for p in placements)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A cheap exact fingerprint per tensor, shape ``(len(tensors), 2)``, int64 on the CPU.

    The tensor's bits are read as integers and summed, plain and squared (wrapping int64
    arithmetic: exact and independent of the reduction order, so bit-identical tensors give
    equal fingerprints whatever the thread count, and one flipped bit changes them).
    """
    out = torch.zeros((len(tensors), 2), dtype=torch.int64)
    for i, t in enumerate(tensors):
        x = local_tensor(t).detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        x = x.contiguous().reshape(-1)
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        bits = x.view(_INT_VIEW[x.element_size()]).to(torch.int64)
        out[i, 0] = bits.sum()
        out[i, 1] = (bits * bits).sum()
    return out


def structure(named: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """``[name, global shape, dtype]`` per parameter: what must be equal on every rank."""
    return [[n, list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in named]


def _structure_difference(mine: list[list[Any]], theirs: list[list[Any]]) -> str | None:
    a = {n: (s, d) for n, s, d in mine}
    b = {n: (s, d) for n, s, d in theirs}
    for n, s, d in mine:
        if n not in b:
            return f"parameter {n!r} exists on {{me}} but not on {{them}}"
        if b[n][0] != s:
            return f"parameter {n!r} has shape {s} on {{me}} but {b[n][0]} on {{them}}"
        if b[n][1] != d:
            return f"parameter {n!r} has dtype {d} on {{me}} but {b[n][1]} on {{them}}"
    for n, _s, _d in theirs:
        if n not in a:
            return f"parameter {n!r} exists on {{them}} but not on {{me}}"
    if [n for n, _, _ in mine] != [n for n, _, _ in theirs]:
        return "the parameters are registered in a different order on {me} and {them}"
    return None


@dataclass
class ReplicaMismatch:
    """A finding of the replica check: the replicas' parameters are no longer equal.

    Attributes
    ----------
    step : int
    parameter : str
        The first parameter (in ``model.named_parameters()`` order) that differs.
    ranks : list of int
        The ranks whose copy differs from the majority's (ties: from the lowest rank's).
    n_differing : int
        How many parameters differ in all.
    """

    step: int
    parameter: str
    ranks: list[int]
    n_differing: int
    severity: str = "error"
    code: str = "replicas_differ"

    @property
    def message(self) -> str:
        more = f" ({self.n_differing} parameters differ)" if self.n_differing > 1 else ""
        return (
            f"step {self.step}: the replicas diverged: parameter {self.parameter!r} differs on "
            f"rank(s) {self.ranks}{more} (a rank that skipped a step alone, a non-deterministic "
            "kernel or faulty hardware)"
        )

    def __repr__(self) -> str:
        return f"ReplicaMismatch({self.message})"


def replica_differences(
    names: Sequence[str], prints: Sequence[torch.Tensor]
) -> list[tuple[str, list[int]]]:
    """Per parameter whose copies differ: ``(name, ranks)``, the ranks (positions in
    ``prints``, one ``(n, 2)`` :func:`fingerprint` per rank) whose copy differs from the
    majority's (ties: from the lowest rank's), in parameter order."""
    if len(prints) < 2:
        return []
    stacked = torch.stack([p.reshape(len(names), 2) for p in prints])  # (ranks, n, 2)
    differs = (stacked != stacked[:1]).any(dim=2).any(dim=0)
    out = []
    for i in differs.nonzero().reshape(-1).tolist():
        rows = [tuple(stacked[r, i].tolist()) for r in range(len(prints))]
        counts: dict[tuple[int, ...], int] = {}
        for v in rows:
            counts[v] = counts.get(v, 0) + 1
        majority = max(counts, key=lambda v: (counts[v], -rows.index(v)))
        out.append((names[i], [r for r, v in enumerate(rows) if v != majority]))
    return out


def first_mismatch(
    step: int, names: Sequence[str], prints: Sequence[torch.Tensor]
) -> ReplicaMismatch | None:
    """Compare the ranks' fingerprints (one ``(n, 2)`` tensor per rank, in rank order)."""
    diffs = replica_differences(names, prints)
    if not diffs:
        return None
    name, ranks = diffs[0]
    return ReplicaMismatch(step=step, parameter=name, ranks=ranks, n_differing=len(diffs))


def replicated_parameters(
    named: Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """The parameters every rank holds whole (FSDP2 shards left out)."""
    return [(n, p) for n, p in named if is_replicated(p)]


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

    group: Any
    rank: int
    world_size: int
    global_ranks: list[int]
    timeout: float
    check_replicas_every: int | None
    device: torch.device
    store: Any
    prefix: str
    replica_findings: list[ReplicaMismatch] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # compared when the ranks meet

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(
        cls,
        model: Any,
        named: Sequence[tuple[str, torch.Tensor]],
        process_group: Any,
        *,
        timeout: float | None,
        check_replicas_every: int | None,
        options: Mapping[str, Any] | None = None,
    ) -> RankAgreement | None:
        """The agreement for ``process_group`` (``None``: the model's DDP group or the
        default group when ``torch.distributed`` is initialised; ``False``: none). ``None``
        is returned for a single-process run. Meets the other ranks' guards (see the
        module docstring) and raises a clear error when they differ: in their models, in
        ``check_replicas_every`` or in ``options`` (the guard options that decide what a
        step's check does, as plain data). Over all the ranks of the run, the agreement's
        collectives run on a process group of their own (made here, once every rank's guard
        is known to exist), not on the one DDP averages gradients on."""
        if check_replicas_every is not None and (
            isinstance(check_replicas_every, bool)
            or not isinstance(check_replicas_every, int)
            or check_replicas_every < 1
        ):
            raise ValueError(
                "check_replicas_every must be a positive int or None; got "
                f"{check_replicas_every!r}."
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}.")
        if process_group is False:
            return None
        import torch.distributed as dist

        if not dist.is_available():  # a torch built without distributed support
            if process_group is not None or check_replicas_every is not None:
                raise RuntimeError(
                    "process_group= / check_replicas_every= need torch.distributed, which this "
                    "torch build does not include."
                )
            return None

        if process_group is None:
            process_group = getattr(model, "process_group", None)  # a DDP wrapper's group
            if process_group is None:
                if not dist.is_initialized():
                    if check_replicas_every is not None:
                        raise ValueError(
                            "check_replicas_every needs a distributed run: torch.distributed is "
                            "not initialised and no process_group= was given."
                        )
                    return None
                process_group = dist.group.WORLD
        elif process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                "process_group (dist.new_group() returned NON_GROUP_MEMBER here): create the "
                "guard with the group this rank belongs to, or process_group=False."
            )
        elif not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD "
                f"or dist.new_group(...)), None or False; got {type(process_group).__qualname__}."
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "process_group= was given but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) first."
            )
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                "process_group: create the guard only on the group's ranks, or pass the group "
                "this rank belongs to."
            )
        backend = str(dist.get_backend(process_group))
        if "gloo" in backend:
            device = torch.device("cpu")
        elif "nccl" in backend:
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(
                f"process_group has backend {backend!r}: the guard's agreement runs on 'gloo' "
                "(CPU) or 'nccl' (CUDA) groups."
            )
        world = dist.get_world_size(process_group)
        if world == 1:
            return None
        global_ranks = list(dist.get_process_group_ranks(process_group))
        key = tuple(global_ranks)
        seq = _SEQUENCE.get(key, 0)
        _SEQUENCE[key] = seq + 1
        store = _default_store()
        self = cls(
            group=process_group,
            rank=rank,
            world_size=world,
            global_ranks=global_ranks,
            timeout=float(timeout if timeout is not None else DEFAULT_TIMEOUT),
            check_replicas_every=check_replicas_every,
            device=device,
            store=store,
            options=dict(options or {}),
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
        options: dict[str, Any] = {"check_replicas_every": self.check_replicas_every}
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
            diff = _structure_difference(mine, theirs["structure"])
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
        while True:
            missing = [r for r in missing if not self.store.check([keys[r]])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.01)

    # ------------------------------------------------------------------ per step
    def _wait(self, work: Any, step: int, what: str, started: float) -> None:
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


def _default_store() -> Any:
    """The rendezvous store of the default process group (``None`` when torch does not
    expose it): the out-of-band channel the guards meet through."""
    import torch.distributed as dist

    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:
        return None


def process_rank() -> int | None:
    """This process's global rank in a distributed run of more than one process (``None``
    otherwise): a guard without an agreement (``process_group=False``) still names its
    snapshots ``...-rankN.nbsnap``, so that ranks sharing a directory keep a file each."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return int(dist.get_rank())


__all__ = [
    "DEFAULT_TIMEOUT",
    "KIND_BITS",
    "REMOTE_KIND",
    "SNAPSHOT_FIELDS",
    "Agreement",
    "RankAgreement",
    "RankError",
    "ReplicaMismatch",
    "culprit_ranks",
    "fingerprint",
    "first_mismatch",
    "full_tensors",
    "is_dtensor",
    "local_tensor",
    "process_rank",
    "replica_differences",
    "replicated_parameters",
    "unwrap_data_parallel",
]
