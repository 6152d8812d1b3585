"""Label-noise detection, nbdebug vs cleanlab, measured side by side in one run.

The grid: every bundled scikit-learn classification set (digits, wine, iris, breast_cancer)
and one ``make_classification`` set (1000 samples, 5 classes, fixed seed); two kinds of
injected noise at 5, 10, 20, 30 and 40 %:

* ``uniform``: that fraction of the samples, chosen at random, gets another class drawn
  uniformly;
* ``class``: class-conditional (asymmetric) noise: class ``i`` is flipped at its own rate,
  the nominal rate times a factor spread evenly from 0.5 to 1.5 over the classes (in a
  random order, capped at 45 %), 80 % of its flips going to one other class drawn per
  class, the rest uniformly to the others (for two classes: all to the other one);

several seeds (the noise and the folds), and three probability models (standardised
logistic regression, a 100-tree random forest, standardised 10-NN). Out-of-fold
probabilities (5 stratified folds) are computed once per dataset, noise, rate, seed and
model, and the very same array is given to ``cleanlab.filter.find_label_issues`` (its
defaults, with ``n_jobs=1``, which changes no flag) and to every ``prune`` option of
``nbdebug.find_label_issues``. The table is the F1 of the flags against the injected
noise, averaged over seeds and models; then the average per dataset (the rule the default
is chosen by: never below cleanlab's), per model, the ensemble vote, and the time of the
whole ``find_label_issues`` call against cleanlab's on 30,000, 300,000 and 1,000,000 x 10
probabilities (medians of interleaved pairs, one thread; target: no slower than cleanlab).

    .venv/bin/pip install -e '.[bench]'      # cleanlab (2.9 measured)
    .venv/bin/python benchmarks/bench_labels.py            # full grid
    .venv/bin/python benchmarks/bench_labels.py --quick    # rates 10 and 30 %, 1 seed
    .venv/bin/python benchmarks/bench_labels.py --timing-only   # the timing alone

The full grid is 450 out-of-fold arrays, single-threaded: about 5 min on two quiet cores
(14 and 23 min measured under loads of 10 and 15 on two cores); ``--quick`` is 60 arrays
(1 min quiet).
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import defaultdict
from collections.abc import Callable

import numpy as np
from sklearn.datasets import (
    load_breast_cancer,
    load_digits,
    load_iris,
    load_wine,
    make_classification,
)
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from nbdebug import find_label_issues

try:
    import cleanlab
    from cleanlab.filter import find_label_issues as cleanlab_find
except ImportError:  # pragma: no cover
    cleanlab = None
    cleanlab_find = None

RATES = (0.05, 0.10, 0.20, 0.30, 0.40)
NOISES = ("uniform", "class")
MODELS = ("logreg", "forest", "knn")
DEFAULT = "threshold_margin"
OPTIONS = ("threshold_margin", "global", "noise_rate")


def datasets() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {
        name: fn(return_X_y=True)
        for name, fn in (
            ("digits", load_digits),
            ("wine", load_wine),
            ("iris", load_iris),
            ("breast_cancer", load_breast_cancer),
        )
    }
    out["make_classification"] = make_classification(
        n_samples=1000,
        n_features=20,
        n_informative=8,
        n_redundant=4,
        n_classes=5,
        n_clusters_per_class=1,
        class_sep=1.2,
        random_state=0,
    )
    return out


def uniform_noise(y: np.ndarray, rate: float, rng: np.random.Generator, k: int) -> np.ndarray:
    noisy = y.copy()
    idx = rng.choice(len(y), round(rate * len(y)), replace=False)
    noisy[idx] = (y[idx] + rng.integers(1, k, len(idx))) % k
    return noisy


def class_noise(y: np.ndarray, rate: float, rng: np.random.Generator, k: int) -> np.ndarray:
    noisy = y.copy()
    factor = rng.permutation(np.linspace(0.5, 1.5, k))
    for i in range(k):
        rows = np.flatnonzero(y == i)
        m = round(min(rate * factor[i], 0.45) * len(rows))
        others = np.array([c for c in range(k) if c != i])
        p = np.full(len(others), 0.2 / max(len(others) - 1, 1))
        p[others == rng.choice(others)] = 0.8
        noisy[rng.choice(rows, m, replace=False)] = rng.choice(others, m, p=p / p.sum())
    return noisy


def models(seed: int) -> dict[str, object]:
    return {
        "logreg": make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)),
        "forest": RandomForestClassifier(n_estimators=100, random_state=seed),
        "knn": make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=10)),
    }


def f1(flags: np.ndarray, truth: np.ndarray) -> float:
    tp = int((flags & truth).sum())
    p = tp / max(int(flags.sum()), 1)
    r = tp / max(int(truth.sum()), 1)
    return 2 * p * r / max(p + r, 1e-12)


def nb_flags(labels: np.ndarray, probs, **kw) -> np.ndarray:
    return find_label_issues(labels, pred_probs=probs, **kw).sort_index()["is_issue"].to_numpy()


def detectors() -> dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    out: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {}
    if cleanlab_find is not None:
        # n_jobs=1: the same flags as its default (it only parallelises over classes),
        # without starting a process pool per call
        out["cleanlab"] = lambda y, P: cleanlab_find(y, P, n_jobs=1)
    for opt in OPTIONS:
        out[opt] = lambda y, P, opt=opt: nb_flags(y, P, prune=opt)
    out["pred_neq_given"] = lambda y, P: nb_flags(y, P, method="predicted_neq_given")
    return out


def oof_cache(rates, seeds) -> dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(dataset, noise, rate, seed, model) -> (true labels, noisy labels, oof probabilities)."""
    cache = {}
    for dname, (X, y) in datasets().items():
        k = int(y.max()) + 1
        for noise, inject in (("uniform", uniform_noise), ("class", class_noise)):
            for rate in rates:
                for seed in seeds:
                    rng = np.random.default_rng([seed, round(rate * 100), noise == "class"])
                    noisy = inject(y, rate, rng, k)
                    folds = StratifiedKFold(5, shuffle=True, random_state=seed)
                    for mname, m in models(seed).items():
                        P = cross_val_predict(m, X, noisy, cv=folds, method="predict_proba")
                        cache[(dname, noise, rate, seed, mname)] = (y, noisy, P)
    return cache


