"""One way for every panel to show a plotly figure, with two back ends.

* ``"figurewidget"``: plotly's ``FigureWidget`` (an anywidget since plotly 6): updates
  are sent as trace/layout diffs, nothing is redrawn.
* ``"output"``: a plain ``go.Figure`` whose mime bundle (:func:`figure_output`: plotly's
  JSON mime type, or in Colab a small HTML page that loads plotly.js from its CDN; never
  plotly.js itself) is set as the ``outputs`` of an ``ipywidgets.Output`` and replaced on
  update; a figure that did not change sends nothing. It works wherever ipywidgets works.
  The figure is not captured with ``with out: display(fig)``: under nbclient (nbconvert,
  papermill, the lesson tests) every captured message made the client write the widget's
  outputs back to the kernel, which stalled the cell for the client's whole timeout
  (:mod:`nbdebug.widgets.output` says how).

plotly's ``FigureWidget`` sets its data after ipywidgets opened its comm, so the figure
reaches the front end as a second message; a view drawn before that message is handled
stays empty (plotly's view does not redraw on it), and anywidget drops a model's messages
when its module (plotly's 5 MB bundle, loaded once per figure) is not ready within 2 s,
as on a loaded machine with many figures at once. :class:`DrawnFigureWidget` opens the
comm once the figure is set, so the data travels in the model's first state.

plotly's anywidget draws a ``FigureWidget`` once, at the width its element has then, or
700 px when the element is not yet attached or sits in a hidden tab, and never follows its
container afterwards (plotly.py#5208). So a ``PlotView`` re-fits its figure to the
container when the front end first reports the drawing, and :func:`fit_figures` does the
same for every figure under a widget (the debugger calls it when a tab is shown).

``"auto"`` (the default) picks ``"output"`` everywhere: ``FigureWidget`` is known to fail in
Google Colab and in some VS Code set-ups (plotly.py#5027, colabtools#5889), and a debugger
shows 4 to 9 figures at once, which anywidget's 2 s limit freezes in JupyterLab and Notebook
7 (measured in headless Chromium on a 2-core machine: 1 or 2 figures load, 4 at once lose 2,
and each ships the 5 MB bundle). Choose ``"figurewidget"`` (diff updates, nothing redrawn)
with :func:`set_backend` or ``NBDEBUG_PLOT_BACKEND=figurewidget`` where the front end loads
it reliably.

Usage in a panel::

    view = PlotView(fig)                 # fig: plotly.graph_objects.Figure
    box.children = [view.widget]
    with view.batch_update() as f:       # f is the live figure: mutate it
        f.data[1].x = [3]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from .output import display_output, show_outputs

BACKENDS = ("auto", "figurewidget", "output")
PLOTLY_JSON = "application/vnd.plotly.v1+json"
_backend: str | None = None


def set_backend(name: str) -> None:
    """Choose how figures are drawn: ``"auto"``, ``"figurewidget"`` or ``"output"``."""
    if name not in BACKENDS:
        raise ValueError(f"plot backend must be one of {BACKENDS}; got {name!r}.")
    global _backend
    _backend = name


def get_backend() -> str:
    """The back end in force, with ``"auto"`` resolved."""
    name = _backend or os.environ.get("NBDEBUG_PLOT_BACKEND", "auto")
    if name not in BACKENDS:
        name = "auto"
    if name == "auto":
        return "output"  # why not FigureWidget by default: see the module docstring
    return name


class DrawnFigureWidget(go.FigureWidget):
    """A ``FigureWidget`` whose comm opens with the figure's data and layout in its first
    state (see the module docstring); otherwise plotly's ``FigureWidget``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._hold_open = True  # ipywidgets opens the comm at the end of Widget.__init__
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._hold_open = False
        self.open()

    def open(self) -> None:
        """Open the comm, with the whole state (not before the figure is set)."""
        if not getattr(self, "_hold_open", False):
            super().open()


