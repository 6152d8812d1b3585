"""Numerics: an operation written by hand that has no guard (a log of 0, a division by 0, an
exp that overflows, a sqrt at 0 in the backward). The right fix is an epsilon, a clamp or
a shift at that operation, or the torch built-in that has them (``epsilon``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import Batch, Loop, Scenario, adam, gen, sgd


def _xy(step: int, salt: int, classes: int = 3, n: int = 16) -> Batch:
    g = gen(step, salt)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :classes].argmax(1) if classes > 1 else x.sum(1, keepdim=True))


class Head(nn.Module):
    """A linear layer followed by a module written by hand (``post``)."""

    def __init__(self, post: nn.Module, d_out: int = 3, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, d_out)
        self.post = post
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.fc(x) * self.scale)


# ---------------------------------------------------------------------- hand-written ops
class Standardise(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, sd = x.mean(dim=1, keepdim=True), x.std(dim=1, keepdim=True)
        return (x - mu) / (sd + 1e-6) if self.fixed else (x - mu) / sd


class StdNet(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = Standardise(fixed)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


def _stuck_sensor(fixed: bool) -> Loop:
    # https://github.com/PaddlePaddle/Paddle/issues/11445 ((x - mean) / std with std 0)
    def batch(step: int) -> Batch:
        x, y = _xy(step, 11)
        if step == 6:
            x[3] = 0.7  # a sensor stuck at one value: the row's std is 0
        return x, y

    return Loop(lambda: StdNet(fixed), batch, F.cross_entropy)


class Softmax(nn.Module):
    def __init__(self, fixed: bool, log: bool = False) -> None:
        super().__init__()
        self.fixed, self.log = fixed, log

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return F.log_softmax(z, dim=-1) if self.log else F.softmax(z, dim=-1)
        e = torch.exp(z)
        p = e / e.sum(dim=-1, keepdim=True)
        return torch.log(p) if self.log else p


def _onehot_mse(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (p - F.one_hot(y, p.shape[-1]).to(p.dtype)).pow(2).mean()


def _nll_logp(logp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(logp * F.one_hot(y, logp.shape[-1]).to(logp.dtype)).sum(-1).mean()


def _sharp(step: int, salt: int) -> Batch:
    """Classes with a sharp margin: the trained logits grow until exp overflows."""
    x, y = _xy(step, salt)
    return x * 3.0, y


def _softmax_overflow(fixed: bool) -> Loop:
    # https://foreai.co/blog/nans-out-of-nowhere-the-trick-that-saved-my-training-run
    return Loop(
        lambda: Head(Softmax(fixed), scale=5.0),
        lambda s: _sharp(s, 12),
        _onehot_mse,
        opt=sgd(0.5),
        steps=80,
    )


def _log_softmax_by_hand(fixed: bool) -> Loop:
    # https://github.com/tensorflow/models/pull/181 (cross entropy by hand: NaN; built-in ok)
    return Loop(
        lambda: Head(Softmax(fixed, log=True), scale=3.0),
        lambda s: _sharp(s, 13),
        _nll_logp,
        opt=sgd(0.05),
        steps=80,
    )


class Probs(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(z, dim=-1)


def _nll_of_probs(fixed: bool) -> Callable[..., torch.Tensor]:
    def loss(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(y, p.shape[-1]).to(p.dtype)
        logp = torch.log(p.clamp_min(1e-12)) if fixed else torch.log(p)
        return -(logp * onehot).sum(-1).mean()

    return loss


def _log_zero_probability(fixed: bool) -> Loop:
    # https://github.com/summerlvsong/Aggregation-Cross-Entropy/issues/2 (log of a 0 score)
    return Loop(
        lambda: Head(Probs(), scale=3.0),
        lambda s: _sharp(s, 14),
        _nll_of_probs(fixed),
        opt=sgd(0.05),
        steps=80,
    )


def _bce_by_hand(fixed: bool) -> Loop:
    # https://github.com/torch/nn/issues/730 (BCE on a sigmoid that reaches 1: log(0))
    def loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if fixed:
            return F.binary_cross_entropy_with_logits(z, y)
        p = torch.sigmoid(z)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()

    def batch(step: int) -> Batch:
        x, _ = _xy(step, 15)
        y = (x[:, :1] > 0).float()
        if step == 9:
            y[2] = 1.0 - y[2]  # a mislabelled record, confidently predicted the other way
        return x * 3.0, y

    return Loop(lambda: Head(nn.Identity(), d_out=1, scale=3.0), batch, loss, opt=sgd(0.05))


class Siamese(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 4)
        self.fixed = fixed

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d2 = (self.enc(a) - self.enc(b)).pow(2).sum(1)
        return torch.sqrt(d2.clamp_min(1e-12)) if self.fixed else torch.sqrt(d2)


def _contrastive(d: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    return (same * d.pow(2) + (1 - same) * torch.relu(1.0 - d).pow(2)).mean()


def _duplicate_pair(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/2421 (the gradient at a zero norm is NaN)
    def batch(step: int) -> Batch:
        g = gen(step, 16)
        a = torch.randn(16, 8, generator=g)
        b = a + 0.3 * torch.randn(16, 8, generator=g)
        same = (torch.rand(16, generator=g) > 0.5).float()
        if step == 6:
            b[7] = a[7]  # the same record twice in a pair: distance exactly 0
        return (a, b), same

    return Loop(lambda: Siamese(fixed), batch, _contrastive)


class Rate(nn.Module):
    """A per-exposure rate, guarded by ``torch.where``: the unselected branch still
    divides by 0, and its gradient is NaN."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 1)
        self.fixed = fixed

    def forward(self, x: torch.Tensor, exposure: torch.Tensor) -> torch.Tensor:
        out = self.fc(x).squeeze(1)
        safe = torch.where(exposure == 0, torch.ones_like(exposure), exposure)
        rate = out / (safe if self.fixed else exposure)
        return torch.where(exposure == 0, torch.zeros_like(rate), rate)


