"""Faults during writes and a run's history across sessions (issue 34, "Faults and history"): each test is one
numbered case of the issue, on tiny CPU runs (seq 32, batch 2) or hand-written run directories."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nsa.rundir.checkpoints import newest_verified
from nsa_cli.app import app
from tests.conftest import events

runner = CliRunner()
TINY = ["--config", "tiny", "--seq-len", "32", "--batch-size", "2", "--set", "logging.every=1", "--set", "eval.every=0"]


def _train_cli(run: Path, steps: int, *extra: str) -> Any:
    return runner.invoke(app, ["train", *TINY, "--steps", str(steps), "--out-dir", str(run), *extra], env={})


# 1. a full disk during a checkpoint save --------------------------------------------------------------


def _disk_full_at(monkeypatch: pytest.MonkeyPatch, needle: str, after_bytes: int = 4096) -> None:
    """Files opened by the checkpoint writer whose path contains ``needle`` take ``after_bytes`` bytes, then
    fail with ENOSPC (what a full tmpfs does); ``torch.save`` itself runs unpatched and wraps the error in its
    ``RuntimeError: [enforce fail at inline_container.cc] ...``."""
    import builtins

    import nsa.train.checkpoint as ckpt

    real_open = builtins.open

    class Full:
        def __init__(self, f: Any) -> None:
            self.f, self.left = f, after_bytes

        def write(self, data: Any) -> int:
            n = len(memoryview(data))
            if n > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= n
            return int(self.f.write(data))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def fake_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if needle in str(path) and "w" in mode else f

    monkeypatch.setattr(ckpt, "open", fake_open, raising=False)


def test_1_a_full_disk_during_a_checkpoint_is_one_line_naming_the_file_and_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _disk_full_at(monkeypatch, "step_00000004")
    res = _train_cli(run, 6, "--set", "checkpoint.every=2")
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and "enforce fail" not in res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error: run failed at step"), line
    assert f"cannot write {run / 'checkpoints' / 'step_00000004'}: No space left on device (" in line
    assert " free)" in line and "resume from step_00000002: --resume auto" in line
    # metrics.json and the heartbeat's end event name the file too, not torch's enforce-fail text
    end = events(run)[-1]
    assert end["event"] == "end" and end["status"] == "failed"
    assert "No space left on device" in end["error"] and "step_00000004" in end["error"]
    assert "enforce fail" not in end["error"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["error"] == end["error"]
    # the previous state is usable: no temporary folder, step 2 verifies, and the report says how to resume
    assert not list((run / "checkpoints").glob(".tmp-*"))
    newest, skipped = newest_verified(run)
    assert newest is not None and newest.name == "step_00000002" and not skipped
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert rep.exit_code == 1 and "No space left on device" in text and "resume from step_00000002" in text
    monkeypatch.undo()
    assert _train_cli(run, 6, "--resume", "auto").exit_code == 0


def test_1_every_write_of_a_run_names_its_file_and_the_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Export, eval results, report and alarms: one line naming the file and the free space; what was
    there before stays."""
    from nsa.errors import NSAError
    from nsa.eval.results import save_results
    from nsa.fileio import write_failure
    from nsa.runs.report import build_report
    from tests.conftest import write_run

    full = OSError(errno.ENOSPC, "No space left on device")
    assert write_failure(full, tmp_path / "x.json").startswith(f"cannot write {tmp_path / 'x.json'}: No space left")
    run = write_run(tmp_path / "run", steps=20, seed=3)
    (run / "eval").mkdir()
    (run / "eval" / "loss.json").write_text('{"task": "loss", "results": []}\n')

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    payload = {"task": "loss", "results": [{"context": 32, "loss": 1.0}], "settings": {}}
    with pytest.raises(NSAError) as err:
        save_results(run, payload)
    assert f"{run / 'eval' / 'loss.json'}" in err.value.message and "free)" in err.value.message
    assert json.loads((run / "eval" / "loss.json").read_text())["results"] == []  # the previous file, whole
    with pytest.raises(NSAError) as err:
        build_report([run], tmp_path / "out" / "r.md", charts=False)
    assert "No space left on device" in err.value.message and "free)" in err.value.message
    monkeypatch.undo()


# 2. Ctrl-C twice during a checkpoint write ---------------------------------------------------------------


