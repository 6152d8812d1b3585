"""Gradient flow over time: the robust z-scores, the spike's origin, the figure's data, the
Flow panel, for per-layer signals made by hand and for a guarded run."""

from __future__ import annotations

import base64
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.core.flow import (
    GAP,
    FlowSource,
    SpikeOrigin,
    flow_data,
    flow_source,
    robust_z,
    spike_origin,
)
from nbdebug.core.guard.signals import LayerSignals
from nbdebug.figures.flow import MARKS, flow_figure
from nbdebug.widgets.flow import FlowPanel
from nbdebug.widgets.plot import json_ready


def z_by_hand(column: np.ndarray) -> np.ndarray:
    """One parameter's robust z, written out: log10, median, MAD x 1.4826, 1 % floor."""
    out = np.full(len(column), np.nan)
    logs = [math.log10(v) for v in column if np.isfinite(v) and v > 0]
    if len(logs) < 5:
        return out
    med = float(np.median(logs))
    spread = max(1.4826 * float(np.median([abs(x - med) for x in logs])), math.log10(1.01))
    for i, v in enumerate(column):
        if v == 0:
            out[i] = -math.inf
        elif v == math.inf:
            out[i] = math.inf
        elif np.isfinite(v) and v > 0:
            out[i] = (math.log10(v) - med) / spread
    return out


def signals(values: np.ndarray, names: list[str], steps=None, update=None) -> LayerSignals:
    n, p = values.shape
    steps = np.arange(n) if steps is None else steps
    nan = np.full((n, p), np.nan, np.float32)
    return LayerSignals.from_arrays(names, steps, values, nan if update is None else update, nan)


def test_robust_z_against_numpy_by_hand():
    rng = np.random.default_rng(0)
    v = np.exp(rng.normal(0, 0.3, (30, 4)))
    v[5, 0] = np.nan  # not measured
    v[7, 1] = 0.0  # a zero gradient
    v[9, 1] = 50.0  # a spike
    v[:26, 2] = np.nan  # only 4 measured steps: no z
    v[:, 3] = 2.0  # constant: the floor keeps the spread finite
    v[12, 3] = 2.2
    z = robust_z(v.astype(np.float32))
    want = np.column_stack([z_by_hand(v[:, j].astype(np.float32)) for j in range(4)])
    np.testing.assert_allclose(z, want, rtol=1e-6)
    assert np.isnan(z[5, 0]) and np.isnan(z[:, 2]).all() and z[7, 1] == -math.inf
    # 10 % over a constant with a 1 % floor: log10(1.1) / log10(1.01)
    assert z[12, 3] == pytest.approx(math.log10(1.1) / math.log10(1.01), rel=1e-4)
    with pytest.raises(ValueError, match="2-D"):
        robust_z(np.ones(3))


def test_the_origin_is_the_first_parameter_to_cross_its_threshold():
    z = np.zeros((12, 3))
    z[7, 1] = 7.0  # b crosses first, at step 7
    z[8, 0], z[8, 1] = 8.0, 6.5
    z[9] = [9.0, 9.5, 12.0]  # the spike step: all above, c the largest
    o = spike_origin(z, np.arange(12), ["a", "b", "c"], 9)
    assert o == SpikeOrigin(9, "b", 7, 7.0, "grad_norm")
    assert o.sentence() == "the spike at step 9: b crossed z > 6 first (z 7 at step 7)"
    # a step that was not measured (all NaN) neither breaks nor extends the walk back
    z[6] = np.nan
    z[5, 2] = 6.1
    assert spike_origin(z, np.arange(12), ["a", "b", "c"], 9).parameter == "c"
    # more than GAP steps in a row with no parameter above: the walk stops
    z2 = np.zeros((12, 2))
    z2[2, 0] = 10.0
    z2[3 + GAP + 1 :, 1] = 7.0
    o2 = spike_origin(z2, np.arange(12), ["a", "b"], 11)
    assert o2 is not None and (o2.parameter, o2.step) == ("b", 3 + GAP + 1)
    # ties at the first step: the largest z, then model order
    z3 = np.zeros((4, 3))
    z3[3] = [7.0, 9.0, 9.0]
    assert spike_origin(z3, np.arange(4), ["a", "b", "c"], 3).parameter == "b"
    # a loss spike before any gradient norm crosses: the run's later steps are looked at
    z4 = np.zeros((8, 2))
    z4[4:, 1] = 8.0
    late = spike_origin(z4, np.arange(8), ["a", "b"], 2, until=5)
    assert (late.spike_step, late.parameter, late.step) == (2, "b", 4)
    assert spike_origin(z4, np.arange(8), ["a", "b"], 2, until=3) is None
    # nothing above at the spike step, or the step not held: no origin
    assert spike_origin(np.zeros((4, 2)), np.arange(4), ["a", "b"], 3) is None
    assert spike_origin(z3, np.arange(4), ["a", "b", "c"], 10) is None
    with pytest.raises(ValueError, match="shape"):
        spike_origin(z3, np.arange(5), ["a", "b", "c"], 3)


