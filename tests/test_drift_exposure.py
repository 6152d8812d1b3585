"""Exposure (issue 18, item 1): the quadrant says whether predictions moved, across
explainers, with the prediction change measured directly on the model.

For each case a few features of the current batch are shifted. For each shifted feature
``j`` the test measures what the shift alone does to the explained output: the mean
``|f(current with j shifted) - f(current)|`` over the current rows, divided by the
spread (std) of ``f`` over the reference. A feature whose shift moves predictions by at
least 0.10 of that spread (twice the materiality threshold) must be labelled
"input+explanation" (the model acts on it); one that moves them by at most 0.02 must be
"input only". The cases are built so that every shifted feature falls clearly on one side
(asserted first).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from nbdebug.analysis.drift import drift
from nbdebug.analysis.drift.exposure import EXPOSURE_MIN
from nbdebug.figures.drift import exposure_bars
from nbdebug.figures.palette import LIGHT_GREY

MOVES, STILL = 0.10, 0.02


@functools.cache
def cancer() -> tuple[np.ndarray, np.ndarray, list[str]]:
    b = load_breast_cancer()
    x = StandardScaler().fit_transform(b.data)
    x.setflags(write=False)
    return x, b.target, [str(f) for f in b.feature_names]


def _run(model, ref, cur, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return drift(model, ref, cur, progress=False, **kw)


def _moved(f, ref: np.ndarray, cur: np.ndarray, j: int, delta: float) -> float:
    """What shifting feature j alone does to the explained output, in reference stds."""
    shifted = cur.copy()
    shifted[:, j] += delta
    return float(np.mean(np.abs(f(shifted) - f(cur))) / np.std(f(ref)))


def _check(rep, f, ref, cur_before, shifts: dict[int, float], names: list[str]) -> list[str]:
    lines = []
    for j, delta in shifts.items():
        moved = _moved(f, ref, cur_before, j, delta)
        q = rep.features.loc[names[j], "quadrant"]
        lines.append(f"{names[j]}: prediction change {moved:.3f} std -> {q}")
        assert moved >= MOVES or moved <= STILL, f"case not clear-cut: {lines[-1]}"
        expected = "input+explanation" if moved >= MOVES else "input only"
        assert q == expected, lines[-1]
    return lines


def _split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    return idx[: n // 2], idx[n // 2 :]


def _shift(x: np.ndarray, rows: np.ndarray, shifts: dict[int, float]) -> np.ndarray:
    cur = x[rows].copy()
    for j, delta in shifts.items():
        cur[:, j] += delta
    return cur


def _pick(rep, names: list[str], top: int, low: int) -> list[int]:
    imp = rep.features["shap_importance"].sort_values(ascending=False)
    chosen = list(imp.index[:top]) + list(imp.index[-low:])
    return [names.index(c) for c in chosen]


@pytest.mark.parametrize("kind", ["rf", "gb"])
def test_tree_explainer_labels_follow_prediction_change(kind, capsys):
    x, y, names = cancer()
    model = (
        RandomForestClassifier(n_estimators=40, random_state=0, n_jobs=1)
        if kind == "rf"
        else GradientBoostingClassifier(n_estimators=40, max_depth=2, random_state=0)
    ).fit(x, y)
    if kind == "rf":

        def f(a):
            return model.predict_proba(a)[:, 1]
    else:

        def f(a):
            return model.decision_function(a)

    for seed in range(2):
        a, b = _split(len(x), seed)
        base = _run(model, x[a], x[b], random_state=seed, feature_names=names)
        assert base.explainer.startswith("TreeExplainer")
        cols = _pick(base, names, 2, 2)
        shifts = {j: float(x[a][:, j].std()) for j in cols}
        rep = _run(model, x[a], _shift(x, b, shifts), random_state=seed, feature_names=names)
        lines = _check(rep, f, x[a], x[b], shifts, names)
        acted = rep.features["quadrant"] == "input+explanation"
        assert rep.features.loc[acted, "exposure_share"].sum() >= 0.7
        with capsys.disabled():
            print(f"\n  [exposure] {kind} seed {seed}: " + "; ".join(lines), end="")


def test_linear_explainer_exposure_is_the_prediction_shift():
    """A linear model's SHAP column is coef * (x - mean): shifting one feature by delta moves
    its SHAP mean by exactly coef * delta, the mean change of the decision function, and the
    features with near-zero coefficients (their SHAP KS test repeats the input KS test) are
    "input only"."""
    x, y, names = cancer()
    lr = LogisticRegression(max_iter=5000).fit(x, y)
    a, b = _split(len(x), 3)
    base = _run(lr, x[a], x[b], random_state=3, feature_names=names)
    assert base.explainer == "LinearExplainer"
    cols = _pick(base, names, 2, 3)
    shifts = {j: float(x[a][:, j].std()) for j in cols}
    rep = _run(lr, x[a], _shift(x, b, shifts), random_state=3, feature_names=names)
    _check(rep, lr.decision_function, x[a], x[b], shifts, names)
    for j, delta in shifts.items():
        expected = lr.coef_[0, j] * delta
        assert rep.features.loc[names[j], "shap_mean_shift"] - base.features.loc[
            names[j], "shap_mean_shift"
        ] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # the shifts of the mean SHAP values add up to the shift of the mean decision function
    total = lr.decision_function(_shift(x, b, shifts)).mean() - lr.decision_function(x[a]).mean()
    assert rep.prediction_shift == pytest.approx(total, rel=1e-6)
    assert rep.features["shap_mean_shift"].sum() == pytest.approx(total, rel=1e-6)


def test_kernel_explainer_on_a_small_function():
    rng = np.random.default_rng(0)
    ref, cur0 = rng.normal(size=(60, 4)), rng.normal(size=(60, 4))

    def f(a):
        return 3.0 * a[:, 0] + 0.01 * a[:, 1] + a[:, 2] * a[:, 3]

    shifts = {0: 1.0, 1: 1.0}
    cur = cur0.copy()
    cur[:, 0] += 1.0
    cur[:, 1] += 1.0
    rep = _run(f, ref, cur, background=15, random_state=0)
    assert rep.explainer.startswith("KernelExplainer")
    _check(rep, f, ref, cur0, shifts, rep.feature_names)


class Lopsided(torch.nn.Module):
    """A small MLP whose first input matters and whose second hardly does."""

    def __init__(self, d: int):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        with torch.no_grad():
            self.net[0].weight[:, 0] *= 8.0
            self.net[0].weight[:, 1] *= 0.002

    def forward(self, x):
        return self.net(x).squeeze(-1)


def test_torch_model_labels_follow_prediction_change():
    x, _, names = cancer()
    d = 8
    model = Lopsided(d)

    def f(a):
        with torch.no_grad():
            return model(torch.tensor(a, dtype=torch.float32)).double().numpy()

    a, b = _split(len(x), 5)
    ref = x[a][:, :d]
    shifts = {0: 1.0, 1: 1.0}
    cur0 = x[b][:, :d]
    cur = cur0.copy()
    cur[:, 0] += 1.0
    cur[:, 1] += 1.0
    rep = _run(model, ref, cur, background=40, random_state=0, feature_names=names[:d])
    assert rep.explainer.startswith(("DeepExplainer", "GradientExplainer"))
    _check(rep, f, ref, cur0, shifts, names[:d])


def test_threshold_is_stated_and_headline_says_what_moved():
    x, y, names = cancer()
    lr = LogisticRegression(max_iter=5000).fit(x, y)
    a, b = _split(len(x), 1)
    rep = _run(lr, x[a], x[b], feature_names=names)
    assert rep.headline.startswith("Nothing drifted") and rep.details.startswith(rep.headline)
    assert f"{EXPOSURE_MIN:.0%} of the output's spread" in rep.details
    j = int(np.argmax(np.abs(lr.coef_[0])))
    cur = x[b].copy()
    cur[:, j] += 1.0
    rep = _run(lr, x[a], cur, feature_names=names)
    assert f"the model acts on `{names[j]}`" in rep.headline
    assert "of the prediction shift" in rep.headline and rep.headline.count(".") <= 2


def test_the_share_bars_say_when_no_feature_moves_predictions():
    x, y, names = cancer()
    lr = LogisticRegression(max_iter=5000).fit(x, y)
    a, b = _split(len(x), 1)
    quiet = _run(lr, x[a], x[b], feature_names=names)
    fig = exposure_bars(quiet)
    assert "no feature moves predictions materially" in fig.layout.title.text
    assert set(fig.data[0].marker.color) == {LIGHT_GREY}  # noise is not coloured as a cause
    j = int(np.argmax(np.abs(lr.coef_[0])))
    cur = x[b].copy()
    cur[:, j] += 1.0
    moved = exposure_bars(_run(lr, x[a], cur, feature_names=names))
    assert moved.layout.title.text == "Share of the prediction shift, by feature"
    assert moved.data[0].y[-1] == names[j]  # the largest share, at the top
    assert moved.data[0].marker.color[-1] != LIGHT_GREY
