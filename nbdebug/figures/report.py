"""What a snapshot says, for a terminal and for a self-contained HTML page.

Pure functions: a :class:`~nbdebug.core.snapshot.Snapshot` (and, when the step could be
replayed, its :class:`~nbdebug.core.trace.result.Trace`) in; facts, tables or an HTML string out.
:func:`report_html` inlines plotly.js once so the page works offline (no CDN).
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from typing import Any

from ..analysis.diagnose import Diagnosis
from ..core.batch import describe
from ..core.snapshot import Snapshot
from ..core.text import cost_text, fmt_num, row_numbers
from ..core.trace.result import Trace
from ..core.vocab import Phase
from .palette import MUTED_TEXT, OK, RED, RULE, TEXT


def largest(values: dict[str, float], k: int = 10) -> list[tuple[str, float]]:
    """The ``k`` largest entries, non-finite ones (NaN, inf) first."""

    def key(item: tuple[str, float]) -> tuple[int, float]:
        v = item[1]
        if isinstance(v, float) and math.isnan(v):
            return (0, 0.0)
        if math.isinf(v):
            return (1, 0.0)
        return (2, -v)

    clean = [(n, float(v)) for n, v in values.items() if isinstance(v, (int, float))]
    return sorted(clean, key=key)[:k]


def grad_norms(snap: Snapshot) -> dict[str, float]:
    """Per-parameter gradient norms the guard measured at the failing step (unscaled)."""
    d = snap.reason.get("grad_norms")
    return (
        {str(k): float(v) for k, v in d.items() if isinstance(v, (int, float))}
        if isinstance(d, dict)
        else {}
    )


def origin_facts(trace: Trace | None, snap: Snapshot | None = None) -> list[tuple[str, str]]:
    """(label, value) rows describing where the replay found the first NaN/Inf; a finite
    replay of a snapshot that recorded a failure says the failure did not reproduce (it
    is not called "healthy" under the recorded reason)."""
    if trace is None:
        return []
    summary = trace.summary()
    failure = snap.recorded_failure if snap is not None else None
    if trace.healthy and failure is not None:
        summary = (
            f"the replay is finite, although the run recorded {failure}: the failure did not "
            "reproduce (non-determinism, a module with state between calls, the autocast "
            "state, or hardware; nbdebug.diagnose says which)"
        )
    rows = [("summary", summary)]
    o = trace.origin
    if o is not None:
        rows += [
            ("phase", o.phase),
            (
                "module",
                "-"
                if o.phase in (Phase.INPUT, Phase.LOSS)
                else (o.module or "<model>") + (f" ({o.module_type})" if o.module_type else ""),
            ),
            (
                "tensor",
                # "output output (8, 1)" reads as a stutter: the kind once when it is the name
                f"{o.kind if o.name == o.kind else f'{o.kind} {o.name}'} {tuple(o.shape)} "
                f"{o.dtype}",
            ),
            ("op", o.op or "-"),
            ("source", o.source or "-"),
            ("samples", row_numbers(o.samples, 16) or "-"),
        ]
        if o.param:
            rows.append(("parameter", o.param))
        if o.note:
            rows.append(("note", o.note))
    elif trace.first_nonfinite is not None:
        rows.append(("first non-finite", trace.first_nonfinite.label))
    return rows


def _join(v: Any) -> str:
    """A list from the file as text (the file is data, not trusted to hold strings)."""
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) or "?"
    return "?" if v is None else str(v)


def snapshot_facts(snap: Snapshot) -> list[tuple[str, str]]:
    """(label, value) rows: file, step, reason, model, batch, environment."""
    env = snap.environment
    when = _dt.datetime.fromtimestamp(snap.time).strftime("%Y-%m-%d %H:%M:%S")
    entries = snap.state_entries()  # from the file's header: no weight is read
    n_params = sum(e.numel for e in entries.values() if e.is_floating)
    model = f"{snap.model_class} ({len(entries)} tensors, {n_params:,} floating-point values)"
    rows = [
        ("file", f"{snap.path} (format {snap.version}, written {when})"),
        ("step", fmt_num(snap.step)),
        ("reason", f"{snap.kind}: {snap.message}"),
        ("model", model),
        (
            "batch",
            f"inputs {describe(snap.inputs)}; target "
            f"{describe(snap.target) if snap.target is not None else '-'}",
        ),
        (
            "loss",
            f"{fmt_num(snap.reason.get('loss'))}"
            + (f", action {snap.reason['action']}" if "action" in snap.reason else ""),
        ),
        (
            "environment",
            f"torch {env.get('torch', '?')}, python {env.get('python', '?')}, devices "
            f"{_join(env.get('devices'))}, dtypes {_join(env.get('dtypes'))}"
            + (f", GPU {env['gpu']}" if env.get("gpu") else ""),
        ),
    ]
    if snap.recipe is not None:
        rows.append(("recipe", f"{snap.recipe['factory']}(**{snap.recipe['kwargs']})"))
    if snap.loss_fn_spec:
        rows.append(
            ("loss_fn", str(snap.loss_fn_spec.get("name") or snap.loss_fn_spec.get("repr")))
        )
    if snap.optimizer_class:
        rows.append(("optimizer", snap.optimizer_class))
    if snap.dropped:
        rows.append(("not stored", _join(snap.dropped)))
    rewind = snap.rewind_summary()  # from the header: no tensor of the window is read
    if rewind is not None:
        rows.append(("rewind", rewind))
    return rows


def history_table(snap: Snapshot, rows: int = 10) -> Any:
    """The last ``rows`` history rows as display strings (DataFrame; no ``time`` column).

    Loss and gradient norm are recorded every step, so a NaN there reads ``nan``; the
    parameter norm (measured every few steps), learning rate, scale and failure kind read
    ``-`` where nothing was recorded."""
    import pandas as pd

    df = snap.history_frame()
    df = df[[c for c in df.columns if c != "time"]].tail(rows)
    out = pd.DataFrame(index=df.index)
    for c in df.columns:
        if c in ("loss", "grad_norm"):
            out[c] = [fmt_num(float(v)) for v in df[c]]
        else:
            out[c] = [_history_cell(v) for v in df[c]]
    return out


def _history_cell(v: Any) -> str:
    """A history value as text: ``-`` where nothing was recorded; the codes of a list of
    findings (the guard's ``checks`` column), not their Python repr."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, (list, tuple)):
        codes = [str(x.get("code", "?")) if isinstance(x, dict) else str(x) for x in v]
        return ", ".join(codes) or "-"
    return fmt_num(v)


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _norm_table(title: str, items: list[tuple[str, float]]) -> str:
    if not items:
        return ""
    body = "".join(
        f"<tr><td>{html.escape(n)}</td><td "
        f'class="{"bad" if not math.isfinite(v) else ""}">{fmt_num(v)}</td></tr>'
        for n, v in items
    )
    return (
        f"<div><h3>{html.escape(title)}</h3>"
        f'<table class="norms"><tr><th>tensor</th><th>L2 norm</th></tr>{body}</table></div>'
    )


_CSS = f"""
body {{
  font-family: system-ui, -apple-system, Segoe UI, sans-serif;
  margin: 2em auto; max-width: 1100px; color: {TEXT};
}}
h1 {{ font-size: 1.5em; }}
h2 {{ font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid {RULE}; }}
table {{ border-collapse: collapse; margin: .5em 0; font-size: .9em; }}
th, td {{
  padding: 3px 10px; text-align: left; border-bottom: 1px solid #eee; vertical-align: top;
}}
table.facts th {{ color: {MUTED_TEXT}; white-space: nowrap; }}
.bad {{ color: {RED}; font-weight: 600; }}
.note {{ color: #666; font-style: italic; }}
.cols {{ display: flex; gap: 3em; flex-wrap: wrap; }}
table.fixes pre {{ margin: 0; font-size: .85em; white-space: pre-wrap; }}
table.fixes tr.finite td.finite {{ color: {OK}; font-weight: 600; }}
"""


def diagnosis_table(d: Diagnosis) -> str:
    """The ranked rows of a :class:`~nbdebug.analysis.diagnose.Diagnosis` as an HTML table
    (rank, kind, module, rows, finite, loss, gradient norm, cost, the change, the snippet
    to paste, the note)."""
    if not isinstance(d, Diagnosis):
        raise TypeError(f"diagnosis_table expects a Diagnosis; got {type(d).__qualname__}.")
    head = [
        "rank",
        "kind",
        "module",
        "rows",
        "finite",
        "loss",
        "grad norm",
        "cost",
        "change",
        "snippet",
        "note",
    ]
    body = []
    for _, r in d.to_frame().iterrows():
        cost = cost_text(r["cost"])
        cells = [
            html.escape(str(r["rank"])),
            html.escape(str(r["kind"])),
            html.escape(str(r["module"])),
            html.escape(row_numbers(list(r["rows"]), 16) or "-"),
            "yes" if r["finite"] else '<span class="bad">no</span>',
            html.escape(fmt_num(r["loss"])),
            html.escape(fmt_num(r["grad_norm"])),
            cost,
            html.escape(str(r["change"])),
            f"<pre>{html.escape(str(r['snippet']))}</pre>",
            html.escape(str(r["note"])),
        ]
        cls = "finite" if r["finite"] else ""
        body.append(
            f'<tr class="{cls}">'
            + "".join(
                f'<td class="finite">{c}</td>' if i == 4 else f"<td>{c}</td>"
                for i, c in enumerate(cells)
            )
            + "</tr>"
        )
    ths = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="fixes"><tr>{ths}</tr>{"".join(body)}</table>'


def diagnosis_section(d: Diagnosis) -> str:
    """The "Verified fixes" part of the report: the cause in one sentence and the table."""
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in d.notes)
    return (
        "<h2>Verified fixes (each replayed on the failing step)</h2>"
        f"<p><b>Cause:</b> {html.escape(d.cause.statement)}</p>{diagnosis_table(d)}{notes}"
    )


