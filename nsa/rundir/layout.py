"""The run directory: every file name, the ``.HALT`` and lock formats, and :class:`RunDir`, the one
object that names each path. The trainer that writes a run and everything that reads one (model
loading, eval, watch, halt, report, the CLI) go through here. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa.rundir.records import HaltFile, Lock

CONFIG_FILE = "config.yaml"
ENV_FILE = "env.json"
METRICS_FILE = "metrics.json"
TRAIN_CSV = "training.csv"
VAL_CSV = "val.csv"
TRAIN_LOG = "train.log"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"  # model.safetensors + config.yaml (+ tokenizer.json) of a finished run
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_TOKENIZER = "tokenizer.json"
HF_EXPORT_DIR = "hf"  # the model in Hugging Face format (checkpoint.export_hf; nsa export --format hf)
EXPORT_INFO = "export.json"  # {"step", "sha256" of the weights, "time"}: which weights an export holds
TENSORBOARD_DIR = "tb"
ANOMALIES_DIR = "anomalies"  # one JSON record per non-finite loss (step_<n>.json)
EVAL_DIR = "eval"  # `nsa eval` results kept with the run (<task>.json, needle.png)
NEEDLE_PNG = "needle.png"  # the needle task's heat map, in EVAL_DIR
RANK_LOG = "train_rank{rank}.log"  # train.log of ranks > 0
HEARTBEAT = "heartbeat_rank{rank}.jsonl"  # one JSON event per line, per rank
HEARTBEAT_RE = re.compile(r"^heartbeat_rank(\d+)\.jsonl$")
HALT_FILE = ".HALT"
HALTS_DIR = "halts"  # .HALT files archived unobeyed at a restart
LOCK_FILE = ".lock"  # the trainer's one-writer lock; its JSON names the holder {"pid", "host", "since"}
ALARMS_FILE = "alarms.jsonl"  # alarms raised by `nsa watch`, one JSON object per line (kept with the run)
STACKDUMP = "stackdump_rank{rank}.txt"  # SIGUSR1 appends every thread's stack (`nsa dump`)
# a watchdog .HALT's reason starts with this (`nsa watch --halt-on`); the trainer exits EXIT_WATCHDOG on it
WATCHDOG_PREFIX = "watchdog:"
EXIT_WATCHDOG = 3  # `nsa train` (and `nsa watch` that wrote .HALT) when the watchdog halted the run
EXIT_INTERRUPTED = 130  # `nsa train` stopped at once by a second request (Ctrl-C twice; 128 + SIGINT)


def watchdog_reason(rule: str, message: str) -> str:
    """The reason a watchdog's ``.HALT`` gives: ``watchdog: <rule>: <message>`` (the rule's name first, so
    a halt event names its rule even where the record is gone; :func:`watchdog_rule` reads it back)."""
    return f"{WATCHDOG_PREFIX} {rule}: {message}"


def watchdog_rule(reason: str) -> str | None:
    """The rule a :func:`watchdog_reason` names (None for another reason, or one written before the rule
    was part of it)."""
    if not reason.startswith(WATCHDOG_PREFIX):
        return None
    head, sep, _ = reason.removeprefix(WATCHDOG_PREFIX).strip().partition(": ")
    return head if sep and re.fullmatch(r"[a-z]+(-[a-z]+)*", head) else None


RUN_MARKERS = (CONFIG_FILE, ENV_FILE, TRAIN_CSV, METRICS_FILE)
# the folders a run keeps its records in (a writer from outside, such as `nsa export OUT`, never replaces one)
RUN_PARTS = (CHECKPOINTS_DIR, EXPORT_DIR, EVAL_DIR, ANOMALIES_DIR, HALTS_DIR, TENSORBOARD_DIR)


def is_run_dir(path: str | Path) -> bool:
    """A folder that holds a run: a heartbeat file or one of the run's first files."""
    p = Path(path)
    if not p.is_dir():
        return False
    if any(HEARTBEAT_RE.match(f.name) for f in p.iterdir()):
        return True
    return any((p / m).is_file() for m in RUN_MARKERS)


