"""The Checks tab: health-check findings grouped by severity, with coloured badges.

Clicking a finding shows its evidence, advice and fix, and calls ``on_select(finding)``
(the debugger moves its step cursor to ``finding.event``, or selects ``finding.param`` in
the Layers tab). ``panel.summary`` is the short count for the debugger's header badge.

>>> panel = ChecksPanel(nbdebug.check((model, x), target=y, loss_fn=F.cross_entropy),
...                     on_select=lambda f: print(f.event, f.param))
>>> panel.widget          # display it
>>> panel.summary         # '1 error, 2 warnings'
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets

from ..analysis.checks.base import SEVERITIES, Finding, Findings
from ..core.text import fmt_num, rows_text
from ..core.trace.result import Trace
from ..figures.palette import GREEN, GREY, SEVERITY_COLORS
from .style import STYLE
from .tabs import FeatureTab, TabContext, TabHost

COLORS = SEVERITY_COLORS
_BUTTON_STYLE = {"error": "danger", "warning": "warning", "info": "info"}


def counts_summary(findings: Sequence[Finding]) -> str:
    """``"2 errors, 1 warning"`` (``"no errors or warnings"`` when there are none)."""
    counts = Findings(findings).counts
    n_err, n_warn = counts["error"], counts["warning"]
    parts = []
    if n_err:
        parts.append(f"{n_err} error{'s' if n_err != 1 else ''}")
    if n_warn:
        parts.append(f"{n_warn} warning{'s' if n_warn != 1 else ''}")
    return ", ".join(parts) if parts else "no errors or warnings"


def badge(text: str, severity: str) -> str:
    color = COLORS.get(severity, GREY)
    return f"<span class='nbdebug-badge' style='background:{color}'>{html.escape(text)}</span>"


class ChecksPanel:
    """Findings grouped by severity; see the module docstring.

    Parameters
    ----------
    findings : list of Finding
        As returned by :func:`nbdebug.check` (shown in that order within each group).
    on_select : callable, optional
        Called with the clicked :class:`Finding` (the debugger moves the Step cursor to its
        event, or highlights its parameter in the Layers tab, and stays on this tab so the
        advice stays in view).
    on_goto : callable, optional
        Called with the selected finding when its "show in ..." button is clicked (the
        debugger brings the Step or Layers tab to the front).

    Attributes
    ----------
    widget : ipywidgets.VBox
    buttons : list of ipywidgets.Button
        One per finding, in the order of ``findings``.
    selected : Finding or None
    """

    def __init__(
        self,
        findings: Sequence[Finding],
        *,
        on_select: Callable[[Finding], object] | None = None,
        on_goto: Callable[[Finding], object] | None = None,
    ) -> None:
        if on_select is not None and not callable(on_select):
            raise TypeError(
                f"on_select must be callable or None; got {type(on_select).__qualname__}."
            )
        self.on_select = on_select
        self.on_goto = on_goto
        self.findings: list[Finding] = []
        self.selected: Finding | None = None
        self.buttons: list[widgets.Button] = []
        self.header = widgets.HTML()
        self.groups = widgets.VBox()
        self.detail = widgets.HTML()
        self.detail.add_class("nbdebug-checks-detail")
        self.goto_button = widgets.Button(
            description="show in the Step tab", layout=widgets.Layout(width="auto", display="none")
        )
        self.goto_button.on_click(lambda _b: self._goto())
        self.widget = widgets.VBox(
            [widgets.HTML(STYLE), self.header, self.groups, self.detail, self.goto_button]
        )
        self.widget.add_class("nbdebug-checks")
        self.update(findings)

    # ------------------------------------------------------------------ content
    def update(self, findings: Sequence[Finding]) -> None:
        """Show another list of findings (clears the selection)."""
        if (
            isinstance(findings, Finding)
            or not isinstance(findings, Sequence)
            or not all(isinstance(f, Finding) for f in findings)
        ):
            raise TypeError(
                "findings must be a list of Finding (from nbdebug.check); got "
                f"{type(findings).__qualname__}."
            )
        self.findings = list(findings)
        self.selected = None
        by_index: dict[int, widgets.Button] = {}
        sections: list[widgets.Widget] = []
        for sev in SEVERITIES:
            group = [(i, f) for i, f in enumerate(self.findings) if f.severity == sev]
            if not group:
                continue
            sections.append(
                widgets.HTML(
                    f"<div style='margin-top:6px'>{badge(_count(len(group), sev), sev)}</div>"
                )
            )
            for i, f in group:
                b = widgets.Button(
                    description=_label(f),
                    tooltip=f.advice[:300],
                    button_style=_BUTTON_STYLE[sev],
                    layout=widgets.Layout(width="auto", max_width="900px"),
                )
                b.on_click(lambda _b, i=i: self.select(i))
                by_index[i] = b
                sections.append(b)
        ordered = [by_index[i] for i in range(len(self.findings))]
        with self.widget.hold_sync():
            old = self.buttons
            self.buttons = ordered
            self.header.value = self._header_html()
            self.groups.children = tuple(sections)
            self.detail.value = (
                "<i>click a finding for its evidence and advice</i>"
                if self.findings
                else "<i>no findings</i>"
            )
        for b in old:
            b.close()

    def _header_html(self) -> str:
        counts = self.counts
        info = f" · {counts['info']} info" if counts["info"] else ""
        sev = "error" if counts["error"] else ("warning" if counts["warning"] else "ok")
        color = GREEN if sev == "ok" else COLORS[sev]
        return (
            f"<b>Health checks</b> <span class='nbdebug-badge' style='background:{color}'>"
            f"{html.escape(self.summary)}</span>{html.escape(info)}"
        )

    @property
    def summary(self) -> str:
        """Counts of errors and warnings, for the debugger's header badge."""
        return counts_summary(self.findings)

    @property
    def counts(self) -> dict[str, int]:
        """The number of findings per severity (:attr:`Findings.counts`)."""
        return Findings(self.findings).counts

    # ------------------------------------------------------------------ selection
    def select(self, index: int) -> Finding:
        """Select finding ``index`` (what a click does): show its details, call ``on_select``."""
        if not 0 <= index < len(self.findings):
            raise IndexError(f"finding index {index} out of range (0..{len(self.findings) - 1}).")
        f = self.findings[index]
        self.selected = f
        self.detail.value = detail_html(f)
        target = "Step" if f.event is not None else ("Layers" if f.param else None)
        self.goto_button.description = f"show in the {target} tab" if target else ""
        self.goto_button.layout.display = "" if target and self.on_goto else "none"
        if self.on_select is not None:
            self.on_select(f)
        return f

    def _goto(self) -> None:
        if self.selected is not None and self.on_goto is not None:
            self.on_goto(self.selected)

    def __repr__(self) -> str:
        return f"ChecksPanel({self.summary}, {len(self.findings)} findings)"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def _count(n: int, severity: str) -> str:
    """``"1 error"``, ``"2 errors"``, ``"3 info"``."""
    return f"{n} {severity}{'s' if n != 1 and severity != 'info' else ''}"


