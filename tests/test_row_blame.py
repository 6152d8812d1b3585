"""nbdebug.row_blame: each row's loss and share of the gradient norm, checked against
per-row gradients computed by a plain loop (zero the grads, the loss of the row alone,
backward, the norm of every gradient)."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug import NaNGuard, load_snapshot, save_snapshot
from nbdebug.core.snapshot import TrainingObjects


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rows: int = 12, loud: tuple[int, ...] = (3, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 4, generator=g)
    y = torch.randint(0, 3, (rows,), generator=g)
    for r in loud:
        x[r] *= 40.0  # saturated rows labelled with the class the model ranks last
        with torch.no_grad():
            y[r] = int(_mlp()(x[r : r + 1]).argmin())
    return x, y


def _plain(model: nn.Module, x, y: torch.Tensor, layer: str = "", call=None):
    """Per-row loss and gradient norm by a plain loop over the rows, on a copy."""
    m = copy.deepcopy(model)
    params = [p for n, p in m.named_parameters() if n.startswith(layer)]
    losses, norms = [], []
    for i in range(len(y)):
        m.zero_grad()
        out = call(m, i) if call is not None else m(x[i : i + 1])
        loss = F.cross_entropy(out, y[i : i + 1])
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item())
    return np.array(losses), np.array(norms)


def _fewest(share: np.ndarray, fraction: float) -> list[int]:
    order = [int(i) for i in np.argsort(-share, kind="stable")]
    total = 0.0
    for k, r in enumerate(order, 1):
        total += share[r]
        if total >= fraction:
            return order[:k]
    return order


def test_norms_losses_and_shares_match_a_plain_loop():
    model = _mlp()
    x, y = _batch()
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy)
    losses, norms = _plain(model, x, y)
    assert blame.method == "vmap" and blame.layer == ""
    np.testing.assert_allclose(blame.loss, losses, rtol=1e-5)
    np.testing.assert_allclose(blame.grad_norm, norms, rtol=1e-4)
    np.testing.assert_allclose(blame.share, norms / norms.sum(), rtol=1e-4)
    heavy = _fewest(norms / norms.sum(), 0.5)
    assert sorted(heavy) == [3, 8] and blame.heavy == heavy
    pct = round(100 * (norms[3] + norms[8]) / norms.sum())
    first, second = heavy
    assert blame.summary() == (
        f"rows {first} and {second} carry {pct}% of the gradient norm (2 of 12 rows)."
    )
    assert set(blame.outliers) == {3, 8} and not blame.ok
    frame = blame.to_frame()
    assert list(frame.columns) == ["id", "loss", "grad_norm", "share", "outlier"]
    assert frame.index.name == "row" and frame["id"].isna().all()
    np.testing.assert_allclose(frame["grad_norm"], norms, rtol=1e-4)


def test_a_stated_fraction_and_a_long_set_is_counted():
    model = _mlp()
    x = torch.randn(1, 4).repeat(32, 1)  # 32 equal rows: equal shares
    y = torch.ones(32, dtype=torch.long)
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy, fraction=0.75)
    assert len(blame.heavy) == 24 and blame.outliers == [] and blame.ok
    assert blame.summary() == "24 of 32 rows carry 75% of the gradient norm."
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]; got 0"):
        nbdebug.row_blame(model, x, y, F.cross_entropy, fraction=0)


def test_a_nan_row_is_named_first_and_the_others_share_the_norm():
    model = _mlp()
    x, y = _batch()
    x[5, 1] = float("nan")
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy)
    _, norms = _plain(model, x, y)
    assert np.isnan(norms[5]) and blame.nonfinite == [5]
    assert np.isnan(blame.grad_norm[5]) and np.isnan(blame.share[5]) and np.isnan(blame.loss[5])
    ok = np.isfinite(norms)
    np.testing.assert_allclose(blame.share[ok], norms[ok] / norms[ok].sum(), rtol=1e-4)
    assert blame.summary().startswith("row 5 has a NaN gradient; of the other 11 rows, rows ")
    assert "(2 of 11 rows)." in blame.summary()


def test_ids_name_the_samples_and_the_wrong_length_is_one_sentence():
    model = _mlp()
    x, y = _batch()
    ids = [100 + 7 * i for i in range(12)]
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy, ids=torch.tensor(ids))
    assert blame.ids == ids and list(blame.to_frame()["id"]) == ids
    a, b = blame.heavy
    assert blame.summary().startswith(f"samples {ids[a]} and {ids[b]} (batch rows {a} and {b}) ")
    with pytest.raises(ValueError) as err:
        nbdebug.row_blame(model, x, y, F.cross_entropy, ids=ids[:11])
    assert str(err.value) == (
        "ids must give one dataset index per batch row: the batch has 12 rows, got 11 ids."
    )


def test_snapshot_ids_are_stored_and_map_the_rows(tmp_path):
    model = _mlp()
    x, y = _batch()
    ids = list(range(500, 512))
    path = save_snapshot(
        tmp_path / "s.nbsnap",
        TrainingObjects(model),
        x,
        y,
        step=7,
        ids=ids,
        loss_fn=F.cross_entropy,
    )
    snap = load_snapshot(path, _mlp)
    assert snap.ids == ids
    blame = nbdebug.row_blame(path, model=_mlp)
    _, norms = _plain(model, x, y)
    np.testing.assert_allclose(blame.grad_norm, norms, rtol=1e-4)
    assert blame.ids == ids and blame.step == 7
    assert blame.summary().startswith("samples ")
    bare = save_snapshot(tmp_path / "b.nbsnap", TrainingObjects(model), x, y)
    assert load_snapshot(bare, _mlp).ids is None


def test_a_guard_snapshot_of_a_nan_step_blames_its_rows(tmp_path):
    model = _mlp()
    x, y = _batch()
    x[2, 0] = float("inf")
    ids = list(range(40, 52))
    guard = NaNGuard(model, directory=tmp_path, loss_fn=F.cross_entropy, on_nonfinite="skip")
    guard.set_snapshot_field("ids", ids)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert not guard.check(loss, inputs=x, target=y, step=3, ids=ids)
    model.zero_grad()
    blame = nbdebug.row_blame(guard.snapshots[0], model=_mlp)
    assert blame.nonfinite == [2] and blame.ids == ids and blame.step == 3
    assert blame.summary().startswith("sample 42 (batch row 2) has a NaN gradient; ")


def test_label_issues_are_joined_on_the_dataset_index():
    rng = np.random.default_rng(0)
    n = 60
    given = rng.integers(0, 3, n)
    probs = np.full((n, 3), 0.05)
    probs[np.arange(n), given] = 0.9
    flipped = [4, 17, 33]
    for i in flipped:
        probs[i] = 0.05
        probs[i, (given[i] + 1) % 3] = 0.9
    issues = nbdebug.find_label_issues(given, pred_probs=probs)
    model = _mlp()
    x, y = _batch()
    ids = [17, 0, 4, 5, 6, 7, 8, 9, 10, 33, 11, 59]
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy, ids=ids, labels=issues)
    frame = blame.to_frame()
    assert list(frame["label_issue"]) == list(issues.loc[ids, "is_issue"])
    assert frame["label_issue"].sum() >= 2  # 17 and 33 are flipped labels
    assert list(frame["given_label"]) == [int(given[i]) for i in ids]
    np.testing.assert_allclose(frame["label_quality"], issues.loc[ids, "label_quality"])
    with pytest.raises(TypeError, match=r"labels must be the table of nbdebug\.find_label_issues"):
        nbdebug.row_blame(model, x, y, F.cross_entropy, labels=[1, 2])


def test_drift_rows_are_joined_on_the_current_data():
    model = _mlp()
    x, y = _batch()
    report = SimpleNamespace(  # the per-row fields of a DriftReport
        current_rows=np.array([0, 2, 3, 5]),
        current_shap=np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]),
        reference_shap=np.zeros((2, 2)),
        labels=np.array([0, 1, 1, 0, 1, 0]),
        clusters=pd.DataFrame({"name": ["a", "b"], "change": [0.25, -0.25]}),
        feature_names=["f0", "f1"],
        drifted_explanations=["f1"],
    )
    frame = nbdebug.row_blame(model, x, y, F.cross_entropy, drift=report).to_frame()
    assert list(frame["drift_cluster"][:4].fillna("-")) == ["b", "-", "a", "b"]
    assert list(frame["drift_shap"][:4].fillna(-1)) == [2.0, -1, 4.0, 6.0]
    assert list(frame["drift_cluster_change"][:4].fillna(0)) == [-0.25, 0, 0.25, -0.25]
    with pytest.raises(TypeError, match=r"drift must be the DriftReport of nbdebug\.drift"):
        nbdebug.row_blame(model, x, y, F.cross_entropy, drift=object())


def test_batchnorm_in_train_mode_runs_one_row_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3)
    ).train()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 3, 5, 5, generator=g), torch.randint(0, 3, (6,), generator=g)
    x[4] *= 10
    running = model[1].running_mean.clone()
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy)
    assert blame.method == "loop" and blame.notes[0].startswith("vmap could not run the model")
    _, norms = _plain(model, x, y)
    np.testing.assert_allclose(blame.grad_norm, norms, rtol=1e-4)
    assert torch.equal(model[1].running_mean, running)


def test_batchnorm_over_one_row_blames_each_rows_term_of_the_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).train()
    x, y = _batch()
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy)
    assert blame.method == "in_batch" and "cannot run alone" in blame.notes[1]
    m = copy.deepcopy(model)
    out = m(x)
    expected = []
    for i in range(len(x)):
        gs = torch.autograd.grad(
            F.cross_entropy(out[i : i + 1], y[i : i + 1]), list(m.parameters()), retain_graph=True
        )
        expected.append(torch.sqrt(sum((g**2).sum() for g in gs)).item())
    np.testing.assert_allclose(blame.grad_norm, expected, rtol=1e-4)


def test_a_small_memory_budget_blames_the_origin_layer():
    model = _mlp()
    x, y = _batch()
    m = copy.deepcopy(model)
    F.cross_entropy(m(x), y).backward()
    top = max(m.named_parameters(), key=lambda kv: kv[1].grad.norm().item())[0]
    layer = top.rsplit(".", 1)[0]
    blame = nbdebug.row_blame(model, x, y, F.cross_entropy, memory=1024)
    assert blame.layer == layer and blame.scope.startswith(f"the origin layer {layer!r}")
    _, norms = _plain(model, x, y, layer=layer + ".")
    np.testing.assert_allclose(blame.grad_norm, norms, rtol=1e-4)
    whole = nbdebug.row_blame(model, x, y, F.cross_entropy, memory=1024, layer="")
    np.testing.assert_allclose(whole.grad_norm, _plain(model, x, y)[1], rtol=1e-4)
    with pytest.raises(ValueError, match="'head' is not one"):
        nbdebug.row_blame(model, x, y, F.cross_entropy, layer="head")


def test_a_spike_snapshot_blames_the_layer_where_the_spike_began(tmp_path):
    model = _mlp()
    x, y = _batch()
    m = copy.deepcopy(model)
    F.cross_entropy(m(x), y).backward()
    top = max(m.named_parameters(), key=lambda kv: kv[1].grad.norm().item())[0]
    began = "0" if top.startswith("2.") else "2"  # not the largest-gradient rule's pick
    names = [n for n, _ in model.named_parameters()]
    rng = np.random.default_rng(1)
    grad = np.exp(rng.normal(0, 0.05, (40, len(names)))).astype(np.float32)
    grad[30:, names.index(f"{began}.weight")] *= 40.0  # this layer grows first
    grad[33:] *= 20.0
    nan = torch.full(grad.shape, float("nan"))
    signals = {"names": names, "steps": torch.arange(40), "grad_norm": torch.from_numpy(grad)}
    signals |= {"update_ratio": nan, "adam_lag": nan}
    history = [{"step": s, "loss": 1.0, "grad_norm": 1.0, "skipped": False} for s in range(40)]
    history[33]["spikes"] = [{"signal": "grad_norm", "z": 9.0}]
    reason = {"kind": "spike", "message": "grad_norm spiked at step 33"}
    path = save_snapshot(
        tmp_path, TrainingObjects(model), x, y, step=33, reason=reason, history=history,
        signals=signals, loss_fn=F.cross_entropy,
    )  # fmt: skip
    blame = nbdebug.row_blame(path, model=_mlp, memory=1024)
    assert blame.kind == "spike" and blame.layer == began
    np.testing.assert_allclose(
        blame.grad_norm, _plain(model, x, y, layer=began + ".")[1], rtol=1e-4
    )


def test_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 3))
    model.train()
    model[3].eval()
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    model[0].bias.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    nbdebug.row_blame(model, x, y, F.cross_entropy)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for n, p in model.named_parameters():
        assert (p.grad is None and grads[n] is None) or torch.equal(p.grad, grads[n])
    assert model.training and not model[3].training and not model[0].bias.requires_grad


def test_dict_inputs_unknown_options_and_the_panel():
    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, *, features: torch.Tensor, scale: float) -> torch.Tensor:
            return self.lin(features) * scale

    torch.manual_seed(0)
    model = Keyed()
    x, y = _batch()
    blame = nbdebug.row_blame(model, {"features": x, "scale": 2.0}, y, F.cross_entropy)
    losses, norms = _plain(model, x, y, call=lambda m, i: m(features=x[i : i + 1], scale=2.0))
    assert blame.method == "vmap"
    np.testing.assert_allclose(blame.loss, losses, rtol=1e-5)
    np.testing.assert_allclose(blame.grad_norm, norms, rtol=1e-4)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'fractoin'.*'fraction'"):
        nbdebug.row_blame(model, {"features": x, "scale": 2.0}, y, F.cross_entropy, fractoin=0.5)
    panel = blame.show()
    assert blame.summary() in panel.value and "grad_norm" in panel.value
    assert repr(blame).startswith("RowBlame(12 rows, vmap: ")
