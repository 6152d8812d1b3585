"""A tensor of a snapshot file that is not read yet."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TensorRef"]


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a snapshot file, not read yet: its name in the file, dtype name and
    shape (``indices``: a sparse tensor's index tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: TensorRef | None = None
