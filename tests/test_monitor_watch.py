"""Operator-grade ``nsa watch``: every watch rule on synthetic run directories (firing and quiet), thresholds
from the run's ``monitor`` config, alarm de-duplication and ``--notify``, ``--wait``, the live view's exit on
a crash, 80-column rendering, the non-terminal line log, JSON lines, pending ``.HALT`` and a smoothed ETA."""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from nsa.errors import ConfigError
from nsa.gpuinfo import GpuInfo, GpuProbe
from nsa.runs.halt import write_halt
from nsa.runs.reader import RunReader, read_run
from nsa.runs.rules import AlarmLog, RuleHit, evaluate, monitor_config, notify, parse_rules
from nsa.runs.summary import summarize
from nsa_cli.app import app
from nsa_cli.render.watch import dashboard
from tests.conftest import dead_pid, write_run

runner = CliRunner()
LINE_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d [A-Z-]+ step \d+/\S+ loss \S+ tok/s \S+ ETA \S+ alarms \S+$")


def point(step: int, ts: float, **fields: Any) -> dict[str, Any]:
    """A rank-0 ``progress`` event with healthy defaults."""
    base: dict[str, Any] = {
        "schema": 1, "event": "progress", "ts": ts, "rank": 0, "pid": os.getpid(), "step": step, "steps_total": 1000,
        "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0, "step_time_s": 1.0,
        "fetch_p50_ms": 1.0, "fetch_p95_ms": 3.0, "tokens_seen": step * 1024, "elapsed_s": float(step),
        "eta_s": float(1000 - step), "mem_allocated_mib": None, "mem_reserved_mib": None, "mem_peak_mib": None,
        "rss_mib": 700.0, "gate_entropy_mean": 1.0, "gate_branch_shares": [0.33, 0.33, 0.34],
        "gate_collapse_fraction": 0.0, "sel_keys_mean": 20.0, "fallback": {}, "mfu": None,
        "data_skipped": {"total": 0}, "data_warnings": [],
    }
    base.update(fields)
    return base


