"""nbdebug.gradcheck_modules against a plain torch.autograd.gradcheck of the same modules.

The DESIGN.md transformer (4 x TransformerEncoderLayer(128, 4), batch 16 x 64 x 128), in
eval mode (plain gradcheck cannot check dropout), swept with ``rows=2``: every checked
module gets the activations of the first 2 batch rows. Side by side, in one run, one torch
thread, times in CPU seconds of this process (robust on a shared machine; wall time in
brackets):

* ``nbdebug`` element-wise (the default: up to ``max_elements`` sampled elements of every
  input, parameter and output, with the verdict analysis) and ``fast=True`` (4 random
  projections per pair);
* ``torch.autograd.gradcheck(fast_mode=True)`` of the same modules on the same float64
  activations, with respect to their inputs (what plain gradcheck checks);
* ``torch.autograd.gradcheck(fast_mode=False)`` is not run: its full Jacobians do not fit
  (the line says how large they would be); its time is estimated from the measured cost of
  one forward and one backward of each module.

    python benchmarks/bench_gradcheck.py [--rows 2] [--max-elements 32]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import transformer

from nbdebug.analysis.gradcheck.sweep import capture_module_inputs, gradcheck_modules
from nbdebug.core.batch import iter_tensors


def _float64(obj):
    def conv(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().to(torch.float64).requires_grad_(True)
        return t

    return tree_map(conv, obj)


def plain_cases(model, x, rows, names):
    """(name, fn, float inputs) for torch.autograd.gradcheck, on the same activations."""
    _, captured = capture_module_inputs(model, x, rows)
    modules = dict(model.named_modules())
    cases = []
    for name in names:
        (args, kwargs), _ = captured[name]
        mod = copy.deepcopy(modules[name]).to(torch.float64)
        args, kwargs = _float64((args, kwargs))
        diff = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not diff:
            continue
        positions = [
            i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad
        ]

        def fn(*d, mod=mod, args=args, kwargs=kwargs, positions=positions):
            full = list(args)
            for i, t in zip(positions, d):
                full[i] = t
            return tuple(iter_tensors(mod(*full, **kwargs)))

        cases.append((name, fn, tuple(diff)))
    return cases


class Clock:
    """CPU and wall seconds since the last lap."""

    def __init__(self) -> None:
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def lap(self) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        out = (cpu - self.cpu, wall - self.wall)
        self.cpu, self.wall = cpu, wall
        return out


def median_time(f, n=3):
    times = []
    for _ in range(n):
        t = time.process_time()
        f()
        times.append(time.process_time() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--max-elements", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model, x = transformer()
    model.eval()

    clock = Clock()
    df = gradcheck_modules(model, x, rows=args.rows, max_elements=args.max_elements)
    t_ours, w_ours = clock.lap()
    df_fast = gradcheck_modules(model, x, rows=args.rows, fast=True)
    t_ours_fast, w_ours_fast = clock.lap()
    checked = list(df.loc[df["passed"].notna(), "module"])
    n_skipped = int(df["passed"].isna().sum())

    cases = plain_cases(model, x, args.rows, checked)
    clock.lap()
    plain_ok = 0
    for _, fn, diff in cases:
        plain_ok += bool(torch.autograd.gradcheck(fn, diff, fast_mode=True, raise_exception=False))
    t_plain_fast, w_plain_fast = clock.lap()

    # slow mode: 2 forwards per input element + 1 backward per output element
    est = 0.0
    jac_bytes = 0
    for _, fn, diff in cases:
        with torch.no_grad():
            t_fwd = median_time(lambda fn=fn, diff=diff: fn(*diff))
        outs = fn(*diff)
        y = torch.cat([o.reshape(-1) for o in outs if o.requires_grad])
        g = torch.ones_like(y)
        t_bwd = median_time(
            lambda y=y, g=g, diff=diff: torch.autograd.grad(y, diff, g, retain_graph=True)
        )
        n_in = sum(d.numel() for d in diff)
        est += 2 * n_in * t_fwd + y.numel() * t_bwd
        jac_bytes += 2 * 8 * n_in * y.numel()

    print(
        f"model: 4 x TransformerEncoderLayer(128, 4), batch {tuple(x.shape)}, "
        f"rows={args.rows}, eval, 1 thread"
    )
    print(
        f"modules: {len(df)} ({len(checked)} checked, {n_skipped} skipped), "
        f"wrong backward found: {int((df['passed'] == False).sum())}"  # noqa: E712
    )
    print(
        f"nbdebug.gradcheck_modules (elements, max_elements={args.max_elements}, inputs+params): "
        f"{t_ours:.2f} s [{w_ours:.2f} s]"
    )
    print(
        f"nbdebug.gradcheck_modules (fast=True, 4 projections, inputs+params): "
        f"{t_ours_fast:.2f} s [{w_ours_fast:.2f} s]"
    )
    print(
        f"torch.autograd.gradcheck(fast_mode=True, 1 projection), same {len(cases)} modules, "
        "inputs only: "
        f"{t_plain_fast:.2f} s [{w_plain_fast:.2f} s] ({plain_ok}/{len(cases)} passed)"
    )
    print(
        "torch.autograd.gradcheck(fast_mode=False), same modules: not run, estimated "
        f"{est:.0f} s and "
        f"{jac_bytes / 2**30:.0f} GiB of Jacobians"
    )
    print(f"ratio nbdebug elements / torch fast_mode: {t_ours / t_plain_fast:.1f}x")
    print(f"ratio nbdebug fast / torch fast_mode:     {t_ours_fast / t_plain_fast:.1f}x")
    print(f"ratio nbdebug elements / torch slow mode (estimated): {t_ours / est:.4f}x")
    agree = list(df_fast["passed"]) == list(df["passed"])
    print(f"fast-mode sweep agrees with the element-wise one: {agree}")


if __name__ == "__main__":
    main()
