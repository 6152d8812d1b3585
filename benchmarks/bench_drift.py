"""Speed of nbdebug.drift: 5,000 x 30 reference rows against 5,000 x 30 current rows with a
random forest (issue 7: under 30 s in total on this machine), time per stage printed.

    .venv/bin/python benchmarks/bench_drift.py [--trees 50] [--depth 8] [--rows 5000]

The forest is trained on a separate 5,000 rows (not timed). Two features of the current
batch are shifted by one standard deviation, so every stage has real work to do.
"""

from __future__ import annotations

import argparse
import os
import time

from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier

from nbdebug.analysis.drift import drift


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--features", type=int, default=30)
    ap.add_argument("--trees", type=int, default=50)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--target", type=float, default=30.0, help="seconds")
    args = ap.parse_args()

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

    t = time.perf_counter()
    rep = drift(model, ref, cur, progress=False)
    total = time.perf_counter() - t

    print(
        f"bench_drift: {n} x {d} reference vs {n} x {d} current, RandomForestClassifier"
        f"(n_estimators={args.trees}, max_depth={args.depth}); model fit {fit_s:.1f} s "
        f"(not counted); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    for stage, secs in rep.timings.items():
        print(f"  {stage:<16} {secs:7.2f} s  ({secs / total:5.1%})")
    other = total - sum(rep.timings.values())
    print(f"  {'other':<16} {other:7.2f} s  ({other / total:5.1%})")
    print(
        f"  total            {total:7.2f} s  target < {args.target:.0f} s: "
        f"{'PASS' if total < args.target else 'FAIL'} (ratio {total / args.target:.2f})"
    )
    print(
        f"  result: alarm={rep.alarm}, inputs drifted {rep.drifted_inputs}, "
        f"{rep.cluster_test.k} clusters, classifier AUC {rep.classifier.auc:.3f}"
    )


if __name__ == "__main__":
    main()
