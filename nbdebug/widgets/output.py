"""Fill an ``ipywidgets.Output`` from the kernel: its ``outputs`` are set, nothing is captured.

The usual way, ``out.clear_output(wait=True)`` then ``with out: display(obj)``, has the front
end capture the display messages into the widget. Where the front end is emulated, as by
nbclient (nbconvert, papermill, the lesson tests), each captured message makes the client
send the widget's whole ``outputs`` back to the kernel on the shell channel while it waits for
the cell's reply on that same socket; the pending wait then misses the reply (an edge of
zmq's notification is consumed by the send) and the cell stalls for the client's whole cell
timeout, without an error (jupyter/nbclient#312). In a terminal shell the same calls print
clear-line codes. Setting ``outputs`` is one ordinary state update instead: the front end
(JupyterLab, Notebook 7, VS Code) draws it as it would the captured messages, nothing is sent
back, and an unchanged output sends nothing at all (traitlets skips an equal value).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets


def display_output(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``display_data`` output (nbformat's dict) for a mime bundle ``data``."""
    return {"output_type": "display_data", "data": data, "metadata": metadata or {}}


def object_output(obj: Any) -> dict[str, Any]:
    """The ``display_data`` output that ``IPython.display.display(obj)`` would publish: the
    running shell's formatters (a user's own included), or IPython's defaults outside one."""
    from IPython.core.formatters import DisplayFormatter
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance() if InteractiveShell.initialized() else None
    formatter = shell.display_formatter if shell is not None else None
    data, metadata = (formatter or DisplayFormatter()).format(obj)
    return display_output(data, metadata)


def show_outputs(out: widgets.Output, *outputs: dict[str, Any]) -> None:
    """Replace what ``out`` shows by ``outputs`` (none: clear it)."""
    out.outputs = tuple(outputs)
