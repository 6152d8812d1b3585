"""The real-browser test: every debugger panel, in JupyterLab 4 and in Notebook 7, read.

One Jupyter server (``jupyter lab``, which also serves Notebook 7's ``/notebooks`` pages)
starts on a free localhost port in a temporary directory; Playwright drives Debian's
``chromium`` (no browser download). Each front end opens its own copy of one notebook: a set-up
cell, then the :data:`CELLS`, each opening a debugger; the :data:`PANELS` are its tabs, shown
by clicking them as a user does. The panels are drawn with the default ``"output"`` back end
(plain plotly figures set as the outputs of an ``ipywidgets.Output``);
``NBDEBUG_BROWSER_BACKEND=figurewidget`` reruns the test with plotly's ``FigureWidget``
(:data:`BACKEND`). For
every panel the test asserts

* the visible text: each expected string is shown, and no table header (``th``) is blank;
* every plot is drawn with its data, fills its place (a ``FigureWidget`` drawn hidden or
  before it was attached is 700 px wide until fitted) and is not clipped by its cell output;
* no title overlaps a legend (bounding boxes of plotly's ``.gtitle`` and ``.legend``);
* no page error (anywidget gives up on a model whose module took over 2 s to load, and
  then drops that figure's updates);

and saves ``test-artifacts/<front end>-<panel>.png`` of the whole panel. On the Step panel it
also clicks "jump to origin" and "next" and follows the detail pane and the norm plot's
marker; on the Labels panel it asks for the keyboard shortcuts, clicks the strip and
presses k, and the sample is kept. Adding a panel is one :class:`Panel` entry (and a
:class:`Cell` for a new debugger).
Chromium missing is a failure, not a skip (``make browser-deps`` installs it).
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
from dataclasses import dataclass
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

SETUP = """%load_ext nbdebug
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_predict
from torch import nn

import nbdebug
from nbdebug.widgets.plot import get_backend

# the back end this run reads (the test's kernels get NBDEBUG_PLOT_BACKEND)
assert get_backend() == os.environ.get("NBDEBUG_PLOT_BACKEND", "output"), get_backend()


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


def make_model():
    torch.manual_seed(0)
    return Classifier()


model = make_model()
torch.manual_seed(0)
x = torch.randn(16, 10)
y = torch.randint(0, 3, (16,))
x[3] = 0.5
loss_fn = F.cross_entropy

# a guarded run that dies at step 11: its snapshot has a history
net = make_model()
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
guard = nbdebug.NaNGuard(net, opt, directory=tempfile.mkdtemp(), on_nonfinite="raise",
                         loss_fn=loss_fn)
try:
    for step in range(12):
        xb, yb = torch.randn(16, 10), torch.randint(0, 3, (16,))
        if step == 11:
            xb[3] = 0.5
        loss = loss_fn(net(xb), yb)
        loss.backward()
        if guard.check(loss, inputs=xb, target=yb, step=step):
            opt.step()
        opt.zero_grad()
except nbdebug.NonFiniteError as e:
    snapshot_path = e.path

# tabular data with flipped labels, for the Labels tab
data = load_breast_cancer()
features = (data.data - data.data.mean(0)) / data.data.std(0)
labels = data.target.copy()
rng = np.random.default_rng(0)
flipped = rng.choice(len(labels), 40, replace=False)
labels[flipped] = 1 - labels[flipped]
probs = cross_val_predict(LogisticRegression(max_iter=500), features, labels, cv=5,
                          method="predict_proba")
tab_model = nn.Sequential(nn.Linear(30, 8), nn.ReLU(), nn.Linear(8, 2))
tab_x = torch.tensor(features[:120], dtype=torch.float32)
tab_y = torch.tensor(labels[:120])


