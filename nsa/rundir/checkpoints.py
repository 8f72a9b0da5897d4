"""The checkpoint container: ``checkpoints/step_NNNNNNNN/{state.pt, manifest.json[, sharded/]}``, its
names, format versions and weight-key prefixes, and reading it (torch-free; the trainer's writer is
``nsa.train.checkpoint``).

A folder is *complete* when its name is ``step_<8 digits>`` and its manifest parses and matches the
file sizes on disk (cheap: what a kill mid-save can leave). It is *verified* when, in addition, every
file's SHA-256 equals the one the manifest recorded before the atomic rename (reads every byte:
what catches corruption that keeps the size). Checkpoints written before checksums existed are
complete but carry no checksum; they are accepted as they are (``verify`` says so).

The trainer writes checkpoints (``nsa.train.checkpoint``); resume, ``nsa sample`` and the model
loader pick the newest one that verifies (``newest_verified``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa.errors import CheckpointError
from nsa.rundir.layout import CHECKPOINTS_DIR, EXPORT_INFO

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_SCHEMA = 2  # 2: per-file SHA-256 under "sha256"
SHARDED_DIR = "sharded"  # a sharded model's DCP files (one per rank + .metadata), beside state.pt
# ``state.pt`` holds {"format", "config", "model", ...}: the format this code writes and can read back
STATE_FORMAT = 1
# what wrappers put before a parameter's name in a state dict (torch.compile, DDP)
WEIGHT_PREFIXES = ("_orig_mod.", "module.")
_NAME = re.compile(r"^step_(\d{8})$")
_CHUNK = 1 << 22


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | Path) -> int:
    """The step number of a ``step_*`` folder name (``-1`` for anything else; a path as text is read too: a
    heartbeat's ``resumed_from``)."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else -1


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file (streamed), remembered for this process by path, inode, size and modification
    time: a file checked when loaded and recorded by ``nsa eval`` right after is read once."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint folder (name, manifest, sizes), else ``None``."""
    if not _NAME.match(path.name) or not path.is_dir():
        return None
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        for name, size in manifest["files"].items():
            if (path / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(path: Path) -> bool:
    return read_manifest(path) is not None


@dataclass(frozen=True)
class Verdict:
    """``ok`` when the folder is complete and every recorded checksum matches; ``reason`` otherwise
    (or, when ``ok``, a note such as "no checksums (written before they existed)")."""

    path: Path
    ok: bool
    reason: str = ""


def verify(path: Path) -> Verdict:
    """Check a checkpoint folder: complete, and each file's SHA-256 equal to the manifest's."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return Verdict(path, False, "incomplete (no valid manifest.json, or a file of the wrong size)")
    sums = manifest.get("sha256")
    if not isinstance(sums, dict):
        return Verdict(path, True, "no checksums (written before they existed)")
    for name in manifest["files"]:
        want = sums.get(name)
        if want is None:
            return Verdict(path, False, f"{name} has no checksum in manifest.json")
        try:
            got = sha256_file(path / name)
        except OSError as exc:
            return Verdict(path, False, f"{name} unreadable: {exc.strerror or exc}")
        if got != want:
            return Verdict(path, False, f"{name} checksum mismatch (corrupted on disk)")
    return Verdict(path, True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (sizes checked, checksums not)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (sizes checked, checksums not)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def newest_verified(run_dir: Path) -> tuple[Path | None, list[Verdict]]:
    """The newest checkpoint that verifies, walking back from the newest folder; also the verdicts of
    the newer ``step_*`` folders that were skipped (incomplete or corrupted), newest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return None, []
    folders = sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=step_of,
                     reverse=True)
    skipped: list[Verdict] = []
    for p in folders:
        v = verify(p)
        if v.ok:
            return p, skipped
        skipped.append(v)
    return None, skipped


def _export_info(folder: Path) -> dict[str, Any] | None:
    info: Any = None
    with contextlib.suppress(OSError, ValueError):
        info = json.loads((folder / EXPORT_INFO).read_text())
    return info if isinstance(info, dict) else None


def recorded_sha256(weights: Path) -> tuple[str | None, Path | None]:
    """``(SHA-256, the file that records it)`` of a weights file: a checkpoint's ``manifest.json`` for its
    files, an export's ``export.json`` for its ``model.safetensors``; ``(None, None)`` when none is
    recorded."""
    weights = Path(weights)
    manifest = read_manifest(weights.parent)
    if manifest is not None:
        sums = manifest.get("sha256")
        want = sums.get(weights.name) if isinstance(sums, dict) else None
        return (want, weights.parent / MANIFEST_FILE) if isinstance(want, str) else (None, None)
    info = _export_info(weights.parent)
    if info is not None and isinstance(info.get("sha256"), str):
        return info["sha256"], weights.parent / EXPORT_INFO
    return None, None


def check_sha256(weights: Path, want: str | None, where: Path | str | None, hint: str | None = None) -> str:
    """The SHA-256 of ``weights`` computed from the file; a ``CheckpointError`` naming both when ``want`` (the
    digest ``where`` records) differs from it."""
    try:
        got = sha256_file(weights)
    except OSError as exc:
        raise CheckpointError(f"cannot read {weights}: {exc.strerror or exc}") from None
    if want is not None and got != want:
        raise CheckpointError(
            f"{weights} does not match the SHA-256 recorded in {where} (file {got[:12]}..., recorded "
            f"{want[:12]}...): corrupted on disk or changed since it was written",
            hint=hint or "restore the file, or give a checkpoint of the run that verifies")
    return got


def check_weights(weights: Path) -> str:
    """:func:`check_sha256` of a weights file against what its folder records (:func:`recorded_sha256`)."""
    want, where = recorded_sha256(weights)
    return check_sha256(weights, want, where)


def weights_identity(weights: Path) -> tuple[int | None, str | None]:
    """``(step, sha256)`` of a weights file: the step its checkpoint manifest or ``export.json`` records (else
    that of a ``step_*`` folder name), and the SHA-256 computed from the file (``None`` each when unknown)."""
    weights = Path(weights)
    step: Any = None
    manifest = read_manifest(weights.parent)
    if manifest is not None:
        step = manifest.get("step")
    elif (info := _export_info(weights.parent)) is not None:
        step = info.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        step = step_of(weights.parent) if step_of(weights.parent) >= 0 else None
    try:
        digest: str | None = sha256_file(weights)
    except OSError:
        digest = None
    return step, digest


def check_state_format(state: dict[str, Any], source: Path) -> None:
    """A ``CheckpointError`` when ``state.pt`` was written in a format this code cannot read (a newer one);
    checkpoints from before the field existed read as format 1."""
    fmt = state.get("format", 1)
    if not isinstance(fmt, int) or fmt > STATE_FORMAT:
        raise CheckpointError(f"{source} is checkpoint format {fmt!r}; this nsa reads format {STATE_FORMAT}",
                              hint="load it with the nsa version that wrote it")


def strip_prefixes(names: dict[str, Any]) -> dict[str, Any]:
    """The same mapping with wrapper prefixes (:data:`WEIGHT_PREFIXES`) removed from each key."""
    out = {}
    for k, v in names.items():
        for p in WEIGHT_PREFIXES:
            if k.startswith(p):
                k = k[len(p) :]
        out[k] = v
    return out
