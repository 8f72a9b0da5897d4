"""Selection diagnostics during and after training (issue 24): the trainer's eval rows (heartbeat, val.csv,
TensorBoard, the eval line, scorer_kl), the run summary, ``nsa watch``, ``nsa report`` (section and the
``monitor.min_selection_recall`` check) and ``nsa eval --task selection``; dense runs stay empty.

The tiny NSA model (l_sel 8, n_sel 4) selects from position 32 on: these runs use seq_len 64."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nsa.rundir.records import VAL_CSV_HEADER
from nsa.runs.reader import read_run
from nsa.runs.report import build_report, selection_reading
from nsa.runs.summary import summarize
from nsa.train.telemetry import CsvLog
from nsa.train.trainer import Trainer
from nsa_cli.app import app
from tests.conftest import csv_rows, events, quiet, resolve

runner = CliRunner()
SEL = {"train__seq_len": 64, "eval__every": 2, "eval__batches": 1, "eval__selection_queries": 16}


def _train(out: Path, steps: int = 4, **extra: Any) -> tuple[Path, str]:
    rep = quiet()
    result = Trainer(resolve(out, steps, **{**SEL, **extra}), reporter=rep).fit()
    assert result.status == "completed"
    return out, rep.text()


@pytest.fixture(scope="module")
def nsa_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return _train(tmp_path_factory.mktemp("sel") / "nsa")


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("sel") / "dense", 2, model__attention="dense")[0]


def _failing(report: Any) -> list[str]:
    """Names of the checks that FAIL in the report's first run (the verdict also weighs timing checks, which
    a loaded CI machine can fail on a tiny run)."""
    return [c.name for c in report.checks[0] if c.result == "FAIL"]


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / run.name
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("tb", "eval"))
    return dst


def _tb_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def _set_monitor(run: Path, **limits: Any) -> None:
    path = run / "config.yaml"
    body, _, sources = path.read_text().partition("# _sources")
    cfg = yaml.safe_load(body)
    cfg["monitor"].update(limits)
    path.write_text(yaml.safe_dump(cfg) + "# _sources" + sources)


# ------------------------------------------------------------------------------------------- training


def test_training_records_selection_at_each_evaluation(nsa_run: tuple[Path, str]) -> None:
    run, text = nsa_run
    evals = [e for e in events(run) if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        layers = e["selection"]
        assert [r["layer"] for r in layers] == [0, 1]
        for r in layers:
            assert set(r) == {"layer", "recall", "recall_best", "recall_forced", "cmp_entropy", "kl", "gates"}
            assert 0.0 <= r["recall_forced"] <= r["recall"] + 1e-6 <= r["recall_best"] + 2e-6 <= 1.0 + 3e-6 and 0.0 <= r["cmp_entropy"] <= 1.0 + 1e-6 and r["kl"] >= 0.0
            assert len(r["gates"]) == 3 and all(0.0 < g < 1.0 for g in r["gates"])
        recalls = [r["recall"] for r in layers]
        assert e["sel_recall_mean"] == pytest.approx(sum(recalls) / 2) and e["sel_recall_min"] == min(recalls)
        assert e["cmp_entropy_mean"] == pytest.approx(sum(r["cmp_entropy"] for r in layers) / 2)
    rows = csv_rows(run / "val.csv")
    assert tuple(rows[0]) == VAL_CSV_HEADER and [r["step"] for r in rows] == ["2", "4"]
    for row, e in zip(rows, evals, strict=True):
        mean, low, ent = (float(row[k]) for k in ("sel_recall_mean", "sel_recall_min", "cmp_entropy_mean"))
        assert 0.0 <= low <= mean <= 1.0 and 0.0 <= ent <= 1.0 + 1e-6
        assert mean == pytest.approx(e["sel_recall_mean"])
    tb = _tb_scalars(run)
    for tag in ("sel/recall_L0", "sel/recall_L1", "sel/cmp_entropy_L1", "sel/kl_L0", "gate/L1_win", "sel/recall_mean"):
        assert [s for s, _ in tb[tag]] == [2, 4], tag
    assert tb["sel/recall_mean"][1][1] == pytest.approx(evals[1]["sel_recall_mean"], rel=1e-6)
    assert "sel/scorer_kl" not in tb  # the scorer loss is off
    line = next(x for x in text.splitlines() if "eval step 4:" in x)
    low_layer = min(evals[1]["selection"], key=lambda r: r["recall"])["layer"]
    assert f"| recall {evals[1]['sel_recall_mean']:.2f} (min L{low_layer} " in line
    assert all(r["scorer_kl"] == "" for r in csv_rows(run / "training.csv"))
    assert all(e["scorer_kl"] is None for e in events(run) if e["event"] == "progress")
    # the alignment loss is on by default: its mean since the last log step, about -log of the training recall
    nll = [float(r["align_nll"]) for r in csv_rows(run / "training.csv")]
    assert nll and all(0.0 < v < 10.0 for v in nll)
    assert [e["align_nll"] for e in events(run) if e["event"] == "progress"][-1] == pytest.approx(nll[-1], rel=1e-6)
    assert "sel/align_nll" in tb


def test_scorer_kl_is_logged_while_the_scorer_trains(tmp_path: Path) -> None:
    run, _ = _train(tmp_path / "scorer", 2, eval__every=0, scorer__weight=0.1, scorer__queries=4,
                    train__batch_size=1)
    rows = csv_rows(run / "training.csv")
    assert [r["step"] for r in rows] == ["1", "2"]
    kls = [float(r["scorer_kl"]) for r in rows]
    assert all(math.isfinite(v) and v > 0 for v in kls)
    progress = [e for e in events(run) if e["event"] == "progress"]
    assert [e["scorer_kl"] for e in progress] == pytest.approx(kls)
    assert [s for s, _ in _tb_scalars(run)["sel/scorer_kl"]] == [1, 2]


def test_dense_run_leaves_the_selection_empty(dense_run: Path, tmp_path: Path) -> None:
    rows = csv_rows(dense_run / "val.csv")
    assert rows and all(r[k] == "" for r in rows for k in ("sel_recall_mean", "sel_recall_min", "cmp_entropy_mean"))
    ev = [e for e in events(dense_run) if e["event"] == "eval"]
    assert ev and all(e["selection"] is None and e["sel_recall_mean"] is None for e in ev)
    assert not [t for t in _tb_scalars(dense_run) if t.startswith("sel/recall")]
    s = summarize(read_run(dense_run), time.time())
    assert s.selection_step is None and s.selection is None and s.sel_recall_mean is None
    res = runner.invoke(app, ["watch", str(dense_run), "--once"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    row = next(x for x in res.stdout.splitlines() if " selection " in x)
    assert "–" in row and "none yet" in row
    rep = build_report([dense_run], tmp_path / "rep", charts=False)
    assert "### Selection" not in rep.path.read_text()
    check = next(c for c in rep.checks[0] if c.name == "selection recall")
    assert check.result == "not set" and "dense model" in check.figure
    assert "selection recall" not in _failing(rep)


def test_a_resumed_csv_keeps_old_rows_under_the_wider_header(tmp_path: Path) -> None:
    path = tmp_path / "val.csv"
    path.write_text("step,val_loss,val_ppl\n2,5.0,148.4\n4,4.5,90.0\n")
    log = CsvLog(path, VAL_CSV_HEADER, keep_until_step=2)
    log.row({"step": 3, "val_loss": 4.8, "val_ppl": 121.5, "sel_recall_mean": 0.7})
    log.close()
    rows = csv_rows(path)
    assert [(r["step"], r["val_loss"], r["sel_recall_mean"]) for r in rows] == [("2", "5.0", ""), ("3", "4.8", "0.7")]


# ---------------------------------------------------------------------------------- summary, watch, report


def test_summary_and_watch_show_the_last_evaluation(nsa_run: tuple[Path, str]) -> None:
    run, _ = nsa_run
    last = [e for e in events(run) if e["event"] == "eval"][-1]
    s = summarize(read_run(run), time.time())
    assert s.selection_step == 4 and s.selection == last["selection"]
    assert s.sel_recall_mean == pytest.approx(last["sel_recall_mean"]) and s.sel_recall_min == last["sel_recall_min"]
    assert s.cmp_entropy_mean == pytest.approx(last["cmp_entropy_mean"])
    assert s.sel_recall_min_layer == min(last["selection"], key=lambda r: r["recall"])["layer"]
    res = runner.invoke(app, ["watch", str(run), "--once"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    row = next(x for x in res.stdout.splitlines() if " selection " in x)
    assert f"recall {s.sel_recall_mean:.2f} mean" in row and f"min {s.sel_recall_min:.2f} (L{s.sel_recall_min_layer})" in row
    assert f"cmp H {s.cmp_entropy_mean:.2f}" in row and "step 4" in row
    res = runner.invoke(app, ["watch", str(run), "--once", "--json"])
    summary = json.loads(res.stdout)["summary"]
    assert summary["selection_step"] == 4 and len(summary["selection"]) == 2
    assert summary["sel_recall_mean"] == pytest.approx(s.sel_recall_mean)


def test_summary_tolerates_odd_eval_events(nsa_run: tuple[Path, str], tmp_path: Path) -> None:
    run = _copy(nsa_run[0], tmp_path)
    hb = run / "heartbeat_rank0.jsonl"
    lines = hb.read_text().splitlines()
    at = next(i for i, x in enumerate(lines) if '"event": "end"' in x)
    odd = {"schema": 1, "event": "eval", "ts": time.time(), "rank": 0, "pid": 1, "step": 5, "val_loss": 4.0,
           "selection": ["junk", {"layer": 1, "recall": "high", "gates": [0.1, None]}, {"layer": 0, "recall": 0.25}]}
    old = {"schema": 1, "event": "eval", "ts": time.time(), "rank": 0, "pid": 1, "step": 6, "val_loss": 4.0}
    hb.write_text("\n".join([*lines[:at], json.dumps(odd), json.dumps(old), *lines[at:]]) + "\n")
    s = summarize(read_run(run), time.time())
    assert s.selection_step == 5 and s.sel_recall_mean == 0.25 and s.sel_recall_min_layer == 0
    assert s.selection == [{"layer": 1, "recall": None, "recall_best": None, "recall_forced": None, "cmp_entropy": None,
                            "kl": None, "gates": None},
                           {"layer": 0, "recall": 0.25, "recall_best": None, "recall_forced": None, "cmp_entropy": None,
                            "kl": None, "gates": None}]
    build_report([run], tmp_path / "rep", charts=False)  # renders without the missing figures


def test_report_has_the_selection_section(nsa_run: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = nsa_run
    s = summarize(read_run(run), time.time())
    res = build_report([run], tmp_path / "rep", charts=False)
    text = res.path.read_text()
    section = text.split("### Selection (last evaluation, step 4)", 1)[1].split("\n### ", 1)[0]
    assert "| layer | recall | ceiling | forced blocks | compressed entropy | scorer KL | gates cmp / sel / win |" in section
    assert s.selection is not None
    for r in s.selection:
        gates = " / ".join(f"{g:.3f}" for g in r["gates"])
        assert r["recall"] <= r["recall_best"] + 1e-6  # the ceiling travels from the trainer's probe to the report
        assert (f"| {r['layer']} | {r['recall']:.3f} | {r['recall_best']:.3f} | {r['recall_forced']:.3f} "
                f"| {r['cmp_entropy']:.3f} | {r['kl']:.3f} "
                f"| {gates} |") in section
    assert selection_reading(s.selection) in section
    assert s.align_nll is not None and f"Alignment loss (training, last log step): {s.align_nll:.4f}" in section
    check = next(c for c in res.checks[0] if c.name == "selection recall")
    assert check.result == "not set" and f"mean {s.sel_recall_mean:.3f}" in check.figure
    assert "selection recall" not in _failing(res)


def test_selection_reading_names_the_weak_layers() -> None:
    layers = [{"layer": 0, "recall": 0.3, "cmp_entropy": 0.5}, {"layer": 1, "recall": 0.9, "cmp_entropy": 0.99},
              {"layer": 3, "recall": 0.45, "cmp_entropy": 0.4}]
    text = selection_reading(layers)
    assert text.startswith("Recall below 0.5 in layers 0, 3: selection misses most of what dense attention reads there")
    assert "near uniform (entropy > 0.95) in layer 1:" in text
    assert "lowest 0.90, layer 1" in selection_reading([{"layer": 1, "recall": 0.9, "cmp_entropy": 0.5}])
    assert "recall is 1 by construction" in selection_reading([{"layer": 0, "recall": None, "cmp_entropy": None}])


def test_min_selection_recall_fails_the_verdict_when_set(nsa_run: tuple[Path, str], tmp_path: Path) -> None:
    run = _copy(nsa_run[0], tmp_path)
    _set_monitor(run, min_selection_recall=1.01)
    res = build_report([run], tmp_path / "rep", charts=False)
    check = next(c for c in res.checks[0] if c.name == "selection recall")
    assert check.result == "FAIL" and check.key == "min_selection_recall"
    assert res.verdicts[0][0] == "FAIL"
    line = f"{check.figure} {check.why}"
    assert "selection recall mean 0." in line and "below the minimum 1.01" in line and "(evaluation at step 4)" in line
    _set_monitor(run, min_selection_recall=0.05)
    res = build_report([run], tmp_path / "rep2", charts=False)
    assert next(c for c in res.checks[0] if c.name == "selection recall").result == "PASS"
    assert "selection recall" not in _failing(res)  # (other checks, e.g. the throughput tail under load, may vary)


# ------------------------------------------------------------------------------------------ nsa eval


def test_eval_selection_averages_the_report_over_val_batches(nsa_run: tuple[Path, str]) -> None:
    from nsa.data.tokenizers import get_tokenizer
    from nsa.eval.tasks import _val_loader, eval_selection
    from nsa.model.load import load_model

    loaded = load_model(nsa_run[0])
    tok, cpu = get_tokenizer("byte"), torch.device("cpu")
    rows = eval_selection(loaded.model, loaded.config, tok, [16, 64], batches=2, queries=8, batch_size=2, device=cpu)
    assert [(r["context"], r["layer"], r["n"]) for r in rows] == [(16, 0, 4), (16, 1, 4), (64, 0, 4), (64, 1, 4)]
    assert all(r["recall"] is None and r["kl"] is None and len(r["gates"]) == 3 for r in rows[:2])
    with torch.no_grad(), _val_loader(loaded.config, tok, 64, 2, cpu) as loader:
        first = [loaded.model.selection_report(next(loader)[0], 8) for _ in range(2)]
    for r in rows[2:]:
        want = [b[r["layer"]] for b in first]
        assert r["recall"] == pytest.approx(sum(w["recall"] for w in want) / 2)
        assert r["kl"] == pytest.approx(sum(w["kl"] for w in want) / 2)
        assert 0.0 <= r["recall"] <= 1.0


def test_cli_eval_selection(nsa_run: tuple[Path, str], dense_run: Path, tmp_path: Path) -> None:
    run = _copy(nsa_run[0], tmp_path)
    res = runner.invoke(app, ["eval", str(run), "--task", "selection", "--contexts", "16,64", "--samples", "2",
                              "--queries", "8", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["task"] == "selection" and data["settings"]["queries"] == 8 and data["settings"]["samples"] == 2
    assert [(r["context"], r["layer"]) for r in data["results"]] == [(16, 0), (16, 1), (64, 0), (64, 1)]
    assert all(0.0 <= r["recall"] <= 1.0 for r in data["results"][2:])
    assert json.loads((run / "eval" / "selection.json").read_text()) == data
    assert "–: all blocks selected at this length" in res.stderr and "compressed entropy" in res.stderr
    rep = build_report([run], tmp_path / "rep", charts=False)
    section = rep.path.read_text().split("#### Selection (nsa eval)", 1)[1]
    assert "| 16 | 0 | – |" in section and "| 64 | 1 | 0." in section

    res = runner.invoke(app, ["eval", str(dense_run), "--task", "selection", "--contexts", "64", "--no-save"])
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.output
    assert "needs an NSA model" in res.stderr
