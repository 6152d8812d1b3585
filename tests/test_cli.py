"""The ``nbdebug`` command (inspect, report, list) and the HTML report, on real snapshots
written by a real NaNGuard."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import nbdebug
from nbdebug.cli import main
from nbdebug.core.guard import NaNGuard
from nbdebug.core.snapshot import load_snapshot, save_snapshot
from nbdebug.figures.report import report_html

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path, monkeypatch, request):
    """A directory with an importable model module (unique name per test) and a snapshot
    of a step whose batch row 3 holds a NaN."""
    mod = f"clinet_{re.sub(r'[^a-z0-9]', '_', request.node.name.lower())}"
    (tmp_path / f"{mod}.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def make(hidden=12):
                return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 3))
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        factory = __import__(mod).make
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = NaNGuard(
        model,
        opt,
        directory="snaps",
        loss_fn=nn.functional.cross_entropy,
        recipe=f"{mod}:make",
        recipe_kwargs={"hidden": 12},
    )
    for step in range(6):
        x = torch.randn(8, 6)
        y = torch.randint(0, 3, (8,))
        if step == 5:
            x[3, 1] = float("nan")
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=100 + step):
            opt.step()
        opt.zero_grad()
    sys.modules.pop(mod, None)
    (path,) = guard.snapshots
    return tmp_path, mod, path


def _model_of(tmp: Path, mod: str) -> nn.Module:
    """A fresh model from the workdir's factory module."""
    sys.path.insert(0, str(tmp))
    try:
        return importlib.import_module(mod).make()
    finally:
        sys.path.remove(str(tmp))


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_with_model(workdir, capsys):
    _tmp, mod, path = workdir
    before = path.read_bytes()
    code, out, err = _run(
        ["inspect", path, "--model", f"{mod}:make", "--rows", "4", "--top", "2"], capsys
    )
    assert code == 0 and err == ""
    assert out.startswith("nbdebug snapshot: step 105\n")
    assert re.search(r"reason\s+loss: non-finite loss \(nan\) at step 105", out)
    assert re.search(r"batch\s+inputs Tensor\(8, 6\) float32; target Tensor\(8,\) int64", out)
    assert f"recipe       {mod}:make(**{{'hidden': 12}})" in out
    # the replay's origin: the batch, row 3
    assert re.search(r"summary\s+NaN produced in the batch", out)
    assert re.search(r"phase\s+input\n", out) and re.search(r"samples\s+3\n", out)
    # the last 4 history rows: steps 102..105, the last one skipped
    hist = out.split("last 4 history rows\n")[1].split("\n\n")[0].splitlines()
    assert hist[0].split()[:7] == [
        "step",
        "loss",
        "grad_norm",
        "param_norm",
        "lr",
        "scale",
        "skipped",
    ]
    assert [row.split()[0] for row in hist[1:]] == ["102", "103", "104", "105"]
    assert hist[-1].split()[1] == "nan" and "True" in hist[-1] and "loss" in hist[-1]
    # largest norms: the NaN gradients first, two entries each
    grads = (
        out.split("largest gradient norms at the failing step\n")[1].split("\n\n")[0].splitlines()
    )
    assert len(grads) == 2 and all(line.split()[1] == "nan" for line in grads)
    params = out.split("largest parameter norms\n")[1].split("\n\n")[0].splitlines()
    snap = load_snapshot(path)
    norms = sorted(snap.param_norms().items(), key=lambda kv: -kv[1])[:2]
    assert [line.split()[0] for line in params] == [n for n, _ in norms]
    # every activation after the NaN row holds it: its norm is nan (not its finite part's)
    acts = out.split("largest activation norms in the replay\n")[1].split("\n\n")[0]
    assert [line.split()[-1] for line in acts.splitlines()] == ["nan", "nan"], acts
    assert path.read_bytes() == before  # the file is not touched
    code, out, _ = _run(["inspect", path, "--model", f"{mod}:make", "--rows", "0"], capsys)
    assert code == 0 and "\nhistory\n  (6 rows, not shown: --rows 0)\n" in out
    assert "last 0" not in out


def test_inspect_without_model_and_with_recipe(workdir, capsys):
    _tmp, mod, path = workdir
    code, out, err = _run(["inspect", path], capsys)
    assert code == 0 and err == ""
    assert (
        f"Not replayed: no model. Give --model package.module:factory or "
        f"--trust-recipe to build it with the recorded recipe {mod}:make." in out
    )
    assert mod not in sys.modules  # the recipe was not imported
    assert "largest parameter norms" in out and "last 6 history rows" in out

    code, out, _ = _run(["inspect", path, "--trust-recipe"], capsys)
    assert code == 0 and re.search(r"samples\s+3\n", out)
    sys.modules.pop(mod, None)

    code, out, _ = _run(["inspect", path, "--no-replay", "--model", f"{mod}:make"], capsys)
    assert code == 0 and "Not replayed (--no-replay)." in out