def shown(dbg, tab, name):
    dbg.select_tab(tab)
    dbg.widget.add_class(f"panel-{name}")
    return dbg"""


@dataclass(frozen=True)
class Cell:
    """A notebook cell whose last value is a debugger (or a panel) marked ``panel-<name>``
    (``shown(dbg, tab, name)`` selects the tab and marks the widget)."""

    name: str
    code: str


@dataclass(frozen=True)
class Panel:
    """One panel to read: tab ``tab`` of the debugger of cell ``cell`` (clicked in the
    front end, as a user does, unless ``tab`` is None: the cell shows it); ``texts`` must
    be visible in it and ``plots`` plots drawn (each with its data)."""

    name: str
    cell: str
    tab: str | None
    texts: tuple[str, ...]
    plots: int = 0


CELLS = (
    # one debugger of the model and batch for the five tabs that need nothing else: one
    # debugger's figures at a time, as a user opens it
    Cell(
        "model",
        "dbg = nbdebug.debug(model, x, y, loss_fn)\n"
        'dbg.panel("Gradcheck").run_sweep()\n'
        'dbg.panel("Fixes").run()\n'
        'shown(dbg, "Step", "model")',
    ),
    Cell(
        "snapshot",
        "shown(nbdebug.debug(snapshot_path, model=make_model, loss_fn=loss_fn), "
        '"History", "snapshot")',
    ),
    Cell(
        "labels",
        "shown(nbdebug.debug(tab_model, tab_x, tab_y, F.cross_entropy, labels=labels[:120],\n"
        '      pred_probs=probs[:120], journal=tempfile.mktemp(suffix=".jsonl")),\n'
        '      "Labels", "labels")',
    ),
    Cell(
        "drift",
        "drift_dbg = nbdebug.debug(tab_model, tab_x[60:] + 1.5, tab_y[60:], F.cross_entropy,\n"
        "                          reference=tab_x[:60])\n"
        'shown(drift_dbg, "Drift", "drift")',
    ),
    # a result shows itself (the result protocol): find_label_issues(...).show()
    Cell(
        "issues",
        "issues_panel = nbdebug.find_label_issues(labels, pred_probs=probs).show()\n"
        'issues_panel.add_class("panel-issues")\n'
        "issues_panel",
    ),
    # a run whose uncapped warm-up diverges: spike snapshots, then the NaN's; its Flow tab
    Cell(
        "flow",
        """import warnings


def make_flow_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


flow_model = make_flow_model()
flow_opt = torch.optim.SGD(flow_model.parameters(), lr=0.05, momentum=0.9)
flow_sched = torch.optim.lr_scheduler.LambdaLR(flow_opt, lambda s: (s + 1) / 10)
flow_guard = nbdebug.NaNGuard(flow_model, flow_opt, scheduler=flow_sched,
                              directory=tempfile.mkdtemp(), loss_fn=F.mse_loss)
