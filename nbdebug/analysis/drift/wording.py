"""The words of a :class:`~nbdebug.analysis.drift.report.DriftReport`: its headline (one
sentence: what changed, and whether the model's predictions move with it) and its details
(one paragraph)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .exposure import EXPOSURE_MIN

if TYPE_CHECKING:  # pragma: no cover
    from .report import DriftReport


def _names(items: list[str], limit: int = 5) -> str:
    shown = [f"`{s}`" for s in items[:limit]]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(shown) + more


def headline(feats: pd.DataFrame, *, alarm: bool, shift: float, unit: str) -> str:
    """One sentence: what changed, and whether the model's predictions move with it."""
    d = len(feats)
    inp = [str(f) for f in feats.index[feats["drifted_input"]]]
    acted = [str(f) for f in feats.index[feats["quadrant"] == "input+explanation"]]
    ignored = [str(f) for f in feats.index[feats["quadrant"] == "input only"]]
    via = [str(f) for f in feats.index[feats["quadrant"] == "explanation only"]]
    share = float(feats.loc[acted + via, "exposure_share"].sum()) if acted or via else 0.0
    moved = f"the mean prediction moved by {shift:+.3g} ({unit})"
    if not inp and not via:
        if alarm:
            return (
                f"No single input drifted, but the batches differ jointly (see the cluster and "
                f"classifier tests); {moved}."
            )
        return (
            "Nothing drifted: no input changed distribution and the model's explanations "
            f"did not move ({moved})."
        )
    head = f"{len(inp)} of {d} inputs drifted" + (f" ({_names(inp, 3)})" if inp else "")
    if acted:
        parts = [f"the model acts on {_names(acted, 3)}"]
        if via:
            parts.append(f"and, through them, on {_names(via, 2)}")
        parts.append(f"({share:.0%} of the prediction shift)")
        tail = " ".join(parts)
        if ignored:
            tail += f" but not on {_names(ignored, 3)}"
        return f"{head}: {tail}; {moved}."
    if via:
        return (
            f"{head}; the model's use of {_names(via, 3)} changed ({share:.0%} of the prediction "
            f"shift) although those inputs did not drift; {moved}."
        )
    them = "it" if len(inp) == 1 else "them"
    return f"{head}, but the model's predictions do not move with {them} ({moved})."


def details(r: DriftReport) -> str:
    """One paragraph in words: the headline, the alarm, the quadrants, the clusters, the
    classifier test and how the tests were run."""
    feats = r.features
    only_inp = [str(f) for f in feats.index[feats["quadrant"] == "input only"]]
    only_exp = [str(f) for f in feats.index[feats["quadrant"] == "explanation only"]]
    s = [r.headline]
    s.append(
        f"Drift alarm at alpha={r.alpha:g}." if r.alarm else f"No drift alarm at alpha={r.alpha:g}."
    )
    if only_inp:
        s.append(f"Input drift the model does not act on: {_names(only_inp)}.")
    if only_exp:
        s.append(
            f"Explanation drift without input drift (the model uses these differently, through "
            f"other features that moved): {_names(only_exp)}."
        )
    s.append(_clusters_sentence(r))
    s.append(_classifier_sentence(r))
    s.append(_method_sentence(r))
    if r.notes:
        s.append("Notes: " + "; ".join(r.notes) + ".")
    return " ".join(s)


def _clusters_sentence(r: DriftReport) -> str:
    ctest, clusters = r.cluster_test, r.clusters
    if ctest.k < 2:
        return "In SHAP space all rows are alike: a single cluster, no share to compare."
    top = clusters.iloc[int(np.argmax(clusters["change"].to_numpy()))]
    moved = ctest.p_adjusted <= r.alpha
    return (
        f"In SHAP space the rows form {ctest.k} clusters ({ctest.method}); their shares "
        + ("changed" if moved else "did not change significantly")
        + f" (permutation p={ctest.p_value:.3g}, corrected {ctest.p_adjusted:.3g})"
        + (
            f": {top['name']} (purity {top['purity']:.0%}) grew from "
            f"{top['group_share_reference']:.0%} of the reference to "
            f"{top['group_share_current']:.0%} of the current batch."
            if moved
            else "."
        )
    )


def _classifier_sentence(r: DriftReport) -> str:
    clf = r.classifier
    if not math.isfinite(clf.auc):
        return "The classifier test did not run: fewer than 4 explained rows in a batch."
    sep = "separates" if clf.p_adjusted <= r.alpha else "does not separate"
    return (
        f"A classifier {sep} the two batches' SHAP values (held-out AUC {clf.auc:.2f}, "
        f"p={clf.p_value:.3g})."
    )


def _method_sentence(r: DriftReport) -> str:
    sampled = (
        f"SHAP on a stratified subsample of {len(r.reference_rows)} + {len(r.current_rows)} "
        f"rows (CDF error <= {r.sampling_error:.2f} at 95%, DKW)"
        if r.sampling_error > 0
        else "SHAP on every row"
    )
    return (
        f"Tests: four families (a KS test per input column, a KS test per SHAP column, the "
        f"permutation test of cluster shares, the classifier test), weighted Holm across "
        f"families, {r.correction} within the drifted ones; exposure is "
        f"material from "
        f"{EXPOSURE_MIN:.0%} of the output's spread. SHAP: {r.explainer} on {r.output}; "
        f"{r.n_reference} reference vs {r.n_current} current rows; {sampled}."
    )
