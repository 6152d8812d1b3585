"""nbdebug.integrations.hf.NaNGuardCallback on a real transformers.Trainer (CPU, a tiny GPT-2
built from a config): the NaN step is made a no-op, written with the batch the Trainer fed,
its TrainingArguments and scheduler state, and replays to the same origin in a fresh
process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="the nbdebug[hf] extra is not installed")
pytest.importorskip("accelerate", reason="the nbdebug[hf] extra (accelerate) is not installed")

from models import tiny_gpt2  # noqa: E402

import nbdebug  # noqa: E402
from nbdebug.integrations.hf import NaNGuardCallback  # noqa: E402

N, BATCH, STEPS, BAD = 24, 4, 6, 13  # dataset row BAD holds a NaN


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        embeds = torch.randn(8, 16, generator=g)
        if i == BAD:
            embeds[3, 5] = float("nan")
        return {"inputs_embeds": embeds, "labels": torch.randint(0, 32, (8,), generator=g)}


class WeightWatch(transformers.TrainerCallback):
    """Which optimizer steps changed the weights (runs after the guard's callback)."""

    def __init__(self) -> None:
        self.changed: dict[int, bool] = {}
        self._before: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._before = [p.detach().clone() for p in kw["model"].parameters()]

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        after = list(kw["model"].parameters())
        changed = any(not torch.equal(a, p) for a, p in zip(self._before, after))
        self.changed[int(state.global_step)] = changed


def arguments(out: Path, **kw: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        weight_decay=0.1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        dataloader_num_workers=0,
        **kw,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf")
    cb, watch, model = NaNGuardCallback(directory=tmp / "snaps"), WeightWatch(), tiny_gpt2()
    trainer = transformers.Trainer(
        model=model, args=arguments(tmp / "out"), train_dataset=Rows(), callbacks=[cb, watch]
    )
    trainer.train()
    return {"cb": cb, "watch": watch, "model": model, "dir": tmp / "snaps", "trainer": trainer}


def test_the_nan_step_is_a_no_op(run: dict[str, Any]) -> None:
    cb, watch = run["cb"], run["watch"]
    assert len(cb.skipped) == 1
    (k,) = cb.skipped
    assert watch.changed[k] is False  # AdamW with weight decay skipped every parameter
    assert all(watch.changed[i] for i in range(STEPS) if i != k)
    assert all(bool(torch.isfinite(p).all()) for p in run["model"].parameters())
    logged = [row for row in run["trainer"].state.log_history if "nbdebug/skipped" in row]
    assert [row["nbdebug/skipped"] for row in logged] == [1.0]
    # the Trainer logs an update under the count after it; skipped_step is the snapshot's
    assert [(row["step"], row["nbdebug/skipped_step"]) for row in logged] == [(k + 1, float(k))]
    assert run["model"]._forward_hooks_with_kwargs == {}  # the batch hook is gone
    assert all(not m._forward_pre_hooks for m in run["model"].modules())  # the autocast one too


def test_the_snapshot_holds_the_fed_batch_args_and_scheduler(run: dict[str, Any]) -> None:
    (path,) = run["cb"].guard.snapshots
    snap = nbdebug.load_snapshot(path, model=tiny_gpt2)
    assert snap.step == run["cb"].skipped[0] and snap.reason["kind"] == "loss"
    embeds = snap.inputs["inputs_embeds"]
    assert embeds.shape == (BATCH, 8, 16) and {"inputs_embeds", "labels"} <= set(snap.inputs)
    rows = torch.isnan(embeds).flatten(1).any(1).nonzero().flatten().tolist()
    assert len(rows) == 1 and torch.equal(
        embeds[rows[0]].nan_to_num(), Rows()[BAD]["inputs_embeds"].nan_to_num()
    )
    assert snap.trainer is not None and snap.trainer["framework"] == "transformers"
    args = snap.trainer["args"]
    assert args["max_steps"] == STEPS and args["per_device_train_batch_size"] == BATCH
    assert args["learning_rate"] == 1e-2 and args["weight_decay"] == 0.1
    assert snap.scheduler_class == "torch.optim.lr_scheduler:LambdaLR"
    assert snap.scheduler_state is not None and snap.scheduler_state["last_epoch"] == snap.step
    assert snap.optimizer_class == "torch.optim.adamw:AdamW"
    assert snap.loss_source is None  # the model returned its loss: the replay runs the model


def test_the_snapshot_replays_to_the_same_origin_in_a_fresh_process(run: dict[str, Any]) -> None:
    (path,) = run["cb"].guard.snapshots
    snap = nbdebug.load_snapshot(path, model=tiny_gpt2)
    embeds = snap.inputs["inputs_embeds"]
    row = torch.isnan(embeds).flatten(1).any(1).nonzero().flatten().tolist()
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import nbdebug
        from models import tiny_gpt2
        o = nbdebug.load_snapshot({str(path)!r}, model=tiny_gpt2).trace().origin
        print(json.dumps({{"phase": o.phase, "module": o.module, "samples": o.samples}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    origin = json.loads(out.stdout.strip().splitlines()[-1])
    assert origin == {"phase": "input", "module": "", "samples": row}


def test_an_unsupported_transformers_version_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transformers, "__version__", "3.5.1")
    with pytest.raises(
        ImportError, match=r"supports transformers >=4.41,<6.0; found transformers 3.5.1\."
    ):
        NaNGuardCallback(directory="x")


@pytest.mark.parametrize("given", ["instance", "class"])
def test_attached_to_a_lightning_trainer_it_says_so(given: str) -> None:
    L = pytest.importorskip("lightning", reason="the nbdebug[lightning] extra is not installed")
    trainer = L.Trainer(
        max_steps=1,
        callbacks=[NaNGuardCallback() if given == "instance" else NaNGuardCallback],
        logger=False,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def training_step(self, batch: Any, i: int) -> Any:
            return self.lin(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    # the class too: the trainer is named, not the module Lightning passes next
    with pytest.raises(
        TypeError,
        match=r"expects a transformers\.Trainer; it was attached to a lightning\..*Trainer: use",
    ):
        trainer.fit(module, [torch.zeros(1)])


def test_a_bad_guard_option_is_refused() -> None:
    with pytest.raises(TypeError, match="takes 'model' from the trainer"):
        NaNGuardCallback(model=nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"directory must be a str or os\.PathLike; got NoneType"):
        NaNGuardCallback(directory=None)  # type: ignore[arg-type]


def test_without_transformers_the_callback_raises_the_install_hint() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from nbdebug.integrations.hf import NaNGuardCallback\n"
        "try:\n    NaNGuardCallback(directory='x')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs transformers" in out.stdout and "pip install nbdebug[hf]" in out.stdout


def mixed_run(tmp: Path, **precision: Any) -> Any:
    cb = NaNGuardCallback(directory=tmp / "snaps")
    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=arguments(tmp / "out", **precision),
        train_dataset=Rows(),
        callbacks=[cb],
    )
    trainer.train()
    assert len(cb.skipped) == 1 and cb.guard.scaler is None  # no GradScaler on CPU
    return nbdebug.load_snapshot(cb.guard.snapshots[0], model=tiny_gpt2)


def test_under_bf16_the_snapshot_records_the_autocast_the_forward_ran_in(tmp_path: Path) -> None:
    snap = mixed_run(tmp_path, bf16=True)
    assert snap.autocast == {"device_type": "cpu", "dtype": "bfloat16"}
    tr = snap.trace()
    assert {e.dtype for e in tr.events if e.module_type == "Conv1D" and e.phase == "forward"} == {
        "bfloat16"
    }
    assert tr.origin is not None and tr.origin.phase == "input"


def test_fp16_on_cpu_runs_in_float32_and_the_snapshot_says_so(tmp_path: Path) -> None:
    # accelerate runs fp16=True on CPU without autocast (and without a GradScaler): the
    # snapshot records no autocast, so the replay runs in float32 like the training did
    snap = mixed_run(tmp_path, fp16=True)
    assert snap.trainer is not None and snap.trainer["args"]["fp16"] is True
    assert snap.autocast is None
    assert {
        e.dtype for e in snap.trace().events if (e.module_type, e.phase) == ("Conv1D", "forward")
    } == {"float32"}


class TupleNet(torch.nn.Module):
    """Returns ``(loss, logits)``: the Trainer takes ``outputs[0]`` as the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.lin(torch.log(x))  # log(-1) = NaN in dataset row 5
        return torch.nn.functional.cross_entropy(logits, labels), logits


class TupleRows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.rand(4, generator=torch.Generator().manual_seed(i)) + 0.5
        if i == 5:
            x[0] = -1.0
        return {"x": x, "labels": torch.tensor(i % 3)}


def test_a_tuple_output_gives_the_guard_its_first_element_as_the_loss(tmp_path: Path) -> None:
    cb = NaNGuardCallback(directory=tmp_path / "snaps")
    args = arguments(tmp_path / "out", max_grad_norm=0.0, remove_unused_columns=False)
    args.max_steps = 4
    transformers.Trainer(
        model=TupleNet(), args=args, train_dataset=TupleRows(), callbacks=[cb]
    ).train()
    losses = [row["loss"] for row in cb.guard.history]
    (k,) = cb.skipped  # the step that drew row 5 (the Trainer shuffles)
    assert math.isnan(losses[k]) and len(losses) == 4
    assert all(isinstance(v, float) and math.isfinite(v) for i, v in enumerate(losses) if i != k)
    reason = nbdebug.load_snapshot(cb.guard.snapshots[0], model=TupleNet).reason
    assert reason["kind"] == "loss" and reason["message"].startswith("non-finite loss (nan)")


def hook_dicts(model: nn.Module) -> dict[str, dict[str, list[int]]]:
    """The ids in every hook dictionary of every submodule."""
    return {
        name: {k: list(v) for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)}
        for name, m in model.named_modules()
    }


class FailingNet(TupleNet):
    """TupleNet whose forward raises ``error`` halfway through its second call (step 1)."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__()
        self.error, self.calls = error, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        out = super().forward(x, labels)  # its child has run
        if self.calls == 2 and self.error is not None:
            raise self.error
        return out


class FailingRows(TupleRows):
    """TupleRows whose ninth read (a later step's batch) raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.reads = 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        if self.reads == 9:
            raise KeyboardInterrupt
        return super().__getitem__(i)


class RaiseAt(transformers.TrainerCallback):
    """Raises RuntimeError in ``event`` at step 1 (after the guard's callback)."""

    def __init__(self, event: str) -> None:
        setattr(self, event, self._raise)

    def _raise(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == 1:
            raise RuntimeError("a callback failed")


def failed_train(tmp: Path, model: nn.Module, error: type[BaseException], **extra: Any) -> Any:
    cb = NaNGuardCallback(directory=tmp / "snaps")
    args = arguments(tmp / "out", max_grad_norm=0.0, remove_unused_columns=False)
    args.max_steps = 4
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=extra.pop("dataset", TupleRows()),
        callbacks=[cb, *extra.pop("callbacks", [])],
    )
    with pytest.raises(error):
        trainer.train()
    return cb


def forward_of_ones_own(model: nn.Module) -> None:
    model.train()
    model(torch.rand(4, 4) + 0.5, torch.zeros(4, dtype=torch.long))  # grad enabled


@pytest.mark.parametrize("where", ["forward", "callback", "data"])
def test_a_train_that_stops_with_an_error_leaves_the_model_s_hooks_as_they_were(
    tmp_path: Path, where: str
) -> None:
    # the Trainer has no exception callback: the hooks must not outlive the failed step
    model = FailingNet(RuntimeError("a bad batch") if where == "forward" else None)
    model.lin.register_forward_hook(lambda *a: None)  # one of the user's own stays
    before = hook_dicts(model)
    if where == "forward":
        cb = failed_train(tmp_path, model, RuntimeError)
    elif where == "callback":
        cb = failed_train(tmp_path, model, RuntimeError, callbacks=[RaiseAt("on_optimizer_step")])
    else:
        cb = failed_train(tmp_path, model, KeyboardInterrupt, dataset=FailingRows())
    assert hook_dicts(model) == before
    forward_of_ones_own(model)
    assert cb.step_batch.batch is None  # nothing recorded, no batch kept
    assert hook_dicts(model) == before


@pytest.mark.parametrize("where", ["KeyboardInterrupt in the forward", "error before it"])
def test_hooks_left_by_a_stopped_step_take_themselves_off_at_the_next_forward(
    tmp_path: Path, where: str
) -> None:
    # torch runs no hook when a KeyboardInterrupt leaves the forward, and no callback sees an
    # error between a step's start and its forward: the hooks are on until the model's next
    # forward, which is not the Trainer's, so they record nothing and take themselves off
    if where == "KeyboardInterrupt in the forward":
        model = FailingNet(KeyboardInterrupt())
        before = hook_dicts(model)
        cb = failed_train(tmp_path, model, KeyboardInterrupt)
    else:
        model = FailingNet()
        before = hook_dicts(model)
        cb = failed_train(tmp_path, model, RuntimeError, callbacks=[RaiseAt("on_step_begin")])
    forward_of_ones_own(model)
    assert cb.step_batch.batch is None
    assert hook_dicts(model) == before
    forward_of_ones_own(model)
    assert cb.step_batch.batch is None


class FlatNet(torch.nn.Module):
    """No child modules, parameters only: the autocast cannot be read inside its forward by
    a child's pre-hook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = torch.log(x) @ self.w  # log(-1) = NaN in dataset row 5
        return {"loss": torch.nn.functional.cross_entropy(logits.float(), labels), "logits": logits}


@pytest.mark.parametrize(
    ("precision", "expected"),
    [("bf16", {"device_type": "cpu", "dtype": "bfloat16"}), ("fp16", None)],
)
def test_a_model_without_children_records_the_autocast_its_forward_ran_in(
    tmp_path: Path, precision: str, expected: Any
) -> None:
    # accelerate enters autocast inside the wrapped model.forward (bf16=True), after the
    # model's own hooks ran; on CPU it runs fp16=True without autocast
    cb = NaNGuardCallback(directory=tmp_path / "snaps")
    args = arguments(
        tmp_path / "out", max_grad_norm=0.0, remove_unused_columns=False, **{precision: True}
    )
    args.max_steps = 4
    model = FlatNet()
    transformers.Trainer(model=model, args=args, train_dataset=TupleRows(), callbacks=[cb]).train()
    assert len(cb.skipped) == 1 and hook_dicts(model) == hook_dicts(FlatNet())
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=FlatNet)
    assert snap.autocast == expected
    dtypes = {e.dtype for e in snap.trace().events if e.phase == "forward"}
    assert dtypes == ({"float32", "bfloat16"} if expected else {"float32"})


# ------------------------------------------- a Trainer subclass's compute_loss (issue 33)
class LogitsOnly(nn.Module):
    """A model that returns logits and no loss; its layer ``log_in`` makes the NaN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.a(torch.log(x))}


class OwnLossTrainer(transformers.Trainer):
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        labels = inputs.pop("labels")
        out = model(**inputs)
        return torch.nn.functional.cross_entropy(out["logits"], labels)


class NeedsArgsTrainer(transformers.Trainer):
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        scale = self.args.learning_rate
        return scale * model(x=inputs["x"])["logits"].sum()


def compute_loss_snapshot(tmp_path: Path, cls: type) -> Path:
    from nbdebug.core.snapshot.data import object_name
    from nbdebug.core.snapshot.write import save_snapshot

    x = torch.rand(4, 4) + 0.5
    x[1, 2] = -1.0
    source = {
        "call": "trainer_method",
        "method": "compute_loss",
        "class": object_name(cls),
        "name": cls.__qualname__,
        "args": [],
        "silence": [],
        "batch": {"form": "inputs"},
    }
    batch = {"x": x, "labels": torch.tensor([0, 1, 2, 0])}
    return save_snapshot(tmp_path / "s.nbsnap", LogitsOnly(), batch, loss_source=source)


def test_a_compute_loss_override_replays_on_a_stand_in_trainer(tmp_path: Path) -> None:
    path = compute_loss_snapshot(tmp_path, OwnLossTrainer)
    snap = nbdebug.load_snapshot(path, model=LogitsOnly)
    with pytest.raises(nbdebug.SnapshotError, match=r"OwnLossTrainer\.compute_loss.*trainer="):
        snap.trace()  # the class is not imported unless trusted or given
    tr = snap.trace(trainer=OwnLossTrainer)
    assert tr.origin is not None and tr.origin.module == "" and tr.origin.samples == [1]
    assert math.isnan(tr.loss) and "labels" in snap.inputs  # the batch is left whole
    trusted = nbdebug.load_snapshot(path, model=LogitsOnly, trust_recipe=True)
    assert trusted.trace().origin.samples == [1]


def test_a_compute_loss_that_needs_the_trainer_says_to_pass_it(tmp_path: Path) -> None:
    snap = nbdebug.load_snapshot(compute_loss_snapshot(tmp_path, NeedsArgsTrainer), LogitsOnly)
    with pytest.raises(nbdebug.TraceError, match=r"self\.args.*trainer=your_trainer"):
        snap.trace(trainer=NeedsArgsTrainer)


class SumLossTrainer(transformers.Trainer):
    """A compute_loss of its own, as the transformers docs show it: the labels taken out of
    the batch, the model called on the rest, a summed loss over ``num_items_in_batch``."""

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        logits = model(**inputs)["logits"]
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        loss = loss / num_items_in_batch
        return (loss, logits) if return_outputs else loss


class LogitsKw(LogitsOnly):
    """LogitsOnly taking ``**kwargs``: the Trainer then counts ``num_items_in_batch``."""

    def forward(self, x: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
        return super().forward(x)


@pytest.fixture(scope="module")
def loss_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf-compute-loss")
    cb = NaNGuardCallback(directory=tmp / "snaps")  # no loss_fn=: the loss is compute_loss's
    args = arguments(tmp / "out", max_grad_norm=0.0, remove_unused_columns=False)
    args.max_steps = 4
    trainer = SumLossTrainer(model=LogitsKw(), args=args, train_dataset=TupleRows(), callbacks=[cb])
    trainer.train()
    return {"cb": cb, "trainer": trainer, "path": cb.guard.snapshots[0]}


def bad_row(snap: Any) -> int:
    """The row of the snapshot's batch that holds dataset row 5 (x[0] = -1: log(-1))."""
    (row,) = (snap.inputs["x"][:, 0] == -1.0).nonzero().flatten().tolist()
    return int(row)


def test_a_compute_loss_override_is_recorded_with_its_batch_and_loss(
    loss_run: dict[str, Any],
) -> None:
    cb, trainer = loss_run["cb"], loss_run["trainer"]
    (k,) = cb.skipped
    losses = [row["loss"] for row in cb.guard.history]
    assert math.isnan(losses[k])  # the loss compute_loss returned, the model returned none
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != k)
    assert "compute_loss" not in vars(trainer)  # the trainer is left as it was
    snap = nbdebug.load_snapshot(loss_run["path"], model=LogitsKw)
    src = snap.loss_source
    assert src["call"] == "trainer_method" and src["method"] == "compute_loss"
    assert src["class"].endswith(":SumLossTrainer") and src["name"] == "SumLossTrainer"
    # the Trainer passed num_items_in_batch=: the labels of the batch, BATCH of them
    assert src["kwargs"] == {"num_items_in_batch": BATCH}
    # the batch as compute_loss got it, before it took the labels out
    assert set(snap.inputs) == {"x", "labels"} and snap.inputs["labels"].shape == (BATCH,)


def test_a_compute_loss_snapshot_replays_through_the_override(loss_run: dict[str, Any]) -> None:
    snap = nbdebug.load_snapshot(loss_run["path"], model=LogitsKw)
    row = bad_row(snap)
    with pytest.raises(nbdebug.SnapshotError, match=r"SumLossTrainer\.compute_loss.*trainer="):
        snap.trace()
    tr = snap.trace(trainer=SumLossTrainer)
    assert tr.origin is not None and tr.origin.samples == [row] and math.isnan(tr.loss)
    assert set(snap.inputs) == {"x", "labels"}  # the replay left the batch whole
    trusted = nbdebug.load_snapshot(loss_run["path"], model=LogitsKw, trust_recipe=True)
    assert trusted.trace().origin.samples == [row]
    d = nbdebug.diagnose(loss_run["path"], model=LogitsKw, trust_recipe=True, progress=False)
    assert d.trace is not None and d.trace.origin is not None
    assert d.trace.origin.samples == [row]
    dbg = nbdebug.debug(trusted)  # what %nbdebug opens for a Snapshot
    try:
        assert dbg.trace.origin is not None and dbg.trace.origin.samples == [row]
    finally:
        dbg.close()


def test_inspect_replays_a_compute_loss_snapshot(
    loss_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbdebug.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    path = str(loss_run["path"])
    main(["inspect", path, "--model", "test_integrations_hf:LogitsKw", "--trust-recipe"])
    text = capsys.readouterr().out
    row = bad_row(nbdebug.load_snapshot(path, model=LogitsKw))
    assert "Not replayed" not in text
    assert "op       torch.log" in text and f"samples  {row}\n" in text