g = torch.Generator().manual_seed(0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    for step in range(200):
        xb = torch.rand(64, 4, generator=g) * 4 - 2
        yb = torch.sin(2 * xb[:, :1]) + 0.5 * xb[:, 1:2]
        loss = F.mse_loss(flow_model(xb), yb)
        loss.backward()
        if flow_guard.check(loss, inputs=xb, target=yb, step=step):
            flow_opt.step()
        flow_opt.zero_grad()
        flow_sched.step()
        if not torch.isfinite(loss):
            break
shown(nbdebug.debug(flow_guard.snapshots[-1], model=make_flow_model, loss_fn=F.mse_loss),
      "Flow", "flow")""",
    ),
    # the Fixes tab of the guarded run's snapshot (it has a rewind window): replays over steps
    Cell(
        "replays",
        "replays_dbg = nbdebug.debug(snapshot_path, model=make_model, loss_fn=loss_fn)\n"
        'replays_dbg.panel("Fixes").run()\n'
        'shown(replays_dbg, "Fixes", "replays")',
    ),
)

PANELS = (
    Panel(
        "step",
        "model",
        None,
        (
            "NaN produced in norm (forward, Tensor.div",
            "2 errors",
            "jump to origin",
            "next non-finite",
            "#3 forward",  # the event after the origin (#0 the batch, #1 the target)
            "non-finite rows: 3",
        ),
        plots=2,
    ),
    Panel(
        "layers",
        "model",
        "Layers",
        (
            "below 1e-05 the gradient vanishes, above 100 it explodes",
            "body.0.weight",
            "head.bias",
            "grad_norm",
            "ratio",
            "NaN",
        ),
        plots=1,
    ),
    Panel(
        "checks",
        "model",
        "Checks",
        (
            "Health checks",
            "2 errors",
            "division_by_zero · norm (RowNorm)",
            "nonfinite_gradient",
            "click a finding for its evidence and advice",
        ),
    ),
    Panel(
        "fixes",
        "model",
        "Fixes",
        (
            "Cause:",
            "an epsilon in the denominator of the division in norm (RowNorm)",
            "makes the step finite end to end",
            "drop batch row 3",
            "drop_rows",
        ),
    ),
    Panel(
        "gradcheck",
        "model",
        "Gradcheck",
        (
            "check all modules",
            "6 modules: 0 with a wrong backward, 0 skipped",
            "checks the model as it is now",
            "no module with a wrong backward",
            "body.0",
            "head",
        ),
        plots=0,  # every module passes: no heatmap, and no empty box in its place
    ),
    Panel(
        "history",
        "snapshot",
        None,
        ("failing step 11", "last steps", "grad_norm", "loss"),
        plots=1,
    ),
    Panel(
        "labels",
        "labels",
        None,
        ("keep", "relabel", "exclude", "given", "then press k keep", "kept the label of sample"),
        plots=1,
    ),
    Panel("drift", "drift", None, ("x0", "feature"), plots=4),
    Panel(
        "issues",
        "issues",
        None,
        ("of 569 samples flagged", "noise rate", "given_label", "suggested_label"),
        plots=1,
    ),
    Panel(
        "flow",
        "flow",
        None,
        (
            "Gradient flow",
            "2.weight crossed z > 6 first",
            "first non-finite step 103",
            "to open its snapshot",
        ),
        plots=1,
    ),
    Panel(
        "replays",
        "replays",
        None,
        (
            "Over steps:",
            "Verdict numerics: the failing batch, finite itself, turns non-finite",
            "skipping the failing batch (step 11) keeps the run finite",
        ),
        plots=1,
    ),
)

#: The front ends: the page of a notebook file in each, and the cells and panels there.
FRONT_ENDS = {"lab": "lab/tree/{nb}", "notebook": "notebooks/{nb}"}
FRONT_END_CELLS = {"lab": CELLS, "notebook": CELLS}
FRONT_END_PANELS = {"lab": PANELS, "notebook": PANELS}

#: Page errors of the front end's own shell, not of any widget (Notebook 7 raises these
#: while it starts with the test's private settings directory): not failures.
FRONT_END_NOISE = (
    "Cannot read properties of undefined (reading 'schema')",
    "Command 'filebrowser:open-path' not registered.",
)

#: The back end the kernels draw with: ``"output"``, unless
#: ``NBDEBUG_BROWSER_BACKEND=figurewidget`` asks for plotly's ``FigureWidget`` (red on a
#: 2-core machine: anywidget drops figures whose 5 MB module takes over 2 s to load, and a
#: debugger loads 4 to 9 at once; see :mod:`nbdebug.widgets.plot`).
BACKEND = os.environ.get("NBDEBUG_BROWSER_BACKEND", "output")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"jupyter exited with code {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter did not answer at {url} within {timeout:.0f} s")


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


def _notebook(path: Path, cells: tuple[Cell, ...]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP)] + [
        nbformat.v4.new_code_cell(c.code) for c in cells
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Jupyter server with one notebook copy per front end; yields (base url, token)."""
    root = tmp_path_factory.mktemp("browser")
    for fe in FRONT_ENDS:
        _notebook(root / f"panels-{fe}.ipynb", FRONT_END_CELLS[fe])
    port, token = _free_port(), secrets.token_hex(16)
    # a private config: no news toast over the page, no update checks, every cell rendered
    settings = root / "settings" / "@jupyterlab"
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}'
    )
    (settings / "notebook-extension").mkdir(parents=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        '{"windowingMode": "none"}'
    )
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(root / "cfg"),
        JUPYTER_RUNTIME_DIR=str(root / "rt"),
        JUPYTERLAB_SETTINGS_DIR=str(root / "settings"),
    )
    # the kernels draw with BACKEND
    env["NBDEBUG_PLOT_BACKEND"] = BACKEND
    # no websocket ping timeouts: on a loaded machine a late pong must not drop the kernel
    # connection (and the widget messages with it)
    (root / "cfg").mkdir()
    (root / "cfg" / "jupyter_server_config.json").write_text(
        '{"ServerApp": {"tornado_settings": {"ws_ping_interval": 0}}}'
    )
    log = root / "server.log"
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "jupyter"),
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--JupyterNotebookApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/api/status?token={token}", proc, 60, log)
        yield base, token
    finally:
        _stop(proc)
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(log, ARTIFACTS / "server.log")


