"""Faults around the trainer and its run directory (issue "Reliability"): one writer per directory,
.HALT of every shape, verified checkpoints, read-only and full disks, resume with other --steps, the
allocator setting. Tiny CPU runs (seq 32, batch 2): each takes seconds."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nsa.errors import CheckpointError, ConfigError, RunDirError
from nsa.rundir.checkpoints import newest_verified, verify
from nsa.train import checkpoint as ckpt
from nsa.train import rundir
from nsa.train.schedule import lr_multiplier
from nsa.train.trainer import Trainer
from nsa_cli.app import app
from tests.conftest import clean_env, csv_rows, events, halt_at, nan_loss_at, nsa, quiet, resolve

runner = CliRunner()


def _train(run: Path, steps: int, step_hook=None, **extra: object):
    return Trainer(resolve(run, steps, eval__every=0, **extra), reporter=quiet(), step_hook=step_hook).fit()


def _corrupt_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


# 1. one writer per run directory --------------------------------------------------------------------


def _lock_holder(run: Path) -> subprocess.Popen[str]:
    """Another process holding the run's lock (what a running trainer does)."""
    code = (f"import sys, time; from nsa.train.lock import RunLock; RunLock({str(run)!r}).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=clean_env())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_and_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _lock_holder(run)
    try:
        with pytest.raises(RunDirError, match=f"in use by PID {holder.pid} on ") as err:
            _train(run, 3)
        assert "nsa halt" in (err.value.hint or "")
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # no heartbeat, csv or checkpoint
        res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "3", "--out-dir", str(run),
                                  "--resume", "auto"], env={})
        assert res.exit_code == 2 and f"PID {holder.pid}" in res.output and len(res.output.strip().splitlines()) == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel dropped the killed holder's lock: nothing stale to clean up
    assert _train(run, 3).status == "completed"


