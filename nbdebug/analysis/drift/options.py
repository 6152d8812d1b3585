"""The options of :func:`nbdebug.drift`, grouped as a user thinks of them: one frozen
:class:`DriftOptions` value, validated once, passed once.

>>> opts = DriftOptions.build(alpha=0.01, explainer="kernel", background=30)
>>> opts.significance.alpha, opts.explain.explainer
(0.01, 'kernel')
>>> nbdebug.drift(model, ref, cur, options=opts)          # or the same names as keywords
>>> nbdebug.drift(model, ref, cur, alpha=0.01, explainer="kernel", background=30)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from ...core.options import field_names, grouped_options
from .clustering import CLUSTER_METHODS
from .sample import DEFAULT_SAMPLING_ERROR
from .statistics import CORRECTIONS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

EXPLAINERS = ("auto", "tree", "linear", "deep", "gradient", "kernel", "permutation")
NAN_POLICIES = ("raise", "impute")

Output = int | Literal["auto", "predicted"]
Auto = Literal["auto"]


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_fraction(v: object) -> bool:
    """A number strictly between 0 and 1."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1


@dataclass(frozen=True)
class ExplainOptions:
    """What is explained, and how.

    explainer : {"auto", "tree", "linear", "deep", "gradient", "kernel", "permutation"}
    background : int
        Reference rows sampled as the explainer's background.
    output : "auto", "predicted" or int
        Which model output is explained when there are several.
    sampling_error : float
        DKW bound on each explained batch's SHAP CDFs (sets the subsample size).
    """

    explainer: str = "auto"
    background: int = 100
    output: Output = "auto"
    sampling_error: float = DEFAULT_SAMPLING_ERROR

    def __post_init__(self) -> None:
        if self.explainer not in EXPLAINERS:
            raise ValueError(f"explainer must be one of {EXPLAINERS}; got {self.explainer!r}.")
        if not _is_int(self.background) or self.background < 1:
            raise ValueError(
                f"background must be a positive number of reference rows; got {self.background!r}."
            )
        if not _is_fraction(self.sampling_error):
            raise ValueError(
                f"sampling_error must be a number strictly between 0 and 1; got "
                f"{self.sampling_error!r}."
            )
        if self.output not in ("auto", "predicted") and not _is_int(self.output):
            raise ValueError(
                f"output must be 'auto', 'predicted' or an integer; got {self.output!r}."
            )


@dataclass(frozen=True)
class SignificanceOptions:
    """How the tests decide.

    alpha : float
        Level of the tests, after correction.
    correction : {"fdr", "bonferroni"}
        Within each test family; a weighted Holm step across them.
    n_permutations : "auto" or int
        Permutations of the cluster-share test.
    """

    alpha: float = 0.05
    correction: str = "fdr"
    n_permutations: int | Auto = "auto"

    def __post_init__(self) -> None:
        if not _is_fraction(self.alpha):
            raise ValueError(
                f"alpha must be a number strictly between 0 and 1; got {self.alpha!r}."
            )
        if self.correction not in CORRECTIONS:
            raise ValueError(
                f"correction must be one of {tuple(CORRECTIONS)}; got {self.correction!r}."
            )
        if self.n_permutations != "auto" and (
            not _is_int(self.n_permutations) or int(self.n_permutations) < 1
        ):
            raise ValueError(
                f"n_permutations must be 'auto' or a positive integer; got {self.n_permutations!r}."
            )

    @property
    def permutations(self) -> int:
        """``n_permutations``, with ``"auto"`` resolved: the smallest attainable p-value,
        ``1 / (B + 1)``, stays well below ``alpha / 4``."""
        if self.n_permutations == "auto":
            return max(999, math.ceil(40 / self.alpha))
        return int(self.n_permutations)


