"""Cost of the health checks, measured side by side in one run.

1. ``NaNGuard(checks=...)`` in a training loop on the DESIGN.md transformer
   (4-layer ``TransformerEncoder``, d=128, seq 64, batch 16, Adam): the median step time
   with ``checks=False``, ``checks=True`` (every 50 steps) and ``checks=1`` (every step, to
   show the cost of one check), interleaved round by round so machine noise hits them
   alike. The target is the guard's: <= 1.03x per step with the default cadence.
2. ``nbdebug.check((model, x), ...)`` against ``nbdebug.trace`` alone on the same model:
   what the checks add on top of the trace they read.

    python benchmarks/bench_checks.py [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_guard import transformer_case

import nbdebug
from nbdebug import NaNGuard


def guard_steps(steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, x, y = transformer_case()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = nn.functional.cross_entropy
    times: dict[str, list[float]] = {"off": [], "every 50": [], "every step": []}
    with tempfile.TemporaryDirectory() as d:
        guards = {
            "off": NaNGuard(model, opt, directory=d, loss_fn=loss_fn),
            "every 50": NaNGuard(model, opt, directory=d, loss_fn=loss_fn, checks=True),
            "every step": NaNGuard(model, opt, directory=d, loss_fn=loss_fn, checks=1),
        }
        for step in range(steps + 3):
            for name, guard in guards.items():
                t = time.perf_counter()
                loss = loss_fn(model(x), y)
                loss.backward()
                if guard.check(loss, step=step):
                    opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= 3:  # warm-up
                    times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def check_vs_trace(rounds: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model, x, y = transformer_case()
    loss_fn = nn.functional.cross_entropy
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    tt, tc = [], []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        nbdebug.trace(model, x, y, loss_fn)
        tt.append(time.perf_counter() - t)
        t = time.perf_counter()
        nbdebug.check((model, x), target=y, loss_fn=loss_fn, optimizer=opt)
        tc.append(time.perf_counter() - t)
    return statistics.median(tt[1:]), statistics.median(tc[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = guard_steps(args.steps)
    base = g["off"]
    print(
        f"guard step, transformer, {args.steps} steps, {args.threads} thread(s): "
        f"checks off {base * 1e3:.1f} ms, checks=True {g['every 50'] * 1e3:.1f} ms "
        f"({g['every 50'] / base:.3f}x), checks every step {g['every step'] * 1e3:.1f} ms "
        f"({g['every step'] / base:.3f}x; one check ~{(g['every step'] - base) * 1e3:.2f} ms)"
    )
    tt, tc = check_vs_trace(args.rounds)
    print(
        f"nbdebug.check vs nbdebug.trace, transformer: trace {tt * 1e3:.1f} ms, check "
        f"{tc * 1e3:.1f} ms "
        f"({tc / tt:.3f}x)"
    )


if __name__ == "__main__":
    main()
