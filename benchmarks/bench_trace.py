"""nbdebug.trace() against a plain forward+backward and torch.autograd.detect_anomaly.

Prints, for the two reference models of DESIGN.md, the median time of each variant and
the ratios, measured side by side in one run (the variants are interleaved round by
round so that machine noise hits them alike). Times are CPU time of this process with
one torch thread (robust on a shared machine) and wall time with the default threads.
Then the peak memory of each variant (each in a fresh subprocess) and the 2,000-module
check.

    python benchmarks/bench_trace.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import cnn, mean_square, narrow_cnn, transformer

import nbdebug

MODELS = {"transformer": transformer, "cnn": cnn, "narrow_cnn": narrow_cnn}


def variants(model: nn.Module, x: torch.Tensor):
    params = [p for p in model.parameters() if p.requires_grad]

    def plain() -> None:
        torch.autograd.grad(mean_square(model(x)), params)

    def traced() -> None:
        nbdebug.trace(model, x, loss_fn=mean_square)

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            torch.autograd.grad(mean_square(model(x)), params)

    return {"plain": plain, "trace": traced, "detect_anomaly": anomaly}


def timed(rounds: int, clock) -> dict[str, dict[str, float]]:
    out = {}
    for name, make in MODELS.items():
        model, x = make()
        vs = variants(model, x)
        for f in vs.values():  # warm-up
            f()
            f()
        times: dict[str, list[float]] = {k: [] for k in vs}
        for _ in range(rounds):
            for k, f in vs.items():
                t = clock()
                f()
                times[k].append(clock() - t)
        out[name] = {k: statistics.median(v) for k, v in times.items()}
    return out


def nan_path(rounds: int, clock) -> None:
    """The NaN path (quick pass, exact pass, origin and the op-level replay of the origin
    module) against a plain step, interleaved: the transformer with one weight of
    ``layers.2.linear1`` set to NaN."""
    model, x = transformer()
    with torch.no_grad():
        model.layers[2].linear1.weight[0, 0] = float("nan")
    vs = variants(model, x)
    vs.pop("detect_anomaly")
    for f in vs.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in vs}
    for _ in range(max(3, rounds // 3)):
        for k, f in vs.items():
            t = clock()
            f()
            times[k].append(clock() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    tr = nbdebug.trace(model, x, loss_fn=mean_square)
    print(
        f"-- NaN path, transformer (origin {tr.origin.module if tr.origin else None}, "
        f"op {tr.origin.op if tr.origin else None}): plain {med['plain'] * 1e3:.1f} ms  "
        f"trace {med['trace'] * 1e3:.1f} ms  |  trace/plain {med['trace'] / med['plain']:.2f}x "
        "(target <= 3x)"
    )


def report(title: str, res: dict[str, dict[str, float]]) -> None:
    print(f"-- {title}")
    for name, r in res.items():
        print(
            f"{name:12s} plain {r['plain'] * 1e3:8.1f} ms  trace {r['trace'] * 1e3:8.1f} ms  "
            f"detect_anomaly {r['detect_anomaly'] * 1e3:8.1f} ms  |  trace/plain "
            f"{r['trace'] / r['plain']:.2f}x  "
            f"anomaly/plain {r['detect_anomaly'] / r['plain']:.2f}x  trace/anomaly "
            f"{r['trace'] / r['detect_anomaly']:.2f}x"
        )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_child(model_name: str, variant: str) -> None:
    """Peak resident memory above the resting level during one call (Linux: the peak is
    reset through /proc/self/clear_refs before the call)."""
    model, x = MODELS[model_name]()
    f = variants(model, x)[variant]
    f()  # warm-up: allocator pools, lazy imports
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = _status_kib("VmRSS")
    f()
    peak = _status_kib("VmHWM")
    print(json.dumps({"delta_mib": (peak - base) / 1024}))


def peak_memory() -> None:
    print("-- peak memory above resting RSS during one call (fresh process each, MiB)")
    for name in MODELS:
        row = []
        for v in ("plain", "trace", "detect_anomaly"):
            r = subprocess.run(
                [sys.executable, __file__, "--memory-child", name, v],
                capture_output=True,
                text=True,
                check=True,
            )
            row.append(f"{v} {json.loads(r.stdout.strip().splitlines()[-1])['delta_mib']:7.1f}")
        print(f"{name:12s} " + "  ".join(row))


def many_modules() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(667)])
    n = sum(1 for _ in model.modules())
    x = torch.randn(4, 8)
    t = time.perf_counter()
    tr = nbdebug.trace(model, x, loss_fn=mean_square)
    t_trace = time.perf_counter() - t
    t = time.perf_counter()
    frame = tr.to_frame()
    t_first = time.perf_counter() - t  # includes importing pandas
    t = time.perf_counter()
    frame = tr.to_frame()
    t_frame = time.perf_counter() - t
    print(
        f"-- {n} modules: trace {t_trace:.2f} s, {len(tr.events)} events, "
        f"to_frame {t_frame * 1e3:.0f} ms ({t_first * 1e3:.0f} ms on first use, with "
        f"the pandas import; "
        f"{len(frame)} rows; target < 1 s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--memory-child", nargs=2)
    a = ap.parse_args()
    if a.memory_child:
        peak_memory_child(*a.memory_child)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    report("CPU time, 1 torch thread (median per call)", timed(a.rounds, time.process_time))
    torch.set_num_threads(threads)
    report(
        f"wall time, {threads} torch threads (median per call)", timed(a.rounds, time.perf_counter)
    )
    nan_path(a.rounds, time.perf_counter)
    peak_memory()
    many_modules()
    print("targets: trace/plain <= 1.25x on both models")


if __name__ == "__main__":
    main()
