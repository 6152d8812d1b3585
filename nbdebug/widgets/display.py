"""How result objects of the lower layers are shown: the panels registered as their viewers.

:func:`register_viewers` runs on the first ``result.show()`` (``import nbdebug`` hands it
to :mod:`nbdebug.core.display`), so it works in a plain notebook, no ``%load_ext`` needed.
A new result type with a panel adds one line to it.
"""

from __future__ import annotations

from typing import Any

from ..core.display import register_viewer


def gradcheck_panel(result: Any, *, backend: str | None = None) -> Any:
    """The gradcheck panel's widget for a ``GradcheckResult``."""
    from .gradcheck import GradcheckPanel

    return GradcheckPanel(result, backend=backend).widget


def drift_panel(report: Any, **options: Any) -> Any:
    """The drift panel (:class:`nbdebug.widgets.drift.DriftPanel`) for a ``DriftReport``."""
    from .drift import DriftPanel

    return DriftPanel(report, **options)


def register_viewers() -> None:
    """Register the panels above as the viewers of their result types."""
    register_viewer("GradcheckResult", gradcheck_panel)
    register_viewer("DriftReport", drift_panel)
