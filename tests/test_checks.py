"""Health checks: every code fires on a small model or state built to trigger it and stays
quiet on one that does not; healthy models give no error or warning; the public NaN
scenarios get their cause as the top finding; odd models never raise; nothing the
checks look at is changed; the guard records findings before the NaN; the Checks panel."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import by_name, scenarios
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug import NaNGuard
from nbdebug.analysis.checks import Findings, parse_checks
from nbdebug.analysis.checks import base as cb
from nbdebug.core.snapshot import load_snapshot


def _codes(findings: Findings, severity: tuple[str, ...] = ("error", "warning")) -> list[str]:
    return [f.code for f in findings if f.severity in severity]


def _serious(findings: Findings) -> list[Any]:
    return [f for f in findings if f.severity in ("error", "warning")]


def _mlp(n_in: int = 4, n_out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, 16), nn.ReLU(), nn.Linear(16, n_out))


# --------------------------------------------------------------------------- scenarios
EXPECTED_TOP = {
    # scenario: (code, module, param, rows, where-substring)
    "nan_in_batch": ("nonfinite_input", None, None, [3], "row 3"),
    "zero_over_zero_norm": ("division_by_zero", "0", None, [2, 4], "Normalize"),
    "exp_overflow": ("exp_overflow_risk", "1", None, [1], "ExpScore"),
    "fp16_linear_overflow": ("fp16_overflow_risk", "0", None, [2], "Linear"),
    "log_zero_in_loss": ("log_of_nonpositive", "", None, [1], "the loss"),
    "sqrt_zero_backward": ("log_of_nonpositive", "2", None, [3], "SqrtLayer"),
    "where_sqrt_negative": ("log_of_nonpositive", "1", None, [1], "SafeSqrt"),
    "param_grad_only": ("log_of_nonpositive", "1", "1.w", None, "SqrtGate"),
    "deep_nested": ("division_by_zero", "1.1.1", None, list(range(7)), "Normalize"),
    "parent_code": ("division_by_zero", "", None, [0, 1, 2], "<model>"),
    "dict_batch_own_loss": ("nonfinite_input", None, None, [5], "row 5"),
    "corrupted_weight": ("nonfinite_weight", "2", "2.weight", None, "2.weight"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_TOP))
def test_the_top_finding_names_the_cause_of_each_scenario(name: str) -> None:
    s = by_name(name)
    tr = nbdebug.trace(s.model, s.inputs, s.target, s.loss_fn)
    findings = nbdebug.check(tr, inputs=s.inputs, target=s.target, loss_fn=s.loss_fn)
    code, module, param, rows, where = EXPECTED_TOP[name]
    top = findings[0]
    assert top.severity == "error", findings
    assert top.code == code, findings
    assert where in top.where
    assert tr.origin is not None and top.event == tr.origin.index  # the UI jumps to the origin
    if module is not None:
        assert top.module == module
    if param is not None:
        assert top.param == param
    if rows is not None:
        assert top.rows == rows
    assert top.advice and top.evidence


def test_scenario_evidence_holds_the_numbers_and_the_threshold() -> None:
    s = by_name("exp_overflow")
    top = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)[0]
    # the input of ExpScore is the Identity's output: the batch with its 200.0
    assert top.evidence["input_absmax"] == 200.0
    assert top.evidence["threshold"] == pytest.approx(88.72, abs=0.01)
    assert top.evidence["op"] == "torch.exp"
    s = by_name("fp16_linear_overflow")
    top = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)[0]
    assert top.evidence["threshold"] == 65504.0 and top.evidence["n_inf"] == 4
    s = by_name("log_zero_in_loss")
    found = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)
    # the NaN came from the log of an underflowed softmax: the huge logits are the warning sign
    assert [f.code for f in found[:3]] == [
        "log_of_nonpositive",
        "nonfinite_gradient",
        "exp_overflow_risk",
    ]
    assert found[2].evidence["output_absmax"] == 1000.0


def test_healthy_scenario_and_symptoms_sort_after_causes() -> None:
    s = by_name("healthy")
    assert _serious(nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)) == []
    s = by_name("param_grad_only")
    found = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)
    # same event for the cause and the symptom: the cause first
    assert found[0].code == "log_of_nonpositive" and found[1].code == "nonfinite_gradient"
    assert found[0].event == found[1].position
    assert found[1].evidence["1.w"] == {"nan": 0, "inf": 1}


# --------------------------------------------------------------------------- healthy suite
class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.enc = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(self.emb(x))
        a, _ = self.mha(h, h, h)
        return self.head(self.ln(h + a).mean(1))


def _healthy_suite() -> list[tuple[str, nn.Module, torch.Tensor, torch.Tensor, Any]]:
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    mlp = nn.Sequential(
        nn.Linear(20, 64),
        nn.LayerNorm(64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.Sigmoid(),
        nn.Linear(64, 3),
        nn.LogSoftmax(dim=1),
    )
    return [
        (
            "cnn_batchnorm",
            cnn,
            torch.randn(16, 3, 16, 16),
            torch.randint(0, 10, (16,)),
            F.cross_entropy,
        ),
        (
            "attention",
            _Attention(),
            torch.randint(0, 50, (8, 12)),
            torch.randint(0, 5, (8,)),
            F.cross_entropy,
        ),
        ("mlp_layernorm", mlp, torch.randn(32, 20), torch.randint(0, 3, (32,)), F.nll_loss),
    ]


@pytest.mark.parametrize("case", range(3), ids=["cnn_batchnorm", "attention", "mlp_layernorm"])
def test_healthy_models_give_no_error_or_warning(case: int) -> None:
    _, model, x, y, loss_fn = _healthy_suite()[case]
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(3):  # a few real steps: optimizer state exists
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    found = nbdebug.check((model, x), target=y, loss_fn=loss_fn, optimizer=opt)
    assert _serious(found) == [], found
    assert isinstance(found, list) and all(f.severity == "info" for f in found)


def test_a_healthy_guarded_run_records_no_warning(tmp_path) -> None:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    xs, ys = torch.tensor(X[:640] / 16.0, dtype=torch.float32), torch.tensor(y[:640])
    model = nn.Sequential(
        nn.Linear(64, 64),
        nn.LayerNorm(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.Tanh(),
        nn.Linear(64, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=120)
    guard = NaNGuard(
        model, opt, scheduler=sched, directory=tmp_path, checks={"every": 5, "clip_norm": 5.0}
    )
    for step in range(120):
        i = slice((step % 20) * 32, (step % 20 + 1) * 32)
        loss = F.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        assert guard.check(loss, step=step)
        opt.step()
        opt.zero_grad()
        sched.step()
    checked = [r for r in guard.history if "checks" in r]
    assert len(checked) == 24 and all(
        "adam" in r for r in checked[1:]
    )  # no Adam state before step 1
    recorded = [(r["step"], c["code"], c["severity"]) for r in checked for c in r["checks"]]
    assert all(sev == "info" for _, _, sev in recorded), recorded
    # information is recorded once: the one-cycle peak (a schedule boundary) and a clip
    # at 5.0 that never engaged (from the first check with 20 rows)
    assert sorted((s, c) for s, c, _ in recorded) == [
        (20, "grad_clip_never_on"),
        (40, "lr_schedule_boundary"),
    ]


# --------------------------------------------------------------------------- data
def test_nonfinite_input_rows() -> None:
    x = torch.randn(6, 4)
    x[1, 2] = float("nan")
    x[4, 0] = float("-inf")
    f = nbdebug.check((_mlp(), x), target=torch.randint(0, 3, (6,)), loss_fn=F.cross_entropy).of(
        "nonfinite_input"
    )
    assert (
        len(f) == 1
        and f[0].rows == [1, 4]
        and f[0].evidence["n_nan"] == 1
        and f[0].evidence["n_inf"] == 1
    )
    assert (
        nbdebug.check(
            (_mlp(), torch.randn(6, 4)), target=torch.randint(0, 3, (6,)), loss_fn=F.cross_entropy
        ).of("nonfinite_input")
        == []
    )


def test_label_out_of_range_is_found_before_the_loss_crashes() -> None:
    x = torch.randn(8, 4)
    y = torch.tensor([0, 1, 2, 3, 0, 1, -1, 2])
    found = nbdebug.check((_mlp(), x), target=y, loss_fn=F.cross_entropy)
    assert found[0].code == "label_out_of_range" and found[0].rows == [3, 6]
    assert found[0].evidence["bad_labels"] == [-1, 3] and found[0].evidence["n_classes"] == 3
    assert "trace_error" in found.codes()  # the loss did crash; the label is named first
    ok = torch.tensor([0, 1, 2, 2, 0, 1, -100, 2])  # ignore_index of cross_entropy
    assert (
        nbdebug.check((_mlp(), x), target=ok, loss_fn=F.cross_entropy).of("label_out_of_range")
        == []
    )
    ignore5 = nn.CrossEntropyLoss(ignore_index=5)
    assert (
        nbdebug.check(
            (_mlp(), x), target=torch.tensor([0, 1, 2, 5, 0, 1, 1, 2]), loss_fn=ignore5
        ).of("label_out_of_range")
        == []
    )
    # binary targets
    m = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    bad = torch.tensor([[0.0], [1.0], [1.5], [0.0], [1.0], [0.2], [0.0], [-0.1]])
    f = nbdebug.check((m, x), target=bad, loss_fn=F.binary_cross_entropy).of("label_out_of_range")
    assert len(f) == 1 and f[0].rows == [2, 7]
    assert (
        nbdebug.check((m, x), target=bad.clamp(0, 1), loss_fn=F.binary_cross_entropy).of(
            "label_out_of_range"
        )
        == []
    )


def test_labels_checked_before_tracing_off_the_cpu() -> None:
    from nbdebug.analysis.checks.data import labels_before_trace

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 3, 0, 1, 2, 0])
    before = fingerprint(model)
    f = labels_before_trace(model, x, y, F.cross_entropy, on_cpu=True)
    assert_unchanged(before, model)  # the forward it ran left BatchNorm's statistics alone
    assert [(g.code, g.rows) for g in f] == [("label_out_of_range", [3])]
    assert labels_before_trace(model, x, y, F.cross_entropy) == []  # CPU: left to the trace
    assert labels_before_trace(model, x, y.clamp(max=2), F.cross_entropy, on_cpu=True) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_out_of_range_labels_on_cuda_do_not_break_the_context() -> None:
    model = _mlp().cuda()
    x, y = torch.randn(8, 4, device="cuda"), torch.tensor([0, 1, 2, 3, 0, 1, 2, 0], device="cuda")
    found = nbdebug.check((model, x), target=y, loss_fn=F.cross_entropy)
    assert found[0].code == "label_out_of_range" and found[0].rows == [3]
    assert "trace_error" not in found.codes()
    ok = nbdebug.check((model, x), target=y.clamp(max=2), loss_fn=F.cross_entropy)
    assert _serious(ok) == []  # the context still works
    s = by_name("log_zero_in_loss")
    tr_model = s.model.cuda()
    top = nbdebug.check((tr_model, s.inputs.cuda()), target=s.target.cuda(), loss_fn=s.loss_fn)[0]
    assert top.code == "log_of_nonpositive" and top.rows == [1]


def test_label_out_of_range_in_a_dict_batch() -> None:
    s = by_name("dict_batch_own_loss")
    inputs = {"x": torch.randn(6, 4), "labels": torch.tensor([0, 1, 7, 0, 1, 2])}
    f = nbdebug.check((s.model, inputs)).of("label_out_of_range")
    assert len(f) == 1 and f[0].rows == [2] and f[0].evidence["n_classes"] == 3
    inputs["labels"] = torch.tensor([0, 1, 2, 0, 1, 2])
    assert nbdebug.check((s.model, inputs)).of("label_out_of_range") == []


def test_constant_feature() -> None:
    x = torch.randn(16, 5)
    x[:, 2] = 3.0
    y = torch.randint(0, 3, (16,))
    f = nbdebug.check((_mlp(5), x), target=y, loss_fn=F.cross_entropy).of("constant_feature")
    assert len(f) == 1 and f[0].severity == "warning"
    assert f[0].evidence["features"] == [2] and f[0].evidence["values"] == [3.0]
    assert "1 of 5 features does not vary across the 16 rows: a standardisation divides it" in (
        f[0].message
    )
    x[:, 4] = 1.0
    two = nbdebug.check((_mlp(5), x), target=y, loss_fn=F.cross_entropy).of("constant_feature")
    assert "2 of 5 features do not vary across the 16 rows: a standardisation divides them" in (
        two[0].message
    )
    assert (
        nbdebug.check((_mlp(5), torch.randn(16, 5)), target=y, loss_fn=F.cross_entropy).of(
            "constant_feature"
        )
        == []
    )
    # images: per channel
    img = torch.randn(8, 3, 4, 4)
    img[:, 1] = 0.0
    f = nbdebug.check(
        (nn.Sequential(nn.Flatten(), nn.Linear(48, 2)), img), loss_fn=lambda o: o.mean()
    ).of("constant_feature")
    assert f and f[0].evidence["features"] == [1] and "channels" in f[0].where
    # fewer rows than CONSTANT_MIN_ROWS: not judged, and said so
    few = nbdebug.check((_mlp(5), x[:4]), target=y[:4], loss_fn=F.cross_entropy)
    assert few.of("constant_feature") == []
    assert any("constant_feature" in s.where for s in few.of("check_skipped"))


def test_unscaled_input() -> None:
    y = torch.randint(0, 3, (8,))
    f = nbdebug.check((_mlp(), torch.randn(8, 4) * 1e5), target=y, loss_fn=F.cross_entropy).of(
        "unscaled_input"
    )
    assert len(f) == 1 and f[0].evidence["range"] > cb.UNSCALED_RANGE
    assert (
        nbdebug.check((_mlp(), torch.randn(8, 4) * 100), target=y, loss_fn=F.cross_entropy).of(
            "unscaled_input"
        )
        == []
    )


# --------------------------------------------------------------------------- forward
def test_exp_overflow_risk_at_softmax_and_in_a_hand_written_loss() -> None:
    lin = nn.Linear(4, 6)
    with torch.no_grad():
        lin.weight.mul_(200.0)
    x = torch.randn(8, 4)
    model = nn.Sequential(lin, nn.Softmax(dim=1))
    f = nbdebug.check((model, x), loss_fn=lambda p: p[:, 0].mean()).of("exp_overflow_risk")
    assert len(f) == 1 and f[0].severity == "warning" and f[0].module == "1"
    assert f[0].evidence["input_absmax"] > cb.EXP_LIMIT["float32"]
    calm = nn.Sequential(nn.Linear(4, 6), nn.Softmax(dim=1))
    assert nbdebug.check((calm, x), loss_fn=lambda p: p[:, 0].mean()).of("exp_overflow_risk") == []

    def my_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (
            -(torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True))
            .log()
            .gather(1, y[:, None])
            .mean()
        )

    y = torch.randint(0, 6, (8,))
    f = nbdebug.check((lin, x), target=y, loss_fn=my_nll).of("exp_overflow_risk")
    assert f and f[0].where.startswith("the loss")
    # the same logits into the stable built-in: no risk
    assert [
        g
        for g in nbdebug.check((lin, x), target=y, loss_fn=F.cross_entropy).of("exp_overflow_risk")
        if g.severity != "info"
    ] == []


def test_fp16_overflow_risk_near_65504_and_under_a_scaler() -> None:
    lin = nn.Linear(4, 4).half()
    with torch.no_grad():
        lin.weight.fill_(10.0)
        lin.bias.zero_()
    x = torch.full((4, 4), 1000.0, dtype=torch.float16)  # 4 * 1000 * 10 = 40000 < 65504
    f = nbdebug.check((nn.Sequential(lin), x), loss_fn=lambda o: o.float().mean()).of(
        "fp16_overflow_risk"
    )
    assert len(f) == 1 and f[0].severity == "warning" and f[0].evidence["absmax"] == 40000.0
    assert (
        nbdebug.check((nn.Sequential(lin), x / 100), loss_fn=lambda o: o.float().mean()).of(
            "fp16_overflow_risk"
        )
        == []
    )
    big = nn.Linear(4, 4)
    with torch.no_grad():
        big.weight.fill_(10.0)
    x32 = torch.full((4, 4), 1000.0)
    scaler = torch.amp.GradScaler("cpu")
    assert nbdebug.check((big, x32), loss_fn=lambda o: o.mean()).of("fp16_overflow_risk") == []
    f = nbdebug.check((big, x32), loss_fn=lambda o: o.mean(), scaler=scaler).of(
        "fp16_overflow_risk"
    )
    assert len(f) == 1 and "autocast" in f[0].advice


def test_dead_relu() -> None:
    lin = nn.Linear(4, 32)
    with torch.no_grad():
        lin.bias.fill_(-100.0)
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(16, 4)
    f = nbdebug.check((model, x), loss_fn=lambda o: o.mean()).of("dead_relu")
    assert len(f) == 1 and f[0].module == "1" and f[0].evidence["zero_frac"] == 1.0
    assert nbdebug.check((_mlp(4, 1), x), loss_fn=lambda o: o.mean()).of("dead_relu") == []


@pytest.mark.parametrize(
    "act,bias", [(nn.Tanh, 0.0), (nn.Sigmoid, 0.0), (nn.Sigmoid, 30.0), (nn.Sigmoid, -30.0)]
)
def test_saturated_activation(act: type, bias: float) -> None:
    lin = nn.Linear(8, 64)
    with torch.no_grad():
        lin.weight.mul_(100.0)
        lin.bias.fill_(bias)
    x = torch.randn(32, 8)
    f = nbdebug.check(
        (nn.Sequential(lin, act(), nn.Linear(64, 1)), x), loss_fn=lambda o: o.mean()
    ).of("saturated_activation")
    assert len(f) == 1 and f[0].module == "1" and f[0].evidence["saturated_share_at_least"] > 0.5
    calm = nn.Sequential(nn.Linear(8, 64), act(), nn.Linear(64, 1))
    assert nbdebug.check((calm, x), loss_fn=lambda o: o.mean()).of("saturated_activation") == []


def test_saturated_share_is_a_lower_bound() -> None:
    # the estimate never exceeds the true share, on saturated and calm tanh/sigmoid layers
    torch.manual_seed(1)
    for act, fn in (
        (nn.Tanh, lambda y: (1 - y.abs()) <= 1e-3),
        (nn.Sigmoid, lambda y: (y <= 1e-3) | (y >= 1 - 1e-3)),
    ):
        for scale in (0.5, 3.0, 10.0, 100.0):
            lin = nn.Linear(8, 64)
            with torch.no_grad():
                lin.weight.mul_(scale)
            model = nn.Sequential(lin, act())
            x = torch.randn(32, 8)
            truth = float(fn(model(x)).float().mean())
            tr = nbdebug.trace(model, x, loss_fn=lambda o: o.mean())
            from nbdebug.analysis.checks.forward import saturated_share

            view = cb.TraceView(tr)
            ev = tr.events_of("1", "forward")[0]
            est = saturated_share(act.__name__, ev, view.input_of(ev))
            # a bound up to the sampling of the histograms (1,024 of 2,048 elements here)
            assert est is not None and est <= truth + 0.02, (act, scale, est, truth)
            if scale == 100.0:
                assert est > 0.5 * truth


def test_log_of_nonpositive_probabilities_into_bce() -> None:
    lin = nn.Linear(4, 1)
    with torch.no_grad():
        lin.bias.fill_(50.0)  # sigmoid(50) == 1.0 exactly in float32
    model = nn.Sequential(lin, nn.Sigmoid())
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8, 1)).float()
    f = nbdebug.check((model, x), target=y, loss_fn=F.binary_cross_entropy).of("log_of_nonpositive")
    assert len(f) == 1 and f[0].severity == "warning" and f[0].evidence["output_max"] == 1.0
    calm = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    assert (
        nbdebug.check((calm, x), target=y, loss_fn=F.binary_cross_entropy).of("log_of_nonpositive")
        == []
    )


def test_division_by_zero_and_nonfinite_origin_in_the_forward() -> None:
    s = by_name("zero_over_zero_norm")
    f = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn).of(
        "division_by_zero"
    )
    assert (
        len(f) == 1
        and f[0].evidence["op"] == "Tensor.div"
        and f[0].evidence["source"].startswith("models.py:")
    )

    class InfTimesZero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.tensor(float("inf")) * 0

    found = nbdebug.check(
        (nn.Sequential(nn.Linear(3, 3), InfTimesZero()), torch.randn(2, 3)),
        loss_fn=lambda o: o.mean(),
    )
    assert found[0].code == "nonfinite_origin" and found[0].module == "1"


# --------------------------------------------------------------------------- backward
def test_nonfinite_gradient_lists_the_parameters() -> None:
    s = by_name("where_sqrt_negative")
    f = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn).of(
        "nonfinite_gradient"
    )
    assert len(f) == 1 and f[0].evidence["n_params"] == 2
    assert set(f[0].evidence) >= {"0.weight", "0.bias"} and f[0].param in ("0.weight", "0.bias")
    healthy = nbdebug.check(
        (_mlp(), torch.randn(4, 4)), target=torch.tensor([0, 1, 2, 0]), loss_fn=F.cross_entropy
    )
    assert healthy.of("nonfinite_gradient") == []


def test_vanishing_and_exploding_gradient_ratios() -> None:
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    tiny = nbdebug.check((_mlp(), x), target=y, loss_fn=lambda o, t: 1e-9 * F.cross_entropy(o, t))
    vanish = tiny.of("vanishing_gradient")
    assert {f.param for f in vanish} == {"0.weight", "2.weight"}  # weights only, not biases
    assert all(f.evidence["ratio"] < cb.VANISHING_RATIO for f in vanish)
    huge = nbdebug.check((_mlp(), x), target=y, loss_fn=lambda o, t: 1e6 * F.cross_entropy(o, t))
    assert {f.param for f in huge.of("exploding_gradient")} == {"0.weight", "2.weight"}
    normal = nbdebug.check((_mlp(), x), target=y, loss_fn=F.cross_entropy)
    assert normal.of("vanishing_gradient") == normal.of("exploding_gradient") == []
    # the trace position of a parameter's gradient orders them (later layer first in the backward)
    assert [f.param for f in vanish] == ["2.weight", "0.weight"]


def test_exploding_gradient_against_the_history() -> None:
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    tr = nbdebug.trace(_mlp(), x, y, lambda o, t: 1e3 * F.cross_entropy(o, t))
    current = math.sqrt(sum(p.grad_norm**2 for p in tr.params if p.grad_norm is not None))
    history = [
        {"step": i, "grad_norm": current / 50 * (1 + 0.01 * i), "loss": 1.0} for i in range(20)
    ]
    f = [
        g
        for g in nbdebug.check(tr, history=history).of("exploding_gradient")
        if g.where == "total gradient norm"
    ]
    assert len(f) == 1 and f[0].evidence["factor"] > cb.EXPLODING_HISTORY_FACTOR
    calm = [{"step": i, "grad_norm": current, "loss": 1.0} for i in range(20)]
    assert [
        g
        for g in nbdebug.check(tr, history=calm).of("exploding_gradient")
        if g.where == "total gradient norm"
    ] == []
    short = calm[:3]  # fewer than HISTORY_MIN_ROWS rows: not judged
    assert [
        g
        for g in nbdebug.check(tr, history=[dict(r, grad_norm=1e-9) for r in short]).of(
            "exploding_gradient"
        )
        if g.where == "total gradient norm"
    ] == []


def test_unused_parameter_and_what_a_bare_trace_cannot_check() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 3)
            self.spare = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    tr = nbdebug.trace(Unused(), x, y, F.cross_entropy)
    found = nbdebug.check(tr)
    f = found.of("unused_parameter")
    assert (
        len(f) == 1
        and f[0].severity == "info"
        and f[0].evidence["params"] == ["spare.weight", "spare.bias"]
    )
    assert (
        nbdebug.check((_mlp(), x), target=y, loss_fn=F.cross_entropy).of("unused_parameter") == []
    )
    skipped = {c for g in found.of("check_skipped") for c in g.evidence["checks"]}
    # (the trace brings its batch: constant_feature runs, issue 33)
    assert {"adam_state_outlier", "lr_spike", "grad_scaler_collapse"} <= skipped
    assert "constant_feature" not in skipped


# --------------------------------------------------------------------------- optimizer and schedule
def test_adam_eps_too_small_for_float16() -> None:
    model = nn.Linear(4, 2).half()
    for eps, expect in ((1e-8, 1), (1e-4, 0)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
        model.weight.grad = torch.tensor([[1.0, 0.0, 1.0, 0.0]] * 2, dtype=torch.float16)
        model.bias.grad = torch.ones(2, dtype=torch.float16)
        opt.step()  # exp_avg_sq is exactly 0 where the gradient was 0
        guard = NaNGuard(model, opt, directory="unused")
        f = nbdebug.check(guard).of("adam_state_outlier")
        assert len(f) == expect
        if expect:
            assert (
                f[0].severity == "error"
                and f[0].param == "weight"
                and f[0].evidence["exp_avg_sq_zeros"] == 4
            )
        model.weight.grad = model.bias.grad = None


def test_adam_state_outlier_against_its_history() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    from nbdebug.analysis.checks.optim import adam_moments, optimizer_params

    now = adam_moments(optimizer_params(opt, model))
    assert set(now) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    steady: list[dict[str, Any]] = [
        {
            "step": i,
            "adam": {
                k: [m * (1 + 0.05 * (i % 3)), v * (1 + 0.05 * (i % 2))] for k, (m, v) in now.items()
            },
        }
        for i in range(10)
    ]
    tr = nbdebug.trace(model, x, y, F.cross_entropy)
    assert nbdebug.check(tr, optimizer=opt, history=steady).of("adam_state_outlier") == []
    spiked = [dict(r) for r in steady]
    for r in spiked:
        r["adam"] = {**r["adam"], "2.weight": [now["2.weight"][0], now["2.weight"][1] / 1e4]}
    f = nbdebug.check(tr, optimizer=opt, history=spiked).of("adam_state_outlier")
    assert [g.param for g in f] == ["2.weight"] and f[0].evidence["moment"] == "exp_avg_sq"
    assert f[0].evidence["z_log10"] > cb.ADAM_SIGMA


def _rows(lrs: list[float], losses: list[float] | None = None) -> list[dict[str, Any]]:
    losses = losses or [1.0] * len(lrs)
    return [
        {"step": i, "lr": lr, "loss": loss, "grad_norm": 1.0}
        for i, (lr, loss) in enumerate(zip(lrs, losses))
    ]


def test_lr_spike() -> None:
    tr = nbdebug.trace(_mlp(), torch.randn(4, 4), torch.tensor([0, 1, 2, 0]), F.cross_entropy)
    jump = _rows([1e-3] * 10 + [1e-1] * 10)
    f = nbdebug.check(tr, history=jump).of("lr_spike")
    assert len(f) == 1 and f[0].step == 10 and f[0].evidence["ratio"] == pytest.approx(100)
    warmup = _rows(
        [1e-3 * (i + 1) / 10 for i in range(10)] + [1e-3] * 10
    )  # from 1e-4: doubles once, grows
    assert nbdebug.check(tr, history=warmup).of("lr_spike") == []
    # the history as a DataFrame (guard.history_frame()) reads the same
    import pandas as pd

    f = nbdebug.check(tr, history=pd.DataFrame(jump)).of("lr_spike")
    assert len(f) == 1 and f[0].step == 10


def test_lr_schedule_boundary_info_or_warning() -> None:
    tr = nbdebug.trace(_mlp(), torch.randn(4, 4), torch.tensor([0, 1, 2, 0]), F.cross_entropy)
    warm = [1e-3 * (i + 1) / 20 for i in range(20)]
    decay = [1e-3 * 0.5 * (1 + math.cos(math.pi * i / 40)) for i in range(1, 41)]
    calm = nbdebug.check(tr, history=_rows(warm + decay)).of("lr_schedule_boundary")
    assert len(calm) == 1 and calm[0].severity == "info" and calm[0].step == 20
    assert calm[0].evidence["kind"] == "end of warm-up"
    losses = [1.0] * 20 + [1.0, 1.2, 2.5, 3.0] + [3.0] * 36
    bad = nbdebug.check(tr, history=_rows(warm + decay, losses)).of("lr_schedule_boundary")
    assert len(bad) == 1 and bad[0].severity == "warning" and bad[0].evidence["loss_rise"] == 3.0
    steps = nbdebug.check(tr, history=_rows([0.1] * 10 + [0.01] * 10 + [0.001] * 10)).of(
        "lr_schedule_boundary"
    )
    assert [(f.step, f.evidence["kind"]) for f in steps] == [(10, "step decay"), (20, "step decay")]
    assert nbdebug.check(tr, history=_rows([1e-3] * 30)).of("lr_schedule_boundary") == []


def test_grad_clip_always_and_never_on() -> None:
    tr = nbdebug.trace(_mlp(), torch.randn(4, 4), torch.tensor([0, 1, 2, 0]), F.cross_entropy)
    post_clip = [{"step": i, "grad_norm": 1.0} for i in range(30)]  # measured after clipping at 1.0
    f = nbdebug.check(tr, history=post_clip, clip_norm=1.0)
    assert [g.code for g in f if g.code.startswith("grad_clip")] == ["grad_clip_always_on"]
    assert f.of("grad_clip_always_on")[0].evidence["share_clipped"] == 1.0
    small = [{"step": i, "grad_norm": 0.1 + 0.01 * i} for i in range(30)]
    never = nbdebug.check(tr, history=small, clip_norm=10.0).of("grad_clip_never_on")
    assert (
        len(never) == 1
        and never[0].severity == "info"
        and never[0].evidence["max_grad_norm"] == pytest.approx(0.39)
    )
    mixed = [{"step": i, "grad_norm": 0.5 if i % 2 else 2.0} for i in range(30)]
    assert [
        g for g in nbdebug.check(tr, history=mixed, clip_norm=1.0) if g.code.startswith("grad_clip")
    ] == []
    # the max_norm can come from the history rows too
    rows = [dict(r, clip_norm=1.0) for r in post_clip]
    assert nbdebug.check(tr, history=rows).of("grad_clip_always_on")


def test_grad_scaler_collapse() -> None:
    tr = nbdebug.trace(_mlp(), torch.randn(4, 4), torch.tensor([0, 1, 2, 0]), F.cross_entropy)
    falling = [
        {"step": i, "scale": 2.0 ** (16 - max(0, i - 10)), "skipped": i > 10, "grad_norm": 1.0}
        for i in range(18)
    ]
    f = nbdebug.check(tr, history=falling).of("grad_scaler_collapse")
    assert len(f) == 1 and f[0].severity == "warning" and f[0].evidence["consecutive_falls"] == 7
    gone = [dict(r, scale=0.5) if r["step"] == 17 else r for r in falling]
    f = nbdebug.check(tr, history=gone).of("grad_scaler_collapse")
    assert f[0].severity == "error"
    stable = [
        {"step": i, "scale": 65536.0 if i < 3 else 32768.0, "skipped": i == 3, "grad_norm": 1.0}
        for i in range(30)
    ]
    assert nbdebug.check(tr, history=stable).of("grad_scaler_collapse") == []
    # a live scaler whose scale is already below 1, no history
    scaler = torch.amp.GradScaler("cpu", init_scale=0.25)
    f = nbdebug.check(tr, scaler=scaler).of("grad_scaler_collapse")
    assert len(f) == 1 and f[0].severity == "error" and f[0].evidence["scale"] == 0.25


# --------------------------------------------------------------------------- checkpoints
def test_state_dict_mismatch() -> None:
    model = _mlp()
    sd = {k: v.clone() for k, v in _mlp().state_dict().items()}
    assert nbdebug.check_state_dict(model, sd) == []
    bad = dict(sd)
    del bad["2.bias"]
    bad["extra.weight"] = torch.zeros(2)
    bad["0.weight"] = torch.zeros(8, 4)
    f = nbdebug.check_state_dict(model, bad)
    assert [g.code for g in f] == ["state_dict_mismatch"]
    ev = f[0].evidence
    assert ev["missing"] == ["2.bias"] and ev["unexpected"] == ["extra.weight"]
    assert ev["shapes"] == {"0.weight": [[8, 4], [16, 4]]}
    ddp = {f"module.{k}": v for k, v in sd.items()}
    f = nbdebug.check_state_dict(model, ddp)
    assert "module." in f[0].advice and "removeprefix('module.')" in f[0].fix
    with pytest.raises(TypeError, match="mapping"):
        nbdebug.check_state_dict(model, [1, 2])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        nbdebug.check_state_dict("model", sd)


def test_dtype_downcast_and_nonfinite_checkpoint() -> None:
    model = _mlp()
    half = {k: v.half() for k, v in model.state_dict().items()}
    f = nbdebug.check_state_dict(model, half)
    assert {g.code for g in f} == {"dtype_downcast"} and len(f) == 4
    w = f.of("dtype_downcast")
    g = next(x for x in w if x.param == "0.weight")
    absmax = float(model.state_dict()["0.weight"].abs().max())
    assert g.evidence["max_roundoff"] == pytest.approx(absmax * 2.0**-11, rel=1e-3)
    # the model holds the same weights at full precision: the actual error is within the bound
    assert 0 < g.evidence["max_abs_error_vs_model"] <= g.evidence["max_roundoff"] * 1.01
    same = {k: v.clone() for k, v in model.state_dict().items()}
    same["2.weight"][0, 0] = float("nan")
    same["2.weight"][0, 1] = float("inf")
    f = nbdebug.check_state_dict(model, same)
    assert [(x.code, x.param) for x in f] == [("nonfinite_weight", "2.weight")]
    # the evidence keys of a live weight's finding: NaN and Inf counted apart
    assert {k: f[0].evidence[k] for k in ("n_nan", "n_inf")} == {"n_nan": 1, "n_inf": 1}


# --------------------------------------------------------------------------- odd models, bad input
class _IntBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("idx", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx: torch.Tensor = self.idx  # type: ignore[assignment]
        return self.fc(x[:, idx])


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.cfloat) @ self.w).abs()


def _frozen() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    m[0].requires_grad_(False)
    return m


ODD = {
    "no_parameters_no_loss": (
        lambda: nn.Softmax(dim=1),
        lambda: torch.randn(8, 4),
        None,
        None,
        "no parameters",
    ),
    "no_parameters": (
        lambda: nn.ReLU(),
        lambda: torch.randn(8, 4),
        None,
        lambda o: o.sum(),
        "no parameters",
    ),
    "frozen_layer": (
        _frozen,
        lambda: torch.randn(8, 4),
        torch.tensor([0, 1] * 4),
        F.cross_entropy,
        "frozen",
    ),
    "all_frozen": (
        lambda: nn.Linear(4, 2).requires_grad_(False),
        lambda: torch.randn(8, 4),
        torch.tensor([0, 1] * 4),
        F.cross_entropy,
        "frozen",
    ),
    "integer_buffers": (
        _IntBuffers,
        lambda: torch.randn(8, 4),
        torch.tensor([0, 1] * 4),
        F.cross_entropy,
        None,
    ),
    "complex_params": (_Complex, lambda: torch.randn(8, 4), None, lambda o: o.mean(), None),
    "complex_input": (
        nn.Identity,
        lambda: torch.randn(8, 4, dtype=torch.cfloat),
        None,
        lambda o: o.abs().sum(),
        "complex",
    ),
    "token_ids": (
        lambda: nn.Embedding(10, 3),
        lambda: torch.randint(0, 10, (8, 5)),
        None,
        lambda o: o.sum(),
        "no floating input",
    ),
    "tuple_output_no_loss": (
        lambda: nn.LSTM(4, 3, batch_first=True),
        lambda: torch.randn(8, 5, 4),
        None,
        None,
        "no loss",
    ),
    "model_raises": (
        lambda: nn.Linear(5, 3),
        lambda: torch.randn(8, 4),
        None,
        lambda o: o.sum(),
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_models_never_raise_and_say_what_was_skipped(name: str) -> None:
    build, batch, target, loss_fn, why = ODD[name]
    model, x = build(), batch()
    before = fingerprint(model)
    found = nbdebug.check((model, x), target=target, loss_fn=loss_fn)
    assert_unchanged(before, model)
    assert isinstance(found, Findings)
    if why is not None:
        assert any(why in f.advice for f in found if f.severity == "info"), found
    if name == "model_raises":
        assert found.codes("error") == ["trace_error"]
        assert "mat1 and mat2" in found[0].evidence["message"]
    else:
        assert _serious(found) == [], found


def test_bad_input_raises_one_clear_sentence() -> None:
    with pytest.raises(TypeError, match="source must be a Trace, a Snapshot"):
        nbdebug.check(42)
    with pytest.raises(ValueError, match="needs the batch"):
        nbdebug.check(_mlp())
    with pytest.raises(TypeError, match="optimizer must be"):
        nbdebug.check((_mlp(), torch.randn(2, 4)), loss_fn=lambda o: o.sum(), optimizer="adam")
    with pytest.raises(TypeError, match="history must be"):
        nbdebug.check((_mlp(), torch.randn(2, 4)), loss_fn=lambda o: o.sum(), history="steps")
    with pytest.raises(ValueError, match="empty"):
        nbdebug.check((_mlp(), torch.empty(0, 4)))
    with pytest.raises(ValueError, match="target was given twice"):
        nbdebug.check(
            (_mlp(), torch.randn(2, 4), torch.tensor([0, 1])), target=torch.tensor([0, 1])
        )
    bad: Any
    for bad in (-3, "often", 2.5, {"every": 0}, {"evry": 5}, {"clip_norm": -1.0}):
        with pytest.raises(ValueError, match="checks"):
            NaNGuard(_mlp(), directory="unused", checks=bad)
    for clip in (-1.0, 0.0, float("nan"), float("inf"), True, "1.0"):
        with pytest.raises(ValueError, match=r"clip_norm must be a positive finite number"):
            nbdebug.check((_mlp(), torch.randn(2, 4)), loss_fn=lambda o: o.sum(), clip_norm=clip)
        with pytest.raises(ValueError, match=r"checks\['clip_norm'\] must be a positive finite"):
            NaNGuard(_mlp(), directory="unused", checks={"clip_norm": clip})


# --------------------------------------------------------------------------- nothing changes
@pytest.mark.parametrize("name", [s.name for s in scenarios()])
def test_check_changes_nothing(name: str) -> None:
    s = by_name(name)
    opt = torch.optim.Adam(s.model.parameters(), 1e-3)
    before = fingerprint(s.model)
    opt_before = {k: v for k, v in opt.state_dict().items()}
    inputs_before = [t.clone() for t in _tensors(s.inputs)]
    nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn, optimizer=opt)
    assert_unchanged(before, s.model)
    assert opt.state_dict()["param_groups"] == opt_before["param_groups"] and not opt.state
    for a, b in zip(inputs_before, _tensors(s.inputs)):
        assert torch.allclose(a, b, equal_nan=True, rtol=0, atol=0) and b.grad is None


def test_guard_checks_change_nothing_but_the_history() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(8, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    model(x).pow(2).mean().backward()  # fresh .grad for the checks to read
    guard = NaNGuard(model, opt, directory="unused", checks=1)
    before = fingerprint(model)
    w0 = model.get_parameter("0.weight")
    state = {k: v.clone() for k, v in opt.state[w0].items()}
    assert guard.check(torch.tensor(1.0), step=0)
    assert_unchanged(before, model)
    assert all(torch.equal(state[k], opt.state[w0][k]) for k in state)
    assert guard.history[-1]["checks"] == [] and set(guard.history[-1]["adam"]) == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "3.weight",
        "3.bias",
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    from nbdebug.core.batch import named_tensors

    return [t for _, t in named_tensors(obj)]


# --------------------------------------------------------------------------- guard and snapshots
def test_guard_records_the_warning_signs_before_the_nan(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NaNGuard(model, opt, directory=tmp_path, checks=2, loss_fn=F.mse_loss, patience=None)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    nan_step = None
    for step in range(60):
        if step == 20:
            for g in opt.param_groups:
                g["lr"] = 1e4  # the cause
        xb, yb = x[(step % 4) * 16 : (step % 4 + 1) * 16], y[(step % 4) * 16 : (step % 4 + 1) * 16]
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        if guard.check(loss, inputs=xb, target=yb, step=step):
            opt.step()
        elif nan_step is None:
            nan_step = step
            break
    assert nan_step is not None and guard.snapshots
    recorded = {(c["code"], r["step"]) for r in guard.history for c in r.get("checks", [])}
    assert ("lr_spike", 20) in recorded
    assert any(code == "exploding_gradient" and step < nan_step for code, step in recorded)
    # the spike detector wrote a "spike" snapshot at step 21, right after the cause and
    # before the NaN; the NaN step's snapshot is the last
    kinds = [load_snapshot(p).kind for p in guard.snapshots]
    assert kinds[0] == "spike" and kinds[-1] != "spike", kinds
    snap = load_snapshot(
        guard.snapshots[-1],
        model=lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)),
    )
    found = nbdebug.check(snap)
    spike = found.of("lr_spike")
    assert snap.step is not None and spike and spike[0].step == 20 < snap.step
    # the replayed step is checked too: the first non-finite value and its cause
    assert found[0].severity == "error"
    assert any(
        f.step is not None and f.step < snap.step and f.code == "exploding_gradient" for f in found
    )


def test_check_of_a_snapshot_without_a_model_still_reads_its_history(tmp_path) -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    guard = NaNGuard(model, opt, directory=tmp_path, on_nonfinite="continue", patience=None)
    for step in range(12):
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]))
        if step == 10:
            for g in opt.param_groups:
                g["lr"] = 1.0
        if step == 11:
            loss = loss * float("nan")
        loss.backward()
        guard.check(loss, step=step)
        opt.step()
    snap = load_snapshot(guard.snapshots[0])
    assert snap.model is None
    found = nbdebug.check(snap)
    assert found.of("lr_spike") and found.of("lr_spike")[0].step == 10
    assert any("without a model" in f.advice for f in found.of("check_skipped"))


def test_parse_checks() -> None:
    assert parse_checks(True) == {"every": cb.CHECK_EVERY, "clip_norm": None}
    assert parse_checks(7) == {"every": 7, "clip_norm": None}
    assert parse_checks({"clip_norm": 2}) == {"every": cb.CHECK_EVERY, "clip_norm": 2.0}
    assert parse_checks(False) is None and parse_checks(None) is None


def test_guard_without_checks_records_none() -> None:
    model = _mlp()
    model(torch.randn(2, 4)).sum().backward()
    guard = NaNGuard(model, directory="unused")
    guard.check(torch.tensor(1.0))
    assert "checks" not in guard.history[-1]


# --------------------------------------------------------------------------- results
def test_findings_table_and_round_trip() -> None:
    s = by_name("log_zero_in_loss")
    found = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)
    df = found.to_frame()
    assert list(df["code"]) == [f.code for f in found] and df["severity"].iloc[0] == "error"
    assert found.counts["error"] == 2 and found.counts["warning"] == 1
    for f in found:
        d = f.to_dict()
        back = cb.Finding.from_dict(d)
        assert (back.code, back.severity, back.where, back.event, back.rows, back.param) == (
            f.code,
            f.severity,
            f.where,
            f.event,
            f.rows,
            f.param,
        )
    assert "log_of_nonpositive" in repr(found) and "2 errors" in repr(found)
    with pytest.raises(ValueError, match="severity"):
        cb.Finding("x", "fatal", "here", {}, "")


# --------------------------------------------------------------------------- the panel
def test_checks_panel_click_calls_on_select() -> None:
    import ipywidgets as widgets

    from nbdebug.widgets.checks import ChecksPanel

    s = by_name("log_zero_in_loss")
    found = nbdebug.check((s.model, s.inputs), target=s.target, loss_fn=s.loss_fn)
    got: list[Any] = []
    panel = ChecksPanel(found, on_select=got.append)
    assert isinstance(panel.widget, widgets.VBox)
    assert panel.summary == "2 errors, 1 warning"
    assert "2 errors, 1 warning" in panel.header.value
    assert len(panel.buttons) == len(found)
    assert panel.buttons[0].button_style == "danger" and panel.buttons[2].button_style == "warning"
    panel.buttons[2].click()
    assert got == [found[2]] and panel.selected is found[2]
    assert "exp_overflow_risk" in panel.detail.value and "88.72" in panel.detail.value
    panel.buttons[0].click()
    assert got[-1].code == "log_of_nonpositive" and got[-1].event == found[0].event
    assert "torch.log(x.clamp_min(1e-12))" in panel.detail.value  # the fix snippet
    # groups: a badge per severity, errors first
    texts = [c.value for c in panel.groups.children if isinstance(c, widgets.HTML)]
    assert ["2 error" in texts[0], "1 warning" in texts[1]] == [True, True]
    # another list; bad input
    panel.update([f for f in found if f.severity == "info"])
    assert panel.summary == "no errors or warnings" and panel.selected is None
    with pytest.raises(TypeError, match="list of Finding"):
        panel.update(found[0])
    with pytest.raises(TypeError, match="on_select"):
        ChecksPanel(found, on_select="jump")  # type: ignore[arg-type]
    assert "ChecksPanel(no errors or warnings" in repr(panel)


# --------------------------------------------------------------------------- structure
def test_ratio_verdict_is_the_one_judgement_of_the_layers_tab_and_the_checks() -> None:
    from nbdebug.analysis.checks.grad import ratio_verdict

    v, e = cb.VANISHING_RATIO, cb.EXPLODING_RATIO
    assert [ratio_verdict(r) for r in (0.0, v / 2, v, 1.0, e, e * 2, math.inf)] == [
        "vanishing",
        "vanishing",
        "ok",
        "ok",
        "ok",
        "exploding",
        "exploding",
    ]
    assert ratio_verdict(None) == ratio_verdict(math.nan) == "unknown"
    # the Layers table marks, and the checks report, the same parameters
    import pandas as pd

    from nbdebug.analysis.checks.grad import grad_findings
    from nbdebug.core.trace.events import ParamInfo
    from nbdebug.widgets.layers import params_table_html

    ratios = {"a.weight": v / 10, "b.weight": v * 10, "c.weight": e * 10, "d.weight": e}
    params = [
        ParamInfo(
            name=n,
            module=n.split(".")[0],
            shape=(4, 4),
            dtype="float32",
            requires_grad=True,
            norm=1.0,
            grad_norm=r,
            n_nan=0,
            n_inf=0,
            grad_n_nan=0,
            grad_n_inf=0,
        )
        for n, r in ratios.items()
    ]
    flagged = {f.param: f.code for f in grad_findings(params)}
    assert flagged == {"a.weight": "vanishing_gradient", "c.weight": "exploding_gradient"}
    frame = pd.DataFrame(
        {"ratio": list(ratios.values()), "n_nan": 0, "n_inf": 0, "grad_n_nan": 0, "grad_n_inf": 0},
        index=list(ratios),
    )
    for c in ("module", "shape", "dtype", "norm", "grad_norm"):
        frame[c] = None
    rows = params_table_html(frame).split("<tr class=")[1:]
    marked = {n for n, row in zip(ratios, rows) if row.startswith("'nbdebug-warn")}
    assert marked == set(flagged)


def test_a_family_runs_when_its_needs_are_there_and_is_named_skipped_otherwise() -> None:
    ran: list[str] = []

    def fam(code: str) -> Any:
        def run(ctx: Any) -> list[cb.Finding]:
            ran.append(code)
            return [cb.Finding(code, "warning", "here", {}, "advice")]

        return run

    families = [
        cb.CheckFamily(("needs_nothing",), (), fam("needs_nothing")),
        cb.CheckFamily(("needs_opt",), ("optimizer",), fam("needs_opt")),
        cb.CheckFamily(("needs_hist",), ("history",), fam("needs_hist")),
        cb.CheckFamily(("also_hist",), ("history",), fam("x"), fallback=fam("fallback")),
    ]
    ctx = cb.CheckContext(missing={"history": "the run kept none"})
    found = cb.run_families(ctx, families)
    assert ran == ["needs_nothing", "fallback"]
    skips = {tuple(f.evidence["checks"]): f.advice for f in found if f.code == "check_skipped"}
    assert skips == {
        ("needs_opt",): "not checked: no optimizer (pass optimizer=).",
        ("needs_hist", "also_hist"): "not checked: the run kept none.",
    }
    ran.clear()
    ctx = cb.CheckContext(optimizer_params=[], history=[{"step": 0}])
    assert [f.code for f in cb.run_families(ctx, families)] == [
        "needs_nothing",
        "needs_opt",
        "needs_hist",
        "x",
    ]
    with pytest.raises(ValueError, match="unknown check needs"):
        cb.CheckFamily(("c",), ("gpu",), fam("c"))


def test_every_code_of_the_table_belongs_to_a_family() -> None:
    from nbdebug.analysis.checks import FAMILIES
    from nbdebug.analysis.checks.codes import rst_table

    table = rst_table(indent="")  # the table of check()'s docstring (tested fresh below)

    declared = {c for f in FAMILIES for c in f.codes}
    documented = {
        line.split()[0]
        for line in (table or "").splitlines()
        if line[:1].isalpha() and line.split()[0].islower() and "_" in line.split()[0]
    }
    # made outside the families: by resolution, check_state_dict, or the skip itself
    others = {"trace_error", "state_dict_mismatch", "dtype_downcast", "check_skipped"}
    assert documented - others <= declared, (documented - others) - declared


def test_findings_sort_by_named_bands() -> None:
    p = cb.position
    assert p(cb.Band.TRACE, 3) == 3.0
    assert (
        p(cb.Band.TRACE, 10**6)
        < p(cb.Band.STEP)
        < p(cb.Band.TRACE_ERROR)
        < p(cb.Band.HISTORY, 10**6)
        < p(cb.Band.RECORDED, 0)
        < math.inf
    )
    recorded = cb.Finding("lr_spike", "warning", "step 3", {}, "", position=p(cb.Band.RECORDED, 3))
    schedule = cb.Finding("lr_spike", "warning", "step 9", {}, "", position=p(cb.Band.HISTORY, 9))
    event = cb.Finding("dead_relu", "warning", "m", {}, "", event=4)
    assert cb.sort_findings([recorded, schedule, event]) == [event, schedule, recorded]


def test_fp16_overflow_made_in_the_backward_is_named_as_such() -> None:
    # float16 autocast, no scaler: the forward stays finite (~46000 < 65504), the weight
    # gradient of layer 2 overflows in its float16 matmul and lands as inf in the float32
    # .grad; in float32 the same step is healthy
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        m[0].bias.fill_(40000.0)
    x, y = torch.randn(8, 8).abs() + 0.5, torch.randn(8, 4)

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(o.float(), t)

    assert nbdebug.trace(m, x, y, loss).healthy
    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(m, x, y, loss)
    o = tr.origin
    assert o is not None and (o.phase, o.module, o.dtype) == ("backward", "2", "float32")
    errors = [f for f in nbdebug.check(tr) if f.severity == "error"]
    assert [
        (f.code, f.module) for f in errors if f.code.endswith("origin") or "fp16" in f.code
    ] == [("fp16_overflow_risk", "2")]
    assert any("overflowed float16" in f.advice for f in errors)


class _MaskedAttention(nn.Module):
    """Additive -inf key mask, as attention takes it: the -inf is intended."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(4, 4)
        self.o = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2) + mask[:, None, :]
        return self.o((scores.softmax(-1) @ x).mean(1))


