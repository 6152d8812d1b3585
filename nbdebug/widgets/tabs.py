"""The feature tabs of the debugger (Checks, Gradcheck, Drift, Labels, ...): a registry.

Each panel file of ``nbdebug/widgets`` that adds a tab to the debugger says so itself, with
one module-level entry::

    FEATURE_TAB = FeatureTab("Drift", order=30, applies=lambda ctx: ..., build=build_tab)

:func:`feature_tabs` finds these entries (it imports the modules of this package and reads
their ``FEATURE_TAB``), and :func:`add_feature_tabs` adds, in ``order``, every tab whose
``applies(ctx)`` is true. So a new panel touches one file: its own. Neither this module nor
the panels import :mod:`nbdebug.widgets.app`; the debugger is handed to ``build``.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TabContext:
    """What the debugger was opened with, for the feature tabs to pick from."""

    model: Any = None
    inputs: Any = None
    target: Any = None
    loss_fn: Any = None
    snapshot: Any = None  # the Snapshot the debugger replays, if any
    reference: Any = None
    labels: Any = None
    pred_probs: Any = None
    journal: str | os.PathLike[str] = "labels.journal.jsonl"
    backend: str | None = None


@dataclass(frozen=True)
class FeatureTab:
    """One tab of the debugger.

    Parameters
    ----------
    title : str
        The tab's title.
    applies : callable
        ``applies(ctx: TabContext) -> bool``: whether the given data allow the tab.
    build : callable
        ``build(debugger, ctx) -> None``: makes the panel and adds it with
        ``debugger.add_tab(title, panel)`` (and wires it to the other tabs, if it needs to).
    order : int
        Tabs are added in increasing ``order`` (ties: by title).
    """

    title: str
    applies: Callable[[TabContext], bool]
    build: Callable[[Any, TabContext], None]
    order: int = 100


def feature_tabs() -> list[FeatureTab]:
    """Every ``FEATURE_TAB`` of the modules of :mod:`nbdebug.widgets`, in ``order``."""
    found: list[FeatureTab] = []
    for info in pkgutil.iter_modules(_package_path()):
        if info.name in ("tabs", "app"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        entry = getattr(module, "FEATURE_TAB", None)
        if isinstance(entry, FeatureTab):
            found.append(entry)
    return sorted(found, key=lambda t: (t.order, t.title))


def _package_path() -> list[str]:
    return [os.path.dirname(__file__)]


def add_feature_tabs(dbg: Any, ctx: TabContext) -> None:
    """Add the tabs that the given data allow (see each panel's ``FEATURE_TAB``).

    * Checks: always (the health checks of the trace shown, refreshed on re-run);
      clicking a finding moves the Step tab to its event or highlights its parameter in
      the Layers tab, and the header shows the counts of errors and warnings.
    * Gradcheck: when the debugger has a model and a batch (the module sweep runs on
      request, from the tab's button).
    * Drift: when a ``reference`` batch is given (the current batch is ``inputs``).
    * Labels: when ``labels`` and ``pred_probs`` are given (the samples are ``inputs``).
    """
    for tab in feature_tabs():
        if tab.applies(ctx):
            tab.build(dbg, ctx)


def as_table(inputs: Any) -> Any:
    """The batch as one 2-D table for drift and label review (a single tensor input)."""
    import torch

    if isinstance(inputs, (tuple, list)) and len(inputs) == 1:
        inputs = inputs[0]
    if isinstance(inputs, torch.Tensor):
        return inputs.detach().cpu().numpy()
    return inputs
