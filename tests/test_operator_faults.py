"""Faults during writes and a run's history across sessions (issue 34, "Faults and history"): each test is one
numbered case of the issue, on tiny CPU runs (seq 32, batch 2) or hand-written run directories."""

from __future__ import annotations

import errno
import json
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
    """``torch.save`` of the checkpoint of ``at_step`` gets ``times`` SIGINTs before it writes (the operator
    pressing Ctrl-C while the checkpoint is being written)."""
    import nsa.train.checkpoint as ckpt

    real_save = ckpt.torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if obj.get("train_state", {}).get("step") == at_step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)


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
    assert events(run)[-1]["status"] == "interrupted"
    assert _train_cli(run, 8, "--resume", "auto").exit_code == 0
