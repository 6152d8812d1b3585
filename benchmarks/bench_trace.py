"""nbdebug.trace() against a plain forward+backward (a training step without the update:
``zero_grad`` + ``loss.backward()``, as ``trace`` runs it), torch.autograd.detect_anomaly,
naive per-module norm hooks, (GPT-2 models) Hugging Face's ``DebugUnderflowOverflow``, and
the same step through ``torch.autograd.grad`` (no ``.grad`` written) for reference.
``trace`` computes its statistics with eager PyTorch ops; ``trace_compiled`` with the
compiled kernel (``nbdebug build-kernels``; the benchmark builds it once, cached). Both
run right after a plain call, so the model holds that step's ``.grad``, which a trace
keeps aside (the user's gradients survive it) while plain's ``zero_grad`` frees them: the
trace then needs a gradient-sized block of memory more than plain, page-faulted in on every
call. ``trace_no_grad`` (the kernel when built, else eager) starts from plain's state,
``zero_grad`` first, so its ratio is the trace's own cost. After each model, the per-event
line: the extra time of ``trace_no_grad`` over plain per event, and the parts of one
trace's wall time spent computing statistics (kernel calls and their Python) and
appending the event records (from the hooks, statistics excluded); the rest is hooks,
building the events and the trace's fixed costs (the weights' norms, keeping the user's
state aside).

Prints, for the models of DESIGN.md's performance targets (4-layer TransformerEncoder,
5-block CNN, ResNet-18-shaped CNN, GPT-2 12 x 768 (124M) and 80 x 304 (105M, 1,048
modules), batch 2 x 64, and a BERT-style encoder of MiniLM-L6's shape from a
``transformers`` config, batch 16 x 26), the median time of plain and each variant's
ratio to plain, measured side by side in one run: each call of a variant runs right after
a plain call of its own, and the line gives the median of these paired ratios with their
quartiles (a burst of load on a shared machine hits both calls of a pair alike), with 1
torch thread (CPU time of this process) and 2 (wall time). Then the NaN path (the 124M
model with one NaN weight, and with one finite weight that overflows in the forward: quick
pass, exact pass, origin and replay) against a plain step, and the peak memory of each
variant (each in a fresh subprocess), and the 2,000-module check.

    python benchmarks/bench_trace.py [--rounds 3] [--models transformer,gpt2_124m]
        [--threads 1,2] [--no-memory] [--kernels both|eager]
        [--variants trace_compiled,trace_no_grad]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import cnn, gpt2_124m, gpt2_deep, mean_square, resnet18, transformer

import nbdebug
from nbdebug.core import engine, kernels
from nbdebug.core.trace.recorder import Recorder


def bert() -> tuple[nn.Module, dict]:
    """A BERT-style encoder (MiniLM-L6's shape: 6 x 384, 12 heads, 22.7M parameters) from a
    ``transformers.BertConfig`` with random init (nothing downloaded), masked-LM loss on a
    batch of 16 x 26 token ids."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    )
    model = BertForMaskedLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (16, 26))
    return model, {"input_ids": ids, "labels": ids}


MODELS = {
    "transformer": transformer,
    "cnn": cnn,
    "resnet18": resnet18,
    "gpt2_124m": gpt2_124m,
    "gpt2_80x304": gpt2_deep,
    "bert": bert,
}
BIG = ("gpt2_124m", "gpt2_80x304")  # fewer rounds, and DebugUnderflowOverflow


def _loss(model: nn.Module, x: Any) -> torch.Tensor:
    if isinstance(x, dict):
        return model(**x).loss
    return mean_square(model(x))


def _trace(model: nn.Module, x: Any) -> Any:
    if isinstance(x, dict):
        return nbdebug.trace(model, x)
    return nbdebug.trace(model, x, loss_fn=mean_square)


def _eager(f: Callable[[], Any]) -> Callable[[], Any]:
    """``f`` with the statistics in eager PyTorch ops, even when the kernel is built."""

    def run() -> Any:
        before = os.environ.get(kernels.ENV)
        os.environ[kernels.ENV] = "eager"
        try:
            return f()
        finally:
            if before is None:
                del os.environ[kernels.ENV]
            else:
                os.environ[kernels.ENV] = before

    return run


def _naive_hooks(model: nn.Module) -> list[Any]:
    """The hand-written way: a forward hook per module that takes the norm of its
    output and hooks the output's gradient for its norm, each read on the host."""
    got: list[float] = []

    def fwd(module: nn.Module, args: Any, out: Any) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                got.append(float(t.detach().norm()))
                if t.requires_grad:
                    t.register_hook(lambda g: got.append(float(g.norm())))

    return [m.register_forward_hook(fwd) for m in model.modules()]


