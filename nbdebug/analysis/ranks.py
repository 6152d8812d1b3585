"""Compare the per-rank snapshots of one distributed step: :func:`compare_ranks`.

A guarded distributed run writes one file per rank for a bad step
(``step-000000003-rank0.nbsnap``, ``...-rank1.nbsnap``; see :mod:`nbdebug.core.guard.agreement`).
The report says, per rank, what that rank saw locally, where its first non-finite value was
produced (a replay of that rank's own batch, when a model is given) and whether its
parameters agree with the other replicas'.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.display import show as show_result
from ..core.guard.replicas import fingerprint, replica_differences
from ..core.snapshot import RANK_NAME, SUFFIX, Snapshot, SnapshotError, load_snapshot
from ..core.vocab import Phase

if TYPE_CHECKING:
    import pandas as pd

#: A model as :func:`nbdebug.load_snapshot` takes it: a module or a factory.
ModelSource = torch.nn.Module | Callable[[], torch.nn.Module]


@dataclass
class RankRow:
    """One rank of :class:`RanksReport`.

    Attributes
    ----------
    rank : int
    path : pathlib.Path
    kind : str
        The rank's verdict: ``"loss"``, ``"grad"``, ``"weights"``, ``"scale"`` (seen on this
        rank) or ``"rank"`` (only another rank's values were not finite).
    local_first : bool or None
        The rank saw the non-finite value itself, before the guard's agreement (``None``:
        the snapshot holds no distributed record).
    culprit : bool
        The run's record names this rank as a culprit.
    loss : float or None
    origin_phase, origin_module, origin_op : str or None
        Where the replay of this rank's batch produced the first non-finite value
        (``None``: not replayed, or finite on replay).
    origin_rows : list of int
        The batch rows concerned.
    replay_error : str or None
        Why the replay failed, when it did.
    params_agree : bool or None
        This rank's parameters equal the majority's (``None``: nothing to compare).
    first_differing_param : str or None
    """

    rank: int
    path: Path
    kind: str
    local_first: bool | None
    culprit: bool
    loss: float | None
    replayed: bool = False
    origin_phase: Phase | None = None
    origin_module: str | None = None
    origin_op: str | None = None
    origin_rows: list[int] = field(default_factory=list)
    replay_error: str | None = None
    params_agree: bool | None = None
    first_differing_param: str | None = None

    @property
    def where(self) -> str:
        if not self.replayed:
            return (
                "not replayed"
                if self.replay_error is None
                else f"replay failed: {self.replay_error}"
            )
        if self.origin_phase is None:
            return "finite on replay"
        module = f" {self.origin_module!r}" if self.origin_module else ""
        rows = f" rows {self.origin_rows}" if self.origin_rows else ""
        op = f" ({self.origin_op})" if self.origin_op else ""
        return f"{self.origin_phase}{module}{rows}{op}"


@dataclass
class RanksReport:
    """What :func:`compare_ranks` found.

    Attributes
    ----------
    step : int or None
    world_size : int
    rows : list of RankRow
        One per rank, in rank order.
    culprit_ranks : list of int
        As recorded by the guard (see :func:`nbdebug.core.guard.agreement.culprit_ranks`).
    replayed_culprits : list of int
        The ranks whose own batch produces a non-finite value on replay (empty when not
        replayed): this tells the rank even when DDP spread the NaN to every gradient.
    params_agree : bool or None
        Every rank's parameters are equal (``None``: no fingerprints to compare).
    first_differing_param : str or None
    missing_ranks : list of int
        Ranks of ``range(world_size)`` without a snapshot.
    """

    step: int | None
    world_size: int
    rows: list[RankRow]
    culprit_ranks: list[int]
    replayed_culprits: list[int]
    params_agree: bool | None
    first_differing_param: str | None
    missing_ranks: list[int]

    def to_frame(self) -> pd.DataFrame:
        """One row per rank: ``rank``, ``kind``, ``local_first``, ``culprit``, ``loss``,
        ``first_nonfinite`` (where, as text), ``origin_module``, ``origin_rows``,
        ``params_agree``, ``first_differing_param``, ``path``."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "rank": r.rank,
                    "kind": r.kind,
                    "local_first": r.local_first,
                    "culprit": r.culprit,
                    "loss": r.loss,
                    "first_nonfinite": r.where,
                    "origin_module": r.origin_module,
                    "origin_rows": list(r.origin_rows),
                    "params_agree": r.params_agree,
                    "first_differing_param": r.first_differing_param,
                    "path": str(r.path),
                }
                for r in self.rows
            ]
        )

    def rank(self, rank: int) -> RankRow:
        """The row of ``rank``."""
        for r in self.rows:
            if r.rank == rank:
                return r
        raise KeyError(f"no snapshot of rank {rank}; ranks: {[r.rank for r in self.rows]}.")

    @property
    def ok(self) -> bool:
        """No rank is named a culprit, no replay produces a non-finite value, and the
        parameters do not differ between ranks."""
        return (
            not self.culprit_ranks and not self.replayed_culprits and self.params_agree is not False
        )

    def summary(self) -> str:
        """One sentence: the step, the ranks, the culprits and whether the parameters agree."""
        if self.params_agree is None:
            params = "parameters not compared"
        elif self.params_agree:
            params = "parameters equal on every rank"
        else:
            params = f"parameters differ, first {self.first_differing_param!r}"
        missing = f", missing rank(s) {self.missing_ranks}" if self.missing_ranks else ""
        replayed = (
            f", replay: rank(s) {self.replayed_culprits} produce it"
            if self.replayed_culprits
            else ""
        )
        return (
            f"step {self.step}, {len(self.rows)} of {self.world_size} ranks{missing}: culprit "
            f"rank(s) {self.culprit_ranks}{replayed}; {params}."
        )

    def show(self, **options: object) -> Any:
        """The per-rank panel for this report (an ``ipywidgets`` widget)."""
        return show_result(self, **options)

    def __repr__(self) -> str:
        lines = [f"RanksReport({self.summary().removesuffix('.')})"]
        for r in self.rows:
            seen = {True: "local", False: "via agreement", None: "?"}[r.local_first]
            if r.params_agree is None:
                agree = "params not compared"
            else:
                agree = (
                    "params equal" if r.params_agree else f"differs at {r.first_differing_param!r}"
                )
            mark = " *" if r.culprit else ""
            lines.append(f"  rank {r.rank}{mark}: {r.kind} ({seen}); {r.where}; {agree}")
        return "\n".join(lines)