def _run(n=40, p=3):
    """Per-layer signals of a run whose 'fc2.weight' starts growing at step 30, the
    spike detector flagging step 33 (and 34), step 35 skipped, step 37 non-finite."""
    rng = np.random.default_rng(1)
    names = ["fc1.weight", "fc1.bias", "fc2.weight"][:p]
    gn = np.exp(rng.normal(0, 0.05, (n, p))).astype(np.float32)
    gn[30:, 2] *= np.float32(40.0)
    gn[33:, :] *= np.float32(20.0)
    gn[37, :] = np.nan
    gn[12, 0] = np.nan
    ur = np.full((n, p), np.nan, np.float32)
    ur[::4] = np.float32(1e-3) * np.exp(rng.normal(0, 0.05, (len(ur[::4]), p)))
    rows = [
        {"step": s, "loss": 1.0, "grad_norm": 1.0, "skipped": s == 35, "nonfinite": None}
        for s in range(n)
    ]
    rows[33]["spikes"] = rows[34]["spikes"] = [{"signal": "grad_norm", "z": 9.0}]
    rows[33]["snapshot"] = "/runs/step-000000033.nbsnap"
    rows[37]["nonfinite"] = "loss"
    rows[37]["skipped"] = True
    return FlowSource(rows, signals(gn, names, update=ur), {33: rows[33]["snapshot"]}), gn, ur


def test_figure_data_z_scores_nan_cells_marks_and_origin():
    src, gn, _ = _run()
    data = flow_data(src)
    assert (
        data.names == ["fc1.weight", "fc1.bias", "fc2.weight"] and data.rule == "all 3 parameters"
    )
    assert data.spike_runs == [33] and data.spikes == [33, 34]
    assert data.skipped == [35, 37] and data.nonfinite == [37]
    assert [(o.parameter, o.step) for o in data.origins] == [("fc2.weight", 30)]
    fig = flow_figure(data)
    traces = {t.name: t for t in fig.data}
    heat = traces["grad_norm"]
    want = np.column_stack([z_by_hand(gn[:, j]) for j in range(3)]).T
    got = np.array(heat.z, dtype=float)
    np.testing.assert_allclose(got, np.clip(np.round(want, 2), -99, 99), atol=0.006)
    # not measured: missing (NaN, null in the JSON the front end gets), never 0
    assert np.isnan(got[0, 12]) and np.isnan(got[:, 37]).all()
    sent = json_ready(fig.to_dict())["data"][[t.name for t in fig.data].index("grad_norm")]["z"]
    cells = np.frombuffer(base64.b64decode(sent["bdata"]), sent["dtype"]).reshape(3, 40)
    assert (np.isnan(cells) == np.isnan(gn.T)).all()  # missing exactly where not measured
    assert heat.hoverongaps is False
    np.testing.assert_allclose(np.array(heat.customdata, float)[2, 5], gn[5, 2], rtol=1e-3)
    ratio = np.array(traces["update_ratio"].z, dtype=float)
    assert np.isnan(ratio[:, 1]).all() and np.isfinite(ratio[:, 0]).all()
    assert list(heat.y) == data.names and list(heat.x) == list(range(40))
    # the strip: one row of marks each, at the right steps
    assert [t.name for t in fig.data[: len(MARKS)]] == list(MARKS)
    assert list(traces["spike"].x) == [33, 34] and list(traces["skipped"].x) == [35, 37]
    assert list(traces["non-finite"].x) == [37] and list(traces["snapshot"].x) == [33]
    assert (traces["origin"].x, traces["origin"].y) == ((30,), ("fc2.weight",))
    assert "spike at step 33: fc2.weight crossed first (step 30)" in fig.layout.title.text
    # a dotted line at the spike through the strip and both heatmaps
    assert [s.x0 for s in fig.layout.shapes if s.type == "line"] == [33, 33, 33]
    assert "fc2.weight crossed z > 6 first (z" in data.summary() and "first non-finite step 37" in (
        data.summary()
    )


