"""nbdebug's colours: one home for every colour a figure, a panel or the HTML report uses.

The named colours are plotly's (and matplotlib's) default qualitative ones, so traces
drawn without an explicit colour still match. Meanings map onto them below: change a
meaning here and every figure and panel follows.
"""

from __future__ import annotations

BLUE = "#1f77b4"
ORANGE = "#ff7f0e"
GREEN = "#2ca02c"
RED = "#d62728"
PURPLE = "#9467bd"
GREY = "#7f7f7f"
BLACK = "black"
#: backgrounds and rules
LIGHT_GREY = "#e8e8e8"
RULE = "#ddd"
HIGHLIGHT = "#fff3b0"
#: text
TEXT = "#222"
MUTED_TEXT = "#555"

#: meanings
OK = GREEN
BAD = RED
WARN = ORANGE
INFO = BLUE
SEVERITY_COLORS = {"error": RED, "warning": ORANGE, "info": BLUE}
#: text on light cells (plotly's default text colour); white goes on dark ones
DARK_TEXT = "#2a3f5f"
