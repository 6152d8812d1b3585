"""Every consumer of a Trace reuses the step it recorded (``Trace.call``: model, batch,
target, loss function, autocast) instead of asking for them again (issue 33, item 2)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.core.snapshot.write import save_snapshot


def my_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A hand-written softmax loss: exp overflows float32 above 88.7."""
    p = torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True)
    return -p.log().gather(1, y[:, None]).mean()


def hot_logits() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Finite logits of about 80 (above half the float32 exp limit)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([80.0, 79.0, 78.0, 0.0, 0.0, 0.0]))
    x = torch.randn(8, 4)
    y = torch.randint(0, 6, (8,))
    return lin, x, y


def test_the_trace_keeps_its_call_as_references() -> None:
    lin, x, y = hot_logits()
    tr = nbdebug.trace(lin, x, y, my_nll)
    assert tr.call is not None
    assert tr.call.model is lin and tr.call.inputs is x and tr.call.target is y
    assert tr.call.loss_fn is my_nll
    assert tr.kept == {}  # no tensor copied for it
    assert "call" not in repr(tr)


def test_check_of_a_trace_reuses_its_loss_function() -> None:
    lin, x, y = hot_logits()
    tr = nbdebug.trace(lin, x, y, my_nll)
    assert tr.healthy
    found = nbdebug.check(tr).of("exp_overflow_risk")
    given = nbdebug.check(tr, loss_fn=my_nll).of("exp_overflow_risk")
    assert found and found[0].where.startswith("the loss")
    assert [f.where for f in found] == [f.where for f in given]
    # the stable built-in, recorded: no risk named
    stable = nbdebug.trace(lin, x, y, F.cross_entropy)
    assert [f for f in nbdebug.check(stable).of("exp_overflow_risk") if f.severity != "info"] == []


def test_check_of_a_trace_reuses_its_batch_and_target() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 3)
    x[:, 1] = 5.0  # a constant feature
    tr = nbdebug.trace(nn.Linear(3, 4), x, torch.randint(0, 4, (16,)), F.cross_entropy)
    assert nbdebug.check(tr).of("constant_feature")
    # a batch given wins over the recorded one
    assert nbdebug.check(tr, inputs=torch.randn(16, 3)).of("constant_feature") == []


def test_check_of_a_hand_built_trace_still_works() -> None:
    lin, x, y = hot_logits()
    tr = nbdebug.trace(lin, x, y, my_nll)
    tr.call = None  # as a Trace made by hand
    assert nbdebug.check(tr).of("exp_overflow_risk") == []


def test_the_debuggers_tabs_of_a_trace_reuse_its_call() -> None:
    lin, x, y = hot_logits()
    dbg = nbdebug.debug(nbdebug.trace(lin, x, y, my_nll))
    try:
        titles = list(dbg.tabs.titles)
        assert "Gradcheck" in titles and "Fixes" in titles
        checks = dbg.panel("Checks")
        assert any(f.code == "exp_overflow_risk" for f in checks.findings)
        grad = dbg.panel("Gradcheck")
        assert grad.model is lin
    finally:
        dbg.close()


def test_a_snapshot_replay_keeps_its_call(tmp_path: Path) -> None:
    lin, x, y = hot_logits()
    path = save_snapshot(tmp_path / "s.nbsnap", lin, x, y, step=3)
    snap = nbdebug.load_snapshot(path, model=nn.Linear(4, 6))
    tr = snap.trace(loss_fn=my_nll)
    assert tr.call is not None and tr.call.model is snap.model and tr.call.loss_fn is my_nll
    assert nbdebug.check(tr).of("exp_overflow_risk")
