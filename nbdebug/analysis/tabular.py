"""Tabular inputs as both features read them: the shared preparation of drift and labels.

Everything the user passes is read, never written: arrays, tensors and DataFrames are
converted into new numpy arrays or DataFrame views. Every problem is reported in one
sentence that names what was expected and what was given (columns, counts, dtypes).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import pandas as pd


def loaded_torch() -> ModuleType | None:
    """The torch module if it is already imported (a tensor cannot exist otherwise)."""
    return sys.modules.get("torch")


def type_name(x: object) -> str:
    """``module.QualName`` of ``x``'s type, builtins without their module."""
    return f"{type(x).__module__}.{type(x).__qualname__}".replace("builtins.", "")


def describe_input(x: object) -> str:
    """``"ndarray of shape (3, 2)"``, or the type's name for objects without a shape."""
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"{type(x).__qualname__} of shape {tuple(shape)}"
    return type(x).__qualname__


def to_numpy(x: object) -> np.ndarray:
    """A numpy view or copy of an array, tensor, pandas object or sequence."""
    torch = loaded_torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, (pd.Series, pd.DataFrame)):
        return x.to_numpy()
    return np.asarray(x)


def nonfinite_counts(arr: np.ndarray, names: Sequence[str]) -> dict[str, int]:
    """NaN/inf per column of a 2-D float array, for the columns that hold any."""
    counts = (~np.isfinite(arr)).sum(axis=0)
    return {names[j]: int(c) for j, c in enumerate(counts) if c}


def describe_counts(counts: dict[str, int], limit: int = 8) -> str:
    """``"x2: 2, x5: 1"``: the counts of :func:`nonfinite_counts`, the first ``limit``."""
    items = [f"{k}: {v}" for k, v in list(counts.items())[:limit]]
    more = f", and {len(counts) - limit} more columns" if len(counts) > limit else ""
    return ", ".join(items) + more


def model_frame(
    x: np.ndarray, columns: Sequence[str], categories: dict[str, list[object]] | None = None
) -> pd.DataFrame:
    """The float matrix ``x (n, d)`` as the DataFrame a model fitted on a frame expects:
    named ``columns``, category codes turned back into their values (strings)."""
    df = pd.DataFrame(x, columns=list(columns))
    for col, cats in (categories or {}).items():
        codes = np.clip(np.rint(df[col].to_numpy()), 0, len(cats) - 1).astype(np.int64)
        df[col] = np.asarray(cats, dtype=object)[codes]
    return df


def read_table(x: object, which: str) -> tuple[pd.DataFrame, bool]:
    """A DataFrame view of one 2-D table (the user's object is never written to) and
    whether it came with its own column names.

    ``x``: a DataFrame, a 2-D numpy array, list or tuple, or a 2-D real torch tensor;
    ``which`` names it in the error messages (``"reference"``).
    """
    if isinstance(x, pd.DataFrame):
        return x, True
    if isinstance(x, pd.Series):
        raise TypeError(
            f"the {which} batch must be 2-D (rows x features): a DataFrame, a 2-D array or a 2-D "
            f"tensor; got a pandas Series of length {len(x)} (use series.to_frame() "
            f"for one feature)."
        )
    torch = loaded_torch()
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
        f"got {type_name(x)}."
    )


def non_numeric(df: pd.DataFrame) -> dict[str, str]:
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
