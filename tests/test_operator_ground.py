"""Operator faults on new ground (issue 57): an export that must never remove a run, the weights' identity checked
by every reader, export write failures, stale evaluations, over-long values. Each test is one numbered defect of
the issue, reproduced as the probe ran it, on a tiny CPU run (3 steps) or a hand-written run directory. The
signal cases (2 and 4) are in ``tests/test_operator_signals.py``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nsa.rundir.checkpoints import newest_verified, sha256_file
from nsa_cli.app import app
from tests.conftest import quiet, resolve

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run of 3 steps (seed 0): export/, checkpoints/step_00000003, heartbeat, CSV."""
    from nsa.train.trainer import Trainer

    run = tmp_path_factory.mktemp("ground") / "runs" / "run"
    assert Trainer(resolve(run, 3, eval__every=0, train__seed=0), reporter=quiet()).fit().status == "completed"
    return run


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _intact(run: Path) -> None:
    """Every file of the run is still there and its checkpoint verifies."""
    for name in ("config.yaml", "training.csv", "heartbeat_rank0.jsonl", "metrics.json", "export/model.safetensors",
                 "export/export.json"):
        assert (run / name).is_file(), name
    newest, skipped = newest_verified(run)
    assert newest is not None and newest.name == "step_00000003" and not skipped


def _one_line_error(res: Any, *says: str) -> str:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for text in says:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# 1. an export never removes what it reads, nor a run -------------------------------------------------------


