"""The guard's history: one row per checked step (:class:`HistoryRow`), written by
:class:`nbdebug.NaNGuard`, stored in its snapshots, and read back by
:func:`parse_history` (the one reader of a ``history=`` argument) and
:func:`history_frame` (the table)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from ..vocab import FailureKind

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["HISTORY_COLUMNS", "HistoryRow", "history_frame", "parse_history"]

#: the failure kinds a row's ``nonfinite`` may hold
KINDS = frozenset(k.value for k in FailureKind)
#: the columns :func:`history_frame` puts first
HISTORY_COLUMNS = ("step", "loss", "grad_norm", "param_norm", "lr", "scale", "skipped")


class HistoryRow(TypedDict, total=False):
    """One checked step as the guard records it (a plain dict: it is stored in snapshots).

    Attributes
    ----------
    step : int
    loss : float or None
        ``None`` when the step passed no loss.
    grad_norm : float
        Total L2 norm of the gradients, unscaled.
    param_norm : float or None
        Total L2 norm of the weights (``None`` on steps that do not measure it).
    lr : float or None
        The first parameter group's learning rate.
    scale : float or None
        The GradScaler's scale.
    skipped : bool
        The update was skipped (by the guard, or by the scaler on an overflow).
    nonfinite : FailureKind or None
        The failure of the step (``None``: no failure).
    time : float
        When it was checked (seconds since the epoch).
    rank : int
        Distributed: this process's rank.
    replicas : str
        Distributed, on a step whose replicas were compared: ``"equal"`` or the first
        parameter that differs.
    checks : list of dict
        The health checks' findings (``NaNGuard(checks=...)``).
    adam : dict
        The Adam moments the health checks measured.
    spikes : list of dict
        The spike detector's findings on this step (:class:`~nbdebug.core.guard.spike.
        SpikeFinding` as data: ``signal``, ``value``, ``median``, ``z``, ``threshold``,
        ``window``, ``history``, ``message``).
    spike_status : dict
        Per signal, why the spike detector could not score it (no gradients yet, no loss).
    snapshot : str
        The snapshot written at this step.
    skips : int
        Skipped updates so far, this step's included (:mod:`nbdebug.core.guard.skips`).
    skips_in_row : int
        Skipped updates in a row up to this step.
    skip_reason : str
        On a skipped step: why (``"non-finite loss"``, ``"spike in grad_norm"``, ...).
    """

    step: int
    loss: float | None
    grad_norm: float
    param_norm: float | None
    lr: float | None
    scale: float | None
    skipped: bool
    nonfinite: FailureKind | None
    time: float
    rank: int
    replicas: str
    checks: list[dict[str, Any]]
    adam: dict[str, list[float]]
    spikes: list[dict[str, Any]]
    spike_status: dict[str, str]
    snapshot: str
    skips: int
    skips_in_row: int
    skip_reason: str


def parse_history(history: object) -> list[HistoryRow]:
    """A ``history=`` argument as rows: a guard (its ``history``), a list of dicts (a
    guard's or a snapshot's rows) or a DataFrame (``guard.history_frame()``); ``None``:
    no rows.

    A DataFrame cannot tell a value that was not recorded from a NaN (it fills both with
    NaN): its NaN cells read as ``None``, "not recorded". A row's ``nonfinite`` says
    whether its step failed; the rows of a list are taken as they are.

    Parameters
    ----------
    history : NaNGuard, list of dict, pandas.DataFrame or None

    Returns
    -------
    list of HistoryRow
        ``nonfinite`` as a :class:`~nbdebug.core.vocab.FailureKind` (or ``None``).

    Raises
    ------
    TypeError
        Anything else, or rows that are not dicts.
    """
    if history is None:
        return []
    rows = getattr(history, "history", history)  # a NaNGuard
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # a DataFrame
        records = rows.to_dict("records")
        return [_row({k: _nan_none(v) for k, v in r.items()}) for r in records]
    if isinstance(rows, Iterable) and not isinstance(rows, (str, bytes, Mapping)):
        items = list(rows)
        if all(isinstance(r, Mapping) for r in items):
            return [_row(r) for r in items]
    raise TypeError(
        "history must be a NaNGuard, a list of dicts (a guard's history) or a DataFrame with "
        f"loss and grad_norm columns; got {type(history).__qualname__}."
    )


def _row(values: Mapping[str, Any]) -> HistoryRow:
    row = dict(values)
    kind = row.get("nonfinite")
    if isinstance(kind, str) and kind in KINDS:
        row["nonfinite"] = FailureKind(kind)
    return row  # type: ignore[return-value]


def _nan_none(v: object) -> object:
    return None if isinstance(v, float) and math.isnan(v) else v


def history_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """History rows as a DataFrame with :data:`HISTORY_COLUMNS` first: ``step``, ``loss``,
    ``grad_norm``, ``param_norm``, ``lr``, ``scale`` (floats; NaN where not recorded),
    ``skipped`` (bool), then any other recorded columns (``nonfinite``, ``time``)."""
    import pandas as pd

    records = [dict(r) for r in rows]
    df = pd.DataFrame.from_records(records) if records else pd.DataFrame()
    for c in HISTORY_COLUMNS:
        if c not in df.columns:
            df[c] = pd.Series([None] * len(df), dtype=object)
    for c in ("loss", "grad_norm", "param_norm", "lr", "scale"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    df["skipped"] = df["skipped"].fillna(False).astype(bool)
    first = list(HISTORY_COLUMNS)
    return df[first + [c for c in df.columns if c not in first]].reset_index(drop=True)