def _hf_debug(model: nn.Module) -> list[tuple[dict, int]]:
    """Attach ``DebugUnderflowOverflow`` and return its hooks (it keeps no handles)."""
    from transformers.debug_utils import DebugUnderflowOverflow

    before = {id(m): set(m._forward_hooks) for m in model.modules()}
    DebugUnderflowOverflow(model)
    return [
        (m._forward_hooks, k)
        for m in model.modules()
        for k in m._forward_hooks
        if k not in before[id(m)]
    ]


def variants(model: nn.Module, x: Any, big: bool) -> dict[str, Callable[[], None]]:
    """Each variant is one training-loop step without the update: ``zero_grad`` and
    ``loss.backward()`` (what ``nbdebug.trace`` runs too, gradients accumulated into
    ``.grad``); ``autograd_grad`` is the same step through ``torch.autograd.grad``, which
    skips writing ``.grad`` (a reference: slightly cheaper than a training step)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        _loss(model, x).backward()

    def plain() -> None:
        step()

    @_eager
    def traced() -> None:
        _trace(model, x)

    def traced_compiled() -> None:
        _trace(model, x)

    def traced_no_grad() -> None:
        # from the state plain starts from: no ``.grad`` for the trace to keep aside
        model.zero_grad(set_to_none=True)
        _trace(model, x)

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            step()

    def naive() -> None:
        handles = _naive_hooks(model)
        try:
            step()
        finally:
            for h in handles:
                h.remove()

    def hf() -> None:
        hooks = _hf_debug(model)
        try:
            step()
        finally:
            for d, k in hooks:
                del d[k]

    def grad_only() -> None:
        torch.autograd.grad(_loss(model, x), params)

    out = {
        "plain": plain,
        "trace": traced,
        **({"trace_compiled": traced_compiled} if kernels.active() else {}),
        "trace_no_grad": traced_no_grad,
        "detect_anomaly": anomaly,
        "naive_hooks": naive,
        "autograd_grad": grad_only,
    }
    if big:
        out["hf_debug"] = hf
    return out


class _Split:
    """Wall time per part, each exclusive of the parts timed inside it (a measurement
    made inside a record counts as statistics only)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.open: list[list[float]] = []  # [start, time in timed calls inside]

    def timing(self, part: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self.open.append(frame)
            try:
                return f(*args)
            finally:
                self.open.pop()
                dt = time.perf_counter() - frame[0]
                self.spent[part] = self.spent.get(part, 0.0) + dt - frame[1]
                if self.open:
                    self.open[-1][1] += dt

        return run


#: what per_event times: the statistics (every measurement of the recorder's engine, one
#: by one or many at once, and the host read of its rows, with their Python) and the
#: records (appending one event from the hooks, statistics excluded); each part includes
#: its own timing's overhead, a fraction of a microsecond per call
TIMED = {
    "statistics": (engine.QuickEngine, ("measure", "measure_many", "host_rows")),
    "records": (Recorder, ("record", "record_param")),
}


def per_event(model: nn.Module, x: Any) -> tuple[int, dict[str, float]]:
    """One trace's events and the wall time of each part of :data:`TIMED` in it."""
    split = _Split()
    saved = [(cls, n, getattr(cls, n)) for cls, names in TIMED.values() for n in names]
    for part, (cls, names) in TIMED.items():
        for n in names:
            setattr(cls, n, split.timing(part, getattr(cls, n)))
    try:
        model.zero_grad(set_to_none=True)
        n = len(_trace(model, x).events)
    finally:
        for cls, name, f in saved:
            setattr(cls, name, f)
    return n, {part: split.spent.get(part, 0.0) for part in TIMED}


#: how the timing lines read
_HOW = (
    "plain: median per call; each variant: the median of its ratios to the plain call "
    "run just before it, [quartiles]"
)


def _call(
    vs: dict[str, Callable[[], None]],
    k: str,
    clock: Callable[[], float],
    times: dict[str, list[float]],
    faults: dict[str, list[int]],
) -> float:
    """Run variant ``k`` once: its time and minor page faults appended; the time returned."""
    n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = clock()
    vs[k]()
    spent = clock() - t
    times[k].append(spent)
    faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - n)
    return spent


