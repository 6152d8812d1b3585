"""nbdebug.integrations.lightning.NaNGuardCallback on a real Lightning Trainer (CPU): a NaN
made at step K is skipped, written with its batch, logged, and replays to the same origin in
a fresh process."""

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
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning", reason="the nbdebug[lightning] extra is not installed")
from lightning.pytorch.loggers.logger import Logger  # noqa: E402

import nbdebug  # noqa: E402
from nbdebug.integrations.lightning import NaNGuardCallback  # noqa: E402

K = 3  # the step whose batch makes a NaN
BAD_ROW = 1  # the row of that batch
BATCH = 4
STEPS = 6


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class TinyModule(L.LightningModule):
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
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(BATCH * STEPS, 4, generator=g) + 0.5
    y = torch.randn(BATCH * STEPS, 1, generator=g)
    x[K * BATCH + BAD_ROW, 2] = -1.0  # log(-1) = NaN, made inside the model
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)


class Metrics(Logger):
    """A logger that keeps what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


class WeightWatch(L.Callback):
    """Which optimizer steps changed the weights (runs after the guard's callback)."""

    def __init__(self) -> None:
        self.changed: dict[int, bool] = {}
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, out: Any, b: Any, i: int) -> None:
        after = list(pl_module.parameters())
        self.changed[i] = any(not torch.equal(a, p) for a, p in zip(self._before, after))


