"""Issue 26, "operator truth": ``nsa report`` and ``nsa watch`` never call a bad run good. Each test is one
numbered case of the issue, on hand-written run directories (``tests/conftest.py::write_run``): a data
fallback, a watch that follows a resume, the run's own stale threshold, throughput floors and kept alarms,
the watchdog's exit code and a stale header, ``nsa dump``, the text of a NaN run, the older runbooks'
thresholds, kernel path and world size, a throughput collapse at the end, and a folder that is no run."""

from __future__ import annotations

import fcntl
import json
import os
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

from nsa.config import MonitorConfig
from nsa.runs.alarms import kept_alarms
from nsa.runs.halt import halted_by_watchdog
from nsa.runs.reader import RunReader, read_run
from nsa.runs.report import build_report
from nsa.runs.rules import evaluate, parse_rules
from nsa.runs.summary import summarize
from nsa.runs.watchdog import Watchdog
from nsa_cli.app import app
from nsa_cli.render.watch import dashboard
from tests.conftest import write_run

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
FALLBACK = ("data source fineweb_edu failed (data source HuggingFaceFW/fineweb-edu/sample-10BT split train is "
            "unreachable: offline); TRAINING ON SYNTHETIC assoc_recall DATA INSTEAD (data.synthetic_on_fail=true)")


def edit_events(run: Path, event: str, rank: int = 0, **fields: Any) -> None:
    """Set ``fields`` on every ``event`` line of a heartbeat (a value, or a function of the old line)."""
    hb = run / f"heartbeat_rank{rank}.jsonl"
    out = []
    for line in hb.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") == event:
            ev.update({k: v(ev) if callable(v) else v for k, v in fields.items()})
        out.append(json.dumps(ev))
    hb.write_text("\n".join(out) + "\n")


def append_events(run: Path, *events: dict[str, Any], rank: int = 0, pid: int | None = None) -> None:
    with open(run / f"heartbeat_rank{rank}.jsonl", "a") as f:
        for ev in events:
            f.write(json.dumps({"schema": 1, "ts": time.time(), "rank": rank, "pid": pid or os.getpid(), **ev}) + "\n")


def set_monitor(run: Path, **values: Any) -> None:
    text = (run / "config.yaml").read_text()
    body, _, sources = text.partition("# _sources")
    cfg = yaml.safe_load(body)
    cfg["monitor"] = values
    (run / "config.yaml").write_text(yaml.safe_dump(cfg) + "# _sources" + sources)


def checks(res: Any) -> dict[str, Any]:
    return {c.name: c for c in res.checks[0]}


def render(run: Path, width: int = 120) -> str:
    st = read_run(run)
    now = time.time()
    con = Console(width=width, record=True, color_system=None)
    con.print(dashboard(st, summarize(st, now), evaluate(parse_rules("all"), st, now), width=width))
    return con.export_text()


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


# 1 --------------------------------------------------------------------------------------------------------


def test_1_a_run_that_fell_back_to_synthetic_data_does_not_pass(tmp_path: Path) -> None:
    run = write_run(tmp_path / "fb", seed=1)
    edit_events(run, "loader-ready", source="fineweb_edu", source_used="synthetic", warnings=[FALLBACK])
    edit_events(run, "progress", data_warnings=[FALLBACK])
    res = build_report([run], tmp_path / "rep", charts=False)
    v, why = res.verdicts[0]
    assert v == "FAIL" and "trained on synthetic data" in why, why
    assert checks(res)["data source"].result == "FAIL"
    assert "SYNTHETIC tokens instead of data.source=" in res.path.read_text()
    view = render(run)
    assert "ALARM data-fallback: training on synthetic data" in view and "SYNTHETIC" in view
    once = runner.invoke(app, ["watch", str(run), "--once"])
    assert once.exit_code == 1 and "data-fallback" in once.output
    # a run written before loader-ready had source_used: the warning alone says it
    old = write_run(tmp_path / "old", seed=1)
    edit_events(old, "loader-ready", source="fineweb_edu", warnings=[FALLBACK])
    assert build_report([old], tmp_path / "rep", charts=False).verdicts[0][0] == "FAIL"
    clean = write_run(tmp_path / "clean", seed=1)
    assert build_report([clean], tmp_path / "rep", charts=False).verdicts[0][0] == "PASS"


