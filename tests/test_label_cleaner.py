"""The label review: the journal (crash, resume, foreign data), undo, bulk accept, the
test-split guard, exports, and the LabelCleaner widget driven from Python."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ipywidgets as widgets
import numpy as np
import pandas as pd
import pytest
import torch
from plotly.callbacks import Points
from sklearn.datasets import load_digits

import nbdebug
from nbdebug.analysis.labels import (
    Journal,
    LabelReview,
    SplitGuardError,
    find_label_issues,
    fingerprint,
)
from nbdebug.core.text import fmt_num
from nbdebug.widgets.labels import LabelCleaner

ROOT = Path(__file__).resolve().parents[1]
N = 300


def make_case(n: int = N, rate: float = 0.1, seed: int = 0):
    """Digits images, noisy labels and issues from synthetic probabilities that know the truth."""
    d = load_digits()
    images, y = d.images[:n], d.target[:n]
    rng = np.random.default_rng(seed)
    noisy = y.copy()
    idx = rng.choice(n, int(rate * n), replace=False)
    noisy[idx] = (y[idx] + rng.integers(1, 10, len(idx))) % 10
    logits = rng.normal(0, 1, (n, 10))
    logits[np.arange(n), y] += 4.0
    P = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    issues = find_label_issues(noisy, pred_probs=P)
    return images, noisy, issues


def shown(c: LabelCleaner) -> np.ndarray:
    """The picture the cleaner shows."""
    assert c.image is not None
    return np.asarray(c.image.figure.data[0].z)


@pytest.fixture
def case():
    return make_case()


# --------------------------------------------------------------------------- journal


def test_decisions_survive_a_killed_kernel_and_resume(tmp_path, case):
    images, noisy, issues = case
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "labels.npy", noisy)
    issues.to_pickle(tmp_path / "issues.pkl")
    journal = tmp_path / "review.jsonl"
    script = textwrap.dedent(
        f"""
        import os, numpy as np, pandas as pd
        from nbdebug.analysis.labels import LabelReview
        images = np.load({str(tmp_path / "images.npy")!r})
        labels = np.load({str(tmp_path / "labels.npy")!r})
        issues = pd.read_pickle({str(tmp_path / "issues.pkl")!r})
        r = LabelReview(labels, issues, data=images, journal={str(journal)!r})
        first = r.current
        r.relabel()          # to the suggestion
        r.exclude()
        r.keep()
        print(first, flush=True)
        os._exit(1)          # the kernel dies: no cleanup, no close, no atexit
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    first = int(proc.stdout.split()[-1])
    queue = list(issues.index[issues["is_issue"]])
    assert first == queue[0]

    r = LabelReview(noisy, issues, data=images, journal=journal)
    d = r.decisions
    assert list(d["item"]) == queue[:3]
    assert list(d["action"]) == ["relabel", "exclude", "keep"]
    assert d.loc[0, "new_label"] == issues.loc[queue[0], "suggested_label"]
    assert d.loc[0, "old_label"] == noisy[queue[0]]
    assert r.current == queue[3]  # resumes where the reviewer stopped
    cleaned = r.cleaned_labels()
    assert cleaned[queue[0]] == issues.loc[queue[0], "suggested_label"]
    assert not r.mask()[queue[1]] and r.mask().sum() == N - 1


def test_journal_lines_hold_the_audit_fields(tmp_path, case):
    images, noisy, issues = case
    path = tmp_path / "j.jsonl"
    r = LabelReview(noisy, issues, data=images, journal=path)
    item = r.current
    r.relabel(4)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["fingerprint"] == fingerprint(images, noisy)
    rec = lines[1]
    assert {k: rec[k] for k in ("item", "old_label", "new_label", "action", "method")} == {
        "item": item,
        "old_label": int(noisy[item]),
        "new_label": 4,
        "action": "relabel",
        "method": "confident_learning",
    }
    assert rec["score"] == pytest.approx(issues.loc[item, "label_quality"])
    assert rec["time"].endswith("+00:00")


