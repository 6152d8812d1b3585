"""Gradient flow over time, the numbers: robust z-scores of the guard's per-layer signals
(:func:`robust_z`), where a spike began (:func:`spike_origin`), and what a flow figure
draws (:func:`flow_data`) from a live :class:`~nbdebug.NaNGuard`, a snapshot or a
directory of snapshots (:func:`flow_source`). :mod:`nbdebug.figures.flow` draws them.

The rules, in one place:

* **z**: a robust z-score per parameter: the signal in log10 (a spike is a factor),
  against the median and the MAD of *that parameter's own* measured steps,
  ``z = (x - median) / max(1.4826 MAD, floor)`` with the floor a 1 % change (as the spike
  detector's); NaN where not measured (never 0); a zero gradient is ``-inf``, an infinite
  one ``+inf``.
* **Origin**: at the first step of a run of spikes where some parameter's gradient-norm
  z is above the threshold (:data:`Z_THRESHOLD`, the spike detector's default; a loss
  spike may come a step or two before), then back over the steps before it where one is
  (at most :data:`GAP` steps in a row without one): the parameter above it at the
  earliest of those steps (the largest z there; ties: model order) is where the spike
  began, the first to cross its threshold.
* **Rows shown**: every parameter, in model order, when there are at most
  ``max_params`` (:data:`MAX_PARAMS`); otherwise the ``max_params`` with the largest
  ``max |z|`` over the steps held (either signal), the origins always among them, still in
  model order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .guard import NaNGuard, parse_history
from .guard.history import HistoryRow
from .guard.signals import LayerSignals
from .guard.spike import SpikeSettings
from .snapshot import Snapshot, list_snapshots, load_snapshot
from .text import fmt_num

__all__ = [
    "FLOW_SIGNALS",
    "GAP",
    "MAX_PARAMS",
    "Z_THRESHOLD",
    "FlowData",
    "FlowSource",
    "SpikeOrigin",
    "flow_data",
    "flow_source",
    "merge_signals",
    "robust_z",
    "spike_origin",
]

#: a parameter's z above this crosses its threshold (the spike detector's default z)
Z_THRESHOLD = SpikeSettings().z
#: rows shown at most (then the top ones by max |z|)
MAX_PARAMS = 30
#: steps in a row without a parameter above the threshold that the origin's walk back skips
GAP = 2
#: fewest measured steps a parameter's z needs (fewer: no z, the cells left out)
MIN_HISTORY = 5
#: the spread's floor in log10 units: a 1 % change
SPREAD_FLOOR = math.log10(1.01)
#: the per-parameter signals a flow figure draws, in display order
FLOW_SIGNALS = ("grad_norm", "update_ratio")
_MAD_SIGMA = 1.4826
_TOTAL = "all parameters (total)"


def robust_z(values: Any) -> np.ndarray:
    """The robust z-score of every cell against its own column (one parameter's history).

    Parameters
    ----------
    values : array-like, shape (steps, parameters)
        Non-negative signals (norms, ratios); NaN where not measured.

    Returns
    -------
    numpy.ndarray
        float64, same shape: ``(log10(v) - median) / max(1.4826 MAD, SPREAD_FLOOR)``, the
        median and MAD over the column's finite log values; NaN where ``v`` is NaN or
        negative, or the column has fewer than :data:`MIN_HISTORY` finite values; ``-inf``
        for a zero, ``+inf`` for an infinite value.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"values must be 2-D (steps, parameters); got shape {v.shape}.")
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(v >= 0, np.log10(np.where(v >= 0, v, np.nan)), np.nan)
    fin = np.where(np.isfinite(x), x, np.nan)
    enough = np.isfinite(fin).sum(axis=0) >= MIN_HISTORY
    z = np.full(v.shape, np.nan)
    if enough.any():
        cols = fin[:, enough]
        med = np.nanmedian(cols, axis=0)
        mad = np.nanmedian(np.abs(cols - med), axis=0)
        spread = np.maximum(_MAD_SIGMA * mad, SPREAD_FLOOR)
        with np.errstate(invalid="ignore"):
            z[:, enough] = (x[:, enough] - med) / spread
    return z