def read_lock(run_dir: str | Path) -> Lock | None:
    """The run lock's holder record ``{"pid", "host", "since"}`` (the holder now, or the last one), or
    None."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        return data if isinstance(data, dict) else None  # type: ignore[return-value]
    return None


def parse_halt(text: str) -> tuple[HaltFile, bool]:
    """``(record, partial)`` of a ``.HALT`` file's text.

    The record is the JSON object the file holds (``nsa halt``, the watchdog), else ``{"reason": text}``
    (``echo reason > .HALT``; any content asks for a halt). ``partial``: the text looks caught mid-write
    (empty, or a JSON object cut short), worth reading again in a moment.
    """
    data: Any = None
    with contextlib.suppress(ValueError):  # plain text is a valid .HALT too
        data = json.loads(text)
    if isinstance(data, dict):
        return data, False  # type: ignore[return-value]
    partial = not text.strip() or (text.lstrip().startswith("{") and data is None)
    return {"reason": text.strip()}, partial


def read_halt(path: str | Path, settle_s: float = 0.0) -> HaltFile | None:
    """The one reader of ``.HALT`` files: the record of a run directory's ``.HALT`` (or of a file, such as an
    archived ``halts/HALT-*``), None when there is none. The bytes are decoded leniently (any content asks for
    a halt, none may crash a reader); a file caught mid-write (``echo ... > .HALT`` truncates first: empty,
    or JSON cut short) is re-read for up to ``settle_s`` seconds before it is taken as it stands. ``time``
    defaults to the file's modification time; an unreadable file is ``{"reason": "halt file
    (unreadable)"}``."""
    p = Path(path)
    p = p / HALT_FILE if p.is_dir() else p
    deadline = time.monotonic() + settle_s
    while True:
        try:
            text = p.read_bytes().decode("utf-8", errors="replace")
            mtime = p.stat().st_mtime
        except FileNotFoundError:
            return None
        except OSError:
            return {"reason": "halt file (unreadable)"}
        record, partial = parse_halt(text)
        if not partial or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    when = record.get("time")
    if not isinstance(when, int | float) or isinstance(when, bool):
        record["time"] = mtime
    return record


@dataclass(frozen=True, init=False)
class RunDir:
    """The paths of one run directory (``root``, a path or its text); nothing is created or read here."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def env(self) -> Path:
        return self.root / ENV_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def train_csv(self) -> Path:
        return self.root / TRAIN_CSV

    @property
    def val_csv(self) -> Path:
        return self.root / VAL_CSV

    @property
    def train_log(self) -> Path:
        return self.root / TRAIN_LOG

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def export(self) -> Path:
        return self.root / EXPORT_DIR

    @property
    def hf_export(self) -> Path:
        return self.root / HF_EXPORT_DIR

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def anomalies(self) -> Path:
        return self.root / ANOMALIES_DIR

    def anomaly(self, step: int) -> Path:
        return self.anomalies / f"step_{step}.json"

    @property
    def eval(self) -> Path:
        return self.root / EVAL_DIR

    def eval_result(self, task: str) -> Path:
        """``eval/<task>.json`` (``nsa eval``)."""
        return self.eval / f"{task}.json"

    @property
    def needle_png(self) -> Path:
        return self.eval / NEEDLE_PNG

    def log(self, rank: int) -> Path:
        """``train.log`` (rank 0) or ``train_rank<r>.log``."""
        return self.root / (TRAIN_LOG if rank == 0 else RANK_LOG.format(rank=rank))

    @property
    def halt(self) -> Path:
        return self.root / HALT_FILE

    @property
    def halts(self) -> Path:
        return self.root / HALTS_DIR

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def alarms(self) -> Path:
        return self.root / ALARMS_FILE

    def heartbeat(self, rank: int) -> Path:
        return self.root / HEARTBEAT.format(rank=rank)

    def heartbeats(self) -> list[Path]:
        """The heartbeat files on disk, by rank."""
        found = [p for p in self.root.glob("heartbeat_rank*.jsonl") if HEARTBEAT_RE.match(p.name)]
        return sorted(found,
                      key=lambda p: int(HEARTBEAT_RE.match(p.name).group(1)))  # type: ignore[union-attr]

    def stackdump(self, rank: int) -> Path:
        return self.root / STACKDUMP.format(rank=rank)