KERNEL_READY_JS = """() => {
  const app = window.jupyterapp;
  const w = app && app.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}"""

MARKER_JS = """() => {
  for (const g of document.querySelectorAll('.panel-model .js-plotly-plot')) {
    const d = g.data || [];
    const t = d[d.length - 1];
    if (t && t.name === 'current event') return [Array.from(t.x || []), Array.from(t.y || [])];
  }
  return null;
}"""

# The plots of the tab shown in a panel, as drawn: a plot counts as drawn once plotly made its
# SVG and drew at least one data trace (a FigureWidget fills in after the kernel's messages,
# whenever the front end gets to them: under load that can take a while).
PLOTS_JS = """(root) => {
  const seen = (el) => el.checkVisibility ? el.checkVisibility() : el.offsetParent !== null;
  const box = (el) => { const r = el.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom,
            width: r.width, height: r.height}; };
  const tab = [...root.querySelectorAll('.widget-tab-contents > *, .lm-TabPanel-stackedPanel > *')]
    .find(seen) || root;
  return [...tab.querySelectorAll('.js-plotly-plot')].filter(seen).map(p => {
    const svg = p.querySelector('.main-svg');
    const titles = [...p.querySelectorAll('.gtitle')].filter(t => t.textContent.trim())
      .map(t => ({text: t.textContent, box: box(t)}));
    const legends = [...p.querySelectorAll('.legend')].map(box);
    return {plot: box(p), svg: svg ? box(svg) : null, titles, legends,
            traces: (p.data || []).length,
            // a figure that sets its own width (the square confusion heatmap) keeps it
            fixed: !!(p.layout && p.layout.width),
            // SVG traces, heatmap images, bars, or the WebGL canvas of a Scattergl trace
            drawn: p.querySelectorAll(
              '.trace, .hm, .heatmaplayer image, .barlayer .point, canvas.gl-canvas').length};
  });
}"""

# Everything the assertions need about one panel, read from what is on screen.
READ_PANEL_JS = (
    """(root) => {
  const seen = (el) => el.checkVisibility ? el.checkVisibility() : el.offsetParent !== null;
  const box = (el) => { const r = el.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom,
            width: r.width, height: r.height}; };
  const tab = [...root.querySelectorAll('.widget-tab-contents > *, .lm-TabPanel-stackedPanel > *')]
    .find(seen) || root;
  const out = root.closest('.jp-OutputArea-output') || root.parentElement;
  const headers = [...tab.querySelectorAll('th')].filter(seen).map(th => th.innerText.trim());
  return {text: tab.innerText, header: root.innerText.slice(0, 600), headers,
          plots: ("""
    + PLOTS_JS
    + """)(root),
          output: box(out), scrollWidth: out.scrollWidth, clientWidth: out.clientWidth};
}"""
)

#: true once ``n`` plots of the panel are drawn, each sized to its place
PLOTS_READY_JS = (
    """([sel, n]) => { const r = document.querySelector(sel); if (!r) return false;
  const plots = ("""
    + PLOTS_JS
    + """)(r);
  const ok = (p) => p.svg && p.traces > 0 && p.drawn > 0
    && (p.fixed || Math.abs(p.svg.width - p.plot.width) <= 2);
  return plots.length >= n && plots.every(ok); }"""
)


