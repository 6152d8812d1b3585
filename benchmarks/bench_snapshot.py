"""Snapshot write / load / inspect against ``torch.save`` / ``torch.load``, interleaved
round by round, on GPT-2 124M (``GPT2Config()``, random init) with AdamW state and a
2 x 64 token batch:

- ``torch.save`` of the same state (model ``state_dict``, optimizer ``state_dict``, batch)
  to a plain file: the baseline (no fsync);
- ``nbdebug.save_snapshot``: one safetensors file, checksums and non-finite counts per
  tensor, temporary file + fsync + rename (target <= 1.0x torch.save);
- ``NaNGuard(async_save=True)``: the time the training step is held (the copy of the
  tensors' bytes into the snapshot's file, target <= 0.5x torch.save) and until the
  background write ends (checksums, header, fsync, rename; <= 1.5x);
- loads: ``torch.load(weights_only=True)`` of the baseline against ``load_snapshot`` to a
  usable Snapshot (reason, history, batch, RNG states, the weights' table; target <= 0.1x),
  and, for reference, reading its whole model state.

``--large``: GPT-2 large from its config (774M parameters, random init, AdamW state,
about 9 GB on disk) written once, then ``nbdebug inspect`` of it in a subprocess: wall
time (target < 5 s) and peak resident memory from ``wait4``'s ``ru_maxrss`` (< 1 GB).
Every file is deleted at the end.

    python benchmarks/bench_snapshot.py [--quick] [--rounds 5] [--threads 1] [--large]
    python benchmarks/bench_snapshot.py --large-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nbdebug
from nbdebug.core.guard.options import SnapshotOptions
from nbdebug.core.guard.writer import SnapshotWriter
from nbdebug.core.snapshot import TrainingObjects
from nbdebug.core.state import RngState

WRITES = ("torch.save", "save_snapshot", "async held", "async total")
LOADS = ("torch.load", "load_snapshot", "load_snapshot + model state")
TARGETS = {"save_snapshot": 1.0, "async held": 0.5, "async total": 1.5, "load_snapshot": 0.1}


def case(large: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=1280, n_layer=36, n_head=20) if large else GPT2Config()
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (2, 64))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if large:  # AdamW's state as after a step, without the memory of a backward
        for p in model.parameters():
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn_like(p) * 1e-3,
                "exp_avg_sq": torch.rand_like(p) * 1e-6,
            }
    else:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, batch


def nbytes(obj: Any, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(nbytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v, seen) for v in obj)
    return 0


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def async_write(
    root: Path, r: int, model: torch.nn.Module, opt: Any, batch: Any
) -> tuple[float, float]:
    writer = SnapshotWriter(SnapshotOptions(directory=root / f"a{r}", async_save=True))
    t0 = time.perf_counter()
    writer.write(
        TrainingObjects(model, opt),
        r,
        {"kind": "manual", "message": "bench"},
        (batch, None),
        rng=RngState.capture(),
        history=[],
    )
    held = time.perf_counter() - t0
    writer.close()
    return held, time.perf_counter() - t0


def _baseline(root: Path, state: dict[str, Any]) -> dict[str, float]:
    base = root / "b.pt"
    out = {"torch.save": timed(torch.save, state, base)}
    out["torch.load"] = timed(torch.load, base, weights_only=True, map_location="cpu")
    out["size torch.save"] = base.stat().st_size
    base.unlink()
    return out


def _ours(root: Path, r: int, model: torch.nn.Module, opt: Any, batch: Any) -> dict[str, float]:
    snap = root / "s.nbsnap"
    out = {"save_snapshot": timed(nbdebug.save_snapshot, snap, model, batch, optimizer=opt, step=r)}
    out["load_snapshot"] = timed(nbdebug.load_snapshot, snap)
    out["load_snapshot + model state"] = timed(lambda: nbdebug.load_snapshot(snap).model_state)
    out["size snapshot"] = snap.stat().st_size
    snap.unlink()
    return out


def _async(root: Path, r: int, model: torch.nn.Module, opt: Any, batch: Any) -> dict[str, float]:
    held, total = async_write(root, r, model, opt, batch)
    for p in root.glob(f"a{r}/*"):
        p.unlink()
    return {"async held": held, "async total": total}


def one_round(root: Path, r: int, model: torch.nn.Module, opt: Any, batch: Any) -> dict[str, float]:
    """Each writer's file is read back and deleted before the next writes (so that none
    writes while another's file fills the page cache); the order turns every round."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "batch": batch}
    jobs: list[Callable[[], dict[str, float]]] = [
        lambda: _baseline(root, state),
        lambda: _ours(root, r, model, opt, batch),
        lambda: _async(root, r, model, opt, batch),
    ]
    out: dict[str, float] = {}
    for job in jobs[r % 3 :] + jobs[: r % 3]:
        out.update(job())
    return out


