"""Label-noise detection, nbdebug vs cleanlab, measured side by side in one run.

sklearn's bundled digits with 10% and 20% of the labels flipped uniformly at random to
another class (fixed seeds). Out-of-fold probabilities (5 stratified folds) are computed
once per setting and the very same arrays are given to ``cleanlab.filter.find_label_issues``
(its defaults) and to ``nbdebug.find_label_issues``. Prints precision, recall, F1 and time
of each, the ensemble vote over three models, and the time to rank 1,000,000 x 10
probabilities.

    .venv/bin/pip install -e '.[bench]'      # cleanlab
    .venv/bin/python benchmarks/bench_labels.py
"""

from __future__ import annotations

import time
import warnings

import numpy as np
from sklearn.datasets import load_digits
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from nbdebug import find_label_issues

try:
    import cleanlab
    from cleanlab.filter import find_label_issues as cleanlab_find
except ImportError:  # pragma: no cover
    cleanlab = None
    cleanlab_find = None


def flip(y: np.ndarray, rate: float, seed: int, k: int = 10) -> np.ndarray:
    rng = np.random.default_rng(seed)
    noisy = y.copy()
    idx = rng.choice(len(y), round(rate * len(y)), replace=False)
    noisy[idx] = (y[idx] + rng.integers(1, k, len(idx))) % k
    return noisy


def scores(flags: np.ndarray, truth: np.ndarray) -> tuple[float, float, float]:
    tp = int((flags & truth).sum())
    p = tp / max(int(flags.sum()), 1)
    r = tp / max(int(truth.sum()), 1)
    return p, r, 2 * p * r / max(p + r, 1e-12)


def line(name: str, flags: np.ndarray, truth: np.ndarray, seconds: float) -> str:
    p, r, f = scores(flags, truth)
    return (
        f"  {name:<44} precision {p:.3f}  recall {r:.3f}  F1 {f:.3f}  time "
        f"{seconds * 1000:8.1f} ms  flagged {int(flags.sum())}"
    )


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def nb_flags(df) -> np.ndarray:
    return df.sort_index()["is_issue"].to_numpy()


def models(seed: int) -> dict[str, object]:
    return {
        "logreg": make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)),
        "forest": RandomForestClassifier(n_estimators=200, random_state=seed),
        "knn": make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=10)),
    }


def main() -> None:
    warnings.filterwarnings("ignore")
    X, y = load_digits(return_X_y=True)
    print(
        f"digits: {len(y)} samples, 10 classes; cleanlab "
        f"{getattr(cleanlab, '__version__', 'not installed')}"
    )
    find_label_issues(y[:50], pred_probs=np.full((50, 10), 0.1))  # warm-up (imports)
    for rate, seed in ((0.10, 0), (0.20, 1)):
        noisy = flip(y, rate, seed)
        truth = noisy != y
        folds = StratifiedKFold(5, shuffle=True, random_state=seed)
        probs = {
            name: cross_val_predict(m, X, noisy, cv=folds, method="predict_proba")
            for name, m in models(seed).items()
        }
        print(f"\n{rate:.0%} uniform flips (seed {seed}): {int(truth.sum())} wrong labels")
        for name, P in probs.items():
            print(f" out-of-fold {name} probabilities, the same array to both:")
            if cleanlab_find is not None:
                f, t = timed(cleanlab_find, noisy, P)
                print(line("cleanlab find_label_issues (defaults)", f, truth, t))
            df, t = timed(find_label_issues, noisy, pred_probs=P)
            print(line("nbdebug confident_learning (prune=global)", nb_flags(df), truth, t))
            df, t = timed(find_label_issues, noisy, pred_probs=P, prune="noise_rate")
            print(line("nbdebug confident_learning (prune=noise_rate)", nb_flags(df), truth, t))
        stack = [probs[k] for k in probs]
        avg = np.mean(stack, axis=0)
        print(" ensemble of logreg + forest + knn:")
        if cleanlab_find is not None:
            f, t = timed(cleanlab_find, noisy, avg)
            print(line("cleanlab on the averaged probabilities", f, truth, t))
        df, t = timed(find_label_issues, noisy, pred_probs=stack, method="ensemble", tau=0.5)
        print(line("nbdebug ensemble vote (tau=0.5)", nb_flags(df), truth, t))
        s = df.sort_index()
        agreed = s["suggested_label"].to_numpy() >= 0
        right = (s["suggested_label"].to_numpy() == y) & agreed
        print(
            f"  ensemble proposed a corrected label for {int(agreed.sum())} samples, "
            f"{int(right.sum())} of them the true label ({right.sum() / max(agreed.sum(), 1):.1%})"
        )

    n, k = 1_000_000, 10
    rng = np.random.default_rng(0)
    true = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), true] += 3.0
    P = np.exp(logits)
    P /= P.sum(axis=1, keepdims=True)
    noisy = np.where(rng.random(n) < 0.1, (true + rng.integers(1, k, n)) % k, true)
    print(f"\nranking {n:,} x {k} probabilities (10% noise), first call then best of 3:")
    runs = [timed(find_label_issues, noisy, pred_probs=P) for _ in range(3)]
    df = runs[0][0]
    print(line("nbdebug find_label_issues, first call", nb_flags(df), noisy != true, runs[0][1]))
    print(
        line(
            "nbdebug find_label_issues, best of 3",
            nb_flags(df),
            noisy != true,
            min(t for _, t in runs),
        )
    )
    if cleanlab_find is not None:
        cruns = [timed(cleanlab_find, noisy, P, n_jobs=1) for _ in range(3)]
        print(
            line(
                "cleanlab find_label_issues (n_jobs=1), first",
                cruns[0][0],
                noisy != true,
                cruns[0][1],
            )
        )
        print(
            line(
                "cleanlab find_label_issues (n_jobs=1), best of 3",
                cruns[0][0],
                noisy != true,
                min(t for _, t in cruns),
            )
        )
    print(
        "  (nbdebug's time covers validation, the confident joint, flags, top-3 and the ranked "
        f"{len(df.columns)}-column DataFrame; cleanlab's returns a boolean mask)"
    )


if __name__ == "__main__":
    main()
