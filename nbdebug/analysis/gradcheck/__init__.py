"""Gradient checks that say *which* input, *which* output and *which* elements disagree:
:func:`gradcheck` (:mod:`.run`) and the module sweep :func:`gradcheck_modules`
(:mod:`.sweep`).

Modules, one job each: :mod:`.inputs` (options, function and inputs, validated),
:mod:`.problem` (``fn`` on copies), :mod:`.layout` (which Jacobian elements, measured how),
:mod:`.verdicts` (the tolerance, the verdicts and their text), :mod:`.result` (the result
types).
"""

from __future__ import annotations

from .inputs import GradcheckOptions
from .result import GradcheckResult, PairCheck
from .run import check_pairs, gradcheck, run_gradcheck
from .sweep import SweepOptions, gradcheck_modules
from .verdicts import VERDICTS, Verdict

__all__ = [
    "VERDICTS",
    "GradcheckOptions",
    "GradcheckResult",
    "PairCheck",
    "SweepOptions",
    "Verdict",
    "check_pairs",
    "gradcheck",
    "gradcheck_modules",
    "run_gradcheck",
]