def test_an_intended_minus_inf_mask_in_the_batch_is_not_bad_data():
    model = _MaskedAttention()
    x, mask = torch.randn(3, 5, 4), torch.zeros(3, 5)
    mask[:, 4] = float("-inf")
    y = torch.tensor([0, 1, 0])
    tr = nbdebug.trace(model, (x, mask), y, F.cross_entropy)
    assert tr.origin is None and [tr.events[i].name for i in tr.mask_events] == ["inputs[1]"]
    codes = {f.code for f in nbdebug.check(tr)}
    assert "nonfinite_input" not in codes
    # a NaN in the same batch is bad data all the same
    x[1, 0, 0] = float("nan")
    bad = nbdebug.check(nbdebug.trace(model, (x, mask), y, F.cross_entropy))
    assert [f.rows for f in bad if f.code == "nonfinite_input"] == [[1]]


def test_the_partial_trace_of_a_step_that_raised_is_a_trace_error_in_the_checks_and_header():
    class Mismatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))  # 4 features into a 5-feature Linear

    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with pytest.raises(nbdebug.TraceError) as err:
        nbdebug.trace(Mismatch(), x, y, F.cross_entropy)
    assert err.value.trace is not None
    codes = [f.code for f in nbdebug.check(err.value.trace) if f.severity == "error"]
    assert codes == ["trace_error"]
    dbg = nbdebug.debug(Mismatch(), x, y, F.cross_entropy)  # the debugger's Checks tab
    assert "1 error" in dbg.header.value
    dbg.close()


