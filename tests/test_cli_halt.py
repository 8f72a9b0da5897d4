"""``nsa halt`` on hand-written run directories, and on a live tiny training run (with watch and report)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nsa_cli.app import app
from tests.conftest import clean_env, dead_pid, nsa, write_run

runner = CliRunner()


def test_halt_writes_reason_time_who(tmp_path) -> None:
    run = write_run(tmp_path / "r", end=None)
    res = runner.invoke(app, ["halt", str(run), "--reason", "disk swap", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["outcome"] == "written"
    data = json.loads((run / ".HALT").read_text())
    assert data["reason"] == "disk swap" and data["time"] > 0 and data["who"]


def test_halt_errors_and_wait_outcomes(tmp_path) -> None:
    res = nsa("halt", str(tmp_path))
    assert res.returncode == 2 and "not a run directory" in res.stderr and len(res.stderr.splitlines()) == 1
    crashed = write_run(tmp_path / "c", end=None, pid=dead_pid())
    res = runner.invoke(app, ["halt", str(crashed), "--wait", "--timeout", "5"])
    assert res.exit_code == 1 and "crashed" in res.output
    done = write_run(tmp_path / "d")
    res = runner.invoke(app, ["halt", str(done)])
    assert res.exit_code == 0 and "already ended" in res.output and not (done / ".HALT").exists()


def _wait_for(pred, timeout: float, proc: subprocess.Popen) -> None:
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early: {proc.communicate()}")
        if time.time() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.2)


@pytest.mark.slow
def test_live_run_watch_halt_report(tmp_path: Path) -> None:
    run = tmp_path / "live"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nsa_cli", "train", "--config", "tiny", "--steps", "2000", "--out-dir", str(run),
         "--set", "logging.every=1", "--set", "eval.every=0", "--set", "checkpoint.every=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )
    try:
        hb = run / "heartbeat_rank0.jsonl"
        _wait_for(lambda: hb.exists() and '"progress"' in hb.read_text(), 180, proc)
        res = nsa("watch", str(run), "--once")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "RUNNING" in res.stdout and "/2000" in res.stdout
        res = nsa("halt", str(run), "--reason", "test halt", "--wait", "--timeout", "120", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        out = json.loads(res.stdout)
        assert out["outcome"] == "acknowledged" and out["checkpoint"]
        assert proc.wait(timeout=60) == 0
        assert Path(out["checkpoint"]).is_dir() and (Path(out["checkpoint"]) / "manifest.json").is_file()
        events = [json.loads(line) for line in hb.read_text().splitlines()]
        assert [e["event"] for e in events][-2:] == ["halt", "end"] and events[-1]["status"] == "halted"
        assert any(e["event"] == "checkpoint" and e["reason"] == "halt" for e in events)
        res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--json"])
        assert res.exit_code == 0, res.output
        verdict = json.loads(res.stdout)["runs"][0]
        assert verdict["status"] == "halted" and verdict["verdict"] == "PASS" and "test halt" in verdict["why"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
