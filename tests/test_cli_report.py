"""``nsa report`` on a finished run, a crashed run, several runs, and the newest run."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nsa_cli.app import app
from tests.conftest import dead_pid, nsa, write_run

runner = CliRunner()


def test_report_finished_and_crashed(tmp_path) -> None:
    ok = write_run(tmp_path / "artifacts" / "ok")
    crashed = write_run(tmp_path / "artifacts" / "crashed", end=None, pid=dead_pid(), truncated=True)
    out = tmp_path / "Reports"
    res = runner.invoke(app, ["report", str(ok), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["runs"][0]["verdict"] == "PASS" and data["path"].endswith("Test Engineer Report - ok v1.md")
    assert all(p.endswith(".png") for p in data["images"])
    res = nsa("report", str(crashed), "--out", str(out))
    assert res.returncode == 1, res.stderr  # a FAIL verdict fails the command
    assert "FAIL" in res.stdout and "crashed" in res.stdout
    text = next(out.glob("*crashed v1.md")).read_text()
    assert "**Overall verdict: FAIL**" in text and "1 truncated" in text


def test_report_two_runs_and_newest(tmp_path) -> None:
    a = write_run(tmp_path / "artifacts" / "s512", seq_len=512)
    b = write_run(tmp_path / "artifacts" / "s1024", seq_len=1024, backend="triton")
    out = tmp_path / "Reports"
    res = runner.invoke(app, ["report", str(a), str(b), "--out", str(out), "--title", "Selection matrix"])
    assert res.exit_code == 0, res.output
    text = next(out.glob("*Selection matrix v1.md")).read_text()
    assert "## Comparison" in text and "| s512 | 512 |" in text and "triton" in text
    res = runner.invoke(app, ["report", "--artifacts", str(tmp_path / "artifacts"), "--out", str(out), "--no-charts"])
    assert res.exit_code == 0 and "s1024" in res.output  # the newest run
    res = runner.invoke(app, ["report", "--artifacts", str(tmp_path / "nothing"), "--out", str(out)])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = runner.invoke(app, ["report", str(tmp_path), "--out", str(out)])
    assert res.exit_code == 2 and "not a run directory" in res.output
