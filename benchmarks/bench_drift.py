"""nbdebug.drift: speed against a per-feature KS + Benjamini-Hochberg baseline, and the
calibration of every alarm and flag on no-drift runs (issue 18, items 2 and 3).

    .venv/bin/python benchmarks/bench_drift.py speed [--trees 100] [--rows 5000] [--repeats 3]
    .venv/bin/python benchmarks/bench_drift.py calibration [--runs 200]

speed: 5,000 x 30 reference rows against 5,000 x 30 current rows, a random forest of 100
full-depth trees fitted on another 5,000 rows (not timed), two features of the current batch
shifted by one standard deviation. nbdebug.drift and the baseline (scipy's ks_2samp per
column + false_discovery_control) run interleaved, ``--repeats`` times each; the median of
each and their ratio are printed, with nbdebug's stages. Target: nbdebug <= 5 s.
Evidently and NannyML are not run: they pin older plotly/pandas, so they would need a
separate environment, which this machine does not have (and nothing is downloaded here).

calibration: ``--runs`` no-drift runs per model type (random forest, gradient boosting,
logistic regression, a small torch MLP) on breast_cancer: the model is fitted on all 569
rows and each run compares two random halves, which are exchangeable, so every test's null
holds. Printed per model: the alarm rate, the rate of runs with any input flag, with any
exposure flag, and each family's rejection rate, each with a 95% Wilson interval, against
alpha = 0.05. SHAP values are computed once per model on all rows with a fixed background
(all rows), so a run's values do not depend on which half a row fell in; each run then does
the statistics of drift() (drift_from_shap) on its halves.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings

import numpy as np


def ks_bh_baseline(ref: np.ndarray, cur: np.ndarray, alpha: float = 0.05) -> list[int]:
    """The drift check people write by hand: KS per column, Benjamini-Hochberg."""
    from scipy.stats import false_discovery_control, ks_2samp

    p = np.array([ks_2samp(ref[:, j], cur[:, j]).pvalue for j in range(ref.shape[1])])
    return [int(j) for j in np.flatnonzero(false_discovery_control(p) <= alpha)]


def speed(args: argparse.Namespace) -> None:
    from sklearn.datasets import make_classification
    from sklearn.ensemble import RandomForestClassifier

    from nbdebug.analysis.drift import drift

    n, d = args.rows, args.features
    x, y = make_classification(
        n_samples=3 * n, n_features=d, n_informative=10, n_redundant=5, random_state=0
    )
    train, ref, cur = x[:n], x[n : 2 * n], x[2 * n :].copy()
    cur[:, :2] += ref[:, :2].std(axis=0)
    t = time.perf_counter()
    model = RandomForestClassifier(
        n_estimators=args.trees, max_depth=args.depth, n_jobs=1, random_state=0
    ).fit(train, y[:n])
    fit_s = time.perf_counter() - t
    depth = max(e.tree_.max_depth for e in model.estimators_)

    ours, base, rep, flagged = [], [], None, []
    for _ in range(args.repeats):  # interleaved, side by side
        t = time.perf_counter()
        rep = drift(model, ref, cur, progress=False)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        flagged = ks_bh_baseline(ref, cur)
        base.append(time.perf_counter() - t)
    assert rep is not None
    m_ours, m_base = statistics.median(ours), statistics.median(base)
    print(
        f"bench_drift speed: {n} x {d} reference vs {n} x {d} current, RandomForestClassifier"
        f"(n_estimators={args.trees}, max_depth={args.depth}: deepest tree {depth}); model fit "
        f"{fit_s:.1f} s (not counted); load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; median of {args.repeats}, interleaved"
    )
    print(
        f"  nbdebug.drift      {m_ours:7.2f} s   target <= {args.target:.0f} s: "
        f"{'PASS' if m_ours <= args.target else 'FAIL'}"
    )
    print(f"  scipy KS + BH      {m_base:7.2f} s   ratio nbdebug / baseline {m_ours / m_base:.0f}x")
    print("  Evidently, NannyML: not run (they pin older plotly/pandas: separate env needed)")
    total = sum(rep.timings.values())
    for stage, secs in rep.timings.items():
        print(f"    {stage:<16} {secs:7.2f} s  ({secs / total:5.1%})")
    print(
        f"  SHAP on {len(rep.reference_rows)} + {len(rep.current_rows)} stratified rows "
        f"(CDF error <= {rep.sampling_error:.3f} at 95%, DKW); input tests on all rows"
    )
    print(
        f"  nbdebug: alarm={rep.alarm}, inputs drifted {rep.drifted_inputs}, exposure shares "
        f"{rep.features['exposure_share'].head(3).round(2).to_dict()}; baseline flags "
        f"{['x' + str(j) for j in flagged]}"
    )
    print(f"  headline: {rep.headline}")


def _wilson(k: int, n: int) -> tuple[float, float]:
    z = 1.96
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return c - h, c + h


def _models():  # type: ignore[no-untyped-def]
    import torch
    from sklearn.datasets import load_breast_cancer
    from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    b = load_breast_cancer()
    x = StandardScaler().fit_transform(b.data)
    y = b.target
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(mlp.parameters(), lr=0.01)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(mlp(xt), yt).backward()
        opt.step()
    return x, {
        "random forest": RandomForestClassifier(n_estimators=40, random_state=0).fit(x, y),
        "gradient boosting": GradientBoostingClassifier(n_estimators=40, random_state=0).fit(x, y),
        "logistic regression": LogisticRegression(max_iter=5000).fit(x, y),
        "torch MLP": mlp,
    }


def calibration(args: argparse.Namespace) -> None:
    from nbdebug.analysis.drift import drift_from_shap
    from nbdebug.analysis.explain import explain_batches

    alpha = 0.05
    x, models = _models()
    n = len(x)
    print(
        f"bench_drift calibration: breast_cancer, {args.runs} no-drift runs per model "
        f"(random halves {n // 2} vs {n - n // 2}), alpha={alpha}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    cols = ["alarm", "any input flag", "any exposure flag", "inputs", "explanations"]
    cols += ["cluster shares", "classifier"]
    print(f"  {'model':<20} {'explainer':<26} " + " ".join(f"{c:>18}" for c in cols))
    for name, model in models.items():
        t = time.perf_counter()
        src = x
        if name == "torch MLP":
            import torch

            src = torch.tensor(x, dtype=torch.float32)  # type: ignore[assignment]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sv = explain_batches(model, x, x[:2], background=n, progress=False)
        del src
        counts = dict.fromkeys(cols, 0)
        for seed in range(args.runs):
            idx = np.random.default_rng(10_000 + seed).permutation(n)
            a, b = np.sort(idx[: n // 2]), np.sort(idx[n // 2 :])
            rep = drift_from_shap(
                x[a], x[b], sv.reference[a], sv.reference[b], random_state=seed, progress=False
            )
            counts["alarm"] += rep.alarm
            counts["any input flag"] += bool(rep.features["drifted_input"].any())
            counts["any exposure flag"] += bool(rep.features["drifted_explanation"].any())
            for fam in ("inputs", "explanations", "cluster shares", "classifier"):
                counts[fam] += bool(rep.tests.loc[fam, "p_adjusted"] <= alpha)
        cells = []
        for c in cols:
            lo, hi = _wilson(counts[c], args.runs)
            cells.append(f"{counts[c] / args.runs:.3f} [{lo:.2f},{hi:.2f}]")
        print(
            f"  {name:<20} {sv.explainer.split(' (')[0]:<26} "
            + " ".join(f"{c:>18}" for c in cells)
            + f"   ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    print("  each cell: rate [95% Wilson interval]; every rate's level is alpha = 0.05")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("mode", choices=["speed", "calibration"], nargs="?", default="speed")
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--features", type=int, default=30)
    ap.add_argument("--trees", type=int, default=100)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", type=float, default=5.0, help="seconds")
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    speed(args) if args.mode == "speed" else calibration(args)


if __name__ == "__main__":
    main()
