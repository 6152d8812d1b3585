"""The distributed guard: 2 and 4 gloo processes on CPU agree on every step.

Each fixture is one spawned run (see ``distributed_helpers.launch``: free port, every
process joined or killed); the tests assert on what each rank returned.
"""

from __future__ import annotations

import functools

import distributed_helpers as h
import pytest
import torch

import nbdebug
from nbdebug.core.guard import RankError, fingerprint, first_mismatch
from nbdebug.core.guard.agreement import culprit_ranks
from nbdebug.core.snapshot import read_archive

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built in"
)


def _values(results: dict[int, dict], world: int) -> list[dict]:
    assert sorted(results) == list(range(world)), results
    for r in range(world):
        assert "value" in results[r], results[r].get("traceback", results[r])
    return [results[r]["value"] for r in range(world)]


@pytest.fixture(scope="module")
def batch_nan_2(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch2")
    return d, _values(h.launch(h.train, 2, str(d)), 2)


@pytest.fixture(scope="module")
def loss_nan_2(tmp_path_factory):
    d = tmp_path_factory.mktemp("loss2")
    return d, _values(h.launch(functools.partial(h.train, where="loss"), 2, str(d)), 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch4")
    return d, _values(h.launch(h.train, 4, str(d)), 4)


def _assert_step3_skipped_everywhere(values: list[dict], directory) -> None:
    world = len(values)
    for r, v in enumerate(values):
        assert v["oks"] == [True, True, True, False, True, True], (r, v["oks"])
        assert [s["name"] for s in v["snapshots"]] == [f"step-000000003-rank{r}.nbsnap"]
        assert v["finite"]
    assert len({v["hash"] for v in values}) == 1  # bit-identical replicas
    files = sorted(p.name for p in directory.glob("*.nbsnap"))
    assert files == [f"step-000000003-rank{r}.nbsnap" for r in range(world)]


@pytest.mark.timeout(120)
def test_nan_in_one_ranks_batch_every_rank_skips_that_step_only(batch_nan_2):
    directory, values = batch_nan_2
    _assert_step3_skipped_everywhere(values, directory)
    # the NaN reached every rank's gradients through DDP's all-reduce; rank 1's loss names it
    for r, v in enumerate(values):
        dist = v["snapshots"][0]["distributed"]
        assert dist["rank"] == r and dist["world_size"] == 2
        assert dist["local_first"] is True
        assert dist["culprit_ranks"] == [1]
        assert dist["rank_kinds"] == {"0": ["grad"], "1": ["loss", "grad"]}
    assert values[1]["snapshots"][0]["kind"] == "loss"
    assert values[0]["snapshots"][0]["kind"] == "grad"
    assert values[0]["snapshots"][0]["message"].endswith(
        "(rank 0 of 2; culprit rank(s) [1]: every rank skips this step)"
    )
    # each rank's snapshot holds its own batch: only rank 1's is not finite
    assert [v["snapshots"][0]["inputs_finite"] for v in values] == [True, False]


@pytest.mark.timeout(120)
def test_nan_only_in_one_ranks_loss_under_no_sync_every_rank_skips(loss_nan_2):
    directory, values = loss_nan_2
    _assert_step3_skipped_everywhere(values, directory)
    d0 = values[0]["snapshots"][0]["distributed"]
    d1 = values[1]["snapshots"][0]["distributed"]
    assert d1["local_first"] is True and d0["local_first"] is False
    assert d0["culprit_ranks"] == d1["culprit_ranks"] == [1]
    assert values[0]["snapshots"][0]["kind"] == "rank"  # rank 0 only learned it from rank 1
    assert values[0]["snapshots"][0]["message"] == (
        "another rank was not finite at step 3 (rank 1: non-finite loss); this rank's (rank 0) "
        "loss, gradients and weights are finite: every rank skips this step"
    )
    assert values[1]["snapshots"][0]["kind"] == "loss"


@pytest.mark.timeout(150)
def test_four_ranks_skip_together_and_stay_identical(four_ranks):
    directory, values = four_ranks
    _assert_step3_skipped_everywhere(values, directory)
    assert {tuple(v["snapshots"][0]["distributed"]["culprit_ranks"]) for v in values} == {(1,)}


@pytest.mark.timeout(150)
def test_replica_check_names_the_perturbed_parameter_and_rank(tmp_path):
    run = functools.partial(h.train, perturb=(2, 3), check_replicas_every=2, nan_step=99)
    values = _values(h.launch(run, 4, str(tmp_path)), 4)
    for v in values:
        assert all(v["oks"])
        # perturbed after step 3's update: steps 0 and 2 equal, step 4 the first check after
        assert v["replicas"] == [(4, "2.weight", [2], 1)]
        assert v["replica_rows"] == [(0, "equal"), (2, "equal"), (4, "2.weight")]
    assert len({v["hash"] for v in values}) == 2


@pytest.mark.timeout(120)
def test_a_rank_that_exits_before_check_is_named_within_the_timeout(tmp_path):
    results = h.launch(h.exit_before_check, 2, str(tmp_path))
    assert sorted(results) == [0]  # rank 1 exited without answering
    out = results[0]["value"]
    assert out["error"] == "RankError" and out["step"] == 2
    assert out["ranks"] == [1]
    assert "rank(s) [1] did not answer the agreement within 3 s" in out["message"]


@pytest.mark.timeout(120)
def test_bad_setups_are_clear_errors_not_hangs(tmp_path):
    v0, v1 = _values(h.launch(h.bad_setups, 2, str(tmp_path)), 2)
    for v in (v0, v1):
        assert v["kind"]["error"] == "TypeError"
        assert "process_group must be a torch.distributed.ProcessGroup" in v["kind"]["message"]
        assert "got str" in v["kind"]["message"]
    assert v0["member"] is None  # a one-rank group: nothing to agree on
    assert v1["member"]["error"] == "ValueError"
    assert "not a member of the given process_group" in v1["member"]["message"]
    assert v0["models"]["error"] == v1["models"]["error"] == "RankError"
    assert (
        "parameter '0.weight' has shape [16, 8] on rank 0 but [32, 8] on rank 1"
        in (v0["models"]["message"])
    )
    assert v0["models"]["ranks"] == [1] and v1["models"]["ranks"] == [0]
    assert v0["options"]["error"] == v1["options"]["error"] == "RankError"
    assert (
        "the ranks' guards differ: on_nonfinite='raise' on rank 0 but 'skip' on rank 1"
        in v0["options"]["message"]
    )
    assert v0["alone"] == ["step-000000003-rank0.nbsnap"]
    assert v1["alone"] == ["step-000000003-rank1.nbsnap"]
    for v in (v0, v1):  # a rank that skipped a check() call: the steps differ
        assert v["steps"]["error"] == "RankError"
        assert (
            "called NaNGuard.check() for different steps (rank 0: step 5, rank 1: step 6)"
            in (v["steps"]["message"])
        )
    assert v0["steps"]["ranks"] == [1] and v1["steps"]["ranks"] == [0]
    some = v0["some_ranks"]
    assert some["error"] == "RankError" and some["ranks"] == [1]
    assert "created on rank(s) [0] but not on rank(s) [1] within 3 s" in some["message"]


@pytest.mark.timeout(120)
def test_a_rank_that_leaves_out_one_check_under_ddp_is_named_not_a_gloo_abort(tmp_path):
    # the agreement's own process group: its all-reduce cannot pair with DDP's
    results = h.launch(h.skip_one_check, 2, str(tmp_path), timeout=60)
    out = results[0]
    assert out.get("error") == "RankError", out
    assert out["ranks"] == [1]
    assert "rank(s) [1] did not answer the agreement within 3 s" in out["message"]


@pytest.mark.timeout(120)
def test_different_models_are_named_on_every_rank_when_the_store_host_exits(tmp_path):
    """The rank hosting the rendezvous store exits on its error; the other rank, slower to
    read the store, still gets the same clear error (it used to get "Connection reset by
    peer")."""
    results = h.launch(h.models_differ_store_host_exits, 2, str(tmp_path))
    assert sorted(results) == [0, 1]
    for r in (0, 1):
        out = results[r]
        assert out.get("error") == "RankError", out
        assert out["ranks"] == [1 - r]
        assert "the ranks' models differ: parameter '0.weight' has shape" in out["message"]


@pytest.mark.timeout(120)
def test_fsdp2_sharded_gradients_agree(tmp_path):
    values = _values(h.launch(h.fsdp2, 2, str(tmp_path)), 2)
    for r, v in enumerate(values):
        assert v["oks"] == [True, True, False, True]
        assert v["snapshots"] == [f"step-000000002-rank{r}.nbsnap"]
        assert v["finite"]
    # each rank's snapshot holds the whole model (gathered from the shards) and its own batch
    report = nbdebug.compare_ranks(tmp_path, model=h.make_model)
    assert report.culprit_ranks == [1] and report.replayed_culprits == [1]
    assert report.rank(1).origin_phase == "input" and report.rank(1).origin_rows == [0]
    assert report.params_agree is True
    snap = nbdebug.load_snapshot(tmp_path / "step-000000002-rank0.nbsnap", model=h.make_model)
    assert snap.model_state["0.weight"].shape == (16, 8)


def test_a_single_process_snapshot_of_format_1_reads_the_distributed_defaults(tmp_path):
    path = nbdebug.save_snapshot(tmp_path / "s.nbsnap", h.make_model(), torch.zeros(2, 8))
    raw = read_archive(path)  # the whole dictionary, as torch.load gave it
    assert (raw["rank"], raw["world_size"], raw["culprit_ranks"]) == (None, None, [])
    for key in ("rank", "world_size", "local_first", "culprit_ranks", "rank_kinds", "fingerprints"):
        del raw[key]
    raw["version"] = 1
    torch.save(raw, path)
    snap = nbdebug.load_snapshot(path)
    assert (snap.rank, snap.local_first, snap.culprit_ranks, snap.fingerprints) == (
        None,
        None,
        [],
        None,
    )


# --------------------------------------------------------------------------- one process


def test_fingerprint_is_exact_and_order_free():
    a = torch.randn(1000)
    b = a.clone()
    assert torch.equal(fingerprint([a]), fingerprint([b]))
    b[17] = torch.nextafter(b[17], torch.tensor(float("inf")))  # one ulp
    assert not torch.equal(fingerprint([a]), fingerprint([b]))
    assert torch.equal(
        fingerprint([a.reshape(10, 100).t()]), fingerprint([a.reshape(10, 100).t().clone()])
    )
    half = torch.randn(7, dtype=torch.bfloat16)
    assert fingerprint([half, torch.tensor([True, False])]).shape == (2, 2)


def test_first_mismatch_names_the_minority():
    same = fingerprint([torch.ones(3), torch.zeros(2)])
    other = fingerprint([torch.ones(3), torch.full((2,), 2.0)])
    found = first_mismatch(7, ["a", "b"], [same, same, other])
    assert (found.step, found.parameter, found.ranks, found.n_differing) == (7, "b", [2], 1)
    assert "parameter 'b' differs on rank(s) [2]" in found.message
    assert first_mismatch(7, ["a", "b"], [same, same]) is None


def test_culprits_prefer_the_rank_whose_loss_was_not_finite():
    assert culprit_ranks([2, 1 | 2, 2, 0]) == [1]  # loss on rank 1, gradients via DDP
    assert culprit_ranks([2, 2, 0]) == [0, 1]  # only gradients: cannot tell
    assert culprit_ranks([0, 0]) == []


def test_single_process_options_are_checked():
    model = h.make_model()
    with pytest.raises(ValueError, match="check_replicas_every needs a distributed run"):
        nbdebug.NaNGuard(model, check_replicas_every=10)
    with pytest.raises(ValueError, match="check_replicas_every must be a positive int"):
        nbdebug.NaNGuard(model, check_replicas_every=0)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
        nbdebug.NaNGuard(model, process_group=group)
    with pytest.raises(TypeError, match="got str"):
        nbdebug.NaNGuard(model, process_group="gloo")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        nbdebug.NaNGuard(model, timeout=-1)
    assert nbdebug.NaNGuard(model).agreement is None  # no distributed run: decides alone
    assert nbdebug.NaNGuard(model, process_group=False).agreement is None


def test_rank_error_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(RankError("x", ranks=[1], step=3)))
    assert (str(e), e.ranks, e.step) == ("x", [1], 3)


# --------------------------------------------------------------------------- compare_ranks


@pytest.mark.timeout(120)
def test_compare_ranks_replays_each_ranks_batch_and_names_the_culprit(batch_nan_2):
    directory, _ = batch_nan_2
    report = nbdebug.compare_ranks(directory, model=h.make_model)
    assert (report.step, report.world_size, report.missing_ranks) == (3, 2, [])
    assert report.culprit_ranks == [1] and report.replayed_culprits == [1]
    assert report.params_agree is True and report.first_differing_param is None
    r0, r1 = report.rows
    assert (r0.kind, r0.local_first, r0.culprit, r0.origin_phase) == ("grad", True, False, None)
    assert r0.where == "finite on replay"  # rank 0's own batch is fine: DDP spread the NaN
    assert (r1.kind, r1.culprit, r1.origin_phase, r1.origin_rows) == ("loss", True, "input", [2])
    df = report.to_frame()
    assert list(df["rank"]) == [0, 1] and list(df["culprit"]) == [False, True]
    assert df.loc[1, "first_nonfinite"].startswith("input")
    text = repr(report)
    assert "culprit rank(s) [1]" in text and "parameters equal on every rank" in text
    assert "rank 1 *: loss (local)" in text


@pytest.mark.timeout(120)
def test_compare_ranks_without_a_model_reads_the_records(loss_nan_2):
    directory, _ = loss_nan_2
    report = nbdebug.compare_ranks(sorted(directory.glob("*.nbsnap")))
    assert report.culprit_ranks == [1] and report.replayed_culprits == []
    assert [r.local_first for r in report.rows] == [False, True]
    assert [r.kind for r in report.rows] == ["rank", "loss"]
    assert all(r.where == "not replayed" for r in report.rows)
    assert report.params_agree is True


def test_compare_ranks_finds_the_first_differing_parameter(tmp_path):
    for rank in range(3):
        model = h.make_model()
        if rank == 2:
            with torch.no_grad():
                model[2].bias += 1.0
        nbdebug.save_snapshot(
            tmp_path / f"step-000000005-rank{rank}.nbsnap",
            model,
            torch.zeros(2, 8),
            step=5,
            reason={"kind": "grad", "message": "x"},
            rank=rank,
        )
    report = nbdebug.compare_ranks(tmp_path)
    assert report.params_agree is False and report.first_differing_param == "2.bias"
    assert [r.params_agree for r in report.rows] == [True, True, False]
    assert report.rows[2].first_differing_param == "2.bias"
    assert report.rows[0].local_first is None  # no guard record in these files
    with pytest.raises(ValueError, match="no snapshot of step 4; the files hold steps"):
        nbdebug.compare_ranks(tmp_path, step=4)
    for bad in ("5", 5.0, True):  # "5" once read "no snapshot of step 5 ... steps [5]"
        with pytest.raises(TypeError, match=f"step expects an int .*got {bad!r}"):
            nbdebug.compare_ranks(tmp_path, step=bad)  # type: ignore[arg-type]
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="holds no per-rank snapshots"):
        nbdebug.compare_ranks(tmp_path / "other")
    with pytest.raises(TypeError, match="expects a directory or a non-empty list"):
        nbdebug.compare_ranks(3)
    nbdebug.save_snapshot(
        tmp_path / "step-000000005-rank1-1.nbsnap",
        h.make_model(),
        step=5,
        reason={"kind": "grad", "message": "x"},
        rank=1,
    )
    with pytest.raises(ValueError, match="two snapshots of step 5 claim rank 1"):
        nbdebug.compare_ranks(tmp_path)
