"""The trainer callbacks under DDP: real 2-process gloo runs on CPU with a NaN on rank 1
only at step K: the Lightning ``Trainer`` (``strategy="ddp"``, ``devices=2``) and the
Hugging Face ``Trainer`` (DDP through accelerate).

The processes are started by ``distributed_helpers.launch`` (free port, process group
initialised, every process joined or killed); each sets the environment a launcher such as
torchrun would (``LOCAL_RANK`` among it), so neither trainer starts processes of its own:
both use the group that is already there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import distributed_helpers as h
import pytest
import torch
import torch.nn.functional as F
from models import tiny_gpt2
from torch import nn

import nbdebug

try:
    import lightning as L
except ImportError:  # the extra is not installed: the Lightning tests are skipped
    L = None

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built in"
)
needs_lightning = pytest.mark.skipif(
    L is None, reason="the nbdebug[lightning] extra is not installed"
)

K = 2  # the step whose batch makes a NaN on rank 1
BAD_RANK = 1
BAD_ROW = 3
STEPS = 4
BATCH = 4


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class DDPModule(L.LightningModule if L is not None else nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.log_in = Log()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.log_in(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def rank_data(rank: int) -> torch.utils.data.DataLoader:
    """Each rank's own batches (no DistributedSampler); rank 1's batch K makes log(-1)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(BATCH * STEPS, 4, generator=g) + 0.5
    y = torch.randn(BATCH * STEPS, 1, generator=g)
    if rank == BAD_RANK:
        x[K * BATCH + BAD_ROW, 0] = -1.0
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)


def env(rank: int, world: int) -> None:
    """The environment a launcher sets for one rank (the process group already exists)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",  # unused: the process group is already initialised
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )


def fit_ddp(rank: int, world: int, directory: str) -> dict[str, Any]:
    """One rank of the run: the environment a launcher sets, then ``Trainer.fit``."""
    from nbdebug.integrations.lightning import NaNGuardCallback

    env(rank, world)
    # no loss_fn=: the loss lives in training_step, the common LightningModule shape
    cb = NaNGuardCallback(directory=directory, timeout=30)
    module = DDPModule()
    changed: list[bool] = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, b: Any, i: int) -> None:
            self.before = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, o: Any, b: Any, i: int) -> None:
            now = list(pl_module.parameters())
            changed.append(any(not torch.equal(a, p) for a, p in zip(self.before, now)))

    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        use_distributed_sampler=False,
        callbacks=[cb, Watch()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, rank_data(rank))
    rows = {r["step"]: r["nonfinite"] for r in cb.guard.history}
    return {
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "skipped": list(cb.skipped),
        "rows": rows,
        "changed": changed,
        "snapshots": [Path(p).name for p in cb.guard.snapshots],
        "hash": h.params_hash(module),
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
    }


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("lightning_ddp")
    results = h.launch(fit_ddp, 2, str(directory), timeout=120)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        assert "value" in results[r], results[r].get("traceback", results[r])
    return directory, [results[0]["value"], results[1]["value"]]


@needs_lightning
@pytest.mark.timeout(180)
def test_under_ddp_every_rank_skips_the_step_one_rank_made_nan(ddp_run: Any) -> None:
    directory, values = ddp_run
    for r, v in enumerate(values):
        assert (v["strategy"], v["world_size"]) == ("DDPStrategy", 2)
        assert v["skipped"] == [K], (r, v)
        assert v["changed"] == [i != K for i in range(STEPS)], (r, v["changed"])
        assert v["snapshots"] == [f"step-{K:09d}-rank{r}.nbsnap"]
        assert v["finite"]
    # rank 1's own loss was NaN; rank 0 got the NaN through DDP's gradient all-reduce
    assert values[BAD_RANK]["rows"][K] == "loss" and values[0]["rows"][K] == "grad"
    assert all(values[r]["rows"][i] is None for r in (0, 1) for i in range(STEPS) if i != K)
    assert values[0]["hash"] == values[1]["hash"]  # identical replicas after the run
    files = sorted(p.name for p in directory.glob("*.nbsnap"))
    assert files == [f"step-{K:09d}-rank{r}.nbsnap" for r in (0, 1)]


@needs_lightning
@pytest.mark.timeout(180)
def test_compare_ranks_over_the_lightning_snapshots_names_rank_1(ddp_run: Any) -> None:
    directory, _ = ddp_run
    report = nbdebug.compare_ranks(directory, model=DDPModule)
    assert (report.step, report.world_size, report.missing_ranks) == (K, 2, [])
    assert report.culprit_ranks == [BAD_RANK] and report.replayed_culprits == [BAD_RANK]
    assert report.params_agree is True
    bad = report.rank(BAD_RANK)
    assert (bad.origin_phase, bad.origin_rows) == ("forward", [BAD_ROW])
    snap = nbdebug.load_snapshot(directory / f"step-{K:09d}-rank{BAD_RANK}.nbsnap", model=DDPModule)
    assert snap.trainer is not None and snap.trainer["framework"] == "lightning"
    # replayed through the module's own training_step (no loss function was recorded)
    assert snap.loss_fn_spec is None
    assert snap.loss_source is not None and snap.loss_source["method"] == "training_step"
    tr = snap.trace()
    assert tr.origin.module == "log_in" and tr.origin.samples == [BAD_ROW]


# --------------------------------------------------------------------------- Hugging Face
HF_STEPS = 4


class RankRows(torch.utils.data.Dataset):
    """Each rank's own rows; on rank 1 the row read as row BAD_ROW of step K's batch holds
    a NaN (rows are read in order: no workers)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reads = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        embeds = torch.randn(8, 16, generator=g)
        if self.rank == BAD_RANK and self.reads == K * BATCH + BAD_ROW:
            embeds[3, 5] = float("nan")
        self.reads += 1
        return {"inputs_embeds": embeds, "labels": torch.randint(0, 32, (8,), generator=g)}