def _rank_of(snap: Snapshot) -> int | None:
    if snap.rank is not None:
        return snap.rank
    m = RANK_NAME.search(snap.path.name) if snap.path is not None else None
    return int(m.group(1)) if m else None


def _paths(paths_or_directory: object) -> list[Path]:
    if isinstance(paths_or_directory, (str, os.PathLike)):
        d = Path(paths_or_directory)
        if d.is_dir():
            found = sorted(p for p in d.glob(f"*{SUFFIX}") if RANK_NAME.search(p.name))
            if not found:
                raise ValueError(
                    f"the directory {d} holds no per-rank snapshots (step-...-rankN{SUFFIX}, "
                    "written by a distributed run's NaNGuard); open one snapshot file instead "
                    "(nbdebug.list_snapshots lists them)."
                )
            return found
        if not d.exists():
            raise ValueError(f"{d} does not exist: expected a directory or snapshot files.")
        return [d]
    if isinstance(paths_or_directory, Sequence) and paths_or_directory:
        out = []
        for p in paths_or_directory:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(
                    f"expected snapshot paths (str or os.PathLike); got a {type(p).__qualname__}."
                )
            out.append(Path(p))
        return out
    raise TypeError(
        "compare_ranks expects a directory or a non-empty list of snapshot paths; got "
        f"{type(paths_or_directory).__qualname__}."
    )