# 2 --------------------------------------------------------------------------------------------------------


def _lock(run: Path, pid: int, since: float) -> None:
    (run / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "since": since}) + "\n")


def test_2_watch_follows_a_run_across_a_resume(tmp_path: Path) -> None:
    """The previous session ended (halted); a new trainer holds the run lock but has not written its boot line
    yet: the watch waits for it and follows the new session to its end."""
    run = write_run(tmp_path / "r", seed=2, end="halted", halt_reason="planned stop", steps=40, steps_total=60)
    new = sleeper()
    try:
        _lock(run, new.pid, time.time())
        assert read_run(run).new_session_pending()

        def resumed_session() -> None:
            time.sleep(0.6)
            append_events(run, {"event": "boot", "step": 0, "run_name": "r", "world_size": 1, "local_rank": 0,
                                "host": socket.gethostname(), "device": "cpu", "resumed_from": "checkpoints/step_00000040",
                                "steps_total": 60}, pid=new.pid)
            for step in (45, 50, 55, 60):
                time.sleep(0.1)
                append_events(run, {"event": "progress", "step": step, "steps_total": 60, "loss": 2.0,
                                    "tokens_per_s": 1000.0, "step_time_s": 1.0}, pid=new.pid)
            append_events(run, {"event": "end", "step": 60, "status": "completed", "error": None}, pid=new.pid)

        t = threading.Thread(target=resumed_session)
        t.start()
        res = runner.invoke(app, ["watch", str(run), "--refresh", "0.05", "--timeout", "30"])
        t.join()
    finally:
        new.kill()
        new.wait()
    assert res.exit_code == 0, res.output
    lines = [x for x in res.output.splitlines() if " step " in x]
    assert " RESUMING step 40/" in lines[0], lines[:3]
    assert " COMPLETED step 60/60" in lines[-1], lines[-3:]
    # the ended session's own lock (its pid, taken before the end) does not keep a watch waiting
    _lock(run, os.getpid(), time.time() - 3600)
    assert not read_run(run).new_session_pending()


def test_2_a_crashed_run_being_resumed_is_not_over(tmp_path: Path) -> None:
    from nsa.runs.watchdog import finished
    from tests.conftest import dead_pid

    run = write_run(tmp_path / "r", seed=2, end=None, pid=dead_pid())
    assert Watchdog(RunReader(run), parse_rules("all"), []).poll().summary.status == "crashed"
    new = sleeper()
    try:
        _lock(run, new.pid, time.time())
        snap = Watchdog(RunReader(run), parse_rules("all"), []).poll()
        assert snap.summary.status == "resuming" and not finished(snap, time.time())
        assert "crashed" not in {h.rule for h in snap.alarms}
    finally:
        new.kill()
        new.wait()


def test_2_a_resume_takes_the_run_lock_before_the_trainer_loads(tmp_path: Path) -> None:
    """``nsa train --resume`` holds ``RUN/.lock`` before torch and the Trainer load (seconds on a GPU box),
    so a watch started right after it sees the new session coming; a fresh run creates nothing early."""
    import nsa.train.trainer
    from nsa.rundir.layout import read_lock

    run = write_run(tmp_path / "r", seed=2, end="halted", halt_reason="planned stop")
    seen: list[Any] = []

    class Probe:
        def __init__(self, *args: Any, run_lock: Any = None, **kwargs: Any) -> None:
            if run_lock is None:  # the fresh run below: no early lock to probe
                raise SystemExit(0)
            fd = os.open(run / ".lock", os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
            seen.append((read_lock(run) or {}).get("pid"))
            seen.append(read_run(run).new_session_pending())
            raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nsa.train.trainer, "Trainer", Probe)
        runner.invoke(app, ["train", "--config", "tiny", "--out-dir", str(run), "--resume", "auto"])
        assert seen == [os.getpid(), False]  # held by this process (the ended session's own pid: not "new")
        fresh = tmp_path / "fresh"
        runner.invoke(app, ["train", "--config", "tiny", "--out-dir", str(fresh)])
        assert not fresh.exists()


