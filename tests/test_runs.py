"""Run-directory reading, watch rules, halt writing and report building on run directories written by
hand per docs/run-directory.md (fixtures include truncated and corrupt lines, several ranks, crashes)."""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nsa.errors import ConfigError, RunDirError
from nsa.runs.halt import halt_run, wait_for_ack, write_halt
from nsa.runs.reader import JsonlTail, RunReader, check_run_dir, read_run
from nsa.runs.report import build_report, newest_run, verdict
from nsa.runs.rules import evaluate, parse_rules
from nsa.runs.summary import summarize
from tests.conftest import dead_pid, write_run

# ------------------------------------------------------------------------------------------------ reader


def test_jsonl_tail_reads_incrementally_and_keeps_partial_lines(tmp_path: Path) -> None:
    p = tmp_path / "heartbeat_rank0.jsonl"
    tail = JsonlTail(p)
    assert tail.read_new() == []  # missing file
    vals = [random.random() for _ in range(3)]
    p.write_text(json.dumps({"a": vals[0]}) + "\n" + '{"a": ')
    assert [o["a"] for o in tail.read_new()] == [vals[0]]
    assert tail.truncated
    with open(p, "a") as f:
        f.write(f"{vals[1]}}}\nnot json\n" + json.dumps({"a": vals[2]}) + "\n")
    got = tail.read_new()
    assert [o["a"] for o in got] == vals[1:]
    assert tail.corrupt == 1 and not tail.truncated
    assert tail.read_new() == []


def test_reader_tolerates_corrupt_truncated_and_missing(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", corrupt=True, truncated=True, end=None)
    (run / "env.json").unlink()
    st = read_run(run)
    assert st.corrupt_lines >= 3  # bad JSON, a non-object line, a short CSV row
    assert st.truncated_lines == 1
    assert "env.json" in st.files_missing
    assert st.steps_done == 40 and st.steps_total == 100
    assert st.status(time.time()) == "running"  # pid is this test process


def test_reader_polls_only_new_data(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", steps=10, end=None)
    reader = RunReader(run)
    n = len(reader.poll().progress)
    with open(run / "heartbeat_rank0.jsonl", "a") as f:
        f.write(json.dumps({"schema": 1, "event": "progress", "ts": time.time(), "rank": 0, "pid": os.getpid(),
                            "step": 15, "loss": 1.5, "tokens_per_s": 900.0}) + "\n")
    st = reader.poll()
    assert len(st.progress) == n + 1 and st.steps_done == 15


def test_multi_rank_and_statuses(tmp_path: Path) -> None:
    now = time.time()
    st = read_run(write_run(tmp_path / "multi", ranks=2, fallback={"nsa_attention:triton->torch:x": 2}))
    assert sorted(st.ranks) == [0, 1] and st.world_size == 2
    s = summarize(st, now)
    assert s.status == "completed" and s.fallback_total == 4  # summed over ranks
    assert read_run(write_run(tmp_path / "crash", end=None, pid=dead_pid())).status(now) == "crashed"
    stale = write_run(tmp_path / "stale", end=None, ts0=now - 10_000, pid=10**9 + 7)
    assert read_run(stale).status(now, stale_s=60) in ("stale", "crashed")
    assert read_run(write_run(tmp_path / "halted", end="halted", halt_reason="ops")).status(now) == "halted"


def test_check_run_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="does not exist"):
        check_run_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="not a run directory"):
        check_run_dir(tmp_path / "empty")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        check_run_dir(tmp_path / "f.txt")


def test_summary_numbers(tmp_path: Path) -> None:
    st = read_run(write_run(tmp_path / "r", fetch_p95_ms=33.0, tokens_per_s=2000.0))
    s = summarize(st, time.time())
    assert s.first_loss is not None and s.last_loss is not None and s.last_loss < s.first_loss
    assert s.fetch_p95_ms == 33.0
    assert 1500 < (s.tokens_per_s_median or 0) < 2500
    assert s.rss_mib is not None and s.rss_mib > 700
    assert s.nonfinite_losses == 0 and s.loss_decreased


# ------------------------------------------------------------------------------------------------ rules


def test_parse_rules() -> None:
    rules = {r.name: r.threshold for r in parse_rules("stale=120, nonfinite,fetch-stall=5000ms")}
    assert rules == {"stale": 120.0, "nonfinite": None, "fetch-stall": 5000.0}
    assert len(parse_rules("all")) == 13  # every rule of nsa.runs.rules.RULES
    assert parse_rules(None) == []
    for bad in ("bogus", "stale=abc", "nonfinite=3", "stale=-1"):
        with pytest.raises(ConfigError):
            parse_rules(bad)


@pytest.mark.parametrize(
    ("rule", "kwargs"),
    [
        ("nonfinite", {"nonfinite_at": 20}),
        ("gate-collapse", {"collapse": 0.8}),
        ("throughput-drop", {"steps": 80, "tps_drop_after": 55, "dt_s": 30.0}),  # slow for 750 s >= 600 s
        ("fetch-stall", {"fetch_p95_ms": 9000.0}),
        ("stale", {"dt_s": 1.0, "ts0": time.time() - 5000}),
    ],
)
def test_rules_fire_only_on_their_condition(tmp_path: Path, rule: str, kwargs: dict[str, Any]) -> None:
    rules = parse_rules("all")
    now = time.time()
    healthy = evaluate(rules, read_run(write_run(tmp_path / "ok", end=None)), now)
    assert healthy == []
    hits = evaluate(rules, read_run(write_run(tmp_path / "bad", end=None, **kwargs)), now)
    assert rule in {h.rule for h in hits}
    hit = next(h for h in hits if h.rule == rule)
    assert hit.message and hit.evidence


