"""Debugger speed on a trace of ~2,000 events (Python side, no browser).

Targets (issue 4): building the debugger < 2 s; one step (button click to updated
widgets, norm-plot marker included) < 50 ms. Run: ``.venv/bin/python benchmarks/bench_widgets.py``.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.widgets.app import Debugger


def deep_mlp(blocks: int, width: int = 8) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers)


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = deep_mlp(250)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    x[1, 2] = float("nan")  # a non-finite trace: every view has something to mark
    tr = nbdebug.trace(model, x, y, F.cross_entropy)
    print(f"trace: {len(tr.events)} events, {len(tr.params)} parameters; {tr.summary()[:70]}")

    build = timed(lambda: Debugger(tr).close(), 3)
    print(
        f"build debugger from the trace: median {statistics.median(build) * 1e3:.0f} "
        f"ms (target < 2000 ms)"
    )
    alone = timed(lambda: nbdebug.trace(model, x, y, F.cross_entropy), 2)
    full = timed(lambda: nbdebug.debug(model, x, y, F.cross_entropy).close(), 2)
    print(
        f"nbdebug.debug(model, batch) incl. the trace: median "
        f"{statistics.median(full) * 1e3:.0f} ms "
        f"(nbdebug.trace alone: {statistics.median(alone) * 1e3:.0f} ms)"
    )

    for backend in ("figurewidget", "output"):
        with contextlib.redirect_stdout(
            io.StringIO()
        ):  # outside a kernel "output" prints its figures
            line = _steps(tr, backend)
        print(line)


def _steps(tr: nbdebug.Trace, backend: str) -> str:
    dbg = Debugger(tr, backend=backend)
    b = dbg.step.buttons
    steps = timed(b["next"].click, 200)
    jumps: list[float] = []
    for _ in range(20):
        jumps += (
            timed(b["first"].click, 1) + timed(b["origin"].click, 1) + timed(b["last"].click, 1)
        )
    slider = []
    for v in range(0, len(tr.events), 97):
        t = time.perf_counter()
        dbg.step.slider.value = v
        slider.append(time.perf_counter() - t)
    filt = timed(lambda: setattr(dbg.step.phase, "value", "backward"), 1)
    filt += timed(lambda: setattr(dbg.step.phase, "value", "all"), 1)
    dbg.close()

    def ms(v: list[float]) -> float:
        return statistics.median(v) * 1e3

    return (
        f"[{backend}] one step (next click): median {ms(steps):.2f} ms, max "
        f"{max(steps) * 1e3:.2f} ms "
        f"(target < 50 ms); jump first/origin/last: median {ms(jumps):.2f} ms; "
        f"slider move: median {ms(slider):.2f} ms; phase filter change: max "
        f"{max(filt) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
