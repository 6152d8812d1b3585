"""Figures of the label-noise explorer: the confident-joint heatmap and a sample as a picture."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from numpy.typing import ArrayLike

from ..analysis.labels import LabelNoise
from .palette import DARK_TEXT, LIGHT_GREY


def _noise(issues: object) -> LabelNoise:
    est = issues.attrs.get("label_noise") if isinstance(issues, pd.DataFrame) else issues
    if not isinstance(est, LabelNoise):
        raise TypeError(
            "expected the DataFrame returned by nbdebug.find_label_issues (or its LabelNoise); "
            f"got {type(issues).__qualname__}."
        )
    return est


def class_labels(n_classes: int, class_names: Sequence[object] | None = None) -> list[str]:
    """Display names of the classes: ``"3: cat"`` with names, ``"3"`` without."""
    if class_names is None:
        return [str(i) for i in range(n_classes)]
    if len(class_names) != n_classes:
        raise ValueError(
            f"class_names must name all {n_classes} classes; got {len(class_names)} names."
        )
    return [f"{i}: {n}" for i, n in enumerate(class_names)]


def _count_color(off: np.ndarray, i: int, j: int) -> str:
    """The colour of the count written on cell (i, j): white where the "Reds" scale of the
    off-diagonal cells is dark (the upper half of its range), else the default dark text."""
    v = off[i, j]
    finite = off[np.isfinite(off)]
    if not np.isfinite(v) or finite.size == 0 or finite.max() == finite.min():
        return DARK_TEXT
    share = (v - finite.min()) / (finite.max() - finite.min())
    return "white" if share > 0.5 else DARK_TEXT


def confident_joint_figure(
    issues: pd.DataFrame | LabelNoise, *, class_names: Sequence[object] | None = None
) -> go.Figure:
    """Heatmap of the confident joint: rows the given label, columns the estimated true label.

    Parameters
    ----------
    issues : pandas.DataFrame or LabelNoise
        The result of :func:`nbdebug.find_label_issues`. With the DataFrame, the hover text
        also gives how many samples of each (given, suggested) pair are flagged.
    class_names : sequence of str, optional

    Returns
    -------
    plotly.graph_objects.Figure
        One ``go.Heatmap`` trace named ``"confident joint"``: ``z[i][j]`` = ``C[i, j]``
        (diagonal cells drawn in grey so the off-diagonal noise stands out), ``x`` and ``y``
        the class indices (ticks show the names). A click on cell ``(x=j, y=i)`` means
        "given ``i``, suggested ``j``".
    """
    est = _noise(issues)
    k = est.n_classes
    names = class_labels(k, class_names)
    cj = est.confident_joint.astype(float)
    off = cj.copy()
    np.fill_diagonal(off, np.nan)
    fig = go.Figure(
        go.Heatmap(
            z=_json_safe(off),
            x=list(range(k)),
            y=list(range(k)),
            text=_cell_text(cj, _flagged_pairs(issues, k), names),
            hovertemplate="%{text}<extra></extra>",
            colorscale="Reds",
            colorbar={"title": "count"},
            name="confident joint",
        )
    )
    fig.add_trace(_diagonal_trace(cj))
    fig.add_trace(_counts_trace(cj, off))
    size = max(320, min(700, 40 * k + 140))
    fig.update_layout(
        title=f"Confident joint: {est.summary()}" if len(est.summary()) < 90 else "Confident joint",
        xaxis={
            "title": "estimated true (suggested) label",
            "tickvals": list(range(k)),
            "ticktext": names,
        },
        yaxis={
            "title": "given label",
            "tickvals": list(range(k)),
            "ticktext": names,
            "autorange": "reversed",
        },
        width=size + 120,
        height=size,
        margin={"l": 60, "r": 20, "t": 50, "b": 60},
    )
    return fig


def _flagged_pairs(issues: pd.DataFrame | LabelNoise, k: int) -> np.ndarray:
    """``(k, k)`` counts of the flagged samples per (given, suggested) pair (zeros for a
    bare LabelNoise)."""
    flagged = np.zeros((k, k), dtype=np.int64)
    if isinstance(issues, pd.DataFrame) and "is_issue" in issues:
        f = issues[issues["is_issue"].to_numpy(dtype=bool)]
        g = f["given_label"].to_numpy()
        s = f["suggested_label"].to_numpy()
        ok = s >= 0
        np.add.at(flagged, (g[ok], s[ok]), 1)
    return flagged


def _cell_text(cj: np.ndarray, flagged: np.ndarray, names: list[str]) -> list[list[str]]:
    """The hover text of every cell."""
    k = len(names)
    return [
        [
            f"given {html.escape(names[i])}, true {html.escape(names[j])}<br>"
            f"confident joint {int(cj[i, j])}<br>"
            + (f"flagged with this suggestion {flagged[i, j]}" if i != j else "agreeing labels")
            for j in range(k)
        ]
        for i in range(k)
    ]


def _diagonal_trace(cj: np.ndarray) -> go.Heatmap:
    """The agreeing labels in grey, so that the off-diagonal noise stands out."""
    k = len(cj)
    diag = np.full((k, k), np.nan)
    np.fill_diagonal(diag, cj.diagonal())
    return go.Heatmap(
        z=_json_safe(diag),
        x=list(range(k)),
        y=list(range(k)),
        colorscale=[[0, LIGHT_GREY], [1, LIGHT_GREY]],
        showscale=False,
        hoverinfo="skip",
        name="diagonal",
    )


def _counts_trace(cj: np.ndarray, off: np.ndarray) -> go.Scatter:
    """The count written on every non-empty cell."""
    k = len(cj)
    return go.Scatter(
        x=[j for i in range(k) for j in range(k)],
        y=[i for i in range(k) for j in range(k)],
        mode="text",
        text=[str(int(cj[i, j])) if cj[i, j] else "" for i in range(k) for j in range(k)],
        # white on the dark half of the red scale, so no count sits unread on its cell
        textfont={
            "size": 10 if k <= 12 else 7,
            "color": [_count_color(off, i, j) for i in range(k) for j in range(k)],
        },
        hoverinfo="skip",
        showlegend=False,
        name="counts",
    )


def as_image(sample: Any, image_shape: Sequence[int] | None = None) -> np.ndarray | None:
    """A sample as an image array, or None when it does not look like one.

    ``(h, w)`` grayscale, ``(h, w, c)`` or ``(c, h, w)`` with ``c`` in 1, 3, 4, or a flat
    vector reshaped to ``image_shape``; a flat vector of a square length ``>= 64`` (8x8
    digits, 28x28 MNIST) is read as a square grayscale image.
    """
    if hasattr(sample, "detach"):
        sample = sample.detach().cpu().numpy()
    arr = np.asarray(sample)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.number):
        return None
    if image_shape is not None:
        if int(np.prod(image_shape)) != arr.size:
            raise ValueError(
                f"image_shape {tuple(image_shape)} holds {int(np.prod(image_shape))} values; the "
                f"sample has {arr.size}."
            )
        arr = arr.reshape(tuple(image_shape))
    elif arr.ndim == 1:
        side = math.isqrt(arr.size)
        if arr.size < 64 or side * side != arr.size:
            return None
        arr = arr.reshape(side, side)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4)):
        return arr
    return None


def sample_image_figure(image: ArrayLike | None, *, title: str = "", size: int = 260) -> go.Figure:
    """One sample drawn as a picture.

    Parameters
    ----------
    image : array, shape (h, w) grayscale or (h, w, 3|4) colour
        As returned by :func:`as_image`. Grayscale is drawn dark-on-light (digits), colour
        is scaled to 0..255.

    Returns
    -------
    plotly.graph_objects.Figure
        One ``go.Heatmap`` (grayscale) or ``go.Image`` (colour) trace, square pixels.
    """
    arr = np.asarray(image, dtype=float)
    if arr.ndim == 2:
        trace: Any = go.Heatmap(
            z=arr,
            colorscale="Greys",
            showscale=False,
            hovertemplate="(%{x}, %{y}): %{z}<extra></extra>",
        )
    elif arr.ndim == 3 and arr.shape[-1] in (3, 4):
        lo, hi = float(np.nanmin(arr)), float(np.nanmax(arr))
        scaled = (arr - lo) / (hi - lo) * 255 if hi > lo else np.zeros_like(arr)
        trace = go.Image(z=scaled[..., :3].astype(np.uint8))
    else:
        raise ValueError(f"expected an image of shape (h, w) or (h, w, 3|4); got {arr.shape}.")
    fig = go.Figure(trace)
    fig.update_layout(
        title=title,
        width=size,
        height=size,
        margin={"l": 10, "r": 10, "t": 30 if title else 10, "b": 10},
        xaxis={"visible": False, "constrain": "domain"},
        yaxis={"visible": False, "autorange": "reversed", "scaleanchor": "x"},
    )
    return fig


def _json_safe(z: np.ndarray) -> list[list[float | None]]:
    """Heatmap cells with None for the gaps: NaN is not valid JSON, and the widget comm
    would warn about it."""
    return [[None if np.isnan(v) else float(v) for v in row] for row in z]