def trainer(
    callbacks: list[Any],
    logger: Any = False,
    steps: int = STEPS,
    precision: str | None = "32-true",
    plugins: Any = None,
    **options: Any,
) -> Any:
    """A quiet CPU Trainer; ``options`` are further Trainer arguments."""
    return L.Trainer(
        max_steps=steps,
        precision=precision,
        plugins=plugins,
        callbacks=callbacks,
        logger=logger,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **options,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("lightning") / "snaps"
    cb = NaNGuardCallback(directory=directory, loss_fn=F.mse_loss)
    watch, metrics = WeightWatch(), Metrics()
    module = TinyModule()
    trainer([cb, watch], logger=metrics).fit(module, data())
    return {"cb": cb, "watch": watch, "metrics": metrics, "module": module, "dir": directory}


def test_the_nan_step_is_skipped_and_logged(run: dict[str, Any]) -> None:
    cb, watch = run["cb"], run["watch"]
    assert cb.skipped == [K]
    assert watch.changed[K] is False  # the AdamW step (weight decay too) left the weights
    assert all(watch.changed[i] for i in range(STEPS) if i != K)
    assert all(bool(torch.isfinite(p).all()) for p in run["module"].parameters())
    assert (K, {"nbdebug/skipped": 1.0}) in run["metrics"].rows
    rows = {r["step"]: r for r in cb.guard.history}
    assert rows[K]["nonfinite"] == "loss" and rows[K]["skipped"]
    assert rows[K - 1]["nonfinite"] is None


def test_the_snapshot_holds_the_batch_and_the_trainer(run: dict[str, Any]) -> None:
    (path,) = run["cb"].guard.snapshots
    assert path.parent == run["dir"]
    snap = nbdebug.load_snapshot(path, model=TinyModule)
    x, y = next(b for i, b in enumerate(data()) if i == K)
    assert snap.step == K and snap.reason["kind"] == "loss"
    assert torch.equal(snap.inputs, x) and torch.equal(snap.target, y)
    assert snap.trainer is not None and snap.trainer["framework"] == "lightning"
    assert snap.trainer["version"] == L.__version__ and snap.trainer["global_step"] == K
    assert snap.optimizer_class == "torch.optim.adamw:AdamW"
    assert snap.autocast is None  # precision="32-true"


def test_the_snapshot_replays_to_the_same_origin_in_a_fresh_process(run: dict[str, Any]) -> None:
    (path,) = run["cb"].guard.snapshots
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import nbdebug
        from test_integrations_lightning import TinyModule
        o = nbdebug.load_snapshot({str(path)!r}, model=TinyModule).trace().origin
        print(json.dumps({{"phase": o.phase, "module": o.module, "samples": o.samples}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    origin = json.loads(out.stdout.strip().splitlines()[-1])
    assert origin == {"phase": "forward", "module": "log_in", "samples": [BAD_ROW]}


def test_a_bad_guard_option_is_refused_when_the_callback_is_made() -> None:
    with pytest.raises(TypeError, match=r"unknown guard option 'patince'; expected .*patience"):
        NaNGuardCallback(directory="x", patince=2)
    with pytest.raises(TypeError, match="takes 'optimizer' from the trainer"):
        NaNGuardCallback(directory="x", optimizer=None)
    with pytest.raises(TypeError, match="takes 'autocast' from the trainer"):
        NaNGuardCallback(directory="x", autocast="float16")  # from its precision setting
    # a wrong value too, not at train start
    with pytest.raises(ValueError, match=r"on_nonfinite must be one of .*; got 'skipp'"):
        NaNGuardCallback(directory="x", on_nonfinite="skipp")
    with pytest.raises(ValueError, match=r"max_snapshots must be a positive int or None; got 0"):
        NaNGuardCallback(directory="x", max_snapshots=0)
    with pytest.raises(TypeError, match="loss_fn"):
        NaNGuardCallback(directory="x", loss_fn="mse")


def test_a_bad_directory_or_the_class_itself_is_named() -> None:
    with pytest.raises(TypeError, match=r"directory must be a str or os\.PathLike; got int"):
        NaNGuardCallback(directory=123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"takes an instance, NaNGuardCallback\(directory=\.\.\.\)"):
        trainer([NaNGuardCallback]).fit(TinyModule(), data())


class DictModule(L.LightningModule):
    """A LightningModule whose forward takes the batch dict as one argument."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.log_in = Log()
        self.a = nn.Linear(4, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.a(self.log_in(batch["x"]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch), batch["y"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_a_dict_batch_that_forward_takes_whole_replays_as_one_argument(tmp_path: Path) -> None:
    rows = [{"x": x, "y": y} for x, y in data().dataset]
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)
    cb = NaNGuardCallback(directory=tmp_path)
    trainer([cb]).fit(DictModule(), loader)
    assert cb.skipped == [K]
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=DictModule)
    (batch,) = snap.inputs  # model(batch), not model(**batch): forward takes no 'x' keyword
    assert set(batch) == {"x", "y"} and float(batch["x"][BAD_ROW, 2]) == -1.0
    tr = snap.trace(loss_fn=lambda o: o.pow(2).mean())
    assert tr.origin is not None and (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])


def test_an_unsupported_lightning_version_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "__version__", "1.9.5")
    with pytest.raises(
        ImportError, match=r"supports lightning >=2.0,<3.0; found lightning 1.9.5\."
    ):
        NaNGuardCallback(directory="x")


def test_attached_to_a_transformers_trainer_it_says_so(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the nbdebug[hf] extra is missing")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match="expects a Lightning Trainer; it was attached to a "):
        transformers.Trainer(model=nn.Linear(2, 2), args=args, callbacks=[NaNGuardCallback()])


def test_without_lightning_the_callback_raises_the_install_hint() -> None:
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "from nbdebug.integrations.lightning import NaNGuardCallback\n"
        "try:\n    NaNGuardCallback(directory='x')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs Lightning" in out.stdout and "pip install nbdebug[lightning]" in out.stdout


def test_under_bf16_mixed_the_snapshot_replays_in_bfloat16(tmp_path: Path) -> None:
    cb = NaNGuardCallback(directory=tmp_path, loss_fn=F.mse_loss)
    trainer([cb], steps=K + 1, precision="bf16-mixed").fit(TinyModule(), data())
    assert cb.skipped == [K]
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=TinyModule)
    assert snap.autocast == {"device_type": "cpu", "dtype": "bfloat16"}
    tr = snap.trace()
    dtypes = {e.module: e.dtype for e in tr.events if e.phase == "forward"}
    assert dtypes["a"] == "bfloat16" and dtypes["b"] == "bfloat16"
    assert tr.origin is not None and (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])
    plain = snap.trace(autocast=False)
    assert {e.dtype for e in plain.events if e.phase == "forward"} == {"float32"}


def test_16_mixed_on_cpu_is_lightnings_bf16_fallback_and_recorded_as_what_ran(
    tmp_path: Path,
) -> None:
    # Lightning 2.x itself turns precision="16-mixed" on CPU into "bf16-mixed" with a warning
    # (no GradScaler): the callback records what ran, not what was asked for
    cb = NaNGuardCallback(directory=tmp_path, loss_fn=F.mse_loss)
    with pytest.warns(UserWarning, match=r"AMP with fp16 is not supported on CPU\. Using "):
        t = trainer([cb], steps=K + 1, precision="16-mixed")
    t.fit(TinyModule(), data())
    assert t.precision == "bf16-mixed" and cb.skipped == [K]
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=TinyModule)
    assert snap.autocast == {"device_type": "cpu", "dtype": "bfloat16"}
    assert snap.scaler_state is None and snap.trainer["args"]["precision"] == "bf16-mixed"


def test_float16_with_a_gradscaler_on_cpu_through_the_mixed_precision_plugin(
    tmp_path: Path,
) -> None:
    # float16 on CPU: Lightning's MixedPrecision plugin given explicitly (a GradScaler("cpu"),
    # initial scale 65536: the first step's float16 gradients overflow)
    from lightning.pytorch.plugins import MixedPrecision

    cb = NaNGuardCallback(directory=tmp_path, loss_fn=F.mse_loss)
    watch = WeightWatch()
    module = TinyModule()
    t = trainer([cb, watch], precision=None, plugins=[MixedPrecision("16-mixed", "cpu")])
    t.fit(module, data())
    assert t.precision == "16-mixed" and cb.guard.scaler is t.precision_plugin.scaler
    rows = {r["step"]: r for r in cb.guard.history}
    # step 0: the scaler's overflow skip (its update skipped, the scale halved), no snapshot
    assert rows[0]["skipped"] is True and rows[0]["nonfinite"] is None
    assert watch.changed[0] is False and rows[1]["scale"] == rows[0]["scale"] / 2
    # step K: the NaN the model makes is the guard's: skipped, one snapshot
    assert cb.skipped == [K] and rows[K]["nonfinite"] == "loss" and watch.changed[K] is False
    assert [p.name for p in cb.guard.snapshots] == [f"step-{K:09d}.nbsnap"]
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=TinyModule)
    assert snap.autocast == {"device_type": "cpu", "dtype": "float16"}
    assert snap.scaler_state is not None and snap.scaler_state["scale"] == rows[K]["scale"]
    tr = snap.trace()
    dtypes = {e.module: e.dtype for e in tr.events if e.phase == "forward"}
    assert dtypes["a"] == "float16" and dtypes["b"] == "float16"
    assert tr.origin is not None and (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_a_skipped_step_under_gradient_clipping_goes_on(tmp_path: Path, algorithm: str) -> None:
    # Lightning clips after on_before_optimizer_step: torch's clip_grad_value_ fails on a
    # step with no gradient at all, so the skip leaves clipping out of that step
    cb, watch, module = NaNGuardCallback(directory=tmp_path), WeightWatch(), TinyModule()
    t = trainer([cb, watch], gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    t.fit(module, data())
    assert cb.skipped == [K] and t.global_step == STEPS
    assert watch.changed[K] is False and all(watch.changed[i] for i in range(STEPS) if i != K)
    assert t.gradient_clip_val == 0.5  # the trainer's setting is back
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


class TwoOptimizers(L.LightningModule):
    """Manual optimization, GAN style: two optimizers stepped one after the other."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.g = nn.Linear(4, 1)
        self.log_in = Log()
        self.d = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.log_in(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_g, opt_d = self.optimizers()
        opt_g.zero_grad()
        self.manual_backward(F.mse_loss(self.g(x), y))
        opt_g.step()
        opt_d.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))  # NaN in batch K
        opt_d.step()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.g.parameters(), lr=0.1),
            torch.optim.SGD(self.d.parameters(), lr=0.1),
        ]


def test_the_second_optimizer_of_a_manual_step_gets_the_batch(tmp_path: Path) -> None:
    cb = NaNGuardCallback(directory=tmp_path, loss_fn=F.mse_loss)
    trainer([cb], steps=2 * STEPS).fit(TwoOptimizers(), data())
    assert cb.skipped == [2 * K + 1]  # global_step counts both optimizers' steps
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=TwoOptimizers)
    x, y = data().dataset[K * BATCH : (K + 1) * BATCH]
    assert torch.equal(snap.inputs.nan_to_num(), x) and torch.equal(snap.target, y)
    tr = snap.trace()
    assert tr.origin is not None and (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])


