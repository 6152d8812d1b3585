"""Small models that fail in known ways: the public scenario suite of the trace tests
(and of the health checks, the debugger and the notebooks)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Scenario:
    """A model, a batch and what ``nbdebug.trace`` must report for it."""

    name: str
    model: nn.Module
    inputs: Any
    target: Any = None
    loss_fn: Callable[..., Any] | None = None
    phase: str | None = None  # expected origin phase (None: healthy)
    module: str | None = None  # expected origin module
    samples: list[int] | None = None  # expected origin rows
    op: str | None = None  # expected op (substring), when the scenario pins it
    param: str | None = None


class Normalize(nn.Module):
    """A hand-written per-row normalisation without epsilon: 0/0 on constant rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=1, keepdim=True)
        return centered / centered.abs().amax(dim=1, keepdim=True)


class ExpScore(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class SqrtLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class SafeSqrt(nn.Module):
    """The classic hidden NaN: the unselected branch of torch.where."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class SqrtGate(nn.Module):
    """Output x * sqrt(w): finite forward and input gradient, inf gradient of ``w`` at 0."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt(self.w)


class ParentDivides(nn.Module):
    """The parent's own code makes the NaN (0/0) and a child passes it on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.child = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        zero = h - h
        h = zero / zero.abs().sum(dim=1, keepdim=True)
        return self.child(h)


class LossInside(nn.Module):
    """Takes a dict batch and returns its own loss (Hugging Face style)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def handwritten_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy written by hand: log of a softmax that underflows to exactly 0."""
    probs = torch.softmax(logits, dim=1)
    onehot = F.one_hot(target, logits.shape[1]).to(logits.dtype)
    return -(onehot * torch.log(probs)).sum(dim=1).mean()


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def scenarios() -> list[Scenario]:
    torch.manual_seed(0)
    out = []

    x = torch.randn(8, 4)
    x[3, 1] = float("nan")
    out.append(
        Scenario(
            "nan_in_batch",
            nn.Sequential(nn.Linear(4, 3)),
            x,
            torch.randint(0, 3, (8,)),
            F.cross_entropy,
            "input",
            "",
            [3],
        )
    )

    x = torch.randn(6, 5)
    x[2] = 1.0
    x[4] = -3.0
    out.append(
        Scenario(
            "zero_over_zero_norm",
            nn.Sequential(Normalize(), nn.Linear(5, 2)),
            x,
            torch.randn(6, 2),
            mse,
            "forward",
            "0",
            [2, 4],
            "div",
        )
    )

    x = torch.randn(5, 3)
    x[1, 0] = 200.0
    out.append(
        Scenario(
            "exp_overflow",
            nn.Sequential(nn.Identity(), ExpScore(), nn.Linear(3, 1)),
            x,
            torch.randn(5, 1),
            mse,
            "forward",
            "1",
            [1],
            "exp",
        )
    )

    lin = nn.Linear(4, 4).half()
    with torch.no_grad():
        lin.weight.fill_(30.0)
        lin.bias.zero_()
    x = torch.ones(4, 4, dtype=torch.float16)
    x[0] = 1.0
    x[2] = 600.0
    out.append(
        Scenario(
            "fp16_linear_overflow",
            nn.Sequential(lin),
            x,
            None,
            lambda o: o.float().mean(),
            "forward",
            "0",
            [2],
            "linear",
        )
    )

    logits_model = nn.Sequential(nn.Linear(3, 3))
    with torch.no_grad():
        logits_model[0].weight.copy_(torch.eye(3) * 1000.0)
        logits_model[0].bias.zero_()
    x = torch.zeros(4, 3)
    x[1] = torch.tensor([1.0, 0.0, 0.0])
    y = torch.tensor([0, 1, 2, 0])
    out.append(
        Scenario("log_zero_in_loss", logits_model, x, y, handwritten_nll, "loss", "", [1], "log")
    )

    x = torch.randn(6, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), SqrtLayer(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 6)
    x[3, 2] = -1.0  # ReLU -> exactly 0 -> sqrt'(0) = inf in backward, row 3
    out.append(
        Scenario(
            "sqrt_zero_backward", model, x, torch.zeros(6, 1), mse, "backward", "2", [3], "sqrt"
        )
    )

    model = nn.Sequential(nn.Linear(4, 4), SafeSqrt(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 5)
    x[1, 0] = -2.0
    out.append(
        Scenario(
            "where_sqrt_negative", model, x, torch.zeros(5, 1), mse, "backward", "1", [1], "sqrt"
        )
    )

    gate = SqrtGate(4)
    with torch.no_grad():
        gate.w[2] = 0.0
    model = nn.Sequential(nn.Linear(4, 4), gate, nn.Linear(4, 1))
    out.append(
        Scenario(
            "param_grad_only",
            model,
            torch.randn(6, 4),
            torch.zeros(6, 1),
            mse,
            "backward",
            "1",
            None,
            "sqrt",
            "1.w",
        )
    )

    deep = nn.Sequential(
        nn.Linear(5, 5),
        nn.Sequential(nn.Tanh(), nn.Sequential(nn.Linear(5, 5), Normalize())),
        nn.Linear(5, 1),
    )
    with torch.no_grad():
        deep[1][1][0].weight.zero_()
        deep[1][1][0].bias.fill_(0.5)
    out.append(
        Scenario(
            "deep_nested",
            deep,
            torch.randn(7, 5),
            torch.zeros(7, 1),
            mse,
            "forward",
            "1.1.1",
            list(range(7)),
            "div",
        )
    )

    out.append(
        Scenario(
            "parent_code",
            ParentDivides(),
            torch.randn(3, 4),
            torch.zeros(3, 2),
            mse,
            "forward",
            "",
            [0, 1, 2],
            "div",
        )
    )

    x = torch.randn(6, 4)
    x[5, 0] = float("inf")
    out.append(
        Scenario(
            "dict_batch_own_loss",
            LossInside(),
            {"x": x, "labels": torch.tensor([0, 1, 2, 0, 1, 2])},
            None,
            None,
            "input",
            "",
            [5],
        )
    )

    lin = nn.Linear(4, 2)
    with torch.no_grad():
        lin.weight[1, 3] = float("nan")
    out.append(
        Scenario(
            "corrupted_weight",
            nn.Sequential(nn.Linear(4, 4), nn.ReLU(), lin),
            torch.randn(5, 4),
            torch.zeros(5, 2),
            mse,
            "forward",
            "2",
            list(range(5)),
            "linear",
            "2.weight",
        )
    )

    healthy = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(4 * 8 * 8, 5),
    )
    out.append(
        Scenario(
            "healthy", healthy, torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)), F.cross_entropy
        )
    )
    return out


def by_name(name: str) -> Scenario:
    return next(s for s in scenarios() if s.name == name)


def bn_dropout_model() -> nn.Module:
    """Conv + BatchNorm + Dropout in train mode, one BatchNorm in eval, a frozen weight and
    existing ``.grad``: the state that debugging must leave as it was."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
        nn.BatchNorm1d(3),
    )
    model.train()
    model[6].eval()  # mixed modes must survive too
    model[0].weight.requires_grad_(False)  # and a frozen weight
    model(torch.randn(4, 3, 6, 6)).sum().backward()  # pre-existing .grad
    return model


