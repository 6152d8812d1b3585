"""One real-browser test: JupyterLab in headless Chromium renders the debugger.

Starts JupyterLab on a free localhost port in a temporary directory, opens a notebook in
Debian's ``chromium`` driven by Playwright (no browser download), runs ``%load_ext
nbdebug`` and ``%nbdebug`` on a failing model, clicks "jump to origin" and "next", and
checks that the badge, the detail pane and the norm plot's marker show what they should.
A screenshot goes to ``test-artifacts/debugger.png``. Chromium missing is a failure, not a
skip (``make browser-deps`` installs it).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

MODEL = """import torch
import torch.nn.functional as F
from torch import nn


class RowNorm(nn.Module):
    def forward(self, x):
        mu = x.mean(dim=1, keepdim=True)
        sd = x.std(dim=1, keepdim=True)
        return (x - mu) / sd


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RowNorm()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(self.norm(x)))


torch.manual_seed(0)
model = Classifier()
x = torch.randn(16, 10)
y = torch.randint(0, 3, (16,))
x[3] = 0.5
loss_fn = F.cross_entropy"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"jupyter lab exited with code {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer at {url} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and its kernels (they share the process group we created)."""
    if proc.poll() is not None:
        return
    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=5)


KERNEL_READY_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""

MARKER_JS = """() => {
  for (const g of document.querySelectorAll('.nbdebug-debugger .js-plotly-plot')) {
    const d = g.data || [];
    const t = d[d.length - 1];
    if (t && t.name === 'current event') return [Array.from(t.x || []), Array.from(t.y || [])];
  }
  return null;
}"""


@pytest.mark.timeout(300)
def test_debugger_in_jupyterlab(tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: run `make browser-deps` (apt-get install chromium)"
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext nbdebug"),
        nbformat.v4.new_code_cell(MODEL),
        nbformat.v4.new_code_cell("%nbdebug model x y --loss loss_fn"),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, tmp_path / "debug.ipynb")

    port, token = _free_port(), secrets.token_hex(16)
    # a private config: no news toast over the page, no update checks
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}'
    )
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(
        '{"windowingMode": "none"}'
    )  # render every cell
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        NBDEBUG_PLOT_BACKEND="figurewidget",
    )
    jupyter = Path(sys.executable).parent / "jupyter"
    server = subprocess.Popen(
        [
            str(jupyter),
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={tmp_path}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "server.log", "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        _wait_http(
            f"http://127.0.0.1:{port}/api/status?token={token}", server, 60, tmp_path / "server.log"
        )
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=chromium, args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1500})
                page.set_default_timeout(60_000)
                page.goto(f"http://127.0.0.1:{port}/lab/tree/debug.ipynb?token={token}")
                page.wait_for_function(
                    "() => window.jupyterapp && document.querySelector('.jp-Notebook')"
                )
                # the kernel is pre-selected in the metadata; accept the dialog if one shows anyway
                accept = page.locator(".jp-Dialog .jp-mod-accept")
                if accept.count():
                    accept.first.click()
                page.wait_for_function(KERNEL_READY_JS, timeout=90_000)
                page.evaluate(
                    "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"
                )

                badge = page.locator(".nbdebug-debugger .nbdebug-badge").first
                badge.wait_for(state="attached", timeout=120_000)
                badge.scroll_into_view_if_needed()
                page.wait_for_function(f"() => ({MARKER_JS})() !== null", timeout=60_000)
                status = badge.inner_text()
                assert status.startswith("NaN produced in norm (forward, Tensor.div"), status
                assert status.endswith("row 3"), status
                detail = page.locator(".nbdebug-debugger .nbdebug-detail").first
                detail_before = detail.inner_text()
                marker_before = page.evaluate(MARKER_JS)
                assert "#0 input" in detail_before and marker_before[0] == ["input"]

                page.locator(".nbdebug-debugger button", has_text="jump to origin").click()
                page.wait_for_function(
                    "() => document.querySelector('.nbdebug-debugger "
                    ".nbdebug-detail').innerText.includes('Tensor.div')"
                )
                at_origin = detail.inner_text()
                assert (
                    "#1 forward" in at_origin
                    and "origin" in at_origin
                    and "non-finite rows: 3" in at_origin
                )
                page.wait_for_function(f"() => ({MARKER_JS})()[0][0] === 'norm'")

                page.locator(".nbdebug-debugger button").filter(
                    has_text=re.compile(r"^\s*next\s*$")
                ).click()
                page.wait_for_function(
                    "() => document.querySelector('.nbdebug-debugger "
                    ".nbdebug-detail').innerText.includes('#2 forward')"
                )
                page.wait_for_function(f"() => ({MARKER_JS})()[0][0] === 'body.0'")
                assert detail.inner_text() != at_origin != detail_before
                assert badge.inner_text() == status
                page.evaluate(
                    "() => window.jupyterapp.commands.execute('application:toggle-left-area')"
                )
                page.locator(".nbdebug-debugger").first.scroll_into_view_if_needed()
                time.sleep(1)  # let plotly finish its transition before the picture
                page.locator(".nbdebug-debugger").first.screenshot(
                    path=str(ARTIFACTS / "debugger.png")
                )

                # the Fixes tab: diagnose, the ranked table, try #1 shows the fixed step
                page.locator(".nbdebug-debugger .lm-TabBar-tab", has_text="Fixes").click()
                page.locator(".nbdebug-fixes button", has_text="diagnose").click()
                table = page.locator(".nbdebug-fixes table.fixes").first
                table.wait_for(state="visible", timeout=120_000)
                first_row = table.locator("tr").nth(1).inner_text()
                assert "epsilon" in first_row and "norm" in first_row, first_row
                assert "(sd + 1e-06)" in page.locator(".nbdebug-fixes textarea").first.input_value()
                page.locator(".nbdebug-fixes button", has_text="try #1").click()
                page.wait_for_function(
                    "() => document.querySelector('.nbdebug-debugger .nbdebug-badge')"
                    ".innerText.trim() === 'healthy'",
                    timeout=120_000,
                )
                header = page.locator(".nbdebug-debugger .nbdebug-header").first.inner_text()
                assert "with fix #1 applied" in header, header
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "debugger-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
    finally:
        _stop(server)
