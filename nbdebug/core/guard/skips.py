"""Skips that cannot hide: the guard counts every skipped update (:class:`SkipCounter`:
in all, in a row, the last one's step and reason, in every history row and the guard's
repr), stops the run past ``max_skips_in_row`` / ``max_skip_fraction``, and writes the
dataset indices of skipped batches (when ``check(..., ids=...)`` gives them) to
``skip_batches.json`` in the snapshot directory, which a resumed run reads back with
:func:`load_skip_batches` to leave those batches out.

``skip_batches.json``::

    {"format": 1,
     "ids": [17, 203, ...],                     # every skipped dataset index, sorted
     "steps": [{"step": 40, "reason": "spike", "ids": [...]}, ...]}
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..vocab import FailureKind
from .failure import NonFiniteError

if TYPE_CHECKING:  # pragma: no cover
    from .history import HistoryRow
    from .options import FailureOptions

__all__ = [
    "SKIP_BATCHES",
    "SkipCounter",
    "batch_ids",
    "check_limits",
    "load_skip_batches",
    "record_skip_batch",
    "skip_error",
]

#: the file name of the skipped batches' dataset indices, in the snapshot directory
SKIP_BATCHES = "skip_batches.json"
#: ``max_skip_fraction`` is judged once this many steps were checked
MIN_STEPS_FOR_FRACTION = 20


def skip_reason(row: HistoryRow) -> tuple[FailureKind, str]:
    """The kind and the words of a skipped row's reason."""
    kind = row.get("nonfinite")
    if kind is not None:
        return FailureKind(kind), f"non-finite {kind}"
    spikes = row.get("spikes")
    if spikes:
        return FailureKind.SPIKE, "spike in " + ", ".join(s["signal"] for s in spikes)
    return FailureKind.SCALE, "GradScaler overflow"


@dataclass
class SkipCounter:
    """Every skipped update of a guard: its own (a non-finite step, a spike under
    ``on_spike="skip"``) and the GradScaler's overflow skips.

    Attributes
    ----------
    total : int
    in_row : int
        Skipped updates in a row up to the last checked step.
    checked : int
        Steps checked.
    last_step : int or None
    last_reason : str or None
        The last skip's reason in words (``"non-finite loss"``, ``"spike in grad_norm"``).
    """

    total: int = 0
    in_row: int = 0
    checked: int = 0
    last_step: int | None = None
    last_reason: str | None = None
    last_kind: FailureKind | None = field(default=None, repr=False)

    @property
    def fraction(self) -> float:
        return self.total / self.checked if self.checked else 0.0

    def record(self, row: HistoryRow) -> None:
        """Count the row's step; write the counters (and a skip's reason) into it."""
        self.checked += 1
        if row.get("skipped"):
            self.total += 1
            self.in_row += 1
            self.last_kind, self.last_reason = skip_reason(row)
            self.last_step = row["step"]
            row["skip_reason"] = self.last_reason
        else:
            self.in_row = 0
        row["skips"], row["skips_in_row"] = self.total, self.in_row

    def over(self, rules: FailureOptions) -> str | None:
        """Why the skips are past the limits (``None``: they are not)."""
        most, share = rules.max_skips_in_row, rules.max_skip_fraction
        if most is not None and self.in_row > most:
            return f"{self.in_row} updates skipped in a row (max_skips_in_row={most})"
        enough = self.checked >= MIN_STEPS_FOR_FRACTION
        if share is not None and enough and self.in_row and self.fraction > share:
            return (
                f"{self.total} of {self.checked} updates skipped, {self.fraction:.1%} "
                f"(max_skip_fraction={share:g})"
            )
        return None

    def stop_reason(self, why: str, step: int) -> dict[str, Any]:
        """The reason (a snapshot's, an error's) of stopping at ``step`` for ``why``."""
        text = f"the guard stops the run: {why}; the last, step {step}: {self.last_reason}"
        kind = self.last_kind or FailureKind.SCALE
        return {"kind": kind, "message": text, "step": step, "action": "raise", "limit": why}

    def summary(self) -> str:
        """For the guard's repr: ``"2 skipped (last: step 97, spike in grad_norm)"``."""
        if not self.total:
            return "0 skipped"
        return f"{self.total} skipped (last: step {self.last_step}, {self.last_reason})"


def skip_error(reason: dict[str, Any], path: Path | None) -> NonFiniteError:
    """The error that stops a run past the skip limits (with its snapshot's path)."""
    saved = f"Snapshot: {path}" if path else "No snapshot was written (max_snapshots)"
    return NonFiniteError(
        f"{reason['message']}. {saved}", path=path, step=reason["step"], reason=reason
    )


def check_limits(most: object, share: object) -> None:
    """Validate ``max_skips_in_row`` (a non-negative int or None) and
    ``max_skip_fraction`` (a number in (0, 1] or None)."""
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 0):
        raise ValueError(f"max_skips_in_row must be a non-negative int or None; got {most!r}.")
    number = isinstance(share, (int, float)) and not isinstance(share, bool)
    if share is not None and not (number and 0 < share <= 1):  # type: ignore[operator]
        raise ValueError(f"max_skip_fraction must be a number in (0, 1] or None; got {share!r}.")


def _rows(batch: object) -> int | None:
    """The batch's row count: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items: Iterable[object] = ()
    if isinstance(batch, dict):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim():
            return item.shape[0]
    return None


def batch_ids(ids: object, inputs: object) -> list[int] | None:
    """``check(ids=...)`` as a list of ints, one per batch row.

    Raises
    ------
    ValueError
        Not one index per row of ``inputs`` (or not integers).
    """
    if ids is None:
        return None
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(
            f"ids must be a sequence of dataset indices; got {type(ids).__qualname__}."
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError("ids must be integer dataset indices, one per batch row.")
    rows = _rows(inputs)
    if rows is not None and len(values) != rows:
        raise ValueError(
            f"ids must give one dataset index per batch row: the batch has {rows} rows, "
            f"got {len(values)} ids."
        )
    return list(values)


def load_skip_batches(path: str | os.PathLike[str]) -> set[int]:
    """The dataset indices a run skipped (its ``skip_batches.json``, or the snapshot
    directory holding it): a resumed run leaves them out (a sampler over the other
    indices: ``[i for i in range(n) if i not in bad]``). A missing file: no indices."""
    p = Path(path)
    if p.is_dir():
        p = p / SKIP_BATCHES
    if not p.exists():
        return set()
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("ids"), list):
        raise ValueError(f"{p} is not a skip_batches.json (no 'ids' list).")
    return {int(i) for i in data["ids"]}


def record_skip_batch(directory: Path, step: int, reason: str, ids: Sequence[int]) -> Path:
    """Add a skipped batch's dataset indices to ``directory/skip_batches.json``
    (written atomically: a temporary file renamed over it)."""
    path = directory / SKIP_BATCHES
    data: dict[str, Any] = {"format": 1, "ids": [], "steps": []}
    if path.exists():
        data = json.loads(path.read_text())
    data["steps"].append({"step": step, "reason": reason, "ids": list(ids)})
    data["ids"] = sorted({*data["ids"], *ids})
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".skip_batches-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path
