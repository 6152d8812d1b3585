"""Pipelines, subsampling and named groups (issue 18, items 3-5), and bad input in one
sentence each."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.compose import ColumnTransformer
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.decomposition import PCA
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from nbdebug.analysis.drift import drift, explain_batches
from nbdebug.analysis.drift.sample import dkw_error, rows_for_error, stratified_rows


@functools.cache
def cancer_frame() -> tuple[pd.DataFrame, np.ndarray]:
    b = load_breast_cancer(as_frame=True)
    return b.data, b.target.to_numpy()


def _run(model, ref, cur, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return drift(model, ref, cur, progress=False, **kw)


def test_pipeline_gets_the_final_estimators_exact_explainer():
    x, y = cancer_frame()
    pipe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)).fit(x, y)
    rep = _run(pipe, x.iloc[:200], x.iloc[200:400])
    assert rep.explainer.startswith("LinearExplainer of the pipeline's final LogisticRegression")
    # exact: the SHAP rows add up to the pipeline's decision function minus a constant
    f = np.r_[pipe.decision_function(x.iloc[:200]), pipe.decision_function(x.iloc[200:400])]
    base = f - np.r_[rep.reference_shap, rep.current_shap].sum(axis=1)
    assert np.ptp(base) < 1e-8
    assert "log-odds" in rep.output


def test_column_transformer_one_hot_columns_are_summed_per_input():
    x, y = cancer_frame()
    df = x[["mean radius", "mean texture", "worst area"]].copy()
    df["site"] = np.arange(len(df)) % 3  # a categorical column coded as numbers
    pre = ColumnTransformer(
        [
            ("num", StandardScaler(), ["mean radius", "mean texture", "worst area"]),
            ("cat", OneHotEncoder(), ["site"]),
        ]
    )
    pipe = make_pipeline(pre, RandomForestClassifier(n_estimators=20, random_state=0))
    pipe.fit(df, y)
    ref, cur = df.iloc[:250], df.iloc[250:500]
    rep = _run(pipe, ref, cur)
    assert rep.explainer.startswith("TreeExplainer (path-dependent) of the pipeline's final")
    assert "6 transformed columns summed into 4 inputs" in rep.explainer
    assert rep.feature_names == list(df.columns)
    # local accuracy on the pipeline's own probability
    p = np.r_[pipe.predict_proba(ref)[:, 1], pipe.predict_proba(cur)[:, 1]]
    assert np.ptp(p - np.r_[rep.reference_shap, rep.current_shap].sum(axis=1)) < 1e-6
    # the site column's value is the sum of its three one-hot columns' values
    final = pipe[-1]
    import shap

    z = pre.transform(ref)
    raw = shap.TreeExplainer(final).shap_values(z, check_additivity=False)[:, :, 1]
    np.testing.assert_allclose(rep.reference_shap[:, 3], raw[:, 3:].sum(axis=1), atol=1e-12)


def test_pipeline_that_mixes_columns_falls_back_with_a_note():
    x, y = cancer_frame()
    pipe = make_pipeline(StandardScaler(), PCA(3), LogisticRegression()).fit(x, y)
    sv = explain_batches(pipe, x.to_numpy()[:30], x.to_numpy()[30:40], background=5, progress=False)
    assert sv.explainer.startswith("KernelExplainer")
    assert any("mixes input columns" in n for n in sv.notes)


def test_large_batches_explain_a_stratified_subsample_of_stated_error():
    assert rows_for_error(0.15) == 82 and dkw_error(82) <= 0.15 < dkw_error(81)
    score = np.random.default_rng(0).random(5000)
    rows = stratified_rows(score, 82, 0)
    assert len(rows) == 82 and len(set(rows)) == 82
    # proportional allocation: each tenth of the score range holds 8 or 9 of the rows
    counts = np.histogram(score[rows], bins=np.quantile(score, np.linspace(0, 1, 11)))[0]
    assert counts.min() >= 8 and counts.max() <= 9
    assert len(stratified_rows(score[:900], 82, 0)) == 900  # small batches: every row

    rng = np.random.default_rng(1)
    x = rng.normal(size=(2800, 5))
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    rf = RandomForestClassifier(n_estimators=10, random_state=0)
    model = make_pipeline(ColumnTransformer([("used", "passthrough", [0, 1, 2, 3])]), rf)
    model.fit(x[:400], y[:400])
    cur = x[1600:].copy()
    cur[:, 4] += 1.0
    rep = _run(model, x[400:1600], cur)
    assert len(rep.reference_rows) == len(rep.current_rows) == 82
    assert rep.reference_shap.shape == (82, 5) and rep.reference.shape == (1200, 5)
    assert rep.sampling_error == pytest.approx(dkw_error(82))
    assert "stratified subsample of 82 + 82 rows" in rep.details
    # the input tests used every row: the KS statistic is that of the full batches
    from scipy.stats import ks_2samp

    row = rep.features.loc["x4"]
    assert row["ks"] == pytest.approx(ks_2samp(x[400:1600, 4], cur[:, 4]).statistic)
    assert row["quadrant"] == "input only"  # the pipeline drops x4
    assert (rep.current_shap[:, 4] == 0).all()


def test_a_class_that_grew_is_named_by_its_class():
    b = load_wine()
    x = StandardScaler().fit_transform(b.data)
    y = b.target
    rf = RandomForestClassifier(n_estimators=40, random_state=0).fit(x, y)
    idx = np.random.default_rng(4).permutation(len(x))
    a, c = idx[:89], idx[89:]
    cur = np.r_[c[y[c] == 1], c[y[c] != 1][:8]]
    rep = _run(rf, x[a], x[cur], random_state=4)
    top = rep.clusters.loc[rep.clusters["change"].idxmax()]
    assert top["name"] == "predicted class 1" and top["purity"] >= 0.9
    pred_ref, pred_cur = rf.predict(x[a]), rf.predict(x[cur])
    assert top["group_share_reference"] == pytest.approx(np.mean(pred_ref == 1))
    assert top["group_share_current"] == pytest.approx(np.mean(pred_cur == 1))
    assert "predicted class 1 (purity" in rep.details and "grew from" in rep.details


def test_two_clusters_of_one_class_get_two_names():
    """Two clusters both made of class-1 predictions (two regions the model calls class 1)
    are not both "predicted class 1": each is named by the rule that sets it apart."""
    from nbdebug.analysis.drift.groups import PredictedClasses, name_groups

    rng = np.random.default_rng(0)
    x = np.r_[
        rng.normal(-3, 0.3, (40, 2)), rng.normal(3, 0.3, (40, 2)), rng.normal(0, 0.3, (40, 2))
    ]
    x[:, 1] = rng.normal(0, 1, 120)  # b tells nothing apart
    labels = np.repeat([0, 1, 2], 40)
    classes = np.repeat([1, 1, 0], 40)  # clusters 0 and 1 are both class 1; cluster 2 is class 0
    groups = name_groups(
        labels,
        x,
        ["a", "b"],
        x[::2],
        x[1::2],
        classes=PredictedClasses(classes, classes[::2], classes[1::2]),
    )
    names = [g.description for g in groups]
    assert len(set(names)) == 3, names
    assert [g.kind for g in groups] == ["rule", "rule", "class"]
    assert names[2] == "predicted class 0"
    assert names[0].startswith("rows with `a` <=") and names[1].startswith("rows with `a` >")
    assert groups[0].purity == groups[1].purity == 1.0


def test_two_clusters_no_rule_tells_apart_are_numbered():
    from nbdebug.analysis.drift.groups import name_groups

    rng = np.random.default_rng(0)
    left, right = rng.normal(-3, 0.3, (40, 2)), rng.normal(3, 0.3, (40, 2))
    x = np.r_[left, left, right]  # clusters 0 and 1 hold the same rows
    groups = name_groups(np.repeat([0, 1, 2], 40), x, ["a", "b"], x[::2], x[1::2])
    names = [g.description for g in groups]
    assert names[0].endswith(" (cluster 0)") and names[1].endswith(" (cluster 1)")
    assert names[0].removesuffix(" (cluster 0)") == names[1].removesuffix(" (cluster 1)")
    assert "(cluster" not in names[2]


def test_a_grown_input_region_is_named_by_a_rule():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(900, 3))
    y = (x[:, 0] > 0.8).astype(int)  # the model reacts to a region of x0
    rf = RandomForestClassifier(n_estimators=20, random_state=0, max_depth=4).fit(x[:300], y[:300])
    ref = x[300:600]
    pool = x[600:]
    cur = np.r_[pool[pool[:, 0] > 0.8], pool[pool[:, 0] <= 0.8][:80]]
    rep = _run(rf, ref, cur, n_clusters=2)
    top = rep.clusters.loc[rep.clusters["change"].idxmax()]
    assert top["name"].startswith(("rows with `x0` >", "predicted class 1"))
    assert top["group_share_current"] > top["group_share_reference"] + 0.2
    assert top["purity"] >= 0.8


def test_bad_input_one_sentence_each():
    x, y = cancer_frame()
    rf = RandomForestClassifier(n_estimators=5, random_state=0).fit(x, y)
    cur = x.iloc[:40].copy()
    cur["mean radius"] = cur["mean radius"].astype(str)
    with pytest.raises(ValueError) as e:
        drift(rf, x.iloc[:40], cur, progress=False)
    msg = str(e.value)
    assert "'mean radius'" in msg and msg.count(". ") == 0  # one sentence

    class NoPredict:
        def fit(self, *a):
            return self

    with pytest.raises(TypeError, match=r"has neither predict_proba nor predict"):
        drift(NoPredict(), x.iloc[:40], x.iloc[40:80], progress=False)
    with pytest.raises(ValueError, match=r"current batch has 1 row\(s\); at least 2"):
        drift(rf, x.iloc[:40], x.iloc[:1], progress=False)
    with pytest.raises(ValueError, match=r"sampling_error must be a number strictly between"):
        drift(rf, x.iloc[:40], x.iloc[40:80], sampling_error=0, progress=False)


def _shop(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "age": rng.normal(40, 10, n),
            "income": rng.normal(50, 15, n),
            "city": rng.choice(["paris", "lyon", "nice"], n, p=[0.5, 0.3, 0.2]),
            "plan": rng.choice(["basic", "pro"], n),
        }
    )


def test_pipeline_with_string_categories_tests_their_counts():
    """A ColumnTransformer that one-hot encodes string columns: the strings reach the
    pipeline unchanged, each string column is one feature (its one-hot SHAP values
    summed), and its input test is a chi-square test on the category counts; a shifted
    category share is flagged and named."""
    from scipy.stats import chi2_contingency
    from sklearn.pipeline import Pipeline

    df = _shop(1200, 0)
    logit = 0.05 * (df.age - 40) + 1.5 * (df.city == "nice") - 1.0 * (df.city == "lyon")
    y = (np.random.default_rng(1).random(len(df)) < 1 / (1 + np.exp(-logit))).astype(int)
    pre = ColumnTransformer(
        [("num", StandardScaler(), ["age", "income"]), ("cat", OneHotEncoder(), ["city", "plan"])]
    )
    pipe = Pipeline([("pre", pre), ("lr", LogisticRegression())]).fit(df[:400], y[:400])
    ref = df[400:800].reset_index(drop=True)
    cur = df[800:].reset_index(drop=True)
    cur.loc[cur.index[cur.city == "paris"][:80], "city"] = "nice"  # nice: 20% -> 40%
    before = cur.copy()
    rep = _run(pipe, ref, cur)
    pd.testing.assert_frame_equal(cur, before)  # the user's frame is untouched
    assert rep.explainer.startswith("LinearExplainer of the pipeline's final LogisticRegression")
    assert "7 transformed columns summed into 4 inputs" in rep.explainer
    # exact: SHAP rows add up to the pipeline's own decision function, called on strings
    f = np.r_[pipe.decision_function(ref), pipe.decision_function(cur)]
    assert np.ptp(f - np.r_[rep.reference_shap, rep.current_shap].sum(axis=1)) < 1e-8
    # city's SHAP value is the sum over its one-hot columns: it depends only on the city,
    # and two cities differ by the difference of their coefficients
    j = rep.feature_names.index("city")
    cities = ref["city"].to_numpy()
    names = list(pre.get_feature_names_out())
    coef = dict(zip(names, pipe[-1].coef_[0]))
    per_city = {c: rep.reference_shap[cities == c, j] for c in ("paris", "lyon", "nice")}
    assert all(np.ptp(v) < 1e-12 for v in per_city.values())
    assert per_city["nice"][0] - per_city["paris"][0] == pytest.approx(
        coef["cat__city_nice"] - coef["cat__city_paris"]
    )
    f_ = rep.features
    assert f_.loc["city", "input_test"] == "chi-square" and f_.loc["age", "input_test"] == "KS"
    counts = np.stack(
        [ref["city"].value_counts().sort_index(), cur["city"].value_counts().sort_index()]
    )
    assert f_.loc["city", "ks_p"] == pytest.approx(
        chi2_contingency(counts, correction=False).pvalue
    )
    assert rep.drifted_inputs == ["city"]
    assert f_.loc["city", "quadrant"] == "input+explanation"
    assert "`city`" in rep.headline
    assert any("kept as categories" in n for n in rep.notes)
    # a missing category value: one sentence
    bad = cur.copy()
    bad.loc[0, "plan"] = None
    with pytest.raises(ValueError, match=r"categorical column 'plan' has 1 missing value"):
        _run(pipe, ref, bad)


def test_batches_with_as_many_columns_but_other_names_say_which_names_differ():
    import pandas as pd

    from nbdebug.analysis.drift.batches import prepare_batches

    ref = pd.DataFrame(np.ones((20, 3)), columns=["a", "b", "c"])
    cur = pd.DataFrame(np.ones((20, 3)), columns=["a", "b", "z"])
    with pytest.raises(
        ValueError,
        match=r"^the batches have different column names; missing from current: \['c'\]; "
        r"only in current: \['z'\]\.$",
    ):
        prepare_batches(ref, cur)