def test_a_failure_that_does_not_reproduce_is_not_called_healthy(workdir, capsys):
    """The snapshot records a NaN loss, but its replay is finite: the terminal and the page
    say the failure did not reproduce, not "healthy" under the recorded reason."""
    tmp, mod, _ = workdir
    model = _model_of(tmp, mod)
    path = save_snapshot(
        "other",
        model,
        torch.randn(8, 6),
        torch.randint(0, 3, (8,)),
        step=7,
        loss_fn=nn.functional.cross_entropy,
        reason={"kind": "loss", "message": "non-finite loss at step 7: nan"},
    )
    code, out, _ = _run(["inspect", path, "--model", f"{mod}:make"], capsys)
    assert code == 0
    said = "the replay is finite, although the run recorded a non-finite loss at step 7"
    assert said in out and "healthy" not in out
    code, _, _ = _run(["report", path, "-o", "r.html", "--model", f"{mod}:make"], capsys)
    page = (tmp / "r.html").read_text(encoding="utf-8")
    assert code == 0 and said in page and "<td>healthy</td>" not in page


def test_report_is_one_offline_page(workdir, capsys):
    tmp, mod, path = workdir
    code, out, err = _run(
        ["report", path, "-o", "out/report.html", "--model", f"{mod}:make"], capsys
    )
    assert code == 2 and "cannot write out/report.html" in err  # no such directory
    code, out, err = _run(["report", path, "-o", "report.html", "--model", f"{mod}:make"], capsys)
    assert code == 0 and err == "" and out.startswith("wrote report.html")
    page = (tmp / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # plotly.js inlined once, nothing fetched from anywhere
    assert not re.search(r"<script[^>]*\bsrc=", page) and not re.search(r"<link[^>]*\bhref=", page)
    assert page.count("<script") == 3 and len(page) > 3_000_000
    # the history plot (with the failing step) and the per-layer norm plot
    assert 'id="nbdebug-history"' in page and 'id="nbdebug-norms"' in page
    assert "failing step 105" in page
    assert "NaN produced in the batch" in page and "non-finite loss (nan) at step 105" in page
    for name in ("forward", "backward", "loss non-finite"):
        assert f'"name":"{name}"' in page


def test_report_without_model_keeps_the_history(workdir, capsys):
    tmp, _mod, path = workdir
    code, _, _ = _run(["report", path, "-o", tmp / "r.html"], capsys)
    page = (tmp / "r.html").read_text(encoding="utf-8")
    assert code == 0 and 'id="nbdebug-history"' in page and 'id="nbdebug-norms"' not in page
    assert "The per-layer norm plot needs the replay" in page and "Not replayed: no model." in page


def test_report_html_input_checks(workdir):
    _, _, path = workdir
    with pytest.raises(TypeError, match="expects a Snapshot"):
        report_html(str(path))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trace must be an nbdebug Trace"):
        report_html(load_snapshot(path), trace="t")  # type: ignore[arg-type]


def test_list(workdir, capsys):
    tmp, _, path = workdir
    (tmp / "snaps" / "broken.nbsnap").write_bytes(b"PK\x03\x04 not really")
    code, out, err = _run(["list", "snaps"], capsys)
    lines = out.splitlines()
    assert code == 0 and err == "" and len(lines) == 3
    assert lines[1].split()[:3] == [f"snaps/{path.name}", "105", "loss"]
    assert "broken.nbsnap" in lines[2] and "truncated or corrupt" in lines[2]
    assert lines[1].rstrip().endswith(" -")  # no error: "-", as in every other column
    (tmp / "snaps" / "broken.nbsnap").unlink()
    code, out, _ = _run(["list", "snaps"], capsys)
    assert code == 0 and "None" not in out and out.splitlines()[1].rstrip().endswith(" -")
    (tmp / "empty").mkdir()
    assert _run(["list", "empty"], capsys)[1] == "no snapshots in empty\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "missing.nbsnap"], "missing.nbsnap: no such file."),
        (["inspect", "garbage.nbsnap"], "is not a snapshot: it is not a torch.save zip archive"),
        (["inspect", "snaps"], "is a directory, not a snapshot file"),
        (
            ["inspect", "{snap}", "--model", "no_such_pkg_q:make"],
            "--model: cannot import module 'no_such_pkg_q'",
        ),
        (["inspect", "{snap}", "--model", "json:dumps"], "--model json:dumps failed: TypeError"),
        (["inspect", "{snap}", "--model", "json:__doc__"], "is a str, not a callable"),
        (
            ["inspect", "{snap}", "--model", "{mod}:make", "--model-kwargs", "{{bad"],
            "--model-kwargs is not valid JSON",
        ),
        (["inspect", "{snap}", "--model-kwargs", "{{}}"], "--model-kwargs needs --model."),
        (
            ["inspect", "{snap}", "--model", "{mod}:make", "--model-kwargs", '{{"hidden": 5}}'],
            "shape mismatches: 0.weight: snapshot (12, 6) vs model (5, 6)",
        ),
        (["inspect", "{snap}", "--loss", "nope"], "--loss: expected an import path"),
        (["inspect", "{snap}", "--rows", "-1"], "--rows must be >= 0; got -1."),
        (["inspect", "{snap}", "--top", "-3"], "--top must be >= 0; got -3."),
        (["list", "nowhere"], "nowhere is not a directory."),
        (["report", "{snap}"], "the following arguments are required: -o/--output"),
        (["report", "{snap}", "-o", "snaps"], "is a directory; give a file name"),
        (["explode"], "invalid choice: 'explode'"),
        ([], "arguments are required: {{inspect,report,list,diagnose,build-kernels}}"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(workdir, capsys, argv, message):
    tmp, mod, path = workdir
    (tmp / "garbage.nbsnap").write_bytes(os.urandom(64).replace(b"P", b"Q"))
    argv = [a.format(snap=path, mod=mod) for a in argv]
    message = message.format(mod=mod)
    code: int | str | None
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    assert message in err and err.startswith("nbdebug")
    assert "Traceback" not in err


def test_real_process(workdir):
    """The command as a process: exit codes and streams (no traceback on bad input)."""
    tmp, mod, path = workdir
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the installed console script (pip install -e . puts it next to the interpreter)
    script = Path(sys.executable).with_name("nbdebug")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nbdebug.cli"]
    ok = subprocess.run(
        [*cmd, "inspect", str(path), "--model", f"{mod}:make"],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stderr == "" and "NaN produced in the batch" in ok.stdout
    bad = subprocess.run(
        [*cmd, "report", str(tmp / "nope.nbsnap"), "-o", "x.html"],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"nbdebug: error: {tmp / 'nope.nbsnap'}: no such file.\n"
    assert not (tmp / "x.html").exists()
    # a reader that stops early (`nbdebug inspect SNAP | head -1`): no traceback
    proc = subprocess.Popen(
        [*cmd, "inspect", str(path), "--model", f"{mod}:make"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and first.startswith(b"nbdebug snapshot")
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_console_script_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert 'nbdebug = "nbdebug.cli:main"' in text


def test_history_checks_column_shows_finding_codes(tmp_path):
    """The guard's ``checks`` column holds finding records: the table gives their codes,
    not a Python repr several hundred characters long."""
    from nbdebug.figures.report import history_table

    finding = {"code": "nonfinite_gradient", "severity": "error", "evidence": {"0.weight": 16}}
    rows = [
        {"step": 0, "loss": 1.0, "grad_norm": 2.0, "skipped": False, "checks": []},
        {"step": 1, "loss": 1.0, "grad_norm": float("nan"), "skipped": True, "checks": [finding]},
    ]
    path = save_snapshot(tmp_path, nn.Linear(2, 1), torch.randn(3, 2), step=1, history=rows)
    table = history_table(load_snapshot(path))
    assert list(table["checks"]) == ["-", "nonfinite_gradient"]
    assert "{" not in table.to_string()


def test_origin_facts_name_the_tensor_without_a_stutter():
    from nbdebug.figures.report import origin_facts

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        m[1].weight[0, 0] = float("nan")
    tr = nbdebug.trace(m, torch.randn(8, 4), loss_fn=lambda o: o.sum())
    facts = dict(origin_facts(tr))
    assert tr.origin is not None and (tr.origin.kind, tr.origin.name) == ("output", "output")
    assert facts["tensor"] == "output (8, 1) float32"


def test_a_snapshot_without_a_loss_function_names_the_option(workdir, capsys):
    tmp, mod, _ = workdir
    model = _model_of(tmp, mod)
    path = save_snapshot("other", model, torch.randn(4, 6), torch.randint(0, 3, (4,)), step=3)
    code, out, _ = _run(["inspect", path, "--model", f"{mod}:make"], capsys)
    assert code == 0
    assert (
        "Not replayed: this snapshot recorded no loss function but has a target: pass --loss "
        "package.module:function." in out
    )
    assert "snap.trace" not in out
