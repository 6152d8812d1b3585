"""The sampler's dataset indices in the Lightning and Hugging Face callbacks: the guard gets
the indices each training batch really held (as the DataLoader's batch sampler yielded them,
with workers prefetching ahead, Lightning's prefetching fetcher, accelerate's one-batch
lookahead, gradient accumulation), the run is bitwise the run without the callback, and the
loaders are left as they were. Expected indices come from plain torch: the same sampler
iterated with the same seed, and the dataset rows the snapshot's batch holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

L = pytest.importorskip("lightning", reason="the nbdebug[lightning] extra is not installed")

from test_integrations_lightning import TinyModule  # noqa: E402
from test_integrations_lightning import trainer as pl_trainer  # noqa: E402

import nbdebug  # noqa: E402
from nbdebug.integrations.lightning import NaNGuardCallback as LightningCallback  # noqa: E402
from nbdebug.integrations.sampler_ids import SamplerIds  # noqa: E402

N, BATCH, BAD, SEED = 24, 4, 13, 7  # dataset row BAD makes a NaN (log of -1)
STEPS = N // BATCH  # one epoch


def rows(bad: int | None = BAD) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(N, 4, generator=g) + 0.5
    y = torch.randn(N, 1, generator=g)
    if bad is not None:
        x[bad, 2] = -1.0
    return x, y


def loader(dataset: Any, **kw: Any) -> DataLoader:
    """The shuffled training loader (its own seeded generator)."""
    kw.setdefault("num_workers", 2)
    g = torch.Generator().manual_seed(SEED)
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=g, **kw)


class Index(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def sampler_batches(epochs: int, **kw: Any) -> list[list[int]]:
    """Each batch's dataset indices, epoch after epoch: a plain DataLoader over the indices
    with the same sampler, seed and workers (the generator also seeds each iterator)."""
    plain = loader(Index(), **kw)
    return [batch.tolist() for _ in range(epochs) for batch in plain]


def rows_of(x: torch.Tensor, data: torch.Tensor) -> list[int]:
    """The dataset index of each row of ``x`` (rows are unique)."""
    return [int((data == r).all(1).nonzero().item()) for r in x]


class Batches(L.Callback):
    """The batches the loop trained on, in order."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
        self.seen.append(batch[0].clone())


def fit(callbacks: list[Any], data: Any, steps: int, **options: Any) -> TinyModule:
    module = TinyModule()
    pl_trainer(callbacks, steps=steps, **options).fit(module, data)
    return module


# -- Lightning -------------------------------------------------------------------------


class Validated(TinyModule):
    validated = 0

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.validated += 1
        x, y = batch
        return F.mse_loss(self(x), y)


@pytest.fixture(scope="module", params=[False, True], ids=["workers", "persistent_workers"])
def pl_run(tmp_path_factory: pytest.TempPathFactory, request: Any) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("pl_ids") / "snaps"
    cb = LightningCallback(directory=directory, loss_fn=F.mse_loss, patience=3)
    x, y = rows()
    kw = {"persistent_workers": request.param}
    train = loader(TensorDataset(x, y), **kw)
    # a validation loader (the sanity check's, then every 2 batches, mid-epoch)
    val = DataLoader(TensorDataset(x, y), batch_size=BATCH, num_workers=1)
    module = Validated()
    t = pl_trainer([cb], steps=2 * STEPS, val_check_interval=2, limit_val_batches=2)
    t.fit(module, train, val)
    assert module.validated >= 2 * STEPS  # between the training batches, and its sanity check
    return {"cb": cb, "dir": directory, "x": x, "loader": train, "trainer": t, "kw": kw}