class PartDictModule(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch["x"]), batch["y"])


def test_a_dict_batch_whose_keys_forward_takes_in_part_replays_those_keys(
    tmp_path: Path,
) -> None:
    rows = [{"x": x, "y": y} for x, y in data().dataset]
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)
    cb = NaNGuardCallback(directory=tmp_path)
    trainer([cb]).fit(PartDictModule(), loader)
    snap = nbdebug.load_snapshot(cb.guard.snapshots[0], model=PartDictModule)
    assert set(snap.inputs) == {"x"} and snap.target is not None  # the key left over
    assert float(snap.inputs["x"][BAD_ROW, 2]) == -1.0
    tr = snap.trace(loss_fn=F.mse_loss)
    assert tr.origin is not None and (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])


class LossLog(TinyModule):
    """Keeps what training_step returned, batch by batch."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def test_under_accumulation_the_history_has_training_steps_loss(tmp_path: Path) -> None:
    # Lightning divides the loss by accumulate_grad_batches before the backward
    cb, module = NaNGuardCallback(directory=tmp_path), LossLog()
    t = trainer([cb], steps=2, accumulate_grad_batches=2)
    t.fit(module, data())
    # step 0 is batches 0 and 1 (the last one's loss); step 1 batches 2 and K=3 (NaN)
    losses = [h["loss"] for h in cb.guard.history]
    assert losses == pytest.approx([module.losses[1], module.losses[3]], rel=1e-6, nan_ok=True)
    assert cb.skipped == [1] and math.isnan(losses[1])


# ------------------------------------------------- the loss in training_step (issue 33)
class ClsModule(TinyModule):
    """The common shape: the loss is computed in training_step, which also logs."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(8, 3)  # three classes

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        self.log_dict({"batch_idx": float(batch_idx)})
        return loss