def tiny_gpt2() -> Any:
    """A 1-layer GPT-2 from its config (16 wide, vocabulary 32, dropout off), random init,
    seeded: the model of the Hugging Face trainer tests."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=32,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class ReluRNN(nn.Module):
    """An Elman RNN with ReLU and a near-identity recurrence (IRNN, recurrence 0.9 x I),
    hidden 32 over 4 inputs, the last step's state into one output: without gradient
    clipping its gradients grow with the sequence (the divergence tests and the corpus)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(32) * 0.9)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of a linear regression: 16 x 8 inputs, target 3 x their sum
    plus noise (seeded by the step)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True) * 3 + 0.1 * torch.randn(16, 1, generator=g)


def sequence_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of sequences for :class:`ReluRNN`: 16 x 40 x 4, target the sum
    of the first feature over time (seeded by the step)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 40, 4, generator=g)
    return x, x[:, :, 0].sum(1, keepdim=True)


def warmup_mlp() -> nn.Module:
    """The MLP of :func:`run_uncapped_warmup` (a factory for ``diagnose(model=...)``)."""
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def run_uncapped_warmup(
    guard_options: dict[str, Any], *, stop_at_nonfinite: bool = True
) -> tuple[Any, list[float], Any]:
    """An MLP learning to copy its first input under SGD with momentum and a linear lr
    warm-up without a cap (lr 1e-3 x (step + 1); the scheduler steps whether or not an
    update was skipped, as in most loops): its loss falls to 0.001, climbs for a hundred
    steps and goes to inf near step 435. Runs under ``NaNGuard(model, opt,
    **guard_options)`` until its first non-finite step (``stop_at_nonfinite``), an error of
    the guard's, or 2,000 steps; returns the guard, every step's loss as plain torch
    computed it, and the ``NonFiniteError`` that stopped the run (``None``: none did)."""
    from nbdebug.core.guard import NaNGuard, NonFiniteError

    torch.manual_seed(0)
    model = warmup_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s + 1.0)
    guard = NaNGuard(model, opt, **guard_options)
    g = torch.Generator().manual_seed(0)
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(2000):
            x = torch.randn(32, 8, generator=g)
            loss = F.mse_loss(model(x), x[:, :1])
            loss.backward()
            losses.append(loss.item())
            try:
                ok = guard.check(loss, inputs=x, target=x[:, :1], step=step)
            except NonFiniteError as error:
                return guard, losses, error
            if ok:
                opt.step()
            elif stop_at_nonfinite and guard.history[-1]["nonfinite"]:
                break
            opt.zero_grad()
            sched.step()
    return guard, losses, None