def own_loss_trainer() -> type:
    """A Trainer subclass whose ``compute_loss`` computes the loss itself (the model is
    called without labels, so it returns none): the common override."""
    import transformers

    class OwnLossTrainer(transformers.Trainer):
        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any
        ) -> Any:
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return OwnLossTrainer


def train_hf(rank: int, world: int, directory: str, own_loss: bool = False) -> dict[str, Any]:
    import transformers

    from nbdebug.integrations.hf import NaNGuardCallback

    env(rank, world)
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(directory, f"out-rank{rank}"),
        max_steps=HF_STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    cb = NaNGuardCallback(directory=os.path.join(directory, "snaps"), timeout=30)
    cls = own_loss_trainer() if own_loss else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=RankRows(rank), callbacks=[cb])
    trainer.train()
    return {
        "parallel": str(args.parallel_mode),
        "wrapped": type(trainer.model_wrapped).__name__,
        "skipped": list(cb.skipped),
        "rows": {r["step"]: r["nonfinite"] for r in cb.guard.history},
        "snapshots": [Path(p).name for p in cb.guard.snapshots],
        "hash": h.params_hash(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("own_loss", [False, True], ids=["model_loss", "compute_loss_override"])
def test_the_hf_trainer_under_ddp_skips_on_every_rank_and_names_rank_1(
    tmp_path: Path, own_loss: bool
) -> None:
    pytest.importorskip("transformers", reason="the nbdebug[hf] extra is not installed")
    pytest.importorskip("accelerate", reason="the nbdebug[hf] extra (accelerate) is not installed")
    results = h.launch(train_hf, 2, str(tmp_path), own_loss, timeout=150)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        assert "value" in results[r], results[r].get("traceback", results[r])
    values = [results[0]["value"], results[1]["value"]]
    for r, v in enumerate(values):
        assert (v["parallel"], v["wrapped"]) == (
            "ParallelMode.DISTRIBUTED",
            "DistributedDataParallel",
        )
        assert v["skipped"] == [K] and v["snapshots"] == [f"step-{K:09d}-rank{r}.nbsnap"]
        assert v["finite"]
    assert values[BAD_RANK]["rows"][K] == "loss" and values[0]["rows"][K] == "grad"
    assert values[0]["hash"] == values[1]["hash"]
    if own_loss:  # the rank's step replays through the trainer's own compute_loss
        path = tmp_path / "snaps" / f"step-{K:09d}-rank{BAD_RANK}.nbsnap"
        snap = nbdebug.load_snapshot(path, model=tiny_gpt2)
        assert snap.loss_fn_spec is None and snap.loss_source is not None
        assert snap.loss_source["method"] == "compute_loss"
        tr = snap.trace(trainer=own_loss_trainer())
        assert (tr.origin.phase, tr.origin.samples) == ("input", [BAD_ROW])
        assert tr.loss is not None and math.isnan(tr.loss)  # as rank 1 saw it in the run
        return
    report = nbdebug.compare_ranks(tmp_path / "snaps", model=tiny_gpt2)
    assert report.culprit_ranks == [BAD_RANK] and report.replayed_culprits == [BAD_RANK]
    bad = report.rank(BAD_RANK)
    assert bad.origin_phase == "input" and bad.origin_rows == [BAD_ROW]


# ------------------------------------------------------------- dataset ids under DDP
BAD_ID = 11  # the dataset row (of 2 * BATCH * STEPS) that makes log(-1)


def ids_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.rand(2 * BATCH * STEPS, 4, generator=g) + 0.5
    x[BAD_ID, 0] = -1.0
    return torch.utils.data.TensorDataset(x, torch.randn(2 * BATCH * STEPS, 1, generator=g))


def fit_ddp_ids(rank: int, world: int, directory: str) -> dict[str, Any]:
    """One rank of a run on one shuffled loader: Lightning gives each rank its own
    ``DistributedSampler``; the ids and the rows of the rank's snapshot."""
    from nbdebug.integrations.lightning import NaNGuardCallback

    env(rank, world)
    cb = NaNGuardCallback(directory=directory, timeout=30)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    ds = ids_data()
    trainer.fit(DDPModule(), torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True))
    (path,) = cb.guard.snapshots
    snap = nbdebug.load_snapshot(path, model=DDPModule)
    held = [int((ds.tensors[0] == r).all(1).nonzero().item()) for r in snap.inputs]
    return {"skipped": list(cb.skipped), "ids": snap.ids, "held": held}


@needs_lightning
@pytest.mark.timeout(180)
def test_under_ddp_each_rank_snapshot_holds_its_distributed_sampler_ids(tmp_path: Path) -> None:
    results = h.launch(fit_ddp_ids, 2, str(tmp_path), timeout=120)
    assert sorted(results) == [0, 1], results
    expected = []  # each rank's batches, from its DistributedSampler (Lightning's seed: 0)
    for r in (0, 1):
        assert "value" in results[r], results[r].get("traceback", results[r])
        order = list(torch.utils.data.DistributedSampler(ids_data(), 2, r, shuffle=True, seed=0))
        expected.append([order[i : i + BATCH] for i in range(0, len(order), BATCH)])
    (step,) = [i for r in (0, 1) for i, b in enumerate(expected[r]) if BAD_ID in b]
    for r in (0, 1):
        v = results[r]["value"]
        assert v["skipped"] == [step] and v["ids"] == v["held"] == expected[r][step]
