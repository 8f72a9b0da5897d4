"""Writing files so that readers never see half of one."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path``. On any error
    (a full disk, a read-only folder) the temporary file is removed and ``path`` keeps what it had."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
