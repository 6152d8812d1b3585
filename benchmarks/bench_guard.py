"""Per-step cost of the always-on NaNGuard: guarded / unguarded training step.

Four models (five with ``--deep``), the DESIGN.md target being <= 1.03x per step:

* an MLP (784-1024-1024-10, batch 256, Adam),
* the DESIGN.md transformer: ``nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4,
  batch_first=True), 4)``, sequence 64, batch 16, Adam,
* a ResNet-18-shaped CNN (``benchmarks/models.py``; 20 BatchNorm layers, whose running
  statistics the guard copies at every step), batch 16x3x64x64, Adam,
* GPT-2 124M (``transformers`` config, random init, batch 2x64, Adam; ``--gpt2``, or
  ``--quick`` leaves it out),
* GPT-2 80 x 304 (105M parameters, 1,048 modules, batch 2x64, Adam; ``--deep``).

Each model is measured under every guard configuration of :data:`CONFIGS` (``--config NAME``
to pick some): the default guard, and one per feature that adds to the step.

A step is forward + backward + ``guard.check`` + ``optimizer.step`` + ``zero_grad``. The
guarded and unguarded variants run interleaved (ABAB...) on two copies of the model (the
same initial weights and data; the unguarded one has none of the guard's hooks, so the
optimizer hooks' work counts too) so that machine noise hits both alike; the script
prints the median step time of each,
the median of the paired ratios (each guarded step over the unguarded step next to it),
and, as a lower-noise second estimate on a busy machine, the median time of
``guard.check`` alone relative to the unguarded step.

Run: ``python benchmarks/bench_guard.py [--steps N] [--threads T] [--quick] [--gpt2] [--deep]``;
``--world 2``: the distributed guard (see ``bench_guard_distributed.py``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

from nbdebug.core.guard import NaNGuard


def mlp_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    x = torch.randn(256, 784)
    y = torch.randint(0, 10, (256,))
    return model, x, y


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, batch_first=True), 4)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(dim=1))


def transformer_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return Encoder(), torch.randn(16, 64, 128), torch.randint(0, 10, (16,))


def resnet_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """models.resnet18 (BatchNorm everywhere: the guard copies its running statistics at
    each step, to put them back when it skips one), with 10 classes."""
    from models import resnet18

    model, x = resnet18()
    return model, x, torch.randint(0, 10, (x.shape[0],))


def gpt2_deep_case() -> tuple[nn.Module, dict, None]:
    """GPT-2 80 x 304 from its config (105M parameters, 1,048 modules), batch 2x64: the
    guard's per-module and per-parameter work (the buffers walked at each step's start, a
    signal per parameter) on a deep model."""
    from models import gpt2_deep

    model, batch = gpt2_deep()
    return model, batch, None


def gpt2_case() -> tuple[nn.Module, dict, None]:
    """GPT-2 124M from its config (random init), batch 2x64; the loss is ``output.loss``."""
    from models import gpt2_124m

    model, batch = gpt2_124m()
    return model, batch, None


#: every feature that adds to a step, off: the guard's own reading (loss, gradient norm,
#: weight norm every 10th step, RNG and buffers at each step's start)
BARE: dict[str, object] = {"rewind": False, "signals": False, "check_update": False, "spike": False}

#: the guard configurations measured, by name: keyword options of ``NaNGuard`` (a feature
#: that adds to the step adds its lines here: alone on the bare guard, and in the default)
CONFIGS: dict[str, dict[str, object]] = {
    "default": {},  # every default feature on: rewind="auto", signals, update watch, spikes
    "bare": BARE,
    "rewind alone": {**BARE, "rewind": "auto"},  # the state copy (adaptive cadence) + batches
    "signals alone": {**BARE, "signals": True},  # per-layer signals
    "update watch alone": {**BARE, "check_update": True},  # the optimizer step as an origin
    "spike alone": {**BARE, "spike": True},  # the spike detector
    "rollback": {"check_update": "rollback"},  # a pre-step copy so a bad update is undone
}


def _loss(model: nn.Module, x, y, loss_fn) -> torch.Tensor:
    if isinstance(x, dict):  # a transformers model computing its own loss
        return model(**x).loss
    return loss_fn(model(x), y)


def measure(name: str, case, steps: int, warmup: int, config: str = "default") -> float:
    torch.manual_seed(0)
    twin, _, _ = case()  # the unguarded copy: the same weights, no hook of the guard's
    torch.manual_seed(0)
    model, x, y = case()  # (made second: a second copy measured up to 0.6% slower)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    loss_fn = nn.functional.cross_entropy
    with tempfile.TemporaryDirectory() as d:
        guard = NaNGuard(model, opt, directory=d, loss_fn=loss_fn, **CONFIGS[config])
        name = f"{name} [{config}]"

        def plain() -> None:
            loss = _loss(twin, x, y, loss_fn)
            loss.backward()
            twin_opt.step()
            twin_opt.zero_grad()

        def guarded() -> None:
            loss = _loss(model, x, y, loss_fn)
            loss.backward()
            if guard.check(loss, inputs=x, target=y):
                opt.step()
            opt.zero_grad()

        for _ in range(warmup):
            plain()
            guarded()
        times: dict[str, list[float]] = {"plain": [], "guarded": []}
        for i in range(steps):
            order = (
                (("plain", plain), ("guarded", guarded))
                if i % 2 == 0
                else (("guarded", guarded), ("plain", plain))
            )
            for label, fn in order:
                t0 = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t0)
        assert not guard.snapshots, "the benchmark step went non-finite"
        # the check alone, on the gradients of one more backward: a low-noise estimate of
        # what the guard adds to a step
        loss = _loss(model, x, y, loss_fn)
        loss.backward()
        check_times = []
        for _ in range(max(20, steps)):
            t0 = time.perf_counter()
            guard.check(loss, inputs=x, target=y)
            check_times.append(time.perf_counter() - t0)
        opt.zero_grad()
    p = statistics.median(times["plain"])
    g = statistics.median(times["guarded"])
    c = statistics.median(check_times)
    # paired: each guarded step against the unguarded step next to it in time
    ratio = statistics.median(gi / pi for gi, pi in zip(times["guarded"], times["plain"]))
    print(
        f"{name}: unguarded {p * 1e3:.3f} ms/step, guarded {g * 1e3:.3f} ms/step (medians), "
        f"paired ratio {ratio:.3f}x (target <= 1.03x) {'OK' if ratio <= 1.03 else 'OVER'}; "
        f"guard.check alone {c * 1e3:.3f} ms = {1 + c / p:.4f}x of an unguarded step"
    )
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="interleaved step pairs per model")
    ap.add_argument("--quick", action="store_true", help="few steps (smoke run)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    ap.add_argument(
        "--config", action="append", choices=sorted(CONFIGS), help="guard configuration(s)"
    )
    ap.add_argument("--gpt2", action="store_true", help="also GPT-2 124M (minutes per config)")
    ap.add_argument(
        "--deep", action="store_true", help="also GPT-2 80 x 304, 1,048 modules (minutes)"
    )
    ap.add_argument(
        "--world", type=int, default=1, help="N > 1: the DDP guard on N gloo processes (CPU)"
    )
    args = ap.parse_args()
    if args.world > 1:
        from bench_guard_distributed import main_distributed

        main_distributed(args.world, args.steps or (10 if args.quick else 200), args.threads)
        return
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    mlp_steps = args.steps or (10 if args.quick else 300)
    tr_steps = args.steps or (4 if args.quick else 60)
    for config in args.config or list(CONFIGS):
        measure("MLP 784-1024-1024-10, batch 256", mlp_case, mlp_steps, 5, config)
        measure(
            "TransformerEncoder d=128 x4, seq 64, batch 16", transformer_case, tr_steps, 3, config
        )
        measure("ResNet-18 shape, batch 16x3x64x64 (BatchNorm)", resnet_case, tr_steps, 3, config)
        if args.gpt2:
            measure("GPT-2 124M 12x768, batch 2x64", gpt2_case, args.steps or 20, 2, config)
        if args.deep:
            measure(
                "GPT-2 80x304 (1,048 modules), batch 2x64",
                gpt2_deep_case,
                args.steps or 20,
                2,
                config,
            )


if __name__ == "__main__":
    main()