def test_the_tables_of_codes_are_generated_from_the_one_table() -> None:
    """``docs/checks.md`` and the ``check()`` docstring show ``codes.CODES``: regenerate them
    with ``python -m nbdebug.analysis.checks.codes`` when this fails."""
    from pathlib import Path

    from nbdebug.analysis.checks import codes

    root = Path(__file__).resolve().parents[1]
    for path, kind in codes.doc_files(root).items():
        text = path.read_text()
        assert codes.generated(text, kind) == text, f"{path} is stale"
    assert {c.code for c in codes.CODES} == set(codes.CheckCode)
    assert "bf16_precision_loss" in (root / "docs" / "checks.md").read_text()
    declared = {c for f in nbdebug.analysis.checks.FAMILIES for c in f.codes}
    made_elsewhere = {codes.CheckGroup.CHECKPOINT, codes.CheckGroup.RUN}
    assert {c.code for c in codes.CODES if c.family not in made_elsewhere} <= declared


def test_a_finding_takes_the_codes_and_severities_of_the_table() -> None:
    from nbdebug.analysis.checks.codes import CheckCode

    f = cb.Finding("dead_relu", "warning", "m", {}, "")
    assert f.code is CheckCode.DEAD_RELU and f.code == "dead_relu"
    assert f.to_dict()["code"] == "dead_relu" and type(f.to_dict()["code"]) is str
    with pytest.raises(ValueError, match="dead_relu finding is warning"):
        cb.Finding("dead_relu", "error", "m", {}, "")
    found = Findings([f])
    assert not found.ok and found.summary().startswith("0 errors, 1 warning, 0 info: first")
    assert Findings().ok and Findings().summary() == "no findings."


def test_a_parameter_the_layers_plot_colours_red_is_one_the_checks_flag() -> None:
    """One eligibility rule (``param_verdict``): a bias or an embedding with an extreme
    ratio is neither flagged by the checks nor red in the Layers plot."""
    from nbdebug.figures.layers import ratio_figure
    from nbdebug.figures.palette import RED

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3), nn.Linear(3, 1))
    with torch.no_grad():
        model[2].weight.mul_(1e-6)  # tiny weight: huge grad/weight ratio (exploding)
        model[2].bias.mul_(1e-6)  # a 1-D bias with a huge ratio: not judged
        model[3].weight.mul_(1e-9)  # the gradient of model[2] becomes tiny as well
    x = torch.randint(0, 10, (5, 3))
    tr = nbdebug.trace(model, x, loss_fn=lambda o: o.sum())
    flagged = {
        f.param
        for f in nbdebug.check(tr)
        if f.code in ("vanishing_gradient", "exploding_gradient", "nonfinite_gradient")
    }
    bar = ratio_figure(tr).data[0]
    red = {n for n, c in zip(bar.x, bar.marker.color) if c == RED}
    assert red and red <= flagged, (red, flagged)
    assert "2.bias" not in red and "0.weight" not in red