def _ctrl_c_during_save(monkeypatch: pytest.MonkeyPatch, at_step: int, times: int) -> None:
    """While ``torch.save`` writes the checkpoint of ``at_step`` (inside its third write of bytes: an interrupt
    there comes out of ``torch.save`` as ``RuntimeError: [enforce fail at inline_container.cc] ...``) the
    operator presses Ctrl-C ``times`` times, 0.1 s apart (each a request of its own: copies of one signal are
    those within ``SAME_REQUEST_S``, set to 0.05 s here)."""
    import time

    import nsa.train.checkpoint as ckpt
    import nsa.train.signals as signals

    monkeypatch.setattr(signals, "SAME_REQUEST_S", 0.05)
    real_write = ckpt._HashingWriter.write
    step: dict[str, int | None] = {"saving": None, "writes": 0}
    real_save = ckpt.save_checkpoint

    def save_checkpoint(run_dir: Path, n: int, *args: Any, **kwargs: Any) -> Path:
        step["saving"] = n
        try:
            return real_save(run_dir, n, *args, **kwargs)
        finally:
            step["saving"] = None

    def write(self: Any, data: Any) -> int:
        if step["saving"] == at_step:
            step["writes"] = (step["writes"] or 0) + 1
        if step["saving"] == at_step and step["writes"] == 3:
            step["saving"] = None  # once
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
        return int(real_write(self, data))

    monkeypatch.setattr(ckpt, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(ckpt._HashingWriter, "write", write)


def test_2_ctrl_c_twice_during_a_checkpoint_write_finishes_it_and_records_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _ctrl_c_during_save(monkeypatch, 4, times=2)
    res = _train_cli(run, 8, "--set", "checkpoint.every=2")
    monkeypatch.undo()
    assert res.exit_code == 130, res.output
    assert "Traceback" not in res.output
    out = res.output
    assert "SIGINT received: halting after this step with a checkpoint (Ctrl-C again to stop at once)" in out
    assert "stopping as soon as the checkpoint being written is complete" in out
    assert out.strip().splitlines()[-1] == ("interrupted at step 4 (Ctrl-C twice): recorded as interrupted; "
                                            "resume from step_00000004 with --resume auto")
    end = events(run)[-1]
    assert end["event"] == "end" and end["status"] == "interrupted"
    assert json.loads((run / "metrics.json").read_text())["status"] == "interrupted"
    newest, skipped = newest_verified(run)
    assert newest is not None and newest.name == "step_00000004" and not skipped
    log = (run / "train.log").read_text()
    assert "SIGINT received" in log and "run interrupted at step 4" in log
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert "interrupted by the operator" in text and "crashed" not in text.split("## Run")[0], text[:2000]
    assert rep.exit_code == 0


def test_2_a_third_ctrl_c_drops_the_partial_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _ctrl_c_during_save(monkeypatch, 4, times=3)
    res = _train_cli(run, 8, "--set", "checkpoint.every=2")
    monkeypatch.undo()
    assert res.exit_code == 130 and "Traceback" not in res.output, res.output
    assert "dropping the partial checkpoint" in res.output
    assert res.output.strip().splitlines()[-1].endswith("resume from step_00000002 with --resume auto")
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / "checkpoints" / "step_00000004").exists()
    end = events(run)[-1]
    assert end["status"] == "interrupted" and end["error"] == "interrupted: SIGINT received twice (Ctrl-C)", end
    assert json.loads((run / "metrics.json").read_text())["status"] == "interrupted"
    assert _train_cli(run, 8, "--resume", "auto").exit_code == 0


# 3. a run's history across sessions -------------------------------------------------------------------


def _kill_after(run: Path) -> float:
    """Make the run's last session look SIGKILLed: its end event (and metrics.json) gone; returns its boot ts."""
    hb = run / "heartbeat_rank0.jsonl"
    lines = hb.read_text().splitlines(keepends=True)
    hb.write_text("".join(x for x in lines if json.loads(x)["event"] != "end"))
    (run / "metrics.json").unlink()
    return float(next(json.loads(x)["ts"] for x in lines if json.loads(x)["event"] == "boot"))


def _alarm(run: Path, rule: str, session: float, step: int) -> None:
    with open(run / "alarms.jsonl", "a") as f:
        f.write(json.dumps({"schema": 1, "event": "alarm", "time": session + 5, "rule": rule, "message": f"{rule} fired",
                            "evidence": {"step": step}, "step": step, "session": session, "by": "nsa watch"}) + "\n")