def test_a_live_run_refuses_a_second_trainer_and_stays_whole(tmp_path: Path) -> None:
    """The issue's case: `nsa train --resume auto` while a run is going; watch and halt keep working."""
    run = tmp_path / "live"
    first = subprocess.Popen(
        [sys.executable, "-m", "nsa_cli", "train", "--config", "tiny", "--steps", "2000", "--out-dir", str(run),
         "--seq-len", "32", "--batch-size", "2", "--set", "logging.every=1", "--set", "eval.every=0",
         "--set", "checkpoint.every=5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        deadline = time.time() + 120
        while not ((run / "heartbeat_rank0.jsonl").exists() and len(list(ckpt.list_checkpoints(run))) >= 1):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = nsa("train", "--config", "tiny", "--steps", "2000", "--out-dir", str(run), "--seq-len", "32",
                     "--batch-size", "2", "--resume", "auto")
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"PID {first.pid}" in second.stderr and len(second.stderr.strip().splitlines()) == 1
        assert nsa("watch", str(run), "--once").returncode in (0, 1)
        halted = nsa("halt", str(run), "--reason", "test", "--wait", "--timeout", "120", "--json")
        assert halted.returncode == 0, halted.stdout + halted.stderr
        assert first.wait(timeout=60) == 0
    finally:
        if first.poll() is None:
            first.kill()
    steps = [int(r["step"]) for r in csv_rows(run / "training.csv")]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved steps
    assert {e["pid"] for e in events(run)} == {first.pid}


# 2. .HALT of every shape ------------------------------------------------------------------------------


@pytest.mark.parametrize(("payload", "reason"), [
    (b'{"reason": "disk swap", "who": "ops"}', "disk swap"),
    (b"plain words\n", "plain words"),
    (b"", "halt file"),
    (b'{"reason": "cut sho', '{"reason": "cut sho'),
    (b"\xff\xfe\x00 not utf-8 \x80", "\ufffd\ufffd\x00 not utf-8 \ufffd"),
    (b"x" * 5000, "x" * 500),
])
def test_halt_file_of_any_shape_gives_a_reason(tmp_path: Path, payload: bytes, reason: str) -> None:
    (tmp_path / ".HALT").write_bytes(payload)
    assert rundir.halt_request(tmp_path, settle_s=0.05)[0] == reason


def test_a_non_utf8_halt_file_halts_with_a_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = Trainer(resolve(run, 40, eval__every=0, checkpoint__every=0), reporter=quiet(),
                     step_hook=halt_at(run, 2, b"\xff\xfe stop \x80")).fit()
    assert result.status == "halted" and result.steps_done == 3
    halt = next(e for e in events(run) if e["event"] == "halt")
    assert "stop" in halt["reason"] and verify(Path(halt["checkpoint"])).ok


# 3. verified checkpoints ------------------------------------------------------------------------------


def test_a_checkpoint_corrupted_in_place_is_skipped_by_resume_and_loaders(tmp_path: Path) -> None:
    from nsa.model.load import find_weights

    run = tmp_path / "run"
    _train(run, 6, checkpoint__every=2)
    newest = run / "checkpoints" / "step_00000006"
    size = (newest / "state.pt").stat().st_size
    _corrupt_same_size(newest / "state.pt")
    assert (newest / "state.pt").stat().st_size == size and ckpt.is_complete(newest)  # sizes alone miss it
    assert not verify(newest).ok and "checksum mismatch" in verify(newest).reason
    found, skipped = newest_verified(run)
    assert found == run / "checkpoints" / "step_00000004" and [v.path for v in skipped] == [newest]
    # nsa sample / load_model: the newest that verifies (exports win, so take the export away)
    (run / "export" / "model.safetensors").unlink()
    assert find_weights(run)[0] == run / "checkpoints" / "step_00000004" / "state.pt"
    incomplete = run / "checkpoints" / "step_00000009"  # a save cut short: state.pt without manifest
    incomplete.mkdir()
    (incomplete / "state.pt").write_bytes(b"cut short")
    assert find_weights(run)[0] == run / "checkpoints" / "step_00000004" / "state.pt"
    assert [v.path.name for v in newest_verified(run)[1]] == ["step_00000009", "step_00000006"]
    (incomplete / "state.pt").unlink()
    incomplete.rmdir()
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        find_weights(newest)
    # an explicit resume of the corrupted one is refused; auto walks back and says so
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        Trainer(resolve(run, 8, train__resume=str(newest)), reporter=quiet())
    out = Trainer(resolve(run, 8, train__resume="auto", eval__every=0), reporter=quiet())
    assert out.resume_from == run / "checkpoints" / "step_00000004"
    result = out.fit()
    assert result.status == "completed" and result.steps_done == 8 and math_finite(result.final_loss)
    assert "skipped checkpoint step_00000006" in out.reporter.text()  # type: ignore[union-attr]


def math_finite(x: float | None) -> bool:
    return x is not None and x == x and abs(x) != float("inf")


def test_the_last_good_checkpoint_of_an_anomaly_is_one_that_verifies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, 4, checkpoint__every=2)
    _corrupt_same_size(run / "checkpoints" / "step_00000004" / "state.pt")
    result = _train(run, 8, train__resume="auto", checkpoint__every=0, step_hook=nan_loss_at(6))
    assert result.status == "failed"
    record = json.loads((run / "anomalies" / "step_6.json").read_text())
    assert record["last_good_checkpoint"] == str(run / "checkpoints" / "step_00000002")


def test_old_checkpoints_without_checksums_still_load(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 3, {"w": torch.arange(4.0)})
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["sha256"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    verdict = verify(path)
    assert verdict.ok and "no checksums" in verdict.reason
    assert ckpt.resolve_resume(tmp_path, "auto") == path


# 4. read-only and full disks --------------------------------------------------------------------------


def _read_only_namespace() -> str | None:
    """Why a read-only mount cannot be made here (None: ``unshare`` gives this test a private mount
    namespace in which a read-only tmpfs can be mounted without privileges)."""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt"],
                           capture_output=True, text=True, check=False) if shutil.which("unshare") else None
    if probe is None:
        return "no unshare command"
    return None if probe.returncode == 0 else f"no private mount namespace ({probe.stderr.strip()[:80]})"


def test_an_unwritable_out_dir_is_one_line_before_any_work(tmp_path: Path) -> None:
    """A real read-only filesystem (a read-only tmpfs in a private mount namespace): the trainer and the
    CLI refuse it before any work, naming it as such; a file in the way is refused too."""
    why = _read_only_namespace()
    if why is not None:
        pytest.skip(f"cannot mount a read-only filesystem here: {why}")
    ro = tmp_path / "ro"
    ro.mkdir()
    check = (
        "import sys\n"
        "from nsa.errors import RunDirError\n"
        "from nsa.train.trainer import Trainer\n"
        "from tests.conftest import quiet, resolve\n"
        f"ro = {str(ro)!r}\n"
        "try:\n"
        "    Trainer(resolve(__import__('pathlib').Path(ro) / 'run', 3), reporter=quiet())\n"
        "except RunDirError as exc:\n"
        "    print('TRAINER:', exc.message)\n"
    )
    script = (f"mount -t tmpfs -o ro tmpfs {ro} && {sys.executable} -c {shlex.quote(check)} && "
              f"{sys.executable} -m nsa_cli train --config tiny --steps 3 --out-dir {ro}/run "
              f"> {tmp_path}/cli.txt 2>&1; echo rc=$?")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[1], env=clean_env(), timeout=300)
    out = res.stdout + res.stderr
    assert "TRAINER:" in out and "read-only filesystem" in out.split("TRAINER:", 1)[1].splitlines()[0], out
    cli = (tmp_path / "cli.txt").read_text().strip().splitlines()  # the CLI's whole output: one line
    assert "rc=2" in out and len(cli) == 1 and "cannot be written (read-only filesystem" in cli[0], (out, cli)
    assert not (ro / "run").exists()  # the namespace's mount hid nothing: nothing was written under ro
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        Trainer(resolve(blocker / "run", 3), reporter=quiet())


