"""The trainer's side of operator monitoring: train.log, step lines with fetch latency, heartbeat
cadence, long-run warnings (trainer and preflight) and the older system's NSA_* knobs."""

from __future__ import annotations

import json
from pathlib import Path

from nsa.config import load_run_config
from nsa.config.settings import LEGACY_VARS, describe_unknown
from nsa.train.runtime import long_run_warnings
from nsa.train.trainer import Trainer
from tests.conftest import csv_rows, events, quiet, resolve

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_train_log_holds_every_printed_line_with_fetch_latency(tmp_path: Path) -> None:
    run = tmp_path / "run"
    Trainer(resolve(run, 6, eval__every=0, logging__every=2), reporter=quiet()).fit()
    log = (run / "train.log").read_text()
    assert "nsa train run" in log and "resolved config" in log and "done 6 steps" in log
    steps = [line for line in log.splitlines() if " step " in line and "fetch p50/p95" in line]
    assert len(steps) == 4  # steps 1, 2, 4, 6
    assert all(line[:4].isdigit() for line in steps)  # time-stamped
    Trainer(resolve(run, 8, eval__every=0, logging__every=2, train__resume="auto"), reporter=quiet()).fit()
    again = (run / "train.log").read_text()
    assert again.startswith(log) and "resumed from" in again  # appended on resume


def test_heartbeat_every_step_without_extra_csv_rows(tmp_path: Path) -> None:
    run = tmp_path / "run"
    Trainer(resolve(run, 8, eval__every=0, logging__every=4, logging__heartbeat_every=1),
            reporter=quiet()).fit()
    progress = [e["step"] for e in events(run) if e["event"] == "progress"]
    assert progress == list(range(1, 9))
    assert [int(r["step"]) for r in csv_rows(run / "training.csv")] == [1, 4, 8]


def test_long_run_warnings_name_the_keys(tmp_path: Path) -> None:
    long = load_run_config("tiny", environ={}, sets=["train.steps=50000", "checkpoint.every=0", "eval.every=0",
                                                     "checkpoint.keep_last=1", "logging.every=5000"]).config
    text = " ".join(long_run_warnings(long))
    for key in ("checkpoint.every=0", "eval.every=0", "logging.every=5000"):
        assert key in text
    assert long_run_warnings(load_run_config("tiny", environ={}).config) == []
    run = tmp_path / "run"
    console = quiet()
    Trainer(resolve(run, 3, eval__every=0, data__synthetic_on_fail=True), reporter=console).fit()
    assert "data.synthetic_on_fail=true" in (run / "train.log").read_text()


def test_preflight_warns_on_long_run_settings() -> None:
    from nsa.checks.preflight import run_preflight

    report = run_preflight(profile="cpu", config="tiny", environ={},
                           sets=["train.steps=50000", "checkpoint.every=0"])
    check = next(c for c in report.checks if c.name == "config")
    assert check.status.value == "WARN" and "checkpoint.every=0" in check.reason


def test_old_knobs_are_named_with_their_replacement(tmp_path: Path) -> None:
    assert "NSA_ATTN_BACKEND" in describe_unknown("NSA_USE_FA2")
    assert "NSA_ATTN_BACKEND=reference" in describe_unknown("NSA_FORCE_PARITY")
    assert describe_unknown("NSA_PREFECH_DEPTH") == "NSA_PREFECH_DEPTH (did you mean NSA_PREFETCH_DEPTH?)"
    migrating = (DOCS / "migrating.md").read_text()
    for name in LEGACY_VARS:
        assert name in migrating, name
    for field in ("toks_per_s", "gpu_mem_alloc", "dt_fetch_s", "gate_collapse_frac"):
        assert f"`{field}`" in migrating
    run = tmp_path / "run"
    resolved = load_run_config("tiny", environ={"NSA_USE_SEL_PACK": "1"},
                               flags={"train.steps": 2, "train.out_dir": str(run), "train.seq_len": 32,
                                      "train.batch_size": 2, "eval.every": 0})
    Trainer(resolved, reporter=quiet()).fit()
    assert "NSA_USE_SEL_PACK=1 (older system: replaced by NSA_ATTN_BACKEND=triton" in (run / "train.log").read_text()
    assert json.loads((run / "env.json").read_text())["nsa_unknown_variables"] == ["NSA_USE_SEL_PACK"]
