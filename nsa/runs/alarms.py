"""Alarms kept with the run: ``RUN/alarms.jsonl``, one JSON object per line, appended by ``nsa watch``.

``{"schema": 1, "event": "alarm" | "cleared", "time", "rule", "message", "evidence", "step", "session",
"by"}``: ``session`` is the ``ts`` of rank 0's ``boot`` line (a resumed run starts a new one), ``by`` the
watch that wrote it. An alarm already open for its session and rule (written by this or another watch, or
an earlier ``--once``) is not written again; ``cleared`` closes it. ``nsa report`` reads the file and fails
a run whose watch raised alarms.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa.fileio import json_safe
from nsa.rundir.layout import ALARMS_FILE


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable record of ``RUN/alarms.jsonl`` in file order (unreadable lines skipped)."""
    out: list[dict[str, Any]] = []
    with contextlib.suppress(OSError), open(Path(run_dir) / ALARMS_FILE, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and isinstance(rec.get("rule"), str):
                    out.append(rec)
    return out


@dataclass
class KeptAlarm:
    """One alarm of the run, as ``nsa watch`` kept it: when it fired, at which step, and when it cleared."""

    rule: str
    message: str
    time: float | None
    step: Any
    session: Any
    cleared: float | None = None
    by: str | None = None

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        end = "" if self.cleared is None else " (cleared later)"
        return f"`{self.rule}`{at}: {self.message}{end}"


def kept_alarms(run_dir: str | Path) -> list[KeptAlarm]:
    """The alarms of ``RUN/alarms.jsonl``, oldest first, each with the time its ``cleared`` record gives."""
    alarms: list[KeptAlarm] = []
    open_: dict[tuple[Any, str], KeptAlarm] = {}
    for rec in read_records(run_dir):
        key = (rec.get("session"), rec["rule"])
        if rec.get("event") == "cleared":
            a = open_.pop(key, None)
            if a is not None:
                a.cleared = rec.get("time") if isinstance(rec.get("time"), int | float) else None
            continue
        if key in open_:
            continue
        a = KeptAlarm(rec["rule"], str(rec.get("message") or ""), rec.get("time"), rec.get("step"), rec.get("session"),
                      by=rec.get("by"))
        alarms.append(a)
        open_[key] = a
    return alarms


class AlarmFile:
    """Appends a watch's alarms to ``RUN/alarms.jsonl`` without repeating one that is already open."""

    def __init__(self, run_dir: str | Path, by: str) -> None:
        self.path = Path(run_dir) / ALARMS_FILE
        self.by = by

    def open_rules(self, session: Any) -> set[str]:
        """Rules with an alarm open (not cleared) for ``session``."""
        return {a.rule for a in kept_alarms(self.path.parent) if a.session == session and a.cleared is None}

    def write(self, event: str, rule: str, message: str, evidence: dict[str, Any], when: float, session: Any) -> None:
        """Append one record; ``OSError`` when the run directory cannot be written."""
        rec = {"schema": 1, "event": event, "time": when, "rule": rule, "message": message, "evidence": evidence,
               "step": evidence.get("step"), "session": session, "by": self.by}
        data = (json.dumps(json_safe(rec), default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
