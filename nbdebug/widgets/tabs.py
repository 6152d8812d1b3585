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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import ipywidgets as widgets
    import torch

    from ..core.snapshot import Snapshot
    from ..core.trace.result import Trace
    from .layers import LayersPanel
    from .step import StepPanel


@dataclass(frozen=True)
class DebugOptions:
    """The feature tabs' options of :func:`nbdebug.debug` (keyword-only, by name).

    Attributes
    ----------
    reference : array, DataFrame or tensor, optional
        A reference batch: adds the Drift tab.
    labels, pred_probs : array-like, optional
        Given labels and out-of-fold class probabilities: add the Labels tab.
    journal : str or os.PathLike
        The Labels tab's decision journal.
    """

    reference: Any = None
    labels: Any = None
    pred_probs: Any = None
    journal: str | os.PathLike[str] = "labels.journal.jsonl"


@dataclass(frozen=True)
class TabContext:
    """What the debugger was opened with, for the feature tabs to pick from."""

    model: torch.nn.Module | None = None
    inputs: Any = None  # the batch: a tensor, a tuple/list or a dict
    target: Any = None
    loss_fn: Callable[..., Any] | None = None
    snapshot: Snapshot | None = None  # the Snapshot the debugger replays, if any
    options: DebugOptions = field(default_factory=DebugOptions)
    backend: str | None = None

    @property
    def reference(self) -> Any:
        return self.options.reference

    @property
    def labels(self) -> Any:
        return self.options.labels

    @property
    def pred_probs(self) -> Any:
        return self.options.pred_probs

    @property
    def journal(self) -> str | os.PathLike[str]:
        return self.options.journal


class TabHost(Protocol):
    """What a feature tab's ``build`` may use of the debugger it is added to."""

    @property
    def trace(self) -> Trace: ...
    @property
    def error(self) -> str | None: ...
    @property
    def step(self) -> StepPanel: ...
    @property
    def layers(self) -> LayersPanel: ...

    def add_tab(self, title: str, widget: widgets.Widget | HasWidget) -> None: ...
    def select_tab(self, title: str) -> None: ...
    def set_warned(self, source: str, warned: bool) -> None: ...
    def set_header_extra(self, html_text: str, *, warned: bool = False) -> None: ...
    def show_trace(
        self, trace: Trace, *, error: str | None = None, label: str | None = None
    ) -> None: ...
    def on_retrace(self, callback: Callable[[Any], object]) -> None: ...


class HasWidget(Protocol):
    """A panel: an object whose ``widget`` is the ipywidget to display."""

    @property
    def widget(self) -> widgets.Widget: ...


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
    build: Callable[[TabHost, TabContext], None]
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


def add_feature_tabs(dbg: TabHost, ctx: TabContext) -> None:
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
