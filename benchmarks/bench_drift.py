"""nbdebug.drift: speed against a per-feature KS + Benjamini-Hochberg baseline, Evidently
and NannyML, and the calibration of every alarm and flag on no-drift runs (issue 18).

    .venv/bin/python benchmarks/bench_drift.py speed [--trees 100] [--rows 5000] [--repeats 3]
        [--baseline-python /work/driftbase-venv/bin/python]
    .venv/bin/python benchmarks/bench_drift.py calibration [--runs 200] [--models rf,gb,lr,mlp]

speed: 5,000 x 30 reference rows against 5,000 x 30 current rows, a random forest of 100
full-depth trees fitted on another 5,000 rows (not timed), two features of the current batch
shifted by one standard deviation. nbdebug.drift and the baseline (scipy's ks_2samp per
column + false_discovery_control) run interleaved, ``--repeats`` times each; the median of
each and their ratio are printed, with nbdebug's stages. Target: nbdebug <= 5 s.

Evidently (data drift preset) and NannyML (univariate drift, KS, five chunks a batch: its
thresholds come from the reference's chunks; a column is flagged when a chunk alerts) pin older
plotly/pandas, so they are never dependencies of nbdebug: they run in another interpreter,
``--baseline-python PATH`` (default: the ``NBDEBUG_DRIFT_BASELINE_PYTHON`` environment
variable), e.g. a venv made with ``python3.11 -m venv /work/driftbase-venv &&
/work/driftbase-venv/bin/pip install evidently nannyml "pandas<3" pyarrow``. The two frames
go to a temporary parquet file; this script runs itself in that interpreter
(``baseline-worker`` mode, which imports neither nbdebug nor torch), which times each tool
(import excluded, said apart) and reports which columns it flagged. Without it the line
says "not run".

calibration: ``--runs`` no-drift runs per model type (random forest, gradient boosting,
logistic regression, a small torch MLP) on breast_cancer, and two three-class models on
wine (random forest, logistic regression: the default multi-class output, whose class
signs are chosen from each run's predictions): the model is fitted on all rows and each
run compares two random halves, which are exchangeable, so every test's null holds.
Printed per model: the alarm rate, the rate of runs with any input flag, with any
exposure flag, and each family's rejection rate, each with a 95% Wilson interval, against
alpha = 0.05. SHAP values are computed once per model on all rows with a fixed background
(all rows), so a run's values do not depend on which half a row fell in; each run then does
the statistics of drift() (drift_from_shap) on its halves. ``--models`` picks the rows
(rf, gb, lr, mlp, rf-wine, lr-wine), so each can run on its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np


def ks_bh_baseline(ref: np.ndarray, cur: np.ndarray, alpha: float = 0.05) -> list[int]:
    """The drift check people write by hand: KS per column, Benjamini-Hochberg."""
    from scipy.stats import false_discovery_control, ks_2samp

    p = np.array([ks_2samp(ref[:, j], cur[:, j]).pvalue for j in range(ref.shape[1])])
    return [int(j) for j in np.flatnonzero(false_discovery_control(p) <= alpha)]


# ------------------------------------------------------------------ Evidently and NannyML


NANNYML_CHUNKS = 5


def baseline_worker(ref_path: str, cur_path: str) -> None:
    """Runs inside the baseline interpreter: times Evidently's data drift preset and
    NannyML's univariate drift on the two parquet frames, prints one JSON line."""
    import pandas as pd

    os.environ.setdefault("NML_DISABLE_USAGE_LOGGING", "1")  # no telemetry calls
    os.environ.setdefault("DO_NOT_TRACK", "1")
    warnings.simplefilter("ignore")
    ref, cur = pd.read_parquet(ref_path), pd.read_parquet(cur_path)
    cols = list(ref.columns)
    out: dict[str, object] = {}

    t = time.perf_counter()
    try:
        from evidently import Report
        from evidently.presets import DataDriftPreset

        imported = time.perf_counter() - t
        t = time.perf_counter()
        snap = Report([DataDriftPreset()]).run(cur, ref)
        flagged = []
        for m in snap.dict()["metrics"]:
            cfg = m.get("config", {})
            if cfg.get("type", "").endswith("ValueDrift") and isinstance(m["value"], float):
                # Evidently's own rule: a distance drifts above its threshold, a p-value below
                stat = m["value"]
                bad = (
                    stat >= cfg["threshold"]
                    if "distance" in m["metric_name"].lower()
                    else (stat < cfg["threshold"])
                )
                if bad:
                    flagged.append(cfg["column"])
        out["evidently"] = {
            "seconds": time.perf_counter() - t,
            "import": imported,
            "flagged": flagged,
            "version": __import__("evidently").__version__,
        }
    except Exception as e:  # report, do not hide: the line says what failed
        out["evidently"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    t = time.perf_counter()
    try:
        import nannyml as nml

        imported = time.perf_counter() - t
        t = time.perf_counter()
        # NannyML's thresholds come from the spread of the statistic over the reference's
        # chunks (one chunk gives none): five chunks a batch, a column flagged when any of
        # the current batch's chunks alerts
        calc = nml.UnivariateDriftCalculator(
            column_names=cols,
            chunk_number=NANNYML_CHUNKS,
            continuous_methods=["kolmogorov_smirnov"],
        )
        calc.fit(ref)
        df = calc.calculate(cur).filter(period="analysis").to_df()
        flagged = [c for c in cols if bool(df[(c, "kolmogorov_smirnov", "alert")].any())]
        out["nannyml"] = {
            "seconds": time.perf_counter() - t,
            "import": imported,
            "flagged": flagged,
            "version": nml.__version__,
        }
    except Exception as e:
        out["nannyml"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(json.dumps(out))


def run_baselines(python: str | None, ref: np.ndarray, cur: np.ndarray) -> dict | None:
    """Evidently and NannyML in ``python`` (another interpreter), or None without one."""
    if not python:
        return None
    import pandas as pd

    cols = [f"x{j}" for j in range(ref.shape[1])]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(Path(tmp) / "reference.parquet"), str(Path(tmp) / "current.parquet")]
        pd.DataFrame(ref, columns=cols).to_parquet(paths[0])
        pd.DataFrame(cur, columns=cols).to_parquet(paths[1])
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(
            [python, str(Path(__file__).resolve()), "baseline-worker", *paths],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"{python} exited {done.returncode}: {tail[0][:200]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _flag_names(cols: list[str]) -> str:
    return "[" + ", ".join(cols[:6]) + (f", +{len(cols) - 6}" if len(cols) > 6 else "") + "]"


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
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):  # interleaved, side by side
        t = time.perf_counter()
        rep = drift(model, ref, cur, progress=False)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        flagged = ks_bh_baseline(ref, cur)
        base.append(time.perf_counter() - t)
        load.append(os.getloadavg()[0])
    assert rep is not None
    others = run_baselines(args.baseline_python, ref, cur)
    load.append(os.getloadavg()[0])
    m_ours, m_base = statistics.median(ours), statistics.median(base)
    print(
        f"bench_drift speed: {n} x {d} reference vs {n} x {d} current, RandomForestClassifier"
        f"(n_estimators={args.trees}, max_depth={args.depth}: deepest tree {depth}); model fit "
        f"{fit_s:.1f} s (not counted); load average {min(load):.1f}-{max(load):.1f} on "
        f"{os.cpu_count()} cores; median of {args.repeats}, interleaved; shifted: x0, x1"
    )
    print(
        f"  nbdebug.drift      {m_ours:7.2f} s   target <= {args.target:.0f} s: "
        f"{'PASS' if m_ours <= args.target else 'FAIL'}   flags {_flag_names(rep.drifted_inputs)}"
    )
    print(
        f"  scipy KS + BH      {m_base:7.2f} s   ratio nbdebug / baseline {m_ours / m_base:.0f}x"
        f"   flags {_flag_names(['x' + str(j) for j in flagged])}"
    )
    if others is None:
        print("  Evidently, NannyML: not run (no baseline environment: --baseline-python)")
    elif "error" in others:
        print(f"  Evidently, NannyML: failed ({others['error']})")
    else:
        for tool, label in (("evidently", "Evidently preset"), ("nannyml", "NannyML univariate")):
            r = others[tool]
            if "error" in r:
                print(f"  {label:<18} failed: {r['error']}")
                continue
            print(
                f"  {label:<18} {r['seconds']:7.2f} s   ratio nbdebug / it "
                f"{m_ours / r['seconds']:.1f}x"
                f"   flags {_flag_names(r['flagged'])}   (v{r['version']}, one run, import "
                f"{r['import']:.1f} s not counted)"
            )
    total = sum(rep.timings.values())
    for stage, secs in rep.timings.items():
        print(f"    {stage:<16} {secs:7.2f} s  ({secs / total:5.1%})")
    m = len(rep.reference_rows) + len(rep.current_rows)
    print(
        f"  SHAP on {len(rep.reference_rows)} + {len(rep.current_rows)} stratified rows "
        f"(CDF error <= {rep.sampling_error:.3f} at 95%, DKW) with {rep.explainer}: "
        f"{rep.timings['shap'] / m * 1000:.0f} ms a row; input tests on all rows"
    )
    print(
        f"  nbdebug: alarm={rep.alarm}, exposure shares "
        f"{rep.features['exposure_share'].head(3).round(2).to_dict()}"
    )
    print(f"  headline: {rep.headline}")


# ---------------------------------------------------------------------------- calibration


def _wilson(k: int, n: int) -> tuple[float, float]:
    z = 1.96
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return c - h, c + h


MODELS = {
    "rf": "random forest",
    "gb": "gradient boosting",
    "lr": "logistic regression",
    "mlp": "torch MLP",
    "rf-wine": "random forest, wine",
    "lr-wine": "logistic reg., wine",
}


def _model(key: str):  # type: ignore[no-untyped-def]
    """(x, model) for one calibration row: the model fitted on all standardised rows."""
    import torch
    from sklearn.datasets import load_breast_cancer, load_wine
    from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    b = load_wine() if key.endswith("wine") else load_breast_cancer()
    x = StandardScaler().fit_transform(b.data)
    y = b.target
    if key == "mlp":
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.Adam(mlp.parameters(), lr=0.01)
        xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
        for _ in range(200):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(mlp(xt), yt).backward()
            opt.step()
        return x, mlp
    if key.startswith("rf"):
        return x, RandomForestClassifier(n_estimators=40, random_state=0).fit(x, y)
    if key == "gb":
        return x, GradientBoostingClassifier(n_estimators=40, random_state=0).fit(x, y)
    return x, LogisticRegression(max_iter=5000).fit(x, y)


def calibration(args: argparse.Namespace) -> None:
    from nbdebug.analysis.drift import drift_from_shap, explain_batches, moved_direction
    from nbdebug.analysis.drift.models import adapt_model

    alpha = 0.05
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    bad = [k for k in keys if k not in MODELS]
    if bad:
        raise SystemExit(f"--models takes a comma list of {list(MODELS)}; got {bad}.")
    print(
        f"bench_drift calibration: breast_cancer (569 rows) and wine (178 rows), {args.runs} "
        f"no-drift runs per model (random halves), alpha={alpha}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    cols = ["alarm", "any input flag", "any exposure flag", "inputs", "explanations"]
    cols += ["cluster shares", "classifier"]
    print(f"  {'model':<20} {'explainer':<26} " + " ".join(f"{c:>18}" for c in cols))
    for key in keys:
        t = time.perf_counter()
        x, model = _model(key)
        n = len(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adapter = adapt_model(model, x.shape[1])
            multi = key.endswith("wine")
            outputs = range(3) if multi else ["auto"]
            per_output = [
                explain_batches(model, x, x[:2], background=n, output=o, progress=False)
                for o in outputs
            ]
            preds = adapter.predict(x) if multi else None
        counts = dict.fromkeys(cols, 0)
        for seed in range(args.runs):
            idx = np.random.default_rng(10_000 + seed).permutation(n)
            a, b = np.sort(idx[: n // 2]), np.sort(idx[n // 2 :])
            if preds is not None:  # drift()'s default output: the signed sum of the classes
                signs = moved_direction(preds[a], preds[b])
                shap_all = sum(sv.reference * s for sv, s in zip(per_output, signs))
            else:
                shap_all = per_output[0].reference
            rep = drift_from_shap(
                x[a], x[b], shap_all[a], shap_all[b], random_state=seed, progress=False
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
            f"  {MODELS[key]:<20} {per_output[0].explainer.split(' (')[0]:<26} "
            + " ".join(f"{c:>18}" for c in cells)
            + f"   ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    print(
        "  each cell: rate [95% Wilson interval]; every rate's level is alpha = 0.05; across "
        "families: weighted Holm (inputs 0.4, explanations 0.3, cluster shares 0.15, "
        "classifier 0.15)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("mode", choices=["speed", "calibration", "baseline-worker"], nargs="?")
    ap.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--features", type=int, default=30)
    ap.add_argument("--trees", type=int, default=100)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", type=float, default=5.0, help="seconds")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    ap.add_argument(
        "--baseline-python",
        default=os.environ.get("NBDEBUG_DRIFT_BASELINE_PYTHON"),
        help="an interpreter with evidently and nannyml installed "
        "(default: $NBDEBUG_DRIFT_BASELINE_PYTHON)",
    )
    args = ap.parse_args()
    if args.mode == "baseline-worker":
        baseline_worker(*args.paths)
    elif args.mode == "calibration":
        calibration(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