@dataclass(frozen=True)
class SpikeOrigin:
    """Where a spike began (:func:`spike_origin`).

    Attributes
    ----------
    spike_step : int
        The step the spike detector flagged (the first of a run of spikes).
    parameter : str
        The parameter that crossed its threshold first.
    step : int
        The step it crossed it at (``<= spike_step``).
    z : float
        Its robust z there.
    signal : str
        The signal judged (``"grad_norm"``).
    """

    spike_step: int
    parameter: str
    step: int
    z: float
    signal: str = "grad_norm"

    def sentence(self, threshold: float = Z_THRESHOLD) -> str:
        """``"the spike at step 41: fc2.weight crossed z > 6 first (z 9.1 at step 39)"``."""
        return (
            f"the spike at step {self.spike_step}: {self.parameter} crossed z > {threshold:g} "
            f"first (z {fmt_num(self.z, '.3g')} at step {self.step})"
        )


def spike_origin(
    z: np.ndarray,
    steps: Sequence[int] | np.ndarray,
    names: Sequence[str],
    spike_step: int,
    *,
    until: int | None = None,
    threshold: float = Z_THRESHOLD,
    signal: str = "grad_norm",
) -> SpikeOrigin | None:
    """The parameter where the run of spikes from ``spike_step`` began (the rule: module
    docstring).

    Parameters
    ----------
    z : numpy.ndarray, shape (steps, parameters)
        Robust z-scores (:func:`robust_z`) of one signal.
    steps : sequence of int
        The step of each row of ``z``, increasing.
    names : sequence of str
        The parameter of each column.
    spike_step : int
        The first step of the run of spikes.
    until : int, optional
        Its last step (default: ``spike_step``): a loss spike may come before any
        parameter's gradient norm crosses, so the run's steps are looked at in turn.
    threshold : float

    Returns
    -------
    SpikeOrigin or None
        ``None`` when no parameter is above the threshold at a step of the run held in
        ``steps`` (the spike is not one parameter's).
    """
    z = np.asarray(z, dtype=np.float64)
    st = np.asarray(steps, dtype=np.int64)
    if z.shape != (len(st), len(names)):
        raise ValueError(
            f"z must have shape (steps, parameters) = {(len(st), len(names))}; got {z.shape}."
        )
    with np.errstate(invalid="ignore"):
        above = z > threshold
    last = int(spike_step) if until is None else int(until)
    hit = np.flatnonzero((st >= int(spike_step)) & (st <= last) & above.any(axis=1))
    if not hit.size:
        return None
    measured = ~np.isnan(z).all(axis=1)
    first, misses = int(hit[0]), 0
    for i in range(first - 1, -1, -1):
        if not measured[i]:
            continue
        if above[i].any():
            first, misses = i, 0
        else:
            misses += 1
            if misses > GAP:
                break
    cols = np.flatnonzero(above[first])
    j = int(cols[np.argmax(z[first, cols])])
    return SpikeOrigin(int(spike_step), str(names[j]), int(st[first]), float(z[first, j]), signal)


@dataclass(frozen=True)
class FlowSource:
    """What a flow figure reads: history rows, per-layer signals and snapshot files.

    Attributes
    ----------
    rows : list of HistoryRow
    signals : LayerSignals or None
        ``None``: not recorded (an older snapshot, or the guard's option off).
    snapshots : dict of int to str
        Step -> the snapshot file written at it.
    """

    rows: list[HistoryRow]
    signals: LayerSignals | None
    snapshots: dict[int, str] = field(default_factory=dict)


def _row_snapshots(rows: Iterable[Mapping[str, Any]]) -> dict[int, str]:
    return {int(r["step"]): str(r["snapshot"]) for r in rows if r.get("snapshot")}


def _of_snapshot(snap: Snapshot) -> FlowSource:
    rows = parse_history(list(snap.history))
    files = _row_snapshots(rows)
    if snap.step is not None and snap.path is not None:
        files[int(snap.step)] = str(snap.path)
    return FlowSource(rows, snap.signals, files)


_SIGNALS = ("grad_norm", "update_ratio", "adam_lag")


def merge_signals(parts: Sequence[LayerSignals]) -> LayerSignals | None:
    """The signals of several snapshots of one run as one: the union of their steps (a
    step held by several: the latest part's row). Parts of another model (other parameter
    names than the last part's) are left out."""
    if not parts:
        return None
    names = parts[-1].names
    kept = [p for p in parts if p.names == names]
    steps = np.unique(np.concatenate([p.steps for p in kept]))
    arrays = {k: np.full((len(steps), len(names)), np.nan, np.float32) for k in _SIGNALS}
    for p in kept:  # oldest first: a later part overwrites
        at = np.searchsorted(steps, p.steps)
        for k in _SIGNALS:
            arrays[k][at] = getattr(p, k)
    return LayerSignals.from_arrays(names, steps, *(arrays[k] for k in _SIGNALS))