def test_a_journal_of_other_data_is_refused(tmp_path, case):
    images, noisy, issues = case
    path = tmp_path / "j.jsonl"
    LabelReview(noisy, issues, data=images, journal=path).keep()
    other = images.copy()
    other[5, 0, 0] += 1  # one pixel differs
    with pytest.raises(ValueError, match=r"written for different data .* refusing to mix"):
        LabelReview(noisy, issues, data=other, journal=path)
    with pytest.raises(ValueError, match="written for different data"):
        LabelCleaner(
            images[:200],
            noisy[:200],
            find_label_issues(noisy[:200], pred_probs=np.full((200, 10), 0.1)),
            journal=path,
        )
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="is not an nbdebug label journal"):
        LabelReview(noisy, issues, data=images, journal=tmp_path / "notes.txt")


def test_a_write_cut_short_is_skipped_and_appending_goes_on(tmp_path, case):
    images, noisy, issues = case
    path = tmp_path / "j.jsonl"
    r = LabelReview(noisy, issues, data=images, journal=path)
    r.keep()
    r.keep()
    with open(path, "a") as f:
        f.write('{"type":"decision","seq":3,"ba')  # the crash hit mid-line
    with pytest.warns(UserWarning, match="line 4 is unreadable"):
        r2 = LabelReview(noisy, issues, data=images, journal=path)
    assert len(r2.decisions) == 2
    r2.exclude()
    with pytest.warns(UserWarning, match="line 4 is unreadable"):
        r3 = LabelReview(noisy, issues, data=images, journal=path)
    assert list(r3.decisions["action"]) == ["keep", "keep", "exclude"]


def test_fingerprints_of_kinds_of_data():
    y = np.array([0, 1])
    assert fingerprint(None, y) == fingerprint(None, y.copy())
    assert fingerprint(None, y) != fingerprint(None, np.array([1, 0]))
    assert fingerprint(["a", "b"], y) != fingerprint(["a", "c"], y)
    df = pd.DataFrame({"x": [1.0, 2.0]})
    assert fingerprint(df, y) == fingerprint(df.copy(), y)
    assert fingerprint(df, y) != fingerprint(df.rename(columns={"x": "z"}), y)
    t = torch.zeros(2, 3)
    assert fingerprint(t, y) == fingerprint(t.numpy().copy(), y)
    with pytest.raises(TypeError, match="data must be a sequence"):
        fingerprint(3, y)


# --------------------------------------------------------------------------- review logic


def test_undo_single_and_bulk(tmp_path, case):
    images, noisy, issues = case
    r = LabelReview(noisy, issues, data=images, journal=tmp_path / "j.jsonl")
    a = r.current
    assert a is not None
    r.keep()
    r.relabel(7, item=a)  # change of mind on the same item: latest wins
    assert r.decisions.set_index("item").loc[a, "action"] == "relabel"
    undone = r.undo()
    assert [u["action"] for u in undone] == ["relabel"]
    assert r.decisions.set_index("item").loc[a, "action"] == "keep"  # the earlier decision is back
    assert r.cleaned_labels()[a] == noisy[a]
    n = r.count_above(0.5)
    assert n > 0
    assert r.accept_above(0.5) == n
    assert len(r.decisions) == n + 1
    undone = r.undo()  # the bulk is one step
    assert len(undone) == n
    assert len(r.decisions) == 1
    assert len(r.undo()) == 1
    assert r.undo() == []
    assert r.decisions.empty
    np.testing.assert_array_equal(r.cleaned_labels(), noisy)
    # and the undo survives a reopen
    r2 = LabelReview(noisy, issues, data=images, journal=tmp_path / "j.jsonl")
    assert r2.decisions.empty and r2.current == a


def test_bulk_accept_counts_first_and_relabels_exactly_those(tmp_path, case):
    images, noisy, issues = case
    r = LabelReview(noisy, issues, data=images, journal=tmp_path / "j.jsonl")
    flagged = issues[issues["is_issue"]]
    expected = set(
        flagged.index[(flagged["suggested_prob"] >= 0.9) & (flagged["suggested_label"] >= 0)]
    )
    first = r.current
    r.keep()  # decided items are not touched by the bulk
    expected.discard(first)
    assert r.count_above(0.9) == len(expected)
    assert r.accept_above(0.9) == len(expected)
    d = r.decisions.set_index("item")
    bulk = set(d.index[d["action"] == "relabel"])
    assert bulk == expected
    cleaned = r.cleaned_labels()
    for i in expected:
        assert cleaned[i] == issues.loc[i, "suggested_label"]
    assert r.count_above(0.9) == 0
    with pytest.raises(ValueError, match=r"threshold must be a probability in \[0, 1\]"):
        r.count_above(1.5)


