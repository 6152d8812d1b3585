"""Calibration of the multivariate drift tests (issue 18, item 2), on generated data with
fixed seeds: under no drift each test rejects at or below its level.

The full table (200 no-drift runs for each of four model types) is in
``benchmarks/bench_drift.py calibration``. Here: 300 runs of the classifier test and 150 of
the cluster-share test on exchangeable rows; the bound is the level plus three binomial
standard errors, so a calibrated test fails it with probability about 0.001 (fixed seeds:
the outcome is the same on every run).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from nbdebug.analysis.drift.classifier import classifier_test
from nbdebug.analysis.drift.clustering import cluster_shap, most_shifted_clustering
from nbdebug.analysis.drift.statistics import FAMILY_WEIGHTS, hierarchical, holm_weighted


def _bound(level: float, runs: int) -> float:
    return level + 3 * math.sqrt(level * (1 - level) / runs)


def _split(n: int, seed: int) -> np.ndarray:
    is_cur = np.zeros(n, bool)
    is_cur[np.random.default_rng(seed).permutation(n)[: n // 2]] = True
    return is_cur


def test_classifier_test_keeps_its_level():
    runs = 300
    data = np.random.default_rng(0).standard_t(3, size=(120, 6))  # heavy tails, fixed rows
    p = np.array(
        [classifier_test(data, _split(120, s), random_state=s).p_value for s in range(runs)]
    )
    for level in (0.05, 0.1):
        assert (p <= level).mean() <= _bound(level, runs), (level, (p <= level).mean())
    assert (p <= 0.5).mean() <= _bound(0.5, runs)
    # and it has power: a shifted half is found
    shifted = data.copy()
    cur = _split(120, 1)
    shifted[cur, 0] += 1.5
    assert classifier_test(shifted, cur, random_state=1).p_value < 1e-3


def test_cluster_share_test_keeps_its_level_with_small_clusters():
    runs = 150
    rng = np.random.default_rng(1)
    # three blobs of unequal size: some clusters have expected counts below 5
    data = np.r_[rng.normal(0, 1, (70, 3)), rng.normal(5, 1, (14, 3)), rng.normal(-5, 1, (6, 3))]
    clustering = cluster_shap(data, max_k=5, random_state=0)
    ps = []
    for s in range(runs):
        _, _, p = most_shifted_clustering(clustering, _split(len(data), s), 199, s)
        ps.append(p)
    ps = np.array(ps)
    for level in (0.05, 0.1):
        assert (ps <= level).mean() <= _bound(level, runs), (level, (ps <= level).mean())
    cur = np.zeros(len(data), bool)
    cur[70:] = True  # the current batch is the two small blobs plus a few
    cur[:20] = True
    chosen, _, p = most_shifted_clustering(clustering, cur, 199, 0)
    assert p <= 0.01 and chosen.k >= 2


def test_weighted_holm_steps_down_and_keeps_its_level_under_any_dependence():
    w = np.array(list(FAMILY_WEIGHTS.values()))
    assert w.sum() == 1.0 and w[0] == w.max()  # the inputs family gets the largest share
    # by hand: p / w = 0.0025, 0.133, 3.33, 0.133; weights left 1, 0.6, 0.3, 0.15
    adj = holm_weighted(np.array([0.001, 0.04, 0.5, 0.02]), w)
    np.testing.assert_allclose(adj, [0.0025, 0.08, 0.5, 0.08])
    assert np.isnan(holm_weighted(np.array([0.01, np.nan]), np.array([0.5, 0.5]))[1])
    # null p-values with the worst dependences: two families identical (a linear model's
    # SHAP columns repeat its inputs), one the mirror image of them; alarm <= alpha
    rng = np.random.default_rng(0)
    runs = 5000
    u, v = rng.random(runs), rng.random(runs)
    alarms = 0
    for a, b in zip(u, v):
        fams = {
            "inputs": np.array([a]),
            "explanations": np.array([a]),
            "cluster shares": np.array([1 - a]),
            "classifier": np.array([b]),
        }
        alarms += bool(hierarchical(fams, "fdr", 0.05, FAMILY_WEIGHTS)[1]["drift"].any())
    assert alarms / runs <= _bound(0.05, runs), alarms / runs
    # a drifted family passes its share on: the second family is tested at 0.3 / 0.6 alpha
    adj2, table = hierarchical(
        {"inputs": np.array([1e-9, 0.5]), "explanations": np.array([0.02, 0.9])},
        "fdr",
        0.05,
        {"inputs": 0.4, "explanations": 0.3},
    )
    assert table["drift"].tolist() == [True, True]  # Simes 0.04 <= alpha * 0.3 / 0.3
    assert adj2["explanations"][0] == pytest.approx(0.04)  # BH 0.04, alpha at its full level