def write_points(run_dir: Path, points: list[dict[str, Any]], *, pid: int | None = None, steps_total: int = 1000,
                 monitor: dict[str, Any] | None = None, end: str | None = None, ts0: float | None = None) -> Path:
    """A run directory whose heartbeat is a ``boot`` line plus ``points`` (no training.csv)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getpid() if pid is None else pid
    if ts0 is None:
        ts0 = float(points[0]["ts"]) - 1.0 if points else time.time()
    cfg: dict[str, Any] = {"train": {"steps": steps_total, "run_name": run_dir.name}}
    if monitor is not None:
        cfg["monitor"] = monitor
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "env.json").write_text(json.dumps({"device": "cpu", "profile": "cpu", "git": {"commit": "cd" * 20}}))
    boot = {"schema": 1, "event": "boot", "ts": ts0, "rank": 0, "pid": pid, "step": 0, "run_name": run_dir.name,
            "world_size": 1, "local_rank": 0, "host": socket.gethostname(), "device": "cpu", "resumed_from": None,
            "steps_total": steps_total}
    lines = [boot] + [{**p, "pid": pid} for p in points]
    if end is not None:
        last = points[-1] if points else boot
        lines.append({"schema": 1, "event": "end", "ts": float(last["ts"]) + 0.5, "rank": 0, "pid": pid,
                      "step": last["step"], "status": end, "error": None})
    (run_dir / "heartbeat_rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run_dir


def series(n: int, dt: float = 1.0, end_ago: float = 2.0, **per_step: Any) -> list[dict[str, Any]]:
    """``n`` points at steps 1..n, ``dt`` seconds apart, the last ``end_ago`` s ago; ``per_step[key]`` is a
    function of the index giving that field."""
    t_last = time.time() - end_ago
    return [point(i + 1, t_last - (n - 1 - i) * dt, **{k: f(i) for k, f in per_step.items()}) for i in range(n)]


def fired(run: Path) -> set[str]:
    st = read_run(run)
    return {h.rule for h in evaluate(parse_rules("all"), st, time.time())}


# ------------------------------------------------------------------------------------------------ rules


def test_crashed_rule(tmp_path: Path) -> None:
    assert "crashed" in fired(write_run(tmp_path / "dead", end=None, pid=dead_pid(), seed=0))
    assert "crashed" not in fired(write_run(tmp_path / "alive", end=None, seed=0))
    assert "crashed" not in fired(write_run(tmp_path / "ended", pid=dead_pid(), seed=0))  # ended with an end event


def test_stale_rule_takes_the_runs_threshold(tmp_path: Path) -> None:
    old = series(10, end_ago=500.0)
    assert "stale" in fired(write_points(tmp_path / "old", old))  # default 180 s
    assert "stale" not in fired(write_points(tmp_path / "lenient", old, monitor={"stale_s": 1000}))
    assert "stale" not in fired(write_points(tmp_path / "fresh", series(10)))


def test_nonfinite_rule(tmp_path: Path) -> None:
    assert "nonfinite" in fired(write_run(tmp_path / "nan", end=None, nonfinite_at=20, seed=0))
    assert "nonfinite" not in fired(write_run(tmp_path / "ok", end=None, seed=0))


def test_gate_entropy_rule(tmp_path: Path) -> None:
    low = write_points(tmp_path / "low", series(10, gate_entropy_mean=lambda i: 0.1 if i >= 7 else 1.0))
    assert "gate-entropy" in fired(low)
    blip = write_points(tmp_path / "blip", series(10, gate_entropy_mean=lambda i: 0.1 if i in (7, 9) else 1.0))
    assert "gate-entropy" not in fired(blip)  # only 2 of the last 3 points
    assert "gate-entropy" not in fired(write_points(tmp_path / "cfg", series(10, gate_entropy_mean=lambda i: 0.1),
                                                    monitor={"gate_entropy_min": 0.05, "gate_entropy_early_min": 0.05}))


def test_gate_collapse_rule(tmp_path: Path) -> None:
    assert "gate-collapse" in fired(write_run(tmp_path / "c", end=None, collapse=0.8, seed=0))
    assert "gate-collapse" not in fired(write_run(tmp_path / "ok", end=None, collapse=0.05, seed=0))


def test_grad_spike_rule(tmp_path: Path) -> None:
    def grads(last: float) -> Any:
        return lambda i: last if i == 29 else 1.0 + 0.01 * (i % 5)

    st = read_run(write_points(tmp_path / "spike", series(30, grad_norm=grads(50.0))))
    hit = next(h for h in evaluate(parse_rules("all"), st, time.time()) if h.rule == "grad-spike")
    assert hit.evidence["step"] == 30 and hit.evidence["ratio"] > 40
    assert "grad-spike" not in fired(write_points(tmp_path / "mild", series(30, grad_norm=grads(5.0))))
    assert "grad-spike" not in fired(write_points(tmp_path / "short", series(15, grad_norm=grads(50.0))))


def test_loss_plateau_rule(tmp_path: Path) -> None:
    mon = {"plateau_steps": 100, "plateau_min_drop": 0.01}
    flat = series(300, loss=lambda i: 3.0 - 0.005 * min(i, 150) + 0.0005 * (i % 3))  # flat after step 150
    assert "loss-plateau" in fired(write_points(tmp_path / "flat", flat, monitor=mon))
    falling = series(300, loss=lambda i: 3.0 * 0.995 ** i)
    assert "loss-plateau" not in fired(write_points(tmp_path / "falling", falling, monitor=mon))
    short = series(80, loss=lambda i: 2.0)  # flat, but fewer than plateau_steps steps of history
    assert "loss-plateau" not in fired(write_points(tmp_path / "short", short, monitor=mon))


def test_memory_creep_rule(tmp_path: Path) -> None:
    creep = series(50, rss_mib=lambda i: 700.0 if i < 25 else 700.0 + 20 * (i - 25))
    st = read_run(write_points(tmp_path / "rss", creep))
    hit = next(h for h in evaluate(parse_rules("all"), st, time.time()) if h.rule == "memory-creep")
    assert hit.evidence["metric"] == "rss_mib" and hit.evidence["baseline_mib"] == 700.0
    assert "memory-creep" not in fired(write_points(tmp_path / "flat", series(50, rss_mib=lambda i: 700.0 + i % 3)))
    gpu = series(50, mem_reserved_mib=lambda i: 10_000.0 + (400.0 * i if i > 10 else 0), rss_mib=lambda i: 700.0)
    st = read_run(write_points(tmp_path / "gpu", gpu))
    hit = next(h for h in evaluate(parse_rules("all"), st, time.time()) if h.rule == "memory-creep")
    assert hit.evidence["metric"] == "mem_reserved_mib"


def test_throughput_drop_rule_is_a_time_window(tmp_path: Path) -> None:
    mon = {"throughput_window_s": 40}

    def tps(i: int) -> float:
        return 200.0 if i >= 24 else 1000.0 + 10 * (i % 4)  # the last 6 points are slow

    long = write_points(tmp_path / "long", series(30, dt=10.0, tokens_per_s=tps), monitor=mon)   # 60 s slow
    short = write_points(tmp_path / "short", series(30, dt=5.0, tokens_per_s=tps), monitor=mon)  # 30 s slow
    st = read_run(long)
    hit = next(h for h in evaluate(parse_rules("all"), st, time.time()) if h.rule == "throughput-drop")
    assert hit.evidence["seconds"] == 60.0 and hit.evidence["since_step"] == 25
    assert "throughput-drop" not in fired(short)  # same number of slow points, less wall time
    assert "throughput-drop" not in fired(write_points(tmp_path / "ok", series(30, dt=10.0), monitor=mon))


def test_fetch_stall_rule(tmp_path: Path) -> None:
    assert "fetch-stall" in fired(write_run(tmp_path / "s", end=None, fetch_p95_ms=9000.0, seed=0))
    assert "fetch-stall" not in fired(write_run(tmp_path / "ok", end=None, fetch_p95_ms=900.0, seed=0))
    cfg = write_points(tmp_path / "cfg", series(5, fetch_p95_ms=lambda i: 9000.0), monitor={"fetch_stall_ms": 10000})
    assert "fetch-stall" not in fired(cfg)  # the run's own limit
    st = read_run(cfg)  # an explicit threshold wins over the run's config
    assert [h.rule for h in evaluate(parse_rules("fetch-stall=5000"), st, time.time())] == ["fetch-stall"]


def test_rule_specs_and_invalid_monitor(tmp_path: Path) -> None:
    rules = {r.name: (r.threshold, r.explicit) for r in parse_rules("crash,grad=5,plateau")}
    assert rules == {"crashed": (None, False), "grad-spike": (5.0, True), "loss-plateau": (0.01, False)}
    assert parse_rules("none") == []
    for bad in ("throughput-drop=2", "grad-spike=0.5", "crashed=3", "bogus"):
        with pytest.raises(ConfigError):
            parse_rules(bad)
    run = write_points(tmp_path / "bad", series(5), monitor={"stale_s": -1})
    with pytest.raises(ConfigError, match=r"monitor\.stale_s"):
        monitor_config(read_run(run))
    res = runner.invoke(app, ["watch", str(run), "--once"])
    assert res.exit_code == 2 and "error:" in res.output and "monitor.stale_s" in res.output


# ------------------------------------------------------------------------------------------------ actions


def test_alarm_log_deduplicates_until_cleared() -> None:
    log = AlarmLog()
    hit = RuleHit("stale", "old", {"age_s": 400})
    assert [a.rule for a in log.update([hit], 1.0)[0]] == ["stale"]
    assert log.update([hit], 2.0) == ([], [])
    new, cleared = log.update([], 3.0)
    assert new == [] and [a.rule for a in cleared] == ["stale"] and cleared[0].cleared == 3.0
    assert [a.rule for a in log.update([hit], 4.0)[0]] == ["stale"]  # fires again after clearing
    assert len(log.history) == 2


def test_notify_sends_each_new_alarm_once_as_json(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", end=None, fetch_p95_ms=8000.0, seed=0)
    out = tmp_path / "alarms.jsonl"
    res = runner.invoke(app, ["watch", str(run), "--refresh", "0.05", "--timeout", "0.6", "--notify", f"cat >> {out}"])
    assert res.exit_code == 0, res.output
    sent = [json.loads(x) for x in out.read_text().splitlines()]
    assert [a["rule"] for a in sent] == ["fetch-stall"]  # ~10 refreshes, one notification
    a = sent[0]
    assert set(a) == {"run", "rule", "message", "evidence", "time", "host"}
    assert a["run"] == "r" and a["evidence"]["fetch_p95_ms"] == 8000.0 and a["host"] == socket.gethostname()
    assert abs(a["time"] - time.time()) < 60


def test_notify_command_from_the_run_config(tmp_path: Path) -> None:
    out = tmp_path / "hook.json"
    run = write_points(tmp_path / "r", series(5, fetch_p95_ms=lambda i: 9000.0), monitor={"notify": f"cat > {out}"})
    res = runner.invoke(app, ["watch", str(run), "--refresh", "0.05", "--timeout", "0.3"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["rule"] == "fetch-stall"


def test_failing_notify_is_one_warning_and_the_watch_goes_on(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", end=None, fetch_p95_ms=8000.0, seed=0)
    res = runner.invoke(app, ["watch", str(run), "--refresh", "0.05", "--timeout", "0.4", "--notify", "echo nope >&2; exit 3"])
    assert res.exit_code == 0
    assert res.output.count("warning: notify command for alarm fetch-stall failed: exit status 3: nope") == 1
    assert len([x for x in res.output.splitlines() if LINE_RE.match(x)]) >= 3  # kept watching
    t0 = time.monotonic()
    assert notify("sleep 5", {"rule": "x"}, timeout_s=0.2) == "timed out after 0.2 s"
    assert time.monotonic() - t0 < 3


# ------------------------------------------------------------------------------------------------ live view


def test_wait_for_a_run_directory_that_appears_later(tmp_path: Path) -> None:
    run = tmp_path / "later"

    def trainer() -> None:
        time.sleep(0.4)
        write_run(run, seed=0)

    t = threading.Thread(target=trainer)
    t.start()
    res = runner.invoke(app, ["watch", str(run), "--refresh", "0.05", "--timeout", "30"])
    t.join()
    assert res.exit_code == 0, res.output
    assert f"waiting for run directory {run} to appear" in res.output and "COMPLETED" in res.output


def test_wait_timeout_and_no_wait_are_one_line_errors(tmp_path: Path) -> None:
    res = runner.invoke(app, ["watch", str(tmp_path / "never"), "--timeout", "0.2"])
    assert res.exit_code == 2 and "error: run directory" in res.output and "did not start within 0.2 s" in res.output
    res = runner.invoke(app, ["watch", str(tmp_path / "never"), "--no-wait"])
    assert res.exit_code == 2 and "does not exist" in res.output and "waiting" not in res.output


def test_crashed_run_ends_the_live_view_with_an_alarm(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = write_run(tmp_path / "r", end=None, pid=proc.pid, seed=0)
        out = tmp_path / "n.jsonl"
        threading.Timer(0.4, proc.kill).start()  # SIGKILL: no end event
        t0 = time.monotonic()
        res = runner.invoke(app, ["watch", str(run), "--refresh", "0.05", "--timeout", "30", "--notify", f"cat >> {out}"])
        assert time.monotonic() - t0 < 20
    finally:
        proc.kill()
        proc.wait()
    assert res.exit_code == 1, res.output
    assert "ALARM crashed: trainer process" in res.output
    assert any(LINE_RE.match(x) and " CRASHED " in x for x in res.output.splitlines())
    assert [json.loads(x)["rule"] for x in out.read_text().splitlines()] == ["crashed"]


def test_failed_and_halted_runs_end_the_live_view(tmp_path: Path) -> None:
    assert runner.invoke(app, ["watch", str(write_run(tmp_path / "f", end="failed", seed=0))]).exit_code == 1
    assert runner.invoke(app, ["watch", str(write_run(tmp_path / "h", end="halted", halt_reason="ops", seed=0))]).exit_code == 0


def _render(run: Path, width: int, gpus: Any = None) -> list[str]:
    st = read_run(run)
    now = time.time()
    con = Console(width=width, record=True, color_system=None)
    con.print(dashboard(st, summarize(st, now), evaluate(parse_rules("all"), st, now), gpus, width=width))
    return con.export_text().splitlines()


def test_dashboard_fits_80_columns_and_keeps_the_newest_points(tmp_path: Path) -> None:
    n = 200
    run = write_points(tmp_path / ("run-with-a-long-name-" + "x" * 40), series(
        n, tokens_per_s=lambda i: 500.0 if i == n - 2 else 2000.0 if i == n - 1 else 1000.0 + 10 * (i % 7),
        loss=lambda i: 3.0 - 0.001 * i, lr=lambda i: 3e-3, grad_norm=lambda i: 0.5,
        mem_reserved_mib=lambda i: 12_000.0, mem_peak_mib=lambda i: 11_000.0))
    with open(run / "heartbeat_rank0.jsonl", "a") as f:
        f.write(json.dumps({"schema": 1, "event": "checkpoint", "ts": time.time() - 1, "rank": 0, "pid": os.getpid(),
                            "step": n, "path": str(run / "checkpoints" / f"step_{n:08d}"), "seconds": 0.1,
                            "reason": "periodic"}) + "\n")
    gpus = GpuProbe(True, gpus=[GpuInfo(i, "NVIDIA H100 80GB HBM3", 81559.0, 1559.0, temperature_c=71.0,
                                        utilization_pct=97.0 - 40 * i, power_w=650.0) for i in range(2)])
    for width in (80, 200):
        lines = _render(run, width, gpus)
        assert max(len(x) for x in lines) <= width
        text = "\n".join(lines)
        for field in ("profile cpu", "commit cdcdcdcdcdcd", "device cpu", f"step {n}/1000", "3.00e-03 / 0.5",
                      f"step {n} periodic", "GPU0", "97% 71C 650W", "57% 71C 650W", "12,000 MiB res."):
            assert sum(field in x for x in lines) == 1, (width, field, text)  # whole, on one line
        tps = next(x for x in lines if "tokens/s" in x and "2,000" in x)
        spark = tps.rstrip(" │").split()[-1]
        assert spark.endswith("▁█") and len(spark) >= 30  # the newest points, trimmed from the left
        if width == 200:
            assert len(spark) > 100


def test_non_terminal_output_is_a_line_log(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", end=None, steps=20, seed=0)

    def trainer() -> None:
        time.sleep(0.5)  # the watch's first refresh (its imports included) sees step 20
        for step in range(25, 45, 5):
            time.sleep(0.15)
            with open(run / "heartbeat_rank0.jsonl", "a") as f:
                f.write(json.dumps(point(step, time.time(), steps_total=100)) + "\n")

    t = threading.Thread(target=trainer)
    t.start()
    res = runner.invoke(app, ["watch", str(run), "--refresh", "0.1", "--timeout", "1.5"])
    t.join()
    assert res.exit_code == 0, res.output
    lines = [x for x in res.output.splitlines() if LINE_RE.match(x)]
    assert len(lines) >= 5 and all(" RUNNING " in x for x in lines)
    steps = [int(re.search(r"step (\d+)/", x).group(1)) for x in lines]  # type: ignore[union-attr]
    assert steps == sorted(steps) and steps[0] == 20 and steps[-1] == 40
    assert "╭" not in res.output  # no frames


def test_json_lines_in_live_mode(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", end=None, fetch_p95_ms=8000.0, seed=0)
    res = runner.invoke(app, ["watch", str(run), "--json", "--refresh", "0.05", "--timeout", "0.4"])
    assert res.exit_code == 0, res.output
    objs = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(objs) >= 3
    for o in objs:
        assert {"time", "status", "step", "steps_total", "loss", "tokens_per_s", "eta_s", "alarms", "summary"} <= set(o)
        assert o["status"] == "running" and [a["rule"] for a in o["alarms"]] == ["fetch-stall"]
    assert objs[0]["new_alarms"] == ["fetch-stall"] and all(o["new_alarms"] == [] for o in objs[1:])
    assert "stale=180" in objs[0]["rules"]


def test_pending_halt_disappears_once_the_trainer_acted(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", end=None, seed=0)
    write_halt(run, "maintenance window")
    reader = RunReader(run)
    st = reader.poll()
    assert summarize(st, time.time()).pending_halt["reason"] == "maintenance window"
    assert any("pending .HALT" in x for x in _render(run, 80))
    time.sleep(0.05)
    with open(run / "heartbeat_rank0.jsonl", "a") as f:
        for ev in ({"event": "halt", "reason": "maintenance window", "source": "file", "checkpoint": "ck"},
                   {"event": "end", "status": "halted", "error": None}):
            f.write(json.dumps({"schema": 1, "ts": time.time(), "rank": 0, "pid": os.getpid(), "step": 41, **ev}) + "\n")
    st = reader.poll()
    s = summarize(st, time.time())
    assert s.pending_halt is None and st.halt_file is not None  # the file is still there, but acted on
    assert not any("pending .HALT" in x for x in _render(run, 80))
    assert any("last halt: step 41" in x for x in _render(run, 80))


def test_eta_is_smoothed(tmp_path: Path) -> None:
    # 1 s per step for 120 steps, then one slow interval of 10 s: the trainer's ETA jumps tenfold
    pts = series(121, dt=1.0, end_ago=20.0, steps_total=lambda i: 1000, step_time_s=lambda i: 1.0)
    pts[-1]["ts"] += 9.0
    pts[-1]["step_time_s"] = 10.0
    pts[-1]["eta_s"] = (1000 - 121) * 10.0
    run = write_points(tmp_path / "r", [], ts0=pts[0]["ts"] - 1.0)
    reader = RunReader(run)
    etas = []
    with open(run / "heartbeat_rank0.jsonl", "a") as f:
        for p in pts:
            f.write(json.dumps(p) + "\n")
            f.flush()
            etas.append(summarize(reader.poll(), time.time()).eta_s)
    s = summarize(reader.poll(), time.time())
    remaining = 1000 - 121
    assert s.eta_s_trainer == remaining * 10.0
    assert s.eta_s is not None and remaining * 1.0 <= s.eta_s <= remaining * 1.15
    steady = [e for e in etas[5:] if e is not None]
    assert all(abs(b - a) / a < 0.1 for a, b in itertools.pairwise(steady))


def test_watchdog_writes_one_halt_and_tracks_alarms(tmp_path: Path) -> None:
    """The library watchdog on a live run whose loss turned non-finite (seed 9): the halt rule fires,
    ``.HALT`` is written once naming the rule, the alarm is new once and stays active on the next poll."""
    from nsa.runs.reader import RunReader
    from nsa.runs.rules import parse_rules
    from nsa.runs.watchdog import Watchdog, finished

    run = write_run(tmp_path / "run", end=None, nonfinite_at=30, seed=9, ts0=time.time() - 40)
    warnings: list[str] = []
    dog = Watchdog(RunReader(run), parse_rules("nonfinite"), parse_rules("nonfinite"), notify_cmd="exit 3",
                   on_warning=warnings.append)
    first = dog.poll()
    assert first.wrote_halt and [a.rule for a in first.new] == ["nonfinite"]
    assert (run / ".HALT").exists() and "nonfinite" in (run / ".HALT").read_text()
    assert warnings and "notify command for alarm nonfinite failed" in warnings[0]
    again = dog.poll()
    assert not again.wrote_halt and again.new == [] and [h.rule for h in again.alarms] == ["nonfinite"]
    assert len(dog.halted) == 1 and dog.payload(again)["halt_written"]["rule"] == "nonfinite"
    assert not finished(again, time.time())
