"""Turn the two batches of :func:`nbdebug.drift` into aligned float matrices.

Everything the user passes is read, never written: DataFrames, arrays and tensors are
copied into new ``float64`` arrays. Every problem is reported in one sentence that names
what was expected and what was given (columns, counts, dtypes), before any explainer or
statistical test sees the data.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

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
        (:func:`model_frame` turns them back into the values for the model).
    """

    reference: np.ndarray
    current: np.ndarray
    feature_names: list[str]
    notes: list[str] = field(default_factory=list)
    frame_columns: list[str] | None = None
    categories: dict[str, list[Any]] = field(default_factory=dict)


def model_frame(
    x: np.ndarray, columns: list[str], categories: dict[str, list[Any]] | None = None
) -> pd.DataFrame:
    """The float matrix ``x (n, d)`` as the DataFrame a model fitted on a frame expects:
    named ``columns``, category codes turned back into their values (strings)."""
    df = pd.DataFrame(x, columns=columns)
    for col, cats in (categories or {}).items():
        codes = np.clip(np.rint(df[col].to_numpy()), 0, len(cats) - 1).astype(np.int64)
        df[col] = np.asarray(cats, dtype=object)[codes]
    return df


def _kind(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}".replace("builtins.", "")


def _to_frame(x: Any, which: str) -> tuple[pd.DataFrame, bool]:
    """A DataFrame view of one batch (no copy of the user's object is written to) and
    whether it came with its own column names."""
    if isinstance(x, pd.DataFrame):
        return x, True
    if isinstance(x, pd.Series):
        raise TypeError(
            f"the {which} batch must be 2-D (rows x features): a DataFrame, a 2-D array or a 2-D "
            f"tensor; got a pandas Series of length {len(x)} (use series.to_frame() "
            f"for one feature)."
        )
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(x, torch.Tensor):
        if x.ndim != 2:
            raise ValueError(
                f"the {which} batch must be 2-D (rows x features); got a tensor of "
                f"shape {tuple(x.shape)}."
            )
        if x.is_complex():
            raise TypeError(f"the {which} batch must hold real numbers; got a {x.dtype} tensor.")
        arr = x.detach().to(device="cpu", dtype=torch.float64).numpy()
        return pd.DataFrame(arr), False
    if isinstance(x, (np.ndarray, list, tuple)):
        arr = np.asarray(x, dtype=object) if isinstance(x, (list, tuple)) else x
        if arr.ndim != 2:
            raise ValueError(
                f"the {which} batch must be 2-D (rows x features); got an array of "
                f"shape {arr.shape}."
            )
        return pd.DataFrame(arr), False
    raise TypeError(
        f"the {which} batch must be a pandas DataFrame, a 2-D numpy array or a 2-D torch tensor; "
        f"got {_kind(x)}."
    )


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


def _non_numeric(df: pd.DataFrame) -> dict[str, str]:
    """Column name -> dtype, for columns that are not real numbers or booleans."""
    bad: dict[str, str] = {}
    for col in df.columns:
        s = df[col]
        if pd.api.types.is_bool_dtype(s) or (
            pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_complex_dtype(s)
        ):
            continue
        if s.dtype == object:
            conv = pd.to_numeric(s, errors="coerce")
            # numbers stored as objects (e.g. an object ndarray) are fine; strings are not
            if conv.notna().sum() == s.notna().sum():
                continue
        bad[str(col)] = str(s.dtype)
    return bad


def nonfinite_counts(arr: np.ndarray, names: list[str]) -> dict[str, int]:
    """NaN/inf per column of a 2-D float array, for the columns that hold any."""
    counts = (~np.isfinite(arr)).sum(axis=0)
    return {names[j]: int(c) for j, c in enumerate(counts) if c}


def describe_counts(counts: dict[str, int], limit: int = 8) -> str:
    """``"x2: 2, x5: 1"``: the counts of :func:`nonfinite_counts`, the first ``limit``."""
    items = [f"{k}: {v}" for k, v in list(counts.items())[:limit]]
    more = f", and {len(counts) - limit} more columns" if len(counts) > limit else ""
    return ", ".join(items) + more


