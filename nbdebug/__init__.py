"""nbdebug: a notebook debugger for PyTorch training.

>>> import nbdebug
>>> tr = nbdebug.trace(model, x, target=y, loss_fn=torch.nn.functional.cross_entropy)
>>> tr.origin        # where the first NaN/Inf was produced, or None

Public names are imported lazily so that ``import nbdebug`` stays cheap and the UI
stack (ipywidgets, plotly) is only imported when a widget is asked for. Importing a
module registers nothing: ``nbdebug.NaNGuard`` is core's guard extended by
:mod:`nbdebug.analysis.checks_guard` so that ``checks=True`` (or a number of steps, or a
dict) means its health checks; ``nbdebug.core.guard.NaNGuard`` takes a
``GuardChecks(...)`` object instead. The ``df.label_issues`` pandas accessor is registered
by the first :func:`find_label_issues` call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .core.display import add_viewer_source

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "trace": "nbdebug.core.trace",
    "Trace": "nbdebug.core.trace",
    "TraceError": "nbdebug.core.trace",
    "Event": "nbdebug.core.events",
    "ParamInfo": "nbdebug.core.events",
    "TensorStats": "nbdebug.core.stats",
    "Histogram": "nbdebug.core.stats",
    "NaNGuard": "nbdebug.analysis.checks_guard",
    "NonFiniteError": "nbdebug.core.guard",
    "Snapshot": "nbdebug.core.snapshot",
    "SnapshotError": "nbdebug.core.snapshot",
    "load_snapshot": "nbdebug.core.snapshot",
    "save_snapshot": "nbdebug.core.snapshot",
    "list_snapshots": "nbdebug.core.snapshot",
    "gradcheck": "nbdebug.analysis.gradcheck",
    "gradcheck_modules": "nbdebug.analysis.gradcheck_sweep",
    "GradcheckResult": "nbdebug.analysis.gradcheck",
    "check": "nbdebug.analysis.checks",
    "check_state_dict": "nbdebug.analysis.checks",
    "Finding": "nbdebug.analysis.checks",
    "drift": "nbdebug.analysis.drift",
    "DriftReport": "nbdebug.analysis.drift",
    "diagnose": "nbdebug.analysis.diagnose",
    "Diagnosis": "nbdebug.analysis.diagnose",
    "find_label_issues": "nbdebug.analysis.labels",
    "LabelCleaner": "nbdebug.widgets.labels",
    "compare_ranks": "nbdebug.analysis.ranks",
    "RanksReport": "nbdebug.analysis.ranks",
    "debug": "nbdebug.widgets.app",
    "Debugger": "nbdebug.widgets.app",
}

# result objects of core and analysis show themselves through the panels that the widgets
# layer registers: on the first show(), not before (``import nbdebug`` stays UI-free)
add_viewer_source(lambda: importlib.import_module("nbdebug.widgets.display").register_viewers())

__all__ = sorted([*_EXPORTS, "load_ipython_extension", "unload_ipython_extension"])


def __getattr__(name: str) -> Any:
    modname = _EXPORTS.get(name)
    if modname is None:
        raise AttributeError(f"module 'nbdebug' has no attribute {name!r}")
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name == modname:  # the feature is not built yet, not a missing dependency
            raise AttributeError(f"module 'nbdebug' has no attribute {name!r}") from e
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbdebug``: registers the ``%nbdebug`` magic.

    Parameters
    ----------
    ipython : IPython.core.interactiveshell.InteractiveShell
        The running shell (IPython passes it).

    Examples
    --------
    >>> %load_ext nbdebug
    >>> %nbdebug model x y --loss cross_entropy
    """
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbdebug``: removes the magic and its callbacks and closes the
    debuggers it opened.

    Parameters
    ----------
    ipython : IPython.core.interactiveshell.InteractiveShell
        The running shell (IPython passes it).

    Examples
    --------
    >>> %unload_ext nbdebug
    """
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)


if TYPE_CHECKING:  # pragma: no cover
    from .core.events import Event as Event
    from .core.events import ParamInfo as ParamInfo
    from .core.stats import Histogram as Histogram
    from .core.stats import TensorStats as TensorStats
    from .core.trace import Trace as Trace
    from .core.trace import TraceError as TraceError
    from .core.trace import trace as trace