@dataclass(frozen=True)
class ClusterOptions:
    """How SHAP space is clustered.

    n_clusters : "auto" or int
        ``"auto"``: k in 2..8 by silhouette.
    cluster_method : {"kmeans", "agglomerative"}
    """

    n_clusters: int | Auto = "auto"
    cluster_method: str = "kmeans"

    def __post_init__(self) -> None:
        if self.n_clusters != "auto" and (not _is_int(self.n_clusters) or int(self.n_clusters) < 2):
            raise ValueError(
                f"n_clusters must be 'auto' or an integer >= 2; got {self.n_clusters!r}."
            )
        if self.cluster_method not in CLUSTER_METHODS:
            raise ValueError(
                f"cluster_method must be one of {CLUSTER_METHODS}; got {self.cluster_method!r}."
            )


@dataclass(frozen=True)
class InputOptions:
    """What is done with inputs that are not clean numbers.

    one_hot : bool
        One-hot encode non-numeric columns instead of refusing them.
    nan_policy : {"raise", "impute"}
        Refuse NaN/inf values, or replace them with the reference median.
    """

    one_hot: bool = False
    nan_policy: str = "raise"

    def __post_init__(self) -> None:
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}; got {self.nan_policy!r}.")


@dataclass(frozen=True)
class DriftOptions:
    """Every option of :func:`nbdebug.drift` (see its docstring), in four groups plus the
    seed and the progress bars.

    Build it from the flat keyword names with :meth:`build`; change some with
    :meth:`replace`. Invalid values raise ``ValueError`` when the value is made.

    Attributes
    ----------
    explain : ExplainOptions
        Which SHAP explainer, on how many samples.
    significance : SignificanceOptions
        The tests, their level and the multiple-testing correction.
    clusters : ClusterOptions
        How explanations are clustered by sample.
    inputs : InputOptions
        How the two batches are read (one-hot groups, NaN policy).
    random_state : int
    progress : bool

    Examples
    --------
    >>> opts = nbdebug.DriftOptions.build(alpha=0.01, explainer="tree")
    >>> nbdebug.drift(model, X_ref, X_new, options=opts)
    """

    explain: ExplainOptions = field(default_factory=ExplainOptions)
    significance: SignificanceOptions = field(default_factory=SignificanceOptions)
    clusters: ClusterOptions = field(default_factory=ClusterOptions)
    inputs: InputOptions = field(default_factory=InputOptions)
    random_state: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.random_state):
            raise ValueError(f"random_state must be an integer; got {self.random_state!r}.")

    @classmethod
    def names(cls) -> list[str]:
        """The flat option names, as :func:`nbdebug.drift` takes them as keywords."""
        return [*(n for g in GROUPS.values() for n in field_names(g)), "random_state", "progress"]

    @classmethod
    def build(cls, **flat: object) -> DriftOptions:
        """Options from the flat keyword names (``alpha=``, ``explainer=``, ...)."""
        return cls().updated(flat, "DriftOptions.build()")

    def replace(self, **flat: object) -> DriftOptions:
        """A copy with the options named by their flat keyword names changed."""
        return self.updated(flat, "DriftOptions.replace()")

    def updated(self, flat: Mapping[str, object], where: str) -> DriftOptions:
        """A copy with the options ``flat`` (flat keyword names) of the call ``where``.

        Raises
        ------
        TypeError
            A name that is no option: the message names it and lists the options.
        ValueError
            An invalid value.
        """
        return grouped_options(self, GROUPS, flat, where=where)


#: The nested groups of :class:`DriftOptions`, by attribute.
GROUPS: dict[str, type[DataclassInstance]] = {
    "explain": ExplainOptions,
    "significance": SignificanceOptions,
    "clusters": ClusterOptions,
    "inputs": InputOptions,
}


def resolve(options: DriftOptions | None, flat: Mapping[str, object], where: str) -> DriftOptions:
    """``options`` (default: the defaults) with the keyword options ``flat`` of the call
    ``where`` applied."""
    base = DriftOptions() if options is None else options
    if not isinstance(base, DriftOptions):
        raise TypeError(f"options must be a DriftOptions; got {type(base).__qualname__}.")
    return base.updated(flat, where)
