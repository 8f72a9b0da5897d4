"""``nsa train`` as a process: SIGUSR1/SIGUSR2, SIGKILL and resume with identical losses, and a
two-rank gloo run through ``--nproc-per-node`` (torchrun) halted by SIGTERM."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nsa.rundir.checkpoints import latest_checkpoint
from nsa.runs.dump import dump_stacks
from nsa.train.checkpoint import load_state

TINY = ["--config", "tiny", "--seq-len", "32", "--batch-size", "2", "--set", "logging.every=1",
        "--set", "schedule.warmup_steps=2", "--set", "runtime.deterministic=true"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NSA_")}
    # one intra-op thread per process: tiny shapes gain nothing from more, and oversubscribed OpenMP
    # threads on a busy CI machine slow every step many times over
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return env


def cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nsa_cli", "train", *TINY, *args]


def events(run: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run / f"heartbeat_rank{rank}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


def wait_for(run: Path, pred: Any, proc: subprocess.Popen[bytes], timeout: float = 120) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in events(run):
            if pred(e):
                return e
        if proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) before the awaited event")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out waiting for a heartbeat event")


def losses(run: Path) -> list[tuple[str, str, str, str]]:
    with open(run / "training.csv", newline="") as f:
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in csv.DictReader(f)]


def run_ok(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def run_all_ok(*commands: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Independent runs started together (a launch is mostly one process importing torch: two of them use
    both cores of a small machine); each must exit 0."""
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    out = []
    try:
        for c, p in zip(commands, procs, strict=True):
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
            out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.slow
def test_sigusr_then_sigkill_then_resume_reproduces_the_losses(tmp_path: Path) -> None:
    """SIGUSR1 dumps stacks, SIGUSR2 checkpoints and continues; after a SIGKILL, ``--resume auto``
    continues from the newest complete checkpoint and logs exactly the losses of an uninterrupted run."""
    steps = ["--steps", "24", "--set", "checkpoint.every=5", "--set", "eval.every=0"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    proc = subprocess.Popen(cmd(*steps, "--out-dir", str(cut)), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(cut, lambda e: e["event"] == "progress" and e["step"] >= 2, proc)
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGUSR2)
        saved = wait_for(cut, lambda e: e["event"] == "checkpoint" and e["reason"] == "signal", proc)
        wait_for(cut, lambda e: e["event"] == "progress" and e["step"] >= saved["step"] + 2, proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    dump = (cut / "stackdump_rank0.txt").read_text()
    assert "most recent call first" in dump and "nsa" in dump
    killed_at = max(e["step"] for e in events(cut) if e["event"] == "progress")
    assert killed_at < 24, "the run finished before it could be killed"
    assert not any(e["event"] == "end" for e in events(cut))
    newest = latest_checkpoint(cut)
    assert newest is not None and int(newest.name.split("_")[1]) >= saved["step"]

    _, res = run_all_ok(cmd(*steps, "--out-dir", str(ref)), cmd(*steps, "--out-dir", str(cut), "--resume", "auto"))
    assert "resumed from" in res.stdout
    boots = [e for e in events(cut) if e["event"] == "boot"]
    assert len(boots) == 2 and boots[1]["resumed_from"] == str(newest)
    assert losses(cut) == losses(ref)
    assert [int(r[0]) for r in losses(ref)] == list(range(1, 25))


@pytest.mark.slow
def test_two_rank_gloo_run_halted_through_the_launcher(tmp_path: Path) -> None:
    """``--nproc-per-node 2`` runs torchrun (gloo on CPU); ``nsa dump`` gets the stacks of both ranks; SIGTERM
    to the launcher halts both ranks
    at the same step with one checkpoint holding both ranks' data positions, and exits 0."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        cmd("--nproc-per-node", "2", "--steps", "500", "--accum", "2", "--set", "checkpoint.every=2",
            "--set", "eval.every=2", "--set", "eval.batches=1", "--out-dir", str(run)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        wait_for(run, lambda e: e["event"] == "eval" and e["step"] >= 2, proc, timeout=240)
        dumped = dump_stacks(run, timeout_s=60)  # `nsa dump`: rank 0 from RUN/.lock, rank 1 from its boot line
        assert dumped.ok and sorted(dumped.pids) == [0, 1] and "most recent call first" in dumped.text, dumped
        deadline = time.time() + 30
        while (run / "stackdump_rank1.txt").stat().st_size == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert "most recent call first" in (run / "stackdump_rank1.txt").read_text()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert b"torch.distributed.run" in err
    ends = []
    for rank in (0, 1):
        evs = events(run, rank)
        assert evs[0]["event"] == "boot" and evs[0]["world_size"] == 2 and evs[0]["rank"] == rank
        assert evs[-1]["event"] == "end" and evs[-1]["status"] == "halted"
        assert evs[-2]["event"] == "halt" and evs[-2]["source"] == "SIGTERM"
        ends.append(evs[-1]["step"])
    assert ends[0] == ends[1]
    p0 = [e for e in events(run, 0) if e["event"] == "progress"]
    p1 = [e for e in events(run, 1) if e["event"] == "progress"]
    assert [e["loss"] for e in p0] == [e["loss"] for e in p1]  # the global mean, agreed by all ranks
    assert p0[-1]["tokens_seen"] == p0[-1]["step"] * 2 * 2 * 32 * 2
    assert sorted(p.name for p in run.glob("*.csv")) == ["training.csv", "val.csv"]
    state = load_state(latest_checkpoint(run))
    assert state["train_state"]["step"] == ends[0]
    assert len(state["loader"]) == 2 and state["loader"][0] != state["loader"][1] and len(state["rng"]) == 2
    m = json.loads((run / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["status"] == "halted"
    assert all(torch.isfinite(t).all() for t in state["model"].values())
