"""Data-parallel and sharded models as nbdebug sees them: the module inside a DDP or
DataParallel wrapper, this rank's shard of an FSDP2 ``DTensor``, the whole tensor
gathered from the shards, and this process's rank."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "full_tensors",
    "is_dtensor",
    "is_replicated",
    "local_tensor",
    "process_rank",
    "unwrap_data_parallel",
]


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


def process_rank() -> int | None:
    """This process's global rank in a distributed run of more than one process (``None``
    otherwise): a guard without an agreement (``process_group=False``) still names its
    snapshots ``...-rankN.nbsnap``, so that ranks sharing a directory keep a file each."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return int(dist.get_rank())
