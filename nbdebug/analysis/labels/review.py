"""The state of a label review, without any UI: :class:`LabelReview`.

:class:`nbdebug.LabelCleaner` is this object plus buttons. Every action goes through the
:class:`~nbdebug.analysis.labels.journal.Journal` first (written and fsync'ed), then changes the
in-memory state, so the journal is always the truth and reopening it resumes the review.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .inputs import check_labels
from .journal import Journal, fingerprint

ACTIONS = ("keep", "relabel", "exclude", "skip")
REQUIRED_COLUMNS = ("given_label", "suggested_label", "label_quality", "is_issue")


class SplitGuardError(ValueError):
    """Relabeling or excluding samples of a split marked ``is_test=True`` without ``force``."""


def check_issues(issues: object, labels: np.ndarray) -> pd.DataFrame:
    """The frame of :func:`nbdebug.find_label_issues`, checked against ``labels``."""
    if not isinstance(issues, pd.DataFrame):
        raise TypeError(
            "issues must be the DataFrame returned by nbdebug.find_label_issues; got "
            f"{type(issues).__qualname__}."
        )
    missing = [c for c in REQUIRED_COLUMNS if c not in issues.columns]
    if missing:
        raise ValueError(
            f"issues lacks the columns {missing}: expected the DataFrame returned by "
            "nbdebug.find_label_issues."
        )
    idx = issues.index.to_numpy()
    if not np.issubdtype(idx.dtype, np.integer) or (
        len(idx) and (idx.min() < 0 or idx.max() >= len(labels))
    ):
        found = (
            f"its index runs {int(idx.min())}..{int(idx.max())}"
            if len(idx) and np.issubdtype(idx.dtype, np.integer)
            else f"its index is of dtype {idx.dtype}"
        )
        raise ValueError(
            f"issues' index must hold sample positions 0..{len(labels) - 1} (there are "
            f"{len(labels)} labels; as returned by find_label_issues); {found}."
        )
    given = issues["given_label"].to_numpy()
    bad = given != labels[idx]
    if bad.any():
        i = int(idx[np.flatnonzero(bad)[0]])
        raise ValueError(
            f"issues were computed for other labels: sample {i} has given_label "
            f"{int(given[np.flatnonzero(bad)[0]])} in issues but label {int(labels[i])} here."
        )
    return issues


def _num(x: float | str | None) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


class LabelReview:
    """A ranked queue of suspect labels and the reviewer's decisions, journaled.

    Parameters
    ----------
    labels : array-like of int, shape (n,)
        Given labels.
    issues : pandas.DataFrame
        The result of :func:`nbdebug.find_label_issues` for these labels.
    data : optional
        The samples (array, tensor, DataFrame, list); part of the journal's fingerprint.
    journal : str or Path
        JSONL file; created, or resumed when it was written for the same data.
    is_test : bool
        The split is a test split: relabeling and excluding are refused unless ``force``.
    force : bool
    """

    def __init__(
        self,
        labels: object,
        issues: object,
        *,
        data: object = None,
        journal: str | os.PathLike[str] = "labels.journal.jsonl",
        is_test: bool = False,
        force: bool = False,
        n_classes: int | None = None,
    ):
        self.labels = check_labels(labels)
        self.issues = check_issues(issues, self.labels)
        table = self.issues
        est = table.attrs.get("label_noise")
        k = getattr(est, "n_classes", None) or n_classes
        if k is None:
            k = int(max(self.labels.max(), table["suggested_label"].max())) + 1
        self.n_classes = int(k)
        self.is_test = bool(is_test)
        self.force = bool(force)
        self.journal = Journal(
            journal,
            fingerprint=fingerprint(data, self.labels),
            n_items=len(self.labels),
            n_classes=self.n_classes,
        )
        flagged = table[table["is_issue"].to_numpy(dtype=bool)]
        self._queue = flagged.index.to_numpy(dtype=np.int64)
        self._filter: tuple[int | None, int | None] = (None, None)
        self._state: dict[int, dict[str, Any]] = {}
        self._rebuild()

    # ---- state
    def _rebuild(self) -> None:
        self._state = {}
        for r in self.journal.active():
            self._state[int(r["item"])] = r

    @property
    def can_relabel(self) -> bool:
        return not self.is_test or self.force

    def _guard(self, what: str) -> None:
        if not self.can_relabel:
            raise SplitGuardError(
                f"this split is marked is_test=True: {what} test samples biases the evaluation; "
                "pass force=True to allow it."
            )

    def set_filter(self, given: int | None = None, suggested: int | None = None) -> None:
        """Show only suspects with this given label and/or this suggested label."""
        for name, v in (("given", given), ("suggested", suggested)):
            if v is not None and not (isinstance(v, (int, np.integer)) and 0 <= v < self.n_classes):
                raise ValueError(
                    f"{name} must be a class in 0..{self.n_classes - 1} or None; got {v!r}."
                )
        self._filter = (
            None if given is None else int(given),
            None if suggested is None else int(suggested),
        )

    @property
    def filter(self) -> tuple[int | None, int | None]:
        return self._filter

    @property
    def queue(self) -> np.ndarray:
        """Sample positions of the suspects under the current filter, most suspicious first."""
        q = self._queue
        g, s = self._filter
        if g is not None or s is not None:
            rows = self.issues.loc[q]
            keep = np.ones(len(q), dtype=bool)
            if g is not None:
                keep &= rows["given_label"].to_numpy() == g
            if s is not None:
                keep &= rows["suggested_label"].to_numpy() == s
            q = q[keep]
        return q

    def pending(self) -> np.ndarray:
        """Queue items without a decision yet."""
        q = self.queue
        return q[[int(i) not in self._state for i in q]] if len(q) else q

    @property
    def current(self) -> int | None:
        """The next item to review (None when the filtered queue is done)."""
        p = self.pending()
        return int(p[0]) if len(p) else None

    def decision(self, item: int) -> dict[str, Any] | None:
        return self._state.get(int(item))

    def row(self, item: int) -> pd.Series:
        """The issues row of one sample."""
        row = self.issues.loc[int(item)]
        assert isinstance(row, pd.Series)
        return row

    # ---- actions
    def _record(self, item: int, action: str, new_label: int) -> dict[str, Any]:
        row = self.row(item)
        meth = str(row["method"]) if "method" in row.index and str(row["method"]) else "manual"
        return {
            "item": int(item),
            "old_label": int(self.labels[item]),
            "new_label": int(new_label),
            "action": action,
            "score": _num(row["label_quality"]),
            "method": meth,
        }

    def _item(self, item: int | None) -> int:
        if item is None:
            cur = self.current
            if cur is None:
                raise ValueError(
                    "the queue is done: no item left to decide (pass item= explicitly)."
                )
            return cur
        if not isinstance(item, (int, np.integer)) or not 0 <= int(item) < len(self.labels):
            raise ValueError(
                f"item must be a sample position in 0..{len(self.labels) - 1}; got {item!r}."
            )
        if int(item) not in self.issues.index:
            raise ValueError(f"sample {item} is not in issues.")
        return int(item)

    def _apply(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        written = self.journal.append(records)
        for r in written:
            self._state[int(r["item"])] = r
        return written

    def keep(self, item: int | None = None) -> dict[str, Any]:
        """The given label is right."""
        i = self._item(item)
        return self._apply([self._record(i, "keep", int(self.labels[i]))])[0]

    def relabel(self, new_label: int | None = None, item: int | None = None) -> dict[str, Any]:
        """Change the label (to the suggestion when ``new_label`` is None)."""
        self._guard("relabeling")
        i = self._item(item)
        if new_label is None:
            new_label = int(self.row(i)["suggested_label"])
            if new_label < 0:
                raise ValueError(f"sample {i} has no suggested label: pass new_label=.")
        if not isinstance(new_label, (int, np.integer)) or not 0 <= int(new_label) < self.n_classes:
            raise ValueError(
                f"new_label must be a class in 0..{self.n_classes - 1}; got {new_label!r}."
            )
        return self._apply([self._record(i, "relabel", int(new_label))])[0]

    def exclude(self, item: int | None = None) -> dict[str, Any]:
        """Drop the sample from the cleaned set."""
        self._guard("excluding")
        i = self._item(item)
        return self._apply([self._record(i, "exclude", int(self.labels[i]))])[0]

    def skip(self, item: int | None = None) -> dict[str, Any]:
        """Decide later: the label stays, the queue moves on."""
        i = self._item(item)
        return self._apply([self._record(i, "skip", int(self.labels[i]))])[0]

    def undo(self) -> list[dict[str, Any]]:
        """Undo the last action (a bulk accept is one action); returns the undone decisions."""
        undone = self.journal.undo()
        if undone:
            self._rebuild()
        return undone

    def _bulk_candidates(self, threshold: float) -> np.ndarray:
        if not isinstance(threshold, (int, float)) or not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(
                f"the score threshold must be a probability in [0, 1]; got {threshold!r}."
            )
        p = self.pending()
        if not len(p):
            return p
        rows = self.issues.loc[p]
        sug = rows["suggested_label"].to_numpy()
        prob = (
            rows["suggested_prob"].to_numpy(dtype=float)
            if "suggested_prob" in rows.columns
            else np.full(len(p), np.nan)
        )
        ok = (sug >= 0) & (sug != rows["given_label"].to_numpy()) & (prob >= float(threshold))
        return p[ok]

    def count_above(self, threshold: float) -> int:
        """How many pending suspects (under the filter) have a suggestion whose probability
        is at least ``threshold``: what :meth:`accept_above` would relabel."""
        return len(self._bulk_candidates(threshold))

    def accept_above(self, threshold: float) -> int:
        """Relabel to the suggestion every pending suspect counted by :meth:`count_above`,
        as one undoable action; returns the number relabeled."""
        self._guard("relabeling")
        items = self._bulk_candidates(threshold)
        recs = [
            self._record(int(i), "relabel", int(self.row(int(i))["suggested_label"])) for i in items
        ]
        for r in recs:
            r["bulk"] = float(threshold)
        return len(self._apply(recs))

    # ---- results
    @property
    def decisions(self) -> pd.DataFrame:
        """One row per decided item (the latest decision; undone ones are gone), in the order
        they were made: item, old_label, new_label, action, score, method, time."""
        cols = ["item", "old_label", "new_label", "action", "score", "method", "time"]
        recs = sorted(self._state.values(), key=lambda r: int(r["seq"]))
        df = pd.DataFrame([{c: r.get(c) for c in cols} for r in recs], columns=cols)
        return df.astype(
            {"item": "int64", "old_label": "int64", "new_label": "int64", "score": "float64"}
        )

    def cleaned_labels(self) -> np.ndarray:
        """A copy of the labels with every relabel applied, shape ``(n,)`` int64."""
        out = self.labels.copy()
        for i, r in self._state.items():
            if r["action"] == "relabel":
                out[i] = int(r["new_label"])
        return out

    def mask(self) -> np.ndarray:
        """``True`` for the samples kept (every one not excluded), shape ``(n,)`` bool."""
        m = np.ones(len(self.labels), dtype=bool)
        for i, r in self._state.items():
            if r["action"] == "exclude":
                m[i] = False
        return m

    def to_frame(self) -> pd.DataFrame:
        """Every sample: index, given_label, label (cleaned), keep, action ("" if undecided)."""
        action = np.full(len(self.labels), "", dtype=object)
        for i, r in self._state.items():
            action[i] = r["action"]
        return pd.DataFrame(
            {
                "index": np.arange(len(self.labels)),
                "given_label": self.labels,
                "label": self.cleaned_labels(),
                "keep": self.mask(),
                "action": action.astype(str),
            }
        )

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_frame` to ``.csv`` or ``.parquet`` (needs pyarrow); returns the path."""
        p = Path(path)
        suffix = p.suffix.lower()
        df = self.to_frame()
        if suffix == ".csv":
            df.to_csv(p, index=False)
        elif suffix in (".parquet", ".pq"):
            try:
                import pyarrow  # noqa: F401
            except ImportError as e:
                raise ImportError(
                    "exporting to Parquet needs pyarrow, which is not installed: "
                    "pip install pyarrow (or export to a .csv path)."
                ) from e
            df.to_parquet(p, index=False)
        else:
            raise ValueError(f"export path must end in .csv or .parquet; got {p.name!r}.")
        return p

    def progress(self) -> dict[str, int]:
        """Counts for a status line."""
        queued = set(self._queue.tolist())
        decided = [r["action"] for i, r in self._state.items() if i in queued]
        return {
            "suspects": len(self._queue),
            "in_filter": len(self.queue),
            "pending": len(self.pending()),
            "decided": len(decided),
            **{a: decided.count(a) for a in ACTIONS},
        }

    def __repr__(self) -> str:
        pr = self.progress()
        return (
            f"LabelReview(suspects={pr['suspects']}, decided={pr['decided']}, "
            f"relabeled={pr['relabel']}, excluded={pr['exclude']}, "
            f"journal={str(self.journal.path)!r})"
        )
