"""How result objects of the lower layers are shown: the panels registered as their viewers.

:func:`register_viewers` runs on the first ``result.show()`` (``import nbdebug`` hands it
to :mod:`nbdebug.core.display`), so it works in a plain notebook, no ``%load_ext`` needed.
A new result type with a panel adds one function and one row of :data:`VIEWERS`.

Every viewer is ``viewer(result, *, backend=None)`` and returns the panel's ``ipywidgets``
widget, ready to display; the drift report's returns the
:class:`~nbdebug.widgets.drift.DriftPanel` itself (it displays as its widget, and its
``.widget`` is that widget). A recorded ``Trace``'s panel is the debugger, which only
:mod:`nbdebug.widgets.app` composes (no other panel file imports it): ``app.py`` registers
the ``Trace`` viewer itself, so ``trace.show()`` is ``nbdebug.debug(trace)``'s widget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import ipywidgets as widgets

from ..core.display import register_viewer

if TYPE_CHECKING:
    from ..analysis.checks import Findings
    from ..analysis.diagnose import Diagnosis
    from ..analysis.drift import DriftReport
    from ..analysis.gradcheck import GradcheckResult
    from ..analysis.labels import LabelIssues, LabelNoise
    from ..analysis.ranks import RanksReport
    from .drift import DriftPanel


def findings_panel(findings: Findings, *, backend: str | None = None) -> widgets.Widget:
    """The Checks panel's widget for the ``Findings`` of :func:`nbdebug.check` (a table:
    ``backend`` draws no figure here)."""
    from .checks import ChecksPanel

    return ChecksPanel(findings).widget


def gradcheck_panel(result: GradcheckResult, *, backend: str | None = None) -> widgets.Widget:
    """The gradcheck panel's widget for a ``GradcheckResult``."""
    from .gradcheck import GradcheckPanel

    return GradcheckPanel(result, backend=backend).widget


def drift_panel(report: DriftReport, *, backend: str | None = None) -> DriftPanel:
    """The drift panel (:class:`nbdebug.widgets.drift.DriftPanel`) for a ``DriftReport``."""
    from .drift import DriftPanel

    return DriftPanel(report, backend=backend)


def label_noise_panel(noise: LabelNoise, *, backend: str | None = None) -> widgets.Widget:
    """The confident-joint heatmap of the label-noise estimate of
    :func:`nbdebug.find_label_issues` (``df.label_issues``); the review of the flagged
    samples themselves is :class:`nbdebug.LabelCleaner`, which needs the samples."""
    from ..figures.labels import confident_joint_figure
    from .plot import PlotView

    return PlotView(confident_joint_figure(noise), backend=backend).widget


#: the columns of the flagged-samples table of :func:`label_issues_panel`
ISSUE_COLUMNS = ("given_label", "suggested_label", "suggested_prob", "label_quality")
#: flagged samples listed at most (then how many more)
ISSUE_ROWS = 20


def label_issues_panel(issues: LabelIssues, *, backend: str | None = None) -> widgets.Widget:
    """The result of :func:`nbdebug.find_label_issues`: its one-sentence summary, the
    confident-joint heatmap and the flagged samples, worst first (the first
    :data:`ISSUE_ROWS`; reviewing them with the samples is :class:`nbdebug.LabelCleaner`)."""
    from html import escape

    from .style import STYLE

    flagged = issues.to_frame()
    flagged = flagged[flagged["is_issue"]] if "is_issue" in flagged else flagged
    cols = [c for c in ISSUE_COLUMNS if c in flagged.columns]
    shown = flagged[cols].head(ISSUE_ROWS)
    shown = shown.rename_axis("sample").reset_index()  # the sample's row in the data
    table = shown.to_html(index=False, border=0, float_format=lambda v: f"{v:.3g}")
    more = len(flagged) - ISSUE_ROWS
    tail = f"<p>{more} more flagged samples: issues.to_frame()</p>" if more > 0 else ""
    head = f"<p>{escape(issues.summary())}</p>"
    return widgets.VBox(
        [
            widgets.HTML(STYLE),
            widgets.HTML(head),
            label_noise_panel(issues.noise, backend=backend),
            widgets.HTML(f'<div class="nbdebug-detail">{table}{tail}</div>'),
        ]
    )


def diagnosis_panel(diagnosis: Diagnosis, *, backend: str | None = None) -> widgets.Widget:
    """The Fixes panel's widget for a ``Diagnosis`` of :func:`nbdebug.diagnose` (a table:
    ``backend`` draws no figure here)."""
    from .fixes import FixesPanel

    return FixesPanel(diagnosis=diagnosis).widget


def ranks_panel(report: RanksReport, *, backend: str | None = None) -> widgets.Widget:
    """The compare-ranks table of a ``RanksReport`` (:func:`nbdebug.compare_ranks`; a
    table: ``backend`` draws no figure here); the per-rank debugger is
    ``nbdebug.debug(directory, model=...)``."""
    from .ranks import ranks_report_html
    from .style import STYLE

    return widgets.VBox([widgets.HTML(STYLE), widgets.HTML(ranks_report_html(report))])


#: result class name -> its viewer
VIEWERS: dict[str, Callable[..., object]] = {
    "Findings": findings_panel,
    "GradcheckResult": gradcheck_panel,
    "DriftReport": drift_panel,
    "LabelNoise": label_noise_panel,
    "LabelIssues": label_issues_panel,
    "Diagnosis": diagnosis_panel,
    "RanksReport": ranks_panel,
    "RowBlame": lambda blame, *, backend=None: widgets.HTML(blame._repr_html_()),
}


def register_viewers() -> None:
    """Register the panels above as the viewers of their result types."""
    for name, viewer in VIEWERS.items():
        register_viewer(name, viewer)
