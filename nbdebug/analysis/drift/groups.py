"""Name the clusters of SHAP space by what defines them, so a share that grew reads as a
finding ("predicted class 0 grew from 37% to 64%", "rows with `worst radius` > 1.2 grew").

A cluster is named

* by the model's predicted class, when at least :data:`CLASS_PURITY` of its rows have that
  class and no other cluster is that class too (the cluster *is* the class);
* otherwise by a rule on the inputs: a depth-2 decision tree (scikit-learn, as shap's
  cohorts do) is fitted on the inputs to tell the cluster's rows from the others, and the
  leaf holding most of the cluster's rows gives the rule. Two clusters whose rules read
  alike get their cluster number added, so no two clusters share a name.

Each name comes with its purity (the share of the cluster's rows that match the
description) and its coverage (the share of the rows matching the description that lie in
the cluster). The shares of
the description in each batch are counted over *all* rows of the batches (the rule and the
prediction are cheap), not only over the explained ones.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # pragma: no cover
    from sklearn.tree import DecisionTreeClassifier

CLASS_PURITY = 0.9
RULE_DEPTH = 2


@dataclass
class Group:
    description: str
    kind: str  # "class" | "rule"
    purity: float
    coverage: float
    share_reference: float
    share_current: float


@dataclass(frozen=True)
class PredictedClasses:
    """The model's predicted class of the explained rows (``explained``, in the order of
    the cluster labels) and of every row of each batch (``reference``, ``current``)."""

    explained: np.ndarray
    reference: np.ndarray
    current: np.ndarray


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _condition(name: str, side: str, threshold: float, cats: list[object] | None) -> str:
    if cats is None:
        return f"`{name}` {side} {_fmt(threshold)}"
    # a split on category codes: the categories on this side of it
    keep = [c for i, c in enumerate(cats) if (i <= threshold) == (side == "<=")]
    return f"`{name}` = {keep[0]!r}" if len(keep) == 1 else f"`{name}` in {set(keep)!r}"


def _rule(
    tree: DecisionTreeClassifier, leaf: int, names: list[str], categories: dict[int, list[object]]
) -> str:
    t = tree.tree_
    parent = {}
    for node in range(t.node_count):
        for child, side in ((t.children_left[node], "<="), (t.children_right[node], ">")):
            if child != -1:
                parent[int(child)] = (node, side)
    parts = []
    node = leaf
    while node in parent:
        p, side = parent[node]
        j = int(t.feature[p])
        parts.append(_condition(names[j], side, float(t.threshold[p]), categories.get(j)))
        node = p
    return " and ".join(reversed(parts)) or "all rows"


def name_groups(
    labels: np.ndarray,
    x: np.ndarray,
    names: list[str],
    xr_all: np.ndarray,
    xc_all: np.ndarray,
    *,
    classes: PredictedClasses | None = None,
    categories: dict[int, list[object]] | None = None,
    random_state: int = 0,
) -> list[Group]:
    """One :class:`Group` per cluster ``0..k-1``.

    Parameters
    ----------
    labels : numpy.ndarray
        int64 ``(m,)``: cluster of each explained row.
    x : numpy.ndarray
        float64 ``(m, d)``: the inputs of those rows.
    xr_all, xc_all : numpy.ndarray
        All rows of the two batches, ``(n_reference, d)``, ``(n_current, d)``.
    classes : PredictedClasses, optional
        Predicted class of the explained rows and of all rows of each batch (classifiers).
    categories : dict of int to list, optional
        Columns of ``x`` holding category codes -> the categories: a rule on such a
        column names the categories (```city` = 'nice'``), not a threshold on codes.
    """
    k = int(labels.max()) + 1 if len(labels) else 0
    pure = _pure_classes(labels, k, classes.explained) if classes is not None else {}
    out: list[Group] = []
    for c in range(k):
        members = labels == c
        if c in pure and classes is not None:
            out.append(_class_group(members, *pure[c], classes))
        elif members.all() or not members.any():
            out.append(Group("all rows", "rule", 1.0, 1.0, 1.0, 1.0))
        else:
            rule = _RuleInputs(x, names, xr_all, xc_all, categories or {}, random_state)
            out.append(_rule_group(members, rule))
    return _distinct(out)


def _class_group(
    members: np.ndarray, cls: Hashable, purity: float, classes: PredictedClasses
) -> Group:
    """The group of a cluster that *is* a predicted class."""
    in_class = classes.explained == cls
    return Group(
        f"predicted class {cls.item() if isinstance(cls, np.generic) else cls!r}",
        "class",
        float(purity),
        float((members & in_class).sum() / max(in_class.sum(), 1)),
        float(np.mean(classes.reference == cls)),
        float(np.mean(classes.current == cls)),
    )


@dataclass(frozen=True)
class _RuleInputs:
    x: np.ndarray  # the explained rows' inputs
    names: list[str]
    xr_all: np.ndarray
    xc_all: np.ndarray
    categories: dict[int, list[object]]
    random_state: int


def _rule_group(members: np.ndarray, r: _RuleInputs) -> Group:
    """The group of a cluster named by the rule of a depth-2 tree's best leaf."""
    from sklearn.tree import DecisionTreeClassifier

    tree = DecisionTreeClassifier(
        max_depth=RULE_DEPTH,
        min_samples_leaf=max(2, len(members) // 20),
        random_state=r.random_state,
    ).fit(r.x, members)
    leaves = tree.apply(r.x)
    best, best_key = -1, (-1.0, -1.0)
    for leaf in np.unique(leaves):
        in_leaf = leaves == leaf
        hit = float((in_leaf & members).sum())
        purity = hit / in_leaf.sum()
        key = (float(purity >= 0.5), hit)  # a majority leaf first, then the most members
        if key > best_key:
            best, best_key = int(leaf), key
    in_leaf = leaves == best
    hit = float((in_leaf & members).sum())
    return Group(
        "rows with " + _rule(tree, best, r.names, r.categories),
        "rule",
        hit / members.sum(),
        hit / in_leaf.sum(),
        float(np.mean(tree.apply(r.xr_all) == best)),
        float(np.mean(tree.apply(r.xc_all) == best)),
    )


def _pure_classes(
    labels: np.ndarray, k: int, classes: np.ndarray | None
) -> dict[int, tuple[Hashable, float]]:
    """Cluster -> (its class, purity) for the clusters that *are* a class: at least
    :data:`CLASS_PURITY` of their rows have it, and no other cluster is that class too (two
    clusters of one class are told apart by a rule, not given one name)."""
    if classes is None:
        return {}
    found: dict[int, tuple[Hashable, float]] = {}
    for c in range(k):
        vals, counts = np.unique(classes[labels == c], return_counts=True)
        if not len(vals):
            continue
        top = int(np.argmax(counts))
        purity = counts[top] / counts.sum()
        if purity >= CLASS_PURITY:
            found[c] = (vals[top], float(purity))
    taken = [cls for cls, _ in found.values()]
    return {c: v for c, v in found.items() if taken.count(v[0]) == 1}


def _distinct(groups: list[Group]) -> list[Group]:
    """Two clusters whose rules read alike get their cluster number added to the name."""
    names = [g.description for g in groups]
    for c, g in enumerate(groups):
        if names.count(g.description) > 1:
            g.description = f"{g.description} (cluster {c})"
    return groups


def groups_frame(groups: list[Group]) -> pd.DataFrame:
    """Columns ``name``, ``purity``, ``coverage``, ``group_share_reference``,
    ``group_share_current`` (index: cluster)."""
    return pd.DataFrame(
        {
            "name": [g.description for g in groups],
            "purity": [g.purity for g in groups],
            "coverage": [g.coverage for g in groups],
            "group_share_reference": [g.share_reference for g in groups],
            "group_share_current": [g.share_current for g in groups],
        },
        index=pd.Index(range(len(groups)), name="cluster"),
    )
