"""A scikit-learn ``Pipeline`` explained by the exact explainer of its final estimator.

The steps before the final estimator (scalers, imputers, ``OneHotEncoder``, a
``ColumnTransformer`` of those) turn the ``d`` input columns into ``d_z`` transformed
columns; the final tree or linear model is explained there with shap's exact explainer,
and each transformed column's SHAP value is added to the input column it came from (the
one-hot columns of a category add up to that column's value).

Which input a transformed column comes from is read from the names scikit-learn gives
the columns (``get_feature_names_out``): a transformed column named like an input (a
scaler) or ``input_<something>`` (a one-hot or binned column) comes from that input. A
step whose columns mix inputs (``PCA``, ``PolynomialFeatures``, a custom transformer
without names) cannot be mapped back; the pipeline is then explained as a whole by the
kernel explainer and a note says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..tabular import model_frame

_SENTINEL = "nbdbg{}x"


@dataclass
class PipelinePlan:
    """How to explain a pipeline: its final estimator on the transformed columns.

    ``columns[i]`` is the input column that transformed column ``i`` comes from.
    """

    final: object
    transform: Callable[[np.ndarray], np.ndarray]  # (n, d) float64 -> (n, d_z) float64
    columns: np.ndarray  # int64 (d_z,)
    n_inputs: int

    def to_inputs(self, values: np.ndarray) -> np.ndarray:
        """Sum ``(n, d_z[, k])`` SHAP values into ``(n, d[, k])`` per input column."""
        out = np.zeros((values.shape[0], self.n_inputs, *values.shape[2:]), dtype=np.float64)
        np.add.at(out, (slice(None), self.columns), values)  # type: ignore[arg-type]
        return out


def _out_names(est: object, in_names: list[str]) -> list[str] | None:
    names_out = getattr(est, "get_feature_names_out", None)
    if names_out is None:
        return None
    for args in ((in_names,), ()):
        try:
            return [str(n) for n in names_out(*args)]
        except Exception:  # unfitted names, no names: try the next way
            continue
    return None


def _match(out_names: list[str], in_names: list[str]) -> list[int] | None:
    idx = []
    for o in out_names:
        hits = [i for i, n in enumerate(in_names) if o == n or o.startswith(n + "_")]
        if not hits:
            return None
        idx.append(max(hits, key=lambda i: len(in_names[i])))
    return idx


def _positions(cols: object, in_names: list[str], names_in: list[str] | None) -> list[int] | None:
    n = len(in_names)
    if isinstance(cols, slice):
        return list(range(n))[cols]
    if callable(cols):
        return None
    if isinstance(cols, (str, int, np.integer)):
        items: list[object] = [cols]
    elif isinstance(cols, Iterable):
        items = list(cols)
    else:
        return None
    if not items:
        return []
    if all(isinstance(c, (bool, np.bool_)) for c in items):
        return [i for i, c in enumerate(items) if c]
    if all(isinstance(c, (int, np.integer)) for c in items):
        return [int(c) for c in items if isinstance(c, (int, np.integer))]
    if names_in is not None and all(isinstance(c, str) for c in items):
        strs = [str(c) for c in items]
        return [names_in.index(c) for c in strs] if all(c in names_in for c in strs) else None
    return None


def input_map(est: object, in_names: list[str]) -> tuple[list[int], list[str]] | None:
    """For a fitted transformer: the input index of each output column and the output
    names; None when some output column mixes inputs or has no readable name."""
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import Pipeline

    if est is None or (isinstance(est, str) and est == "passthrough"):
        return list(range(len(in_names))), list(in_names)
    if isinstance(est, Pipeline):
        idx, names = list(range(len(in_names))), list(in_names)
        for _, step in est.steps:
            got = input_map(step, names)
            if got is None:
                return None
            idx, names = [idx[i] for i in got[0]], got[1]
        return idx, names
    if isinstance(est, ColumnTransformer):
        names_in = [str(c) for c in getattr(est, "feature_names_in_", [])] or None
        n_out = sum(s.stop - s.start for s in est.output_indices_.values())
        idx_out: list[int | None] = [None] * n_out
        names_out = [""] * n_out
        for name, trans, cols in est.transformers_:
            out = est.output_indices_[name]
            if out.stop == out.start or (isinstance(trans, str) and trans == "drop"):
                continue
            pos = _positions(cols, in_names, names_in)
            if pos is None:
                return None
            got = input_map(trans, [in_names[p] for p in pos])
            if got is None or len(got[0]) != out.stop - out.start:
                return None
            for i, (k, nm) in enumerate(zip(*got)):
                idx_out[out.start + i] = pos[k]
                names_out[out.start + i] = f"{name}__{nm}"
        if any(i is None for i in idx_out):
            return None
        return [int(i) for i in idx_out if i is not None], names_out
    out_names = _out_names(est, in_names)
    if out_names is None:
        return None
    matched = _match(out_names, in_names)
    return None if matched is None else (matched, out_names)


def takes_strings(model: object) -> bool:
    """Whether ``model`` is a ``Pipeline`` fitted on a DataFrame: its own steps (a
    ``ColumnTransformer`` with a ``OneHotEncoder``) turn string columns into numbers, so
    drift passes the strings through rather than refusing them."""
    from sklearn.pipeline import Pipeline

    return isinstance(model, Pipeline) and getattr(model, "feature_names_in_", None) is not None


def plan_pipeline(
    model: object, n_features: int, categories: dict[str, list[object]] | None = None
) -> tuple[PipelinePlan | None, str]:
    """A plan for a fitted ``Pipeline``, or ``(None, why not)``. ``categories``: columns
    whose float codes stand for string categories
    (:func:`~nbdebug.analysis.tabular.model_frame`)."""
    from sklearn.pipeline import Pipeline

    if not isinstance(model, Pipeline) or len(model.steps) < 2:
        return None, "not a pipeline"
    names_in = [str(c) for c in getattr(model, "feature_names_in_", [])] or None
    in_names = names_in or [_SENTINEL.format(j) for j in range(n_features)]
    pre = model[:-1]
    got = input_map(pre, in_names)
    if got is None:
        return None, (
            "a step of the pipeline mixes input columns (its output columns cannot be mapped "
            "back to the inputs)"
        )

    def transform(x: np.ndarray) -> np.ndarray:
        frame = model_frame(x, names_in, categories) if names_in is not None else x
        z = pre.transform(frame)
        if hasattr(z, "toarray"):
            z = z.toarray()
        return np.asarray(z, dtype=np.float64)

    return PipelinePlan(model[-1], transform, np.array(got[0], dtype=np.int64), n_features), ""