def test_filter_by_pair(tmp_path, case):
    images, noisy, issues = case
    r = LabelReview(noisy, issues, data=images, journal=tmp_path / "j.jsonl")
    f = issues[issues["is_issue"]]
    g, s = int(f.iloc[0]["given_label"]), int(f.iloc[0]["suggested_label"])
    r.set_filter(g, s)
    want = list(f.index[(f["given_label"] == g) & (f["suggested_label"] == s)])
    assert list(r.queue) == want and r.current == want[0]
    r.set_filter(given=g)
    assert list(r.queue) == list(f.index[f["given_label"] == g])
    r.set_filter()
    assert len(r.queue) == len(f)
    with pytest.raises(ValueError, match=r"given must be a class in 0\.\.9"):
        r.set_filter(12)


def test_test_split_guard(tmp_path, case):
    images, noisy, issues = case
    r = LabelReview(noisy, issues, data=images, journal=tmp_path / "a.jsonl", is_test=True)
    with pytest.raises(
        SplitGuardError,
        match=r"is_test=True: relabeling test samples biases the evaluation; pass force=True",
    ):
        r.relabel()
    with pytest.raises(SplitGuardError, match="excluding test samples"):
        r.exclude()
    with pytest.raises(SplitGuardError):
        r.accept_above(0.0)
    r.keep()
    r.skip()
    assert list(r.decisions["action"]) == ["keep", "skip"]
    np.testing.assert_array_equal(r.cleaned_labels(), noisy)
    forced = LabelReview(
        noisy, issues, data=images, journal=tmp_path / "b.jsonl", is_test=True, force=True
    )
    forced.relabel()
    assert forced.decisions["action"].tolist() == ["relabel"]


def test_export_round_trips(tmp_path, case):
    images, noisy, issues = case
    r = LabelReview(noisy, issues, data=images, journal=tmp_path / "j.jsonl")
    r.relabel()
    r.exclude()
    r.keep()
    r.skip()
    for name in ("clean.csv", "clean.parquet"):
        path = r.export(tmp_path / name)
        back = (
            pd.read_csv(path, keep_default_na=False)
            if name.endswith(".csv")
            else pd.read_parquet(path)
        )
        np.testing.assert_array_equal(back["label"].to_numpy(), r.cleaned_labels())
        np.testing.assert_array_equal(back["keep"].to_numpy(), r.mask())
        np.testing.assert_array_equal(back["given_label"].to_numpy(), noisy)
        np.testing.assert_array_equal(back["index"].to_numpy(), np.arange(N))
        assert sorted(back.loc[back["action"] != "", "action"]) == [
            "exclude",
            "keep",
            "relabel",
            "skip",
        ]
    with pytest.raises(ValueError, match=r"must end in \.csv or \.parquet; got 'clean\.xlsx'"):
        r.export(tmp_path / "clean.xlsx")


def test_parquet_without_pyarrow_says_so(tmp_path, case, monkeypatch):
    images, noisy, issues = case
    r = LabelReview(noisy, issues, data=images, journal=tmp_path / "j.jsonl")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now fails
    with pytest.raises(
        ImportError, match="Parquet needs pyarrow, which is not installed: pip install pyarrow"
    ):
        r.export(tmp_path / "clean.parquet")
    assert not (tmp_path / "clean.parquet").exists()


def test_review_bad_inputs(tmp_path, case):
    _, noisy, issues = case
    with pytest.raises(
        TypeError, match=r"issues must be the DataFrame returned by nbdebug\.find_label_issues"
    ):
        LabelReview(noisy, issues.to_numpy(), journal=tmp_path / "j.jsonl")
    with pytest.raises(ValueError, match="lacks the columns"):
        LabelReview(noisy, issues.drop(columns=["is_issue"]), journal=tmp_path / "j.jsonl")
    other = noisy.copy()
    other[issues.index[0]] = (other[issues.index[0]] + 1) % 10
    with pytest.raises(ValueError, match="issues were computed for other labels"):
        LabelReview(other, issues, journal=tmp_path / "j.jsonl")
    r = LabelReview(noisy, issues, journal=tmp_path / "j.jsonl")
    with pytest.raises(ValueError, match=r"new_label must be a class in 0\.\.9; got 10"):
        r.relabel(10)
    with pytest.raises(ValueError, match="item must be a sample position"):
        r.keep(item=N + 5)


