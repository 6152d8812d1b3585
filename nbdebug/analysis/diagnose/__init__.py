"""``nbdebug.diagnose()``: replay the failing step with candidate fixes and rank the causes
by what removes the non-finite value.

Modules, one job each:

- :mod:`.api`: :func:`diagnose`, the entry point (resolve, trace, menu, replays, rank);
- :mod:`.options`: :class:`DiagnoseOptions`, its keyword options checked;
- :mod:`.workbench`: copies of the step, reset and replayed under a fix;
- :mod:`.fix`: the :class:`Fix` protocol and the :class:`Replay` a fix changes;
- :mod:`.fix_epsilon` (with :mod:`.rewrite`, the op rewriting), :mod:`.fix_rows`,
  :mod:`.fix_float32`, :mod:`.fix_optim`, :mod:`.fix_pseudo`: the fix families;
- :mod:`.menu` (with :mod:`.probe`): the candidate fixes for a traced step;
- :mod:`.history`: the guard's history (healthy reference, divergence);
- :mod:`.rank`: the ranking; :mod:`.text`: the sentences;
- :mod:`.result`: :class:`Diagnosis`, :class:`Cause`, :class:`FixResult`,
  :class:`StepOutcome`.
"""

from .api import diagnose
from .fix import KINDS, Fix, Replay
from .fix_epsilon import EpsilonFix
from .fix_float32 import Float32Fix
from .fix_optim import ClipGradFix, LowerLRFix, ScalerFix
from .fix_pseudo import NotReproducible, WeightsCorrupted
from .fix_rows import DropRowsFix
from .options import DiagnoseOptions
from .result import Cause, Diagnosis, FixResult, StepOutcome
from .workbench import Workbench

__all__ = [
    "KINDS",
    "Cause",
    "ClipGradFix",
    "DiagnoseOptions",
    "Diagnosis",
    "DropRowsFix",
    "EpsilonFix",
    "Fix",
    "FixResult",
    "Float32Fix",
    "LowerLRFix",
    "NotReproducible",
    "Replay",
    "ScalerFix",
    "StepOutcome",
    "WeightsCorrupted",
    "Workbench",
    "diagnose",
]
