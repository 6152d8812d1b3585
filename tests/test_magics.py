"""``%load_ext nbdebug`` and ``%nbdebug`` through a real IPython shell."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from IPython.core.interactiveshell import InteractiveShell
from ipywidgets.widgets import widget as ipw_widget
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug import magics


class LogNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.log(self.enc(x)))


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    torch.manual_seed(0)
    sh.user_ns.update(
        model=LogNet(),
        x=torch.randn(6, 8),
        y=torch.randint(0, 3, (6,)),
        my_loss=F.cross_entropy,
        data={"pair": (1, 2)},
        factory=LogNet,
    )
    sh.run_cell("%load_ext nbdebug")
    yield sh
    sh.run_cell("%unload_ext nbdebug")
    for k in ("model", "x", "y", "my_loss", "data", "factory", "snap", "net", "feats", "total"):
        sh.user_ns.pop(k, None)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_error_line(capsys) -> str:
    out = capsys.readouterr()
    # a terminal shell has no widget front end: a panel's repr ("VBox(...)") and the
    # clear-line codes of its plots' Output widgets reach stdout; they are not messages
    lines = [
        line
        for line in (out.err + out.out).splitlines()
        if _ANSI.sub("", line).strip() and "VBox(" not in line
    ]
    assert len(lines) == 1, lines
    assert "Traceback" not in out.err + out.out
    assert lines[0].startswith("nbdebug: ")
    return lines[0]


def test_load_registers_the_magic_and_opens_a_debugger(shell, capsys):
    assert "nbdebug" in shell.magics_manager.magics["line"]
    res = shell.run_cell("%nbdebug model x y --loss cross_entropy")
    assert res.success
    dbg = magics.open_debuggers()[-1]
    assert isinstance(dbg, nbdebug.Debugger)
    expected = nbdebug.trace(
        shell.user_ns["model"], shell.user_ns["x"], shell.user_ns["y"], F.cross_entropy
    )
    assert dbg.trace.summary() == expected.summary() and dbg.trace.origin.op == "torch.log"
    # --loss from the notebook's names
    shell.run_line_magic("nbdebug", "model x y --loss my_loss")
    assert magics.open_debuggers()[-1].trace.origin.module == expected.origin.module
    # a dotted name
    import types

    shell.user_ns["net"] = shell.user_ns["model"]
    shell.user_ns["feats"] = types.SimpleNamespace(h=torch.randn(4, 16))
    shell.user_ns["total"] = torch.sum
    capsys.readouterr()
    shell.run_line_magic("nbdebug", "net.head feats.h --loss total")
    assert "nbdebug: " not in capsys.readouterr().err
    dbg = magics.open_debuggers()[-1]
    assert dbg.trace.model_name == "Linear" and dbg.trace.healthy
    assert dbg.trace.events[0].shape == (4, 16)


def test_help_is_the_docstring(shell):
    fn = shell.find_line_magic("nbdebug")
    assert "%nbdebug model batch [target] [--loss NAME]" in fn.__doc__
    assert "NonFiniteError" in fn.__doc__


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("nope x y", "'nope' is not defined"),
        ("model nope", "'nope' (batch) is not defined"),
        ("model x y --loss nope", "--loss nope"),
        ("model", "batch is missing"),
        ("model x y --optim adam", "unknown option --optim"),
        ("data x", "expected a torch.nn.Module"),
        ("model x", "no loss"),  # a (6, 3) output without loss_fn: the trace's own ValueError
        ("missing/step-1.nbsnap", "no such file: missing/step-1.nbsnap"),
        ("step-1.nbsnap", "no such file"),
        ("'unclosed", "cannot parse"),
        ("cfg[0] x", "'cfg[0]' is neither a name from the notebook nor a snapshot path"),
        ("", "no NonFiniteError"),
    ],
)
def test_bad_lines_print_one_clear_line(shell, capsys, monkeypatch, line, needle):
    from nbdebug.core.guard import failure as guard

    monkeypatch.setattr(guard, "_last", None)  # no NonFiniteError in this session yet
    monkeypatch.delattr("sys.last_value", raising=False)
    monkeypatch.delattr("sys.last_exc", raising=False)
    n = len(magics.open_debuggers())
    capsys.readouterr()
    assert shell.run_line_magic("nbdebug", line) is None
    assert needle in one_error_line(capsys)
    assert len(magics.open_debuggers()) == n


def test_files_that_are_not_snapshots(shell, capsys, tmp_path):
    junk = tmp_path / "junk.nbsnap"
    junk.write_bytes(b"\x00\x01 not a snapshot at all")
    ckpt = tmp_path / "ckpt.pt"
    torch.save(LogNet().state_dict(), ckpt)
    for p in (junk, ckpt):
        shell.run_line_magic("nbdebug", f"{p} --model factory")
        line = one_error_line(capsys)
        assert line.count(str(p)) == 1  # the file named once
    shell.run_line_magic("nbdebug", str(tmp_path))
    assert "directory" in one_error_line(capsys)


def test_snapshot_path_and_snapshot_object(shell, tmp_path, capsys):
    m = LogNet()
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    history = [
        {"step": s, "loss": 1.0 / (s + 1), "grad_norm": 1.0 + s, "param_norm": 3.0, "lr": 0.1}
        for s in range(6)
    ]
    path = nbdebug.save_snapshot(
        tmp_path, m, x, y, step=6, reason="loss is nan", history=history, loss_fn=F.cross_entropy
    )
    shell.run_line_magic("nbdebug", f"{path} --model factory")
    dbg = magics.open_debuggers()[-1]
    assert list(dbg.tabs.titles) == ["Step", "Layers", "History", "Checks", "Fixes", "Gradcheck"]
    assert (
        dbg.history is not None and dbg.history.failing_step == 6 and len(dbg.history.history) == 6
    )
    assert dbg.trace.origin is not None and dbg.trace.origin.op == "torch.log"
    # without a model: one line that says how to give it
    shell.run_line_magic("nbdebug", str(path))
    assert one_error_line(capsys) == (
        f"nbdebug: {path} was loaded without a model: give --model NAME (a module, or a "
        "zero-argument factory, in the notebook's namespace)."
    )
    # a name holding a loaded Snapshot
    shell.user_ns["snap"] = nbdebug.load_snapshot(path, model=LogNet)
    shell.run_line_magic("nbdebug", "snap")
    assert magics.open_debuggers()[-1].trace.summary() == dbg.trace.summary()


def test_a_model_factory_that_raises_is_one_line_and_load_snapshot_says_where(
    shell, tmp_path, capsys
):
    path = nbdebug.save_snapshot(
        tmp_path, LogNet(), torch.randn(5, 8), torch.randint(0, 3, (5,)), step=1, reason="nan"
    )

    def broken():
        raise RuntimeError("factory boom")

    shell.user_ns["broken"] = broken
    shell.run_line_magic("nbdebug", f"{path} --model broken")
    assert one_error_line(capsys) == "nbdebug: --model broken failed: RuntimeError: factory boom"
    # the API keeps the factory's own error (its type and message), with a note saying where
    with pytest.raises(RuntimeError, match="factory boom") as info:
        nbdebug.load_snapshot(path, model=broken)
    notes = getattr(info.value, "__notes__", [])
    assert sys.version_info < (3, 11) or any("model factory" in n and "broken" in n for n in notes)


def test_relative_file_names_without_a_slash(shell, tmp_path, capsys, monkeypatch):
    # "crash.pt" reads like a dotted notebook name; a file of that name here is a path
    m = LogNet()
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    path = nbdebug.save_snapshot(tmp_path / "snaps", m, x, y, loss_fn=F.cross_entropy)
    monkeypatch.chdir(tmp_path)
    shutil.copy(path, "crash.pt")
    n = len(magics.open_debuggers())
    shell.run_line_magic("nbdebug", "crash.pt --model factory")
    assert len(magics.open_debuggers()) == n + 1
    capsys.readouterr()
    shell.run_line_magic("nbdebug", "snaps --model factory")  # a folder: per-rank files
    assert "the directory snaps holds no per-rank snapshots" in one_error_line(capsys)
    Path("notes.txt").write_text("not a snapshot")
    shell.run_line_magic("nbdebug", "notes.txt --model factory")
    line = one_error_line(capsys)
    assert "notes.txt" in line and "not defined" not in line
    shell.run_line_magic("nbdebug", "nothere.txt")
    assert "'nothere.txt' is not defined in the notebook nor a file or folder here" in (
        one_error_line(capsys)
    )


TRAIN = """
import nbdebug, torch
net = factory()
opt = torch.optim.SGD(net.parameters(), lr=0.01)
guard = nbdebug.NaNGuard(net, opt, directory=snapdir, on_nonfinite="raise", loss_fn=my_loss)
for step in range(6):
    xb, yb = torch.randn(4, 8), torch.randint(0, 3, (4,))
    if step < 3:
        xb = xb.abs() + 1  # log of positive pre-activations: finite while the weights allow it
        with torch.no_grad():
            net.enc.weight.abs_(); net.enc.bias.abs_()
    loss = my_loss(net(xb), yb)
    loss.backward()
    if guard.check(loss, inputs=xb, target=yb, step=step):
        opt.step()
    opt.zero_grad()
