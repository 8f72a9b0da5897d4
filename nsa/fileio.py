"""Writing files so that readers never see half of one."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def nearest_existing(path: Path) -> Path:
    """``path`` itself when it exists, else its nearest existing parent (where it would be made)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path``. On any error
    (a full disk, a read-only folder) the temporary file is removed and ``path`` keeps what it had."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        named(exc, path)
        raise
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def json_safe(obj: Any) -> Any:
    """``obj`` as JSON can hold it: non-finite floats become ``None`` (JSON has no NaN), paths strings,
    tuples lists, keys strings (recursively)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def named(exc: OSError, path: str | Path) -> OSError:
    """``exc`` naming ``path`` when it names no file (``os.write`` errors name none) or only a temporary
    one."""
    if exc.filename is None or ".tmp-" in str(exc.filename):
        exc.filename = str(path)
    return exc


def os_error_in(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, or one in its ``__cause__`` / ``__context__`` chain
    (``torch.save`` turns a full disk into ``RuntimeError: [enforce fail at inline_container.cc] ...``, the
    ``OSError`` its context)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def surface_os_error(exc: BaseException, path: str | Path) -> None:
    """Inside ``except``: when an ``OSError`` is behind ``exc`` (:func:`os_error_in`), name ``path`` on it
    (:func:`named`) and raise it in place of a wrapper such as ``torch.save``'s ``RuntimeError``; otherwise
    return, and the caller re-raises ``exc``."""
    disk = os_error_in(exc)
    if disk is None:
        return
    named(disk, path)
    if disk is not exc:
        raise disk from None


def free_space(path: str | Path) -> str | None:
    """``"2.9 MiB free"`` on the filesystem of ``path`` (its nearest existing folder), or None when
    unknown."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return None
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free"
    return f"{free} bytes free"


def write_failure(exc: OSError, path: str | Path | None = None) -> str:
    """One line for a failed write: ``cannot write FILE: No space left on device (2.9 MiB free)``; ``path``
    names the file when the error does not."""
    where = exc.filename if exc.filename is not None else path
    why = exc.strerror or str(exc) or type(exc).__name__
    free = free_space(where) if where is not None else None
    return (f"cannot write {where}: {why}" if where is not None else f"write failed: {why}") + (f" ({free})"
        if free else "")
