"""nbdebug.diagnose(): the scenario suite (a known right fix each), the fix objects, bad
input, and that the user's model and optimizer are untouched."""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from diagnose_scenarios import CASES, MLP, Case, NormNet, constant_row
from state import assert_unchanged, same_tensor
from state import fingerprint as state_fingerprint
from torch import nn

import nbdebug
from nbdebug import DropRowsFix, EpsilonFix, Fix, Float32Fix, Replay
from nbdebug.analysis.diagnose import KINDS
from nbdebug.analysis.diagnose.fix_epsilon import rewrite_line
from nbdebug.analysis.diagnose.rewrite import RewriteMode, op_family


# ---------------------------------------------------------------------- fingerprint
def _tensors_of(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors_of(v, f"{prefix}[{k!r}]"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors_of(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = copy.deepcopy(obj)
    return out


def fingerprint(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """tests/state.py's fingerprint (with version counters: not even a write-back), plus
    the optimizer's state and hyper-parameters and the modules' forward attributes."""
    return {
        "model": state_fingerprint(model, versions=True),
        "dtypes": {n: p.dtype for n, p in model.named_parameters()},
        "forward": [("forward" in m.__dict__) for m in model.modules()],
        "optimizer": None if optimizer is None else _tensors_of(optimizer.state_dict()),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same_tensor(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return bool(a == b)


def assert_untouched(before: dict[str, Any], model: nn.Module, optimizer: Any = None) -> None:
    assert_unchanged(before["model"], model)
    after = fingerprint(model, optimizer)
    for key in ("dtypes", "forward", "optimizer"):
        assert _same(before[key], after[key]), f"diagnose changed the user's {key}"


# ---------------------------------------------------------------------- scenario suite
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scenario_ranks_the_right_cause_first(case: Case, tmp_path: Path) -> None:
    kw = case.build(tmp_path)
    user_model, user_opt = kw.pop("user_model"), kw.pop("user_optimizer")
    earlier = kw.pop("earlier_step", None)
    arch = None
    if isinstance(kw["source"], Path):
        # the architecture as a module instance: load_snapshot copies it, never changes it
        arch = kw["model"]()
        kw["model"] = arch
        arch_before = fingerprint(arch)
    before = fingerprint(user_model, user_opt)
    d = nbdebug.diagnose(progress=False, **kw)
    assert_untouched(before, user_model, user_opt)
    if arch is not None:
        assert_untouched(arch_before, arch)
    assert isinstance(d, nbdebug.Diagnosis)
    c = d.cause
    assert c.kind == case.kind, f"{case.name}: top row {c.kind} ({c.statement})\n{d!r}"
    if case.module is not ...:
        assert c.module == case.module, d
    if case.rows is not None:
        assert c.rows == case.rows, d
    assert c.finite == (case.kind != "weights_corrupted")
    assert d.results[0].rank == 1 and d.results[0].kind == c.kind
    assert c.statement.endswith(".") and len(c.statement.split(". ")) <= 2
    if earlier is not None:
        assert f"step {earlier}" in c.statement


def testconstant_row_diagnosis_reads_as_the_issue_says(tmp_path: Path) -> None:
    kw = CASES[0].build(tmp_path)
    for k in ("user_model", "user_optimizer"):
        kw.pop(k)
    d = nbdebug.diagnose(progress=False, **kw)
    df = d.to_frame()
    assert list(df["rank"]) == list(range(1, len(df) + 1))
    top = df.iloc[0]
    assert top["kind"] == "epsilon" and top["module"] == "norm" and bool(top["finite"])
    assert bool(top["loss_ok"]) and bool(top["backward"]) and bool(top["update"])
    # the epsilon is named at its line and given as code to paste
    assert "diagnose_scenarios.py:" in d.cause.statement
    assert "/ (sd + 1e-06)" in top["snippet"]
    assert "dropping batch row 3" in d.cause.statement
    rows = df[df["kind"] == "drop_rows"].iloc[0]
    assert rows["rows"] == [3] and bool(rows["finite"])
    plain = df[df["kind"] == "rerun"].iloc[0]
    assert not plain["finite"] and plain["cost"] == pytest.approx(1.0)
    # a healthy reference from the guard's history, and the fixed loss near it
    assert d.reference["loss"] is not None and math.isfinite(top["loss"])
    assert "Diagnosis(step 6)" in repr(d) and "epsilon" in repr(d)
    # the debugger's "try": the trace with the fix applied is finite, without it NaN
    assert d.trace is not None and d.trace.origin is not None
    fixed = d.trace_with(1)
    assert fixed.origin is None and fixed.healthy
    assert d.trace_with("drop_rows").healthy


# ---------------------------------------------------------------------- user fixes, bad input
class _Raises(Fix):
    kind = "custom"

    @contextmanager
    def apply(self, replay: Replay):
        raise RuntimeError("this fix is broken")
        yield  # pragma: no cover

    def describe(self) -> str:
        return "a fix that raises"


class _ReplaceNorm(Fix):
    """A user's fix: swap the module for one with an epsilon (on the replay's copy)."""

    kind = "custom"
    module = "norm"

    @contextmanager
    def apply(self, replay: Replay):
        old = replay.model.norm
        replay.model.norm = _EpsNorm()
        try:
            yield
        finally:
            replay.model.norm = old

    def describe(self) -> str:
        return "Normalize with eps=1e-5"


class _EpsNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-5)


class _NeverApplies(Fix):
    kind = "scaler"

    def applies(self, trace: Any) -> bool:
        return False

    def why_not(self, trace: Any) -> str:
        return "the step has no GradScaler."


def _live_norm() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = NormNet()
    x, y = constant_row()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # some optimizer state and a user's .grad and hook, which must all survive
    F.cross_entropy(model(torch.randn(8, 8)), y).backward()
    opt.step()
    model.fc.register_forward_hook(lambda m, i, o: None)
    return model, x, y, opt


def test_user_fixes_errors_and_fixes_that_do_not_apply_are_rows() -> None:
    model, x, y, opt = _live_norm()
    before = fingerprint(model, opt)
    d = nbdebug.diagnose(
        model,
        x,
        y,
        F.cross_entropy,
        optimizer=opt,
        fixes=[_Raises(), _ReplaceNorm(), _NeverApplies(), "drop_rows"],
        progress=False,
    )
    assert_untouched(before, model, opt)
    df = d.to_frame()
    assert set(df["kind"]) == {"custom", "scaler", "drop_rows", "rerun"}
    broken = df[df["change"] == "a fix that raises"].iloc[0]
    assert not broken["finite"] and "RuntimeError: this fix is broken" in broken["note"]
    never = df[df["kind"] == "scaler"].iloc[0]
    assert not never["finite"] and never["note"] == "the step has no GradScaler."
    assert never["rank"] == len(df)  # not applicable: last
    # both the user's fix and dropping the row make the step finite: rows are the more
    # local change (a custom fix ranks as one module unless it sets its locality)
    assert d.cause.kind == "drop_rows" and d.cause.rows == [3]
    custom = df[df["change"] == "Normalize with eps=1e-5"].iloc[0]
    assert bool(custom["finite"]) and custom["rank"] == 2


def test_live_model_batch_optimizer_untouched_and_menu() -> None:
    model, x, y, opt = _live_norm()
    before = fingerprint(model, opt)
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, optimizer=opt, progress=False)
    assert_untouched(before, model, opt)
    assert d.cause.kind == "epsilon" and d.cause.module == "norm" and d.cause.rows == [3]
    kinds = set(d.to_frame()["kind"])
    assert {"epsilon", "drop_rows", "rerun"} <= kinds
    # no gradient is finite here: clipping and the learning rate are not candidates
    assert not kinds & {"clip_grad", "lower_lr"}


def test_snapshot_without_optimizer_state_still_diagnoses(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NormNet()
    x, y = constant_row()
    path = nbdebug.save_snapshot(
        tmp_path / "s.nbsnap", model, x, y, reason="by hand", loss_fn=F.cross_entropy
    )
    d = nbdebug.diagnose(path, model=NormNet, progress=False)
    assert any("holds no optimizer state" in n for n in d.notes)
    assert d.cause.kind == "epsilon" and d.cause.finite
    top = d.to_frame().iloc[0]
    assert top["update"] is None  # no optimizer: the update is not checked


def test_a_factory_of_another_architecture_is_one_clear_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = constant_row()
    path = nbdebug.save_snapshot(tmp_path / "s.nbsnap", NormNet(), x, y, loss_fn=F.cross_entropy)
    with pytest.raises(nbdebug.SnapshotError, match="does not fit the given MLP"):
        nbdebug.diagnose(path, model=MLP, progress=False)
    with pytest.raises(nbdebug.SnapshotError, match="without a model"):
        nbdebug.diagnose(nbdebug.load_snapshot(path), progress=False)


def test_a_snapshot_with_a_target_but_no_loss_function_asks_for_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = constant_row()
    none = nbdebug.save_snapshot(tmp_path / "none.nbsnap", NormNet(), x, y)
    # a lambda cannot be stored: the snapshot names it but cannot rebuild it
    anon = nbdebug.save_snapshot(
        tmp_path / "anon.nbsnap", NormNet(), x, y, loss_fn=lambda o, t: F.cross_entropy(o, t)
    )
    expected = {
        none: r"recorded no loss function but has a target: pass diagnose\(snapshot, loss_fn=",
        anon: r"has no import path .*pass it again: diagnose\(snapshot, loss_fn=",
    }
    for path, message in expected.items():
        snap = nbdebug.load_snapshot(path, NormNet)
        assert snap.target is not None
        with pytest.raises(nbdebug.SnapshotError, match=message):
            nbdebug.diagnose(snap, progress=False)
        with pytest.raises(nbdebug.SnapshotError, match=r"pass (it again: )?snap\.trace\("):
            snap.trace()
        d = nbdebug.diagnose(snap, loss_fn=F.cross_entropy, progress=False)
        assert d.cause.kind == "epsilon"


def test_budget_zero_replays_only_the_plain_step() -> None:
    model, x, y, opt = _live_norm()
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, optimizer=opt, budget_s=0, progress=False)
    df = d.to_frame()
    skipped = df[df["kind"] != "rerun"]
    assert len(skipped) >= 2 and all("budget_s=0" in n for n in skipped["note"])
    assert not any(skipped["finite"])
    # the plain re-run failed again: a row of its own kind, never "not_reproducible"
    assert d.cause.kind == "rerun" and not d.cause.finite
    assert "not_reproducible" not in set(df["kind"])
    # none was tried: the statement says so, not that none works
    assert "no candidate fix made the step finite" not in d.cause.statement
    assert f"budget_s ran out before any of the {len(skipped)} candidate fixes found" in (
        d.cause.statement
    )


def test_bad_arguments_say_what_was_expected() -> None:
    model, x, y, _ = _live_norm()
    with pytest.raises(TypeError, match="expects a Snapshot, a snapshot path"):
        nbdebug.diagnose(42)
    with pytest.raises(TypeError, match="needs the batch"):
        nbdebug.diagnose(model)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        nbdebug.diagnose(model, x, y, F.cross_entropy, steps=0)
    with pytest.raises(ValueError, match="unknown fix kind 'nope'"):
        nbdebug.diagnose(model, x, y, F.cross_entropy, fixes=["nope"])
    with pytest.raises(TypeError, match="fixes must hold fix kinds"):
        nbdebug.diagnose(model, x, y, F.cross_entropy, fixes=[3])
    other = torch.optim.SGD(MLP().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        nbdebug.diagnose(model, x, y, F.cross_entropy, optimizer=other)
    # a step that raises before any NaN: nothing to diagnose, and no "finite" verdict
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(nbdebug.TraceError, match=r"in fc \(Linear\).*shapes cannot be"):
        nbdebug.diagnose(model, x[:, :5], y, F.cross_entropy, progress=False)
    with pytest.raises(nbdebug.TraceError, match="the loss function raised"):
        nbdebug.diagnose(model, x, y[:3], F.cross_entropy, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_healthy_step_has_nothing_to_fix() -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, progress=False)
    assert d.cause.kind == "not_reproducible" and d.cause.finite
    assert "nothing to fix" in d.cause.statement


def test_steps_replays_more_updates() -> None:
    model, x, y, opt = _live_norm()
    d = nbdebug.diagnose(
        model, x, y, F.cross_entropy, optimizer=opt, steps=3, fixes=["epsilon"], progress=False
    )
    assert d.cause.kind == "epsilon" and d.cause.finite


# ---------------------------------------------------------------------- the fix objects
def test_fix_kinds_are_documented() -> None:
    for k in (
        "float32",
        "epsilon",
        "drop_rows",
        "clip_grad",
        "lower_lr",
        "scaler",
        "weights_corrupted",
        "not_reproducible",
        "rerun",
    ):
        assert k in KINDS


@pytest.mark.parametrize(
    "op, family",
    [
        ("Tensor.__truediv__", "div"),
        ("Tensor.div", "div"),
        ("torch.div", "div"),
        ("Tensor.__rtruediv__", "div"),
        ("torch.log", "log"),
        ("Tensor.log", "log"),
        ("torch.sqrt", "sqrt"),
        ("torch.rsqrt", "sqrt"),
        ("torch.exp", "exp"),
        ("torch.nn.functional.softmax", "softmax"),
        ("Tensor.softmax", "softmax"),
        ("torch.nn.functional.linear", None),
        (None, None),
    ],
)
def test_op_family(op: str | None, family: str | None) -> None:
    assert op_family(op) == family


def test_rewrite_mode_semantics() -> None:
    x = torch.tensor([[0.0, 0.0], [1.0, -2.0]])
    with RewriteMode("div", 1e-6) as m:
        out = x / x
    assert torch.isfinite(out).all() and m.calls == 1
    assert out[0].tolist() == [0.0, 0.0] and out[1].tolist() == pytest.approx([1.0, 1.0], rel=1e-5)
    with RewriteMode("div", 1e-6):
        assert (2.0 / x)[0].tolist() == [2e6, 2e6]  # __rtruediv__: the tensor is the denominator
    with RewriteMode("log", 1e-6):
        assert torch.log(x)[0, 0].item() == pytest.approx(math.log(1e-6))
    big = torch.tensor([[1000.0, 999.0], [0.0, 1.0]])
    with RewriteMode("exp"):
        e = torch.exp(big)
    p = e / e.sum(-1, keepdim=True)
    assert torch.allclose(p, torch.softmax(big, -1))
    s = torch.tensor([[float("-inf"), float("-inf")], [0.0, 0.0]])
    with RewriteMode("softmax"):
        q = torch.softmax(s, dim=-1)
    assert q.tolist() == [[0.0, 0.0], [0.5, 0.5]]
    # other families are left alone
    with RewriteMode("log"):
        assert torch.isnan((x / x)[0]).all()


def test_rewrite_line_makes_paste_ready_code() -> None:
    assert (
        rewrite_line("    return (x - mu) / sd", "div", 1e-6)
        == "    return (x - mu) / (sd + 1e-06)"
    )
    assert rewrite_line("y = torch.log(p)", "log", 1e-8) == "y = torch.log(p.clamp_min(1e-08))"
    assert (
        rewrite_line("e = torch.exp(z)", "exp", 0)
        == "e = torch.exp(z - z.amax(dim=-1, keepdim=True))"
    )
    # every operation of the family on the line, as the replay patches them all
    assert rewrite_line(
        "l = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()", "log", 1e-6
    ) == (
        "l = -(y * torch.log(p.clamp_min(1e-06)) "
        "+ (1 - y) * torch.log((1 - p).clamp_min(1e-06))).mean()"
    )
    assert rewrite_line("z = a / b + c / d", "div", 1e-6) == "z = a / (b + 1e-06) + c / (d + 1e-06)"
    assert rewrite_line("if x:", "div", 1e-6) is None
    assert rewrite_line("y = a + b", "div", 1e-6) is None


def test_apply_changes_nothing_outside_the_block() -> None:
    torch.manual_seed(0)
    model = NormNet().half()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8).half()).float().sum().backward()
    opt.step()
    r = Replay(model=model, optimizer=opt, inputs=torch.randn(4, 8).half(), batch_size=4)
    before = fingerprint(model, opt)
    for fix in (Float32Fix("fc"), Float32Fix(""), EpsilonFix("norm", "div"), DropRowsFix([1])):
        with fix.apply(r):
            if isinstance(fix, Float32Fix):
                assert model.fc.weight.dtype == torch.float32
            out = model(r.inputs)
            assert torch.isfinite(out).all()
        assert r.inputs.shape[0] == 4
        assert_untouched(before, model, opt)


# ---------------------------------------------------------------------- command line
def test_cli_diagnose_prints_the_table_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nbdebug.cli import main

    kw = CASES[0].build(tmp_path)
    path = kw["source"]
    before = path.read_bytes()
    out_html = tmp_path / "report.html"
    argv = [
        "diagnose",
        str(path),
        "--model",
        "diagnose_scenarios:NormNet",
        "--loss",
        "torch.nn.functional:cross_entropy",
        "-o",
        str(out_html),
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("nbdebug diagnose: step 6\n")
    assert "cause: norm (Normalize) produces" in out
    lines = out.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "kind", "module"]
    )
    assert lines[header + 1].split()[:5] == ["1", "epsilon", "norm", "-", "True"]
    page = out_html.read_text()
    assert "Verified fixes" in page and "<b>Cause:</b>" in page
    assert "/ (sd + 1e-06)" in page  # the snippet to paste
    assert path.read_bytes() == before
    # without a model: one line, status 2
    assert main(["diagnose", str(path)]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("nbdebug: error: ") and len(err.strip().splitlines()) == 1


class _FiniteButFar(DropRowsFix):
    """Drops the row, and scales the logits by 1e4: finite, but far from the history."""

    kind = "custom"
    locality = -1.0  # claims to be the most local change there is

    def __init__(self) -> None:
        super().__init__([3])

    @contextmanager
    def apply(self, replay: Replay):
        with super().apply(replay), torch.no_grad():
            replay.model.fc.weight.mul_(1e4)  # the copy's weights (reset before each replay)
            yield

    def describe(self) -> str:
        return "logits x1e4"


def test_a_finite_fix_far_from_the_history_ranks_after_close_ones() -> None:
    model, x, y, opt = _live_norm()
    history = [{"step": i, "loss": 1.1, "grad_norm": 0.7} for i in range(10)]
    d = nbdebug.diagnose(
        model,
        x,
        y,
        F.cross_entropy,
        optimizer=opt,
        history=history,
        fixes=[_FiniteButFar(), "drop_rows"],
        progress=False,
    )
    df = d.to_frame()
    assert d.reference == {"loss": 1.1, "grad_norm": 0.7}
    far = df[df["change"] == "logits x1e4"].iloc[0]
    assert bool(far["finite"]) and far["rank"] == 2
    assert "far from the healthy history" in far["note"]
    assert d.cause.kind == "drop_rows"


def test_a_corrupted_buffer_is_weights_corrupted() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).eval()
    with torch.no_grad():
        model[1].running_var[2] = float("nan")
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    before = fingerprint(model)
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, progress=False)
    assert_untouched(before, model)
    assert d.cause.kind == "weights_corrupted" and d.cause.module == "1" and not d.cause.finite
    assert "1.running_var" in d.cause.statement
    assert "no replay of this step can fix it" in d.cause.statement


def test_a_nonfinite_error_names_its_snapshot(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp_path, on_nonfinite="raise", loss_fn=F.cross_entropy
    )
    x, y = constant_row()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with pytest.raises(nbdebug.NonFiniteError) as info:
        guard.check(loss, inputs=x, target=y, step=7)
    d = nbdebug.diagnose(info.value, model=NormNet, progress=False)
    assert d.step == 7 and d.cause.kind == "epsilon" and d.cause.rows == [3]


class _RowNorm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = torch.sqrt((h**2).sum(1, keepdim=True))
        return h + n


def test_a_backward_origin_gets_its_line_rewritten_and_the_paste_works() -> None:
    # sqrt(0) is finite; its gradient is not: the NaN appears only in the backward, and
    # the snippet still rewrites the line, into code that makes the step finite
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), _RowNorm(), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    x[5] = 0.0
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, fixes=["epsilon"], progress=False)
    assert (d.trace.origin.phase, d.trace.origin.module) == ("backward", "1")
    top = d.to_frame().iloc[0]
    assert top["kind"] == "epsilon" and bool(top["finite"])
    new = top["snippet"].splitlines()[-1]
    assert new == "n = torch.sqrt((h ** 2).sum(1, keepdim=True).clamp_min(1e-06))"
    env: dict = {"torch": torch}
    exec(f"def pasted(h):\n    {new}\n    return h + n", env)
    model[1].forward = env["pasted"]
    F.cross_entropy(model(x), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_table_text_shows_a_replay_that_never_ran_as_dash_and_a_nan_loss_as_nan() -> None:
    """Every row of a batch holds Inf: dropping them all leaves nothing to replay (no cost,
    no loss: "-"), the plain replay's loss is NaN ("nan", as in every view): pandas'
    "NaN" for a missing value appears nowhere."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.full((4, 8), float("inf"))
    d = nbdebug.diagnose(model, x, torch.randn(4, 3), F.mse_loss, progress=False)
    lines = {line.split()[1]: line.split() for line in d.table().splitlines()[1:]}
    assert "NaN" not in d.table()
    assert lines["drop_rows"][5:8] == ["-", "-", "-"]  # loss, grad_norm, cost
    assert lines["rerun"][5] == "nan"


def _diverging_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _diverging_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, generator=g) * 3
    return x, x.sum(1, keepdim=True) * 5


def test_with_several_steps_a_row_shows_the_last_update_and_a_fix_that_still_diverges_says_so():
    model = _diverging_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3)
    x, y = _diverging_batch()
    x, y = x[:16], y[:16]
    d = nbdebug.diagnose(model, x, y, F.mse_loss, optimizer=opt, steps=5, progress=False)
    lower = next(r for r in d.results if r.kind == "lower_lr")
    # lr x 0.1 by hand, 5 updates: finite, but the loss is huge by the fifth
    m = _diverging_mlp()
    o = torch.optim.SGD(m.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-3)
    first = None
    for _ in range(5):
        loss = F.mse_loss(m(x), y)
        first = float(loss) if first is None else first
        o.zero_grad()
        loss.backward()
        o.step()
    assert lower.finite and lower.outcome.loss == pytest.approx(float(loss), rel=1e-4)
    assert lower.outcome.loss > 100 * first
    assert "diverging over the 5 replayed updates" in lower.note


def test_a_divergence_over_earlier_steps_that_no_fix_undoes_points_at_the_learning_rate(
    tmp_path,
):
    model = _diverging_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, loss_fn=F.mse_loss)
    x_all, y_all = _diverging_batch()
    for step in range(50):
        i = (step * 16) % 64
        loss = F.mse_loss(model(x_all[i : i + 16]), y_all[i : i + 16])
        loss.backward()
        if not guard.check(loss, inputs=x_all[i : i + 16], target=y_all[i : i + 16], step=step):
            break
        opt.step()
        opt.zero_grad()
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=_diverging_mlp)
    d = nbdebug.diagnose(snap, progress=False)
    assert not d.cause.finite
    assert "the failure reproduces, and no candidate fix made the step finite" in d.cause.statement
    assert "lower the learning rate" in d.cause.statement


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(a * b).pow(2).mean()  # the loss itself: no target


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_the_drop_rows_snippet_runs_on_the_batch_as_the_step_had_it(form: str) -> None:
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    b[2, 1] = float("nan")
    batch: Any = {"a": a, "b": b} if form == "dict" else (a, b)
    d = nbdebug.diagnose(_TwoInputs(), batch, progress=False)
    drop = next(r for r in d.results if r.kind == "drop_rows")
    assert drop.finite and drop.rows == [2]
    scope: dict[str, Any] = {"torch": torch, "batch": batch, "inputs": batch}
    exec(drop.snippet(), scope)
    kept = scope["batch"] if form == "dict" else scope["inputs"]
    values = list(kept.values()) if form == "dict" else list(kept)
    assert [v.shape[0] for v in values] == [5, 5]
    assert all(bool(torch.isfinite(v).all()) for v in values)


class _NormEmb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 6, bias=False)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.normalize(self.fc(x), dim=1, eps=0.0))


class _PaddedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.o = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.o(self.att(x, x, x, key_padding_mask=pad)[0].mean(1))


def test_the_epsilon_fix_reaches_the_op_inside_a_composite_torch_function():
    # F.normalize(eps=0) on a zero row: the division inside it
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    x[4] = 0
    d = nbdebug.diagnose(_NormEmb(), x, y, F.cross_entropy, progress=False)
    assert d.cause.kind == "epsilon" and d.cause.finite
    assert "F.normalize(self.fc(x), dim=1, eps=1e-06)" in d.results[0].snippet()
    # a fully padded sample in nn.MultiheadAttention: the softmax inside it, backward too
    xm, pad = torch.randn(3, 4, 8), torch.zeros(3, 4, dtype=torch.bool)
    pad[2] = True
    d = nbdebug.diagnose(
        _PaddedAttention(), (xm, pad), torch.tensor([0, 1, 0]), F.cross_entropy, progress=False
    )
    eps = next(r for r in d.results if r.kind == "epsilon")
    assert eps.finite and eps.outcome.backward and d.cause.kind == "epsilon"


# ---------------------------------------------------------------------- options, protocol
def test_keyword_options_and_an_options_value_are_the_same_call() -> None:
    model, x, y, opt = _live_norm()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'step'.*steps"):
        nbdebug.diagnose(model, x, y, F.cross_entropy, step=2)
    with pytest.raises(TypeError, match="options must be a DiagnoseOptions"):
        nbdebug.diagnose(model, x, y, F.cross_entropy, options={"steps": 2})
    opts = nbdebug.DiagnoseOptions(fixes=["drop_rows"], progress=False)
    a = nbdebug.diagnose(model, x, y, F.cross_entropy, optimizer=opt, options=opts)
    b = nbdebug.diagnose(
        model, x, y, F.cross_entropy, optimizer=opt, fixes=["drop_rows"], progress=False
    )
    assert list(a.to_frame()["kind"]) == list(b.to_frame()["kind"]) == ["drop_rows", "rerun"]
    assert a.cause.statement == b.cause.statement
    # a keyword given with options replaces that field
    c = nbdebug.diagnose(model, x, y, F.cross_entropy, options=opts, fixes=["epsilon"])
    assert set(c.to_frame()["kind"]) == {"epsilon", "rerun"}


def test_diagnosis_result_protocol() -> None:
    model, x, y, opt = _live_norm()
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, optimizer=opt, progress=False)
    assert d.summary() == d.cause.statement and not d.ok
    assert isinstance(d.cause.kind, nbdebug.core.vocab.FixKind)
    # the other fixes that work are named by their own action phrase
    assert "as does dropping batch row 3" in d.summary()
    healthy = nbdebug.diagnose(
        MLP(), torch.randn(8, 8), torch.randint(0, 3, (8,)), F.cross_entropy, progress=False
    )
    assert healthy.ok and "nothing to fix" in healthy.summary()


def test_each_fix_states_its_action() -> None:
    from nbdebug.analysis.diagnose import NotReproducible

    assert DropRowsFix([1, 2]).action() == "dropping batch rows 1, 2"
    assert Float32Fix("fc").action() == "running fc in float32 instead of half precision"
    assert nbdebug.ClipGradFix(2.0).action().startswith("clipping the gradient norm to 2")
    assert nbdebug.LowerLRFix(0.1).action() == "a learning rate x0.1 for the update"
    assert EpsilonFix("norm", "div").action() == EpsilonFix("norm", "div").describe()
    assert NotReproducible().action() == NotReproducible().describe()
