"""A batch cut into its rows: the tensors whose first dimension is the batch size (the
row leaves), and the same batch rebuilt around other leaves (one row, a chunk of rows)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["row_leaves", "with_leaves"]


def _is_row(obj: object, rows: int) -> bool:
    return isinstance(obj, torch.Tensor) and obj.dim() >= 1 and obj.shape[0] == rows


def row_leaves(batch: object, rows: int) -> list[torch.Tensor]:
    """The tensors of ``batch`` (tensors, tuples, lists, dicts of them) whose first
    dimension is ``rows``, in the order :func:`with_leaves` puts them back."""
    if _is_row(batch, rows):
        return [batch]  # type: ignore[list-item]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in row_leaves(v, rows)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in row_leaves(v, rows)]
    return []


def with_leaves(batch: Any, rows: int, leaves: Iterator[torch.Tensor]) -> Any:
    """``batch`` with each row leaf (:func:`row_leaves`) replaced by the next of
    ``leaves``; everything else as it is (a dict as a dict, a named tuple as its type)."""
    if _is_row(batch, rows):
        return next(leaves)
    if isinstance(batch, Mapping):
        return {k: with_leaves(v, rows, leaves) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        items = [with_leaves(v, rows, leaves) for v in batch]
        if hasattr(batch, "_fields"):
            return type(batch)(*items)
        return type(batch)(items) if isinstance(batch, list) else tuple(items)
    return batch
