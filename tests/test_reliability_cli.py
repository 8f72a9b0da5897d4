"""Reliability of the CLI edges: ``nsa report`` exit codes and output paths, ``nsa halt`` on a read-only
run directory, booleans refused for numeric config fields, and ``NSA_*`` settings read only from the
mapping given."""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from nsa.config import ModelConfig, NSAConfig, RunConfig, RuntimeConfig, load_run_config
from nsa.config.data import DataConfig
from nsa.config.settings import NSASettings, read_settings
from nsa.config.train import OptimizerConfig, TrainConfig
from nsa.errors import ConfigError
from nsa_cli.app import app
from tests.conftest import dead_pid, write_run

runner = CliRunner()


def read_only(folder: Path, monkeypatch: pytest.MonkeyPatch, err: int = errno.EACCES) -> None:
    """Make ``folder`` read-only (0o555). Where that does not stop writes (root), simulate it: creating a
    file or folder inside raises ``OSError(err)``."""
    folder.chmod(0o555)
    probe = folder / ".probe"
    try:
        probe.write_text("x")
    except PermissionError:
        return
    probe.unlink()
    inside = folder.resolve()

    def refuse(path: Path) -> None:
        if path.resolve().parent == inside or inside in path.resolve().parents:
            raise OSError(err, os.strerror(err), str(path))

    real_write, real_mkdir = Path.write_text, Path.mkdir

    def write_text(self: Path, *args: Any, **kwargs: Any) -> int:
        refuse(self)
        return real_write(self, *args, **kwargs)

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if not self.exists():
            refuse(self)
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(Path, "mkdir", mkdir)


@pytest.fixture
def restore_mode(tmp_path: Path) -> Iterator[None]:
    """Give write permission back so that tmp_path can be cleaned up."""
    yield
    for p in [tmp_path, *tmp_path.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755)


def one_error_line(res: Any) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return str(lines[0])


# ------------------------------------------------------------------------------------- A: exit codes


def test_report_exit_1_on_fail_0_otherwise(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    crashed = write_run(tmp_path / "crashed", end=None, pid=dead_pid(), seed=1)
    failed = write_run(tmp_path / "failed", end="failed", seed=2)
    ok = write_run(tmp_path / "ok", seed=3)
    running = write_run(tmp_path / "running", end=None, seed=4)
    res = runner.invoke(app, ["report", str(crashed), "--out", str(out), "--no-charts"])
    assert res.exit_code == 1 and "FAIL" in res.stdout and "report:" in res.stdout, res.output
    res = runner.invoke(app, ["report", str(failed), "--out", str(out), "--no-charts", "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["verdict"] == "FAIL" and data["runs"][0]["verdict"] == "FAIL" and Path(data["path"]).is_file()
    res = runner.invoke(app, ["report", str(ok), str(failed), "--out", str(out), "--no-charts"])
    assert res.exit_code == 1, res.output  # one failed run fails the report
    for run, verdict in ((ok, "PASS"), (running, "RUNNING")):
        res = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-charts", "--json"])
        assert res.exit_code == 0 and json.loads(res.stdout)["verdict"] == verdict, res.output


# ------------------------------------------------------------------------------- B: report output path


def test_report_existing_out_file_needs_force(tmp_path: Path) -> None:
    run = write_run(tmp_path / "ok", seed=5)
    target = tmp_path / "rep" / "daily.md"
    target.parent.mkdir()
    target.write_text("keep me\n")
    res = runner.invoke(app, ["report", str(run), "--out", str(target), "--no-charts"])
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert str(target) in line and "--force" in line
    assert target.read_text() == "keep me\n"
    res = runner.invoke(app, ["report", str(run), "--out", str(target), "--force", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["path"] == str(target) and all(Path(p).is_file() for p in data["images"])
    assert "**Overall verdict: PASS**" in target.read_text()
    assert sorted(p.name for p in target.parent.iterdir()) == ["assets", "daily.md"]  # no temporary file left
    other = tmp_path / "notes.txt"  # an existing file, whatever its suffix
    other.write_text("x")
    res = runner.invoke(app, ["report", str(run), "--out", str(other), "--no-charts"])
    assert res.exit_code == 2 and "--force" in one_error_line(res) and other.read_text() == "x"


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS])
@pytest.mark.parametrize("charts", [False, True])
def test_report_unwritable_out_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_mode: None, err: int, charts: bool
) -> None:
    run = write_run(tmp_path / "ok", seed=6)
    out = tmp_path / "ro"
    out.mkdir()
    read_only(out, monkeypatch, err)
    for dest in (out, out / "sub", out / "daily.md"):
        res = runner.invoke(app, ["report", str(run), "--out", str(dest), *([] if charts else ["--no-charts"])])
        assert res.exit_code == 2, res.output
        line = one_error_line(res)
        assert f"cannot write the report to {dest}" in line and "--out" in line
    assert list(out.iterdir()) == []  # nothing half-written


def test_report_write_failure_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = write_run(tmp_path / "ok", seed=7)
    target = tmp_path / "rep" / "daily.md"
    target.parent.mkdir()
    target.write_text("old report\n")

    def full_disk(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        with open(self, "w") as fh:  # half of it reaches the disk, then the disk is full
            fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    res = runner.invoke(app, ["report", str(run), "--out", str(target), "--force", "--no-charts"])
    assert res.exit_code == 2 and "No space left" in one_error_line(res), res.output
    assert target.read_text() == "old report\n" and [p.name for p in target.parent.iterdir()] == ["daily.md"]
    folder = tmp_path / "folder"
    res = runner.invoke(app, ["report", str(run), "--out", str(folder), "--no-charts"])
    assert res.exit_code == 2 and f"cannot write the report to {folder}" in one_error_line(res), res.output
    assert list(folder.iterdir()) == []


# ------------------------------------------------------------------------------ C: halt, read-only run


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS])
def test_halt_read_only_run_dir_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_mode: None, err: int
) -> None:
    run = write_run(tmp_path / "r", end=None, seed=8)
    read_only(run, monkeypatch, err)
    before = sorted(p.name for p in run.iterdir())
    res = runner.invoke(app, ["halt", str(run), "--reason", "maintenance"])
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert f"could not write .HALT in {run}: {os.strerror(err)}" in line, line
    assert sorted(p.name for p in run.iterdir()) == before  # no .HALT, no temporary file