def table(cache, rates, seeds) -> None:
    dets = detectors()
    names = list(dets)
    score: dict[tuple, list[float]] = defaultdict(list)
    ens: dict[tuple, list[float]] = defaultdict(list)
    for (d, noise, rate, seed, m), (y, noisy, P) in cache.items():
        truth = noisy != y
        for name, fn in dets.items():
            s = f1(fn(noisy, P), truth)
            for key in ((d, noise, rate), (d,), (d, m), (m,)):
                score[(*key, name)].append(s)
        if m == MODELS[-1]:  # every model of this setting is in the cache: the ensemble
            stack = [cache[(d, noise, rate, seed, mm)][2] for mm in MODELS]
            flags = nb_flags(noisy, stack, method="ensemble", tau=0.5)
            ens[(d, "nbdebug")].append(f1(flags, truth))
            if cleanlab_find is not None:
                avg = np.mean(stack, axis=0)
                ens[(d, "cleanlab")].append(f1(cleanlab_find(noisy, avg, n_jobs=1), truth))
    dnames = list(dict.fromkeys(k[0] for k in cache))
    head = f"{'dataset':<20}{'noise':<8}{'rate':>5}" + "".join(f"{n:>17}" for n in names)
    print(f"\nF1 against the injected noise, mean over {len(seeds)} seed(s) x {len(MODELS)} models")
    print(head)
    print("-" * len(head))
    for d in dnames:
        for noise in NOISES:
            for rate in rates:
                row = [np.mean(score[(d, noise, rate, n)]) for n in names]
                best = max(row)
                cells = "".join(
                    f"{v:>16.3f}{'*' if v == best else ' '}" for v, n in zip(row, names)
                )
                print(f"{d:<20}{noise:<8}{rate:>5.0%}{cells}")
    print("-" * len(head))
    print(
        "mean F1 per dataset (over noises, rates, seeds, models; "
        f"{len(cache) // len(dnames)} runs each)"
    )
    worst = np.inf
    for d in dnames:
        row = [np.mean(score[(d, n)]) for n in names]
        print(f"{d:<33}" + "".join(f"{v:>16.4f} " for v in row))
        if "cleanlab" in names:
            worst = min(worst, row[names.index(DEFAULT)] - row[names.index("cleanlab")])
    print("mean F1 per model (over datasets)")
    for m in MODELS:
        print(f"{m:<33}" + "".join(f"{np.mean(score[(m, n)]):>16.4f} " for n in names))
    if "cleanlab" in names:
        print(
            f"default prune={DEFAULT!r} minus cleanlab, worst dataset: {worst:+.4f} "
            f"({'never below' if worst >= 0 else 'BELOW'} cleanlab on average F1 per dataset)"
        )
        print("\nensemble of the three models (mean F1 per dataset)")
        print(f"{'':<33}{'nbdebug vote (tau=0.5)':>24}{'cleanlab on averaged probs':>30}")
        for d in dnames:
            print(
                f"{d:<33}{np.mean(ens[(d, 'nbdebug')]):>24.4f}"
                f"{np.mean(ens[(d, 'cleanlab')]):>30.4f}"
            )


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def ranking_inputs(n: int, k: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(true labels, labels with 10 % uniform noise, softmax probabilities (n, k) float64)."""
    rng = np.random.default_rng(0)
    true = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), true] += 3.0
    P = np.exp(logits)
    P /= P.sum(axis=1, keepdims=True)
    noisy = np.where(rng.random(n) < 0.1, (true + rng.integers(1, k, n)) % k, true)
    return true, noisy, P


def ranking_time(n: int, pairs: int) -> int:
    """One line: nbdebug's and cleanlab's medians over ``pairs`` interleaved calls on the
    same inputs, their ratio (and the spread of the pairs' ratios) against the target."""
    k = 10
    true, noisy, P = ranking_inputs(n, k)
    df = find_label_issues(noisy, pred_probs=P)  # warm-up, not timed
    flags = df.sort_index()["is_issue"].to_numpy()
    nb_t, cl_t = [], []
    for _ in range(pairs):  # interleaved: nbdebug, cleanlab, nbdebug, cleanlab, ...
        nb_t.append(timed(find_label_issues, noisy, pred_probs=P)[1])
        if cleanlab_find is not None:
            mask, t = timed(cleanlab_find, noisy, P, n_jobs=1)
            cl_t.append(t)
    nb = float(np.median(nb_t))
    line = f"  {n:>9,} x {k}: nbdebug {nb:.3f} s (F1 {f1(flags, noisy != true):.3f})"
    if cl_t:
        cl_med = float(np.median(cl_t))
        r = np.array(nb_t) / np.array(cl_t)
        line += (
            f", cleanlab {cl_med:.3f} s (F1 {f1(mask, noisy != true):.3f}); ratio "
            f"{nb / cl_med:.2f}x (pairs {r.min():.2f}-{r.max():.2f}x), target <= 1.0x "
            f"cleanlab: {'met' if nb <= cl_med else 'MISSED'}"
        )
    print(line, flush=True)
    return len(df.columns)


def ranking_times(sizes: tuple[int, ...], pairs: int) -> None:
    print(
        f"\nfind_label_issues on n x 10 probabilities (10% uniform noise), median of {pairs} "
        "interleaved pairs, one thread; cleanlab.filter.find_label_issues with its defaults "
        "and n_jobs=1, same inputs:"
    )
    for n in sizes:
        n_columns = ranking_time(n, pairs)
    print(
        "  (nbdebug's time covers validation, the confident joint, flags, top-3 and the ranked "
        f"{n_columns}-column DataFrame; cleanlab's returns a boolean mask; the target is on "
        "the whole call)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rates 10%% and 30%%, one seed")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)")
    ap.add_argument("--timing-only", action="store_true", help="only the timing against cleanlab")
    ap.add_argument("--pairs", type=int, default=7, help="interleaved timing pairs (>= 5)")
    args = ap.parse_args()
    if args.pairs < 5:
        ap.error(f"--pairs must be at least 5 (medians of interleaved pairs); got {args.pairs}")
    warnings.filterwarnings("ignore")
    rates = (0.10, 0.30) if args.quick else RATES
    seeds = range(args.seeds or (1 if args.quick else 3))
    grid = f"rates {', '.join(f'{r:.0%}' for r in rates)}; {len(seeds)} seed(s)"
    print(
        f"cleanlab {getattr(cleanlab, '__version__', 'not installed')}; default "
        f"prune={DEFAULT!r}; {'timing only' if args.timing_only else grid}"
    )
    sizes = (30_000, 300_000, 1_000_000)
    with threadpool_limits(1):
        if args.timing_only:
            ranking_times(sizes, args.pairs)
            return
        t0 = time.perf_counter()
        cache = oof_cache(rates, seeds)
        t1 = time.perf_counter()
        table(cache, rates, seeds)
        t2 = time.perf_counter()
        print(
            f"\n{len(cache)} out-of-fold probability arrays in {t1 - t0:.0f} s, all detectors "
            f"on them in {t2 - t1:.0f} s (single-threaded)"
        )
        ranking_times(sizes, args.pairs)


if __name__ == "__main__":
    main()