def _overlap(a: dict, b: dict) -> bool:
    return not (
        a["right"] <= b["left"]
        or b["right"] <= a["left"]
        or a["bottom"] <= b["top"]
        or b["bottom"] <= a["top"]
    )


def _check_panel(panel: Panel, seen: dict) -> None:
    text = seen["text"]
    for want in panel.texts:
        assert want in text or want in seen["header"], (panel.name, want, text[:1500])
    assert all(seen["headers"]), (panel.name, "blank table header", seen["headers"])
    out = seen["output"]
    assert len(seen["plots"]) == panel.plots, (panel.name, "plots shown", seen["plots"])
    for plot in seen["plots"]:
        svg = plot["svg"]
        assert svg is not None and svg["width"] > 100, (panel.name, "plot not drawn", plot)
        assert plot["traces"] > 0 and plot["drawn"] > 0, (panel.name, "plot has no data", plot)
        assert svg["right"] <= out["right"] + 1, (panel.name, "plot clipped", svg, out)
        # sized to its place (plotly's anywidget draws 700 px wide unless fitted), unless the
        # figure sets its own width
        fitted = plot["fixed"] or abs(svg["width"] - plot["plot"]["width"]) <= 2
        assert fitted, (panel.name, "plot not fitted", plot)
        for title in plot["titles"]:
            for legend in plot["legends"]:
                assert not _overlap(title["box"], legend), (
                    panel.name,
                    "title overlaps legend",
                    title,
                    legend,
                )


def _step_clicks(page) -> None:
    """Jump to origin, then next: the detail pane and the norm plot's marker follow."""
    root = ".panel-model"
    page.wait_for_function(f"() => ({MARKER_JS})() !== null", timeout=60_000)
    badge = page.locator(f"{root} .nbdebug-badge").first
    status = badge.inner_text()
    assert status.startswith("NaN produced in norm (forward, Tensor.div"), status
    assert status.endswith("row 3"), status
    detail = page.locator(f"{root} .nbdebug-detail").first
    before = detail.inner_text()
    assert "#0 input" in before and page.evaluate(MARKER_JS)[0] == ["input"]
    page.locator(f"{root} button", has_text="jump to origin").click()
    page.wait_for_function(
        f"() => document.querySelector('{root} .nbdebug-detail').innerText.includes('Tensor.div')"
    )
    at_origin = detail.inner_text()
    # (#0 the batch, #1 the target)
    assert "#2 forward" in at_origin and "origin" in at_origin and "non-finite rows: 3" in at_origin
    page.wait_for_function(f"() => ({MARKER_JS})()[0][0] === 'norm'")
    page.locator(f"{root} button").filter(has_text=re.compile(r"^\s*next\s*$")).click()
    page.wait_for_function(
        f"() => document.querySelector('{root} .nbdebug-detail').innerText.includes('#3 forward')"
    )
    page.wait_for_function(f"() => ({MARKER_JS})()[0][0] === 'body.0'")
    assert detail.inner_text() != at_origin != before
    assert badge.inner_text() == status


def _label_keys(page) -> None:
    """Ask for the keyboard shortcuts, click the strip, press k: the sample is kept."""
    root = ".panel-labels"
    page.locator(f"{root} button", has_text="Keyboard shortcuts").click()
    strip = page.locator(f"{root} [tabindex='0']", has_text="then press k keep").first
    strip.click()
    page.keyboard.press("k")
    page.wait_for_function(
        f"() => document.querySelector('{root}').innerText.includes('kept the label of sample')"
    )