def test_2_the_watchdog_halts_again_in_a_resumed_session(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", seed=2, end=None, nonfinite_at=30, ts0=time.time() - 60)
    dog = Watchdog(RunReader(run), parse_rules("nonfinite"), parse_rules("nonfinite"))
    assert dog.poll().wrote_halt
    append_events(run, {"event": "halt", "step": 40, "reason": "watchdog: x", "source": "file", "checkpoint": None},
                  {"event": "end", "step": 40, "status": "halted", "error": None})
    dog.poll()
    (run / ".HALT").unlink()
    append_events(run, {"event": "boot", "step": 0, "run_name": "r", "world_size": 1, "local_rank": 0,
                        "host": socket.gethostname(), "device": "cpu", "resumed_from": None, "steps_total": 100},
                  {"event": "anomaly", "step": 41, "kind": "nonfinite_loss", "value": "nan", "record": "anomalies/step_41.json"})
    assert dog.poll().wrote_halt  # a new session: the watchdog may halt it too


# 3 --------------------------------------------------------------------------------------------------------


def test_3_report_uses_the_runs_own_stale_threshold(tmp_path: Path) -> None:
    """Frozen for 208 s, the trainer still alive: stale by the run's monitor.stale_s (180), not RUNNING."""
    steps = 20
    run = write_run(tmp_path / "frozen", seed=3, end=None, steps=steps, dt_s=1.0, ts0=time.time() - 208 - 1 - steps)
    set_monitor(run, stale_s=180.0)
    res = build_report([run], tmp_path / "rep", charts=False)
    assert res.verdicts[0][0] == "FAIL" and "heartbeat stale" in res.verdicts[0][1], res.verdicts
    cli = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep2"), "--no-charts"])
    assert cli.exit_code == 1 and "stale" in cli.output
    set_monitor(run, stale_s=600.0)  # a run started with a longer threshold is judged by it
    assert build_report([run], tmp_path / "rep", charts=False).verdicts[0][0] == "RUNNING"
    book = (ROOT / "runbooks" / "monitoring-and-troubleshooting.md").read_text()
    assert "| `stale=S` | a rank's heartbeat is older than S seconds | 180 (`monitor.stale_s`) |" in book


# 4 --------------------------------------------------------------------------------------------------------


def test_4_gpu_profiles_carry_a_throughput_floor_that_the_report_judges(tmp_path: Path) -> None:
    from nsa.config.profiles import list_profiles

    for prof in list_profiles():
        if prof.expect.device == "cuda":
            assert prof.monitor.get("min_tokens_per_s", 0) > 0, prof.name
    run = write_run(tmp_path / "slow", seed=4, tokens_per_s=1000.0)
    res = build_report([run], tmp_path / "rep", charts=False, limits="a100-80g")
    tps = checks(res)["throughput"]
    assert tps.result == "FAIL" and "--limits a100-80g" in tps.limit and res.verdicts[0][0] == "FAIL"


def test_4_alarms_raised_by_watch_are_kept_with_the_run_and_fail_it(tmp_path: Path) -> None:
    mon = {"throughput_window_s": 40, "plateau_steps": 100}
    run = write_run(tmp_path / "r", seed=4, end=None, steps=300, steps_total=1000, log_every=10, dt_s=10.0,
                    tps_drop_after=250, ts0=time.time() - 3010)
    edit_events(run, "progress", loss=lambda ev: 3.0 if ev["step"] > 150 else 4.0 - ev["step"] / 150)
    set_monitor(run, **mon)
    first = runner.invoke(app, ["watch", str(run), "--once"])
    assert first.exit_code == 1, first.output
    kept = kept_alarms(run)
    assert {a.rule for a in kept} == {"throughput-drop", "loss-plateau"}, kept
    assert runner.invoke(app, ["watch", str(run), "--once"]).exit_code == 1
    assert len(kept_alarms(run)) == 2  # an open alarm is not written again
    append_events(run, {"event": "end", "step": 300, "status": "completed", "error": None})
    res = build_report([run], tmp_path / "rep", charts=False)
    alarms = checks(res)["watch alarms"]
    assert alarms.result == "FAIL" and "throughput-drop" in alarms.why and "loss-plateau" in alarms.why
    assert res.verdicts[0][0] == "FAIL" and "alarm `throughput-drop` at step" in res.path.read_text()


# 5 --------------------------------------------------------------------------------------------------------


def test_5_a_watchdog_halt_has_its_own_exit_code(tmp_path: Path) -> None:
    from nsa.train.trainer import TrainResult

    run = write_run(tmp_path / "r", seed=5, end=None, nonfinite_at=30, ts0=time.time() - 60)

    def trainer() -> None:  # acts on the watchdog's .HALT like the trainer does
        for _ in range(200):
            time.sleep(0.05)
            if (run / ".HALT").exists():
                reason = json.loads((run / ".HALT").read_text())["reason"]
                append_events(run, {"event": "halt", "step": 40, "reason": reason, "source": "file", "checkpoint": "c"},
                              {"event": "end", "step": 40, "status": "halted", "error": None})
                return

    t = threading.Thread(target=trainer)
    t.start()
    res = runner.invoke(app, ["watch", str(run), "--halt-on", "nonfinite", "--refresh", "0.05", "--timeout", "30"])
    t.join()
    assert res.exit_code == 3, res.output
    assert halted_by_watchdog(run)
    operator = write_run(tmp_path / "op", seed=5, end="halted", halt_reason="planned stop")
    assert not halted_by_watchdog(operator)
    assert runner.invoke(app, ["watch", str(operator)]).exit_code == 0

    import nsa.train.trainer

    class Halted:  # `nsa train` maps a watchdog halt to exit 3
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.run_dir = tmp_path / "t"

        def fit(self) -> TrainResult:
            return TrainResult("halted", self.run_dir, 4, 2.0, halted_by="watchdog")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nsa.train.trainer, "Trainer", Halted)
        out = runner.invoke(app, ["train", "--config", "tiny", "--steps", "4", "--out-dir", str(tmp_path / "t")])
    assert out.exit_code == 3, out.output
    help_text = runner.invoke(app, ["train", "--help"]).output
    assert "3 halted by the watchdog" in " ".join(help_text.split())