def compare_ranks(
    paths_or_directory: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    model: ModelSource | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    step: int | None = None,
    trust_recipe: bool = False,
) -> RanksReport:
    """Compare the per-rank snapshots of one step of a distributed run.

    Parameters
    ----------
    paths_or_directory : str, PathLike or list of them
        A directory holding ``step-...-rankN.nbsnap`` files, or the files.
    model : torch.nn.Module or callable, optional
        The architecture (as for :func:`nbdebug.load_snapshot`): each rank's batch is then
        replayed (:meth:`Snapshot.trace`) to find where its first non-finite value is produced.
    loss_fn : callable, optional
        Overrides the recorded loss function for the replays.
    step : int, optional
        Which step, when the files hold several (default: the earliest).
    trust_recipe : bool
        Build the model from the recorded recipe (see :func:`nbdebug.load_snapshot`).

    Returns
    -------
    RanksReport

    Raises
    ------
    TypeError
        A ``step`` that is not an int.
    ValueError
        No per-rank snapshot, the step asked for is absent, or two files claim the same rank.
    nbdebug.SnapshotError
        A file cannot be read.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step expects an int (or None: the earliest); got {step!r}.")
    paths = _paths(paths_or_directory)
    snaps = [load_snapshot(p, trust_recipe=trust_recipe) for p in paths]
    step, chosen = _one_step(snaps, step)
    ranks = sorted(chosen)
    world = max([chosen[r].world_size or 0 for r in ranks] + [ranks[-1] + 1])
    culprits = sorted({int(c) for r in ranks for c in chosen[r].culprit_ranks})
    names, prints = _fingerprints([chosen[r] for r in ranks])
    diffs = replica_differences(names, prints) if names is not None else []
    rows = []
    for i, r in enumerate(ranks):
        s = chosen[r]
        loss = s.reason.get("loss")
        mine = [name for name, bad in diffs if i in bad]
        row = RankRow(
            rank=r,
            path=Path(s.path) if s.path is not None else Path(),
            kind=s.kind,
            local_first=s.local_first,
            culprit=r in culprits,
            loss=float(loss) if isinstance(loss, (int, float)) else None,
            params_agree=None if names is None else not mine,
            first_differing_param=mine[0] if mine else None,
        )
        if model is not None:
            _replay(row, s.path, model, loss_fn, trust_recipe)
        rows.append(row)
    return RanksReport(
        step=step,
        world_size=world,
        rows=rows,
        culprit_ranks=culprits,
        replayed_culprits=[r.rank for r in rows if r.origin_phase is not None],
        params_agree=None if names is None else not diffs,
        first_differing_param=diffs[0][0] if diffs else None,
        missing_ranks=[r for r in range(world) if r not in chosen],
    )


def _one_step(snaps: list[Snapshot], step: int | None) -> tuple[int | None, dict[int, Snapshot]]:
    """The step to compare (``None``: the earliest) and its snapshot per rank."""
    steps = sorted({s.step for s in snaps if s.step is not None})
    if step is None:
        step = steps[0] if steps else None
    elif step not in steps:
        raise ValueError(f"no snapshot of step {step}; the files hold steps {steps}.")
    chosen: dict[int, Snapshot] = {}
    for s in snaps:
        if s.step != step:
            continue
        r = _rank_of(s)
        if r is None:
            raise ValueError(
                f"{s.path} is not a per-rank snapshot (no rank in its record or its name)."
            )
        if r in chosen:
            raise ValueError(
                f"two snapshots of step {step} claim rank {r}: {chosen[r].path} and {s.path}; "
                "pass the files of one run."
            )
        chosen[r] = s
    return step, chosen


def _fingerprints(snaps: list[Snapshot]) -> tuple[list[str] | None, list[torch.Tensor]]:
    """The names and per-rank fingerprints to compare: the guard's recorded ones (of the
    replicated parameters), else those of the stored states' floating tensors (buffers
    included)."""
    if len(snaps) < 2:
        return None, []
    recorded = [s.fingerprints for s in snaps]
    if all(isinstance(f, dict) and isinstance(f.get("values"), torch.Tensor) for f in recorded):
        names = [list(f["names"]) for f in recorded if f is not None]
        if all(n == names[0] for n in names):
            return names[0], [f["values"] for f in recorded if f is not None]

    def floating(s: Snapshot) -> list[str]:
        return [k for k, v in s.model_state.items() if v.is_floating_point() or v.is_complex()]

    keys = floating(snaps[0])
    if any(floating(s) != keys for s in snaps[1:]):
        return None, []
    return keys, [fingerprint([s.model_state[k] for k in keys]) for s in snaps]


def _replay(
    row: RankRow,
    path: Path | None,
    model: ModelSource,
    loss_fn: Callable[..., torch.Tensor] | None,
    trust_recipe: bool,
) -> None:
    if path is None:
        return
    try:
        snap = load_snapshot(path, model=model, trust_recipe=trust_recipe)
        tr = snap.trace(loss_fn=loss_fn)
    except (SnapshotError, RuntimeError, ValueError, TypeError) as e:
        row.replay_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return
    row.replayed = True
    origin = tr.origin
    if origin is not None:
        row.origin_phase = origin.phase
        row.origin_module = origin.module
        row.origin_op = getattr(origin, "op", None)
        row.origin_rows = list(origin.samples or [])


__all__ = ["RankRow", "RanksReport", "compare_ranks"]