def report(times: dict[str, list[float]], payload: int) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for group, base in ((WRITES, "torch.save"), (LOADS, "torch.load")):
        kind = "write" if group is WRITES else "load "
        b = med[base]
        for k in group:
            target = f", target <= {TARGETS[k]:.1f}x" if k in TARGETS else ""
            ok = "" if k not in TARGETS else (" ok" if med[k] / b <= TARGETS[k] else " MISSED")
            print(f"{kind}  {k} {med[k]:.2f} s ({med[k] / b:.2f}x {base}{target}){ok}")
    for k in ("size torch.save", "size snapshot"):
        print(f"size   {k[5:]} {med[k] / 2**20:.0f} MiB ({med[k] / payload:.3f}x the tensors)")


def inspect_large(root: Path) -> None:
    """GPT-2 large written once, then ``nbdebug inspect`` of it in a fresh process."""
    model, opt, batch = case(large=True)
    n = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    path = nbdebug.save_snapshot(root / "large.nbsnap", model, batch, optimizer=opt, step=1)
    wrote = time.perf_counter() - t
    del model, opt
    size = path.stat().st_size
    print(
        f"large  GPT-2 {n / 1e6:.0f}M + AdamW: snapshot {size / 2**30:.2f} GiB, "
        f"written in {wrote:.1f} s"
    )
    summary = (
        "s = nbdebug.load_snapshot(sys.argv[1]); print(repr(s)); s.history_frame(); "
        "print(len(s.state_entries()), s.nonfinite_state()); "
        "print(sorted(s.param_norms().items(), key=lambda kv: -kv[1])[:3])"
    )
    for what, code in (
        ("python + import nbdebug.cli", "pass"),
        ("nbdebug inspect", "main(['inspect', sys.argv[1]])"),
        ("load_snapshot + header summary", summary),
    ):
        took, peak = _measured(code, path)
        print(f"large  {what} {took:.2f} s, peak memory {peak:.2f} GiB")
    print("large  targets: nbdebug inspect < 5 s, peak memory < 1 GB")
    path.unlink()


#: run in a fresh interpreter: the code, then the peak resident memory of this process
#: image (VmHWM: wait4's ru_maxrss would count the benchmark's own memory, which the
#: child had before its exec)
_CHILD = (
    "import sys, nbdebug\nfrom nbdebug.cli import main\n{code}\n"
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "print('VmHWM', int(hwm.split()[1]), file=sys.stderr)\n"
)


def _measured(code: str, path: Path) -> tuple[float, float]:
    """(wall seconds, peak resident GiB) of ``code`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-c", _CHILD.format(code=code), str(path)]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    took = time.perf_counter() - t
    if r.returncode:
        print(r.stdout, r.stderr)
        return took, float("nan")
    kib = int(r.stderr.rsplit("VmHWM", 1)[1].split()[0])
    return took, kib / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)  # IO here is at times throttled
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one round, no --large")
    ap.add_argument("--large", action="store_true", help="also GPT-2 large + nbdebug inspect")
    ap.add_argument("--large-only", action="store_true", help="only the GPT-2 large part")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="nbdebug-bench-") as d:
        root = Path(d)
        if args.large_only:
            inspect_large(root)
            return
        model, opt, batch = case(large=False)
        payload = nbytes({"m": model.state_dict(), "o": opt.state_dict(), "b": batch}, set())
        times: dict[str, list[float]] = {}
        for r in range(rounds):
            for k, v in one_round(root, r, model, opt, batch).items():
                times.setdefault(k, []).append(v)
        n = sum(p.numel() for p in model.parameters())
        print(
            f"GPT-2 {n / 1e6:.0f}M + AdamW state + batch 2x64: {payload / 2**20:.0f} MiB of "
            f"tensors; {rounds} round(s), {args.threads} thread(s)"
        )
        report(times, payload)
        del model, opt
        if args.large and not args.quick:
            inspect_large(root)


if __name__ == "__main__":
    main()
