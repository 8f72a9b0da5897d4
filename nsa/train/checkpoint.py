"""Atomic checkpoints: ``checkpoints/step_NNNNNNNN/{state.pt, manifest.json}``.

A checkpoint is written under ``checkpoints/.tmp-*``, each file is fsynced, the manifest (with file
sizes) is written last, and the folder is renamed into place. A folder counts as complete only when its
name is ``step_<8 digits>`` and its manifest parses and matches the sizes on disk, so a kill at any
moment never leaves something that ``--resume`` would pick.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from nsa.errors import CheckpointError

CKPT_DIR = "checkpoints"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_SCHEMA = 1
_NAME = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint folder, else ``None``."""
    if not _NAME.match(path.name) or not path.is_dir():
        return None
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        for name, size in manifest["files"].items():
            if (path / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest


def is_complete(path: Path) -> bool:
    return read_manifest(path) is not None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; return its folder."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if is_complete(final):
        return final
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    state_path = tmp / STATE_FILE
    with open(state_path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "step": step,
        "created": time.time(),
        "files": {STATE_FILE: state_path.stat().st_size},
        **(extra or {}),
    }
    with open(tmp / MANIFEST_FILE, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # an incomplete leftover with the final name: move it out of the way first
        _remove(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


def _remove(path: Path) -> None:
    """Rename out of the picked namespace first, then delete (a kill mid-delete leaves only a .tmp)."""
    doomed = path.with_name(f".tmp-delete-{path.name}-{time.time_ns()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return the deleted paths."""
    found = list_checkpoints(run_dir)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for p in doomed:
        _remove(p)
    return doomed


def clean_partials(run_dir: Path) -> list[Path]:
    """Remove ``.tmp-*`` leftovers of interrupted saves or deletes."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def resolve_resume(run_dir: Path, resume: str | None) -> Path | None:
    """``None`` -> no resume; ``auto`` -> newest complete checkpoint (or ``None``); else a given path.

    A given path may be a checkpoint folder, its ``state.pt``, or a run directory (newest checkpoint).
    """
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    p = Path(resume)
    if p.is_file() and p.name == STATE_FILE:
        p = p.parent
    if p.is_dir() and (p / CKPT_DIR).is_dir():
        newest = latest_checkpoint(p)
        if newest is None:
            raise CheckpointError(f"train.resume={resume}: run directory has no complete checkpoint")
        return newest
    if not p.exists():
        raise CheckpointError(f"train.resume={resume}: no such checkpoint", hint="use 'auto' or a step_* folder")
    if not is_complete(p):
        raise CheckpointError(
            f"train.resume={resume} is not a complete checkpoint (no valid manifest.json)",
            hint="use 'auto' to take the newest complete one",
        )
    return p


def load_state(path: Path) -> dict[str, Any]:
    """Load ``state.pt`` of a checkpoint folder onto the CPU (tensors and plain containers only)."""
    try:
        return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from None
