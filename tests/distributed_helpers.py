"""Launch a few gloo processes on localhost for the distributed guard tests.

:func:`launch` starts ``world`` spawned processes (a free port chosen at run time), runs
``fn(rank, world, tmp, *args)`` in each after ``init_process_group("gloo")``, and returns
what each rank returned (or the exception it raised, as plain data). Every process is
joined or killed before it returns, also when the test fails or times out.
"""

from __future__ import annotations

import datetime
import hashlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "nbdebug",
    "nbdebug.core.guard",
    "nbdebug.analysis.checks",
    __name__,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, q: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=30),
        )
        out: dict[str, Any] = {"value": fn(rank, world, *args)}
    except BaseException as e:  # reported to the test as data
        out = {
            "error": type(e).__name__,
            "message": str(e),
            "ranks": getattr(e, "ranks", None),
            "traceback": traceback.format_exc(),
        }
    # plain pickle: tensors travel by value, not as shared memory tied to this process
    q.put((rank, pickle.dumps(out)))
    q.close()
    q.join_thread()
    os._exit(0)  # no atexit handler waits on a peer that is gone


def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0) -> dict[int, Any]:
    """``{rank: {"value": ...} or {"error": name, "message": ..., "ranks": ...}}``; a rank
    that exited without answering is missing."""
    ctx = mp.get_context("forkserver")
    # one server imports torch once; every rank of every run is forked from it
    ctx.set_forkserver_preload(PRELOAD)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, q, args), daemon=True)
        for r in range(world)
    ]
    results: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, out = q.get(timeout=0.2)
                results[rank] = pickle.loads(out)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
    return results


# --------------------------------------------------------------------------- training


