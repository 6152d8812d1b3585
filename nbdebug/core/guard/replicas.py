"""The replica check of a distributed guard: an exact fingerprint of every replicated
parameter, compared across the ranks (:func:`first_mismatch`), and the structure of a
model that every rank must share (:func:`structure`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..parallel import is_replicated, local_tensor

__all__ = [
    "ReplicaMismatch",
    "fingerprint",
    "first_mismatch",
    "replica_differences",
    "replicated_parameters",
    "structure",
    "structure_difference",
]

#: one parameter's ``[name, global shape, dtype]``
Structure = list[list[object]]

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


def structure(named: Sequence[tuple[str, torch.Tensor]]) -> Structure:
    """``[name, global shape, dtype]`` per parameter: what must be equal on every rank."""
    return [[n, list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in named]


def structure_difference(mine: Structure, theirs: Structure) -> str | None:
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
