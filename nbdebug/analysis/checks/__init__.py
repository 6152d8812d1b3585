"""Health checks: :func:`check` turns the training-stability checklist into findings that
point at the cause (:mod:`.api`); the codes are one table (:mod:`.codes`).

Modules, one job each: :mod:`.base` (findings, thresholds, the context families read),
:mod:`.data`, :mod:`.origin` (the cause of the first NaN/Inf), :mod:`.forward` (warning
signs of the forward pass), :mod:`.precision`, :mod:`.grad`, :mod:`.optim` (optimizer,
schedule, clipping, scaler), :mod:`.state` (:func:`check_state_dict`), :mod:`.guard` (the
checks a :class:`~nbdebug.NaNGuard` runs on its live model).
"""

from __future__ import annotations

from .api import FAMILIES, CheckOptions, check, check_state_dict
from .base import CHECK_EVERY, Finding, Findings
from .codes import CODES, CheckCode, CheckGroup, Code
from .grad import RatioVerdict, judged, param_verdict, param_verdicts, ratio_verdict
from .guard import GuardChecks, parse_checks

__all__ = [
    "CHECK_EVERY",
    "CODES",
    "FAMILIES",
    "CheckCode",
    "CheckGroup",
    "CheckOptions",
    "Code",
    "Finding",
    "Findings",
    "GuardChecks",
    "RatioVerdict",
    "check",
    "check_state_dict",
    "judged",
    "param_verdict",
    "param_verdicts",
    "parse_checks",
    "ratio_verdict",
]