def make_model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _outcome(guard: Any, model: nn.Module, oks: list[bool]) -> dict[str, Any]:
    import nbdebug

    snaps = []
    for path in guard.snapshots:
        snap = nbdebug.load_snapshot(path)
        snaps.append(
            {
                "name": Path(path).name,
                "kind": snap.kind,
                "message": snap.message,
                "distributed": {
                    "rank": snap.rank,
                    "world_size": snap.world_size,
                    "local_first": snap.local_first,
                    "culprit_ranks": snap.culprit_ranks,
                    "rank_kinds": snap.rank_kinds,
                },
                "inputs_finite": bool(torch.isfinite(snap.inputs).all()),
            }
        )
    return {
        "oks": oks,
        "snapshots": snaps,
        "hash": params_hash(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "replicas": [(f.step, f.parameter, f.ranks, f.n_differing) for f in guard.replica_findings],
        "replica_rows": [(r["step"], r["replicas"]) for r in guard.history if "replicas" in r],
    }


def train(
    rank: int,
    world: int,
    directory: str,
    *,
    steps: int = 6,
    nan_step: int = 3,
    nan_rank: int = 1,
    where: str = "batch",
    perturb: tuple[int, int] | None = None,
    check_replicas_every: int | None = None,
) -> dict[str, Any]:
    """A DDP run where ``nan_rank``'s batch (``where="batch"``) or only its loss
    (``where="loss"``: a detached NaN term, gradients finite, the first micro-batch under
    ``no_sync()``) is NaN at ``nan_step``; ``perturb=(rank, step)`` nudges one weight of
    that rank after that step's update."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nbdebug

    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(
        ddp,
        opt,
        directory=directory,
        loss_fn=F.mse_loss,
        timeout=20,
        check_replicas_every=check_replicas_every,
    )
    oks = []
    for step in range(steps):
        x, y = batch(rank, step)
        bad = rank == nan_rank and step == nan_step
        if where == "batch":
            if bad:
                x[2, 1] = float("nan")
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
        else:  # two micro-batches; the first's gradients stay local (no_sync)
            with ddp.no_sync():
                first = F.mse_loss(ddp(x[:4]), y[:4])
                first.backward()
            second = F.mse_loss(ddp(x[4:]), y[4:])
            second.backward()
            loss = first.detach() + second.detach()
            if bad:
                loss = loss + torch.tensor(float("nan"))  # a logged term, not differentiated
        ok = guard.check(loss, inputs=x, target=y, step=step)
        oks.append(ok)
        if ok:
            opt.step()
        opt.zero_grad()
        if perturb is not None and (rank, step) == perturb:
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-3
    return _outcome(guard, model, oks)


def _ddp_guarded(directory: str) -> tuple[nn.Module, Any, Any]:
    """A DDP replica of :func:`make_model`, its SGD and a guard that waits 3 s."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nbdebug

    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    return ddp, opt, nbdebug.NaNGuard(ddp, opt, directory=directory, timeout=3)


def skip_one_check(rank: int, world: int, directory: str) -> Any:
    """A DDP run where rank 1 leaves out its check() at step 1 and trains on: its next
    collective is DDP's gradient all-reduce, while rank 0 waits in the agreement."""
    ddp, opt, guard = _ddp_guarded(directory)
    for step in range(4):
        x, y = batch(rank, step)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        if not (rank == 1 and step == 1):
            guard.check(loss, inputs=x, target=y, step=step)
        opt.step()
        opt.zero_grad()
    return "trained"


def exit_before_check(rank: int, world: int, directory: str) -> Any:
    """Rank 1 does its forward and backward (DDP's all-reduce included) at step 2, then
    exits without calling ``check()``."""
    ddp, opt, guard = _ddp_guarded(directory)
    for step in range(5):
        x, y = batch(rank, step)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        if rank == 1 and step == 2:
            os._exit(0)
        started = time.monotonic()
        try:
            if guard.check(loss, step=step):
                opt.step()
        except Exception as e:
            return {
                "error": type(e).__name__,
                "message": str(e),
                "ranks": getattr(e, "ranks", None),
                "seconds": time.monotonic() - started,
                "step": step,
            }
        opt.zero_grad()
    return "no error"


def bad_setups(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Each bad input in turn, on a healthy group: a wrong process_group, a group this rank
    is not in, different models, then (last: it leaves the ranks' guards unpaired) a guard
    on rank 0 only."""
    import torch.distributed as dist

    import nbdebug

    out: dict[str, Any] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        started = time.monotonic()
        try:
            fn()
            out[name] = None
        except Exception as e:
            out[name] = {
                "error": type(e).__name__,
                "message": str(e),
                "ranks": getattr(e, "ranks", None),
                "seconds": time.monotonic() - started,
            }

    model = make_model()
    attempt("kind", lambda: nbdebug.NaNGuard(model, process_group="gloo"))
    only0 = dist.new_group([0])
    attempt("member", lambda: nbdebug.NaNGuard(model, process_group=only0))
    other = make_model(16 if rank == 0 else 32)
    attempt("models", lambda: nbdebug.NaNGuard(other, process_group=dist.group.WORLD, timeout=10))
    choice = "raise" if rank == 0 else "skip"  # the ranks would decide differently
    attempt("options", lambda: nbdebug.NaNGuard(model, on_nonfinite=choice, timeout=10))
    # each rank alone, one directory: a file per rank all the same
    alone = nbdebug.NaNGuard(model, directory=directory, process_group=False)
    alone.check(torch.tensor(float("nan")), step=3)
    out["alone"] = [p.name for p in alone.snapshots]
    steps = nbdebug.NaNGuard(model, process_group=dist.group.WORLD, timeout=10)
    attempt("steps", lambda: steps.check(torch.tensor(1.0), step=5 + rank))
    dist.barrier()
    if rank == 0:
        attempt("some_ranks", lambda: nbdebug.NaNGuard(model, directory=directory, timeout=3))
    else:
        time.sleep(4)
    return out


def models_differ_store_host_exits(rank: int, world: int, directory: str) -> Any:
    """Different models on the two ranks. Rank 0 hosts the store and exits as soon as its
    guard raises; rank 1 reads the store slowly (each read 1 s late)."""
    import torch.distributed as dist

    import nbdebug

    if rank == 1:
        c10d = dist.distributed_c10d
        real = c10d._get_default_store()

        class SlowReads:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def get(self, key: str) -> bytes:
                time.sleep(1.0)
                return real.get(key)

        c10d._get_default_store = SlowReads  # type: ignore[attr-defined]
    return nbdebug.NaNGuard(make_model(16 if rank == 0 else 32), timeout=10)


def fsdp2(rank: int, world: int, directory: str) -> dict[str, Any]:
    """FSDP2 (``fully_shard``) on CPU: a NaN in rank 1's batch at step 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import nbdebug

    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(
        model, opt, directory=directory, loss_fn=F.mse_loss, timeout=20, max_snapshots=None
    )
    oks = []
    for step in range(4):
        x, y = batch(rank, step)
        if rank == 1 and step == 2:
            x[0, 0] = float("nan")
        loss = F.mse_loss(model(x), y)
        loss.backward()
        ok = guard.check(loss, inputs=x, target=y, step=step)
        oks.append(ok)
        if ok:
            opt.step()
        opt.zero_grad()
    local = [p.to_local().detach().clone() for p in model.parameters()]
    return {
        "oks": oks,
        "snapshots": [Path(p).name for p in guard.snapshots],
        "finite": all(bool(torch.isfinite(t).all()) for t in local),
    }