def test_a_thousand_parameters_show_the_top_ones_by_max_z_in_model_order():
    rng = np.random.default_rng(2)
    names = [
        f"encoder.layers.{i // 2}.self_attn.out_proj.{'weight' if i % 2 == 0 else 'bias'}"
        for i in range(1000)
    ]
    gn = np.exp(rng.normal(0, 0.05, (50, 1000))).astype(np.float32)
    hot = [3, 400, 999]
    gn[44:, hot] *= np.float32(30.0)
    gn[43, 3] *= np.float32(30.0)  # the first to rise
    gn[47:, 10] *= np.float32(100.0)  # crosses later, larger
    rows = [{"step": s, "grad_norm": 1.0, "skipped": False} for s in range(50)]
    rows[47]["spikes"] = [{"signal": "grad_norm"}]
    data = flow_data(FlowSource(rows, signals(gn, names)), max_params=12)
    z = robust_z(gn)
    score = np.nanmax(np.abs(z), axis=0)
    top = sorted(int(j) for j in np.argsort(-score, kind="stable")[:12])
    assert data.names == [names[j] for j in top]  # model order
    assert {names[j] for j in [*hot, 10]} <= set(data.names)
    assert data.rule == "the 12 of 1,000 parameters with the largest max |z|"
    assert data.origins[0].parameter == names[3] and data.origins[0].step == 43
    fig = flow_figure(FlowSource(rows, signals(gn, names)))  # the default: 30 rows
    heat = next(t for t in fig.data if t.name == "grad_norm")
    assert len(heat.y) == 30
    ticks = fig.layout.yaxis2.ticktext
    assert all(len(t) <= 36 for t in ticks) and ticks[0].endswith("out_proj.bias")
    assert fig.layout.yaxis2.automargin is True
    assert "1,000 parameters" in fig.layout.annotations[1].text
    assert 30 * 12 < fig.layout.height < 1000  # 12 px a row, the strip and the margins


def test_without_per_layer_signals_the_total_gradient_norm_is_one_row():
    rows = [{"step": s, "grad_norm": 1.0 + (s == 9) * 99.0} for s in range(12)]
    rows[9]["spikes"] = [{"signal": "grad_norm"}]
    data = flow_data(FlowSource(rows, None))
    assert data.names == ["all parameters (total)"] and not data.per_layer
    assert list(data.z) == ["grad_norm"]
    assert data.origins[0].parameter == "all parameters (total)"
    assert len([t for t in flow_figure(data).data if t.type == "heatmap"]) == 1


def test_bad_input_is_one_sentence():
    src, _, _ = _run()
    with pytest.raises(ValueError, match="threshold must be a positive number; got -1"):
        flow_data(src, threshold=-1)
    with pytest.raises(ValueError, match="max_params must be a positive int; got 0"):
        flow_data(src, max_params=0)
    with pytest.raises(TypeError, match=r"NaNGuard, a Snapshot, .* got list"):
        flow_source([1, 2])
    with pytest.raises(TypeError, match="on_open must be callable"):
        FlowPanel(src, on_open=3)