def test_3_the_report_shows_each_session_and_judges_past_alarms(tmp_path: Path) -> None:
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    run = tmp_path / "run"
    Trainer(resolve(run, 4, eval__every=0, checkpoint__every=2), reporter=quiet()).fit()
    first = _kill_after(run)  # a SIGKILL after step 4: no end event
    _alarm(run, "crashed", first, 4)  # what nsa watch kept when it saw it
    Trainer(resolve(run, 6, eval__every=0, checkpoint__every=2, train__resume="auto"), reporter=quiet()).fit()
    second = [e for e in events(run) if e["event"] == "boot"][-1]["ts"]
    _alarm(run, "throughput-drop", second, 5)  # an alarm of the session that completed

    def report() -> tuple[int, str]:
        res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts", "--force"], env={})
        return res.exit_code, (tmp_path / "r.md").read_text()

    code, text = report()
    assert "### Sessions" in text
    rows = [x for x in text.splitlines() if x.startswith("| 1 |") or x.startswith("| 2 |")]
    assert "crashed (the trainer is gone without an end event)" in rows[0] and "0 -> 4" in rows[0]
    assert "completed" in rows[1] and "4 -> 6" in rows[1]
    assert "| sessions | 2 session(s): 1 crashed at step 4; 2 completed at step 6 |" in text and "**WARN** |" in text
    # the crash alarm is resolved by session 2; the throughput alarm of session 2 is open and fails the run
    assert "[resolved: session 2 ran on and ended completed]" in text
    assert code == 1 and "1 open alarm(s) raised by nsa watch (throughput-drop)" in text
    res = runner.invoke(app, ["ack", str(run), "--rule", "throughput", "--reason", "known slow node, replaced"], env={})
    assert res.exit_code == 0 and "acknowledged `throughput-drop` at step 5" in res.output, res.output
    ack = json.loads((run / "alarms.jsonl").read_text().splitlines()[-1])
    assert ack["event"] == "ack" and ack["rule"] == "throughput-drop" and ack["reason"] == "known slow node, replaced"
    code, text = report()
    assert code == 0 and "**Verdict: PASS**" in text
    assert "[acknowledged: by " in text and "known slow node, replaced]" in text
    # the history stays in the verdict
    assert "WARN: session 1 crashed (the trainer is gone without an end event) at step 4; session 2 resumed at step 4" in text
    # acknowledging again: nothing open; a rule with no open alarm is bad input
    assert runner.invoke(app, ["ack", str(run), "--reason", "x"], env={}).output.strip() == f"no open alarm in {run}"
    res = runner.invoke(app, ["ack", str(run), "--rule", "stale", "--reason", "x"], env={})
    assert res.exit_code == 2 and "no open alarm for rule stale" in res.output
    assert runner.invoke(app, ["ack", str(run), "--reason", " "], env={}).exit_code == 2


def test_3_a_first_session_that_failed_on_data_is_in_the_history(tmp_path: Path) -> None:
    from nsa.runs.sessions import read_sessions
    from tests.conftest import write_run

    run = write_run(tmp_path / "run", steps=10, seed=1)
    hb = run / "heartbeat_rank0.jsonl"
    lines = hb.read_text().splitlines()
    boot = json.loads(lines[0])
    failed = [json.dumps({**boot, "ts": boot["ts"] - 100}),
              json.dumps({"schema": 1, "event": "end", "ts": boot["ts"] - 99, "rank": 0, "pid": 1, "step": 0,
                          "status": "failed", "error": "DataError: data.path=x.txt is empty"})]
    hb.write_text("\n".join(failed + lines) + "\n")
    sessions = read_sessions(run, "completed")
    assert [s.status for s in sessions] == ["failed", "completed"]
    assert sessions[0].how() == "failed: DataError: data.path=x.txt is empty"
    rep = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert rep.exit_code == 0 and "WARN: session 1 failed: DataError: data.path=x.txt is empty at step 0" in text


# 4. evaluations record the step and weights they evaluated; stale ones are marked -------------------------