# ------------------------------------------------------------------------------------------------ halt


def test_write_halt_is_json_and_atomic(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", end=None)
    reason = f"maintenance {random.randrange(10**6)}"
    rec = write_halt(run, reason, rule="stale", evidence={"age_s": 400})
    data = json.loads((run / ".HALT").read_text())
    assert data["reason"] == reason and data["rule"] == "stale" and data["evidence"] == {"age_s": 400}
    assert abs(data["time"] - rec["time"]) < 1e-6 and "@" in data["who"]
    assert not list(run.glob(".HALT.tmp-*"))
    assert read_run(run).halt_file["reason"] == reason


def test_halt_run_outcomes(tmp_path: Path) -> None:
    done = write_run(tmp_path / "done")
    out = halt_run(done, "x")
    assert out.outcome == "already-ended" and not (done / ".HALT").exists()
    crashed = write_run(tmp_path / "crashed", end=None, pid=dead_pid())
    out = halt_run(crashed, "x", wait=True, timeout_s=5, poll_s=0.05)
    assert out.outcome == "crashed" and not out.ok
    with pytest.raises(RunDirError):
        halt_run(tmp_path / "missing")


def test_wait_for_ack_sees_the_trainers_halt(tmp_path: Path) -> None:
    run = write_run(tmp_path / "live", end=None, steps=10)
    reader = RunReader(run)
    reader.poll()
    since = time.time()

    def trainer() -> None:  # what the trainer appends when it obeys .HALT
        time.sleep(0.2)
        ck = str(run / "checkpoints" / "step_00000012")
        with open(run / "heartbeat_rank0.jsonl", "a") as f:
            for ev in ({"event": "checkpoint", "path": ck, "seconds": 0.1, "reason": "halt"},
                       {"event": "halt", "reason": "ops", "source": "file", "checkpoint": ck},
                       {"event": "end", "status": "halted", "error": None}):
                f.write(json.dumps({"schema": 1, "ts": time.time(), "rank": 0, "pid": os.getpid(), "step": 12, **ev}) + "\n")

    t = threading.Thread(target=trainer)
    t.start()
    out = wait_for_ack(reader, since, timeout_s=10, poll_s=0.05)
    t.join()
    assert out.outcome == "acknowledged" and out.checkpoint.endswith("step_00000012") and out.step == 12
    reader2 = RunReader(write_run(tmp_path / "slow", end=None))
    assert wait_for_ack(reader2, time.time(), timeout_s=0.2, poll_s=0.05).outcome == "timeout"


# ------------------------------------------------------------------------------------------------ report


def test_report_finished_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "artifacts" / "tiny-ok")
    out = tmp_path / "reports"
    res = build_report([run], out, date="2030-01-02")
    assert res.path.name == "2030-01-02 Test Engineer Report - tiny-ok v1.md"
    text = res.path.read_text()
    assert "**Overall verdict: PASS**" in text
    for needle in ("main", "ab" * 20, "dirty", "NSA_ATTN_BACKEND=torch", "seq_len 128", "Tokens/s trend",
                   "fetch p50 / p95", "MiB", "gate entropy", "loss.png", "training.csv",
                   "`train.steps=100` (flag --steps)"):
        assert needle in text, needle
    assert all(p.is_file() and p.stat().st_size > 1000 for p in res.images)
    # relative links resolve from the report folder
    assert "](<../artifacts/tiny-ok/training.csv>)" in text
    assert build_report([run], out, date="2030-01-02").path.name.endswith("tiny-ok v2.md")


def test_report_crashed_and_failed_runs(tmp_path: Path) -> None:
    crashed = write_run(tmp_path / "crashed", end=None, pid=dead_pid(), truncated=True)
    res = build_report([crashed], tmp_path / "rep", charts=False)
    assert res.verdicts[0][0] == "FAIL" and "crashed" in res.verdicts[0][1]
    failed = write_run(tmp_path / "nan", end="failed", nonfinite_at=20)
    res = build_report([failed], tmp_path / "rep", charts=False)
    text = res.path.read_text()
    assert res.verdicts[0][0] == "FAIL" and "anomaly `nonfinite_loss at step 20 (value nan)`" in text


def test_report_running_and_comparison(tmp_path: Path) -> None:
    a = write_run(tmp_path / "s512", seq_len=512, backend="torch", tokens_per_s=3000.0)
    b = write_run(tmp_path / "s1024", seq_len=1024, backend="triton", end=None, tokens_per_s=1500.0)
    res = build_report([a, b], tmp_path / "rep")
    text = res.path.read_text()
    assert "## Comparison" in text and "| s512 | 512 |" in text and "| s1024 | 1024 |" in text
    assert [v for v, _ in res.verdicts] == ["PASS", "RUNNING"]
    assert "**Overall verdict: RUNNING**" in text
    assert len(res.images) == 14  # 7 charts per run (nsa.runs.charts)


def test_newest_run_and_verdict_rules(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    old = write_run(root / "old")
    new = write_run(root / "new")
    past = time.time() - 1000
    for f in old.iterdir():
        os.utime(f, (past, past))
    assert newest_run(root) == new
    with pytest.raises(RunDirError):
        newest_run(tmp_path / "none")
    s = summarize(read_run(write_run(tmp_path / "fb", fallback={"x": 1})), time.time())
    assert verdict(s)[0] == "FAIL" and "fallback" in verdict(s)[1]
    assert math.isfinite(s.first_loss or float("nan"))
