"""find_label_issues: detection quality on digits with injected noise, the confident-learning
kernels against hand computations and properties, the torch adapter, bad inputs."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import nbdebug
from nbdebug.analysis.labels import LabelNoise, TorchClassifier, find_label_issues
from nbdebug.analysis.labels import confident_learning as cl

COLUMNS = [
    "given_label",
    "suggested_label",
    "suggested_prob",
    "label_quality",
    "self_confidence",
    "normalized_margin",
    "is_issue",
    "method",
    "top1",
    "top1_prob",
    "top2",
    "top2_prob",
    "top3",
    "top3_prob",
]


def flip(y: np.ndarray, rate: float, seed: int, k: int = 10) -> np.ndarray:
    rng = np.random.default_rng(seed)
    noisy = y.copy()
    idx = rng.choice(len(y), int(rate * len(y)), replace=False)
    noisy[idx] = (y[idx] + rng.integers(1, k, len(idx))) % k
    return noisy


def prf(flags: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    tp = int((flags & truth).sum())
    return tp / max(int(flags.sum()), 1), tp / int(truth.sum())


@pytest.fixture(scope="module")
def digits_oof():
    """Digits with 10% uniform flips (seed 0) and 5-fold out-of-fold probabilities of two
    fast models (LDA, k-NN)."""
    X, y = load_digits(return_X_y=True)
    noisy = flip(y, 0.10, seed=0)
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    knn = make_pipeline(StandardScaler(), KNeighborsClassifier(10))
    p_lda = cross_val_predict(
        LinearDiscriminantAnalysis(), X, noisy, cv=folds, method="predict_proba"
    )
    p_knn = cross_val_predict(knn, X, noisy, cv=folds, method="predict_proba")
    return X, y, noisy, p_lda, p_knn


def flags_of(df: pd.DataFrame) -> np.ndarray:
    return df.sort_index()["is_issue"].to_numpy()


# --------------------------------------------------------------------------- detection


def test_confident_learning_finds_injected_noise_on_digits(digits_oof):
    _, y, noisy, p_lda, _ = digits_oof
    truth = noisy != y
    df = find_label_issues(noisy, pred_probs=p_lda)
    precision, recall = prf(flags_of(df), truth)
    assert precision >= 0.75 and recall >= 0.9, (precision, recall)
    est = df.label_issues
    # 10% injected: the calibrated estimate is in the right range, and flagged == estimated
    assert 0.06 <= est.noise_rate <= 0.16
    assert est.n_flagged == int(df["is_issue"].sum())
    assert est.n_flagged <= est.n_estimated
    # the suggestion is the true label for most correctly flagged samples
    hit = df[df["is_issue"] & truth[df.index]]
    assert (hit["suggested_label"].to_numpy() == y[hit.index]).mean() >= 0.8


def test_prune_by_noise_rate_and_predicted_neq_given(digits_oof):
    _, y, noisy, p_lda, _ = digits_oof
    truth = noisy != y
    pbnr = find_label_issues(noisy, pred_probs=p_lda, prune="noise_rate")
    precision, recall = prf(flags_of(pbnr), truth)
    assert precision >= 0.75 and recall >= 0.85, (precision, recall)
    neq = find_label_issues(noisy, pred_probs=p_lda, method="predicted_neq_given")
    np.testing.assert_array_equal(flags_of(neq), p_lda.argmax(1) != noisy)
    assert set(neq.loc[neq["is_issue"], "method"]) == {"predicted_neq_given"}
    assert set(neq.loc[~neq["is_issue"], "method"]) == {""}


def test_ensemble_vote_is_precise_and_only_suggests_agreed_labels(digits_oof):
    _, y, noisy, p_lda, p_knn = digits_oof
    truth = noisy != y
    df = find_label_issues(noisy, pred_probs=[p_lda, p_knn], method="ensemble", tau=0.4)
    precision, recall = prf(flags_of(df), truth)
    assert precision >= 0.8 and recall >= 0.9, (precision, recall)
    s = df.sort_index()
    agreed = (p_lda.argmax(1) == p_knn.argmax(1)) & (p_lda.argmax(1) != noisy)
    conf = np.minimum(
        p_lda[np.arange(len(y)), p_lda.argmax(1)], p_knn[np.arange(len(y)), p_lda.argmax(1)]
    )
    proposes = agreed & (conf >= 0.4)
    np.testing.assert_array_equal(s["suggested_label"].to_numpy() >= 0, proposes)
    np.testing.assert_array_equal(
        s.loc[proposes, "suggested_label"].to_numpy(), p_lda.argmax(1)[proposes]
    )
    assert s.loc[~proposes, "suggested_prob"].isna().all()
    # every agreed correction is flagged
    assert s.loc[proposes, "is_issue"].all()
    # a stack (M, n, K) is the same as a list
    df2 = find_label_issues(noisy, pred_probs=np.stack([p_lda, p_knn]), method="ensemble", tau=0.4)
    pd.testing.assert_frame_equal(df, df2)


def test_frame_layout_ranking_and_accessor():
    P = np.array([[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.95, 0.03, 0.02]] * 5)
    y = np.array([0, 1, 2, 0] * 5)
    y[3] = 2  # p[2] = 0.02: a clear issue, suggested 0
    y[7] = 1  # p[1] = 0.03
    df = find_label_issues(y, pred_probs=P)
    assert list(df.columns) == COLUMNS
    assert df.index.name == "index"
    assert sorted(df.index) == list(range(20))
    # flagged first, each block ranked by label quality ascending
    flags = df["is_issue"].to_numpy()
    assert not (np.diff(flags.astype(int)) > 0).any()
    for block in (df[df["is_issue"]], df[~df["is_issue"]]):
        assert block["label_quality"].is_monotonic_increasing
    assert df.index[0] == 3 and df.loc[3, "suggested_label"] == 0
    assert df.loc[3, "self_confidence"] == pytest.approx(0.02)
    assert df.loc[3, "normalized_margin"] == pytest.approx((0.02 - 0.95 + 1) / 2)
    assert df.loc[3, "top1"] == 0 and df.loc[3, "top1_prob"] == pytest.approx(0.95)
    assert df.loc[3, "top2"] == 1 and df.loc[3, "top3"] == 2
    assert list(df.index[df["is_issue"]]) == [3, 7]
    est = df.attrs["label_noise"]
    assert isinstance(est, LabelNoise)
    assert df.label_issues.confident_joint is est.confident_joint
    assert est.confident_joint.shape == (3, 3)
    assert (
        f"{est.n_flagged} of 20" in est.summary()
        and f"estimates {est.n_estimated}" in est.summary()
    )
    assert "n_flagged=" in repr(est)
    # results concatenate (attrs compared by identity, no ambiguous array truth value)
    assert len(pd.concat([df, df])) == 40
    with pytest.raises(AttributeError, match="find_label_issues"):
        _ = pd.DataFrame({"a": [1]}).label_issues
    by_margin = find_label_issues(y, pred_probs=P, rank_by="normalized_margin")
    np.testing.assert_allclose(by_margin["label_quality"], by_margin["normalized_margin"])


def f1_of(labels: np.ndarray, P: np.ndarray, truth: np.ndarray, **kw) -> float:
    flags = flags_of(find_label_issues(labels, pred_probs=P, **kw))
    tp = int((flags & truth).sum())
    return 2 * tp / (int(flags.sum()) + int(truth.sum()))


ALTERNATIVES = (
    {"prune": "global"},
    {"prune": "noise_rate"},
    {"method": "predicted_neq_given"},
)


def test_default_is_at_least_as_good_as_the_alternatives_on_two_clear_cases():
    # Case 1, confidence on different scales. Class 0 is easy (the model gives its samples
    # 0.95), class 1 hard (0.6). Samples 40-43 are labelled 0 but look like a typical class 1
    # (p = 0.4, 0.6); samples 84-87 are labelled 1, truly 1, and the model leans to 0 without
    # confidence (p = 0.65, 0.35: far below class 0's threshold 0.9). The confident joint
    # counts only 40-43 as issues (p_1 = 0.6 reaches t_1 = 0.577): 4 estimated. Ranking by
    # raw self-confidence ("global") puts 0.35 below 0.4 and flags the four wrong ones; the
    # threshold-normalised margin gives 0.4/0.9 - 0.6/0.577 = -0.60 against
    # 0.35/0.577 - 0.65/0.9 = -0.12 and flags 40-43, as pruning by noise rate does (pair
    # (0, 1), largest p_1 - p_0). predicted_neq_given flags all 8 disagreements.
    P = np.array([[0.95, 0.05]] * 40 + [[0.4, 0.6]] * 44 + [[0.65, 0.35]] * 4)
    y = np.array([0] * 44 + [1] * 44)
    truth = np.zeros(88, dtype=bool)
    truth[40:44] = True
    f1 = {str(kw): f1_of(y, P, truth, **kw) for kw in ALTERNATIVES}
    assert f1_of(y, P, truth) == 1.0
    assert f1 == {
        "{'prune': 'global'}": 0.0,
        "{'prune': 'noise_rate'}": 1.0,
        "{'method': 'predicted_neq_given'}": pytest.approx(2 / 3),
    }
    # Case 2, a per-class budget too large for its class. Class 0 is hard: 8 of its 18
    # samples reach no threshold, so its one confident issue (sample 16, p_1 = 0.9) is
    # calibrated to 2 issues in class 0 (1 of its 9 assigned samples, scaled to its 18).
    # Pruning by noise rate spends both on class 0 and takes sample 17, a clean sample the
    # model barely leans away from (0.42 against 0.48). Sample 38, labelled 1 but p_2 = 0.75
    # (below class 2's threshold 0.95, so not in the confident joint), is the clearer issue:
    # threshold margin 0.2/0.867 - 0.75/0.95 = -0.56 against 0.42/0.604 - 0.48/0.867 = +0.14
    # for sample 17. The default keeps the estimated count (2) but takes 16 and 38, as the
    # global ranking by self-confidence does (0.05, 0.2 < 0.42).
    rows = [(0.8, 0.1, 0.1)] * 8 + [(0.5, 0.3, 0.2)] * 8 + [(0.05, 0.9, 0.05), (0.42, 0.48, 0.1)]
    rows += [(0.05, 0.9, 0.05)] * 20 + [(0.05, 0.2, 0.75)] + [(0.02, 0.03, 0.95)] * 20
    P = np.array(rows)
    y = np.array([0] * 18 + [1] * 21 + [2] * 20)
    truth = np.zeros(59, dtype=bool)
    truth[[16, 38]] = True
    assert find_label_issues(y, pred_probs=P).label_issues.n_estimated == 2
    f1 = {str(kw): f1_of(y, P, truth, **kw) for kw in ALTERNATIVES}
    assert f1_of(y, P, truth) == 1.0
    assert f1 == {
        "{'prune': 'global'}": 1.0,
        "{'prune': 'noise_rate'}": 0.5,
        "{'method': 'predicted_neq_given'}": pytest.approx(0.8),
    }


def test_threshold_margin_matches_a_hand_computation():
    P = np.array([[0.4, 0.6, 0.0], [0.65, 0.35, 0.0], [0.2, 0.3, 0.5]])
    y = np.array([0, 1, 1])
    t = np.array([0.9, 0.5, np.inf])  # class 2 without examples contributes 0
    np.testing.assert_allclose(
        cl.threshold_margin(P, y, t),
        [0.4 / 0.9 - 0.6 / 0.5, 0.35 / 0.5 - 0.65 / 0.9, 0.3 / 0.5 - 0.2 / 0.9],
    )
    np.testing.assert_array_equal(P[0], [0.4, 0.6, 0.0])  # the input is not written to


def test_public_name():
    assert nbdebug.find_label_issues is find_label_issues


# --------------------------------------------------------------------------- the kernels


def test_confident_joint_matches_a_hand_computation():
    P = np.array(
        [
            [0.8, 0.2, 0.0],  # label 0
            [0.6, 0.4, 0.0],  # label 0
            [0.1, 0.9, 0.0],  # label 0, confidently class 1
            [0.3, 0.7, 0.0],  # label 1
            [0.2, 0.5, 0.3],  # label 1
            [0.0, 0.1, 0.9],  # label 2
            [0.5, 0.0, 0.5],  # label 2
        ]
    )
    y = np.array([0, 0, 0, 1, 1, 2, 2])
    counts = cl.class_counts(y, 3)
    t = cl.per_class_thresholds(P, y, counts)
    np.testing.assert_allclose(t, [(0.8 + 0.6 + 0.1) / 3, (0.7 + 0.5) / 2, (0.9 + 0.5) / 2])
    assigned = cl.confident_assignment(P, t)
    # t = [0.5, 0.6, 0.7]: row 1 -> 0 (0.6 >= 0.5); row 4 -> none; row 6 -> 0 (0.5 >= 0.5, 0.5 <
    # 0.7)
    np.testing.assert_array_equal(assigned, [0, 0, 1, 1, -1, 2, 0])
    cj = cl.confident_joint(y, assigned, 3)
    np.testing.assert_array_equal(cj, [[2, 1, 0], [0, 1, 0], [1, 0, 1]])
    cal = cl.calibrate(cj, counts)
    np.testing.assert_allclose(cal.sum(axis=1), counts)
    np.testing.assert_allclose(cal[1], [0, 2, 0])
    np.testing.assert_allclose(cal[2], [1, 0, 1])


def test_prune_by_noise_rate_takes_the_largest_margins():
    # 6 samples labelled 0; two of them look like 1; calibrated says 2 issues (0 -> 1)
    P = np.array(
        [[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4], [0.3, 0.7], [0.1, 0.9]] + [[0.1, 0.9]] * 6
    )
    y = np.array([0] * 6 + [1] * 6)
    counts = cl.class_counts(y, 2)
    cal = np.array([[4.0, 2.0], [0.0, 6.0]])
    flagged = cl.prune_by_noise_rate(P, y, cal, counts)
    np.testing.assert_array_equal(np.flatnonzero(flagged), [4, 5])
    # never all of a class
    cal = np.array([[0.0, 6.0], [0.0, 6.0]])
    assert cl.prune_by_noise_rate(P, y, cal, counts).sum() == 5


probs_and_labels = st.integers(2, 6).flatmap(
    lambda k: st.tuples(
        st.just(k),
        st.integers(k * 2, 60),
        st.integers(0, 2**31 - 1),
    )
)


@settings(max_examples=40, deadline=None)
@given(probs_and_labels)
def test_estimates_are_consistent(args):
    k, n, seed = args
    rng = np.random.default_rng(seed)
    y = np.concatenate([np.arange(k), np.arange(k), rng.integers(0, k, n - 2 * k)])
    P = rng.dirichlet(np.ones(k) * 0.5, size=n)
    df = find_label_issues(y, pred_probs=P)
    est = df.label_issues
    assert est.confident_joint.sum() <= n
    np.testing.assert_allclose(est.joint.sum(), 1.0)
    np.testing.assert_allclose(est.noise_matrix.sum(axis=0), 1.0)
    np.testing.assert_array_equal(est.class_counts, np.bincount(y, minlength=k))
    s = df.sort_index()
    flagged = s["is_issue"].to_numpy()
    # never flags a sample whose label is the prediction; never more than estimated
    assert not (flagged & (P.argmax(1) == y)).any()
    assert est.n_flagged == flagged.sum() <= max(est.n_estimated, 0)
    np.testing.assert_allclose(s["self_confidence"], P[np.arange(n), y])
    # the same data in another row order gives the same flags
    perm = rng.permutation(n)
    s2 = find_label_issues(y[perm], pred_probs=P[perm]).sort_index()
    np.testing.assert_allclose(s2["self_confidence"].to_numpy(), P[perm, y[perm]])
    assert s2["is_issue"].sum() == flagged.sum()


def test_top_k_orders_classes():
    P = np.array([[0.1, 0.5, 0.15, 0.25], [0.7, 0.1, 0.1, 0.1]])
    cls, p = cl.top_k(P, 3)
    np.testing.assert_array_equal(cls[0], [1, 3, 2])
    np.testing.assert_allclose(p[0], [0.5, 0.25, 0.15])
    assert cls[1, 0] == 0


# ----------------------------------------------------------------- computing probabilities


def test_out_of_fold_from_sklearn_model_leaves_model_unfitted():
    X, y = load_digits(return_X_y=True)
    X, y = X[:400], flip(y[:400], 0.1, seed=3)
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
    df = find_label_issues(y, X=X, model=model, cv=3)
    assert not hasattr(model[-1], "coef_")
    assert df.label_issues.models == ["LogisticRegression"]
    assert df["is_issue"].sum() > 0


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )

    def forward(self, x):
        return self.net(x / 16.0)


def test_torch_classifier_per_fold_leaves_the_module_and_rng_alone():
    X, y = load_digits(return_X_y=True)
    X, y_true = X[:500], y[:500]
    noisy = flip(y_true, 0.1, seed=4)
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    rng_before = torch.get_rng_state()
    df = find_label_issues(noisy, X=torch.as_tensor(X, dtype=torch.float32), model=model, cv=3)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    precision, recall = prf(flags_of(df), noisy != y_true)
    assert precision >= 0.5 and recall >= 0.6, (precision, recall)
    assert df.label_issues.models == ["torch MLP"]


def test_torch_classifier_is_a_sklearn_estimator():
    X, y = load_digits(return_X_y=True)
    clf = TorchClassifier(MLP, epochs=5, random_state=1).fit(X[:300], y[:300])
    p = clf.predict_proba(X[300:360])
    assert p.shape == (60, 10)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    assert (clf.predict(X[300:360]) == y[300:360]).mean() > 0.6
    # same seed, same result
    p2 = (
        TorchClassifier(MLP, epochs=5, random_state=1)
        .fit(X[:300], y[:300])
        .predict_proba(X[300:360])
    )
    np.testing.assert_allclose(p, p2)
    with pytest.raises(TypeError, match=r"must return a torch\.nn\.Module"):
        TorchClassifier(lambda: 3).fit(X[:10], y[:10])  # type: ignore[arg-type, return-value]


def test_default_ensemble_from_features():
    X, y = load_digits(return_X_y=True)
    X, y_true = X[:300], y[:300]
    noisy = flip(y_true, 0.1, seed=5)
    df = find_label_issues(noisy, X=X, method="ensemble", cv=3)
    assert len(df.label_issues.models) == 3
    precision, _ = prf(flags_of(df), noisy != y_true)
    assert precision >= 0.6


# --------------------------------------------------------------------------- bad input


def good():
    P = np.full((6, 3), 0.1)
    P[np.arange(6), [0, 1, 2, 0, 1, 2]] = 0.8
    return np.array([0, 1, 2, 0, 1, 2]), P


@pytest.mark.parametrize(
    "labels, probs, exc, match",
    [
        (
            np.array([0, 1, 3, 0, 1, 2]),
            None,
            ValueError,
            r"labels must lie in 0\.\.2 .* sample 2 has label 3",
        ),
        (np.array([0, 1, -1, 0, 1, 2]), None, ValueError, r"sample 2 has label -1"),
        (
            np.array([0, 1, 2, 0, 1]),
            None,
            ValueError,
            r"pred_probs has 6 rows but there are 5 labels",
        ),
        (
            np.array(["a", "b", "c", "a", "b", "c"]),
            None,
            TypeError,
            r"integer class indices.*LabelEncoder",
        ),
        (np.array([0, 1, 2.5, 0, 1, 2]), None, ValueError, r"sample 2 has label 2\.5"),
        (np.zeros((6, 2), dtype=int), None, ValueError, r"labels must be 1-D"),
        (np.array([], dtype=int), None, ValueError, r"labels is empty"),
        (None, "nan", ValueError, r"must be finite; row 1"),
        (None, "neg", ValueError, r"non-negative probabilities; row 4.*not the logits"),
        (None, "1d", ValueError, r"pred_probs must be 2-D"),
        (None, "zero", ValueError, r"row 0 is all zeros"),
    ],
)
def test_bad_input_messages(labels, probs, exc, match):
    y, P = good()
    if labels is not None:
        y = labels
    if probs == "nan":
        P[1, 1] = np.nan
    elif probs == "neg":
        P[4, 0] = -0.2
    elif probs == "1d":
        P = P[:, 0]
    elif probs == "zero":
        P[0] = 0
    with pytest.raises(exc, match=match):
        find_label_issues(y, pred_probs=P)


def test_bad_options():
    y, P = good()
    with pytest.raises(ValueError, match="method must be one of"):
        find_label_issues(y, pred_probs=P, method="vote")
    with pytest.raises(ValueError, match="tau must be a probability"):
        find_label_issues(y, pred_probs=[P, P], method="ensemble", tau=1.5)
    with pytest.raises(ValueError, match=r"needs pred_probs=.*or X="):
        find_label_issues(y)
    with pytest.raises(ValueError, match="at least 2 models"):
        find_label_issues(y, pred_probs=[P], method="ensemble")
    with pytest.raises(ValueError, match="needs several models"):
        find_label_issues(y, pred_probs=P, method="ensemble")
    with pytest.raises(ValueError, match="is for method='ensemble'"):
        find_label_issues(y, pred_probs=[P, P])
    with pytest.raises(ValueError, match="cv must be an integer"):
        find_label_issues(y, X=np.zeros((6, 2)), cv=1)
    with pytest.raises(TypeError, match="model must be a scikit-learn classifier"):
        find_label_issues(y, X=np.zeros((6, 2)), model=object(), cv=2)
    with pytest.raises(ValueError, match="X has 5 rows but there are 6 labels"):
        find_label_issues(y, X=np.zeros((5, 2)), cv=2)
    with pytest.raises(ValueError, match="prune must be one of"):
        find_label_issues(y, pred_probs=P, prune="both")


def test_rows_not_summing_to_one_are_normalised_with_a_warning():
    y, P = good()
    scaled = P * 3.0
    scaled_before = scaled.copy()
    with pytest.warns(UserWarning, match=r"6 rows do not sum to 1 \(row 0 sums to 3"):
        df = find_label_issues(y, pred_probs=scaled)
    np.testing.assert_array_equal(scaled, scaled_before)  # the caller's array is untouched
    ref = find_label_issues(y, pred_probs=P)
    pd.testing.assert_frame_equal(df.sort_index(), ref.sort_index())


def test_a_class_with_one_sample_cannot_be_assessed():
    rng = np.random.default_rng(0)
    y = np.array([0] * 10 + [1] * 10 + [2])
    P = rng.dirichlet(np.ones(3), size=21)
    P[20] = [0.98, 0.01, 0.01]  # the lone class-2 sample looks like class 0
    with pytest.warns(
        UserWarning, match=r"class \[2\] has fewer than 2 samples and cannot be assessed"
    ):
        df = find_label_issues(y, pred_probs=P)
    assert not df.loc[20, "is_issue"]
    assert df.label_issues.unassessed == [2]


def test_a_class_no_sample_is_labelled_with_is_said_when_the_model_predicts_it():
    # every true class-2 sample was relabelled 1 (rows 20-29): class 2 has no label left,
    # so confident learning has no threshold for it; the model predicts 2 for those 10 rows
    y = np.array([0] * 10 + [1] * 20)
    P = np.array([[0.9, 0.05, 0.05]] * 10 + [[0.05, 0.9, 0.05]] * 10 + [[0.05, 0.05, 0.9]] * 10)
    with pytest.warns(
        UserWarning,
        match=r"class \[2\] has no sample labelled with it, but the model predicts it for "
        r"10 samples",
    ):
        find_label_issues(y, pred_probs=P)
    # a class the model never predicts either is simply absent: nothing to say about it
    P2 = P.copy()
    P2[20:] = [0.05, 0.9, 0.05]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = find_label_issues(y, pred_probs=P2)
    assert not df["is_issue"].any()


def test_in_sample_probabilities_warn_and_out_of_fold_do_not(digits_oof):
    _, _, noisy, p_lda, _ = digits_oof
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_label_issues(noisy, pred_probs=p_lda)
    X, y = load_digits(return_X_y=True)
    model = KNeighborsClassifier(1).fit(X, y)  # predicting its own training data
    with pytest.warns(UserWarning, match="look in-sample"):
        find_label_issues(y, pred_probs=model.predict_proba(X))


def test_inputs_are_not_changed(digits_oof):
    _, _, noisy, p_lda, p_knn = digits_oof
    series = pd.Series(noisy.copy())
    P = p_lda.copy()
    t = torch.as_tensor(noisy.copy())
    find_label_issues(series, pred_probs=P)
    find_label_issues(t, pred_probs=[P, p_knn], method="ensemble")
    np.testing.assert_array_equal(series.to_numpy(), noisy)
    np.testing.assert_array_equal(P, p_lda)
    assert torch.equal(t, torch.as_tensor(noisy))


def test_out_of_fold_columns_follow_the_class_indices():
    X, y = load_digits(return_X_y=True)
    keep = y < 3
    X, y = X[keep][:240], y[keep][:240]
    y = np.where(y == 2, 3, y)  # classes 0, 1, 3: class 2 has no sample
    y[0] = 5  # and class 5 a single one
    with pytest.warns(
        UserWarning, match=r"class \[5\] has fewer than 2 samples and cannot be assessed"
    ):
        df = find_label_issues(y, X=X, model=KNeighborsClassifier(5), cv=3)
    s = df.sort_index()
    assert df.label_issues.n_classes == 6
    assert df.label_issues.class_counts.tolist() == [int((y == c).sum()) for c in range(6)]
    assert s.loc[y == 3, "self_confidence"].mean() > 0.8  # class 3's column holds class 3
    assert (s["top1"] != 2).all()
    assert not s.loc[0, "is_issue"]


def test_uninformative_probabilities_flag_nothing():
    # every class at 1/3: the given label ties for the top in every row, so it is the
    # model's prediction and no sample is flagged (nor any noise estimated)
    y = np.repeat([0, 1, 2], 50)
    P = np.full((150, 3), 1 / 3)
    for kw in ({}, {"prune": "global"}, {"method": "predicted_neq_given"}):
        issues = find_label_issues(y, pred_probs=P, **kw)
        assert not issues["is_issue"].any(), kw
    assert issues.attrs["label_noise"].n_estimated == 0
    # one informative row among tied ones is still flagged
    P2 = P.copy()
    P2[7] = [0.05, 0.05, 0.9]  # labelled 0, confidently 2
    issues = find_label_issues(y, pred_probs=P2)
    assert list(issues.index[issues["is_issue"]]) == [7]


def test_features_and_models_that_do_not_fit_get_one_sentence():
    d = load_digits()
    X, y = d.data[:300], d.target[:300]
    with pytest.raises(ValueError, match=r"X has shape \(300, 8, 8\): a scikit-learn model"):
        find_label_issues(y, X=d.images[:300])
    Xn = X.copy()
    Xn[[3, 9], 5] = np.nan
    before = Xn.copy()
    with pytest.raises(
        ValueError,
        match=r"X holds 2 NaN/inf values in 1 feature column\(s\) "
        r"\(column 5: 2\): expected finite features for LogisticRegression",
    ):
        find_label_issues(y, X=Xn)
    np.testing.assert_array_equal(Xn, before)  # the user's array is unchanged
    # a model that takes NaN is left to do so
    from sklearn.ensemble import HistGradientBoostingClassifier

    hgb = HistGradientBoostingClassifier(max_iter=10, random_state=0)
    assert len(find_label_issues(y, X=Xn, model=hgb)) == 300
    # a torch model with fewer outputs than classes
    net = torch.nn.Linear(64, 4)
    with pytest.raises(ValueError, match=r"one score per class, logits of shape \(batch, 10\)"):
        find_label_issues(y, X=X.astype(np.float32), model=net)


# ------------------------------------------------- the fast paths against plain numpy


def test_fast_sorts_and_confident_assignment():
    rng = np.random.default_rng(3)
    keys = [
        rng.random(500),
        np.round(rng.random(500), 1),  # many ties
        np.array([0.0, -0.0, 1.0, -np.inf, 0.0, -np.inf, 2.0, -0.0]),
        np.array([1.0]),
        np.array([]),
    ]
    for k in keys:
        np.testing.assert_array_equal(cl.stable_argsort(k), np.argsort(k, kind="stable"))
    for n_classes in (2, 7, 40_000):
        y = rng.integers(0, n_classes, 300)
        np.testing.assert_array_equal(cl.group_order(y, n_classes), np.argsort(y, kind="stable"))
    # a given label tied for the top confident class is kept; a row with none above gets -1
    P = np.array([[0.5, 0.5], [0.5, 0.5], [0.1, 0.9], [0.3, 0.35]])
    t = np.array([0.4, 0.4])
    np.testing.assert_array_equal(
        cl.confident_assignment(P, t, np.array([1, 0, 0, 1])), [1, 0, 1, -1]
    )
    np.testing.assert_array_equal(cl.confident_assignment(P, t), [0, 0, 1, -1])


def plain_confident_learning(y: np.ndarray, P: np.ndarray) -> np.ndarray:
    """The default flags, sample by sample (no ties in P; every class >= 2 samples)."""
    n, k = P.shape
    counts = np.bincount(y, minlength=k)
    t = np.array([P[y == j, j].mean() for j in range(k)])
    cj = np.zeros((k, k))
    for i in range(n):
        above = [j for j in range(k) if P[i, j] >= t[j] - 1e-9]
        if above:
            best = max(above, key=lambda j: P[i, j])
            cj[y[i], y[i] if y[i] in above and P[i, y[i]] >= P[i, best] else best] += 1
    cal = cj / cj.sum(axis=1, keepdims=True) * counts[:, None]
    n_est = int(np.rint(cal.sum() - np.trace(cal)))
    by_rate = np.zeros(n, dtype=bool)
    for i in range(k):
        rows = np.flatnonzero(y == i)
        hit = set()
        for j in range(k):
            m = min(int(np.rint(cal[i, j])), len(rows) - 1) if j != i else 0
            hit |= set(rows[np.argsort(P[rows, i] - P[rows, j])[:m]].tolist())
        assert len(hit) < len(rows)  # at least one sample of each class is kept
        by_rate[sorted(hit)] = True
    candidates = P[np.arange(n), y] < P.max(axis=1)
    n_take = min(int((by_rate & candidates).sum()), n_est)
    scaled = P / t
    margin = np.array([scaled[i, y[i]] - np.delete(scaled[i], y[i]).max() for i in range(n)])
    idx = np.flatnonzero(candidates)
    flagged = np.zeros(n, dtype=bool)
    flagged[idx[np.argsort(margin[idx])[:n_take]]] = True
    return flagged


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_column_matches_a_plain_numpy_computation(seed):
    rng = np.random.default_rng(seed)
    n, k = 120, 4
    true = np.concatenate([np.arange(k), np.arange(k), rng.integers(0, k, n - 2 * k)])
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), true] += 2.0
    P = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = np.where(rng.random(n) < 0.2, (true + 1) % k, true)
    df = find_label_issues(y, pred_probs=P)
    flagged = plain_confident_learning(y, P)
    rows = np.arange(n)
    sc = P[rows, y]
    ranked = np.argsort(-P, axis=1)  # no ties
    other = np.where(ranked[:, 0] == y, ranked[:, 1], ranked[:, 0])
    # flagged first, then by self-confidence; equal qualities in index order
    order = sorted(rows, key=lambda i: (not flagged[i], sc[i] - 2.0 * flagged[i], i))
    np.testing.assert_array_equal(df.index, order)
    s = df.sort_index()
    np.testing.assert_array_equal(s["is_issue"], flagged)
    np.testing.assert_array_equal(s["method"], np.where(flagged, "confident_learning", ""))
    np.testing.assert_array_equal(s["given_label"], y)
    np.testing.assert_array_equal(s["suggested_label"], other)
    np.testing.assert_array_equal(s["suggested_prob"], P[rows, other])
    np.testing.assert_array_equal(s["self_confidence"], sc)
    np.testing.assert_array_equal(s["label_quality"], sc)
    np.testing.assert_array_equal(s["normalized_margin"], (sc - P[rows, other] + 1) / 2)
    for j in range(3):
        np.testing.assert_array_equal(s[f"top{j + 1}"], ranked[:, j])
        np.testing.assert_array_equal(s[f"top{j + 1}_prob"], P[rows, ranked[:, j]])
    # duplicated rows tie on every score: the ranking keeps them in index order
    dup = find_label_issues(np.tile(y, 2), pred_probs=np.tile(P, (2, 1)))
    s = dup.sort_index()
    f, q = s["is_issue"].to_numpy(), s["label_quality"].to_numpy()
    assert len(set(q)) <= n
    expect = sorted(range(2 * n), key=lambda i: (not f[i], q[i] - 2.0 * f[i], i))
    np.testing.assert_array_equal(dup.index, expect)