def _paired(ratios: list[float]) -> str:
    """``1.16x [1.12-1.20]``: the median of the paired ratios and their quartiles."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return f"{statistics.median(ratios):.2f}x [{q[0]:.2f}-{q[2]:.2f}]"


def timed(
    names: list[str], rounds: int, clock: Callable[[], float], keep: list[str] | None = None
) -> None:
    for name in names:
        model, x = MODELS[name]()
        big = name in BIG
        vs = variants(model, x, big)
        if keep:
            vs = {k: f for k, f in vs.items() if k == "plain" or k in keep}
        for f in vs.values():  # warm-up
            f()
        times: dict[str, list[float]] = {k: [] for k in vs}
        faults: dict[str, list[int]] = {k: [] for k in vs}
        pairs: dict[str, list[float]] = {k: [] for k in vs if k != "plain"}
        for _ in range(rounds if big else 3 * rounds):
            # each variant right after a plain call of its own: the pair's ratio (a burst
            # of load on this shared machine hits both of a pair alike), and every variant
            # starts from the ``.grad`` that plain leaves (the trace keeps it aside)
            for k in pairs:
                base = _call(vs, "plain", clock, times, faults)
                pairs[k].append(_call(vs, k, clock, times, faults) / base)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = "  ".join(f"{k} {_paired(pairs[k])}" for k in pairs)
        print(f"{name:12s} plain {med['plain'] * 1e3:7.0f} ms  |  {ratios}")
        # page faults: memory the allocator handed back to the system and took again;
        # they cost system time that the ratios include (glibc's trimming depends on the
        # order of allocations, so they vary from run to run)
        pf = "  ".join(
            f"{k} {statistics.median(faults[k]):.0f}"
            for k in ("plain", "trace", "trace_compiled", "trace_no_grad")
            if k in faults
        )
        print(f"{'':12s} minor page faults per call: {pf}")
        if "trace_no_grad" in med:
            n, spent = per_event(model, x)
            extra = med["trace_no_grad"] - med["plain"]
            print(
                f"{'':12s} per event ({n} events): trace_no_grad - plain "
                f"{extra / n * 1e6:.1f} us, of which statistics "
                f"{spent['statistics'] / n * 1e6:.1f} us, records "
                f"{spent['records'] / n * 1e6:.1f} us (wall, one trace), the rest hooks "
                f"and building the events"
            )
        del model, x, vs


def nan_model(kind: str = "nan") -> tuple[nn.Module, Any]:
    """The 124M GPT-2 with one bad weight in ``transformer.h.5.mlp.c_fc``: ``"nan"`` a NaN
    weight (corrupted weights: the parameter check sees it before the pass), ``"overflow"``
    a finite 3e38 weight whose product overflows to inf in the forward (only the quick
    pass can see that the step is not finite)."""
    model, x = gpt2_124m()
    with torch.no_grad():
        model.transformer.h[5].mlp.c_fc.weight[7, 11] = float("nan") if kind == "nan" else 3e38
    return model, x


NAN_CASES = {"nan": "one NaN weight", "overflow": "one 3e38 weight (inf in the forward)"}


def nan_path(rounds: int, clock: Callable[[], float]) -> None:
    """The NaN path (quick pass when the weights are finite, exact pass, origin and the
    op-level replay of the origin module) against a plain step, interleaved."""
    for kind, label in NAN_CASES.items():
        model, x = nan_model(kind)
        keep = ("plain", "trace", "trace_compiled")
        vs = {k: f for k, f in variants(model, x, False).items() if k in keep}
        for f in vs.values():
            f()
        times: dict[str, list[float]] = {k: [] for k in vs}
        for _ in range(rounds):
            for k, f in vs.items():
                t = clock()
                f()
                times[k].append(clock() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        tr = _trace(model, x)
        o = tr.origin
        ratios = "  ".join(
            f"{k} {med[k] * 1e3:.0f} ms {med[k] / med['plain']:.2f}x" for k in vs if k != "plain"
        )
        print(
            f"-- NaN path, gpt2_124m with {label} (origin {o.module if o else None}, "
            f"param {o.param if o else None}, op {o.op if o else None}): plain "
            f"{med['plain'] * 1e3:.0f} ms  |  {ratios} (target <= 3x)"
        )
        del model, x, vs, tr


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_child(model_name: str, variant: str) -> None:
    """Peak resident memory above the resting level during one call (Linux: the peak is
    reset through /proc/self/clear_refs before the call)."""
    if model_name.startswith("gpt2_nan:"):
        model, x = nan_model(model_name.split(":")[1])
    else:
        model, x = MODELS[model_name]()
    f = variants(model, x, False)[variant]
    f()  # warm-up: allocator pools, lazy imports
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = _status_kib("VmRSS")
    f()
    peak = _status_kib("VmHWM")
    print(json.dumps({"delta_mib": (peak - base) / 1024, "base_mib": base / 1024}))


def _child(name: str, variant: str, env: dict[str, str] | None = None) -> dict[str, float]:
    r = subprocess.run(
        [sys.executable, __file__, "--memory-child", name, variant],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


# glibc's malloc raises its mmap threshold each time a large mmapped block is freed, after
# which blocks of that size come from the heap, and freed heap below live small blocks is
# not returned: resting RSS then depends on the allocation history. A fixed threshold
# (blocks over 128 KiB mmapped and unmapped when freed) shows the memory each variant
# actually holds.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def peak_memory(names: list[str]) -> None:
    print(
        "-- peak memory during one call (fresh process each; MiB above the resting RSS, "
        "which holds the model; ratio of resting + peak to plain's; first with glibc's "
        "default malloc, then [held] with a fixed mmap threshold: the memory held)"
    )
    rows = [(n, n) for n in names]
    if "gpt2_124m" in names:
        rows += [(f"gpt2_nan:{k}", f"gpt2_124m, {v} (NaN path)") for k, v in NAN_CASES.items()]
    for name, label in rows:
        cells = []
        for env in (None, FIXED_MMAP):
            p = _child(name, "plain", env)
            traces = ["trace", "trace_compiled"] if kernels.active() else ["trace"]
            for variant in traces:
                t = _child(name, variant, env)
                ratio = (t["base_mib"] + t["delta_mib"]) / (p["base_mib"] + p["delta_mib"])
                extra = t["delta_mib"] / max(p["delta_mib"], 1e-9)
                cells.append(
                    f"{'[held] ' if env else ''}plain +{p['delta_mib']:6.1f}  {variant} "
                    f"+{t['delta_mib']:6.1f}  peak {ratio:.2f}x (above resting {extra:.2f}x)"
                )
        print(f"{label:12s} " + "  |  ".join(cells))


def many_modules() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(667)])
    n = sum(1 for _ in model.modules())
    x = torch.randn(4, 8)
    calls = []
    for _ in range(4):  # the first call of a fresh model, then warm ones
        t = time.perf_counter()
        tr = nbdebug.trace(model, x, loss_fn=mean_square)
        calls.append(time.perf_counter() - t)
    t_first_trace, t_trace = calls[0], statistics.median(calls[1:])
    t = time.perf_counter()
    frame = tr.to_frame()
    t_first = time.perf_counter() - t  # includes importing pandas
    t = time.perf_counter()
    frame = tr.to_frame()
    t_frame = time.perf_counter() - t
    print(
        f"-- {n} modules: trace {t_trace:.2f} s (median of 3; the first call of the model "
        f"{t_first_trace:.2f} s), {len(tr.events)} events, "
        f"to_frame {t_frame * 1e3:.0f} ms ({t_first * 1e3:.0f} ms on first use, with "
        f"the pandas import; "
        f"{len(frame)} rows; target < 1 s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="rounds (x3 for the small models)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    ap.add_argument("--threads", default="1,2", help="torch thread counts timed; 0: none")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--variants", default="", help="comma-separated variants timed beside plain (all)"
    )
    ap.add_argument("--memory-child", nargs=2)
    ap.add_argument(
        "--kernels",
        choices=("both", "eager"),
        default="both",
        help="both: also time the trace with the compiled kernel (built once, cached)",
    )
    a = ap.parse_args()
    if a.memory_child:
        peak_memory_child(*a.memory_child)
        return
    if a.kernels == "both":
        t = time.perf_counter()
        path = kernels.build()
        print(f"compiled kernel: {path} (ready in {time.perf_counter() - t:.1f} s)")
    else:
        os.environ[kernels.ENV] = "eager"
    names = [n for n in a.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"--models expects names from {sorted(MODELS)}, got {unknown}")
    keep = [v for v in a.variants.split(",") if v]
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    for n in [int(v) for v in a.threads.split(",") if int(v) > 0]:
        torch.set_num_threads(n)
        if n == 1:
            print(f"-- 1 torch thread, CPU time of this process ({_HOW})")
            timed(names, a.rounds, time.process_time, keep)
        else:
            print(f"-- {n} torch threads, wall time ({_HOW})")
            timed(names, a.rounds, time.perf_counter, keep)
    torch.set_num_threads(1)
    if "gpt2_124m" in names:
        nan_path(a.rounds, time.process_time)
    if not a.no_memory:
        peak_memory(names)
    many_modules()
    print(
        "targets: trace/plain <= 1.25x; NaN path <= 3x with peak memory <= 1.25x; "
        "healthy peak memory <= 1.10x"
    )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
