"""The run directory's vocabulary (``nsa.rundir.records``) and the watch rules as declarations (issue 34,
"Structure"): one spelling of each record field and rule, derived tables, schemas checked on read."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from nsa.rundir.layout import read_halt, watchdog_reason, watchdog_rule
from nsa.rundir.records import EVENT_FIELDS, EVENTS, TRAIN_CSV_HEADER, TrainRow, newer_schema
from nsa.runs.rules import ALIASES, RULES, canonical, parse_rules, synopsis
from nsa_cli.app import app
from tests.conftest import events, halt_at, quiet, resolve, write_run

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_the_field_tables_are_derived_from_the_record_types() -> None:
    assert set(EVENT_FIELDS) == set(EVENTS) and tuple(TrainRow.__annotations__) == TRAIN_CSV_HEADER
    assert "rule" in EVENT_FIELDS["halt"] and "gpu_util_pct" in EVENT_FIELDS["progress"]
    assert newer_schema({"schema": 2}, 1) == 2 and newer_schema({"schema": 1}, 1) is None
    assert newer_schema({}, 1) is None and newer_schema({"schema": True}, 1) is None


def test_a_file_written_by_a_newer_nsa_is_said(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=20, seed=4)
    with open(run / "heartbeat_rank0.jsonl", "a") as f:
        f.write(json.dumps({"schema": 2, "event": "note", "ts": 1e9, "rank": 0, "pid": 1, "step": 20}) + "\n")
    (run / "metrics.json").write_text(json.dumps({"schema": 3, "status": "completed"}))
    runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert "heartbeat_rank0.jsonl is schema 2, written by a newer nsa (this one reads schema 1)" in text
    assert "metrics.json is schema 3" in text and "| record formats |" in text


def test_one_halt_reader_and_the_rule_travels_into_the_halt_event(tmp_path: Path) -> None:
    from nsa.train.trainer import Trainer

    (tmp_path / ".HALT").write_bytes(b"")
    assert read_halt(tmp_path)["reason"] == ""  # type: ignore[index]
    assert read_halt(tmp_path / "missing") is None
    reason = watchdog_reason("fetch-stall", "data fetch p95 2500 ms > 2000 ms")
    assert reason == "watchdog: fetch-stall: data fetch p95 2500 ms > 2000 ms" and watchdog_rule(reason) == "fetch-stall"
    assert watchdog_rule("watchdog: rank 0 heartbeat is 412 s old") is None and watchdog_rule("ops: x") is None
    run = tmp_path / "run"
    hook = halt_at(run, 2, json.dumps({"reason": reason, "rule": "fetch-stall", "who": "nsa watch"}))
    result = Trainer(resolve(run, 20, eval__every=0), reporter=quiet(), step_hook=hook).fit()
    assert result.status == "halted" and result.halted_by == "watchdog"
    halt = next(e for e in events(run) if e["event"] == "halt")
    assert halt["rule"] == "fetch-stall" and halt["reason"] == reason


def test_each_rule_is_declared_once_and_everything_else_is_derived() -> None:
    assert len(RULES) == 13 and len(parse_rules("all")) == 13
    assert all(r.help and r.check is not None for r in RULES.values())
    assert all((r.field is None) == (r.unit == "") for r in RULES.values())
    assert len(ALIASES) == sum(len(r.aliases) for r in RULES.values())  # no alias names two rules
    assert canonical("Crash") == "crashed" and canonical("unknown") == "unknown"
    assert {r.name for r in RULES.values() if r.after_end} == {"nonfinite", "data-fallback"}
    help_text = " ".join(runner.invoke(app, ["watch", "--help"], env={"COLUMNS": "400"}).output.split())
    assert synopsis() in help_text
    ops = (ROOT / "docs" / "operations.md").read_text()
    for r in RULES.values():  # the docs' rule table has a row per declared rule
        assert f"| `{r.name}" in ops, r.name
