"""``nsa smoke``: the verdict criteria on hand-made summaries, and a short real smoke on this CPU."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from nsa.checks.result import Status
from nsa.checks.smoke import detect_profile, parity_checks, verdict_checks
from nsa.config.profiles import load_profile
from nsa.runs.reader import read_run
from nsa.runs.summary import summarize
from nsa_cli.app import app
from tests.conftest import nsa, write_run

runner = CliRunner()


def statuses(run, smoke, status="completed"):
    s = summarize(read_run(run), time.time())
    return {c.name: c.status for c in verdict_checks(s, smoke, status, time.time())}


def test_verdict_criteria(tmp_path) -> None:
    smoke = load_profile("cpu").smoke
    good = statuses(write_run(tmp_path / "good", tokens_per_s=5000.0), smoke)
    assert set(good.values()) == {Status.PASS}, good
    assert set(good) == {"run-completed", "loss-decreased", "finite", "tokens-per-s", "fetch-p95", "gate-health",
                         "fallbacks", "heartbeat"}
    cases = {
        "tokens-per-s": {"tokens_per_s": smoke.min_tokens_per_s / 4},
        "fetch-p95": {"fetch_p95_ms": smoke.max_fetch_p95_ms * 3},
        "gate-health": {"collapse": 0.95},
        "fallbacks": {"fallback": {"nsa_attention:triton->torch:shape": 3}},
        "finite": {"nonfinite_at": 30},
        "heartbeat": {"ts0": time.time() - 5000},
    }
    for name, kw in cases.items():
        got = statuses(write_run(tmp_path / name, **{"tokens_per_s": 5000.0, **kw}), smoke)
        assert got[name] == Status.FAIL, (name, got)
    assert statuses(write_run(tmp_path / "f"), smoke, "failed")["run-completed"] == Status.FAIL


@pytest.mark.parametrize("seed", [0, 7])
def test_parity_checks_every_backend_on_cpu(seed: int) -> None:
    """One check per backend this CPU serves (the reference aside), each over every shape, all PASS."""
    from nsa.checks.smoke import SHAPES
    from nsa.ops.dispatch import available_backends

    checks = parity_checks("cpu", seed=seed)
    backends = [b for b in available_backends("cpu") if b != "reference"]
    assert backends and [c.name for c in checks] == [f"parity-{b}-float32" for b in backends]
    assert all(c.status is Status.PASS for c in checks), [c.reason for c in checks]
    for c in checks:
        assert [r["shape"] for r in c.details["results"]] == list(SHAPES), c.details
    import torch

    if not torch.cuda.is_available():
        assert detect_profile() == "cpu"


@pytest.mark.slow
def test_short_smoke_on_cpu_subprocess(tmp_path) -> None:
    res = nsa("smoke", "--steps", "6", "--skip-preflight", "--out-dir", str(tmp_path / "smoke"), "--json", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(res.stdout)
    got = {c["name"]: c["status"] for c in data["checks"]}
    assert data["facts"]["profile"] == "cpu"  # detected: no CUDA here
    assert got["loss-decreased"] == "PASS" and got["run-completed"] == "PASS" and "preflight" not in got
    assert "FAIL" not in got.values() and any(k.startswith("parity-torch") for k in got)
    assert (tmp_path / "smoke" / "heartbeat_rank0.jsonl").is_file()


@pytest.mark.slow
def test_smoke_through_typer_runner(tmp_path) -> None:
    res = runner.invoke(app, ["smoke", "--profile", "cpu", "--steps", "6", "--out-dir", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert "preflight" in res.output and "run-completed" in res.output and "loss-decreased" in res.output and "PASS" in res.output


def test_smoke_usage_error() -> None:
    res = runner.invoke(app, ["smoke", "--profile", "quantum-9000"])
    assert res.exit_code == 2 and "profile 'quantum-9000' not found" in res.output