class PlotView:
    """A figure shown in a widget; see the module docstring."""

    def __init__(self, fig: go.Figure, *, backend: str | None = None):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"plot backend must be one of {BACKENDS}; got {backend!r}.")
        self.backend = get_backend() if backend in (None, "auto") else backend
        self.widget: widgets.Widget
        self.figure: Any
        if self.backend == "figurewidget":
            self.figure = DrawnFigureWidget(fig)
            self.widget = self.figure
            # the front end sends the drawn layout back once a view has drawn it: then the
            # element is in the page, and a re-fit sizes the drawing to it
            self.figure.observe(self._on_drawn, names="_js2py_layoutDelta")
        else:
            self.figure = go.Figure(fig)
            self.widget = widgets.Output()
            self._render()

    def _on_drawn(self, change: Any) -> None:
        if not change["new"]:
            return
        self.figure.unobserve(self._on_drawn, names="_js2py_layoutDelta")
        self.fit()

    def fit(self) -> None:
        """Size the drawing to its container as it is now (``FigureWidget`` only; the
        ``"output"`` back end follows its container by itself)."""
        if self.backend == "figurewidget":
            fit_figure(self.figure)

    def _render(self) -> None:
        out = self.widget
        assert isinstance(out, widgets.Output)
        show_outputs(out, figure_output(self.figure))

    @contextmanager
    def batch_update(self) -> Iterator[Any]:
        """Group changes to the figure into one front-end update."""
        if self.backend == "figurewidget":
            with self.figure.batch_update():
                yield self.figure
        else:
            yield self.figure
            self._render()

    def replace(self, fig: go.Figure) -> None:
        """Swap in a new figure (same widget, new traces and layout)."""
        if self.backend == "figurewidget":
            with self.figure.batch_update():
                self.figure.data = ()
                self.figure.add_traces(list(fig.data))
                self.figure.layout = fig.layout
            self.fit()
        else:
            self.figure = go.Figure(fig)
            self._render()

    def __repr__(self) -> str:
        return f"PlotView(backend={self.backend!r}, traces={len(self.figure.data)})"


def figure_output(fig: go.Figure) -> dict[str, Any]:
    """``fig`` as one ``display_data`` output (nbformat's dict, JSON-ready).

    The mime types of plotly's default renderers (``plotly.io.renderers.default``, which
    plotly picks for the front end: its JSON mime type in JupyterLab, Notebook 7 and VS Code,
    an HTML page that loads plotly.js from its CDN in Colab), as ``display(fig)`` would send
    them, less the classic notebook's ``"notebook"`` HTML (it draws only after plotly.js,
    5 MB, was embedded into the page once); plotly's JSON mime type where no renderer is left
    (a terminal shell's ``"browser"``: no browser tab opens for a panel). Nothing is activated
    or published: the output is data for :func:`nbdebug.widgets.output.show_outputs`.
    """
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer, NotebookRenderer, PlotlyRenderer

    def bundle_of(renderer: MimetypeRenderer) -> dict[str, Any]:
        if type(renderer) is PlotlyRenderer and not renderer.config:
            # what its to_mimebundle returns, in 2 JSON passes instead of 4 (a step of a
            # 2,000-event debugger redraws a 450 kB norm plot)
            return {PLOTLY_JSON: json_ready(fig.to_dict())}
        return dict(renderer.to_mimebundle(fig.to_dict()))

    bundle: dict[str, Any] = {}
    for name in (pio.renderers.default or "").split("+"):
        if name not in pio.renderers:  # "" (no default)
            continue
        renderer = pio.renderers[name]
        if not isinstance(renderer, MimetypeRenderer):
            continue
        if isinstance(renderer, NotebookRenderer) and not renderer.connected:
            continue
        bundle.update(bundle_of(renderer))
    return display_output(bundle or bundle_of(pio.renderers["plotly_mimetype"]))


def json_ready(obj: Any) -> Any:
    """``obj`` as plotly writes it to JSON (its encoder for numpy, pandas and dates; NaN and
    infinities as ``null``), read back into Python lists and dicts."""
    from plotly.utils import PlotlyJSONEncoder

    text = json.dumps(obj, default=PlotlyJSONEncoder().default)
    return json.loads(text, parse_constant=lambda _: None)


def fit_figure(figure: go.FigureWidget) -> None:
    """Have the front end size ``figure``'s drawing to its container now.

    Two layout messages, autosize off then on: plotly.js recomputes the width from the
    element only when autosize is switched on (setting it to its current value sends
    nothing). A drawing in a hidden element keeps its size until it is shown and fitted.
    """
    figure.layout.autosize = False
    figure.layout.autosize = True


def fit_figures(root: widgets.Widget) -> int:
    """Fit every ``FigureWidget`` under ``root`` (through ``children``) to its container;
    returns how many. Call it when ``root`` is shown (e.g. its tab is selected)."""
    n = 0
    stack: list[Any] = [root]
    while stack:
        w = stack.pop()
        if isinstance(w, go.FigureWidget):
            fit_figure(w)
            n += 1
        else:
            stack.extend(getattr(w, "children", ()))
    return n
