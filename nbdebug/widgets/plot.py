"""One way for every panel to show a plotly figure, with two back ends.

* ``"figurewidget"``: plotly's ``FigureWidget`` (an anywidget since plotly 6): updates
  are sent as trace/layout diffs, nothing is redrawn.
* ``"output"``: a plain ``go.Figure`` rendered into an ``ipywidgets.Output`` and replaced
  on update. ``FigureWidget`` is known to fail in Google Colab and in some VS Code set-ups
  (plotly.py#5027, colabtools#5889); this back end works wherever ipywidgets works.

``"auto"`` (the default) picks ``"output"`` in Colab and ``"figurewidget"`` elsewhere. Set
it with :func:`set_backend` or the ``NBDEBUG_PLOT_BACKEND`` environment variable.

Usage in a panel::

    view = PlotView(fig)                 # fig: plotly.graph_objects.Figure
    box.children = [view.widget]
    with view.batch_update() as f:       # f is the live figure: mutate it
        f.data[1].x = [3]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

BACKENDS = ("auto", "figurewidget", "output")
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
        return "output" if "google.colab" in sys.modules else "figurewidget"
    return name


class PlotView:
    """A figure shown in a widget; see the module docstring."""

    def __init__(self, fig: go.Figure, *, backend: str | None = None):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"plot backend must be one of {BACKENDS}; got {backend!r}.")
        self.backend = get_backend() if backend in (None, "auto") else backend
        self.widget: widgets.Widget
        self.figure: Any
        if self.backend == "figurewidget":
            self.figure = go.FigureWidget(fig)
            self.widget = self.figure
        else:
            self.figure = go.Figure(fig)
            self.widget = widgets.Output()
            self._render()

    def _render(self) -> None:
        out = self.widget
        assert isinstance(out, widgets.Output)
        out.clear_output(wait=True)
        with out:
            # plotly's mimebundle renders in JupyterLab, Notebook 7, VS Code and Colab.
            from IPython.display import display

            display(self.figure)

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
        else:
            self.figure = go.Figure(fig)
            self._render()

    def __repr__(self) -> str:
        return f"PlotView(backend={self.backend!r}, traces={len(self.figure.data)})"