def _quietly(page, js: str, arg=None, timeout: float = 60_000) -> bool:
    """Wait for ``js`` to hold; on a timeout return False and let the assertions that
    follow say what is wrong."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(js, arg=arg, timeout=timeout)
    except PlaywrightTimeout:
        return False
    return True


def _shoot(page, root, path: Path) -> None:
    """A screenshot of the whole panel: the viewport grows to hold it (the notebook
    scrolls inside the page, so an element screenshot is cut at the viewport)."""
    height = root.bounding_box()["height"]
    size = page.viewport_size
    if height + 320 > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": int(height) + 320})
    root.evaluate("(el) => el.scrollIntoView({block: 'center'})")
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    root.screenshot(path=str(path))


def _show_tab(page, sel: str, tab: str) -> None:
    """Click the tab titled ``tab`` of the debugger ``sel``, as a user does."""
    title = re.compile(rf"^\s*{re.escape(tab)}\s*$")
    page.locator(f"{sel} .lm-TabBar-tab").filter(has_text=title).first.click()
    page.wait_for_function(
        """([sel, tab]) => [...document.querySelectorAll(sel + ' .lm-TabBar-tab')]
             .some(t => t.innerText.trim() === tab && t.classList.contains('lm-mod-current'))""",
        arg=[sel, tab],
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("front_end", list(FRONT_ENDS))
def test_every_panel_reads_right(server, front_end):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: run `make browser-deps` (apt-get install chromium)"
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    base, token = server
    url = f"{base}/{FRONT_ENDS[front_end].format(nb=f'panels-{front_end}.ipynb')}?token={token}"
    panels = FRONT_END_PANELS[front_end]
    ARTIFACTS.mkdir(exist_ok=True)
    console: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.on("console", lambda m: console.append(f"{m.type}: {m.text[:500]}"))
        # an unhandled rejection (e.g. anywidget giving up on a model) is a page error
        page.on("pageerror", lambda e: console.append(f"pageerror: {str(e)[:500]}"))
        page.set_default_timeout(60_000)
        try:
            page.goto(url)
            page.wait_for_function(
                "() => window.jupyterapp && document.querySelector('.jp-Notebook')"
            )
            # the kernel is pre-selected in the metadata; accept the dialog if one shows anyway
            accept = page.locator(".jp-Dialog .jp-mod-accept")
            if accept.count():
                accept.first.click()
            page.wait_for_function(KERNEL_READY_JS, timeout=90_000)
            if front_end == "lab":
                page.evaluate(
                    "() => window.jupyterapp.commands.execute('application:toggle-left-area')"
                )
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.locator(f".panel-{panels[-1].cell}").first.wait_for(
                state="attached", timeout=300_000
            )
            page.wait_for_function(KERNEL_READY_JS, timeout=120_000)
            # every panel is read and photographed; the failures are reported together
            failures: list[str] = []
            for panel in panels:
                sel = f".panel-{panel.cell}"
                root = page.locator(sel).first
                root.wait_for(state="attached", timeout=150_000)
                root.scroll_into_view_if_needed()
                if panel.tab is not None:
                    _show_tab(page, sel, panel.tab)  # drawn hidden: fitted once shown
                # plotly draws a FigureWidget once the front end has loaded its module and
                # the kernel's messages: wait for the drawing itself, not for a time
                _quietly(page, PLOTS_READY_JS, arg=[sel, panel.plots])
                try:
                    if panel.name == "step":
                        _step_clicks(page)
                    if panel.name == "labels":
                        _label_keys(page)
                except (AssertionError, PlaywrightTimeout) as e:
                    failures.append(f"{panel.name} clicks: {e}"[:3000])
                finally:
                    _shoot(page, root, ARTIFACTS / f"{front_end}-{panel.name}.png")
                try:
                    _check_panel(panel, root.evaluate(READ_PANEL_JS))
                except AssertionError as e:
                    failures.append(f"{panel.name}: {e}"[:3000])
            errors = [
                m
                for m in console
                if (m.startswith("pageerror") or "[anywidget]" in m)
                and not any(known in m for known in FRONT_END_NOISE)
            ]
            assert not failures and not errors, (failures, errors)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"{front_end}-failure.png"), full_page=True)
            # stop this front end's kernel: a run left going would slow the next front end
            page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
            raise
        finally:
            (ARTIFACTS / f"{front_end}-console.log").write_text("\n".join(console))
            browser.close()