def test_watchdog_on_a_read_only_run_dir_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_mode: None
) -> None:
    run = write_run(tmp_path / "r", end=None, seed=9, nonfinite_at=25)
    read_only(run, monkeypatch, errno.EROFS)
    res = runner.invoke(app, ["watch", str(run), "--once", "--halt-on", "nonfinite"])
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert "watchdog rule nonfinite fired but could not write .HALT" in line, line
    assert not (run / ".HALT").exists()


# ---------------------------------------------------------------------------- D: no bools for numbers


def _numeric_fields() -> list[tuple[str, str]]:
    out = []
    for section, info in RunConfig.model_fields.items():
        model = info.annotation
        for key, field in model.model_fields.items():  # type: ignore[union-attr]
            if re.search(r"\b(int|float)\b", str(field.annotation)):
                out.append((section, key))
    return out


def test_every_numeric_field_refuses_booleans() -> None:
    fields = _numeric_fields()
    assert {("train", "steps"), ("optimizer", "lr"), ("model", "dim"), ("nsa", "gate_bias"), ("nsa", "fixed_gates"),
            ("data", "prefetch_depth"), ("model", "norm_eps"), ("nsa", "gate_scale")} <= set(fields)
    for section, key in fields:
        for raw in ("true", "false"):
            with pytest.raises(ConfigError) as exc:
                load_run_config("tiny", environ={}, sets=[f"{section}.{key}={raw}"])
            msg = exc.value.one_line()
            assert msg.startswith(f"{section}.{key}={raw.title()}: ") and "not a boolean" in msg, msg
            assert f"--set {section}.{key}" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"nsa\.gate_bias=\[0, True, 0\]: .*not a boolean"):
        load_run_config("tiny", environ={}, sets=["nsa.gate_bias=[0, true, 0]"])


def test_numbers_still_validate_and_sections_refuse_bools() -> None:
    res = load_run_config("tiny", environ={}, sets=[
        "train.steps=10", "optimizer.lr=3e-3", "optimizer.grad_clip=1", "nsa.gate_bias=[0, -1, 2.5]",
        "nsa.fixed_gates=[1, 0, 0]", "runtime.compile=true", "data.timeout_s=5",
    ])
    cfg = res.config
    assert cfg.train.steps == 10 and cfg.optimizer.lr == pytest.approx(3e-3) and cfg.runtime.compile is True
    assert cfg.optimizer.grad_clip == 1.0 and isinstance(cfg.optimizer.grad_clip, float) and cfg.data.timeout_s == 5.0
    assert cfg.nsa.gate_bias == (0.0, -1.0, 2.5) and cfg.nsa.fixed_gates == (1.0, 0.0, 0.0)
    assert RuntimeConfig(compile=True, tf32=False).compile is True  # real booleans are untouched
    for make in (lambda: ModelConfig(dim=True), lambda: NSAConfig(w=False), lambda: NSAConfig(gate_scale=True),
                 lambda: OptimizerConfig(lr=True), lambda: TrainConfig(steps=True),
                 lambda: DataConfig(prefetch_depth=False)):
        with pytest.raises(ValidationError, match="not a boolean"):
            make()
    cfg = RunConfig()
    with pytest.raises(ValidationError, match="not a boolean"):
        cfg.train.steps = True
    with pytest.raises(ValidationError, match="not a boolean"):
        NSASettings.model_validate({"steps": True})


def test_cli_bool_for_int_in_config_file_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"train": {"steps": True}}))
    res = runner.invoke(app, ["profiles", "show", "cpu", "--config", str(cfg)], env={"NSA_STEPS": None})
    assert res.exit_code == 2, res.output
    line = one_error_line(res)
    assert "train.steps=True" in line and "not a boolean" in line and "bad.yaml" in line


# ------------------------------------------------------------------------- E: explicit environ only


def test_explicit_environ_is_the_only_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSA_STEPS", "5")
    monkeypatch.setenv("NSA_PREFETCH_DEPTH", "7")
    monkeypatch.setenv("NSA_ATTN_BACKEND", "torch")
    empty = read_settings({})
    assert empty.model_dump(exclude_none=True) == {}
    assert read_settings({"NSA_STEPS": "3"}).model_dump(exclude_none=True) == {"steps": 3}
    res = load_run_config("tiny", environ={})
    assert not any(src.startswith("env") for src in res.sources.values()), res.sources
    default = load_run_config("tiny", environ={"NSA_SEED": "1"})
    assert default.config.data.prefetch_depth == DataConfig().prefetch_depth
    assert default.source_of("train.seed") == "env NSA_SEED" and default.source_of("train.steps") != "env NSA_STEPS"
    # environ=None still means the process environment
    assert read_settings().steps == 5 and read_settings(None).prefetch_depth == 7
    live = load_run_config("tiny")
    assert live.config.train.steps == 5 and live.source_of("data.prefetch_depth") == "env NSA_PREFETCH_DEPTH"