# --------------------------------------------------------------------------- the widget


def test_cleaner_buttons_keys_and_results(tmp_path, case):
    images, noisy, issues = case
    labels_before, issues_before, images_before = noisy.copy(), issues.copy(), images.copy()
    c = nbdebug.LabelCleaner(
        images, noisy, issues, journal=tmp_path / "j.jsonl", backend="figurewidget"
    )
    assert isinstance(c, LabelCleaner)
    assert c.kind == "image"
    queue = list(issues.index[issues["is_issue"]])
    assert c.current == queue[0]
    assert f"sample <b>{queue[0]}</b>" in c.info.value and "top-3" in c.info.value
    np.testing.assert_array_equal(shown(c), images[queue[0]])
    c.keep_button.click()
    c.relabel_button.click()
    c.relabel_to.value = 2
    c.relabel_to_button.click()
    c.exclude_button.click()
    c.skip_button.click()
    assert list(c.decisions["action"]) == ["keep", "relabel", "relabel", "exclude", "skip"]
    assert c.decisions["new_label"].iloc[2] == 2
    assert c.current == queue[5]
    np.testing.assert_array_equal(shown(c), images[queue[5]])
    c.undo_button.click()
    assert c.current == queue[4] and len(c.decisions) == 4
    assert "undid skip" in c.message.value
    # keyboard: the strip is made on demand, in place of its button (an anywidget made
    # with the panel can miss anywidget's 2 s limit while a front end draws a debugger),
    # and sends {"key": ...}
    assert c.keys is None and c.keys_box.children == (c.keys_button,)
    c.keys_button.click()
    strip = c.keys
    assert strip is not None and c.keys_box.children == (strip,)
    c.enable_keys()
    assert c.keys is strip and c.keys_box.children == (strip,)
    c._on_key(c.keys, {"key": "x"}, [])
    assert c.decisions["action"].iloc[-1] == "exclude" and c.current == queue[5]
    c._on_key(c.keys, {"key": "u"}, [])
    assert c.current == queue[4]
    c._on_key(c.keys, {"key": "?"}, [])  # ignored
    assert len(c.decisions) == 4
    # results
    assert c.cleaned_labels()[queue[2]] == 2
    assert not c.mask()[queue[3]]
    out = c.export(tmp_path / "out.csv")
    assert pd.read_csv(out, keep_default_na=False)["label"].tolist() == c.cleaned_labels().tolist()
    assert "4/" in repr(c) and "LabelCleaner(" in repr(c)
    assert "application/vnd.jupyter.widget-view+json" in c._repr_mimebundle_()
    # nothing the user passed changed
    np.testing.assert_array_equal(noisy, labels_before)
    np.testing.assert_array_equal(images, images_before)
    pd.testing.assert_frame_equal(issues, issues_before)


def test_cleaner_bulk_button_shows_the_count_first(tmp_path, case):
    images, noisy, issues = case
    c = LabelCleaner(images, noisy, issues, journal=tmp_path / "j.jsonl")
    c.threshold.value = 0.8
    n = c.review.count_above(0.8)
    assert n > 1
    assert c.bulk_button.description == f"Accept {n} suggestions"
    assert len(c.decisions) == 0  # counting did not decide anything
    c.bulk_button.click()
    assert len(c.decisions) == n and set(c.decisions["action"]) == {"relabel"}
    assert c.bulk_button.description == "Accept 0 suggestions" and c.bulk_button.disabled
    c.undo_button.click()
    assert len(c.decisions) == 0 and c.bulk_button.description == f"Accept {n} suggestions"


