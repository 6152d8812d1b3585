"""The debugger over a directory of per-rank snapshots (``nbdebug.debug(directory)``,
``%nbdebug snapshots/ --model make_model``): rank selector, compare-ranks table."""

from __future__ import annotations

import distributed_helpers as h
import pytest
import torch
import torch.nn.functional as F
from IPython.core.interactiveshell import InteractiveShell

import nbdebug
from nbdebug import magics
from nbdebug.widgets.ranks import RanksDebugger


def write_rank_snapshots(tmp_path, culprits=(1,)):
    """Per-rank snapshots of step 3 as a 2-rank run writes them: rank 1's batch holds a NaN;
    ``culprits``: the ranks the agreement named."""
    for rank in range(2):
        x, y = h.batch(rank, 3)
        if rank == 1:
            x[2, 1] = float("nan")
        nbdebug.save_snapshot(
            tmp_path / f"step-000000003-rank{rank}.nbsnap",
            h.make_model(),
            x,
            y,
            step=3,
            reason={"kind": "loss" if rank else "grad", "message": "m"},
            loss_fn=F.mse_loss,
            rank=rank,
            world_size=2,
            local_first=True,
            culprit_ranks=list(culprits),
        )
    return tmp_path


@pytest.fixture
def rank_dir(tmp_path):
    return write_rank_snapshots(tmp_path)


def test_with_every_rank_a_culprit_the_debugger_opens_the_one_whose_replay_shows_it(tmp_path):
    # a gradient-only NaN: the agreement names every rank; the replay tells which
    dbg = nbdebug.debug(write_rank_snapshots(tmp_path, (0, 1)), model=h.make_model)
    try:
        assert dbg.rank == 1 and dbg.debugger.trace.origin is not None
    finally:
        dbg.close()


def test_debug_directory_opens_the_culprit_rank_with_the_table(rank_dir):
    dbg = nbdebug.debug(rank_dir, model=h.make_model)
    try:
        assert isinstance(dbg, RanksDebugger)
        assert [o[1] for o in dbg.selector.options] == [0, 1]
        assert dbg.selector.options[1][0] == "rank 1 *"
        assert dbg.rank == 1  # the culprit first
        assert dbg.debugger.trace.origin.phase == "input"
        assert dbg.body.children == (dbg.debugger.widget,)
        html = dbg.debugger.header.value  # the table sits in the rank's debugger header
        assert "culprit rank(s) [1]" in html and "first_nonfinite" in html
        assert html.count("</tr>") == 3  # header row + one per rank
        dbg.selector.value = 0
        assert dbg.rank == 0 and dbg.debugger.trace.origin is None  # rank 0's batch is finite
        assert "culprit rank(s) [1]" in dbg.debugger.header.value
        assert dbg.body.children == (dbg.debugger.widget,)
        with pytest.raises(ValueError, match="no snapshot of rank 5"):
            dbg.select(5)
        assert "showing rank 0" in repr(dbg)
        with pytest.raises(TypeError, match="takes no inputs or target"):
            nbdebug.debug(rank_dir, torch.zeros(1), model=h.make_model)
    finally:
        dbg.close()


def test_magic_opens_a_directory_of_rank_snapshots(rank_dir, capsys):
    sh = InteractiveShell.instance()
    sh.user_ns["make_model"] = h.make_model
    sh.run_cell("%load_ext nbdebug")
    try:
        res = sh.run_cell(f"%nbdebug {rank_dir} --model make_model")
        assert res.success
        dbg = magics.open_debuggers()[-1]
        assert isinstance(dbg, RanksDebugger) and dbg.rank == 1
    finally:
        sh.run_cell("%unload_ext nbdebug")
        sh.user_ns.pop("make_model", None)