def test_1_export_overwrite_onto_the_run_or_its_parts_is_refused_and_the_run_stays(
        trained: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = _copy(trained, runs / "run")
    other = _copy(trained, tmp_path / "others" / "other")
    cases = {
        "the run": (run, "holds what the export reads"),
        "its export/": (run / "export", "is part of the run directory"),
        "its checkpoints/": (run / "checkpoints", "is part of the run directory"),
        "a checkpoint": (run / "checkpoints" / "step_00000003", "is part of the run directory"),
        "the folder of runs": (runs, "holds what the export reads"),
        "a folder holding another run": (tmp_path / "others", "holds the run directory"),
        "another run": (other, "is a run directory"),
    }
    for name, (out, says) in cases.items():
        res = runner.invoke(app, ["export", str(run), str(out), "--format", "hf", "--overwrite"])
        _one_line_error(res, str(out), says)
        _intact(run)
        _intact(other)
        assert not list(out.parent.glob(f".{out.name}.export-*")), name
    # what --overwrite does replace: an earlier export, and RUN/hf (what checkpoint.export_hf writes)
    for out in (tmp_path / "model-hf", run / "hf"):
        for _ in range(2):
            res = runner.invoke(app, ["export", str(run), str(out), "--format", "hf", "--overwrite"])
            assert res.exit_code == 0, res.output
        assert (out / "config.json").is_file()
    _intact(run)
    # and a non-empty folder that is not an export is not replaced
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me\n")
    res = runner.invoke(app, ["export", str(run), str(tmp_path / "notes"), "--format", "hf", "--overwrite"])
    _one_line_error(res, "is not an earlier export")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me\n"


# 3. the weights' identity: every reader checks the file against its recorded SHA-256 ------------------------


def _flip_weights(path: Path) -> None:
    """Flip bytes of the tensor data (the safetensors header, its first 8 + n bytes, stays intact)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header + 16, len(data), 997):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_3_a_corrupted_export_is_refused_by_every_reader_and_fails_the_report(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path / "run")
    weights = run / "export" / "model.safetensors"
    recorded = json.loads((run / "export" / "export.json").read_text())["sha256"]
    assert sha256_file(weights) == recorded
    hf = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(run), str(hf), "--format", "hf"]).exit_code == 0
    ev = ["eval", str(run), "--task", "loss", "--contexts", "32", "--samples", "2", "--device", "cpu"]
    assert runner.invoke(app, ev).exit_code == 0
    assert json.loads((run / "eval" / "loss.json").read_text())["weights"]["sha256"] == recorded
    _flip_weights(weights)
    assert sha256_file(weights) != recorded
    says = (str(weights), "does not match the SHA-256 recorded in", "export.json")
    _one_line_error(runner.invoke(app, ev), *says)
    _one_line_error(runner.invoke(app, ["sample", str(run), "-n", "4", "--seed", "1", "--device", "cpu"]), *says)
    _one_line_error(runner.invoke(app, ["export", str(run), str(tmp_path / "hf2"), "--format", "hf"]), *says)
    assert not (tmp_path / "hf2").exists()
    init = ["train", "--config", "tiny", "--steps", "1", "--seq-len", "32", "--batch-size", "2",
            "--out-dir", str(tmp_path / "init"), "--set", f"train.init_from={run}"]
    _one_line_error(runner.invoke(app, init, env={}), "train.init_from:", *says)
    # the report: FAIL naming the file, and the evaluation of the former bytes marked
    res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert res.exit_code == 1 and "**Overall verdict: FAIL**" in text, text[:1500]
    assert "export/model.safetensors does not match the SHA-256 in export.json" in text
    assert f"**STALE** `eval/loss.json`: evaluated weights of SHA-256 {recorded[:12]}..." in text
    # an export in Hugging Face format records its weights' SHA-256 in config.json; init_from checks it
    assert json.loads((hf / "config.json").read_text())["nsa_weights_sha256"] == sha256_file(hf / "model.safetensors")
    _flip_weights(hf / "model.safetensors")
    init[init.index(f"train.init_from={run}")] = f"train.init_from={hf}"
    _one_line_error(runner.invoke(app, init, env={}), "train.init_from:", str(hf / "model.safetensors"),
                    "config.json")
    # a checkpoint's state.pt given as a file is checked against its manifest
    state = run / "checkpoints" / "step_00000003" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    _one_line_error(runner.invoke(app, ["sample", str(state), "-n", "4", "--device", "cpu"]), str(state),
                    "manifest.json")


# 5. export's filesystem errors: one line naming the path and the cause, nothing half-written ---------------


def test_5_export_filesystem_errors_are_one_line_and_leave_nothing(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("x")
    res = runner.invoke(app, ["export", str(trained), str(tmp_path / "afile" / "out"), "--format", "hf"])
    _one_line_error(res, f"cannot write {tmp_path / 'afile' / 'out'}: {tmp_path / 'afile'} is a file")

    import nsa.hf.export as hf_export

    real_mkdir = Path.mkdir

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        if tmp_path / "ro" in (self, *self.parents):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    res = runner.invoke(app, ["export", str(trained), str(tmp_path / "ro" / "out"), "--format", "hf"])
    _one_line_error(res, f"cannot write {tmp_path / 'ro'}", "Read-only file system")
    monkeypatch.undo()

    earlier = tmp_path / "earlier"
    assert runner.invoke(app, ["export", str(trained), str(earlier), "--format", "hf"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    from safetensors import SafetensorError

    def full_disk(tensors: Any, filename: str, **kwargs: Any) -> None:
        Path(filename).write_bytes(b"\0" * 1000)  # a part written, then the disk is full
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(hf_export, "save_file", full_disk)
    res = runner.invoke(app, ["export", str(trained), str(earlier), "--format", "hf", "--overwrite"])
    _one_line_error(res, f"cannot write {earlier}: No space left on device")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before  # the earlier export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "earlier"]  # no temporary folder left


def test_export_files_share_one_mode(trained: Path, tmp_path: Path) -> None:
    """model.safetensors is as readable as the files beside it (safetensors alone writes 0600)."""
    out = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(trained), str(out), "--format", "hf"]).exit_code == 0
    for folder in (out, trained / "export"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert len(set(modes.values())) == 1, modes
        assert modes["model.safetensors"] == 0o666 & ~_umask(), modes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# 6. a stale evaluation is a warning by default ---------------------------------------------------------------


def test_6_a_stale_evaluation_warns_without_any_limit_set(tmp_path: Path) -> None:
    from tests.conftest import write_run

    run = write_run(tmp_path / "run", steps=50, seed=6)
    (run / "eval").mkdir()
    (run / "eval" / "loss.json").write_text(json.dumps({
        "task": "loss", "step": 40, "weights": {"path": None, "sha256": None},
        "results": [{"context": 128, "loss": 2.5}], "settings": {}}))
    res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.md"), "--no-charts"], env={})
    text = (tmp_path / "r.md").read_text()
    assert res.exit_code == 0, res.output
    assert "**STALE** `eval/loss.json`: is of step 40; the run is at step 50." in text
    assert "WARN: eval/loss.json is of step 40; the run is at step 50: re-run nsa eval" in text
    assert ("| eval freshness | STALE: eval/loss.json is of step 40; the run is at step 50 | of the run's last step "
            "and its weights as they are | **WARN** |") in text


# 7. over-long values: one line, exit 2 ------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["--set", "train.seed=" + "9" * 5000], "--set train.seed='999"),
    (["--seed", "9" * 100], "train.seed=999"),
    (["--set", "data.path=" + "a" * 100_000], "data.path='aaa"),
    (["--out-dir", "b/" * 3000], "train.out_dir='b/b/"),
    (["--lr", "inf"], "optimizer.lr=inf: Input should be a finite number"),
    (["--set", "optimizer.lr=.nan"], "optimizer.lr=nan: Input should be a finite number"),
])
def test_7_over_long_and_non_finite_values_are_one_short_line(tmp_path: Path, args: list[str], says: str) -> None:
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "1", "--out-dir", str(tmp_path / "run"), *args],
                        env={})
    line = _one_line_error(res, says)
    assert len(line) < 400, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "b").exists()


def test_7_an_over_long_number_in_a_config_file_or_variable_is_one_line(tmp_path: Path) -> None:
    from nsa.config import load_run_config
    from nsa.errors import ConfigError

    config = tmp_path / "long.yaml"
    config.write_text("train:\n  seed: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="Exceeds the limit"):
        load_run_config(str(config), environ={})
    with pytest.raises(ConfigError, match=r"NSA_SEED='9+\.\.\. \(5,000 characters\)") as err:
        load_run_config("tiny", environ={"NSA_SEED": "9" * 5000})
    assert len(err.value.one_line()) < 400


# also rough: two operators halting at once both stay on record ----------------------------------------------


def test_concurrent_halt_requests_keep_every_reason(tmp_path: Path) -> None:
    import subprocess
    import sys
    import threading

    from nsa.rundir.layout import read_halt
    from nsa.runs.halt import write_halt
    from tests.conftest import clean_env, write_run

    run = write_run(tmp_path / "run", steps=10, end=None, seed=57)
    procs = [subprocess.Popen([sys.executable, "-m", "nsa_cli", "halt", str(run), "--reason", reason],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for reason in ("node maintenance", "preempted by the scheduler")]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    record = read_halt(run)
    assert record is not None
    assert sorted(r["reason"] for r in record["requests"]) == ["node maintenance", "preempted by the scheduler"]
    assert sorted(record["reason"].split("; ")) == ["node maintenance", "preempted by the scheduler"]
    # many writers at once (threads: each its own lock holder): none lost
    (run / ".HALT").unlink()
    threads = [threading.Thread(target=write_halt, args=(run, f"reason {i}")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = read_halt(run)
    assert record is not None and sorted(r["reason"] for r in record["requests"]) == [f"reason {i}" for i in range(8)]