def prepare_batches(
    reference: Any,
    current: Any,
    *,
    feature_names: list[str] | None = None,
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
    ref, ref_named = _to_frame(reference, "reference")
    cur, cur_named = _to_frame(current, "current")
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
        # positional match: the DataFrame side (if any) gives the names
        cols = ref.columns if ref_named else cur.columns
        ref = ref.set_axis(cols, axis=1)
        cur = cur.set_axis(cols, axis=1)

    bad = {**_non_numeric(ref), **_non_numeric(cur)}
    categories: dict[str, list[Any]] = {}
    if bad and categorical and not one_hot and frame_columns is not None:
        ref, cur = ref.copy(), cur.copy()
        for col in bad:
            both = pd.concat([ref[col], cur[col]], ignore_index=True)
            missing = int(both.isna().sum())
            if missing:
                raise ValueError(
                    f"the categorical column {col!r} has {missing} missing value(s); fill them "
                    f"with a category of their own first."
                )
            cats = sorted(pd.unique(both), key=str)
            lookup = {v: i for i, v in enumerate(cats)}
            ref[col] = ref[col].map(lookup).astype(np.float64)
            cur[col] = cur[col].map(lookup).astype(np.float64)
            categories[str(col)] = list(cats)
        notes.append(
            f"{len(bad)} non-numeric column(s) kept as categories for the model "
            f"(chi-square tests on their counts): {', '.join(bad)}"
        )
        bad = {}
    if bad:
        if not one_hot:
            listed = ", ".join(f"{k!r} ({v})" for k, v in bad.items())
            raise ValueError(
                f"non-numeric columns: {listed}; encode them first, or pass one_hot=True to "
                "one-hot encode them over the categories of both batches."
            )
        both = pd.concat([ref, cur], axis=0, ignore_index=True)
        both.columns = [str(c) for c in both.columns]
        enc = pd.get_dummies(both, columns=list(bad), prefix_sep="=", dtype=float)
        ref, cur = enc.iloc[: len(ref)], enc.iloc[len(ref) :]
        notes.append(f"one-hot encoded {len(bad)} non-numeric column(s): {', '.join(bad)}")
        frame_columns = [str(c) for c in ref.columns]

    names = (
        [str(c) for c in ref.columns]
        if (ref_named or cur_named or bad or categories)
        else [f"x{j}" for j in range(ref.shape[1])]
    )
    if feature_names is not None:
        names_given = [str(n) for n in feature_names]
        if len(names_given) != ref.shape[1]:
            raise ValueError(
                f"feature_names has {len(names_given)} names but the batches have "
                f"{ref.shape[1]} columns."
            )
        names = names_given
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"feature names must be unique; duplicated: {dup}.")

    try:
        xr = ref.to_numpy(dtype=np.float64, na_value=np.nan, copy=True)
        xc = cur.to_numpy(dtype=np.float64, na_value=np.nan, copy=True)
    except (TypeError, ValueError) as e:  # e.g. a column of mixed objects
        raise ValueError(f"the batches could not be read as real numbers: {e}.") from e

    for which, arr in (("reference", xr), ("current", xc)):
        if arr.shape[0] < MIN_ROWS:
            raise ValueError(
                f"the {which} batch has {arr.shape[0]} row(s); at least {MIN_ROWS} are needed "
                f"(and {FEW_ROWS} or more for tests with any power)."
            )
    bad_counts = {w: nonfinite_counts(a, names) for w, a in (("reference", xr), ("current", xc))}
    if any(bad_counts.values()):
        if nan_policy == "raise":
            parts = [
                f"{w} has {sum(c.values())} ({describe_counts(c)})"
                for w, c in bad_counts.items()
                if c
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
                    f"the reference "
                    f"median ({describe_counts(bad_counts[w])})"
                )

    for which, arr in (("reference", xr), ("current", xc)):
        if arr.shape[0] < FEW_ROWS:
            warnings.warn(
                f"the {which} batch has only {arr.shape[0]} rows: with fewer than {FEW_ROWS} the "
                "drift tests have little power (a 'no drift' answer means little).",
                UserWarning,
                stacklevel=3,
            )
    return Batches(xr, xc, names, notes, frame_columns, categories)
