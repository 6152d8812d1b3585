"""The debugger's CSS, in one place: every panel puts :data:`STYLE` in its widget tree
(the rules are scoped by each panel's own class, so showing it twice is harmless)."""

from __future__ import annotations

from ..figures.palette import GREEN, GREY, HIGHLIGHT, MUTED_TEXT, PURPLE, RED, RULE

STYLE = f"""<style>
.nbdebug-events select {{ font-family: var(--jp-code-font-family, monospace); font-size: 12px; }}
.nbdebug-detail table {{ border-collapse: collapse; font-size: 12px; }}
.nbdebug-detail td, .nbdebug-detail th {{ padding: 1px 8px; text-align: right; }}
.nbdebug-detail .nbdebug-bad {{ color: {RED}; font-weight: bold; }}
.nbdebug-badge {{ padding: 2px 8px; border-radius: 4px; color: white; font-weight: bold; }}
.nbdebug-badge-ok {{ background: {GREEN}; }}
.nbdebug-badge-bad {{ background: {RED}; }}
.nbdebug-badge-plain {{ background: {GREY}; }}
.nbdebug-gc-table select {{ font-family: var(--jp-code-font-family, monospace); font-size: 12px; }}
.nbdebug-gc-head {{
  font-family: var(--jp-code-font-family, monospace); font-size: 12px; white-space: pre;
}}
.nbdebug-checks .widget-button {{ text-align: left; justify-content: flex-start; }}
.nbdebug-checks-detail table {{ border-collapse: collapse; font-size: 12px; }}
.nbdebug-checks-detail td {{ padding: 1px 8px; }}
.nbdebug-checks-detail pre {{ margin: 4px 0; }}
.nbdebug-params td, .nbdebug-params th {{ padding: 1px 8px; text-align: right; font-size: 12px; }}
.nbdebug-params .nbdebug-bad {{ color: {RED}; font-weight: bold; }}
.nbdebug-params .nbdebug-warn {{ color: {PURPLE}; }}
.nbdebug-params .nbdebug-selected {{ background: {HIGHLIGHT}; }}
.nbdebug-fixes table.fixes {{ border-collapse: collapse; font-size: 12px; }}
.nbdebug-fixes table.fixes td, .nbdebug-fixes table.fixes th {{
  padding: 2px 8px; text-align: left; border-bottom: 1px solid {RULE}; vertical-align: top;
}}
.nbdebug-fixes table.fixes pre {{ margin: 0; font-size: 11px; white-space: pre-wrap; }}
.nbdebug-fixes .bad {{ color: {RED}; font-weight: 600; }}
.nbdebug-fixes .note {{ color: {MUTED_TEXT}; font-style: italic; }}
</style>"""