def test_4_an_evaluation_of_earlier_weights_is_marked_stale(tmp_path: Path) -> None:
    from nsa.rundir.checkpoints import sha256_file
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    run = tmp_path / "run"
    Trainer(resolve(run, 4, eval__every=0, monitor__min_eval_accuracy=0.0), reporter=quiet()).fit()
    args = ["eval", str(run), "--task", "mqar", "--contexts", "32", "--pairs", "2", "--samples", "2"]
    assert runner.invoke(app, args, env={}).exit_code == 0
    saved = json.loads((run / "eval" / "mqar.json").read_text())
    assert saved["step"] == 4 and saved["weights"]["path"] == str(run / "export" / "model.safetensors")
    assert saved["weights"]["sha256"] == sha256_file(run / "export" / "model.safetensors")
    assert json.loads((run / "export" / "export.json").read_text())["step"] == 4

    def report() -> str:
        runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts", "--force"], env={})
        return (tmp_path / "r.md").read_text()

    assert "STALE" not in report()
    Trainer(resolve(run, 6, eval__every=0, monitor__min_eval_accuracy=0.0, train__resume="auto"),
            reporter=quiet()).fit()
    text = report()
    assert "**STALE** `eval/mqar.json`: is of step 4; the run is at step 6." in text
    assert "WARN: eval/mqar.json is of step 4; the run is at step 6: re-run nsa eval" in text
    assert runner.invoke(app, args, env={}).exit_code == 0
    assert json.loads((run / "eval" / "mqar.json").read_text())["step"] == 6 and "STALE" not in report()


# 5. an unreadable config.yaml is said and never passes on defaults silently ---------------------------------


def test_5_an_unreadable_config_is_said_and_judged_with_what_is_known(tmp_path: Path) -> None:
    from tests.conftest import write_run

    run = write_run(tmp_path / "run", steps=20, seed=5)
    (run / "config.yaml").write_text("model: {dim: 64\n")
    res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert "seq_len None" not in text and "dim None" not in text
    assert "**config.yaml cannot be read: " in text and "the run's settings are unknown" in text
    assert "| run config | config.yaml cannot be read:" in text and "| **WARN** |" in text
    verdict = next(x for x in text.splitlines() if x.startswith("**Verdict:"))
    assert "WARN: config.yaml cannot be read" in verdict and "every limit below is the default" in verdict, verdict
    assert "default, config.yaml unreadable" in text
    assert res.exit_code == 0  # judged on what can be known: the run itself completed
    watch = runner.invoke(app, ["watch", str(run), "--once"], env={"COLUMNS": "200"})
    assert "warning: config.yaml cannot be read" in watch.output


# 6. text that is not UTF-8 names the file and the encoding, and creates nothing ------------------------------


@pytest.mark.parametrize(("name", "data", "what"), [
    ("latin1.txt", ("Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e " * 20 + "\n\n").encode("latin-1") * 30, "is not UTF-8 text (first bad byte 0xe9 at line 1"),
    ("utf16.txt", ("hello world\n\n" * 50).encode("utf-16"), "is UTF-16 text"),
    ("blob.txt", bytes(range(256)) * 40, "is a binary file (NUL bytes)"),
    ("latin1.jsonl", '{"text": "caf\u00e9 cr\u00e8me"}\n'.encode("latin-1") * 20, "is not UTF-8 text (first bad byte 0xe9"),
])
def test_6_text_that_is_not_utf8_names_the_file_and_encoding_and_creates_nothing(
    tmp_path: Path, name: str, data: bytes, what: str
) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", *TINY, "--steps", "2", "--out-dir", str(run), "--dataset", "local",
                              "--data-path", str(path)], env={})
    assert res.exit_code == 2, res.output
    (line,) = [x for x in res.output.strip().splitlines() if x.startswith("error:")]
    assert f"data.path={path}: {name} {what}" in line, line
    assert "skipped as invalid_utf8" in line and "iconv -f latin1 -t utf-8" in line
    assert "val_fraction" not in line and not run.exists()


def test_6_mostly_utf8_text_with_a_few_bad_paragraphs_still_trains(tmp_path: Path) -> None:
    """Three latin-1 paragraphs among the first six of 33: the check lets the file through, the run trains its
    3 steps to the end (seed 0) and counts the three it skipped as invalid_utf8."""
    from nsa.data.sources import _check_local_path

    path = tmp_path / "mixed.txt"
    good, bad = b"a good paragraph of text\n\n", "caf\u00e9 au lait\n\n".encode("latin-1")
    path.write_bytes(b"".join([good, bad] * 3 + [good] * 27))
    assert _check_local_path(str(path))[0] == "text"
    run = tmp_path / "run"
    res = _train_cli(run, 3, "--dataset", "local", "--data-path", str(path), "--seed", "0")
    assert res.exit_code == 0, res.output
    assert "3 record(s) skipped" in res.output
    progress = [e for e in events(run) if e["event"] == "progress"]
    assert [e["step"] for e in progress] == [1, 2, 3] and all(math.isfinite(e["loss"]) for e in progress)
    assert progress[-1]["data_skipped"] == {"invalid_utf8": 3, "total": 3}
    assert events(run)[-1]["status"] == "completed"


