"""Per-step cost of the distributed NaNGuard (``bench_guard.py --world N``).

``N`` gloo processes on this machine (CPU), each a DDP replica of the MLP 784-1024-1024-10
(batch 256 per rank, Adam). Three step variants run interleaved on the same model and data
(plain, guarded, guarded with ``check_replicas_every=100``), in a rotating order so that
machine noise hits all alike; rank 0 prints the median step time of each and the median of
the paired ratios (each guarded step over the plain step next to it). The replica check
runs on one step in 100, so its cost is reported as the ratio of mean step times and as the
time of one check (an ``all_gather`` of the parameter fingerprints) alone.

Run: ``python benchmarks/bench_guard.py --world 2 [--steps N] [--threads T]``.
"""

from __future__ import annotations

import datetime
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, steps: int, threads: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbdebug.core.guard import NaNGuard

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(256, 784, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)
    loss_fn = nn.functional.cross_entropy
    with tempfile.TemporaryDirectory() as d:
        guard = NaNGuard(ddp, opt, directory=d, loss_fn=loss_fn)
        replicas = NaNGuard(ddp, opt, directory=d, loss_fn=loss_fn, check_replicas_every=100)

        def plain() -> None:
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        def guarded(gd: NaNGuard) -> None:
            loss = loss_fn(ddp(x), y)
            loss.backward()
            if gd.check(loss, inputs=x, target=y):
                opt.step()
            opt.zero_grad()

        variants = {
            "plain": plain,
            "guarded": lambda: guarded(guard),
            "replicas": lambda: guarded(replicas),
        }
        names = list(variants)
        for _ in range(3):
            for fn in variants.values():
                fn()
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(steps):
            order = names[i % 3 :] + names[: i % 3]
            for n in order:
                dist.barrier()  # every rank starts the step together
                t0 = time.perf_counter()
                variants[n]()
                times[n].append(time.perf_counter() - t0)
        assert not guard.snapshots and not replicas.snapshots, "the benchmark went non-finite"
        assert replicas.agreement is not None
        # the check alone (local norms + the agreement's all-reduce), on one backward's
        # gradients: a lower-noise estimate of what the guard adds to a step
        loss = loss_fn(ddp(x), y)
        loss.backward()
        alone = []
        for _ in range(max(20, steps)):
            dist.barrier()
            t0 = time.perf_counter()
            guard.check(loss, inputs=x, target=y)
            alone.append(time.perf_counter() - t0)
        opt.zero_grad()
        named = list(model.named_parameters())
        one = []
        for _ in range(20):
            dist.barrier()
            t0 = time.perf_counter()
            replicas.agreement.compare_replicas(0, named)
            one.append(time.perf_counter() - t0)
    if rank == 0:
        p = statistics.median(times["plain"])
        gm = statistics.median(times["guarded"])
        ratio = statistics.median(a / b for a, b in zip(times["guarded"], times["plain"]))
        mean_ratio = statistics.mean(times["replicas"]) / statistics.mean(times["plain"])
        check = statistics.median(one)
        c = statistics.median(alone)
        print(
            f"DDP world {world} (gloo, CPU), MLP 784-1024-1024-10, batch 256/rank: unguarded "
            f"{p * 1e3:.3f} ms/step, guarded {gm * 1e3:.3f} ms/step (medians), paired ratio "
            f"{ratio:.3f}x (target <= 1.03x) {'OK' if ratio <= 1.03 else 'OVER'}; guard.check "
            f"alone {c * 1e3:.3f} ms = {1 + c / p:.4f}x of an unguarded step"
        )
        print(
            f"DDP world {world}, check_replicas_every=100: mean step ratio {mean_ratio:.3f}x of "
            f"unguarded over {steps} steps; one replica check {check * 1e3:.3f} ms "
            f"(amortised over 100 steps: {check / p:.3f} % of a step)"
        )
    dist.destroy_process_group()


def main_distributed(world: int, steps: int, threads: int) -> None:
    """Launch ``world`` gloo processes and print rank 0's measurements."""
    print(f"torch {torch.__version__}, {threads} thread(s) per rank, {world} ranks")
    mp.spawn(_worker, args=(world, _free_port(), steps, threads), nprocs=world, join=True)


if __name__ == "__main__":  # `make bench` runs every bench_*.py: the two-rank run
    main_distributed(2, 200, 1)
