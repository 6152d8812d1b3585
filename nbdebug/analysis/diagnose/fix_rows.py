"""The ``drop_rows`` fix: the batch without the rows that hold or produce the NaN."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from ...core.batch import iter_tensors
from ...core.text import rows_text
from ...core.trace import Trace
from ...core.vocab import FixKind
from .fix import Fix, Replay

__all__ = ["DropRowsFix", "out_of_range_rows"]

BatchForm = Literal["tensor", "dict", "seq"]

#: Longer row lists are counted ("26 of 32 rows"), not listed.
LISTED_ROWS = 8


def rows_phrase(rows: list[int], batch_size: int | None = None) -> str:
    """Batch rows as a phrase: ``"row 3"``, ``"rows 3, 5"``; more than
    :data:`LISTED_ROWS` counted: ``"26 of 32 rows"`` (``"26 rows"`` without the batch
    size)."""
    if len(rows) <= LISTED_ROWS:
        return rows_text(rows, None)
    of = f" of {batch_size}" if batch_size is not None else ""
    return f"{len(rows)}{of} rows"


class DropRowsFix(Fix):
    """The batch without the given rows (every tensor of the batch and the target whose
    first dimension is the batch size).

    Parameters
    ----------
    rows : list of int
        The batch rows to leave out.

    Examples
    --------
    >>> nbdebug.diagnose(model, x, y, F.cross_entropy, fixes=[nbdebug.DropRowsFix([3])])
    """

    kind = FixKind.DROP_ROWS

    def __init__(self, rows: list[int]):
        super().__init__()
        self.rows = sorted({int(r) for r in rows})
        # the batch's form, for the snippet: inputs "tensor", "dict" or "seq", whether a
        # target tensor goes with them, the batch size
        self._form: tuple[BatchForm, bool, int | None] = ("tensor", True, None)
        self.batch_size: int | None = None

    def applies(self, trace: Trace) -> bool:
        bs = trace.batch_size
        self.batch_size = bs
        return bool(self.rows) and bs is not None and len(self.rows) < bs

    def why_not(self, trace: Trace | None) -> str:
        bs = trace.batch_size if trace is not None else None
        return f"dropping rows {self.rows} leaves no batch (batch size {bs})."

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        bs = replay.batch_size
        if bs is None:
            raise ValueError("the batch has no batch dimension: no rows to drop.")
        drop = set(self.rows)
        keep = torch.tensor([i for i in range(bs) if i not in drop], dtype=torch.long)
        old = replay.inputs, replay.target
        form: BatchForm = (
            "dict"
            if isinstance(old[0], dict)
            else "seq"
            if isinstance(old[0], (tuple, list))
            else "tensor"
        )
        self._form = (form, isinstance(old[1], torch.Tensor), bs)
        replay.inputs = _select(replay.inputs, keep, bs)
        replay.target = _select(replay.target, keep, bs)
        try:
            yield
        finally:
            replay.inputs, replay.target = old

    def _rows(self) -> str:
        return rows_phrase(self.rows, self.batch_size)

    def describe(self) -> str:
        return f"drop batch {self._rows()}"

    def action(self) -> str:
        return f"dropping batch {self._rows()}"

    def snippet(self) -> str:
        """The code for the batch as the step had it: a tensor ``x`` (and ``y``), a dict
        ``batch`` (a Hugging Face batch, labels in it) or a tuple ``inputs``."""
        form, target, bs = self._form
        row = "isinstance(v, torch.Tensor) and len(v) == len(keep)"
        take = {
            "tensor": "x = x[keep]",
            "dict": f"batch = {{k: v[keep] if {row} else v for k, v in batch.items()}}",
            "seq": f"inputs = [v[keep] if {row} else v for v in inputs]",
        }[form]
        if target:
            take = "x, y = x[keep], y[keep]" if form == "tensor" else f"{take}\ny = y[keep]"
        size = "x.shape[0]" if form == "tensor" or bs is None else str(bs)
        return (
            f"bad = torch.tensor({self.rows})\n"
            f"keep = torch.ones({size}, dtype=torch.bool); keep[bad] = False\n"
            f"{take}  # and find out why these rows are bad"
        )


def _select(obj: Any, keep: torch.Tensor, bs: int) -> Any:
    """``obj`` (a batch or a target) with only the ``keep`` rows of every tensor whose
    first dimension is the batch size ``bs``."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 1 and obj.shape[0] == bs:
            return obj.index_select(0, keep.to(obj.device))
        return obj
    if isinstance(obj, dict):
        return {k: _select(v, keep, bs) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_select(v, keep, bs) for v in obj]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def out_of_range_rows(batch: Any, bs: int | None) -> list[int]:
    """The batch rows holding a finite value whose square overflows its dtype (``|x| >
    sqrt(finfo.max)``, 1.8e19 in float32): out of any model's range, they overflow the
    first product or square they meet, and the loss then has no rows to point at."""
    if bs is None:
        return []
    bad = torch.zeros(bs, dtype=torch.bool)
    for t in iter_tensors(batch):
        if not t.is_floating_point() or t.dim() == 0 or t.shape[0] != bs or t.numel() == 0:
            continue
        limit = float(torch.finfo(t.dtype).max) ** 0.5
        big = (t.detach().abs() > limit) & torch.isfinite(t.detach())
        bad |= big.reshape(bs, -1).any(1).cpu()
    return [int(i) for i in torch.nonzero(bad).flatten()]
