"""How the label review shows one sample: its kind (picture, table, text, a custom
rendering), a sample's features as a compact table, and the keyboard-shortcut strip."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd

from ..core.text import count_text, fmt_num
from ..core.vocab import Vocab
from ..figures import labels as figs
from ..figures.palette import BLUE, MUTED_TEXT

#: the samples of a label review: an array, a tensor, a DataFrame or a list
Samples = Any
#: ``render(sample, index)``: an ipywidget, a plotly figure, an HTML string, or anything
#: IPython can display
Render = Callable[[Any, int], object]


class SampleKind(Vocab):
    """How :class:`~nbdebug.widgets.labels.LabelCleaner` draws a sample (``.kind``)."""

    IMAGE = "image"  # a picture (an image array, or a flat square one)
    TABLE = "table"  # a compact table of features
    TEXT = "text"  # a string
    CUSTOM = "custom"  # the caller's render(sample, index)
    REPR = "repr"  # anything else: its repr


def check_samples(data: Samples, render: Render | None) -> None:
    """Refuse what cannot be the samples or their rendering."""
    if data is None or not hasattr(data, "__len__"):
        raise TypeError(
            "data must hold the samples (array, tensor, DataFrame or list); got "
            f"{type(data).__qualname__}."
        )
    if render is not None and not callable(render):
        raise TypeError(
            f"render must be a callable render(sample, index); got {type(render).__qualname__}."
        )


def sample_kind(
    data: Samples, image_shape: Sequence[int] | None, render: Render | None
) -> SampleKind:
    """How the samples of ``data`` are drawn."""
    if render is not None:
        return SampleKind.CUSTOM
    if isinstance(data, pd.DataFrame):
        return SampleKind.TABLE
    if hasattr(data, "detach") or isinstance(data, np.ndarray):
        arr = data
        if (
            arr.dtype == object
            or str(arr.dtype).startswith("<U")
            or str(arr.dtype).startswith("<S")
        ):
            return SampleKind.TEXT
        if image_shape is not None or arr.ndim >= 3:
            return SampleKind.IMAGE
        if arr.ndim == 2 and figs.as_image(arr[0]) is not None:
            return SampleKind.IMAGE
        return SampleKind.TABLE
    if len(data) and isinstance(data[0], str):
        return SampleKind.TEXT
    return SampleKind.REPR


KEYS = {"k": "keep", "r": "relabel", "x": "exclude", "s": "skip", "u": "undo"}

_KEYS_ESM = """
function render({ model, el }) {
  const box = document.createElement("div");
  box.tabIndex = 0;
  // the front end's own shortcuts (Notebook 7's command-mode k, j, x...) skip this element
  box.setAttribute("data-lm-suppress-shortcuts", "true");
  box.textContent = "\u2328 click here, then press k keep \u00b7 r relabel to suggestion"
    + " \u00b7 x exclude \u00b7 s skip \u00b7 u undo";
  box.style.cssText = "padding:4px 8px;border:1px dashed #999;border-radius:4px;font-size:12px;"
    + "color:@MUTED@;cursor:pointer;outline:none";
  box.addEventListener("focus", () => {
    box.style.borderColor = "@ACCENT@"; box.style.color = "@ACCENT@";
  });
  box.addEventListener("blur", () => {
    box.style.borderColor = "#999"; box.style.color = "@MUTED@";
  });
  box.addEventListener("keydown", (e) => {
    if (["k", "r", "x", "s", "u"].includes(e.key)) {
      e.preventDefault(); model.send({ key: e.key });
    }
  });
  el.appendChild(box);
}
export default { render };
""".replace("@ACCENT@", BLUE).replace("@MUTED@", MUTED_TEXT)


def key_widget() -> widgets.DOMWidget | None:
    """A focusable strip that sends key presses to Python (anywidget); None without
    anywidget. Made on demand (:meth:`LabelCleaner.enable_keys`), not with the panel:
    anywidget gives up on a model whose module is not loaded within 2 s, which a front end
    busy drawing a whole debugger can miss, and the shortcuts were then dead."""
    try:
        import anywidget
    except ImportError:  # pragma: no cover - anywidget is a dependency
        return None

    class KeyCapture(anywidget.AnyWidget):
        _esm = _KEYS_ESM

    return KeyCapture()


def table_html(sample: object, per_column: int = 12, most: int = 96) -> str:
    """A sample's features as a compact table: name/value pairs in columns of
    ``per_column`` rows, side by side (30 features read as 3 short columns, not one tall
    one), at most ``most`` of them, then how many more."""
    if isinstance(sample, pd.Series):
        items = list(sample.items())
    else:
        arr = np.asarray(sample.detach().cpu() if hasattr(sample, "detach") else sample).ravel()
        items = [(f"x[{i}]", v) for i, v in enumerate(arr)]
    shown = items[:most]
    columns = [shown[i : i + per_column] for i in range(0, len(shown), per_column)] or [[]]
    pad = "padding:0 6px 0 12px"

    def cells(r: int) -> str:
        out = []
        for col in columns:
            if r < len(col):
                k, v = col[r]
                out.append(
                    f"<td style='{pad};color:{MUTED_TEXT}'>{html.escape(str(k))}</td>"
                    f"<td>{html.escape(fmt_num(v))}</td>"
                )
            else:
                out.append("<td></td><td></td>")
        return "<tr>" + "".join(out) + "</tr>"

    rows = "".join(cells(r) for r in range(len(columns[0])))
    more = (
        f"<tr><td colspan={2 * len(columns)} style='{pad}'>"
        f"<i>… {count_text(len(items) - most, 'more feature')}</i></td></tr>"
        if len(items) > most
        else ""
    )
    return f'<table style="font-size:12px;border:1px solid #ddd">{rows}{more}</table>'
