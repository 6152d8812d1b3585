"""nbdebug.diagnose() on the scenario suite (tests/diagnose_scenarios.py): how often the
right cause is ranked first and in the top 3, and what one replay costs against a plain
training step of the same model.

A replay is ``Workbench.run(fix)``: reset the copies (weights, buffers, optimizer state,
RNG), apply the fix, forward, loss, backward, clipping, ``optimizer.step()`` and the
finiteness checks. The plain step is forward, loss, backward and ``optimizer.step()`` on a
copy of the model and optimizer. The two are interleaved round by round, one torch
thread, CPU time of this process. Besides the (tiny) scenario models, the 4-layer
TransformerEncoder of DESIGN.md's targets with a NaN batch row (fix: drop the row), and
the runs of tests/test_diverged.py that diverge through their updates by themselves (an
uncapped warm-up, a ReLU RNN without clipping, a learning rate far too high: right kind
``diverged``).

    python benchmarks/bench_diagnose.py [--rounds 15]
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/models.py first
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time
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