def _of_directory(directory: Path) -> FlowSource:
    import pandas as pd

    listing = list_snapshots(directory)
    ok = listing[listing["error"].isna()]
    if ok.empty:
        raise ValueError(f"the directory {directory} holds no readable snapshot file.")
    merged: dict[int, dict[str, Any]] = {}
    files: dict[int, str] = {}
    parts: list[LayerSignals] = []
    for path, step in zip(ok["path"], ok["step"]):
        one = _of_snapshot(load_snapshot(path))  # the header only: no model, no weights
        for r in one.rows:
            merged[int(r["step"])] = {**merged.get(int(r["step"]), {}), **r}
        if one.signals is not None:
            parts.append(one.signals)
        if pd.notna(step):
            files.setdefault(int(step), str(path))
    rows = parse_history([merged[s] for s in sorted(merged)])
    files = {**_row_snapshots(rows), **files}
    return FlowSource(rows, merge_signals(parts), files)


def flow_source(source: object) -> FlowSource:
    """Read a flow figure's source: a :class:`~nbdebug.NaNGuard` (live: its history and
    signals now), a :class:`~nbdebug.core.snapshot.Snapshot`, the path of a snapshot file,
    a directory of snapshots (their histories and signals merged; only the headers are
    read) or a :class:`FlowSource`.

    Raises
    ------
    TypeError
        Another kind of source.
    ValueError
        A directory without a readable snapshot file.
    SnapshotError
        A file that cannot be read.
    """
    if isinstance(source, FlowSource):
        return source
    if isinstance(source, NaNGuard):
        rows = parse_history(list(source.history))
        return FlowSource(rows, source.signals, _row_snapshots(rows))
    if isinstance(source, Snapshot):
        return _of_snapshot(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return _of_directory(path) if path.is_dir() else _of_snapshot(load_snapshot(path))
    raise TypeError(
        "the flow figure reads a NaNGuard, a Snapshot, a snapshot path or a directory of "
        f"snapshots; got {type(source).__qualname__}."
    )


@dataclass(frozen=True)
class FlowData:
    """The numbers a flow figure draws (:func:`flow_data`).

    Attributes
    ----------
    steps : numpy.ndarray
        int64, the heatmaps' columns.
    names : list of str
        The parameters shown (rows, model order).
    n_params : int
        Parameters recorded (``len(names)`` or more: the rule is ``rule``).
    values, z : dict of str to numpy.ndarray
        Per signal of :data:`FLOW_SIGNALS` with a measured value, ``(steps, shown)`` arrays:
        the values as recorded, and their robust z (over every step held).
    spikes, skipped, nonfinite : list of int
        The steps with spike findings, skipped updates and non-finite values.
    snapshots : dict of int to str
        Step -> snapshot file.
    origins : list of SpikeOrigin
        One per run of spikes whose origin is known, in step order.
    spike_runs : list of int
        The first step of each run of consecutive spikes.
    spike_signals : dict of int to tuple of str
        The signals flagged at each of those steps (``"grad_norm"``, ``"loss"``).
    threshold : float
    rule : str
        Which parameters are shown, in words.
    per_layer : bool
        ``False``: no per-layer signals were recorded; the one row is the history's total
        gradient norm.
    """

    steps: np.ndarray
    names: list[str]
    n_params: int
    values: dict[str, np.ndarray]
    z: dict[str, np.ndarray]
    spikes: list[int]
    skipped: list[int]
    nonfinite: list[int]
    snapshots: dict[int, str]
    origins: list[SpikeOrigin]
    spike_runs: list[int]
    spike_signals: dict[int, tuple[str, ...]]
    threshold: float
    rule: str
    per_layer: bool = True

    def summary(self) -> str:
        """The figure in sentences: where each spike began (or that none was flagged),
        the skipped and non-finite steps."""
        if not len(self.steps):
            return "no step recorded yet."
        found = {o.spike_step: o for o in self.origins}
        parts = []
        for s in self.spike_runs:
            o = found.get(s)
            parts.append(
                o.sentence(self.threshold)
                if o is not None
                else f"the {_what(self.spike_signals.get(s, ()))}spike at step {s} is not "
                f"one parameter's: no gradient norm is above z {self.threshold:g} there"
            )
        if not self.spike_runs:
            parts.append(f"no spike flagged in steps {self.steps[0]}-{self.steps[-1]}")
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped update(s) (last: step {self.skipped[-1]})")
        if self.nonfinite:
            parts.append(f"first non-finite step {self.nonfinite[0]}")
        text = "; ".join(parts)
        return text[0].upper() + text[1:] + "."


def _what(signals: Sequence[str]) -> str:
    return "/".join(signals) + " " if signals else ""


def _signals_of(src: FlowSource) -> tuple[LayerSignals, bool]:
    """The source's signals, or the history's total gradient norm as one row."""
    if src.signals is not None and len(src.signals) and src.signals.names:
        return src.signals, True
    steps = [int(r["step"]) for r in src.rows]
    gn = [[np.nan if r.get("grad_norm") is None else float(r["grad_norm"])] for r in src.rows]
    empty = np.full((len(steps), 1), np.nan)
    return LayerSignals.from_arrays([_TOTAL], steps, np.reshape(gn, (-1, 1)), empty, empty), False


def _spike_runs(rows: Sequence[HistoryRow]) -> list[tuple[int, int]]:
    """The first and last step of each run of consecutive rows with spike findings."""
    runs: list[tuple[int, int]] = []
    before = False
    for r in rows:
        now = bool(r.get("spikes"))
        if now:
            step = int(r["step"])
            runs.append((step, step) if not before else (runs[-1][0], step))
            if before:
                del runs[-2]
        before = now
    return runs


def _choose(z: Mapping[str, np.ndarray], must: set[int], n: int, cap: int) -> list[int]:
    """The columns shown: all (at most ``cap``), else the ``cap`` with the largest max |z|
    (``must`` always among them), in model order."""
    if n <= cap:
        return list(range(n))
    score = np.full(n, -1.0)
    for a in z.values():
        with np.errstate(invalid="ignore"):
            col = np.where(np.isnan(a), -1.0, np.abs(a)).max(axis=0, initial=-1.0)
        score = np.maximum(score, col)
    order = [int(j) for j in np.argsort(-score, kind="stable")]
    chosen = list(must)[:cap]
    chosen += [j for j in order if j not in must][: cap - len(chosen)]
    return sorted(chosen)


def flow_data(
    source: object, *, threshold: float = Z_THRESHOLD, max_params: int = MAX_PARAMS
) -> FlowData:
    """The numbers of :func:`flow_figure` (``source``: as :func:`flow_source` reads it).

    Raises
    ------
    ValueError
        ``threshold`` not a positive number, ``max_params`` not a positive int.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number; got {threshold!r}.")
    if isinstance(max_params, bool) or not isinstance(max_params, int) or max_params < 1:
        raise ValueError(f"max_params must be a positive int; got {max_params!r}.")
    src = flow_source(source)
    sig, per_layer = _signals_of(src)
    z_all = {k: robust_z(sig.signal(k)) for k in FLOW_SIGNALS}
    pairs = _spike_runs(src.rows)
    runs = [a for a, _ in pairs]
    found = [
        spike_origin(z_all["grad_norm"], sig.steps, sig.names, a, until=b, threshold=threshold)
        for a, b in pairs
    ]
    origins = [o for o in found if o is not None]
    where = {name: j for j, name in enumerate(sig.names)}
    measured = {k: a for k, a in z_all.items() if np.isfinite(sig.signal(k)).any()}
    measured.setdefault("grad_norm", z_all["grad_norm"])
    cols = _choose(measured, {where[o.parameter] for o in origins}, len(sig.names), max_params)
    n = len(sig.names)
    rule = (
        f"all {n} parameters"
        if len(cols) == n
        else f"the {len(cols)} of {n:,} parameters with the largest max |z|"
    )
    return FlowData(
        steps=sig.steps,
        names=[sig.names[j] for j in cols],
        n_params=n,
        values={k: sig.signal(k)[:, cols] for k in measured},
        z={k: a[:, cols] for k, a in measured.items()},
        spikes=[int(r["step"]) for r in src.rows if r.get("spikes")],
        skipped=[int(r["step"]) for r in src.rows if r.get("skipped")],
        nonfinite=[int(r["step"]) for r in src.rows if r.get("nonfinite") is not None],
        snapshots=dict(sorted(src.snapshots.items())),
        origins=origins,
        spike_runs=runs,
        spike_signals={
            int(r["step"]): tuple(str(f.get("signal", "")) for f in r["spikes"])
            for r in src.rows
            if int(r["step"]) in runs
        },
        threshold=float(threshold),
        rule=rule if per_layer else "per-layer signals not recorded: the total gradient norm",
        per_layer=per_layer,
    )