def test_5_the_trainer_knows_it_was_halted_by_the_watchdog(tmp_path: Path) -> None:
    from nsa.train.trainer import Trainer
    from tests.conftest import halt_at, quiet, resolve

    run = tmp_path / "run"
    payload = json.dumps({"reason": "watchdog: rank 0 heartbeat is 412 s old (> 180 s) at step 2", "rule": "stale"})
    res = Trainer(resolve(run, 6, eval__every=0, checkpoint__every=0), reporter=quiet(),
                  step_hook=halt_at(run, 2, payload)).fit()
    assert res.status == "halted" and res.halted_by == "watchdog" and halted_by_watchdog(run)


def test_5_a_stale_alarm_changes_the_header(tmp_path: Path) -> None:
    steps = 20
    run = write_run(tmp_path / "r", seed=5, end=None, steps=steps, ts0=time.time() - 30 - 1 - steps)
    plain = runner.invoke(app, ["watch", str(run), "--once", "--alert-on", "none"])
    assert "RUNNING" in plain.output
    res = runner.invoke(app, ["watch", str(run), "--once", "--alert-on", "stale=15"])
    assert res.exit_code == 1 and "STALE" in res.output and "RUNNING" not in res.output, res.output


# 6 --------------------------------------------------------------------------------------------------------

