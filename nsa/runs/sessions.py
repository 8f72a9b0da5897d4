"""A run's history: its sessions (one per ``nsa train`` start, fresh or ``--resume``), read from rank 0's
heartbeat. A session starts at a ``boot`` line and ends at its ``end`` event; a session whose trainer is gone
without one crashed (a later session, or a dead process, says so). ``nsa report`` shows them as a table and
judges the run's earlier sessions (a crash that a resume recovered from is said, not hidden).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nsa.rundir import RunDir
from nsa.rundir.checkpoints import step_of

CLEAN = ("completed", "halted")  # how a session ends when nothing went wrong


@dataclass
class Session:
    """One session: when it started and ended, how it ended, and the steps it trained (``first_step`` is the
    step it resumed at, 0 for a fresh start)."""

    index: int  # 1-based
    start: float | None
    end: float | None
    status: str  # completed, halted, failed, interrupted, crashed, running
    first_step: int
    last_step: int
    resumed_from: str | None = None
    error: str | None = None
    halt_reason: str | None = None
    pid: int | None = None
    host: str | None = None

    @property
    def clean(self) -> bool:
        """Ended as asked: completed, or halted on request (a watchdog halt is not clean)."""
        return self.status in CLEAN and not (self.halt_reason or "").startswith("watchdog:")

    def how(self) -> str:
        """How it ended, in words: ``crashed (no end event)``, ``failed: OSError: ...``, ``halted
        (reason)``."""
        if self.status == "crashed":
            return "crashed (the trainer is gone without an end event)"
        if self.status == "interrupted":
            return "interrupted by the operator (Ctrl-C)"
        if self.status == "halted":
            return f"halted ({self.halt_reason})" if self.halt_reason else "halted"
        if self.status == "failed":
            return f"failed: {self.error}" if self.error else "failed"
        return self.status

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "how": self.how(), "clean": self.clean}


def read_sessions(run_dir: str | Path, current_status: str | None = None) -> list[Session]:
    """The sessions of rank 0's heartbeat, oldest first. ``current_status``: the run's status now
    (``running``,
    ``stale``, ``crashed``, ... from :meth:`nsa.runs.reader.RunState.status`), for the last session when it
    has no end event; earlier sessions without one crashed."""
    rd = RunDir(run_dir)
    files = rd.heartbeats()
    path = files[0] if files else rd.heartbeat(0)
    out: list[Session] = []
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            kind, step, ts = ev.get("event"), ev.get("step"), ev.get("ts")
            ts = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
            if kind == "boot":
                resumed = ev.get("resumed_from")
                first = max(0, step_of(str(resumed or "")))
                out.append(Session(len(out) + 1, ts, None, "", first, first,
                                   str(resumed) if resumed else None,
                                   pid=ev.get("pid") if isinstance(ev.get("pid"), int) else None,
                                   host=str(ev["host"]) if ev.get("host") else None))
                continue
            if not out:
                continue
            s = out[-1]
            if isinstance(step, int) and not isinstance(step, bool):
                s.last_step = max(s.last_step, step)
            if ts is not None:
                s.end = ts
            if kind == "halt" and ev.get("reason"):
                s.halt_reason = str(ev["reason"])
            if kind == "end" and not s.status:
                s.status = str(ev.get("status") or "failed")
                s.error = str(ev["error"]) if ev.get("error") else None
    for s in out[:-1]:
        s.status = s.status or "crashed"
    if out and not out[-1].status:
        last = current_status or "running"
        out[-1].status = "crashed" if last == "crashed" else "running"
    return out


def earlier_trouble(sessions: list[Session]) -> list[Session]:
    """The sessions before the last that did not end cleanly (crashed, failed, interrupted, halted by the
    watchdog): the history a final PASS must not hide."""
    return [s for s in sessions[:-1] if not s.clean]
