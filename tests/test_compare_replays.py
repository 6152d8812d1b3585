"""``nbdebug.compare_replays`` (issue 33, item 6): two replays of one step, op by op."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.analysis.compare import compiler_verdict
from nbdebug.analysis.compare.config import cannot_run
from nbdebug.analysis.compare.result import differs
from nbdebug.core.snapshot.write import compile_settings


class Scale(nn.Module):
    """Finite in float64 and float32; past float16's 65504 at these inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e4


class CompiledOnly(nn.Module):
    """A deliberate compiler difference: a zero over zero in the compiled graph only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return (x - x) / (x - x)
        return x


def _mean(o: torch.Tensor) -> torch.Tensor:
    return o.mean()


def _overflowing() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Scale(), nn.Linear(16, 16), nn.Tanh())
    return model, torch.randn(4, 8) * 10


def test_float16_vs_float64_names_the_op_that_overflows() -> None:
    model, x = _overflowing()
    before = fingerprint(model)
    r = nbdebug.compare_replays(model, x, a="float16", b="float64", loss_fn=_mean)
    assert_unchanged(before, model)
    assert not r.ok and r.level == "op"
    d = r.first
    assert d is not None
    assert (d.phase, d.level, d.module, d.op) == ("forward", "op", "2", "Tensor.mul")
    assert d.source is not None and d.source.startswith("test_compare_replays.py:")
    assert d.reason == "Inf vs finite" and d.a == float("inf") and 65504 < d.b < float("inf")
    assert (d.dtype_a, d.dtype_b) == ("float16", "float64")
    s = r.summary()
    assert "Tensor.mul in '2'" in s and "float16" in s and s.count(".") >= 1
    assert "ReplayComparison(" in repr(r)
    frame = r.to_frame()
    assert list(frame["differs"]).count(True) == 1 and bool(frame["differs"].iloc[-1])
    assert {"module", "op", "source", "relative", "tolerance"} <= set(frame.columns)


def test_healthy_model_agrees_within_the_dtype() -> None:
    model, x = _overflowing()
    model[2] = nn.Identity()
    for a in ("float16", "bfloat16", "float32"):
        r = nbdebug.compare_replays((model, x), a=a, b="float64", loss_fn=_mean)
        assert r.ok, r.summary()
        assert r.first is None and r.compared >= 8
        assert "agree within what the dtypes explain" in r.summary()


def test_tolerance_comes_from_the_lower_precision_side() -> None:
    x64 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    eps16 = torch.finfo(torch.float16).eps
    half = (x64 * (1 + 4 * eps16)).half()
    assert differs(half, x64, None)[0] == ""  # a few float16 ulps: explained
    assert differs(x64.float() * (1 + 4 * eps16), x64, None)[0].startswith("relative")
    nan = x64.clone()
    nan[1] = float("nan")
    assert differs(nan, x64, None)[0] == "NaN vs finite"  # always a difference
    assert differs(x64, nan, None)[0] == "NaN vs finite"
    assert differs(x64[:2], x64, None)[0].startswith("shapes")


def test_a_saved_reference_replays_against_this_machine(tmp_path: Path) -> None:
    model, x = _overflowing()
    r = nbdebug.compare_replays(model, x, a="float64", b="float16", loss_fn=_mean)
    ref = r.recordings[0].save(tmp_path / "reference.pt")
    again = nbdebug.compare_replays(model, x, a="float64", b=str(ref), loss_fn=_mean)
    assert again.ok and again.b == "reference reference.pt (float64)", again.summary()
    worse = nbdebug.compare_replays(model, x, a="float16", b=ref, loss_fn=_mean)
    assert worse.first is not None and worse.first.op == "Tensor.mul"


def test_a_snapshot_is_a_source(tmp_path: Path) -> None:
    model, x = _overflowing()
    path = nbdebug.save_snapshot(tmp_path / "s.nbsnap", model, inputs=x)
    snap = nbdebug.load_snapshot(path, _overflowing()[0])
    r = nbdebug.compare_replays(snap, a="float16", b="float64", loss_fn=_mean)
    assert r.first is not None and r.first.module == "2"


def test_configurations_that_cannot_run_are_refused_before_any_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    class Counting(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return super().forward(x)

    model, x = Counting(8, 2), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"b='compile\[nope\]'.*back end 'nope' is not installed"):
        nbdebug.compare_replays(model, x, b=nbdebug.ReplayConfig(compile=True, backend="nope"))
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match=r"a='compile'.*needs a C\+\+ compiler"):
        nbdebug.compare_replays(model, x, a="compile", loss_fn=lambda o: o.sum())
    with pytest.raises(ValueError, match=r"not a replay configuration"):
        nbdebug.compare_replays(model, x, a="float8")
    with pytest.raises(ValueError, match=r"reference recording .* does not exist"):
        nbdebug.compare_replays(model, x, b="missing.pt")
    assert calls == []
    # a dtype the device cannot compute in is named with the device's own reason
    why = cannot_run(nbdebug.ReplayConfig(dtype=torch.bfloat16), torch.device("meta"))
    assert why is not None and why.startswith("bfloat16 cannot run on meta: ")
    assert cannot_run(nbdebug.ReplayConfig(dtype=torch.bfloat16), torch.device("cpu")) is None


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by inductor
def test_eager_vs_compile_on_cpu_inductor() -> None:
    """A healthy model compiles to the same values; a module that differs only when
    compiled is named at module level, with the note that says why."""
    pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    healthy = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    before = fingerprint(healthy)
    r = nbdebug.compare_replays(healthy, x, a="eager", b="compile", loss_fn=_mean)
    assert_unchanged(before, healthy)
    assert r.ok, r.summary()
    assert r.level == "module" and any("module boundaries" in n for n in r.notes)
    broken = nn.Sequential(nn.Linear(8, 16), CompiledOnly(), nn.Linear(16, 1))
    r = nbdebug.compare_replays(broken, x, a="eager", b="compile", loss_fn=_mean)
    d = r.first
    assert d is not None and (d.phase, d.module, d.op) == ("forward", "1", "output")
    assert d.reason == "NaN vs finite" and d.b != d.b and d.a == d.a
    assert "the output of '1'" in r.summary()


def test_a_snapshot_replays_under_its_recorded_autocast(tmp_path: Path) -> None:
    model, x = _overflowing()
    path = nbdebug.save_snapshot(
        tmp_path / "amp.nbsnap",
        model,
        inputs=x,
        autocast={"device_type": "cpu", "dtype": "float16"},
    )
    snap = nbdebug.load_snapshot(path, _overflowing()[0])
    r = nbdebug.compare_replays(snap, a="eager", b="float64", loss_fn=_mean)
    d = r.first
    assert d is not None and (d.module, d.op, d.dtype_a) == ("2", "Tensor.mul", "float16")
    # the model's own dtypes without the autocast: float32 agrees with float64
    plain = nbdebug.compare_replays(snap, a="float32", b="float64", loss_fn=_mean)
    assert plain.ok, plain.summary()


class LogOf(nn.Module):
    """A NaN in eager mode too: the log of the negative outputs of the layer before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def _compiled_snapshot(
    tmp_path: Path, middle: nn.Module, **compile_options: str
) -> tuple[nbdebug.Snapshot, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), middle, nn.Linear(16, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    compiled = torch.compile(model, **compile_options)
    path = nbdebug.save_snapshot(tmp_path / "c.nbsnap", compiled, x, y, loss_fn=F.mse_loss)
    return nbdebug.load_snapshot(path, model=copy.deepcopy(model)), model, x


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by inductor
def test_compile_settings_name_the_back_end() -> None:
    m = nn.Linear(2, 2)
    assert compile_settings(m) is None
    assert compile_settings(torch.compile(m)) == {"backend": "inductor"}
    assert compile_settings(torch.compile(m, backend="aot_eager")) == {"backend": "aot_eager"}
    inplace = nn.Linear(2, 2)
    inplace.compile(backend="eager")
    assert compile_settings(inplace) == {"backend": "eager"}


def test_an_eager_model_s_snapshot_has_no_compiler_verdict(tmp_path: Path) -> None:
    model, x = _overflowing()
    path = nbdebug.save_snapshot(tmp_path / "s.nbsnap", model, inputs=x)
    snap = nbdebug.load_snapshot(path, _overflowing()[0])
    assert snap.compiled is None and compiler_verdict(snap) is None


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by inductor
def test_a_nan_made_by_the_compiler_is_the_compiler_s(tmp_path: Path) -> None:
    pytest.importorskip("torch._inductor")
    snap, model, _ = _compiled_snapshot(tmp_path, CompiledOnly())
    # the compiled model's snapshot holds the module it wraps, and its back end
    assert snap.compiled == {"backend": "inductor"}
    assert set(snap.model_state) == set(model.state_dict())
    v = compiler_verdict(snap)
    assert v is not None and v.compiler is True and v.backend == "inductor"
    assert v.eager_origin is None and v.first is not None
    assert (v.first.phase, v.first.module, v.first.op) == ("forward", "1", "output")
    assert v.first.reason == "NaN vs finite"
    assert str(v).startswith("The NaN is the compiler's: the eager replay of the step stays")
    assert "the output of '1' (forward)" in v.sentence and v.sentence.count(". ") == 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_nan_the_eager_replay_makes_too_is_not_the_compiler_s(tmp_path: Path) -> None:
    snap, model, x = _compiled_snapshot(tmp_path, LogOf(), backend="aot_eager")
    assert bool((model[0](x) < 0).any())  # the log of a negative: NaN in eager mode
    v = compiler_verdict(snap)
    assert v is not None and v.compiler is False and v.backend == "aot_eager"
    o = v.eager_origin
    assert o is not None and (o.phase, o.module, o.op) == ("forward", "1", "torch.log")
    assert o.source is not None and o.source.startswith("test_compare_replays.py:")
    assert v.sentence.startswith("The NaN is not the compiler's: the eager replay of the step")
    assert "torch.log in '1' at test_compare_replays.py:" in v.sentence


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_diagnose_of_a_compiled_model_s_snapshot_says_whose_nan_it_is(tmp_path: Path) -> None:
    snap, model, x = _compiled_snapshot(tmp_path, LogOf(), backend="aot_eager")
    d = nbdebug.diagnose(snap, progress=False)
    said = [n for n in d.notes if "compiler's" in n]
    assert len(said) == 1 and said[0].startswith("The NaN is not the compiler's")
    # the same step of the eager model: its snapshot says nothing about a compiler
    y = torch.randn(4, 1)
    path = nbdebug.save_snapshot(tmp_path / "e.nbsnap", model, x, y, loss_fn=F.mse_loss)
    eager = nbdebug.diagnose(path, model=copy.deepcopy(model), progress=False)
    assert nbdebug.load_snapshot(path, model=copy.deepcopy(model)).compiled is None
    assert not [n for n in eager.notes if "compiler" in n]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_guard_of_a_compiled_model_records_its_back_end(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), LogOf(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(compiled, opt, directory=tmp_path, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = F.mse_loss(compiled(x), y)
    loss.backward()
    assert not guard.check(loss, inputs=x, target=y)  # log of a negative: NaN
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=copy.deepcopy(model))
    assert snap.compiled == {"backend": "aot_eager"}
    guard.close()
