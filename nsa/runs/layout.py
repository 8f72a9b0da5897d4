"""The run directory's file names and the ``.HALT`` format: one home for the trainer that writes a run
and for everything that reads one (watch, halt, report, sample, eval). Torch-free.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
ENV_FILE = "env.json"
METRICS_FILE = "metrics.json"
TRAIN_CSV = "training.csv"
VAL_CSV = "val.csv"
TRAIN_LOG = "train.log"
CHECKPOINTS_DIR = "checkpoints"
HALT_FILE = ".HALT"
HALTS_DIR = "halts"  # .HALT files archived unobeyed at a restart
LOCK_FILE = ".lock"  # the trainer's one-writer lock; its JSON names the holder {"pid", "host", "since"}
ALARMS_FILE = "alarms.jsonl"  # alarms raised by `nsa watch`, one JSON object per line (kept with the run)
STACKDUMP = "stackdump_rank{rank}.txt"  # SIGUSR1 appends every thread's stack (`nsa dump`)
# a watchdog .HALT's reason starts with this (`nsa watch --halt-on`); the trainer exits EXIT_WATCHDOG on it
WATCHDOG_PREFIX = "watchdog:"
EXIT_WATCHDOG = 3  # `nsa train` (and `nsa watch` that wrote .HALT) when the watchdog halted the run


def read_lock(run_dir: str | Path) -> dict[str, Any] | None:
    """The run lock's holder record ``{"pid", "host", "since"}`` (the holder now, or the last one), or None."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        return data if isinstance(data, dict) else None
    return None


def parse_halt(text: str) -> tuple[dict[str, Any], bool]:
    """``(record, partial)`` of a ``.HALT`` file's text.

    The record is the JSON object the file holds (``nsa halt``, the watchdog), else ``{"reason": text}``
    (``echo reason > .HALT``; any content asks for a halt). ``partial``: the text looks caught mid-write
    (empty, or a JSON object cut short), worth reading again in a moment.
    """
    data: Any = None
    with contextlib.suppress(ValueError):  # plain text is a valid .HALT too
        data = json.loads(text)
    if isinstance(data, dict):
        return data, False
    partial = not text.strip() or (text.lstrip().startswith("{") and data is None)
    return {"reason": text.strip()}, partial
