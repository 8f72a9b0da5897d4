"""Signals from a scheduler (issue 57, defects 2 and 4): ``uv run nsa train`` started in a session of its own, as
a batch job is, and signals sent to its process group (``kill -TERM -PGID``, ``timeout``, a preemption): they reach
``uv`` and the trainer, and ``uv`` forwards each once more (SIGTERM at once, SIGINT 200 ms later). One request must
be one halt: a halt checkpoint, the end event ``halted``, exit 0, on one rank and under torchrun; a third Ctrl-C
during a checkpoint write (here: ``torch.save`` made slow by a wrapper) stops cleanly, recorded ``interrupted``.
Tiny CPU runs (seq 32, batch 2, seed 0); skipped where ``uv`` is not installed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from nsa.rundir.checkpoints import newest_verified

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")
pytestmark = pytest.mark.skipif(UV is None, reason="needs uv (the probe runs `uv run nsa train`)")
TINY = ["--config", "tiny", "--seq-len", "32", "--batch-size", "2", "--seed", "0", "--steps", "5000",
        "--set", "logging.every=1", "--set", "eval.every=0", "--set", "checkpoint.every=0"]

# `python WRAPPER MARKER SECONDS train ...`: nsa's CLI with torch.save made slow (SECONDS inside its third write
# of bytes, after MARKER is created), so that signals arrive while the checkpoint is being written
SLOW_SAVE = """
import sys, time
from pathlib import Path
import nsa.train.checkpoint as ckpt
marker, seconds = Path(sys.argv.pop(1)), float(sys.argv.pop(1))
real, writes = ckpt._HashingWriter.write, []
def write(self, data):
    writes.append(1)
    if len(writes) == 3:
        marker.touch()
        time.sleep(seconds)
    return real(self, data)
ckpt._HashingWriter.write = write
from nsa_cli.app import main
sys.argv[0] = "nsa"
main()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NSA_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _start(*argv: str) -> subprocess.Popen[str]:
    """``uv run ...`` in a new session (its own process group, as a batch job)."""
    assert UV is not None
    return subprocess.Popen([UV, "run", "--offline", "--no-sync", *argv], cwd=ROOT, env=_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _events(run: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run / f"heartbeat_rank{rank}.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


def _wait(proc: subprocess.Popen[str], ready: Any, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise AssertionError(f"not ready (rc {proc.returncode}): {err[-3000:]}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return err


def _stepping(run: Path, step: int = 3) -> Any:
    return lambda: any(e["event"] == "progress" and e["step"] >= step for e in _events(run))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_2_one_signal_to_the_group_of_uv_run_is_one_halt(tmp_path: Path, sig: signal.Signals) -> None:
    """The halt checkpoint takes 2 s to write: uv's copy of a SIGINT arrives during it (read as Ctrl-C twice
    before: the run stopped without finishing its halt and exited 130)."""
    run = tmp_path / "run"
    proc = _start("python", "-c", SLOW_SAVE, str(tmp_path / "saving"), "2", "train", *TINY, "--out-dir", str(run))
    _wait(proc, _stepping(run))
    os.killpg(proc.pid, sig)
    err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "Ctrl-C again:" not in err, err[-3000:]
    assert f"{sig.name} received: halting after this step with a checkpoint" in err
    if sig == signal.SIGINT:  # uv's copy, 200 ms later, during the 2 s write
        assert "SIGINT again within 1 s: the same request" in err, err[-3000:]
    evs = _events(run)
    assert [e["event"] for e in evs[-3:]] == ["checkpoint", "halt", "end"], evs[-3:]
    assert evs[-1]["status"] == "halted" and evs[-2]["source"] == sig.name
    newest, _ = newest_verified(run)
    assert newest is not None and newest.name == f"step_{evs[-1]['step']:08d}"


@pytest.mark.slow
def test_4_a_third_sigint_to_the_group_during_a_checkpoint_write_stops_cleanly(tmp_path: Path) -> None:
    """Three SIGINTs to the group, 1.5 s apart, each with uv's copy: the halt request, 'stop after the write'
    while the halt checkpoint is written, and 'drop it', inside torch.save. Exit 130, one line, no traceback,
    recorded as interrupted (not a failed RuntimeError), the partial checkpoint gone."""
    run, marker = tmp_path / "run", tmp_path / "saving"
    proc = _start("python", "-c", SLOW_SAVE, str(marker), "30", "train", *TINY, "--out-dir", str(run))
    _wait(proc, _stepping(run))
    os.killpg(proc.pid, signal.SIGINT)
    _wait(proc, marker.exists)
    for _ in range(2):  # each later than SAME_REQUEST_S after the one before: a request of its own, not a copy
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)
    err = _finish(proc)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "enforce fail" not in err, err[-3000:]
    assert "Ctrl-C again: stopping now, dropping the partial checkpoint" in err
    assert err.strip().splitlines()[-1].startswith("interrupted at step "), err[-1000:]
    assert err.strip().splitlines()[-1].endswith("(Ctrl-C twice): recorded as interrupted; no checkpoint to resume "
                                                 "from")
    end = _events(run)[-1]
    assert end["event"] == "end" and end["status"] == "interrupted", end
    assert json.loads((run / "metrics.json").read_text())["status"] == "interrupted"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@pytest.mark.slow
def test_2_sigint_to_the_group_of_a_two_rank_run_halts_both_and_exits_0(tmp_path: Path) -> None:
    """``uv run nsa train --nproc-per-node 2`` (gloo ranks): the launcher and uv get the SIGINT, uv forwards its
    copy 200 ms later; before, that copy terminated torchrun (exit 1, its SignalException traceback)."""
    run = tmp_path / "run"
    proc = _start("nsa", "train", *TINY, "--nproc-per-node", "2", "--out-dir", str(run))
    _wait(proc, _stepping(run))
    os.killpg(proc.pid, signal.SIGINT)
    err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "SIGINT: asked 2 rank(s) to halt" in err
    steps = []
    for rank in (0, 1):
        evs = _events(run, rank)
        assert [e["event"] for e in evs[-2:]] == ["halt", "end"] and evs[-1]["status"] == "halted", evs[-3:]
        steps.append(evs[-1]["step"])
    assert steps[0] == steps[1]
    newest, _ = newest_verified(run)
    assert newest is not None and newest.name == f"step_{steps[0]:08d}"
