"""Atomic, checksummed checkpoints: ``checkpoints/step_NNNNNNNN/{state.pt, manifest.json}``.

A checkpoint is written under ``checkpoints/.tmp-*`` while its SHA-256 is computed, each file is
fsynced, the manifest (file sizes and checksums) is written last, and the folder is renamed into
place. A failed write (disk full, say) removes its temporary folder and leaves the previous
checkpoints as they were. The container's names and versions and its reading and verifying are
``nsa.rundir.checkpoints`` (the format's one owner): resume takes the newest
checkpoint that verifies and says which newer ones it skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from nsa.errors import CheckpointError
from nsa.fileio import surface_os_error
from nsa.rundir.checkpoints import (
    MANIFEST_FILE,
    MANIFEST_SCHEMA,
    SHARDED_DIR,
    STATE_FILE,
    Verdict,
    check_state_format,
    is_complete,
    list_checkpoints,
    newest_verified,
    sha256_file,
    step_dir_name,
    verify,
)
from nsa.rundir.layout import CHECKPOINTS_DIR
from nsa.train import distributed as D

__all__ = ["clean_partials", "find_resume", "is_sharded", "load_sharded", "load_state", "prune",
           "resolve_resume", "save_checkpoint", "save_sharded_checkpoint"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that also feeds every byte written to a SHA-256 (so saving reads nothing back)."""

    def __init__(self, f: Any) -> None:
        self.f, self.h = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        n: int = self.f.write(data)
        self.h.update(memoryview(data)[:n] if n is not None else data)
        return n

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], extra: dict[str, Any] | None = None,
                    tmp: Path | None = None) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; return its folder.

    ``tmp``: a temporary folder that already holds a sharded model's files (``SHARDED_DIR``), which the
    manifest then covers too. On any error (``OSError`` such as a full disk included) the temporary
    folder is removed and the error propagates; checkpoints already on disk are untouched.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if tmp is None and is_complete(final) and verify(final).ok:
        return final
    if tmp is None:
        tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
        tmp.mkdir()
    try:
        state_path = tmp / STATE_FILE
        with open(state_path, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(state, writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        files = {STATE_FILE: state_path.stat().st_size}
        sums = {STATE_FILE: writer.h.hexdigest()}
        for part in sorted((tmp / SHARDED_DIR).rglob("*")) if (tmp / SHARDED_DIR).is_dir() else []:
            if part.is_file():
                name = str(part.relative_to(tmp))
                files[name], sums[name] = part.stat().st_size, sha256_file(part)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "step": step,
            "created": time.time(),
            "files": files,
            "sha256": sums,
            **(extra or {}),
        }
        with open(tmp / MANIFEST_FILE, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # an incomplete or corrupted leftover with the final name: move it out first
            _remove(final)
        os.rename(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        surface_os_error(exc, final)  # torch.save's RuntimeError around a full disk: the OSError, naming it
        raise
    _fsync_dir(root)
    return final


def save_sharded_checkpoint(run_dir: Path, step: int, state: dict[str, Any] | None, sharded: dict[str, Any],
                            extra: dict[str, Any] | None, dist: Any) -> Path:
    """A collective: every rank writes its shards of ``sharded`` (``torch.distributed.checkpoint``) into one
    temporary folder, then rank 0 adds ``state`` (the whole components) and the manifest over every file
    and renames the folder into place (atomic as :func:`save_checkpoint`). Returns the final folder."""
    import torch.distributed.checkpoint as dcp


    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / step_dir_name(step)
    name = f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}" if dist.is_main else None
    tmp = root / D.broadcast_object(name, dist)
    if dist.is_main:
        tmp.mkdir(parents=True)
    D.barrier(dist)
    try:
        dcp.save(sharded, checkpoint_id=tmp / SHARDED_DIR)
        D.barrier(dist)
        if dist.is_main:
            assert state is not None
            save_checkpoint(run_dir, step, state, extra, tmp=tmp)
    except BaseException:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def is_sharded(path: Path) -> bool:
    """The checkpoint holds a sharded model (DCP files beside ``state.pt``)."""
    return (Path(path) / SHARDED_DIR).is_dir()


def load_sharded(path: Path, template: dict[str, Any]) -> None:
    """Fill ``template`` (this rank's sharded state dicts) in place from a checkpoint's shards; the number
    of ranks may differ from the run that wrote them (DCP reshards)."""
    import torch.distributed.checkpoint as dcp

    if not (Path(path) / SHARDED_DIR).is_dir():
        raise CheckpointError(f"checkpoint {path} holds no sharded model",
                              hint="resume with the runtime.parallel setting the run was saved with")
    with warnings.catch_warnings():  # one process (no process group) loading whole tensors: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=Path(path) / SHARDED_DIR)


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
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def find_resume(run_dir: Path, resume: str | None) -> tuple[Path | None, list[Verdict]]:
    """The checkpoint to resume from and the newer ones skipped on the way (``auto`` only).

    ``None`` -> no resume; ``auto`` -> the newest checkpoint that verifies (``None`` if there is none);
    else a given path: a checkpoint folder, its ``state.pt``, or a run directory (its newest verified
    checkpoint). A given checkpoint that does not verify is an error naming why.
    """
    if resume is None:
        return None, []
    if resume == "auto":
        return newest_verified(run_dir)
    p = Path(resume)
    if p.is_file() and p.name == STATE_FILE:
        p = p.parent
    if p.is_dir() and (p / CHECKPOINTS_DIR).is_dir():
        newest, skipped = newest_verified(p)
        if newest is None:
            raise CheckpointError(f"train.resume={resume}: run directory has no checkpoint that verifies",
                                  hint=skipped[0].reason if skipped else None)
        return newest, skipped
    if not p.exists():
        raise CheckpointError(f"train.resume={resume}: no such checkpoint",
                              hint="use 'auto' or a step_* folder")
    verdict = verify(p)
    if not verdict.ok:
        raise CheckpointError(
            f"train.resume={resume} is not a usable checkpoint: {verdict.reason}",
            hint="use 'auto' to take the newest one that verifies",
        )
    return p, []


def resolve_resume(run_dir: Path, resume: str | None) -> Path | None:
    """``find_resume`` without the skipped list."""
    return find_resume(run_dir, resume)[0]


def load_state(path: Path) -> dict[str, Any]:
    """Load ``state.pt`` of a checkpoint folder onto the CPU (tensors and plain containers only); its
    format must be one this code reads."""
    try:
        state: dict[str, Any] = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from None
    check_state_format(state, Path(path) / STATE_FILE)
    return state