def test_lightning_snapshots_hold_the_indices_of_the_nan_batches(pl_run: dict[str, Any]) -> None:
    cb, x = pl_run["cb"], pl_run["x"]
    expected = sampler_batches(2, **pl_run["kw"])
    bad_steps = [i for i, b in enumerate(expected) if BAD in b]  # once per epoch
    assert cb.skipped == bad_steps and len(bad_steps) == 2
    for path, step in zip(cb.guard.snapshots, bad_steps):
        snap = nbdebug.load_snapshot(path, model=TinyModule)
        assert snap.step == step and snap.ids == expected[step]
        assert rows_of(snap.inputs, x) == expected[step]  # the rows the batch really held
        blame = nbdebug.row_blame(path, model=TinyModule)  # rows named by dataset index
        assert blame.ids == expected[step] and [blame.ids[r] for r in blame.nonfinite] == [BAD]
    skips = json.loads((pl_run["dir"] / "skip_batches.json").read_text())
    assert skips["ids"] == sorted({*expected[bad_steps[0]], *expected[bad_steps[1]]})
    assert [(s["step"], s["ids"]) for s in skips["steps"]] == [(s, expected[s]) for s in bad_steps]
    assert "dataset ids" not in repr(cb)


def test_lightning_leaves_the_loader_and_the_strategy_as_they_were(pl_run: dict[str, Any]) -> None:
    train, t = pl_run["loader"], pl_run["trainer"]
    assert (
        "_get_iterator" not in vars(train) and type(train.batch_sampler).__name__ == "BatchSampler"
    )
    assert t.train_dataloader is train and "process_dataloader" not in vars(t.strategy)
    assert train._iterator is None or train._iterator._index_sampler is train.batch_sampler


@pytest.mark.parametrize("persistent", [False, True])
def test_lightning_run_is_bitwise_the_unguarded_run(tmp_path: Path, persistent: bool) -> None:
    x, y = rows(bad=None)
    runs = []
    for guarded in (False, True):
        train = loader(TensorDataset(x, y), persistent_workers=persistent)
        batches = Batches()
        cbs = [LightningCallback(directory=tmp_path / "s")] if guarded else []
        module = fit([*cbs, batches], train, 2 * STEPS)
        runs.append((batches.seen, [p.detach().clone() for p in module.parameters()], train))
    (seen_a, weights_a, _), (seen_b, weights_b, train) = runs
    assert len(seen_a) == 2 * STEPS and all(torch.equal(a, b) for a, b in zip(seen_a, seen_b))
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    assert (
        "_get_iterator" not in vars(train) and type(train.batch_sampler).__name__ == "BatchSampler"
    )


def test_lightning_batches_left_unread_in_an_epoch_do_not_shift_the_next(tmp_path: Path) -> None:
    # limit_train_batches=4 of 6: the workers fetched ahead, past what the epoch trained on
    expected = sampler_batches(2)
    trained = [expected[e * STEPS + i] for e in range(2) for i in range(4)]
    bad = trained[5][1]  # in the second epoch's second batch (and where epoch 1 had it)
    x, y = rows(bad=bad)
    cb = LightningCallback(directory=tmp_path / "s", loss_fn=F.mse_loss, patience=3)
    fit([cb], loader(TensorDataset(x, y)), 8, limit_train_batches=4)
    assert 5 in cb.skipped and cb.skipped == [s for s, b in enumerate(trained) if bad in b]
    for path, step in zip(cb.guard.snapshots, cb.skipped):
        snap = nbdebug.load_snapshot(path, model=TinyModule)
        assert snap.ids == trained[step] == rows_of(snap.inputs, x)