def test_flow_panel_opens_the_snapshot_of_a_step(tmp_path):
    model = nn.Linear(3, 1)
    path = nbdebug.save_snapshot(
        tmp_path,
        model,
        torch.ones(2, 3),
        torch.ones(2, 1),
        step=33,
        reason={"kind": "spike", "message": "grad_norm spiked at step 33"},
    )
    src, _, _ = _run()
    src = FlowSource(src.rows, src.signals, {33: str(path)})
    opened = []
    panel = FlowPanel(src, on_open=opened.append)
    assert "fc2.weight crossed z &gt; 6 first" in panel.summary.value
    assert [v for _, v in panel.chooser.options] == [33]
    assert panel.chooser.options[0][0].startswith("step 33 · spike")
    assert panel.open_step(34) is None and "steps with one: 33" in panel.detail.value
    assert opened == []
    panel.open_button.click()
    assert opened == [str(path)] and panel.opened == str(path)
    assert "step 33 · spike" in panel.detail.value and "spiked at step 33" in panel.detail.value
    assert repr(panel) == "FlowPanel(40 steps x 3 of 3 parameters, 1 spike(s), 1 snapshot(s))"
    # a FigureWidget: a click on a cell of the heatmap opens its step's snapshot
    from plotly.callbacks import InputDeviceState, Points

    live = FlowPanel(src, on_open=opened.append, backend="figurewidget")
    heat = next(t for t in live.plot.figure.data if t.name == "grad_norm")
    i = list(live.plot.figure.data).index(heat)
    pts = Points(
        point_inds=[[2, 33]], xs=[33], ys=["fc2.weight"], trace_name="grad_norm", trace_index=i
    )
    heat._dispatch_on_click(pts, InputDeviceState())
    assert opened == [str(path)] * 2
    missing = FlowSource(src.rows, src.signals, {33: str(tmp_path / "gone.nbsnap")})
    assert FlowPanel(missing).open_step(33) is None


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """A guarded run whose learning rate climbs without a cap until it diverges: spike
    snapshots first, then the non-finite step's."""
    directory = tmp_path_factory.mktemp("flow-run")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
    guard = nbdebug.NaNGuard(model, opt, scheduler=sched, directory=directory, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(200):
            x = torch.rand(64, 4, generator=g) * 4 - 2
            y = torch.sin(2 * x[:, :1]) + 0.5 * x[:, 1:2]
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if guard.check(loss, inputs=x, target=y, step=step):
                opt.step()
            opt.zero_grad()
            sched.step()
            if not torch.isfinite(loss):
                break
    return guard, directory


def test_a_live_guard_a_snapshot_and_a_directory_show_the_same_run(diverged):
    guard, directory = diverged
    rows = list(guard.history)
    first_spike = next(r["step"] for r in rows if r.get("spikes"))
    first_nan = next(r["step"] for r in rows if r.get("nonfinite") is not None)
    assert first_spike < first_nan
    live = flow_data(guard)
    assert live.spike_runs[0] == first_spike and live.nonfinite[0] == first_nan
    names = [n for n, _ in guard.model.named_parameters()]
    assert live.names == names and live.per_layer
    # the z-scores of the live guard's signals, by hand
    sig = guard.signals
    want = np.column_stack([z_by_hand(sig.grad_norm[:, j]) for j in range(len(names))])
    np.testing.assert_allclose(live.z["grad_norm"], want, rtol=1e-5, atol=1e-9)
    # the snapshot written at the failure holds the same history and signals
    last = nbdebug.load_snapshot(live.snapshots[first_nan])
    from_snap = flow_data(last)
    assert from_snap.spike_runs == live.spike_runs and from_snap.origins == live.origins
    np.testing.assert_array_equal(from_snap.steps, live.steps)
    # the directory: every snapshot of the run, their histories merged
    from_dir = flow_data(directory)
    assert sorted(from_dir.snapshots) == sorted(live.snapshots)
    assert from_dir.spike_runs == live.spike_runs and from_dir.origins == live.origins


def test_the_debugger_of_a_spike_snapshot_has_a_flow_tab_that_opens_steps(diverged):
    guard, _ = diverged
    data = flow_data(guard)
    spike, nan = data.spike_runs[0], data.nonfinite[0]
    dbg = nbdebug.debug(data.snapshots[nan], model=make_model, loss_fn=F.mse_loss)
    titles = list(dbg.tabs.titles)
    assert titles.index("Flow") == titles.index("History") + 1
    panel = dbg.panel("Flow")
    assert panel.open_step(spike) == data.snapshots[spike]
    # the spike's snapshot replayed in the Step tab: a finite step (before any NaN)
    assert dbg.tabs.titles[dbg.tabs.selected_index] == "Step"
    assert f"step {spike} opened from the Flow tab" in dbg.header.value
    assert dbg.trace.healthy and math.isfinite(dbg.trace.loss)
    assert "spike" in panel.detail.value


def test_a_live_guards_panel_refreshes_with_its_new_steps(tmp_path):
    model = nn.Linear(3, 1)
    guard = nbdebug.NaNGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), directory=tmp_path)
    panel = FlowPanel(guard)
    assert panel.data.summary() == "no step recorded yet."
    assert panel.refresh_button.layout.display == "" and panel.chooser.disabled
    for step in range(3):
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        guard.check(loss, step=step)
        model.zero_grad()
    panel.refresh_button.click()
    assert list(panel.data.steps) == [0, 1, 2] and panel.data.names == ["weight", "bias"]
    # the gradient norms the guard measured: d(sum of 2 outputs)/dw = 2 per weight
    np.testing.assert_allclose(panel.data.values["grad_norm"][0], [2 * math.sqrt(3), 2.0])
    assert "No spike flagged in steps 0-2." in panel.summary.value