def _label(f: Finding) -> str:
    text = f"{f.code} · {f.where}"
    if f.step is not None:
        text += f" · step {f.step}"
    return text if len(text) <= 110 else text[:107] + "..."


def detail_html(f: Finding) -> str:
    """The selected finding: badge, code, where, advice, fix snippet and evidence table."""
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(str(k))}</td><td><code>{e(_value(v))}</code></td></tr>"
        for k, v in f.evidence.items()
    )
    jump = []
    if f.event is not None:
        jump.append(f"event #{f.event}")
    if f.param:
        jump.append(f"parameter {e(f.param)}")
    if f.rows:
        jump.append(e(rows_text(f.rows, 20)))
    if f.step is not None:
        jump.append(f"step {f.step}")
    parts = [
        f"{badge(f.severity, f.severity)} <b>{e(f.code)}</b> at {e(f.where)}",
        f"<div>{e(f.advice)}</div>",
    ]
    if f.fix:
        parts.append(f"<pre><code>{e(f.fix)}</code></pre>")
    if jump:
        parts.append(f"<div><i>{' · '.join(jump)}</i></div>")
    if rows:
        parts.append(f"<table>{rows}</table>")
    return "".join(parts)


def _value(v: object) -> str:
    if isinstance(v, float):
        return fmt_num(v, ".6g")
    text = str(v)
    return text if len(text) <= 200 else text[:197] + "..."


def build_tab(dbg: TabHost, ctx: TabContext) -> None:
    """The Checks tab: findings of the trace shown, wired to the Step and Layers tabs."""
    from ..analysis.checks import check

    def on_select(finding: Finding) -> None:
        if finding.event is not None:
            dbg.step.goto(finding.event)
        elif finding.param is not None:
            dbg.layers.select(finding.param)

    def on_goto(finding: Finding) -> None:
        dbg.select_tab("Step" if finding.event is not None else "Layers")

    def refresh(findings: Sequence[Finding]) -> None:
        worst = (
            "error"
            if any(f.severity == "error" for f in findings)
            else ("warning" if any(f.severity == "warning" for f in findings) else "info")
        )
        dbg.set_header_extra(badge(counts_summary(findings), worst), warned=worst != "info")

    def run_checks(trace: Trace) -> Findings:
        # a snapshot's checks read its optimizer state and history too (as check(snap) does)
        if ctx.snapshot is not None and trace is dbg.trace and dbg.error is None:
            try:
                return check(ctx.snapshot, loss_fn=ctx.loss_fn)
            except (TypeError, ValueError):
                pass
        return check(trace)

    findings = run_checks(dbg.trace)
    panel = ChecksPanel(findings, on_select=on_select, on_goto=on_goto)
    refresh(findings)
    dbg.add_tab("Checks", panel)

    def on_retrace(d: TabHost) -> None:
        fresh = run_checks(d.trace)
        panel.update(fresh)
        refresh(fresh)

    dbg.on_retrace(on_retrace)


FEATURE_TAB = FeatureTab("Checks", applies=lambda ctx: True, build=build_tab, order=10)
