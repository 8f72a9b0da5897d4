"""Run-directory files the trainer manages besides telemetry: the writer lock, halt files, config,
anomalies, export."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from nsa.config import ResolvedConfig
from nsa.errors import ConfigError, RunDirError
from nsa.fileio import nearest_existing, surface_os_error
from nsa.model import build_model
from nsa.rundir import RunDir
from nsa.rundir.checkpoints import list_checkpoints, sha256_file
from nsa.rundir.layout import (
    CONFIG_FILE,
    EXPORT_INFO,
    EXPORT_TOKENIZER,
    EXPORT_WEIGHTS,
    read_halt,
)
from nsa.rundir.records import Anomaly, ExportInfo
from nsa.train.telemetry import write_json_atomic


def check_writable(run_dir: Path) -> None:
    """``RunDirError`` naming ``run_dir`` when it (or the folder it would be made in) cannot be written:
    a read-only filesystem, missing permissions, or a file in the way. Creates nothing."""
    probe = nearest_existing(Path(run_dir))
    if probe.exists() and not probe.is_dir():
        raise RunDirError(f"train.out_dir={run_dir}: {probe} is a file, not a directory",
                          hint="choose another --out-dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "read-only filesystem" if _read_only_fs(probe) else "no write permission"
        raise RunDirError(f"train.out_dir={run_dir} cannot be written ({why} at {probe})",
                          hint="choose a writable --out-dir")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_fresh(run_dir: Path) -> None:
    """A run without ``--resume`` must not write into a directory that already holds a run."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"train.out_dir={run_dir} exists and is not a directory")
    if list_checkpoints(run_dir) or RunDir(run_dir).train_csv.exists():
        raise ConfigError(
            f"train.out_dir={run_dir} already holds a run",
            hint="pass --resume auto to continue it, or choose a new --out-dir",
        )


def halt_request(run_dir: Path, settle_s: float = 0.25) -> tuple[str, str | None] | None:
    """``(reason, watch rule or None)`` of the ``.HALT`` in ``run_dir`` (:func:`nsa.rundir.layout.read_halt`:
    any content asks for a halt; a file caught mid-write settles for up to ``settle_s``), None without one.
    The reason is at most 500 characters, ``halt file`` when the file says none."""
    record = read_halt(run_dir, settle_s)
    if record is None:
        return None
    rule = record.get("rule")
    return (str(record.get("reason") or "").strip()[:500] or "halt file"), (rule if isinstance(rule, str)
                                                                            else None)


def archive_stale_halt(files: RunDir) -> Path | None:
    """Move a ``.HALT`` present at start-up (written before this session, never acted on) into ``halts/``."""
    return _move_halt(files, "")


def retire_halt(files: RunDir) -> Path | None:
    """Move the ``.HALT`` this session acted on into ``halts/`` (``HALT-<time>-acted``): it asks nothing of
    the next session, and the report still finds its record (the watchdog's rule)."""
    return _move_halt(files, "-acted")


def _move_halt(files: RunDir, suffix: str) -> Path | None:
    path = files.halt
    if not path.exists():
        return None
    dest_dir = files.halts
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / f"HALT-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 1_000_000:06d}{suffix}"
    os.replace(path, dest)
    return dest


def write_config(files: RunDir, resolved: ResolvedConfig) -> Path:
    """``config.yaml``: the resolved config, then a comment block saying where each value came from."""
    lines = [resolved.config.to_yaml().rstrip(), "", "# _sources (key: origin; unlisted keys are defaults)"]
    lines += [f"#   {k}: {v}" for k, v in sorted(resolved.sources.items())]
    path = files.config
    path.write_text("\n".join(lines) + "\n")
    return path


def write_anomaly(files: RunDir, step: int, record: Anomaly) -> Path:
    files.anomalies.mkdir(exist_ok=True)
    path = files.anomaly(step)
    write_json_atomic(path, record)
    return path


def export_model(files: RunDir, model: Any, resolved: ResolvedConfig, tokenizer: Any,
                 full_state: dict[str, Any] | None = None, step: int | None = None) -> Path:
    """``export/``: ``model.safetensors`` (shared tensors stored once), ``config.yaml``, ``tokenizer.json``
    and
    ``export.json`` (the step and the weights' SHA-256, which ``nsa eval`` records with its results).

    ``full_state``: the whole model's weights gathered from a sharded model; they are loaded into a fresh
    unsharded copy on the CPU, which is what is saved."""
    from safetensors.torch import save_model

    if full_state is not None:
        model = build_model(resolved.config)
        model.load_state_dict(full_state)

    out = files.export
    tmp = files.root / f".export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(model, str(tmp / EXPORT_WEIGHTS))
        (tmp / CONFIG_FILE).write_text(resolved.config.to_yaml())
        os.chmod(tmp / EXPORT_WEIGHTS, (tmp / CONFIG_FILE).stat().st_mode & 0o777)  # safetensors writes 0600
        tok = {
            "name": getattr(tokenizer, "name", None),
            "vocab_size": getattr(tokenizer, "vocab_size", None),
            "eot_id": getattr(tokenizer, "eot_id", None),
            "path": resolved.config.data.tokenizer_path,
        }
        (tmp / EXPORT_TOKENIZER).write_text(json.dumps(tok, indent=2) + "\n")
        info: ExportInfo = {"step": step, "sha256": sha256_file(tmp / EXPORT_WEIGHTS), "time": time.time()}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException as exc:  # a full disk: the previous export (if any) stays, no temporary folder
        shutil.rmtree(tmp, ignore_errors=True)
        surface_os_error(exc, out)
        raise
    return out


def config_summary(resolved: ResolvedConfig) -> list[str]:
    """Lines for the start-up print: each section's values, then values not from defaults or the YAML."""
    data = resolved.config.model_dump(mode="json")
    lines = []
    width = max([len("sources"), *(len(section) for section in data)])
    for section, values in data.items():
        body = " ".join(f"{k}={v}" for k, v in values.items() if v is not None)
        lines.append(f"  {section:<{width}} {body}")
    overrides = {k: v for k, v in resolved.sources.items() if not v.startswith("config ")}
    config_name = Path(resolved.config_path).name if resolved.config_path else "none"
    lines.append(
        f"  {'sources':<{width}} config {config_name}; "
        + ("; ".join(f"{k} <- {v}" for k, v in overrides.items()) or "no overrides")
    )
    return lines