FAKE_TRAINER = """
import fcntl, json, os, socket, sys, time
from pathlib import Path
from nsa.train.signals import SignalFlags
run = Path(sys.argv[1])
fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
flags = SignalFlags()
flags.install(run / "stackdump_rank0.txt")
print("ready", flush=True)
def waiting_in_the_training_loop():
    time.sleep(120)
waiting_in_the_training_loop()
"""


def test_6_nsa_dump_signals_the_trainer_that_holds_the_run_lock(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", seed=6, end=None)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        res = runner.invoke(app, ["dump", str(run), "--timeout", "20"])
        assert res.exit_code == 0, res.output
        assert "most recent call first" in res.output and "waiting_in_the_training_loop" in res.output
        assert f"rank 0 PID {proc.pid}" in res.output
        assert "waiting_in_the_training_loop" in (run / "stackdump_rank0.txt").read_text()
    finally:
        proc.kill()
        proc.wait()
    gone = runner.invoke(app, ["dump", str(run)])  # the lock names a dead process
    assert gone.exit_code == 1 and "is not running" in gone.output
    _lock(run, os.getpid(), time.time())  # a live PID that does not hold the lock (reused): never signalled
    assert runner.invoke(app, ["dump", str(run)]).exit_code == 1
    (run / ".lock").write_text(json.dumps({"pid": 4242, "host": "gpu-node-7", "since": time.time()}))
    elsewhere = runner.invoke(app, ["dump", str(run)])
    assert elsewhere.exit_code == 2 and "runs on host gpu-node-7" in elsewhere.output
    (run / ".lock").unlink()
    assert runner.invoke(app, ["dump", str(run)]).exit_code == 2
    assert runner.invoke(app, ["dump", str(tmp_path)]).exit_code == 2
    book = (ROOT / "runbooks" / "monitoring-and-troubleshooting.md").read_text()
    assert "nsa dump artifacts/m7c-125m-50k" in book and "pgrep" not in book


# 8 --------------------------------------------------------------------------------------------------------


def test_8_a_nan_run_reads_right(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run dir given relative (the trainer wrote its record path relative to its working directory), value
    written as null, no checkpoint to resume from: the link works, no "None" anywhere."""
    monkeypatch.chdir(tmp_path)
    run = write_run(Path("artifacts/nan"), seed=8, end="failed", nonfinite_at=20)
    (run / "anomalies").mkdir()
    (run / "anomalies" / "step_20.json").write_text("{}")
    edit_events(run, "anomaly", value=None, record=str(run / "anomalies" / "step_20.json"))
    append_events(run, {"event": "halt", "step": 19, "reason": "nonfinite_loss at step 20", "source": "anomaly",
                        "checkpoint": None})
    res = build_report([run], Path("reports"), charts=False)
    text = res.path.read_text()
    link = text.split("anomaly `nonfinite_loss at step 20 (value non-finite)` — [step_20.json](<")[1].split(">)")[0]
    assert (res.path.parent / link).resolve() == (run / "anomalies" / "step_20.json").resolve()
    assert "None" not in text.split("### Anomalies")[1].split("### Artifacts")[0]
    assert "no checkpoint to resume from" in text
    view = render(run)
    assert "value None" not in view and "checkpoint None" not in view and "no checkpoint to resume from" in view


# 9 --------------------------------------------------------------------------------------------------------


def _points(run: Path, n: int, **per_step: Any) -> Path:
    """A run whose progress lines are steps 10, 20, ... with ``per_step[key](step)`` values."""
    write_run(run, seed=9, end=None, steps=n * 10, steps_total=10_000, log_every=10, ts0=time.time() - n * 10 - 5)
    edit_events(run, "progress", **{k: _of_step(f) for k, f in per_step.items()})
    return run


def _of_step(f: Any) -> Any:
    return lambda ev: f(ev["step"])


def fired(run: Path) -> set[str]:
    return {h.rule for h in evaluate(parse_rules("all"), read_run(run), time.time())}


def test_9_thresholds_are_as_strict_as_the_older_runbooks(tmp_path: Path) -> None:
    mon = MonitorConfig()
    assert (mon.gate_collapse_max, mon.gate_entropy_early_min, mon.gate_entropy_min) == (0.1, 0.5, 0.3)
    assert "gate-collapse" in fired(_points(tmp_path / "c15", 10, gate_collapse_fraction=lambda s: 0.15))
    assert "gate-collapse" not in fired(_points(tmp_path / "c05", 10, gate_collapse_fraction=lambda s: 0.05))
    early = _points(tmp_path / "early", 10, gate_entropy_mean=lambda s: 0.4)  # steps 10..100: early, 0.4 < 0.5
    assert "gate-entropy" in fired(early)
    late = _points(tmp_path / "late", 10, gate_entropy_mean=lambda s: 0.4, step=lambda s: s + 2000)
    assert "gate-entropy" not in fired(late)  # later on 0.3 applies
    assert "gate-entropy" in fired(_points(tmp_path / "low", 10, gate_entropy_mean=lambda s: 0.25,
                                           step=lambda s: s + 2000))
    res = build_report([early], tmp_path / "rep", charts=False)
    assert checks(res)["gate entropy"].result == "FAIL" and "gate_entropy_early_min" in checks(res)["gate entropy"].limit


def test_9_rules_for_rising_fallbacks_and_gpu_memory_errors(tmp_path: Path) -> None:
    rising = _points(tmp_path / "fb", 10, fallback=lambda s: {"triton_unsupported": s // 10})
    hit = next(h for h in evaluate(parse_rules("fallback-rise"), read_run(rising), time.time()))
    assert "rose 7 -> 10 over steps 70-100" in hit.message and hit.evidence["fallback"] == {"triton_unsupported": 10}
    flat = _points(tmp_path / "flat", 10, fallback=lambda s: {"triton_unsupported": 3})
    assert "fallback-rise" not in fired(flat)
    ecc = _points(tmp_path / "ecc", 10, gpu_mem_errors=lambda s: {"ecc_uncorrected": 0 if s < 80 else 2, "retired_pages": 0})
    hit = next(h for h in evaluate(parse_rules("gpu-errors"), read_run(ecc), time.time()))
    assert "ecc_uncorrected 0 -> 2" in hit.message and "dmesg" in hit.message
    assert "gpu-errors" not in fired(_points(tmp_path / "steady", 10, gpu_mem_errors=lambda s: {"ecc_uncorrected": 1}))
    assert "gpu-errors" not in fired(_points(tmp_path / "cpu", 10))  # no telemetry: nothing to say
    append_events(ecc, {"event": "end", "step": 100, "status": "completed", "error": None})
    res = build_report([ecc], tmp_path / "rep", charts=False)
    assert checks(res)["GPU memory errors"].result == "FAIL" and res.verdicts[0][0] == "FAIL"


# 10 -------------------------------------------------------------------------------------------------------


def test_10_comparison_table_records_world_size_and_kernel_path(tmp_path: Path) -> None:
    a = write_run(tmp_path / "triton-1", seed=10, backend="triton", fallback={"unsupported_shape": 120})
    b = write_run(tmp_path / "torch-2", seed=10, backend="torch", ranks=2)
    text = build_report([a, b], tmp_path / "rep", charts=False).path.read_text()
    assert "| world size | kernel path |" in text
    rows = [x for x in text.splitlines() if x.startswith(("| triton-1 ", "| torch-2 "))]
    assert "| 1 | triton + torch fallback (120 calls) |" in rows[0] and "| 2 | torch |" in rows[1], rows


def test_10_bench_train_rows_name_the_path_that_ran() -> None:
    from nsa.bench.train import TrainRow

    row = TrainRow("nsa", 2048, 8, 125.0, 90.0, 180_000.0, None, "NVIDIA H100", "triton", fallbacks={"x": 3})
    assert row.path == "triton + torch fallback (3 calls)" and row.to_dict()["world_size"] == 1
    assert TrainRow("dense", 2048, 8, 125.0, 90.0, 1.0, None, "cpu", "torch").path == "dense (SDPA)"


def test_10_preflight_warns_when_nccl_transports_are_off() -> None:
    from nsa.checks.preflight import run_preflight

    def nccl(environ: dict[str, str]) -> Any:
        report = run_preflight(profile="cpu", config="tiny", environ=environ)
        return next(c for c in report.checks if c.name == "nccl")

    off = nccl({"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"})
    assert off.status.value == "WARN" and "NCCL_P2P_DISABLE=1" in off.reason and "NCCL_IB_DISABLE=1" in off.reason
    assert nccl({"NCCL_P2P_DISABLE": "0"}).status.value == "PASS"


# 11 -------------------------------------------------------------------------------------------------------


def test_11_a_throughput_collapse_at_the_end_fails(tmp_path: Path) -> None:
    """~16k tokens/s, then a fifth of it for the last 20 steps: the median and the floor of 200 pass, the tail
    does not."""
    run = write_run(tmp_path / "collapse", seed=11, steps=100, steps_total=100, log_every=5, tokens_per_s=16_000.0,
                    tps_drop_after=80)
    set_monitor(run, min_tokens_per_s=200)
    res = build_report([run], tmp_path / "rep", charts=False)
    c = checks(res)
    assert c["throughput"].result == "PASS" and c["throughput tail"].result == "FAIL", c["throughput tail"]
    assert res.verdicts[0][0] == "FAIL" and "throughput collapsed at the end" in res.verdicts[0][1]
    assert "(steps 90-100)" in c["throughput tail"].figure
    steady = write_run(tmp_path / "steady", seed=11, steps=100, steps_total=100, tokens_per_s=16_000.0)
    assert checks(build_report([steady], tmp_path / "rep", charts=False))["throughput tail"].result == "PASS"
    # the same drop for 1.5 s of wall time only (e.g. `nsa halt` starting next to a CPU run): a WARN
    brief = write_run(tmp_path / "brief", seed=11, steps=100, steps_total=100, dt_s=0.1, tokens_per_s=16_000.0,
                      tps_drop_after=80)
    res = build_report([brief], tmp_path / "rep", charts=False)
    assert checks(res)["throughput tail"].result == "WARN" and res.verdicts[0][0] == "PASS", checks(res)["throughput tail"]


# 12 -------------------------------------------------------------------------------------------------------


def test_12_watch_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a run")
    (other / "src").mkdir()
    t0 = time.monotonic()
    res = runner.invoke(app, ["watch", str(other)])
    assert time.monotonic() - t0 < 5
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {other} is not a run directory"), res.output
    for waiting in (tmp_path / "missing", tmp_path / "empty", tmp_path / "claimed"):
        if waiting.name != "missing":
            waiting.mkdir()
        if waiting.name == "claimed":
            (waiting / ".lock").write_text("{}")
        res = runner.invoke(app, ["watch", str(waiting), "--timeout", "0.2"])
        assert res.exit_code == 2 and "waiting for run directory" in res.output and "did not start" in res.output


def test_fcntl_lock_of_the_fake_trainer_is_exclusive(tmp_path: Path) -> None:
    """The fake trainer of case 6 holds the lock as ``nsa train`` does (a second flock fails)."""
    run = write_run(tmp_path / "r", seed=6, end=None)
    proc = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        fd = os.open(run / ".lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        proc.kill()
        proc.wait()
