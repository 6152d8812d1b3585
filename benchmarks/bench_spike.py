"""The guard's spike detector: lead time before the first NaN on diverging runs, and
false alarms on healthy runs of the same models (DESIGN.md / issue 32 targets: flags
several steps before the first NaN on each diverging run, <= 1 false alarm per 10,000
healthy steps).

Three models, each once diverging and once healthy, with the detector at its defaults
(``spike=True``, ``on_spike="ignore"`` so that the findings do not change the run):

* a small transformer language model (2 layers, d=64, 4 heads, a home-made attention
  whose softmax is ``exp(logits) / sum``, no max subtracted), trained with Adam warmed
  up over 200 steps to a learning rate (0.06) that makes its attention logits grow
  until ``exp`` overflows (some 350 steps later); healthy: the same warm-up to 1e-3;
* a ReLU RNN (``nn.RNN(nonlinearity="relu")``, hidden 64, sequences of 40) trained with
  SGD without gradient clipping at lr 0.3 (healthy: lr 0.003 with the gradient norm
  clipped to 1 after the guard's check: at lr 0.01 without clipping this RNN's gradient
  norm already jumps 10-100x its median every few hundred steps, real spikes that the
  detector flags);
* an MLP under a linear warm-up with no cap (``lr = 1e-3 * step``, SGD with momentum)
  (healthy: the same warm-up capped at 0.05 after 50 steps).

The healthy runs also include those of ``spike_healthy.py``: small models trained on
scikit-learn's digits until their batch loss is heavy-tailed near its floor, under the
schedules and batch sizes people use (batch 1, cosine warm restarts, step decay, a GRU),
and, printed apart, a run whose loss spikes and comes back (Adam at lr 3e-3 with BatchNorm
on the memorised digits): its flagged steps are not counted as false alarms.

Every step draws a fresh batch from a fixed synthetic task (the digits: a random batch
of the bundled dataset). A diverging run goes until
the guard reports the first non-finite step; its lead time is that step minus the first
flagged one. A healthy run goes ``--healthy`` steps (default 3,400 per model, 10,200 in
all); every flagged step is a false alarm.

Run: ``python benchmarks/bench_spike.py [--healthy N] [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import tempfile
from collections.abc import Callable

import torch
from spike_healthy import cases as converged_cases
from spike_healthy import recovering
from torch import nn

from nbdebug.core.guard import NaNGuard

VOCAB, SEQ = 32, 24


class NaiveAttention(nn.Module):
    """Self-attention whose softmax does not subtract the maximum: the logits' growth is
    what overflows."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        logits = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        w = torch.exp(logits).masked_fill(mask, 0.0)
        w = w / w.sum(-1, keepdim=True)
        return self.out((w @ v).transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d),
                    "att": NaiveAttention(d, heads),
                    "ln2": nn.LayerNorm(d),
                    "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for blk in self.blocks:
            assert isinstance(blk, nn.ModuleDict)
            h = h + blk["att"](blk["ln1"](h))
            h = h + blk["mlp"](blk["ln2"](h))
        return self.head(h)


def lm_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy copy task: each token is the one three places back, 10 % replaced."""
    start = torch.randint(0, VOCAB, (32, 3), generator=g)
    seq = start.repeat(1, SEQ // 3 + 2)[:, : SEQ + 1]
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


class ReluRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(8, 64, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1]).squeeze(-1)


def rnn_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the first feature over a 40-step sequence."""
    x = torch.randn(32, 40, 8, generator=g)
    return x, x[:, :, 0].sum(1) / 6.0


W_MLP = torch.randn(20, 1, generator=torch.Generator().manual_seed(1))


def mlp_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 20, generator=g)
    return x, torch.tanh(x @ W_MLP).squeeze(-1) + 0.1 * torch.randn(64, generator=g)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )


def epoch_of_unequal_batches() -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    """A fixed epoch of 8 batches, not shuffled, one of them with noisy targets: its loss
    is several times the others' every 8th step, a healthy pattern a robust z-score alone
    (which ignores a minority of high values) would call a spike each epoch."""
    data = [mlp_batch(torch.Generator().manual_seed(100 + i)) for i in range(8)]
    x, y = data[7]
    data[7] = (x, y + 1.5 * torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
    batches = itertools.cycle(data)
    return lambda g: next(batches)


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.squeeze(-1), y)


Case = tuple[
    Callable[[], nn.Module],
    Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    Callable[[int], float],  # lr multiplier by step
    float | None,  # clip the gradient norm to this after the check
]


