"""nbdebug.drift: statistical honesty on bundled data, bad input, nothing changed, the panel.

Statistical tests (issue 7, item 3) on sklearn's breast_cancer and wine, with a random
forest and a logistic regression each fitted once on all rows (so two random halves are
exchangeable):
(a) no drift: alarm rate <= alpha + 0.05 over 200 seeds (random forest: SHAP computed once)
    or 60 (logistic regression: drift() itself); with 30 seeds a level-0.05 test exceeds 0.10
    by chance 6% of the time (wine/rf did at seeds 0-29: 4 alarms, 13 in 200);
(b) two features shifted by 1 std: those two flagged and no other input, in most seeds;
(c) a subpopulation shift (one class over-sampled) moves a cluster's share, even where few
    raw features flag;
(d) a shift in a feature the model ignores: input drift, no explanation drift.
The measured rates are printed (visible in the pytest output).
"""

from __future__ import annotations

import functools
import pickle
import random
import re
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from state import assert_unchanged, fingerprint

import nbdebug
from nbdebug.analysis.drift import (
    DriftReport,
    drift,
    drift_from_shap,
    explain_batches,
    moved_direction,
)
from nbdebug.analysis.drift.statistics import hierarchical

ALPHA = 0.05
LOADERS = {"breast_cancer": load_breast_cancer, "wine": load_wine}
COMBOS = [(d, m) for d in LOADERS for m in ("rf", "lr")]