def _full_disk_after(monkeypatch: pytest.MonkeyPatch, module: object, n_ok: int) -> None:
    """``os.write`` in ``module`` succeeds ``n_ok`` times, then writes half a line and fails ENOSPC."""
    real = os.write
    calls = {"n": 0}

    def write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] <= n_ok:
            return real(fd, data)
        if calls["n"] == n_ok + 1 and len(data) > 1:
            return real(fd, bytes(data[: len(data) // 2]))  # a torn half line, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module.os, "write", write)  # type: ignore[attr-defined]


def test_a_full_disk_tears_no_line_leaves_no_temp_file_and_keeps_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nsa.train.telemetry as telemetry

    run = tmp_path / "run"
    _train(run, 4, checkpoint__every=2)
    _full_disk_after(monkeypatch, telemetry, 12)
    real_replace = os.replace

    def replace(src: object, dst: object) -> None:  # metrics.json cannot be written either
        if str(dst).endswith("metrics.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(telemetry.os, "replace", replace)
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "40", "--out-dir", str(run), "--resume", "auto",
                              "--seq-len", "32", "--batch-size", "2", "--set", "logging.every=1",
                              "--set", "eval.every=0", "--set", "checkpoint.every=2"], env={})
    monkeypatch.undo()
    assert res.exit_code == 1, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error: run failed at step") and "No space left on device" in line
    for name in ("heartbeat_rank0.jsonl", "training.csv"):
        text = (run / name).read_text()
        assert text.endswith("\n"), name  # no torn last line
    for raw in (run / "heartbeat_rank0.jsonl").read_text().splitlines():
        json.loads(raw)
    assert not list(run.glob(".*.tmp-*")) and not list((run / "checkpoints").glob(".tmp-*"))
    assert json.loads((run / "metrics.json").read_text())["status"] == "completed"  # the previous one, whole
    newest, skipped = newest_verified(run)
    assert newest is not None and not skipped
    assert _train(run, newest_step(newest) + 2, train__resume="auto").status == "completed"


def newest_step(path: Path) -> int:
    return int(path.name.split("_")[1])


def test_a_full_disk_during_a_checkpoint_removes_the_partial_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.randn(64, 64)}
    first = ckpt.save_checkpoint(tmp_path, 1, state)

    def full(obj: object, f: object) -> None:
        f.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_checkpoint(tmp_path, 2, state)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert newest_verified(tmp_path) == (first, [])


def test_json_written_atomically_keeps_the_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nsa.train import telemetry

    path = tmp_path / "metrics.json"
    telemetry.write_json_atomic(path, {"status": "completed"})
    monkeypatch.setattr(telemetry.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError):
        telemetry.write_json_atomic(path, {"status": "failed"})
    assert json.loads(path.read_text()) == {"status": "completed"} and sorted(os.listdir(tmp_path)) == ["metrics.json"]


# 6. resume with other --steps -------------------------------------------------------------------------


def test_resume_with_more_steps_uses_the_new_schedule_from_the_first_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, 6, schedule__warmup_steps=2)
    _train(run, 12, schedule__warmup_steps=2, train__resume="auto")
    rows = {int(r["step"]): float(r["lr"]) for r in csv_rows(run / "training.csv")}
    peak = resolve(run, 12).config.optimizer.lr
    min_ratio = resolve(run, 12).config.schedule.min_lr_ratio
    assert rows[7] == pytest.approx(peak * lr_multiplier(6, 12, 2, min_ratio), rel=1e-9)
    assert rows[6] == pytest.approx(peak * lr_multiplier(5, 6, 2, min_ratio), rel=1e-9)