def cases(diverging: bool) -> dict[str, Case]:
    one = lambda step: 1.0  # noqa: E731
    lm_lr, rnn_lr = (0.06, 0.3) if diverging else (1e-3, 0.003)
    clip = None if diverging else 1.0
    lm_warm = lambda step: min(1.0, (step + 1) / 200)  # noqa: E731
    warm = (lambda s: s + 1.0) if diverging else (lambda s: min(s + 1.0, 50.0))
    unequal: dict[str, Case] = {}
    if not diverging:
        unequal["MLP (fixed epoch, one noisy batch in 8)"] = (
            mlp,
            epoch_of_unequal_batches(),
            mse,
            lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
            one,
            None,
        )
    return unequal | {
        "transformer (naive softmax, Adam)": (
            TinyLM,
            lm_batch,
            lm_loss,
            lambda p: torch.optim.Adam(p, lr=lm_lr),
            lm_warm,
            None,
        ),
        "ReLU RNN (SGD, " + ("no clipping)" if diverging else "clipped)"): (
            ReluRNN,
            rnn_batch,
            mse,
            lambda p: torch.optim.SGD(p, lr=rnn_lr),
            one,
            clip,
        ),
        "MLP (linear warm-up, " + ("no cap)" if diverging else "capped)"): (
            mlp,
            mlp_batch,
            mse,
            lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
            warm,
            None,
        ),
    }


def run(case: Case, steps: int, seed: int = 0) -> tuple[list[int], int | None]:
    """(the flagged steps, the first non-finite step or None) of one run."""
    make, batch, loss_fn, optimizer, lr_at, clip = case
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make()
    opt = optimizer(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    with tempfile.TemporaryDirectory() as d:
        guard = NaNGuard(
            model, opt, directory=d, on_spike="ignore", patience=None, history=steps + 1
        )
        for step in range(steps):
            x, y = batch(g)
            loss = loss_fn(model(x), y)
            loss.backward()
            ok = guard.check(loss, step=step)
            if not ok:
                break
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            sched.step()
        flagged = [f.step for f in guard.spike_findings]
        bad = next((r["step"] for r in guard.history if r.get("nonfinite")), None)
    return sorted(set(flagged)), bad


_GAP = 20  # flagged steps closer than this are one run of flags


def _onset(flagged: list[int]) -> int | None:
    """The first step of the last run of flags (a flag within ``_GAP`` steps of the one
    before it continues the run): where the divergence that ended in the NaN was first
    seen, apart from earlier episodes the run came back from."""
    if not flagged:
        return None
    start = flagged[-1]
    for a, b in zip(reversed(flagged[:-1]), reversed(flagged[1:])):
        if b - a >= _GAP:
            break
        start = a
    return start


def main() -> None:
    import warnings

    warnings.simplefilter("ignore", RuntimeWarning)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--healthy", type=int, default=3400, help="healthy steps per model")
    ap.add_argument("--quick", action="store_true", help="few healthy steps (smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    healthy = 300 if args.quick else args.healthy
    print(f"torch {torch.__version__}; spike detector at its defaults (z=6, window=128)")
    all_ok = True
    for name, case in cases(diverging=True).items():
        flagged, bad = run(case, 3000)
        first = flagged[0] if flagged else None
        before = [s for s in flagged if bad is None or s < bad]
        lead = bad - before[0] if bad is not None and before else None
        last = [s for s in before if bad is not None and s >= bad - 20]
        onset = _onset(before)
        ok = lead is not None and lead >= 3
        all_ok &= ok
        print(
            f"diverging {name}: first NaN at step {bad}, first spike at step {first}: "
            f"lead time {lead} steps; {len(before)} flagged steps before the NaN, "
            f"{len(last)} of the 20 before it; the last run of flags (gaps under "
            f"{_GAP} steps) began at step {onset}, "
            f"{None if onset is None or bad is None else bad - onset} steps before the NaN "
            f"{'OK' if ok else 'MISSED'}"
        )
    total, alarms = 0, 0
    for name, case in (cases(diverging=False) | converged_cases()).items():
        flagged, bad = run(case, healthy)
        assert bad is None, f"the healthy {name} run went non-finite at step {bad}"
        total += healthy
        alarms += len(flagged)
        print(f"healthy {name}: {healthy} steps, {len(flagged)} false alarm(s) at {flagged[:10]}")
    for name, case in recovering().items():
        flagged, bad = run(case, healthy)
        print(
            f"recovering {name}: {healthy} steps, {len(flagged)} flagged at {flagged[:10]} "
            f"(loss spikes that come back; not counted as false alarms)"
        )
    rate = alarms / total * 10_000
    ok = rate <= 1.0
    all_ok &= ok
    print(
        f"false alarms: {alarms} in {total} healthy steps = {rate:.2f} per 10,000 "
        f"(target <= 1) {'OK' if ok else 'OVER'}"
    )
    print("ALL OK" if all_ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