def report_html(
    snap: Snapshot,
    trace: Trace | None = None,
    *,
    note: str | None = None,
    rows: int = 20,
    top: int = 10,
    diagnosis: Diagnosis | None = None,
) -> str:
    """One self-contained HTML page about a snapshot.

    Parameters
    ----------
    snap : Snapshot
    trace : Trace, optional
        ``snap.trace()`` (the replay); without it the per-layer norm plot and the origin
        are left out and ``note`` says why.
    note : str, optional
        A sentence shown where the replay would be (e.g. "give --model to replay").
    rows : int
        History rows in the table.
    top : int
        Entries in each largest-norms table.
    diagnosis : Diagnosis, optional
        :func:`nbdebug.diagnose` of the snapshot: adds the ranked table of verified fixes.

    Returns
    -------
    str
        A complete HTML document with plotly.js inlined (no network access needed).
    """
    import plotly.graph_objects as go
    from plotly.offline import get_plotlyjs

    from .history import history_figure
    from .norms import norm_figure

    if not isinstance(snap, Snapshot):
        raise TypeError(f"report_html expects a Snapshot; got {type(snap).__qualname__}.")
    if trace is not None and not isinstance(trace, Trace):
        raise TypeError(f"trace must be an nbdebug Trace or None; got {type(trace).__qualname__}.")

    def figure(fig: go.Figure, div_id: str) -> str:
        return fig.to_html(
            full_html=False, include_plotlyjs=False, div_id=div_id, config={"displaylogo": False}
        )

    title = f"nbdebug snapshot: step {fmt_num(snap.step)}"
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="bad">{html.escape(snap.kind)}: {html.escape(snap.message)}</p>',
        _table(snapshot_facts(snap)),
        "<h2>Where the first NaN/Inf was produced (replay)</h2>",
    ]
    if trace is not None:
        parts.append(_table(origin_facts(trace, snap)))
    if note:
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    if diagnosis is not None:
        parts.append(diagnosis_section(diagnosis))

    parts.append("<h2>History</h2>")
    if snap.history:
        parts.append(
            figure(history_figure(snap.history_frame(), failing_step=snap.step), "nbdebug-history")
        )
        parts.append(history_table(snap, rows).to_html(index=False, border=0))
    else:
        parts.append('<p class="note">No history was recorded in this snapshot.</p>')

    parts.append("<h2>Per-layer norms</h2>")
    if trace is not None:
        current = trace.origin if trace.origin is not None else None
        parts.append(figure(norm_figure(trace, current=current), "nbdebug-norms"))
    else:
        parts.append('<p class="note">The per-layer norm plot needs the replay (see above).</p>')
    parts.append('<div class="cols">')
    parts.append(
        _norm_table("Largest gradient norms at the failing step", largest(grad_norms(snap), top))
    )
    parts.append(_norm_table("Largest parameter norms", largest(snap.param_norms(), top)))
    parts.append("</div>")
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script>'
        f"</head><body>\n{body}\n</body></html>\n"
    )
