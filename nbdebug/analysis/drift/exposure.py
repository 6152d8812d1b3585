"""Exposure: how much of a feature's drift reaches the model's output, in the output's units.

A feature's SHAP values are its contributions to the model's output (probability, log-odds,
regression target, module output: see ``DriftReport.output``). For each feature ``j``:

* ``shap_mean_shift``: current minus reference mean of its SHAP values. These add up,
  over the features, to the shift of the mean explained output (SHAP's local accuracy).
* ``exposure``: the Wasserstein-1 distance between its reference and current SHAP values,
  in output units: how far, on average, the feature's push on a prediction moved. Unlike
  the mean shift it also sees changes that cancel on average.
* ``exposure_noise``: what ``exposure`` is when nothing drifted: the same distance between
  two random halves of the reference (averaged over :data:`NOISE_SPLITS` splits), rescaled
  from two halves to the two batch sizes (a two-sample distance shrinks as
  ``sqrt(1/n_1 + 1/n_2)``).
* ``exposure_excess = max(exposure - exposure_noise, 0)`` and ``exposure_share``: its
  share of the features' total excess, i.e. the share of the prediction shift the
  feature explains (the bars of the panel).

The model acts on a feature's drift ("exposed") when both hold:

1. its SHAP distribution changed significantly (the KS test on its SHAP column, corrected
   with the other tests: see :mod:`nbdebug.analysis.drift`), so the flag keeps the
   stated level when nothing drifted; and
2. the change is material: ``exposure_excess >= EXPOSURE_MIN * output_scale``, where
   ``output_scale`` is the standard deviation of the explained output over the reference
   rows (the sum of each row's SHAP values). With ``EXPOSURE_MIN = 0.05`` a feature whose
   drift moves its push on predictions by less than 5% of their spread is "input only":
   the model sees the input move but its predictions do not.

The quadrant of a feature then comes from input drift and exposure (:func:`quadrant`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

EXPOSURE_MIN = 0.05
NOISE_SPLITS = 10
QUADRANTS = ("input+explanation", "input only", "explanation only", "none")
#: the quadrants of the features whose drift the model acts on
EXPOSED_QUADRANTS = (QUADRANTS[0], QUADRANTS[2])


def quadrant(drifted_input: bool, exposed: bool) -> str:
    """``input+explanation``: the input drifted and the model acts on it; ``input only``:
    the input drifted, predictions do not move with it; ``explanation only``: the input
    did not drift but its push on predictions did (through features it interacts with);
    ``none``."""
    if drifted_input and exposed:
        return QUADRANTS[0]
    if drifted_input:
        return QUADRANTS[1]
    if exposed:
        return QUADRANTS[2]
    return QUADRANTS[3]


def _w1_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.stats import wasserstein_distance

    return np.array([wasserstein_distance(a[:, j], b[:, j]) for j in range(a.shape[1])])


def output_scale(sr: np.ndarray) -> float:
    """Standard deviation of the explained output over the reference rows (the row sums
    of the SHAP values; the base value is a constant)."""
    return float(np.std(sr.sum(axis=1)))


def exposure_table(
    sr: np.ndarray, sc: np.ndarray, names: list[str], *, random_state: int = 0
) -> tuple[pd.DataFrame, float]:
    """Per-feature exposure (see the module docstring).

    Parameters
    ----------
    sr, sc : numpy.ndarray
        float64 SHAP values ``(m_reference, d)`` and ``(m_current, d)``.

    Returns
    -------
    (table, scale)
        ``table``: index ``feature``; columns ``shap_mean_shift``, ``exposure``,
        ``exposure_noise``, ``exposure_excess``, ``exposure_share``, ``material``
        (bool). ``scale``: :func:`output_scale`.
    """
    m_r, m_c = len(sr), len(sc)
    exposure = _w1_columns(sr, sc)
    noise = np.zeros(sr.shape[1])
    half = m_r // 2
    if half >= 2:
        rng = np.random.default_rng(random_state)
        for _ in range(NOISE_SPLITS):
            perm = rng.permutation(m_r)
            noise += _w1_columns(sr[perm[:half]], sr[perm[half : 2 * half]])
        noise /= NOISE_SPLITS
        noise *= math.sqrt((1 / m_r + 1 / m_c) / (2 / half))
    excess = np.maximum(exposure - noise, 0.0)
    total = float(excess.sum())
    share = excess / total if total > 0 else np.zeros_like(excess)
    scale = output_scale(sr)
    material = excess >= EXPOSURE_MIN * scale if scale > 0 else excess > 0
    table = pd.DataFrame(
        {
            "feature": names,
            "shap_mean_shift": sc.mean(axis=0) - sr.mean(axis=0),
            "exposure": exposure,
            "exposure_noise": noise,
            "exposure_excess": excess,
            "exposure_share": share,
            "material": material.astype(bool),
        }
    ).set_index("feature")
    return table, scale
