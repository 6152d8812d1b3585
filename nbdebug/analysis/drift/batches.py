"""Turn the two batches of :func:`nbdebug.drift` into aligned float matrices.

Everything the user passes is read, never written: DataFrames, arrays and tensors are
copied into new ``float64`` arrays. Every problem is reported in one sentence that names
what was expected and what was given (columns, counts, dtypes), before any explainer or
statistical test sees the data.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..tabular import describe_counts, non_numeric, nonfinite_counts, read_table

NAN_POLICIES = ("raise", "impute")
MIN_ROWS = 2  # below this no test is defined at all
FEW_ROWS = 20  # below this the tests have little power: warn


@dataclass
class Batches:
    """The two batches as aligned ``float64`` matrices.

    Attributes
    ----------
    reference, current : numpy.ndarray
        Shapes ``(n_reference, d)`` and ``(n_current, d)``, dtype float64, new arrays.
    feature_names : list[str]
        ``d`` names, in column order.
    notes : list[str]
        What was done to the data (columns reordered, one-hot encoded, values imputed).
    frame_columns : list[str] | None
        The DataFrame columns the model expects, when the batches were DataFrames.
    categories : dict of str to list
        Non-numeric columns kept as categories (``categorical=True``): frame column name ->
        its categories; the matrices hold each value's index in that list
        (:func:`nbdebug.analysis.tabular.model_frame` turns them back into the values).
    """

    reference: np.ndarray
    current: np.ndarray
    feature_names: list[str]
    notes: list[str] = field(default_factory=list)
    frame_columns: list[str] | None = None
    categories: dict[str, list[object]] = field(default_factory=dict)


@dataclass
class _Frames:
    """The two batches as DataFrames with the same columns, while they are prepared."""

    ref: pd.DataFrame
    cur: pd.DataFrame
    named: bool  # some batch came with its own column names
    frame_columns: list[str] | None
    notes: list[str]


def _align_columns(
    ref: pd.DataFrame, cur: pd.DataFrame, named: tuple[bool, bool], notes: list[str]
) -> pd.DataFrame:
    """``cur`` with the columns of ``ref`` (same names, reference order)."""
    if named[0] and named[1]:
        rcols, ccols = [str(c) for c in ref.columns], [str(c) for c in cur.columns]
        for which, cols in (("reference", rcols), ("current", ccols)):
            dup = sorted({c for c in cols if cols.count(c) > 1})
            if dup:
                raise ValueError(f"the {which} batch has duplicated column names: {dup}.")
        missing = [c for c in rcols if c not in ccols]
        extra = [c for c in ccols if c not in rcols]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing from current: {missing}")
            if extra:
                parts.append(f"only in current: {extra}")
            raise ValueError("the batches have different column names; " + "; ".join(parts) + ".")
        if rcols != ccols:
            notes.append("the current batch's columns were put in the reference's order")
            cur = cur.set_axis(ccols, axis=1)[rcols]
            cur.columns = ref.columns
        return cur
    if ref.shape[1] != cur.shape[1]:
        raise ValueError(
            f"the batches have different numbers of columns: reference {ref.shape[1]}, "
            f"current {cur.shape[1]}."
        )
    return cur


def _frames(reference: object, current: object) -> _Frames:
    """Read both batches and match their columns (by name, or by position)."""
    ref, ref_named = read_table(reference, "reference")
    cur, cur_named = read_table(current, "current")
    notes: list[str] = []
    for which, df in (("reference", ref), ("current", cur)):
        if df.shape[1] == 0:
            raise ValueError(f"the {which} batch has no columns; expected at least one feature.")
    cur = _align_columns(ref, cur, (ref_named, cur_named), notes)
    frame_columns = (
        [str(c) for c in ref.columns]
        if ref_named
        else ([str(c) for c in cur.columns] if cur_named else None)
    )
    if not (ref_named and cur_named):
        # positional match: the DataFrame side (if any) gives the names, else the report's
        # x0, x1, ... (so that an error or a note names a column as the report does)
        cols = (
            ref.columns
            if ref_named
            else (cur.columns if cur_named else [f"x{j}" for j in range(ref.shape[1])])
        )
        ref = ref.set_axis(cols, axis=1)
        cur = cur.set_axis(cols, axis=1)
    return _Frames(ref, cur, ref_named or cur_named, frame_columns, notes)


def _as_categories(f: _Frames, bad: dict[str, str]) -> dict[str, list[object]]:
    """Replace each non-numeric column by its category codes; returns the categories."""
    f.ref, f.cur = f.ref.copy(), f.cur.copy()
    categories: dict[str, list[object]] = {}
    for col in bad:
        both = pd.concat([f.ref[col], f.cur[col]], ignore_index=True)
        missing = int(both.isna().sum())
        if missing:
            raise ValueError(
                f"the categorical column {col!r} has {missing} missing value(s); fill them "
                f"with a category of their own first."
            )
        cats = sorted(pd.unique(both), key=str)
        lookup = {v: i for i, v in enumerate(cats)}
        f.ref[col] = f.ref[col].map(lookup).astype(np.float64)
        f.cur[col] = f.cur[col].map(lookup).astype(np.float64)
        categories[str(col)] = list(cats)
    f.notes.append(
        f"{len(bad)} non-numeric column(s) kept as categories for the model "
        f"(chi-square tests on their counts): {', '.join(bad)}"
    )
    return categories


def _one_hot(f: _Frames, bad: dict[str, str], one_hot: bool) -> None:
    """One-hot encode the non-numeric columns, or refuse them."""
    if not one_hot:
        listed = ", ".join(f"{k!r} ({v})" for k, v in bad.items())
        raise ValueError(
            f"non-numeric columns: {listed}; encode them first, or pass one_hot=True to "
            "one-hot encode them over the categories of both batches."
        )
    both = pd.concat([f.ref, f.cur], axis=0, ignore_index=True)
    both.columns = [str(c) for c in both.columns]
    enc = pd.get_dummies(both, columns=list(bad), prefix_sep="=", dtype=float)
    f.ref, f.cur = enc.iloc[: len(f.ref)], enc.iloc[len(f.ref) :]
    f.notes.append(f"one-hot encoded {len(bad)} non-numeric column(s): {', '.join(bad)}")
    f.frame_columns = [str(c) for c in f.ref.columns]
    f.named = True


def _names(f: _Frames, feature_names: Sequence[str] | None) -> list[str]:
    d = f.ref.shape[1]
    names = [str(c) for c in f.ref.columns] if f.named else [f"x{j}" for j in range(d)]
    if feature_names is not None:
        names = [str(n) for n in feature_names]
        if len(names) != d:
            raise ValueError(
                f"feature_names has {len(names)} names but the batches have {d} columns."
            )
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"feature names must be unique; duplicated: {dup}.")
    return names


def _matrices(f: _Frames) -> tuple[np.ndarray, np.ndarray]:
    try:
        xr = f.ref.to_numpy(dtype=np.float64, na_value=np.nan, copy=True)
        xc = f.cur.to_numpy(dtype=np.float64, na_value=np.nan, copy=True)
    except (TypeError, ValueError) as e:  # e.g. a column of mixed objects
        raise ValueError(f"the batches could not be read as real numbers: {e}.") from e
    for which, arr in (("reference", xr), ("current", xc)):
        if arr.shape[0] < MIN_ROWS:
            raise ValueError(
                f"the {which} batch has {arr.shape[0]} row(s); at least {MIN_ROWS} are needed "
                f"(and {FEW_ROWS} or more for tests with any power)."
            )
    return xr, xc


def _nonfinite(
    xr: np.ndarray, xc: np.ndarray, names: list[str], nan_policy: str, notes: list[str]
) -> None:
    """Refuse NaN/inf values, or replace them (in place) with the reference median."""
    bad_counts = {w: nonfinite_counts(a, names) for w, a in (("reference", xr), ("current", xc))}
    if not any(bad_counts.values()):
        return
    if nan_policy == "raise":
        parts = [
            f"{w} has {sum(c.values())} ({describe_counts(c)})" for w, c in bad_counts.items() if c
        ]
        raise ValueError(
            "NaN/inf values in the features: "
            + "; ".join(parts)
            + ". Clean them, or pass nan_policy='impute' to replace them with the "
            "reference median."
        )
    ref_fin = np.where(np.isfinite(xr), xr, np.nan)
    all_missing = [names[j] for j in range(xr.shape[1]) if np.isnan(ref_fin[:, j]).all()]
    if all_missing:
        raise ValueError(
            f"cannot impute: these columns have no finite value in the reference "
            f"batch: {all_missing}."
        )
    med = np.nanmedian(ref_fin, axis=0)
    for w, arr in (("reference", xr), ("current", xc)):
        mask = ~np.isfinite(arr)
        if mask.any():
            arr[mask] = np.broadcast_to(med, arr.shape)[mask]
            notes.append(
                f"imputed {int(mask.sum())} NaN/inf value(s) in the {w} batch with "
                f"the reference median ({describe_counts(bad_counts[w])})"
            )


def prepare_batches(
    reference: object,
    current: object,
    *,
    feature_names: Sequence[str] | None = None,
    one_hot: bool = False,
    nan_policy: str = "raise",
    categorical: bool = False,
) -> Batches:
    """Validate and align the two batches.

    Parameters
    ----------
    reference, current : DataFrame, numpy.ndarray or torch.Tensor
        Shapes ``(n_reference, d)`` and ``(n_current, d)``. DataFrames are matched by
        column name; arrays and tensors by position.
    feature_names : list of str, optional
        ``d`` display names; default: the DataFrame columns, else ``"x0"``, ``"x1"``, ...
    one_hot : bool
        One-hot encode non-numeric columns (``"column=value"`` indicator columns over the
        categories of both batches) instead of refusing them.
    nan_policy : {"raise", "impute"}
        What to do with NaN/inf values: refuse them (default), or replace them with the
        reference column's median.
    categorical : bool
        Keep non-numeric columns as categories: each value becomes its index among the
        sorted categories of both batches (``Batches.categories``), for a model that takes
        the strings itself (a pipeline with a ``OneHotEncoder``). ``one_hot`` wins.

    Returns
    -------
    Batches

    Raises
    ------
    TypeError, ValueError
        One sentence naming the problem: mismatched columns (listed), non-numeric
        columns (named), NaN/inf values (counted per column), fewer than two rows.
    """
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {NAN_POLICIES}; got {nan_policy!r}.")
    f = _frames(reference, current)
    bad = {**non_numeric(f.ref), **non_numeric(f.cur)}
    categories: dict[str, list[object]] = {}
    if bad and categorical and not one_hot and f.frame_columns is not None:
        categories = _as_categories(f, bad)
        f.named = True
    elif bad:
        _one_hot(f, bad, one_hot)
    names = _names(f, feature_names)
    xr, xc = _matrices(f)
    _nonfinite(xr, xc, names, nan_policy, f.notes)
    for which, arr in (("reference", xr), ("current", xc)):
        if arr.shape[0] < FEW_ROWS:
            warnings.warn(
                f"the {which} batch has only {arr.shape[0]} rows: with fewer than {FEW_ROWS} the "
                "drift tests have little power (a 'no drift' answer means little).",
                UserWarning,
                stacklevel=3,
            )
    return Batches(xr, xc, names, f.notes, f.frame_columns, categories)
