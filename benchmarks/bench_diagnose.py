"""nbdebug.diagnose() on the scenario corpus (tests/corpus/: failing loops drawn from public
bug reports, by category) and on the scenario suite (tests/diagnose_scenarios.py): how often
the right cause is ranked first and in the top 3, per category, what a whole diagnosis
costs against a training step of the same model, and what one replay costs against a
plain training step.

A diagnosis' cost: ``diagnose(snapshot)`` (snapshot loaded beforehand) against one
training step (forward, loss, backward, ``optimizer.step()``) of the scenario's model on
its failing batch, interleaved round by round, CPU time of this process.

A replay is ``Workbench.run(fix)``: reset the copies (weights, buffers, optimizer state,
RNG), apply the fix, forward, loss, backward, clipping, ``optimizer.step()`` and the
finiteness checks. The plain step is forward, loss, backward and ``optimizer.step()`` on a
copy of the model and optimizer. The two are interleaved round by round, one torch
thread, CPU time of this process. Besides the (tiny) scenario models, the 4-layer
TransformerEncoder of DESIGN.md's targets with a NaN batch row (fix: drop the row), and
the runs of tests/test_diverged.py that diverge through their updates by themselves (an
uncapped warm-up, a ReLU RNN without clipping, a learning rate far too high: right kind
``diverged``).

    python benchmarks/bench_diagnose.py [--rounds 15] [--corpus-only]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/models.py first
from corpus import CATEGORIES, right, run, scenarios
from diagnose_scenarios import CASES
from models import mean_square, transformer
from test_diverged import MODELS, SHAPES, until_nonfinite

import nbdebug
from nbdebug.analysis.diagnose import NotReproducible
from nbdebug.core.batch import call_model, compute_loss


def _right(case: Any, row: Any) -> bool:
    return row.kind == case.kind and (case.module is ... or row.module == case.module)


def plain_step(model: torch.nn.Module, opt: Any, inputs: Any, target: Any, loss_fn: Any) -> None:
    opt.zero_grad(set_to_none=True)
    loss = compute_loss(call_model(model, inputs), target, loss_fn)
    loss.backward()
    opt.step()


def cost_ratio(d: Any, rounds: int, clock: Any, fix: Any) -> float:
    """Median over rounds of (replay with ``fix``) / (plain step), interleaved."""
    bench = d.workbench
    model, opt = copy.deepcopy((bench.model, bench.optimizer))
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):  # warm-up
        bench.run(fix)
        _safe_plain(model, opt, bench)
    ratios = []
    for _ in range(rounds):
        t0 = clock()
        bench.run(fix)
        t1 = clock()
        _safe_plain(model, opt, bench)
        t2 = clock()
        ratios.append((t1 - t0) / max(t2 - t1, 1e-9))
    return statistics.median(ratios)


def _safe_plain(model: torch.nn.Module, opt: Any, bench: Any) -> None:
    with contextlib.suppress(RuntimeError):  # an overflowing update (the learning-rate cases)
        plain_step(model, opt, bench.inputs, bench.target, bench.loss_fn)


def _diagnose(snap: Any, loss_fn: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nbdebug.diagnose(snap, loss_fn=loss_fn, progress=False)


def _diagnosis_cost(snap: Any, loss_fn: Any, rounds: int, clock: Any) -> tuple[Any, float]:
    """The diagnosis and the median over ``rounds`` of (one diagnosis) / (one training
    step of the snapshot's model on its batch), interleaved (after a warm-up of each)."""
    d = _diagnose(snap, loss_fn)
    bench = d.workbench
    model, opt = copy.deepcopy((bench.model, bench.optimizer))
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _safe_plain(model, opt, bench)
    ratios = []
    for _ in range(rounds):
        t0 = clock()
        _diagnose(snap, loss_fn)
        t1 = clock()
        steps = []
        for _ in range(5):
            t2 = clock()
            _safe_plain(model, opt, bench)
            steps.append(clock() - t2)
        ratios.append((t1 - t0) / max(statistics.median(steps), 1e-9))
    return d, statistics.median(ratios)


def corpus(rounds: int) -> None:
    """Top-1 and top-3 per category over the corpus, and the cost of a diagnosis."""
    clock = time.process_time
    per: dict[str, list[tuple[bool, bool]]] = {c: [] for c in CATEGORIES}
    costs: list[float] = []
    for s in scenarios():
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what the failing loops warn themselves
            out = run(s.loop(False), Path(tmp))
            if out.snapshot is None:
                print(f"  {s.name:<62} did not fail")
                per[s.category].append((False, False))
                continue
            loop = s.loop(False)
            snap = nbdebug.load_snapshot(out.snapshot, model=loop.model)
            d, cost = _diagnosis_cost(snap, loop.loss_fn, rounds, clock)
        kinds = [r.kind.value for r in d.results]
        ok1, ok3 = right(s, kinds[0]), any(right(s, k) for k in kinds[:3])
        per[s.category].append((ok1, ok3))
        costs.append(cost)
        tag = f"[{s.category}]"
        print(
            f"  {tag:<14} {s.name:<58} rank1 {'yes' if ok1 else 'NO ':<3} top3 "
            f"{'yes' if ok3 else 'NO '}  got {kinds[0]:<17} diagnosis {cost:,.0f}x a step"
        )
    n1 = sum(a for v in per.values() for a, _ in v)
    n3 = sum(b for v in per.values() for _, b in v)
    n = sum(len(v) for v in per.values())
    for c, v in per.items():
        print(
            f"corpus {c:<13} top-1 {sum(a for a, _ in v)}/{len(v)}  "
            f"top-3 {sum(b for _, b in v)}/{len(v)}"
        )
    print(f"corpus all           top-1 {n1}/{n} = {n1 / n:.0%}  top-3 {n3}/{n} = {n3 / n:.0%}")
    print(
        f"cost of a diagnosis: median {statistics.median(costs):,.0f}x a training step of the "
        f"same model (min {min(costs):,.0f}x, max {max(costs):,.0f}x; tiny corpus models)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--corpus-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time
    corpus(max(1, args.rounds // 5))
    if args.corpus_only:
        return
    top1 = top3 = 0
    ratios: dict[str, float] = {}
    plain_ratios: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            kw = case.build(Path(tmp))
            for k in ("user_model", "user_optimizer", "earlier_step"):
                kw.pop(k, None)
            t0 = time.perf_counter()
            d = nbdebug.diagnose(progress=False, **kw)
            seconds[case.name] = time.perf_counter() - t0
            rows = d.results
            ok1 = _right(case, rows[0])
            ok3 = any(_right(case, r) for r in rows[:3])
            top1 += ok1
            top3 += ok3
            ratios[case.name] = cost_ratio(d, args.rounds, clock, rows[0].fix)
            plain_ratios[case.name] = cost_ratio(d, args.rounds, clock, NotReproducible())
            print(
                f"  {case.name:<55} rank1 {'yes' if ok1 else 'NO ':<3}  "
                f"top3 {'yes' if ok3 else 'NO '}"
                f"  top-fix replay {ratios[case.name]:.2f}x, plain replay "
                f"{plain_ratios[case.name]:.2f}x a plain step; diagnose {seconds[case.name]:.2f} s"
                f" ({len(rows)} rows)"
            )
    n = len(CASES)
    print(f"right cause at rank 1: {top1}/{n} = {top1 / n:.0%}")
    print(f"right cause in the top 3: {top3}/{n} = {top3 / n:.0%}")
    print(
        f"median replay cost: {statistics.median(ratios.values()):.2f}x a plain step with the "
        f"top fix, {statistics.median(plain_ratios.values()):.2f}x without (tiny scenario models, "
        f"max {max(ratios.values()):.2f}x)"
    )

    model, x = transformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = x.clone()
    x[5, 3, 7] = float("nan")
    d = nbdebug.diagnose(model, x, loss_fn=mean_square, optimizer=opt, progress=False)
    n = max(5, args.rounds // 3)
    r = cost_ratio(d, n, clock, d.results[0].fix)
    rp = cost_ratio(d, n, clock, NotReproducible())
    print(
        f"TransformerEncoder (4 x d128, batch 16x64), NaN in batch row 5: top cause "
        f"{d.cause.kind} rows {d.cause.rows}; replay cost {r:.2f}x a plain step with the fix, "
        f"{rp:.2f}x without"
    )
    diverged()


def diverged() -> None:
    """The runs that diverge by themselves: how often ``diverged`` ranks first."""
    right = 0
    for name, make in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            guard, failed = until_nonfinite(make()[0], Path(tmp))
            snap = nbdebug.load_snapshot(guard.snapshots[-1], model=MODELS[name])
            t0 = time.perf_counter()
            d = nbdebug.diagnose(snap, progress=False)
            took = time.perf_counter() - t0
        ok = d.cause.kind == "diverged"
        right += ok
        began = d.cause.fix.divergence.began if ok else None  # type: ignore[union-attr]
        print(
            f"  {name:<55} rank1 {'yes' if ok else 'NO ':<3}  failed at step {failed}, "
            f"diverged from step {began}; diagnose {took:.2f} s"
        )
    print(f"runs that diverged by themselves, diverged at rank 1: {right}/{len(SHAPES)}")


if __name__ == "__main__":
    main()
