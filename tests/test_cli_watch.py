"""``nsa watch``: snapshots of hand-written run directories (corrupt lines, multi-rank) and the watchdog."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nsa_cli.app import app
from tests.conftest import nsa, write_run

runner = CliRunner()


def test_once_on_directory_with_corrupt_lines(tmp_path) -> None:
    run = write_run(tmp_path / "r", corrupt=True, truncated=True, end=None, ranks=2)
    res = runner.invoke(app, ["watch", str(run), "--once"])
    assert res.exit_code == 0, res.output
    for needle in ("RUNNING", "step 40/100", "loss", "tokens/s", "fetch p50/p95", "rank0", "rank1", "corrupt"):
        assert needle in res.output, needle
    res = nsa("watch", str(run), "--once", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["summary"]["status"] == "running" and data["summary"]["corrupt_lines"] >= 2
    assert data["summary"]["world_size"] == 2 and data["alarms"] == []


def test_once_shows_alarms_and_exit_code(tmp_path) -> None:
    run = write_run(tmp_path / "r", end=None, fetch_p95_ms=8000.0, collapse=0.9)
    res = runner.invoke(app, ["watch", str(run), "--once", "--json"])
    assert res.exit_code == 1
    rules = {a["rule"] for a in json.loads(res.stdout)["alarms"]}
    assert {"fetch-stall", "gate-collapse"} <= rules
    assert not (run / ".HALT").exists()  # alarms alone do not halt


def test_watchdog_writes_halt_with_rule_and_evidence(tmp_path) -> None:
    run = write_run(tmp_path / "r", end=None, nonfinite_at=25)
    res = runner.invoke(app, ["watch", str(run), "--once", "--halt-on", "nonfinite,stale=600"])
    assert res.exit_code == 1
    halt = json.loads((run / ".HALT").read_text())
    assert halt["rule"] == "nonfinite" and halt["evidence"]["kind"] == "nonfinite_loss"
    assert halt["reason"].startswith("watchdog:") and "nsa watch" in halt["who"]
    assert "watchdog wrote .HALT" in res.output


def test_live_mode_returns_when_the_run_has_ended(tmp_path) -> None:
    run = write_run(tmp_path / "done")
    res = runner.invoke(app, ["watch", str(run), "--refresh", "0.1"])
    assert res.exit_code == 0 and "COMPLETED" in res.output


def test_usage_errors(tmp_path) -> None:
    res = nsa("watch", str(tmp_path / "missing"), "--once")
    assert res.returncode == 2 and res.stderr.startswith("error: run directory") and "Traceback" not in res.stderr
    run = write_run(tmp_path / "r")
    res = runner.invoke(app, ["watch", str(run), "--once", "--halt-on", "stale=abc"])
    assert res.exit_code == 2 and "threshold must be a number" in res.output


def test_live_watchdog_halts_and_keeps_watching(tmp_path) -> None:
    run = write_run(tmp_path / "r", end=None, fetch_p95_ms=7000.0)
    res = runner.invoke(app, ["watch", str(run), "--halt-on", "fetch-stall=5000", "--refresh", "0.1", "--timeout", "0.5"])
    assert res.exit_code == 0, res.output
    halt = json.loads((run / ".HALT").read_text())
    assert halt["rule"] == "fetch-stall" and halt["evidence"]["fetch_p95_ms"] == 7000.0
    assert "pending .HALT" in res.output and "watchdog wrote .HALT" in res.output