def test_heatmap_click_and_dropdowns_filter_the_queue(tmp_path, case):
    images, noisy, issues = case
    f = issues[issues["is_issue"]]
    g, s = int(f.iloc[-1]["given_label"]), int(f.iloc[-1]["suggested_label"])
    want = list(f.index[(f["given_label"] == g) & (f["suggested_label"] == s)])
    c = LabelCleaner(images, noisy, issues, journal=tmp_path / "a.jsonl", backend="figurewidget")
    assert c.heatmap.backend == "figurewidget"
    trace = c.heatmap.figure.data[0]
    assert trace.name == "confident joint"
    # what plotly sends for a click on cell (x=s, y=g) of the heatmap
    trace._dispatch_on_click(
        Points(point_inds=[[g, s]], xs=[s], ys=[g], trace_name=trace.name, trace_index=0), None
    )
    assert c.review.filter == (g, s)
    assert (c.filter_given.value, c.filter_suggested.value) == (g, s)
    assert c.current == want[0]
    c.clear_filter.click()
    assert c.review.filter == (None, None) and c.filter_given.value == -1
    # the Output back end has no clicks: the dropdown pair does the same
    c2 = LabelCleaner(images, noisy, issues, journal=tmp_path / "b.jsonl", backend="output")
    assert isinstance(c2.heatmap.widget, widgets.Output)
    c2.filter_given.value = g
    c2.filter_suggested.value = s
    assert c2.review.filter == (g, s) and list(c2.review.queue) == want
    for item in want:
        assert c2.current == item
        c2.keep_button.click()
    assert c2.current is None and "Nothing left to review" in c2.info.value
    c2.keep_button.click()
    assert "nothing left" in c2.message.value


def test_cleaner_test_split_disables_relabeling(tmp_path, case):
    images, noisy, issues = case
    c = LabelCleaner(images, noisy, issues, journal=tmp_path / "j.jsonl", is_test=True)
    assert c.relabel_button.disabled and c.exclude_button.disabled and c.bulk_button.disabled
    assert "test split" in c.status.value
    c._act("relabel")  # e.g. the r key: refused with the reason, nothing written
    assert "is_test=True" in c.message.value and c.decisions.empty
    c.keep_button.click()
    assert list(c.decisions["action"]) == ["keep"]
    forced = LabelCleaner(
        images, noisy, issues, journal=tmp_path / "k.jsonl", is_test=True, force=True
    )
    assert not forced.relabel_button.disabled
    forced.relabel_button.click()
    assert list(forced.decisions["action"]) == ["relabel"]


def test_sample_rendering_kinds(tmp_path):
    images, noisy, issues = make_case(120)
    flat = LabelCleaner(images.reshape(120, 64), noisy, issues, journal=tmp_path / "a.jsonl")
    assert flat.kind == "image"
    np.testing.assert_array_equal(shown(flat), images[flat.current])
    chw = LabelCleaner(
        torch.as_tensor(images[:, None]), noisy, issues, journal=tmp_path / "b.jsonl"
    )
    assert chw.kind == "image"
    np.testing.assert_array_equal(shown(chw), images[chw.current])
    table = pd.DataFrame({"height": np.arange(120) * 1.5, "colour": ["red"] * 120})
    t = LabelCleaner(table, noisy, issues, journal=tmp_path / "c.jsonl")
    assert t.kind == "table" and t.current is not None
    assert "height" in t.sample_html.value and f"{t.current * 1.5:.4g}" in t.sample_html.value
    # many features: short columns side by side, every value shown up to 96, then a count
    # (101 features, not 100: a square number reads as a flat image)
    wide = np.arange(120 * 30, dtype=float).reshape(120, 30)
    w = LabelCleaner(wide, noisy, issues, journal=tmp_path / "w.jsonl")
    assert w.kind == "table"
    body = w.sample_html.value
    assert body.count("<tr>") == 12 and body.count("x[") == 30  # 3 columns of 12, 12, 6
    assert f"<td>{fmt_num(wide[w.current, 29])}</td>" in body and "more" not in body
    huge = LabelCleaner(np.zeros((120, 101)), noisy, issues, journal=tmp_path / "h.jsonl")
    assert huge.sample_html.value.count("x[") == 96 and "… 5 more features" in (
        huge.sample_html.value
    )
    texts = [f"review <{i}> text" for i in range(120)]
    tx = LabelCleaner(texts, noisy, issues, journal=tmp_path / "d.jsonl")
    assert tx.kind == "text" and f"review &lt;{tx.current}&gt; text" in tx.sample_html.value
    calls = []

    def render(sample, index):
        calls.append(index)
        return widgets.Label(f"custom {index}")

    cu = LabelCleaner(
        texts,
        noisy,
        issues,
        render=render,
        journal=tmp_path / "e.jsonl",
        class_names=list("abcdefghij"),
    )
    assert cu.kind == "custom" and calls == [cu.current]
    cu.skip_button.click()
    assert calls[-1] == cu.current
    assert cu.names[0] == "0: a"
    row = issues.loc[cu.current]
    assert (
        f'given <b style="color:#d62728">{row["given_label"]}: '
        f"{'abcdefghij'[row['given_label']]}</b>" in cu.info.value
    )


