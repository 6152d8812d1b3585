"""nbdebug: a notebook debugger for PyTorch training.

>>> import nbdebug
>>> tr = nbdebug.trace(model, x, target=y, loss_fn=torch.nn.functional.cross_entropy)
>>> tr.origin        # where the first NaN/Inf was produced, or None

Public names are imported lazily so that ``import nbdebug`` stays cheap and the UI
stack (ipywidgets, plotly) is only imported when a widget is asked for. Importing a
module registers nothing: ``nbdebug.NaNGuard`` is core's guard, and its ``checks=True``
(or a number of steps, or a dict) means the health checks of
:mod:`nbdebug.analysis.checks.guard`, which core imports through the checks source added
below on the first guard that needs them. The ``df.label_issues`` pandas accessor is
registered by the first :func:`find_label_issues` call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .core.display import add_viewer_source
from .core.sources import COMPILER_VERDICT, GUARD_CHECKS, PRECISION_EVIDENCE, add_source

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "trace": "nbdebug.core.trace",
    "Trace": "nbdebug.core.trace",
    "TraceError": "nbdebug.core.trace",
    "Event": "nbdebug.core.trace",
    "ParamInfo": "nbdebug.core.trace",
    "TensorStats": "nbdebug.core.stats",
    "Histogram": "nbdebug.core.stats",
    "NaNGuard": "nbdebug.core.guard",
    "NonFiniteError": "nbdebug.core.guard",
    "RankError": "nbdebug.core.guard",
    "GuardOptions": "nbdebug.core.guard",
    "WatchOptions": "nbdebug.core.guard",
    "FailureOptions": "nbdebug.core.guard",
    "SnapshotOptions": "nbdebug.core.guard",
    "HistoryOptions": "nbdebug.core.guard",
    "ScalerOptions": "nbdebug.core.guard",
    "DistributedOptions": "nbdebug.core.guard",
    "HistoryRow": "nbdebug.core.guard",
    "parse_history": "nbdebug.core.guard",
    "GuardChecks": "nbdebug.analysis.checks",
    "TrainingObjects": "nbdebug.core.snapshot",
    "resolve_step": "nbdebug.core.snapshot",
    "ResolvedStep": "nbdebug.core.snapshot",
    "Snapshot": "nbdebug.core.snapshot",
    "SnapshotError": "nbdebug.core.snapshot",
    "load_snapshot": "nbdebug.core.snapshot",
    "save_snapshot": "nbdebug.core.snapshot",
    "list_snapshots": "nbdebug.core.snapshot",
    "gradcheck": "nbdebug.analysis.gradcheck",
    "gradcheck_modules": "nbdebug.analysis.gradcheck",
    "GradcheckOptions": "nbdebug.analysis.gradcheck",
    "SweepOptions": "nbdebug.analysis.gradcheck",
    "PairCheck": "nbdebug.analysis.gradcheck",
    "GradcheckResult": "nbdebug.analysis.gradcheck",
    "check": "nbdebug.analysis.checks",
    "check_state_dict": "nbdebug.analysis.checks",
    "Finding": "nbdebug.analysis.checks",
    "Findings": "nbdebug.analysis.checks",
    "CheckOptions": "nbdebug.analysis.checks",
    "CheckCode": "nbdebug.analysis.checks",
    "drift": "nbdebug.analysis.drift",
    "drift_from_shap": "nbdebug.analysis.drift",
    "DriftReport": "nbdebug.analysis.drift",
    "DriftOptions": "nbdebug.analysis.drift",
    "diagnose": "nbdebug.analysis.diagnose",
    "Diagnosis": "nbdebug.analysis.diagnose",
    "DiagnoseOptions": "nbdebug.analysis.diagnose",
    "Cause": "nbdebug.analysis.diagnose",
    "FixResult": "nbdebug.analysis.diagnose",
    "Fix": "nbdebug.analysis.diagnose",
    "Replay": "nbdebug.analysis.diagnose",
    "EpsilonFix": "nbdebug.analysis.diagnose",
    "DropRowsFix": "nbdebug.analysis.diagnose",
    "Float32Fix": "nbdebug.analysis.diagnose",
    "ClipGradFix": "nbdebug.analysis.diagnose",
    "LowerLRFix": "nbdebug.analysis.diagnose",
    "ScalerFix": "nbdebug.analysis.diagnose",
    "find_label_issues": "nbdebug.analysis.labels",
    "LabelIssues": "nbdebug.analysis.labels",
    "LabelNoise": "nbdebug.analysis.labels",
    "LabelOptions": "nbdebug.analysis.labels",
    "LabelReview": "nbdebug.analysis.labels",
    "TorchClassifier": "nbdebug.analysis.labels",
    "LabelCleaner": "nbdebug.widgets.labels",
    "row_blame": "nbdebug.analysis.blame",
    "RowBlame": "nbdebug.analysis.blame",
    "BlameOptions": "nbdebug.analysis.blame",
    "compare_ranks": "nbdebug.analysis.ranks",
    "RanksReport": "nbdebug.analysis.ranks",
    "RankRow": "nbdebug.analysis.ranks",
    "compare_replays": "nbdebug.analysis.compare",
    "ReplayConfig": "nbdebug.analysis.compare",
    "ReplayComparison": "nbdebug.analysis.compare",
    "debug": "nbdebug.widgets.app",
    "Debugger": "nbdebug.widgets.app",
}

# result objects of core and analysis show themselves through the panels that the widgets
# layer registers: on the first show(), not before (``import nbdebug`` stays UI-free); a
# Trace's panel is the debugger, which only the app composes
add_viewer_source(lambda: importlib.import_module("nbdebug.widgets.display").register_viewers())
add_viewer_source(lambda: importlib.import_module("nbdebug.widgets.app").register_viewers())
# NaNGuard(checks=True | int | dict) means the health checks of the analysis layer: imported
# by the first guard that needs them (core never imports analysis)
add_source(
    GUARD_CHECKS, lambda: importlib.import_module("nbdebug.analysis.checks.guard").register()
)


def _replay_comparisons() -> None:
    """diagnose of a compiled model's snapshot says whether its NaN is the compiler's, and a
    float32 fix brings its evidence (the step against float64, op by op), through the replay
    comparison (features do not import each other)."""
    importlib.import_module("nbdebug.analysis.compare.verdict").register()


add_source(COMPILER_VERDICT, _replay_comparisons)
add_source(PRECISION_EVIDENCE, _replay_comparisons)

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
    from .core.stats import Histogram as Histogram
    from .core.stats import TensorStats as TensorStats
    from .core.trace import Event as Event
    from .core.trace import ParamInfo as ParamInfo
    from .core.trace import Trace as Trace
    from .core.trace import TraceError as TraceError
    from .core.trace import trace as trace
