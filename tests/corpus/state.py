"""State: the weights were already non-finite when the failing step started (a checkpoint
saved in half precision, a pretrained embedding row that was never initialised, a
checkpoint written after a NaN update). No change to the step can repair it
(``weights_corrupted``): the fix is at the earlier step that wrote them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import Batch, Loop, Scenario, gen, sgd


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step: int) -> Batch:
    g = gen(step, 52)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _half_checkpoint(fixed: bool) -> Loop:
    # https://github.com/NVIDIA/apex/issues/1494 (saving the model in FP16 is risky)
    def start(model: nn.Module) -> None:
        assert isinstance(model, nn.Sequential)
        with torch.no_grad():
            model[0].weight[0, 0] = 7e4  # one large weight (a feature in raw units)
        state = model.state_dict()
        if not fixed:
            state = {k: v.half() for k, v in state.items()}  # the checkpoint, in float16
        model.load_state_dict({k: v.float() for k, v in state.items()})

    return Loop(mlp, _batch, F.mse_loss, opt=sgd(1e-9, 0.0), start=start, steps=10)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


def _unk_embedding(fixed: bool) -> Loop:
    # https://github.com/jiesutd/NCRFpp/issues/126 (the </unk> row of an np.empty table: NaN)
    def start(model: nn.Module) -> None:
        assert isinstance(model, Tagger)
        with torch.no_grad():
            model.emb.weight[19] = 0.0 if fixed else float("nan")  # the unknown-token row

    def batch(step: int) -> Batch:
        g = gen(step, 53)
        ids = torch.randint(0, 19, (8, 5), generator=g)
        if step == 6:
            ids[2, 1] = 19  # the first unknown word of the run
        return ids, (ids[:, 0] > 9).long()

    return Loop(Tagger, batch, F.cross_entropy, opt=sgd(0.01), start=start, steps=12)


def _checkpoint_after_nan_update(fixed: bool) -> Loop:
    # https://github.com/Peterande/D-FINE/issues/199 (NaN weights saved during AMP training)
    def start(model: nn.Module) -> None:
        state = model.state_dict()
        if not fixed:
            state["0.bias"][3] = float("nan")  # the update before the save was NaN
        model.load_state_dict(state)

    return Loop(mlp, _batch, F.mse_loss, opt=sgd(0.01), start=start, steps=10)


SCENARIOS = [
    Scenario(
        "a checkpoint saved in float16: a weight beyond 65504",
        "state",
        "weights_corrupted",
        "https://github.com/NVIDIA/apex/issues/1494",
        _half_checkpoint,
    ),
    Scenario(
        "the unknown-token row of a pretrained embedding holds NaN",
        "state",
        "weights_corrupted",
        "https://github.com/jiesutd/NCRFpp/issues/126",
        _unk_embedding,
    ),
    Scenario(
        "resumed from a checkpoint written after a NaN update",
        "state",
        "weights_corrupted",
        "https://github.com/Peterande/D-FINE/issues/199",
        _checkpoint_after_nan_update,
    ),
]