def test_cleaner_bad_inputs(tmp_path, case):
    images, noisy, issues = case
    with pytest.raises(ValueError, match="data has 10 samples but there are 300 labels"):
        LabelCleaner(images[:10], noisy, issues, journal=tmp_path / "a.jsonl")
    with pytest.raises(TypeError, match="data must hold the samples"):
        LabelCleaner(None, noisy, issues, journal=tmp_path / "b.jsonl")
    with pytest.raises(TypeError, match="render must be a callable"):
        LabelCleaner(images, noisy, issues, render="png", journal=tmp_path / "c.jsonl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="class_names must name all 10 classes; got 3"):
        LabelCleaner(
            images, noisy, issues, class_names=["a", "b", "c"], journal=tmp_path / "d.jsonl"
        )
    # a refused call writes no journal: the corrected call on the same path opens fine
    assert list(tmp_path.iterdir()) == []
    c = LabelCleaner(images, noisy, issues, journal=tmp_path / "a.jsonl")
    assert list(tmp_path.iterdir()) == []  # nor does a review without a decision
    c.keep_button.click()
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(x)["type"] for x in lines] == ["header", "decision"]


def test_ensemble_rows_without_agreed_suggestion(tmp_path):
    images, noisy, _ = make_case(120)
    rng = np.random.default_rng(1)
    P1 = rng.dirichlet(np.ones(10), 120)
    P2 = rng.dirichlet(np.ones(10), 120)
    issues = find_label_issues(noisy, pred_probs=[P1, P2], method="ensemble", tau=0.9)
    flagged = issues[issues["is_issue"]]
    assert (flagged["suggested_label"] == -1).any()
    c = LabelCleaner(images, noisy, issues, journal=tmp_path / "j.jsonl")
    item = int(flagged.index[flagged["suggested_label"] == -1][0])
    c.set_filter(given=int(noisy[item]))
    while c.current != item:
        c.skip_button.click()
    assert c.relabel_button.disabled and "none agreed" in c.info.value
    with pytest.raises(ValueError, match="has no suggested label: pass new_label="):
        c.review.relabel(item=item)
    c.relabel_to.value = 3
    c.relabel_to_button.click()
    assert c.cleaned_labels()[item] == 3


def test_journal_class_directly(tmp_path):
    j = Journal(tmp_path / "j.jsonl", fingerprint="abc", n_items=3, n_classes=2)
    assert j.append([]) == []
    recs = j.append([{"item": 0, "action": "keep"}, {"item": 1, "action": "keep"}])
    assert {r["batch"] for r in recs} == {1} and [r["seq"] for r in recs] == [1, 2]
    assert len(j.undo()) == 2 and j.active() == []
    j2 = Journal(tmp_path / "j.jsonl", fingerprint="abc", n_items=3, n_classes=2)
    assert j2.active() == [] and len(j2.records) == 3
    assert "decisions=0" in repr(j2)


def test_cleaner_as_the_debuggers_labels_tab(tmp_path, case):
    images, noisy, issues = case
    model = torch.nn.Linear(64, 10)
    x = torch.as_tensor(images[:16].reshape(16, 64), dtype=torch.float32)
    y = torch.as_tensor(noisy[:16])
    dbg = nbdebug.debug(model, x, y, torch.nn.functional.cross_entropy, backend="output")
    cleaner = LabelCleaner(images, noisy, issues, journal=tmp_path / "j.jsonl", backend="output")
    dbg.add_tab("Labels", cleaner)
    assert dbg.tabs.titles[-1] == "Labels" and dbg.tabs.children[-1] is cleaner.widget
    cleaner.keep_button.click()
    assert len(cleaner.decisions) == 1


def test_issues_for_more_samples_than_labels_say_both_counts():
    from nbdebug.analysis.labels.review import check_issues

    issues = pd.DataFrame(
        {c: [0] * 3 for c in ("given_label", "suggested_label", "label_quality", "is_issue")},
        index=[0, 10, 49],
    )
    with pytest.raises(
        ValueError, match=r"0\.\.44 \(there are 45 labels; .*\); its index runs 0\.\.49\.$"
    ):
        check_issues(issues, np.zeros(45, dtype=int))