class LossMadeModule(ClsModule):
    """A NaN made in training_step itself, from finite logits (a log of a negative)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return torch.log(out.mean() - 1e3) + F.cross_entropy(out, y)


def cls_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(BATCH * STEPS, 4, generator=g) + 0.5
    y = torch.randint(0, 3, (BATCH * STEPS,), generator=g)
    x[K * BATCH + BAD_ROW, 2] = -1.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


@pytest.fixture(scope="module")
def step_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("lightning-step")
    cb = NaNGuardCallback(directory=directory)  # no loss_fn=: the loss is training_step's
    trainer([cb]).fit(ClsModule(), cls_data())
    return {"cb": cb, "path": cb.guard.snapshots[0]}


def test_a_training_step_loss_replays_without_loss_fn(step_run: dict[str, Any]) -> None:
    assert step_run["cb"].skipped == [K]
    snap = nbdebug.load_snapshot(step_run["path"], ClsModule)
    src = snap.loss_source
    assert src["call"] == "model_method" and src["method"] == "training_step"
    assert src["args"] == [K] and src["class"].endswith(":ClsModule")
    tr = snap.trace()
    assert tr.origin is not None
    assert (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])
    assert tr.model_name == "ClsModule" and math.isnan(tr.loss)
    # the loaded module is left as it was: no instance attribute for the silenced methods
    assert not {"log", "log_dict", "print"} & set(vars(snap.model))
    # the trace's events are named as the module's own
    assert {e.module for e in tr.events} <= {n for n, _ in snap.model.named_modules()}


def test_diagnose_and_check_replay_through_training_step(step_run: dict[str, Any]) -> None:
    d = nbdebug.diagnose(step_run["path"], model=ClsModule, progress=False)
    assert d.trace is not None and d.trace.origin is not None
    assert d.trace.origin.module == "log_in"
    found = nbdebug.check(nbdebug.load_snapshot(step_run["path"], ClsModule))
    assert found.of("nonfinite_origin") or found.of("log_of_nonpositive")


def test_a_loss_made_in_training_step_is_named_there(tmp_path: Path) -> None:
    cb = NaNGuardCallback(directory=tmp_path)
    trainer([cb], steps=1).fit(LossMadeModule(), cls_data())
    tr = nbdebug.load_snapshot(cb.guard.snapshots[0], LossMadeModule).trace()
    assert tr.origin is not None and tr.origin.module == ""
    assert "test_integrations_lightning.py" in (tr.origin.source or "")


def test_a_training_step_snapshot_without_its_class_names_it(step_run: dict[str, Any]) -> None:
    plain = nn.Sequential()
    plain.log_in, plain.a, plain.b = Log(), nn.Linear(4, 8), nn.Linear(8, 3)
    snap = nbdebug.load_snapshot(step_run["path"], model=lambda: plain)
    with pytest.raises(nbdebug.SnapshotError, match=r"ClsModule\.training_step.*model=ClsModule"):
        snap.trace()
    # a loss function given replays the model's forward as before
    assert snap.trace(loss_fn=F.cross_entropy).origin.module == "log_in"
    with pytest.raises(nbdebug.SnapshotError, match="ClsModule"):
        nbdebug.load_snapshot(step_run["path"]).trace()


def test_inspect_and_the_debugger_replay_through_training_step(
    step_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from nbdebug.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    main(["inspect", str(step_run["path"]), "--model", "test_integrations_lightning:ClsModule"])
    text = out.getvalue()
    assert "log_in" in text and "Not replayed" not in text
    dbg = nbdebug.debug(nbdebug.load_snapshot(step_run["path"], ClsModule))
    try:
        assert dbg.trace.origin is not None and dbg.trace.origin.module == "log_in"
    finally:
        dbg.close()


def fit_ddp_step(rank: int, world: int, directory: str) -> dict[str, Any]:
    """One rank of a DDP run of ClsModule (no loss_fn=); rank 1's batch K makes the NaN."""
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(BATCH * STEPS, 4, generator=g) + 0.5
    y = torch.randint(0, 3, (BATCH * STEPS,), generator=g)
    if rank == 1:
        x[K * BATCH + BAD_ROW, 2] = -1.0
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    cb = NaNGuardCallback(directory=directory, timeout=30)
    t = trainer([cb], strategy="ddp", devices=world, use_distributed_sampler=False)
    t.fit(ClsModule(), loader)
    return {"skipped": list(cb.skipped), "snapshots": [str(p) for p in cb.guard.snapshots]}


@pytest.mark.timeout(240)
def test_under_ddp_each_ranks_snapshot_replays_its_training_step(tmp_path: Path) -> None:
    import distributed_helpers as h

    results = h.launch(fit_ddp_step, 2, str(tmp_path), timeout=180)
    for r in (0, 1):
        assert "value" in results.get(r, {}), results.get(r)
        assert results[r]["value"]["skipped"] == [K]
    bad = nbdebug.load_snapshot(tmp_path / f"step-{K:09d}-rank1.nbsnap", ClsModule)
    assert bad.loss_source is not None and bad.loss_source["method"] == "training_step"
    tr = bad.trace()
    assert tr.origin is not None and (tr.origin.module, tr.origin.samples) == ("log_in", [BAD_ROW])
    # rank 0 got the NaN through the gradient all-reduce: its own step replays finite
    assert nbdebug.load_snapshot(tmp_path / f"step-{K:09d}-rank0.nbsnap", ClsModule).trace().healthy