def _where_nan_gradient(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/16317 (NaN gradients after torch.where)
    def batch(step: int) -> Batch:
        g = gen(step, 17)
        x = torch.randn(16, 8, generator=g)
        exposure = torch.rand(16, generator=g) + 0.5
        if step == 5:
            exposure[11] = 0.0  # a policy with no exposure yet
        return (x, exposure), x[:, 0]

    return Loop(lambda: Rate(fixed), batch, F.mse_loss)


class Cosine(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 4, bias=False)
        self.fixed = fixed

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        u, v = self.enc(a), self.enc(b)
        if self.fixed:
            return F.cosine_similarity(u, v, dim=1)
        return (u * v).sum(1) / (u.norm(dim=1) * v.norm(dim=1))


def _cosine_zero_vector(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/2421 (a zero norm in a division)
    def batch(step: int) -> Batch:
        g = gen(step, 18)
        a, b = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        if step == 6:
            a[4] = 0.0  # an all-padding record: its embedding is the zero vector
        return (a, b), torch.ones(16)

    return Loop(lambda: Cosine(fixed), batch, F.mse_loss)


class Attention(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 2)
        self.fixed = fixed

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = (q @ k.transpose(1, 2)) / 8**0.5
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        if self.fixed:
            p = p.nan_to_num(0.0)  # a sequence with no token attends to nothing
        return self.out((p @ v).mean(1))


def _all_padding(fixed: bool) -> Loop:
    # https://github.com/OpenBMB/ModelCenter/issues/14 (-inf masks: NaN after the softmax)
    def batch(step: int) -> Batch:
        g = gen(step, 19)
        x = torch.randn(4, 5, 8, generator=g)
        mask = torch.ones(4, 5, dtype=torch.bool)
        mask[:, 4] = False
        if step == 6:
            mask[2] = False  # an empty sequence after truncation
        return (x, mask), torch.randint(0, 2, (4,), generator=g)

    return Loop(lambda: Attention(fixed), batch, F.cross_entropy)


def _kl_by_hand(fixed: bool) -> Loop:
    # https://github.com/Lightning-AI/torchmetrics/issues/1029 (KL of 0-probabilities: NaN)
    def loss(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if fixed:
            return (torch.xlogy(p, p) - p * torch.log(q)).sum(-1).mean()
        return (p * torch.log(p / q)).sum(-1).mean()

    def batch(step: int) -> Batch:
        g = gen(step, 20)
        x = torch.randn(16, 8, generator=g)
        p = torch.softmax(x[:, :3], dim=-1)
        if step == 6:
            p[5] = torch.tensor([1.0, 0.0, 0.0])  # a hard label among the soft ones
        return x, p

    return Loop(lambda: Head(Probs()), batch, loss)


class BatchStandardise(nn.Module):
    """Standardises each feature over the batch by hand (a BatchNorm without its
    epsilon): a batch of one record has an undefined (unbiased) std."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.fixed:
            var = h.var(dim=0, unbiased=False, keepdim=True)  # as BatchNorm: biased, + eps
            h = (h - h.mean(dim=0, keepdim=True)) / torch.sqrt(var + 1e-5)
        else:
            h = (h - h.mean(dim=0, keepdim=True)) / h.std(dim=0, keepdim=True)
        return self.fc2(torch.relu(h))


def _batch_of_one(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/1381 (a batch of size 1: everything NaN)
    def batch(step: int) -> Batch:
        return _xy(step, 21, n=1 if step == 7 else 16)  # the epoch's last, odd batch

    return Loop(lambda: BatchStandardise(fixed), batch, F.cross_entropy)


def _softplus_by_hand(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/49844 (log-sigmoid / softplus of large logits)
    def loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a log-likelihood of positive counts, with the rate log(1 + exp(z)) by hand
        rate = F.softplus(z) if fixed else torch.log(1 + torch.exp(z))
        return (rate - y * torch.log(rate + 1e-6)).mean()

    def batch(step: int) -> Batch:
        x, _ = _xy(step, 22)
        y = torch.poisson(torch.full((16, 1), 3.0), generator=gen(step, 22))
        if step == 6:
            x[10] = x[10] * 400.0  # a record far out: its logit passes 88
        return x, y

    return Loop(lambda: Head(nn.Identity(), d_out=1, scale=3.0), batch, loss, opt=sgd(0.01))


def _focal_by_hand(fixed: bool) -> Loop:
    # https://github.com/clcarwin/sphereface_pytorch/issues/24 (a focal loss giving NaN)
    def loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if fixed:
            logp = F.log_softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1)
        else:
            logp = torch.log(torch.softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1))
        return (-((1 - logp.exp()) ** 2) * logp).mean()

    def batch(step: int) -> Batch:
        x, y = _sharp(step, 23)
        if step == 30:
            y[6] = (y[6] + 1) % 3  # a mislabelled record (the run fails before it)
        return x, y

    return Loop(lambda: Head(nn.Identity(), scale=6.0), batch, loss, opt=sgd(0.1), steps=60)


class RMSNorm(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1, keepdim=True)
        return x / torch.sqrt(ms + 1e-6) if self.fixed else x / torch.sqrt(ms)


class Tokens(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.norm = RMSNorm(fixed)
        self.out = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(ids)).mean(1))


def _rmsnorm_padding(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/6394 (sqrt at 0 in the chain rule: NaN)
    def batch(step: int) -> Batch:
        g = gen(step, 24)
        ids = torch.randint(1, 10, (8, 6), generator=g)
        if step == 6:
            ids[3, 4:] = 0  # padding tokens: all-zero embeddings
        return ids, (ids[:, 0] > 5).long()

    return Loop(lambda: Tokens(fixed), batch, F.cross_entropy, opt=adam(1e-2))


def _scenario(name: str, source: str, loop: Callable[[bool], Loop]) -> Scenario:
    return Scenario(name, "numerics", "epsilon", source, loop)


SCENARIOS = [
    _scenario(
        "standardisation of a constant row (std 0)",
        "https://github.com/PaddlePaddle/Paddle/issues/11445",
        _stuck_sensor,
    ),
    _scenario(
        "hand-written softmax: exp overflows",
        "https://foreai.co/blog/nans-out-of-nowhere-the-trick-that-saved-my-training-run",
        _softmax_overflow,
    ),
    _scenario(
        "hand-written log-softmax (exp, sum, div, log)",
        "https://github.com/tensorflow/models/pull/181",
        _log_softmax_by_hand,
    ),
    _scenario(
        "log of a probability that reached 0",
        "https://github.com/summerlvsong/Aggregation-Cross-Entropy/issues/2",
        _log_zero_probability,
    ),
    _scenario(
        "binary cross-entropy by hand on a saturated sigmoid",
        "https://github.com/torch/nn/issues/730",
        _bce_by_hand,
    ),
    _scenario(
        "euclidean distance of a duplicate pair: sqrt'(0)",
        "https://github.com/pytorch/pytorch/issues/2421",
        _duplicate_pair,
    ),
    _scenario(
        "torch.where over a division by zero: NaN gradient",
        "https://github.com/pytorch/pytorch/issues/16317",
        _where_nan_gradient,
    ),
    _scenario(
        "cosine similarity by hand with a zero vector",
        "https://github.com/pytorch/pytorch/issues/2421",
        _cosine_zero_vector,
    ),
    _scenario(
        "attention over an all-padding sequence",
        "https://github.com/OpenBMB/ModelCenter/issues/14",
        _all_padding,
    ),
    _scenario(
        "KL divergence by hand with a zero probability",
        "https://github.com/Lightning-AI/torchmetrics/issues/1029",
        _kl_by_hand,
    ),
    _scenario(
        "batch standardisation by hand on a batch of one",
        "https://github.com/pytorch/pytorch/issues/1381",
        _batch_of_one,
    ),
    _scenario(
        "softplus by hand: log(1 + exp(z)) overflows",
        "https://github.com/pytorch/pytorch/issues/49844",
        _softplus_by_hand,
    ),
    _scenario(
        "focal loss by hand: log of an underflowed probability",
        "https://github.com/clcarwin/sphereface_pytorch/issues/24",
        _focal_by_hand,
    ),
    _scenario(
        "RMSNorm without epsilon on padding tokens",
        "https://github.com/pytorch/pytorch/issues/6394",
        _rmsnorm_padding,
    ),
]
