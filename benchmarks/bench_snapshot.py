"""Snapshot write / load / size on a 124M GPT-2 (``GPT2Config()``, random init) with AdamW
state and a 2 x 64 token batch, measured side by side, interleaved round by round:

- ``torch.save`` of the same state (model ``state_dict``, optimizer ``state_dict``, batch)
  to a plain file: the baseline (no fsync);
- ``nbdebug.save_snapshot`` (torch.save zip + fsync + rename, the format nbdebug writes);
- ``safetensors`` for the tensors beside a JSON file for the rest (the alternative the
  issue asks to measure);
- ``NaNGuard(async_save=True)``: the time the training step is held (the CPU copy), and
  the background write.

Loads: ``torch.load(weights_only=True)`` of the baseline, ``nbdebug.load_snapshot`` (also
``weights_only``), and ``safetensors.torch.load_file``. Size: file bytes over the bytes of
the parameters (tied ones once) + optimizer state + batch.

    python benchmarks/bench_snapshot.py [--rounds 3] [--threads 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import nbdebug
from nbdebug.core.snapshot import read_payload
from nbdebug.core.state import RngState


def case(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (2, 64), device=device)
    batch = {"input_ids": ids, "labels": ids.clone()}
    model(**batch).loss.backward()
    opt.step()  # AdamW state: exp_avg, exp_avg_sq per parameter
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


def flat_tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor], meta: Any) -> Any:
    """Tensors into ``out`` by path (safetensors takes a flat dict), the rest as JSON."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {str(k): flat_tensors(v, f"{prefix}.{k}", out, meta) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [flat_tensors(v, f"{prefix}.{i}", out, meta) for i, v in enumerate(obj)]
    return obj


def save_safetensors(state: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    meta = flat_tensors(state, "s", tensors, None)
    # safetensors refuses shared memory: store a tied tensor once
    for k in list(tensors):
        ptr = tensors[k].untyped_storage().data_ptr()
        if ptr in seen:
            tensors.pop(k)
        else:
            seen[ptr] = k
    save_file(tensors, str(path))
    path.with_suffix(".json").write_text(json.dumps(meta, default=str))


def timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def load_safetensors(path: Path) -> None:
    from safetensors.torch import load_file

    load_file(str(path))
    json.loads(path.with_suffix(".json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, opt, batch = case(args.device)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "batch": batch}
    payload = nbytes(state, set())
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "torch.save",
            "save_snapshot",
            "safetensors",
            "async held",
            "async total",
            "torch.load",
            "load_snapshot",
            "safetensors load",
        )
    }
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for r in range(args.rounds):
            base, snap, st = root / f"b{r}.pt", root / f"s{r}.nbsnap", root / f"t{r}.safetensors"
            times["torch.save"].append(timed(torch.save, state, base))
            times["save_snapshot"].append(
                timed(nbdebug.save_snapshot, snap, model, batch, optimizer=opt, step=r)
            )
            times["safetensors"].append(timed(save_safetensors, state, st))
            guard = nbdebug.NaNGuard(
                model, opt, directory=root / f"a{r}", on_nonfinite="continue", async_save=True
            )
            t0 = time.perf_counter()
            guard.writer.write(
                guard,
                r,
                {"kind": "manual", "message": "bench"},
                batch,
                None,
                rng=RngState.capture(),
            )
            times["async held"].append(time.perf_counter() - t0)
            guard.close()
            times["async total"].append(time.perf_counter() - t0)
            times["torch.load"].append(
                timed(torch.load, base, weights_only=True, map_location="cpu")
            )
            times["load_snapshot"].append(timed(read_payload, snap))
            times["safetensors load"].append(timed(load_safetensors, st))
            sizes = {
                "torch.save": base.stat().st_size,
                "save_snapshot": snap.stat().st_size,
                "safetensors": st.stat().st_size + st.with_suffix(".json").stat().st_size,
            }
            for p in (base, snap, st, *root.glob(f"a{r}/*")):
                os.unlink(p)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(p.numel() for p in model.parameters())
    print(
        f"GPT-2 {n / 1e6:.0f}M + AdamW state + batch 2x64: {payload / 2**20:.0f} MiB of "
        f"tensors; {args.rounds} rounds, {args.threads} thread(s), device {args.device}"
    )
    b = med["torch.save"]
    print(f"write  torch.save {b:.2f} s (1.00x)")
    for k in ("save_snapshot", "safetensors", "async held", "async total"):
        print(f"write  {k} {med[k]:.2f} s ({med[k] / b:.2f}x torch.save)")
    lb = med["torch.load"]
    print(f"load   torch.load(weights_only) {lb:.2f} s (1.00x)")
    for k in ("load_snapshot", "safetensors load"):
        print(f"load   {k} {med[k]:.2f} s ({med[k] / lb:.2f}x torch.load)")
    for k, v in sizes.items():
        print(f"size   {k} {v / 2**20:.0f} MiB ({v / payload:.3f}x params+optimizer+batch)")


if __name__ == "__main__":
    main()
