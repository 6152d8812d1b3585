"""The snapshot files of a directory as a table (:func:`list_snapshots`), and the earliest
readable one (:func:`earliest_snapshot`)."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .archive import read_payload
from .format import SUFFIX, SnapshotError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["earliest_snapshot", "list_snapshots"]


def list_snapshots(directory: str | os.PathLike[str]) -> pd.DataFrame:
    """The snapshot files in ``directory``, oldest step first.

    Returns
    -------
    pandas.DataFrame
        Columns ``path`` (str), ``step`` (Int64), ``kind``, ``reason`` (the message),
        ``time`` (datetime64) and ``error`` (why a file could not be read, else ``None``).
        Tensors are memory-mapped, not read.
    """
    import pandas as pd

    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"directory must be a str or os.PathLike; got {type(directory).__qualname__}."
        )
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d} is not a directory.")
    rows: list[tuple[object, ...]] = []
    for p in sorted(d.glob(f"*{SUFFIX}")):
        try:
            payload = read_payload(p, map_location="cpu", mmap=True)
        except SnapshotError as e:
            rows.append((str(p), None, None, None, pd.NaT, str(e)))
            continue
        t = pd.Timestamp(_dt.datetime.fromtimestamp(float(payload["time"])))
        reason = payload["reason"]
        rows.append((str(p), payload["step"], reason["kind"], reason["message"], t, None))
    df = pd.DataFrame.from_records(
        rows, columns=["path", "step", "kind", "reason", "time", "error"]
    )
    df["step"] = df["step"].astype("Int64")
    df["time"] = pd.to_datetime(df["time"])
    return df.sort_values(["step", "path"], na_position="last").reset_index(drop=True)


def earliest_snapshot(directory: str | os.PathLike[str]) -> Path:
    """The readable snapshot file of ``directory`` with the earliest step (a file that
    cannot be read is passed over).

    Raises
    ------
    SnapshotError
        The directory holds no readable snapshot file.
    """
    df = list_snapshots(directory)
    ok = df[df["error"].isna()]
    if ok.empty:
        raise SnapshotError(f"{Path(directory)} holds no readable snapshot file.")
    return Path(ok["path"].iloc[0])