# 7. bench quality names its runs by arm and seed ----------------------------------------------------------


def test_7_bench_quality_names_runs_by_arm_and_seed(tmp_path: Path) -> None:
    q = tmp_path / "q"
    res = runner.invoke(app, ["bench", "quality", "--tiny", "--arms", "dense,nsa", "--steps", "2", "--out-dir", str(q),
                              "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "dense seed 0: text, 2 steps [run 1/2, 0% done" in res.stderr and "[run 2/2, 50% done" in res.stderr
    rep = runner.invoke(app, ["report", str(q / "dense" / "seed0"), str(q / "nsa" / "seed0"), "--out",
                              str(tmp_path / "rep"), "--no-charts", "--json"], env={})
    data = json.loads(rep.stdout)
    assert [r["run_name"] for r in data["runs"]] == ["dense-seed0", "nsa-seed0"]
    assert Path(data["path"]).name.endswith("dense-seed0 vs nsa-seed0 v1.md")


# 8. exit codes, usage errors, the lock of a refused resume, retired .HALT, bf16 on a CPU ----------------------


def test_8_debug_keeps_exit_code_2_and_shows_the_traceback(tmp_path: Path) -> None:
    res = runner.invoke(app, ["--debug", "halt", str(tmp_path / "missing")], env={})
    assert res.exit_code == 2
    assert "Traceback" in res.stderr and res.stderr.strip().splitlines()[-1].startswith("error: run directory")
    plain = runner.invoke(app, ["halt", str(tmp_path / "missing")], env={})
    assert plain.exit_code == 2 and "Traceback" not in plain.output


@pytest.mark.parametrize("argv", [["train", "--steps", "abc"], ["watch", "x", "--refresh", "soon"], ["report", "--bogus"]])
def test_8_a_usage_error_is_one_error_line(argv: list[str]) -> None:
    res = runner.invoke(app, argv, env={})
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"(hint: nsa {argv[0]} --help)" in lines[0], lines


def test_8_a_refused_resume_leaves_the_lock_naming_the_last_trainer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert _train_cli(run, 3).exit_code == 0
    before = (run / ".lock").read_text()
    res = _train_cli(run, 1, "--resume", "auto")  # fewer steps than done: refused
    assert res.exit_code == 2 and "train.steps=1 is below" in res.output
    assert (run / ".lock").read_text() == before


def test_8_a_halt_file_acted_on_is_retired(tmp_path: Path) -> None:
    from nsa.train.trainer import Trainer
    from tests.conftest import halt_at, quiet, resolve

    run = tmp_path / "run"
    assert Trainer(resolve(run, 20, eval__every=0), reporter=quiet(), step_hook=halt_at(run, 2, "stop")).fit().status == "halted"
    assert not (run / ".HALT").exists() and [p.name.endswith("-acted") for p in (run / "halts").iterdir()] == [True]
    out = quiet()
    Trainer(resolve(run, 5, eval__every=0, train__resume="auto"), reporter=out).fit()
    assert ".HALT" not in out.text()  # no warning about a stale .HALT on the resume


def test_8_preflight_and_train_agree_about_bf16_on_a_cpu(tmp_path: Path) -> None:
    from nsa.checks.preflight import run_preflight
    from nsa.config import load_run_config
    from nsa.errors import ConfigError
    from nsa.train.runtime import resolve_runtime

    sets = ["runtime.device=cpu", "runtime.precision=bf16"]
    report = run_preflight(config="tiny", sets=sets, environ={}, out_dir=tmp_path)
    (check,) = [c for c in report.checks if c.name == "bf16"]
    with pytest.raises(ConfigError) as err:
        resolve_runtime(load_run_config("tiny", environ={}, sets=sets).config)
    assert check.status.value == "FAIL" and err.value.message in check.reason and err.value.hint == check.hint
    fine = run_preflight(config="tiny", sets=["runtime.device=cpu"], environ={}, out_dir=tmp_path)
    (check,) = [c for c in fine.checks if c.name == "bf16"]
    assert check.status.value == "PASS" and "fp32" in check.reason and "supported" not in check.reason


# 9. what the older runbooks' operators also watched ---------------------------------------------------------


def test_9_fetch_percentiles_and_memory_in_training_csv_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nsa.rundir.records import TRAIN_CSV_HEADER
    from nsa.train.trainer import Trainer
    from tests.conftest import csv_rows, quiet, resolve

    run = tmp_path / "run"
    Trainer(resolve(run, 3, eval__every=0), reporter=quiet()).fit()
    rows = csv_rows(run / "training.csv")
    assert {"fetch_p50_ms", "fetch_p95_ms", "mem_peak_mib", "rss_mib", "gpu_util_pct", "gpu_mem_used_mib"} <= set(
        TRAIN_CSV_HEADER)
    assert all(float(r["fetch_p95_ms"]) >= float(r["fetch_p50_ms"]) >= 0 and float(r["rss_mib"]) > 0 for r in rows)
    assert rows[-1]["gpu_util_pct"] == "" and rows[-1]["mem_peak_mib"] == ""  # CPU run: no GPU figures
    progress = [e for e in events(run) if e["event"] == "progress"]
    assert {"gpu_util_pct", "gpu_mem_used_mib"} <= set(progress[-1])
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert {"perf/fetch_p50_ms", "perf/fetch_p95_ms", "mem/rss_mib"} <= set(acc.Tags()["scalars"])


def test_9_gpu_utilisation_and_memory_over_time(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from nsa.envinfo import GpuProbe
    from tests.conftest import write_run

    probe = GpuProbe(None)
    assert probe.usage() == {"gpu_util_pct": None, "gpu_mem_used_mib": None}
    probe._nvml = SimpleNamespace(nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87, memory=40),
                                  nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=3 * 2**30, total=80 * 2**30))
    probe._handle = object()
    assert probe.usage() == {"gpu_util_pct": 87.0, "gpu_mem_used_mib": 3072.0}
    run = write_run(tmp_path / "run", steps=30, seed=9)
    hb = run / "heartbeat_rank0.jsonl"
    evs = [json.loads(x) for x in hb.read_text().splitlines()]
    for i, e in enumerate(evs):
        if e["event"] == "progress":
            e.update(gpu_util_pct=60.0 + i, gpu_mem_used_mib=2048.0 + i)
    hb.write_text("".join(json.dumps(e) + "\n" for e in evs))
    (run / "train.log").write_text("step 1\n")
    res = runner.invoke(app, ["report", str(run), str(write_run(tmp_path / "other", steps=30, seed=10)), "--out",
                              str(tmp_path / "rep"), "--json"], env={})
    data = json.loads(res.stdout)
    text = Path(data["path"]).read_text()
    assert any(c["name"] == "gpu" and c["run"] == "run" for c in data["charts"])
    assert "| GPU utilisation median / min (NVML) |" in text and "| Log | [train.log](" in text
    header = next(x for x in text.splitlines() if x.startswith("| run | S |"))
    assert "| final loss | val loss | verdict |" in header


def test_9_long_benchmarks_show_progress_with_an_eta(tmp_path: Path) -> None:
    from nsa.bench.progress import Eta

    now = [100.0]
    eta = Eta(400, clock=lambda: now[0])
    assert eta.line(0).endswith("ETA ?")
    now[0] += 30.0
    assert eta.line(100) == "25% done, 0:00:30 elapsed, ETA 0:01:30"
    res = runner.invoke(app, ["bench", "retrieval", "--config", "tiny", "--seq-len", "64", "--gap", "20", "--steps",
                              "4", "--eval-every", "2", "--eval-samples", "4", "--variants", "nsa,dense"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    points = [x for x in res.output.splitlines() if " step " in x and "ETA" in x]
    assert points[0].split("|")[-1].strip().startswith("25% done") and "100% done" in points[-1]


def test_9_bench_attention_warns_when_its_timings_are_noisy(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import torch

    import nsa.bench.attention as attention
    from nsa.bench.timing import Timer, noise_note

    calls = iter([0.001, 0.02] * 50)
    timer = Timer(torch.device("cpu"), cpu_reps=4)
    timer(lambda: time.sleep(next(calls)))
    assert timer.spread > 1.0 and "too noisy to read" in (noise_note("x", timer.spread) or "")
    assert noise_note("x", 0.05) is None

    class Noisy(Timer):
        def __call__(self, fn: Any) -> float:
            super().__call__(fn)
            self.spread = 0.5
            return 1.0

    monkeypatch.setattr(attention, "make_timer", lambda *a, **k: Noisy(torch.device("cpu"), cpu_reps=1))
    res = runner.invoke(app, ["bench", "attention", "--tiny", "--seq-lens", "64", "--no-peer"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "warning (tiny, S=64): NSA forward timings spread 50% around their median (> 20%): too noisy" in res.stderr
