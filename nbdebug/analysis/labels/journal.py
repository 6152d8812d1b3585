"""An append-only JSONL journal of label-review decisions.

The first line is a header holding a fingerprint of the data and labels under review; every
decision (and every undo) is one more line, written, flushed and fsync'ed at once, so a
crashed kernel loses nothing. Reopening the same file resumes; a file written for other data
is refused (decisions of two data sets are never mixed).

Format (one JSON object per line)::

    {"type": "header", "format": "nbdebug-label-journal", "version": 1,
     "fingerprint": "...", "n_items": 1797, "n_classes": 10, "created": "..."}
    {"type": "decision", "seq": 1, "batch": 1, "item": 42, "old_label": 3,
     "new_label": 8, "action": "relabel", "score": 0.02, "method": "confident_learning",
     "time": "2024-05-01T12:00:00+00:00"}
    {"type": "undo", "seq": 2, "batch": 1, "time": "..."}
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Sized
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import pandas as pd

from ..tabular import loaded_torch

FORMAT = "nbdebug-label-journal"
VERSION = 1


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class Hasher(Protocol):
    """What :func:`fingerprint` needs of a ``hashlib`` object."""

    def update(self, data: bytes, /) -> None: ...


def _hash_data(h: Hasher, data: object) -> None:
    torch = loaded_torch()
    if torch is not None and isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    if isinstance(data, (pd.DataFrame, pd.Series)):
        h.update(b"pandas")
        if isinstance(data, pd.DataFrame):
            h.update(json.dumps([str(c) for c in data.columns]).encode())
        h.update(pd.util.hash_pandas_object(data, index=True).to_numpy().tobytes())
        return
    if isinstance(data, np.ndarray) and data.dtype != object:
        h.update(f"ndarray{data.shape}{data.dtype.str}".encode())
        h.update(np.ascontiguousarray(data).tobytes())
        return
    if not isinstance(data, Sized):
        raise TypeError(
            "data must be a sequence of samples (array, tensor, DataFrame, list); got "
            f"{type(data).__qualname__}."
        )
    h.update(f"seq{len(data)}".encode())
    for item in cast("Iterable[object]", data):  # a sized sequence of samples
        if isinstance(item, (str, bytes)):
            b = item.encode() if isinstance(item, str) else item
        elif isinstance(item, np.ndarray) or (torch is not None and isinstance(item, torch.Tensor)):
            arr = np.asarray(item.detach().cpu() if hasattr(item, "detach") else item)
            b = arr.tobytes() + arr.dtype.str.encode() + str(arr.shape).encode()
        else:
            b = repr(item).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)


def fingerprint(data: object, labels: np.ndarray) -> str:
    """SHA-256 (hex) of the samples and their given labels.

    ``data`` may be an array, a tensor, a DataFrame, or a list of samples (strings,
    arrays, anything with a stable ``repr``); ``None`` fingerprints the labels only.
    """
    h = hashlib.sha256()
    h.update(b"labels")
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    if data is not None:
        _hash_data(h, data)
    return h.hexdigest()


class Journal:
    """Open (resume) or create a decision journal (a new one is written with its first
    decision).

    Parameters
    ----------
    path : str or Path
    fingerprint : str
        From :func:`fingerprint`; must match the header of an existing file.
    n_items, n_classes : int
        Stored in a new file's header and checked against an existing one.

    Raises
    ------
    ValueError
        The file is not a journal, or was written for different data.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fingerprint: str, n_items: int, n_classes: int
    ):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.records: list[dict[str, Any]] = []
        self._needs_newline = False
        self._unwritten = False
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load(n_items)
        else:
            self.header = {
                "type": "header",
                "format": FORMAT,
                "version": VERSION,
                "fingerprint": fingerprint,
                "n_items": int(n_items),
                "n_classes": int(n_classes),
                "created": now(),
            }
            # written with the first decision: a review that fails to open, or makes no
            # decision, leaves no file behind (that would then refuse the corrected call)
            self._unwritten = True

    # ---- reading
    def _load(self, n_items: int) -> None:
        text = self.path.read_text(encoding="utf-8")
        self._needs_newline = not text.endswith("\n")
        lines = text.splitlines()
        try:
            header = json.loads(lines[0])
        except (json.JSONDecodeError, IndexError):
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(
                f"{self.path} is not an nbdebug label journal (its first line is not a journal "
                "header); pass another journal path."
            )
        if header.get("version", 0) > VERSION:
            raise ValueError(
                f"{self.path} was written by a newer nbdebug (journal version "
                f"{header.get('version')}, this one reads {VERSION}); upgrade nbdebug."
            )
        if header.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"the journal {self.path} was written for different data (fingerprint "
                f"{str(header.get('fingerprint'))[:12]}, {header.get('n_items')} items) than the "
                f"data under review (fingerprint {self.fingerprint[:12]}, {n_items} items): "
                "refusing to mix their decisions; pass another journal path."
            )
        self.header = header
        for lineno, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(
                    f"{self.path}, line {lineno} is unreadable (a write cut short?); skipped.",
                    UserWarning,
                    stacklevel=4,
                )
                continue
            if isinstance(rec, dict) and rec.get("type") in ("decision", "undo"):
                self.records.append(rec)

    # ---- writing
    def _write(self, records: Iterable[dict[str, Any]]) -> None:
        if self._unwritten:
            records = [self.header, *records]
            self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        if self._needs_newline:
            payload = "\n" + payload
            self._needs_newline = False
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        self._unwritten = False

    @property
    def _next_seq(self) -> int:
        return max((int(r.get("seq", 0)) for r in self.records), default=0) + 1

    @property
    def _next_batch(self) -> int:
        return max((int(r.get("batch", 0)) for r in self.records), default=0) + 1

    def append(self, decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write decisions as one batch (one undo step); returns them with ``seq``,
        ``batch`` and ``time`` filled in."""
        if not decisions:
            return []
        seq, batch, t = self._next_seq, self._next_batch, now()
        out = []
        for i, d in enumerate(decisions):
            out.append({"type": "decision", "seq": seq + i, "batch": batch, **d, "time": t})
        self._write(out)
        self.records.extend(out)
        return out

    def undone_batches(self) -> set[int]:
        return {int(r["batch"]) for r in self.records if r.get("type") == "undo"}

    def active(self) -> list[dict[str, Any]]:
        """Decisions not undone, in the order they were made."""
        undone = self.undone_batches()
        return [
            r for r in self.records if r.get("type") == "decision" and int(r["batch"]) not in undone
        ]

    def undo(self) -> list[dict[str, Any]]:
        """Undo the last batch still active; returns its decisions (empty when none)."""
        act = self.active()
        if not act:
            return []
        batch = int(act[-1]["batch"])
        rec = {"type": "undo", "seq": self._next_seq, "batch": batch, "time": now()}
        self._write([rec])
        self.records.append(rec)
        return [r for r in act if int(r["batch"]) == batch]

    def __repr__(self) -> str:
        return (
            f"Journal({str(self.path)!r}, decisions={len(self.active())}, "
            f"fingerprint={self.fingerprint[:12]!r})"
        )