"""


def test_last_nonfinite_error_opens_its_snapshot(shell, tmp_path, capsys):
    shell.user_ns["snapdir"] = str(tmp_path)
    res = shell.run_cell(TRAIN)
    assert isinstance(res.error_in_exec, nbdebug.NonFiniteError)
    err = res.error_in_exec
    capsys.readouterr()
    shell.run_line_magic("nbdebug", "--model factory")
    dbg = magics.open_debuggers()[-1]
    assert dbg.history is not None and dbg.history.failing_step == err.step
    assert list(dbg.history.history["step"])[: err.step] == list(range(err.step))
    assert dbg.trace.origin is not None and dbg.trace.origin.op == "torch.log"
    assert f"step {err.step}" in dbg.header.value
    for k in ("snapdir", "net", "opt", "guard", "xb", "yb", "loss", "step"):
        shell.user_ns.pop(k, None)


def test_rerunning_a_cell_leaves_no_hooks_and_no_widgets(shell):
    import gc
    import weakref

    model = shell.user_ns["model"]
    before = fingerprint(model)
    counts, refs = [], []
    for _ in range(4):
        assert shell.run_cell("%nbdebug model x y --loss cross_entropy", cell_id="cell-1").success
        assert_unchanged(before, model)
        counts.append(len(ipw_widget._instances))
        refs.append(weakref.ref(magics.open_debuggers()[-1]))
        assert all(
            not m._forward_hooks
            and not m._backward_hooks
            and not m._forward_pre_hooks
            and not m._backward_pre_hooks
            for m in model.modules()
        )
    assert counts[1] == counts[2] == counts[3]
    assert len(magics.open_debuggers()) == 1
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True, False]  # the old debuggers are freed
    # outside Jupyter (no cell id) the same line replaces its own debugger too
    for _ in range(3):
        shell.run_line_magic("nbdebug", "model x y --loss cross_entropy")
    assert len(magics.open_debuggers()) == 2


def test_unload_removes_everything_and_reload_works(shell):
    before = len(ipw_widget._instances)
    pre = list(shell.events.callbacks["pre_run_cell"])
    post = list(shell.events.callbacks["post_run_cell"])
    shell.run_cell("%unload_ext nbdebug")
    assert "nbdebug" not in shell.magics_manager.magics["line"]
    assert not hasattr(shell.magics_manager.user_magics, "nbdebug")
    assert len(shell.events.callbacks["pre_run_cell"]) == len(pre) - 1
    assert len(shell.events.callbacks["post_run_cell"]) == len(post) - 1
    assert not any(
        "nbdebug" in getattr(f, "__module__", "") for f in shell.events.callbacks["pre_run_cell"]
    )
    shell.run_cell("%load_ext nbdebug")
    shell.run_cell("%nbdebug model x y --loss cross_entropy", cell_id="c2")
    assert len(ipw_widget._instances) > before
    shell.run_cell("%unload_ext nbdebug")
    assert len(ipw_widget._instances) == before and magics.open_debuggers() == []
    assert shell.find_line_magic("nbdebug") is None
    shell.run_cell("%load_ext nbdebug")  # the fixture unloads at the end
    assert shell.find_line_magic("nbdebug") is not None
