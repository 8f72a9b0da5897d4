"""``nsa preflight`` through Typer's runner and as a real subprocess, on this CPU machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nsa_cli.app import app
from tests.conftest import nsa

runner = CliRunner()


def test_preflight_cpu_profile_passes_with_warnings(tmp_path) -> None:
    res = runner.invoke(app, ["preflight", "--profile", "cpu", "--config", "tiny", "--out-dir", str(tmp_path), "--json"],
                        env={"NSA_ATTN_BACKNED": "torch"})
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert data["ok"] and "FAIL" not in status.values()
    assert status["env"] == "WARN"
    env_check = next(c for c in data["checks"] if c["name"] == "env")
    assert "NSA_ATTN_BACKNED" in env_check["reason"] and "NSA_ATTN_BACKEND" in env_check["reason"]
    for name in ("python", "torch", "config", "nsa-parity", "disk", "ram", "dataset", "tokenizer"):
        assert status[name] == "PASS", (name, data["checks"])
    for name in ("triton", "flash-attn", "gpu", "bf16", "triton-compile", "sdpa-backends", "git"):
        assert status[name] in ("PASS", "WARN")
    assert all(c["reason"] for c in data["checks"])
    assert data["facts"]["versions"]["python"]


def test_preflight_subprocess_table_and_exit_code() -> None:
    res = nsa("preflight", "--profile", "cpu")
    assert res.returncode == 0, res.stderr
    assert "nsa-parity" in res.stdout and "PASS" in res.stdout and "WARN" in res.stdout
    assert "\x1b[" not in res.stdout  # not a terminal: no colour codes


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_preflight_gpu_profile_fails_without_gpu() -> None:
    res = runner.invoke(app, ["preflight", "--profile", "h100-80g", "--json"], env={"NSA_DEVICE": None, "NSA_PROFILE": None})
    assert res.exit_code == 1
    status = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert status["gpu"]["status"] == "FAIL" and status["gpu"]["hint"]


def test_preflight_usage_errors_are_one_line() -> None:
    res = nsa("preflight", "--profile", "no-such-profile")
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: profile 'no-such-profile' not found (hint:")
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    res = runner.invoke(app, ["preflight", "--config", "nope.yaml"])
    assert res.exit_code == 2 and "config 'nope.yaml' not found" in res.output


def test_invalid_config_is_a_fail_not_a_crash(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nsa:\n  l: 30\n  d: 16\n")
    res = runner.invoke(app, ["preflight", "--config", str(bad), "--json"])
    assert res.exit_code == 1
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["config"]["status"] == "FAIL" and "nsa.d=16 must divide nsa.l=30" in checks["config"]["reason"]


def test_layout_check_counts_gpus_and_their_links_for_the_context_layout() -> None:
    """``nsa preflight`` judges the data x context layout against the node's GPUs and NVML's peer-to-peer
    status of the pairs that would share a sequence (faked probes: this machine has no GPU)."""
    from nsa.checks.preflight import _check_layout, _Context
    from nsa.checks.result import Status
    from nsa.config import load_run_config
    from nsa.gpuinfo import GpuInfo, GpuProbe

    def check(n: int, cp: int, links: dict[str, str], device: str = "cuda") -> tuple[Status, str]:
        sets = [f"runtime.context_parallel={cp}", f"runtime.device={device}"]
        ctx = _Context(None, load_run_config("tiny", environ={}, sets=sets), {}, Path("."))
        ctx.gpu_probe = GpuProbe(True, gpus=[GpuInfo(i, "H100", 80e3, 80e3) for i in range(n)], links=links)
        c = _check_layout(ctx)
        return c.status, c.reason

    nv4 = {f"{i}-{j}": "nvlink" for i in range(4) for j in range(i + 1, 4)}
    assert check(4, 2, nv4) == (Status.PASS, "4 GPUs (2 data x 2 context with --nproc-per-node 4), NVLink")
    status, said = check(2, 4, {"0-1": "nvlink"})
    assert status is Status.FAIL and "needs 4 GPUs of one node; 2 visible" in said
    status, said = check(4, 2, {**nv4, "2-3": "none"})
    assert status is Status.WARN and "2-3" in said and "host memory" in said
    assert check(4, 2, {**nv4, "0-2": "none"})[0] is Status.PASS  # 0 and 2 never share a sequence
    assert check(1, 1, {})[0] is Status.PASS
    status, said = check(0, 2, {})
    assert status is Status.FAIL and "none visible" in said
    assert check(0, 2, {}, device="cpu")[0] is Status.PASS
