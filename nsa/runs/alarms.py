"""Alarms kept with the run: ``RUN/alarms.jsonl``, one JSON object per line, appended by ``nsa watch``.

``{"schema": 1, "event": "alarm" | "cleared" | "ack", "time", "rule", "message", "evidence", "step",
"session", "by"}``: ``session`` is the ``ts`` of rank 0's ``boot`` line (a resumed run starts a new one),
``by`` the watch (or the operator) that wrote it. An alarm already open for its session and rule (written by
this or another watch, or an earlier ``--once``) is not written again; ``cleared`` closes it.

A past alarm stops counting against the run in one of two ways (:func:`judge`):
- *resolved*: a later session of the run ended cleanly (completed, or halted on request); while a later
  session is still running the alarm is *superseded* (a warning, not a failure);
- *acknowledged*: ``nsa ack RUN --reason TEXT`` (:func:`acknowledge`) appends an ``ack`` record (``reason``,
  ``by``) for each open alarm, kept with the run.
``nsa report`` fails a run on its *open* alarms only and lists the others with what closed them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa.errors import ConfigError, NSAError
from nsa.fileio import json_safe, write_failure
from nsa.rundir import RunDir
from nsa.rundir.records import ALARMS_SCHEMA, Alarm
from nsa.runs.sessions import Session, read_sessions
from nsa.view import Block, Line, Result

OPEN, RESOLVED, SUPERSEDED, ACKNOWLEDGED = "open", "resolved", "superseded", "acknowledged"


def read_records(run_dir: str | Path) -> list[Alarm]:
    """Every readable record of ``RUN/alarms.jsonl`` in file order (unreadable lines skipped)."""
    out: list[Alarm] = []
    with contextlib.suppress(OSError), open(RunDir(run_dir).alarms, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                rec: Any = json.loads(line)
                if isinstance(rec, dict) and isinstance(rec.get("rule"), str):
                    out.append(rec)  # type: ignore[arg-type]  # an Alarm line (unknown fields ignored)
    return out


@dataclass
class KeptAlarm:
    """One alarm of the run, as ``nsa watch`` kept it: when it fired, at which step, when it cleared, and
    whether it still counts (``state``: open, resolved, superseded or acknowledged; ``note`` says by what)."""

    rule: str
    message: str
    time: float | None
    step: Any
    session: Any
    cleared: float | None = None
    by: str | None = None
    state: str = OPEN
    note: str | None = None

    @property
    def counts(self) -> bool:
        """It still fails the run (open)."""
        return self.state == OPEN

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        end = "" if self.cleared is None else " (cleared later)"
        closed = f" [{self.state}: {self.note}]" if self.state != OPEN and self.note else ""
        return f"`{self.rule}`{at}: {self.message}{end}{closed}"


def kept_alarms(run_dir: str | Path, sessions: list[Session] | None = None) -> list[KeptAlarm]:
    """The alarms of ``RUN/alarms.jsonl``, oldest first, each with the time its ``cleared`` record gives and
    the ``ack`` records applied; ``sessions`` (:func:`nsa.runs.sessions.read_sessions`): also resolve the
    alarms of earlier sessions (:func:`judge`)."""
    alarms: list[KeptAlarm] = []
    open_: dict[tuple[Any, str], KeptAlarm] = {}
    acks: list[Alarm] = []
    for rec in read_records(run_dir):
        key = (rec.get("session"), rec["rule"])
        if rec.get("event") == "ack":
            acks.append(rec)
            continue
        if rec.get("event") == "cleared":
            a = open_.pop(key, None)
            if a is not None:
                a.cleared = rec.get("time") if isinstance(rec.get("time"), int | float) else None
            continue
        if key in open_:
            continue
        a = KeptAlarm(rec["rule"], str(rec.get("message") or ""), rec.get("time"), rec.get("step"),
                      rec.get("session"), by=rec.get("by"))
        alarms.append(a)
        open_[key] = a
    return judge(alarms, acks, sessions)


def judge(alarms: list[KeptAlarm], acks: list[Alarm], sessions: list[Session] | None) -> list[KeptAlarm]:
    """Mark each alarm acknowledged (an ``ack`` record for its session and rule), resolved (a later session
    ended cleanly) or superseded (a later session is still running); the rest stay open."""
    for a in alarms:
        ack = next((r for r in acks if r.get("rule") == a.rule and r.get("session") == a.session), None)
        if ack is not None:
            a.state, a.note = (ACKNOWLEDGED,
                               f"by {ack.get('by') or 'unknown'}: {ack.get('reason') or ''}".rstrip(": "))
            continue
        if not sessions or not isinstance(a.session, int | float):
            continue
        later = [s for s in sessions if s.start is not None and s.start > float(a.session) + 1e-6]
        healthy = next((s for s in later if s.clean), None)
        if healthy is not None:
            a.state, a.note = RESOLVED, f"session {healthy.index} ran on and ended {healthy.status}"
        elif later and later[-1].status == "running":
            a.state, a.note = SUPERSEDED, f"session {later[-1].index} resumed the run and is still running"
    return alarms


def acknowledge(run_dir: str | Path, reason: str, by: str, rules: list[str] | None = None,
                sessions: list[Session] | None = None) -> list[KeptAlarm]:
    """Acknowledge the open alarms of ``rules`` (every open alarm when None): one ``ack`` record each in
    ``RUN/alarms.jsonl`` with ``reason`` and ``by``. Returns the alarms acknowledged. ``ConfigError`` without
    a reason, or when a named rule has no open alarm; ``OSError`` when the file cannot be written."""
    if not reason.strip():
        raise ConfigError("an acknowledgement needs a reason",
                          hint="nsa ack RUN --reason 'why this alarm is fine'")
    pending = [a for a in kept_alarms(run_dir, sessions) if a.counts]
    if rules:
        named = set(rules)
        unknown = sorted(named - {a.rule for a in pending})
        if unknown:
            have = ", ".join(sorted({a.rule for a in pending})) or "none"
            raise ConfigError(f"no open alarm for rule {', '.join(unknown)} in {run_dir} (open: {have})",
                              hint="nsa report RUN lists the alarms and what closed them")
        pending = [a for a in pending if a.rule in named]
    writer = AlarmFile(run_dir, by)
    for a in pending:
        writer.append({"schema": ALARMS_SCHEMA, "event": "ack", "time": time.time(), "rule": a.rule,
                       "session": a.session, "step": a.step, "reason": reason.strip(), "by": by})
        a.state, a.note = ACKNOWLEDGED, f"by {by}: {reason.strip()}"
    return pending


@dataclass
class Acknowledged(Result):
    """What ``nsa ack`` acknowledged in ``run_dir`` (nothing when no alarm was open)."""

    run_dir: str
    alarms: list[KeptAlarm]

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "acknowledged": [
            {"rule": a.rule, "step": a.step, "session": a.session, "message": a.message, "note": a.note}
            for a in self.alarms]}

    def view(self) -> list[Block]:
        return [Line(f"acknowledged {a.describe()}") for a in self.alarms] or [Line("no open alarm in "
                                                                                    f"{self.run_dir}")]


def ack_run(run_dir: str | Path, reason: str, rules: list[str] | None = None,
            by: str | None = None) -> Acknowledged:
    """``nsa ack``: :func:`acknowledge` the open alarms of a run directory (checked), judged against its
    sessions; ``by`` defaults to ``user@host (nsa ack, pid N)``. A run directory that cannot be written: one
    ``NSAError``."""
    from nsa.runs.halt import who_am_i
    from nsa.runs.reader import RunReader, check_run_dir
    from nsa.runs.rules import canonical

    path = check_run_dir(run_dir)
    rules = [canonical(r) for r in rules] if rules else None
    st = RunReader(path).poll(final=True)
    sessions = read_sessions(path, st.status(time.time()))
    try:
        return Acknowledged(str(run_dir),
                            acknowledge(path, reason, by or who_am_i("nsa ack"), rules, sessions))
    except OSError as exc:
        raise NSAError(write_failure(exc, Path(run_dir) / "alarms.jsonl"),
                       hint="make the run directory writable") from None


class AlarmFile:
    """Appends a watch's alarms to ``RUN/alarms.jsonl`` without repeating one that is already open."""

    def __init__(self, run_dir: str | Path, by: str) -> None:
        self.path = RunDir(run_dir).alarms
        self.by = by

    def open_rules(self, session: Any) -> set[str]:
        """Rules with an alarm open (not cleared) for ``session``."""
        return {a.rule for a in kept_alarms(self.path.parent) if a.session == session and a.cleared is None}

    def write(self, event: str, rule: str, message: str, evidence: dict[str, Any], when: float,
              session: Any) -> None:
        """Append one alarm or cleared record; ``OSError`` when the run directory cannot be written."""
        self.append({"schema": ALARMS_SCHEMA, "event": event, "time": when, "rule": rule, "message": message,
                     "evidence": evidence, "step": evidence.get("step"), "session": session, "by": self.by})

    def append(self, rec: Alarm) -> None:
        """Append one record as one line (one ``write``: whole or not at all)."""
        data = (json.dumps(json_safe(rec), default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
