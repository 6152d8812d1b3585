"""The batch rows joined with what other analyses found about the same samples: the
label-issue table of :func:`nbdebug.find_label_issues` (indexed by dataset index) and the
per-row results of a :class:`nbdebug.DriftReport` (the rows of its current data).

Both are joined on the rows' dataset indices (``ids``), or on the batch rows when there
are none (the table and the report were then computed on the batch itself)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["DRIFT_COLUMNS", "LABEL_COLUMNS", "drift_columns", "label_columns"]

#: the columns taken from the label-issue table, and their names in the blame table
LABEL_COLUMNS = {
    "is_issue": "label_issue",
    "given_label": "given_label",
    "suggested_label": "suggested_label",
    "label_quality": "label_quality",
}
#: the columns of the drift join
DRIFT_COLUMNS = ("drift_cluster", "drift_cluster_change", "drift_shap")
#: what a drift report must hold to be joined
_DRIFT_ATTRS = ("current_rows", "current_shap", "reference_shap", "labels", "clusters")


def label_columns(labels: object, keys: Sequence[int]) -> pd.DataFrame:
    """The label-issue columns of the samples ``keys`` (``<NA>`` for a sample the table
    does not hold), one row per batch row.

    Raises
    ------
    TypeError
        ``labels`` is not a DataFrame.
    ValueError
        It has none of the columns of :data:`LABEL_COLUMNS`, or a repeated index.
    """
    import pandas as pd

    if not isinstance(labels, pd.DataFrame):
        raise TypeError(
            "labels must be the table of nbdebug.find_label_issues (a DataFrame indexed by "
            f"dataset index); got {type(labels).__qualname__}."
        )
    cols = [c for c in LABEL_COLUMNS if c in labels.columns]
    if not cols:
        raise ValueError(
            f"labels must hold the columns of nbdebug.find_label_issues ({', '.join(LABEL_COLUMNS)}"
            f"); got the columns {list(labels.columns)}."
        )
    if not labels.index.is_unique:
        raise ValueError("labels must have one row per dataset index; its index repeats some.")
    table = pd.DataFrame(labels[cols]).rename(columns=LABEL_COLUMNS)
    if "label_issue" in table:
        table["label_issue"] = table["label_issue"].astype("boolean")
    out = table.reindex(list(keys))
    out.index = pd.RangeIndex(len(keys), name="row")
    return out


def drift_columns(drift: object, keys: Sequence[int]) -> pd.DataFrame:
    """Per batch row, what the drift report says about that row of its current data:
    ``drift_cluster`` (the name of its cluster in SHAP space), ``drift_cluster_change``
    (that cluster's current minus reference share) and ``drift_shap`` (the sum of its SHAP
    values over the features whose explanation drifted; 0 when none did); ``NaN`` for a
    row the report did not explain.

    Raises
    ------
    TypeError
        ``drift`` is not a drift report.
    """
    import pandas as pd

    if not all(hasattr(drift, a) for a in _DRIFT_ATTRS):
        raise TypeError(
            f"drift must be the DriftReport of nbdebug.drift; got {type(drift).__qualname__}."
        )
    rows = np.asarray(drift.current_rows, dtype=np.int64)  # type: ignore[attr-defined]
    shap = np.asarray(drift.current_shap, dtype=np.float64)  # type: ignore[attr-defined]
    offset = len(drift.reference_shap)  # type: ignore[attr-defined]
    clusters = drift.clusters  # type: ignore[attr-defined]
    labels = np.asarray(drift.labels)  # type: ignore[attr-defined]
    names = list(getattr(drift, "feature_names", []))
    drifted = [names.index(f) for f in getattr(drift, "drifted_explanations", []) if f in names]
    where = {int(r): j for j, r in enumerate(rows)}
    name, change, total = [], [], []
    for k in keys:
        j = where.get(int(k))
        c = int(labels[offset + j]) if j is not None else -1
        known = j is not None and c in clusters.index
        name.append(str(clusters.loc[c, "name"]) if known else None)
        change.append(float(clusters.loc[c, "change"]) if known else np.nan)
        total.append(np.nan if j is None else float(shap[j, drifted].sum()) if drifted else 0.0)
    return pd.DataFrame(
        dict(zip(DRIFT_COLUMNS, (name, change, total))),
        index=pd.RangeIndex(len(keys), name="row"),
    )
