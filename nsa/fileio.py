"""Writing files so that readers never see half of one."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