@functools.cache
def dataset(name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    bunch = LOADERS[name]()
    x = StandardScaler().fit_transform(bunch.data)
    x.setflags(write=False)
    return x, bunch.target, [str(f) for f in bunch.feature_names]


@functools.cache
def fitted(name: str, kind: str):
    x, y, _ = dataset(name)
    if kind == "rf":
        return RandomForestClassifier(n_estimators=40, random_state=0, n_jobs=1).fit(x, y)
    return LogisticRegression(max_iter=2000).fit(x, y)


@functools.cache
def tree_shap_per_output(name: str) -> np.ndarray:
    """SHAP values of every row for each output of the random forest ``(n, d, k)``
    (TreeExplainer's row values do not depend on the other rows); one output for two
    classes (class 1)."""
    x, _, _ = dataset(name)
    model = fitted(name, "rf")
    k = len(model.classes_)
    outputs = ["auto"] if k == 2 else list(range(k))
    vals = [explain_batches(model, x, x[:2], output=o, progress=False).reference for o in outputs]
    return np.stack(vals, axis=2)


def tree_shap_as_drift(name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What drift() explains for the halves ``a``, ``b``, for every row: class 1, or for
    more classes the classes signed by their mean change between the halves."""
    x, _, _ = dataset(name)
    vals = tree_shap_per_output(name)
    if vals.shape[2] == 1:
        return vals[:, :, 0]
    proba = fitted(name, "rf").predict_proba
    return vals @ moved_direction(proba(x[a]), proba(x[b]))


def halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    return idx[: n // 2], idx[n // 2 :]


def run(model, ref, cur, **kw) -> DriftReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sklearn feature-name chatter
        kw.setdefault("progress", False)
        return drift(model, ref, cur, **kw)


def say(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n  [drift] {text}", end="")


# ---------------------------------------------------------------------------- (a) no drift


@pytest.mark.parametrize("name,kind", COMBOS)
def test_a_no_drift_alarm_rate_at_most_alpha_plus_005(name, kind, capsys):
    x, _, names = dataset(name)
    model = fitted(name, kind)
    # TreeExplainer's (path-dependent) SHAP row of a sample does not depend on the other
    # rows: explain all rows once and reuse (exactness checked below). LinearExplainer's
    # values depend on the background drawn from the reference: run drift() itself.
    seeds = 200 if kind == "rf" else 60
    alarms = 0
    for seed in range(seeds):
        a, b = halves(len(x), seed)
        if kind == "rf":
            shap_all = tree_shap_as_drift(name, a, b)
            rep = drift_from_shap(
                x[a],
                x[b],
                shap_all[a],
                shap_all[b],
                feature_names=names,
                alpha=ALPHA,
                random_state=seed,
                progress=False,
            )
        else:
            rep = run(model, x[a], x[b], feature_names=names, alpha=ALPHA, random_state=seed)
        alarms += rep.alarm
    rate = alarms / seeds
    say(capsys, f"(a) {name}/{kind}: no-drift alarm rate {rate:.3f} over {seeds} seeds")
    assert rate <= ALPHA + 0.05


@pytest.mark.parametrize("name", list(LOADERS))
def test_a_shortcut_equals_full_drift_for_trees(name):
    """The reuse in (a) is exact: drift() on the halves gives the same tests."""
    x, _, names = dataset(name)
    model = fitted(name, "rf")
    a, b = halves(len(x), 3)
    shap_all = tree_shap_as_drift(name, a, b)
    full = run(model, x[a], x[b], feature_names=names, random_state=3)
    short = drift_from_shap(
        x[a], x[b], shap_all[a], shap_all[b], feature_names=names, random_state=3, progress=False
    )
    cols = ["ks_p", "shap_ks_p", "ks_p_adj", "shap_ks_p_adj"]
    pd.testing.assert_frame_equal(
        full.features[cols], short.features.loc[full.features.index, cols], atol=1e-9
    )
    assert full.cluster_test.p_value == pytest.approx(short.cluster_test.p_value, abs=1e-9)
    assert full.classifier.auc == pytest.approx(short.classifier.auc, abs=1e-9)
    assert full.alarm == short.alarm


# ----------------------------------------------------------------- (b) 2 shifted features


@pytest.mark.parametrize("name,kind", COMBOS)
def test_b_two_shifted_features_are_the_flagged_inputs(name, kind, capsys):
    x, _, names = dataset(name)
    model = fitted(name, kind)
    shifted = {names[0], names[1]}
    seeds = 6
    exact = found = 0
    extra_expl = []
    for seed in range(seeds):
        a, b = halves(len(x), 100 + seed)
        cur = x[b].copy()
        cur[:, :2] += x[a][:, :2].std(axis=0)
        rep = run(model, x[a], cur, feature_names=names, random_state=seed)
        flagged = set(rep.drifted_inputs)
        found += rep.alarm and shifted <= flagged
        exact += flagged == shifted
        extra_expl.append(len(set(rep.drifted_explanations) - shifted))
    say(
        capsys,
        f"(b) {name}/{kind}: both shifted found {found}/{seeds}, exactly those two inputs flagged "
        f"{exact}/{seeds}; other features with explanation drift per seed {extra_expl}",
    )
    assert found == seeds
    assert exact / seeds > 0.5


# ---------------------------------------------------------------------------- (c) subpopulation


SUBPOP = {"breast_cancer": (0, 0.5), "wine": (1, 0.1)}  # over-sampled class, share of others kept


@pytest.mark.parametrize("name,kind", COMBOS)
def test_c_subpopulation_shift_moves_a_cluster_share(name, kind, capsys):
    x, y, names = dataset(name)
    model = fitted(name, kind)
    cls, keep = SUBPOP[name]
    seeds = 6
    significant, purities, raw_flags = 0, [], []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        a, b = halves(len(x), seed)
        others = b[y[b] != cls]
        cur = np.r_[b[y[b] == cls], rng.choice(others, int(keep * len(others)), replace=False)]
        rep = run(model, x[a], x[cur], feature_names=names, random_state=seed)
        significant += rep.cluster_test.p_adjusted <= ALPHA
        grown = int(rep.clusters["change"].idxmax())
        in_grown = rep.labels[rep.is_current] == grown
        purities.append(float((y[cur][in_grown] == cls).mean()))
        raw_flags.append(len(rep.drifted_inputs))
        assert rep.clusters.loc[grown, "share_current"] > rep.clusters.loc[grown, "share_reference"]
    say(
        capsys,
        f"(c) {name}/{kind}: class {cls} over-sampled; cluster shares significant "
        f"{significant}/{seeds}; grown cluster's share of class {cls}: "
        f"{[round(p, 2) for p in purities]}; raw features flagged per seed {raw_flags} "
        f"of {len(names)}",
    )
    assert significant / seeds > 0.5
    assert np.median(purities) >= 0.85  # the cluster that grew is the over-sampled class
    if name == "wine":  # the middle class moves few marginals: the clusters see it anyway
        assert np.median(raw_flags) <= 4


# ---------------------------------------------------------------------------- (d) ignored feature


def _ignoring_model(name: str, kind: str) -> tuple[object, int]:
    """A model that does not use one feature, and that feature's index."""
    x, y, _ = dataset(name)
    if kind == "rf":
        j = 0
        blind = x.copy()
        blind[:, j] = 0.0  # a constant column is never split on
        return RandomForestClassifier(n_estimators=40, random_state=0, n_jobs=1).fit(blind, y), j
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lasso = LogisticRegression(l1_ratio=1.0, C=0.1, solver="saga", max_iter=5000).fit(x, y)
    zero = np.flatnonzero((lasso.coef_ == 0).all(axis=0))
    assert len(zero) > 0
    return lasso, int(zero[0])


@pytest.mark.parametrize("name,kind", COMBOS)
def test_d_ignored_feature_shift_is_input_drift_only(name, kind, capsys):
    x, _, names = dataset(name)
    model, j = _ignoring_model(name, kind)
    for seed in range(2):
        a, b = halves(len(x), 200 + seed)
        cur = x[b].copy()
        cur[:, j] += x[a][:, j].std()
        rep = run(model, x[a], cur, feature_names=names, random_state=seed)
        row = rep.features.loc[names[j]]
        assert bool(row["drifted_input"]) and not bool(row["drifted_explanation"])
        assert row["quadrant"] == "input only"
        assert np.all(rep.current_shap[:, j] == 0)  # the model truly ignores it
        assert "input drift the model does not act on" in rep.details.lower()
    say(capsys, f"(d) {name}/{kind}: shifted ignored feature {names[j]!r}: input only")


# ---------------------------------------------------------------------------- explainers


def _torch_mlp(d: int, k: int = 2) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(d, 8), torch.nn.ReLU(), torch.nn.Linear(8, k))


class Squash(torch.nn.Module):
    """Functional tanh in forward: DeepLIFT's hooks do not see it."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, 1)

    def forward(self, x):
        return torch.tanh(self.lin(x)).squeeze(-1)


def test_explainer_auto_choice_and_local_accuracy():
    """SHAP rows sum to the explained output (up to the base value): the right explainer
    and the right output column are used for each model kind."""
    x, _, names = dataset("breast_cancer")
    ref, cur = x[:60], x[60:120]

    def check(rep: DriftReport, f_ref: np.ndarray, f_cur: np.ndarray, tol: float) -> None:
        s = np.r_[rep.reference_shap, rep.current_shap].sum(axis=1)
        f = np.r_[f_ref, f_cur]
        base = f - s
        assert np.ptp(base) < tol, (rep.explainer, np.ptp(base))

    rf = fitted("breast_cancer", "rf")
    rep = run(rf, ref, cur, feature_names=names)
    assert rep.explainer.startswith("TreeExplainer") and "class 1" in rep.output
    check(rep, rf.predict_proba(ref)[:, 1], rf.predict_proba(cur)[:, 1], 1e-6)

    lr = fitted("breast_cancer", "lr")
    rep = run(lr, ref, cur)
    assert rep.explainer == "LinearExplainer" and "log-odds" in rep.output
    check(rep, lr.decision_function(ref), lr.decision_function(cur), 1e-6)

    mlp = _torch_mlp(30)
    rep = run(mlp, torch.tensor(ref, dtype=torch.float32), torch.tensor(cur, dtype=torch.float32))
    assert rep.explainer.startswith("DeepExplainer") and rep.output.startswith("output 1")
    with torch.no_grad():
        out = mlp(torch.tensor(np.r_[ref, cur], dtype=torch.float32))[:, 1].double().numpy()
    check(rep, out[:60], out[60:], 1e-3)

    sq = Squash(30)
    rep = run(sq, ref[:30], cur[:30], background=20)
    assert rep.explainer.startswith("GradientExplainer")
    assert any("DeepExplainer does not fit" in n for n in rep.notes)

    def f(a: np.ndarray) -> np.ndarray:
        return 2.0 * a[:, 0] - a[:, 1] * a[:, 2]

    rep = run(f, ref[:25, :4], cur[:25, :4], background=10)
    assert rep.explainer.startswith("KernelExplainer")
    check(rep, f(ref[:25, :4]), f(cur[:25, :4]), 1e-6)


def test_multiclass_output_predicted_class_on_request():
    x, _, names = dataset("wine")
    lr = fitted("wine", "lr")
    a, b = halves(len(x), 0)
    rep = run(lr, x[a], x[b], feature_names=names, output="predicted")
    assert "predicted class" in rep.output
    pred = lr.decision_function(x[a])
    cls = pred.argmax(axis=1)
    # local accuracy per predicted class: same class -> same base value
    base = pred[np.arange(len(a)), cls] - rep.reference_shap.sum(axis=1)
    for c in np.unique(cls):
        assert np.ptp(base[cls == c]) < 1e-6
    rep2 = run(lr, x[a], x[b], output=2)
    assert "class 2" in rep2.output
    assert not np.allclose(rep2.reference_shap, rep.reference_shap)


def test_multiclass_default_explains_the_moved_probability_mass(capsys):
    """Three classes: by default the explained output is the sum of the class outputs,
    each signed by how its mean predicted probability moved (measured here from
    predict_proba), so exposure says which features moved probability between classes;
    it finds the two shifted features' explanation drift where each row's predicted
    class does not."""
    x, _, names = dataset("wine")
    lr = fitted("wine", "lr")
    found = {"auto": 0, "predicted": 0}
    for seed in range(6):
        a, b = halves(len(x), 100 + seed)
        cur = x[b].copy()
        cur[:, :2] += x[a][:, :2].std(axis=0)
        signs = np.sign(lr.predict_proba(cur).mean(axis=0) - lr.predict_proba(x[a]).mean(axis=0))
        for out in found:
            rep = run(lr, x[a], cur, feature_names=names, random_state=seed, output=out)
            found[out] += {names[0], names[1]} <= set(rep.drifted_explanations)
            if out != "auto":
                continue
            assert "moved predict_proba mass" in rep.output
            f_ref, f_cur = lr.decision_function(x[a]) @ signs, lr.decision_function(cur) @ signs
            base = np.r_[f_ref, f_cur] - np.r_[rep.reference_shap, rep.current_shap].sum(axis=1)
            assert np.ptp(base) < 1e-6  # SHAP of the signed sum: local accuracy
            assert rep.prediction_shift == pytest.approx(f_cur.mean() - f_ref.mean(), abs=1e-6)
    say(capsys, f"multi-class wine/lr: both shifted features' explanation drift found {found}/6")
    assert found["auto"] >= 4 and found["auto"] > found["predicted"]


# ---------------------------------------------------------------------------- bad input


def _frame(n: int = 40, seed: int = 0) -> pd.DataFrame:
    x, _, names = dataset("breast_cancer")
    rows = np.random.default_rng(seed).choice(len(x), n, replace=False)
    return pd.DataFrame(x[rows], columns=names)


def test_mismatched_columns_are_listed():
    rf = fitted("breast_cancer", "rf")
    ref, cur = _frame(), _frame(seed=1)
    cur = cur.rename(columns={"mean radius": "radius"})
    cur["extra"] = 1.0
    with pytest.raises(ValueError) as e:
        drift(rf, ref, cur, progress=False)
    msg = str(e.value)
    assert (
        "missing from current: ['mean radius']" in msg
        and "only in current: ['radius', 'extra']" in msg
    )
    with pytest.raises(ValueError, match=r"reference 30, current 29"):
        drift(rf, ref.to_numpy(), cur.to_numpy()[:, :29], progress=False)


def test_reordered_columns_are_aligned_by_name():
    rf = fitted("breast_cancer", "rf")
    ref, cur = _frame(), _frame(seed=1)
    rep1 = run(rf, ref, cur)
    rep2 = run(rf, ref, cur[list(reversed(cur.columns))])
    pd.testing.assert_frame_equal(rep1.features, rep2.features)
    assert any("order" in n for n in rep2.notes)


def test_non_numeric_columns_are_named_and_one_hot_on_request():
    ref, cur = (
        _frame()[["mean radius", "mean texture"]],
        _frame(seed=1)[["mean radius", "mean texture"]],
    )
    ref = ref.assign(colour=np.where(ref["mean radius"] > 0, "red", "blue"))
    cur = cur.assign(colour=np.where(cur["mean radius"] > 0.5, "red", "green"))
    rf = RandomForestClassifier(n_estimators=10, random_state=0).fit(
        ref[["mean radius", "mean texture"]], ref["mean radius"] > 0
    )
    ref_before = ref.copy()
    with pytest.raises(
        ValueError, match=r"non-numeric columns: 'colour' \((object|str)\).*one_hot=True"
    ):
        drift(rf, ref, cur, progress=False)
    enc = pd.get_dummies(pd.concat([ref, cur]), columns=["colour"], prefix_sep="=", dtype=float)
    model = RandomForestClassifier(n_estimators=10, random_state=0).fit(enc, enc["mean radius"] > 0)
    rep = run(model, ref, cur, one_hot=True)
    assert {"colour=red", "colour=blue", "colour=green"} <= set(rep.feature_names)
    assert rep.features.loc["colour=green", "ks"] > 0.3  # a category only in current
    pd.testing.assert_frame_equal(ref, ref_before)  # the user's frame is untouched


def test_unnamed_columns_are_named_in_errors_as_in_the_report():
    # numpy batches: the report calls the features x0, x1, ...; an error names them so too
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    model = RandomForestClassifier(n_estimators=5, random_state=0).fit(X, X[:, 0] > 0)
    assert run(model, X[:30], X[30:]).feature_names == ["x0", "x1", "x2"]
    cur = X[30:].astype(object)
    cur[:, 1] = "a"
    with pytest.raises(ValueError, match=r"non-numeric columns: 'x1' \((object|str)\)"):
        drift(model, X[:30], cur, progress=False)


def test_nan_counted_per_column_refused_or_imputed():
    rf = fitted("breast_cancer", "rf")
    ref, cur = _frame(), _frame(seed=1)
    ref.iloc[[1, 5], 0] = np.nan
    ref.iloc[3, 2] = np.inf
    before = ref.copy()
    with pytest.raises(ValueError) as e:
        drift(rf, ref, cur, progress=False)
    msg = str(e.value)
    assert (
        "reference has 3 (mean radius: 2, mean perimeter: 1)" in msg
        and "nan_policy='impute'" in msg
    )
    rep = run(rf, ref, cur, nan_policy="impute")
    assert any("imputed 3 NaN/inf" in n for n in rep.notes) and "imputed 3" in rep.details
    assert np.isfinite(rep.reference).all()
    pd.testing.assert_frame_equal(ref, before)


def test_few_rows_warn_and_too_few_refuse():
    rf = fitted("breast_cancer", "rf")
    ref, cur = _frame(40), _frame(12, seed=2)
    with pytest.warns(UserWarning, match=r"only 12 rows.*little power"):
        rep = drift(rf, ref, cur, progress=False)
    assert isinstance(rep, DriftReport)
    with pytest.raises(ValueError, match=r"current batch has 1 row"):
        drift(rf, ref, cur.iloc[:1], progress=False)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"explainer": "magic"}, r"explainer must be one of"),
        ({"alpha": 1.5}, r"alpha must be a number strictly between 0 and 1; got 1.5"),
        ({"correction": "holm"}, r"correction must be one of \('fdr', 'bonferroni'\)"),
        ({"n_clusters": 1}, r"n_clusters must be 'auto' or an integer >= 2"),
        ({"background": 0}, r"background must be a positive number"),
        ({"nan_policy": "drop"}, r"nan_policy must be one of"),
        ({"cluster_method": "dbscan"}, r"cluster_method must be one of"),
        ({"random_state": None}, r"random_state must be an integer; got None"),
        (
            {"output": 7},
            r"output must be 'auto', 'predicted' or an output index in \[0, 2\); got 7",
        ),
        (
            {"output": 0, "model": "lr"},
            r"output=0 is not available: the explainer returned a single output",
        ),
        ({"output": "max"}, r"output must be 'auto', 'predicted' or an integer; got 'max'"),
        (
            {"explainer": "tree", "model": "lr"},
            r"explainer='tree' cannot explain .*LogisticRegression",
        ),
        ({"explainer": "deep"}, r"explainer='deep' needs a torch.nn.Module"),
    ],
)
def test_bad_options_one_clear_message(kwargs, match):
    kwargs = dict(kwargs)
    model = fitted("breast_cancer", kwargs.pop("model", "rf"))
    with pytest.raises(ValueError, match=match) as info:
        drift(model, _frame(), _frame(seed=1), progress=False, **kwargs)
    assert type(info.value) is ValueError  # not a private subclass the user cannot name


def test_bad_models_and_shapes_one_clear_message():
    ref, cur = _frame(), _frame(seed=1)
    with pytest.raises(
        TypeError, match=r"model must be a fitted scikit-learn estimator.*got builtins.str|got str"
    ):
        drift("model", ref, cur, progress=False)
    with pytest.raises(ValueError, match=r"RandomForestClassifier is not fitted"):
        drift(RandomForestClassifier(), ref, cur, progress=False)
    rf = fitted("breast_cancer", "rf")
    with pytest.raises(ValueError, match=r"fitted on 30 features but the batches have 5 columns"):
        drift(rf, ref.to_numpy()[:, :5], cur.to_numpy()[:, :5], progress=False)
    with pytest.raises(
        ValueError, match=r"must be 2-D \(rows x features\); got an array of shape \(40,\)"
    ):
        drift(rf, ref.to_numpy()[:, 0], cur, progress=False)

    def broken(a):
        raise RuntimeError("boom")

    with pytest.raises(ValueError, match=r"could not be called on 2 rows.*RuntimeError: boom"):
        drift(broken, ref, cur, progress=False)
    with pytest.raises(ValueError, match=r"must return an array of shape \(n,\) or \(n, k\)"):
        drift(lambda a: np.zeros((len(a), 2, 2)), ref, cur, progress=False)
    with pytest.raises(TypeError, match=r"must return a tensor"):
        drift(_DictOut(), torch.zeros(30, 30), torch.zeros(30, 30), progress=False)


class _DictOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(30, 2)

    def forward(self, x):
        return {"logits": self.lin(x)}


def test_dataframe_model_gets_its_own_column_order():
    x, y, names = dataset("breast_cancer")
    df = pd.DataFrame(x[:, :5], columns=names[:5])
    model = RandomForestClassifier(n_estimators=10, random_state=0).fit(df, y)
    shuffled = [names[3], names[0], names[4], names[1], names[2]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "X does not have valid feature names" from sklearn
        rep = drift(model, df.iloc[:200][shuffled], df.iloc[200:400][shuffled], progress=False)
    assert rep.feature_names == names[:5]
    assert any("order the model was fitted with" in n for n in rep.notes)
    np.testing.assert_array_equal(rep.reference, x[:200, :5])
    bad = df.rename(columns={names[0]: "other"})
    with pytest.raises(
        ValueError, match=rf"missing: \['{names[0]}'\], not used by the model: \['other'\]"
    ):
        drift(model, bad.iloc[:50], bad.iloc[50:100], progress=False)


def test_constant_model_single_cluster_and_progress_bars(capsys):
    x = np.random.default_rng(0).normal(size=(60, 3))
    rep = run(lambda a: np.full(len(a), 0.3), x[:30], x[30:], background=10, progress=True)
    assert not rep.alarm and rep.cluster_test.k == 1 and rep.cluster_test.p_value == 1.0
    assert (rep.reference_shap == 0).all() and "single cluster" in rep.details
    assert rep.classifier.auc == pytest.approx(0.5)


# ---------------------------------------------------------------------------- nothing changed


def test_nothing_the_user_passed_is_changed_sklearn():
    rf = fitted("breast_cancer", "rf")
    ref_df, cur_arr = _frame(), _frame(seed=1).to_numpy()
    ref_before, cur_before = ref_df.copy(), cur_arr.copy()
    model_before = pickle.dumps(rf)
    np.random.seed(123)
    random.seed(7)
    np_state, py_state = np.random.get_state(), random.getstate()
    run(rf, ref_df, cur_arr)
    pd.testing.assert_frame_equal(ref_df, ref_before)
    np.testing.assert_array_equal(cur_arr, cur_before)
    assert pickle.dumps(rf) == model_before
    assert np.array_equal(np.random.get_state()[1], np_state[1]) and random.getstate() == py_state


@pytest.mark.parametrize("explainer", ["auto", "gradient"])
def test_nothing_the_user_passed_is_changed_torch(explainer):
    x, _, _ = dataset("breast_cancer")
    model = _torch_mlp(30)
    model.train()
    model[1].eval()  # mixed flags must come back as they were
    model(torch.randn(4, 30)).sum().backward()  # existing grads must survive
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    ref = torch.tensor(x[:40], dtype=torch.float32, requires_grad=True)
    cur = torch.tensor(x[40:80], dtype=torch.float32)
    ref_before, cur_before = ref.detach().clone(), cur.clone()
    before = fingerprint(model)
    threads = torch.get_num_threads()
    rep = run(model, ref, cur, explainer=explainer, background=20)
    assert rep.explainer.startswith("DeepExplainer" if explainer == "auto" else "GradientExplainer")
    assert (
        torch.equal(ref.detach(), ref_before) and torch.equal(cur, cur_before) and ref.grad is None
    )
    assert_unchanged(before, model)  # parameters, buffers, .grad, flags, hooks, RNG
    assert not any(
        hasattr(m, "x") or hasattr(m, "y") for m in model.modules()
    )  # DeepLIFT's attributes
    assert torch.get_num_threads() == threads
    n_calls = len(calls)
    model(torch.zeros(1, 30))
    assert len(calls) == n_calls + 1  # the user's hook is still there and still works
    handle.remove()


# ---------------------------------------------------------------------------- report and correction


def test_report_tables_repr_and_correction():
    x, _, names = dataset("breast_cancer")
    a, b = halves(len(x), 1)
    cur = x[b].copy()
    cur[:, 3] += 1.0
    rf = fitted("breast_cancer", "rf")
    rep = run(rf, x[a], cur, feature_names=names)
    f = rep.features
    assert list(f.index[:1]) == [names[3]] and f.loc[names[3], "drifted_input"]
    assert f["wasserstein"].loc[names[3]] == pytest.approx(
        __import__("scipy").stats.wasserstein_distance(x[a][:, 3], cur[:, 3]) / x[a][:, 3].std()
    )
    flagged = f["drifted_input"] | f["drifted_explanation"]
    assert not flagged.iloc[flagged.sum() :].any()  # flagged rows first
    assert set(f["quadrant"]) <= {"input+explanation", "input only", "explanation only", "none"}
    assert rep.clusters["share_reference"].sum() == pytest.approx(1) and rep.clusters[
        "share_current"
    ].sum() == pytest.approx(1)
    assert list(rep.tests.index) == ["inputs", "explanations", "cluster shares", "classifier"]
    assert rep.alarm == bool(rep.tests["drift"].any())
    assert "Benjamini-Hochberg" in rep.details and "DriftReport(alarm=True" in repr(rep)
    assert rep.to_frame() is not rep.features and rep.to_frame().equals(rep.features)
    bonf = run(rf, x[a], cur, feature_names=names, correction="bonferroni")
    assert bonf.correction == "Bonferroni" and "Bonferroni" in bonf.details
    assert (
        bonf.features["ks_p_adj"] >= rep.features.loc[bonf.features.index, "ks_p_adj"] - 1e-12
    ).all()
    agg = run(rf, x[a], cur, feature_names=names, cluster_method="agglomerative", n_clusters=3)
    assert agg.cluster_test.k == 3 and agg.cluster_test.method == "agglomerative"
    assert nbdebug.drift is drift and nbdebug.DriftReport is DriftReport


def test_hierarchical_correction_flags_only_inside_drifted_families():
    fams = {
        "a": np.array([1e-6, 0.2, 0.9]),
        "b": np.array([0.04, 0.5]),
        "c": np.array([0.6]),
    }
    adj, table = hierarchical(fams, "fdr", 0.05)
    assert list(table["drift"]) == [True, False, False]
    assert (adj["a"] <= 0.05).tolist() == [True, False, False]
    assert not (adj["b"] <= 0.05).any()  # 0.04 alone does not survive three families
    assert table.loc["a", "p_value"] == pytest.approx(3e-6)  # Simes: min of BH within
    _, table_b = hierarchical(fams, "bonferroni", 0.05)
    assert table_b.loc["a", "p_adjusted"] == pytest.approx(9e-6)


# ---------------------------------------------------------------------------- panel


@pytest.mark.parametrize("backend", ["figurewidget", "output"])
def test_panel_driven_in_python(backend):
    from nbdebug.figures.drift import QUADRANT_RGB, feature_overlay
    from nbdebug.widgets.drift import DriftPanel

    x, _, names = dataset("breast_cancer")
    a, b = halves(len(x), 2)
    cur = x[b].copy()
    cur[:, 5] += 1.0
    rep = run(fitted("breast_cancer", "rf"), x[a], cur, feature_names=names)
    panel = rep.show(backend=backend)
    assert isinstance(panel, DriftPanel) and "DriftPanel(alarm=True" in repr(panel)
    assert "DRIFT" in panel.summary.value
    order = [v for _, v in panel.feature.options]
    assert order == list(rep.features.index) and panel.feature.value == names[5]
    # the table is HTML (issue 17.1): every feature name, header and multi-word cell is text
    table = panel.table.value
    # one header row, no index column (a named index adds a row of blank header cells)
    assert "row_heading" not in table and "index_name" not in table
    rows = re.findall(r'class="data row\d+ col0" >([^<]*)</td>', table)
    assert rows == order
    headers = re.findall(r'class="col_heading level0 col\d+" >([^<]*)</th>', table)
    assert len(headers) == 10 and all(h.strip() for h in headers)
    assert headers[0] == "feature"
    assert "share of prediction shift" in headers and "quadrant" in headers
    cells = re.findall(r'class="data row(\d+) col1" >([^<]*)</td>', table)
    assert [q for _, q in cells] == list(rep.features["quadrant"])
    fills = {}
    for selectors, colour in re.findall(r"([^{}]+)\{\s*background-color: ([^;]+);", table):
        for sel in selectors.split(","):
            fills[sel.strip().rsplit("_", 2)[-2:][0] + "_" + sel.strip().rsplit("_", 1)[-1]] = (
                colour
            )
    r, g, b_ = QUADRANT_RGB["input+explanation"]
    for i, q in enumerate(rep.features["quadrant"]):
        assert (f"rgba({r},{g},{b_}" in fills.get(f"row{i}_col1", "")) == (q == "input+explanation")
    bars = panel.exposure.figure.data[0]
    shares = rep.features["exposure_share"].sort_values(ascending=False, kind="stable")
    assert list(bars.y)[::-1] == [str(f) for f in shares.index[: len(bars.y)]]
    np.testing.assert_allclose(list(bars.x)[::-1], shares.to_numpy()[: len(bars.y)])
    assert __import__("html").escape(rep.headline) in panel.summary.value

    j = names.index("worst area")
    panel.feature.value = "worst area"
    data = panel.overlay.figure.data
    np.testing.assert_array_equal(data[0].x, rep.reference[:, j])
    np.testing.assert_array_equal(data[1].x, rep.current[:, j])
    np.testing.assert_array_equal(data[2].x, rep.reference_shap[:, j])
    np.testing.assert_array_equal(data[3].x, rep.current_shap[:, j])
    assert "worst area" in panel.overlay.figure.layout.annotations[0].text
    panel.select(names[0])
    np.testing.assert_array_equal(panel.overlay.figure.data[0].x, rep.reference[:, 0])
    with pytest.raises(ValueError, match="unknown feature"):
        panel.select("nope")
    with pytest.raises(ValueError, match="unknown feature"):
        feature_overlay(rep, "nope")

    traces = panel.map.figure.data
    assert len(traces) == 2 * rep.cluster_test.k
    assert {t.marker.symbol for t in traces} == {"circle", "x"}
    assert sum(len(t.x) for t in traces) == rep.n_reference + rep.n_current
    for t in traces:
        c = int(t.name.split()[0][1:])
        cur_rows = t.name.endswith("current")
        assert (rep.labels[t.customdata] == c).all() and (
            rep.is_current[t.customdata] == cur_rows
        ).all()
    bars = panel.shares.figure.data
    np.testing.assert_allclose(bars[0].x, rep.clusters["share_reference"])
    np.testing.assert_allclose(bars[1].x, rep.clusters["share_current"])
    assert panel.widget.children[0] is panel.summary