def test_resume_with_fewer_steps_than_done_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, 6)
    with pytest.raises(ConfigError, match=r"train\.steps=4 is below the step of checkpoint .* \(6\)"):
        Trainer(resolve(run, 4, train__resume="auto"), reporter=quiet())
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "4", "--out-dir", str(run), "--resume", "auto"],
                        env={})
    assert res.exit_code == 2 and "--steps above 6" in res.output


# 10. the allocator setting ----------------------------------------------------------------------------


def test_alloc_conf_is_set_before_the_runtime_looks_at_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nsa.train.trainer as trainer_mod

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    seen: dict[str, str | None] = {}
    real = trainer_mod.resolve_runtime

    def spy(cfg: object, local_rank: int = 0) -> object:
        seen["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        return real(cfg, local_rank)  # type: ignore[arg-type]

    monkeypatch.setattr(trainer_mod, "resolve_runtime", spy)
    t = Trainer(resolve(tmp_path / "run", 2, runtime__alloc_conf="expandable_segments:True"), reporter=quiet())
    assert seen["conf"] == "expandable_segments:True" and t.alloc_conf_note is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    t = Trainer(resolve(tmp_path / "run", 2, runtime__alloc_conf="expandable_segments:True"), reporter=quiet())
    assert t.alloc_conf_note is not None and "max_split_size_mb:64" in t.alloc_conf_note
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"  # the user's explicit value stays


def test_sigusr1_dumps_every_thread_without_stopping(tmp_path: Path) -> None:
    """The stack dump runs in its own thread under the GIL (never reads a running thread's frames)."""
    import threading

    from nsa.train.signals import SignalFlags

    busy = threading.Event()

    def worker() -> None:
        while not busy.is_set():
            sum(range(1000))

    t = threading.Thread(target=worker, name="busy-worker", daemon=True)
    t.start()
    flags = SignalFlags()
    dump = tmp_path / "stackdump_rank0.txt"
    flags.install(dump)
    try:
        for _ in range(20):  # repeated dumps while another thread runs: the process survives each
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
        deadline = time.time() + 10
        while "Thread busy-worker" not in dump.read_text() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        flags.uninstall()
        busy.set()
    text = dump.read_text()
    assert "Thread MainThread" in text and "Thread busy-worker" in text and "in worker" in text
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