@pytest.mark.parametrize("micro", [2, 3], ids=["first_micro_batch", "second_micro_batch"])
def test_lightning_accumulation_keeps_the_indices_of_the_bad_micro_batch(
    tmp_path: Path, micro: int
) -> None:
    # no workers: the loader fetches each batch as the loop asks for it
    expected = sampler_batches(1, num_workers=0)
    x, y = rows(bad=expected[micro][0])  # step 1's first or second micro-batch
    cb = LightningCallback(directory=tmp_path / "s", loss_fn=F.mse_loss)
    fit([cb], loader(TensorDataset(x, y), num_workers=0), STEPS // 2, accumulate_grad_batches=2)
    (path,) = cb.guard.snapshots
    snap = nbdebug.load_snapshot(path, model=TinyModule)
    assert snap.step == 1 and snap.ids == expected[micro] == rows_of(snap.inputs, x)


class Stream(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Any:
        return iter(zip(self.x, self.y))


def test_lightning_iterable_dataset_trains_without_ids(tmp_path: Path) -> None:
    x, y = rows()
    cb = LightningCallback(directory=tmp_path / "s", loss_fn=F.mse_loss)
    fit([cb], DataLoader(Stream(x, y), batch_size=BATCH), STEPS)
    assert cb.skipped == [BAD // BATCH]  # in order: the batch holding BAD
    (path,) = cb.guard.snapshots
    assert nbdebug.load_snapshot(path, model=TinyModule).ids is None
    assert not (tmp_path / "s" / "skip_batches.json").exists()
    assert repr(cb).endswith(
        "no dataset ids: the training loader's dataset is an IterableDataset (no sampler indices))"
    )


def test_sampler_ids_false_passes_no_ids_and_a_bad_value_is_one_sentence(tmp_path: Path) -> None:
    x, y = rows()
    cb = LightningCallback(directory=tmp_path / "s", sampler_ids=False, loss_fn=F.mse_loss)
    fit([cb], loader(TensorDataset(x, y)), STEPS)
    (path,) = cb.guard.snapshots
    assert nbdebug.load_snapshot(path, model=TinyModule).ids is None
    assert "dataset ids off (sampler_ids=False)" in repr(cb)
    with pytest.raises(TypeError, match=r"^sampler_ids must be True or False; got 'yes'\.$"):
        LightningCallback(directory=tmp_path, sampler_ids="yes")  # type: ignore[arg-type]


# -- Hugging Face ----------------------------------------------------------------------


def hf() -> Any:
    """The Hugging Face test helpers (skips without the extra)."""
    pytest.importorskip("transformers", reason="the nbdebug[hf] extra is not installed")
    pytest.importorskip("accelerate", reason="the nbdebug[hf] extra (accelerate) is not installed")
    import test_integrations_hf

    return test_integrations_hf


def hf_trainer(tmp: Path, callbacks: list[Any], dataset: Any, **args: Any) -> Any:
    """A Trainer on a tiny GPT-2 over ``dataset``; ``args``: TrainingArguments set."""
    h = hf()
    from models import tiny_gpt2

    arguments = h.arguments(tmp / "out")
    for key, value in {"dataloader_num_workers": 2, **args}.items():
        setattr(arguments, key, value)
    return h.transformers.Trainer(
        model=tiny_gpt2(), args=arguments, train_dataset=dataset, callbacks=callbacks
    )


def hf_train(tmp: Path, callbacks: list[Any], dataset: Any, **args: Any) -> Any:
    """:func:`hf_trainer`, trained."""
    trainer = hf_trainer(tmp, callbacks, dataset, **args)
    trainer.train()
    return trainer


def embeds_rows(embeds: torch.Tensor) -> list[int]:
    """The dataset index of each row of a batch's ``inputs_embeds`` (rows are unique)."""
    data = [hf().Rows()[i]["inputs_embeds"].nan_to_num() for i in range(N)]
    return [next(i for i, d in enumerate(data) if torch.equal(d, e.nan_to_num())) for e in embeds]


def test_hf_snapshots_hold_the_indices_of_the_nan_batches(tmp_path: Path) -> None:
    from nbdebug.integrations.hf import NaNGuardCallback

    cb = NaNGuardCallback(directory=tmp_path / "s", patience=3)
    hf_train(tmp_path, [cb], hf().Rows(), max_steps=2 * STEPS)
    assert len(cb.skipped) == 2  # the batch holding row BAD, once per epoch
    snaps = [nbdebug.load_snapshot(p, model=None) for p in cb.guard.snapshots]
    for snap in snaps:
        held = embeds_rows(snap.inputs["inputs_embeds"])
        assert BAD in held and snap.ids == held
    skips = json.loads((tmp_path / "s" / "skip_batches.json").read_text())
    assert skips["ids"] == sorted({*snaps[0].ids, *snaps[1].ids})
    assert "dataset ids" not in repr(cb)


def test_hf_run_is_bitwise_the_unguarded_run_and_the_loader_is_as_it_was(tmp_path: Path) -> None:
    from nbdebug.integrations.hf import NaNGuardCallback

    class Healthy(hf().Rows):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            row = super().__getitem__(i)
            return {**row, "inputs_embeds": row["inputs_embeds"].nan_to_num()}

    runs = []
    for guarded in (False, True):
        cbs = [NaNGuardCallback(directory=tmp_path / "s")] if guarded else []
        trainer = hf_train(tmp_path / str(guarded), cbs, Healthy(), max_steps=2 * STEPS)
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        runs.append(([p.detach().clone() for p in trainer.model.parameters()], losses, trainer))
    (weights_a, losses_a, _), (weights_b, losses_b, trainer) = runs
    assert len(losses_a) == 2 * STEPS and losses_a == losses_b
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    shard = trainer.callback_handler.train_dataloader  # accelerate's, around a DataLoader
    base = vars(shard).get("base_dataloader", shard)
    assert "_get_iterator" not in vars(base) and "_get_iterator" not in vars(shard)
    assert "Recording" not in type(base.batch_sampler).__name__


def test_hf_accumulation_keeps_the_indices_of_the_bad_micro_batch(tmp_path: Path) -> None:
    from nbdebug.integrations.hf import NaNGuardCallback

    cb = NaNGuardCallback(directory=tmp_path / "s")
    hf_train(tmp_path, [cb], hf().Rows(), max_steps=STEPS // 2, gradient_accumulation_steps=2)
    (path,) = cb.guard.snapshots
    snap = nbdebug.load_snapshot(path, model=None)
    held = embeds_rows(snap.inputs["inputs_embeds"])
    assert BAD in held and snap.ids == held and len(held) == BATCH


def test_hf_iterable_dataset_trains_without_ids(tmp_path: Path) -> None:
    from nbdebug.integrations.hf import NaNGuardCallback

    class Streamed(IterableDataset):
        def __iter__(self) -> Any:
            rows = hf().Rows()
            return iter([rows[i] for i in range(N)])

    cb = NaNGuardCallback(directory=tmp_path / "s")
    hf_train(tmp_path, [cb], Streamed(), max_steps=STEPS, dataloader_num_workers=0)
    assert cb.skipped == [BAD // BATCH]  # in order: the batch holding BAD
    (path,) = cb.guard.snapshots
    assert nbdebug.load_snapshot(path, model=None).ids is None
    assert not (tmp_path / "s" / "skip_batches.json").exists()
    assert repr(cb).endswith(
        "no dataset ids: the training loader's dataset is an IterableDataset (no sampler indices))"
    )


# -- what has no ids -------------------------------------------------------------------


class Keyed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.full((2,), float(key))


def drop_last_row(items: list[Any]) -> torch.Tensor:
    return torch.tensor(items[:-1])


def in_order_false() -> DataLoader:
    return DataLoader(Index(), batch_size=BATCH, num_workers=2, in_order=False)


@pytest.mark.parametrize(
    ("make", "note"),
    [
        (
            lambda: DataLoader(Keyed(), batch_sampler=[[str(i), str(i + 1)] for i in range(4)]),
            "the batch sampler yields ['0', '1'], not a list of integer indices",
        ),
        (
            lambda: DataLoader(Index(), batch_size=BATCH, collate_fn=drop_last_row),
            "a batch's rows do not match its sampler indices (ids must give one dataset index "
            "per batch row: the batch has 3 rows, got 4 ids.)",
        ),
        (
            lambda: DataLoader(Index(), batch_size=None),
            "the training loader has no batch_sampler (batch_size=None)",
        ),
        (in_order_false, "the training loader yields batches out of order (in_order=False)"),
        (lambda: [torch.zeros(4, 2)], "the training loader is a list, not a torch DataLoader"),
    ],
    ids=["string_indices", "rows_dropped", "no_batch_sampler", "out_of_order", "a_list"],
)
def test_a_batch_without_knowable_ids_gets_none_and_one_note(make: Any, note: str) -> None:
    data = make()
    plain = [torch.as_tensor(b).tolist() for b in make()]
    ids = SamplerIds()
    ids.arm(data)
    got = []
    for batch in data:
        ids.take(kept=True)
        got.append((batch, ids.step_ids(batch)))
    ids.close()
    assert [i for _, i in got] == [None] * len(plain) and ids.note == note
    # the same batches (in_order=False: in the order the workers finish them)
    assert sorted(torch.as_tensor(b).tolist() for b, _ in got) == sorted(plain)


class TwoLoaders(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (xa, ya), (xb, yb) = batch["a"], batch["b"]
        return F.mse_loss(self(xa), ya) + F.mse_loss(self(xb), yb)


def test_lightning_several_training_loaders_have_no_ids(tmp_path: Path) -> None:
    x, y = rows(bad=None)
    train = {"a": loader(TensorDataset(x, y)), "b": loader(TensorDataset(y.exp() + x, y))}
    cb = LightningCallback(directory=tmp_path / "s")
    module = TwoLoaders()
    pl_trainer([cb], steps=STEPS).fit(module, train)
    assert cb.guard is not None and len(cb.guard.history) == STEPS and not cb.skipped
    assert repr(cb).endswith("no dataset ids: the training batches come from several loaders)")
    assert all("_get_iterator" not in vars(dl) for dl in train.values())


class ReadsItsBatches(TinyModule):
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:
        (x, y), _, _ = next(dataloader_iter)
        return F.mse_loss(self(x), y)


def test_lightning_training_step_reading_its_own_batches_has_no_ids(tmp_path: Path) -> None:
    x, y = rows(bad=None)
    cb = LightningCallback(directory=tmp_path / "s")
    pl_trainer([cb], steps=STEPS).fit(ReadsItsBatches(), loader(TensorDataset(x, y)))
    assert cb.guard is not None and len(cb.guard.history) == STEPS
    assert repr(cb).endswith(
        "no dataset ids: training_step takes the batches itself (dataloader_iter))"
    )


class FailsAtStep2(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_lightning_a_failed_fit_leaves_the_loader_and_the_strategy(tmp_path: Path) -> None:
    x, y = rows(bad=None)
    train = loader(TensorDataset(x, y))
    t = pl_trainer([LightningCallback(directory=tmp_path / "s")], steps=STEPS)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(FailsAtStep2(), train)
    assert "_get_iterator" not in vars(train) and "process_dataloader" not in vars(t.strategy)
    assert type(train.batch_sampler).__name__ == "BatchSampler"


def test_hf_a_failed_train_leaves_the_loader(tmp_path: Path) -> None:
    from nbdebug.integrations.hf import NaNGuardCallback

    class Fails(hf().transformers.TrainerCallback):
        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            raise RuntimeError("boom")  # after the guard's callback armed the loader

    cb = NaNGuardCallback(directory=tmp_path / "s")
    trainer = hf_trainer(tmp_path, [cb, Fails()], hf().Rows())
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    shard = trainer.callback_handler.train_dataloader  # the Trainer's, made by train()
    base = vars(shard).get("base_dataloader", shard)
    assert type(base.batch_sampler).__name__ == "BatchSampler"
    # the error came before its iterator: the next one, not the Trainer's, takes the hook
    # off and records nothing; the batches are the loader's own (every row, once)
    labels = torch.cat([b["labels"] for b in base]).tolist()
    cb.sampler_ids.take(kept=True)  # nothing was recorded for it
    assert "_get_iterator" not in vars(base) and cb.sampler_ids.step_ids(None) is None
    assert sorted(labels) == sorted(hf().Rows()[i]["labels"].tolist() for i in range(N))
