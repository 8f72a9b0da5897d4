"""The watchdog over a run directory: read the newest state, evaluate the alert and halt rules, write
``.HALT`` once per session when a halt rule fires, record alarms (new / cleared), keep them with the run
(``RUN/alarms.jsonl``, :mod:`nsa.runs.alarms`) and notify each new one. It follows a run across resumes.

``nsa watch`` renders what :meth:`Watchdog.poll` returns; the policy lives here (no torch, no Rich).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nsa.config import MonitorConfig
from nsa.errors import NSAError, RunDirError
from nsa.fileio import write_failure
from nsa.rundir.layout import EXIT_WATCHDOG, watchdog_reason
from nsa.rundir.records import HaltFile
from nsa.runs.alarms import AlarmFile
from nsa.runs.halt import who_am_i, write_halt
from nsa.runs.reader import RunReader, RunState
from nsa.runs.rules import Alarm, AlarmLog, ArmedRule, RuleHit, evaluate, monitor_config, notify, resolve
from nsa.runs.summary import RunSummary, summarize

ENDED_GRACE_S = 30.0  # after rank 0's end event, how long to wait for the other ranks' end events


@dataclass
class Snapshot:
    """One poll: the run's state and summary, the firing alarms, what changed since the last poll."""

    state: RunState
    summary: RunSummary
    alarms: list[RuleHit]
    monitor: MonitorConfig
    time: float
    new: list[Alarm] = field(default_factory=list)
    cleared: list[Alarm] = field(default_factory=list)
    wrote_halt: bool = False  # this poll wrote .HALT


class Watchdog:
    """``alert_rules`` raise alarms; ``halt_rules`` also write ``.HALT`` (once). ``notify``: a shell command
    per new alarm (``None``: the run's ``monitor.notify``; ``""``: none); ``on_warning`` hears a failed
    notification."""

    def __init__(self, reader: RunReader, alert_rules: list[ArmedRule], halt_rules: list[ArmedRule], *,
                 notify_cmd: str | None = None, notify_timeout: float = 10.0,
                 stale_after: float | None = None, on_warning: Callable[[str], None] | None = None,
                 keep: bool = True) -> None:
        """``keep``: write the alarms to ``RUN/alarms.jsonl`` (a run directory that cannot be written is one
        warning, and the watch goes on)."""
        self.reader, self.alert_rules, self.halt_rules = reader, alert_rules, halt_rules
        self.notify_cmd, self.notify_timeout, self.stale_after = notify_cmd, notify_timeout, stale_after
        self.on_warning = on_warning or (lambda _: None)
        self.log = AlarmLog()
        self.halted: list[HaltFile] = []  # the .HALT this watchdog wrote (in the current session)
        self._alert_names = {r.name for r in alert_rules}
        self._session: float | None = None
        self._config_said = False
        self._kept = AlarmFile(reader.run_dir, who_am_i("nsa watch")) if keep else None

    def poll(self, final: bool = False) -> Snapshot:
        now = time.time()
        st = self.reader.poll(final=final)
        if st.end is None and st.process_alive() is False:
            st = self.reader.poll(final=True)  # the trainer is gone: take a last line written without newline
        if st.session_start != self._session:  # a new session (a resume): its own watchdog halt
            self._session, self.halted = st.session_start, []
        mon = monitor_config(st)
        if st.config_error is not None and not self._config_said:
            self._config_said = True
            self.on_warning(f"{st.config_error}: the rules use the default monitor thresholds")
        if self.stale_after is not None:
            mon = mon.model_copy(update={"stale_s": self.stale_after})
        summ = summarize(st, now, mon.stale_s)
        hits = evaluate(self.alert_rules + [r for r in self.halt_rules if r.name not in self._alert_names],
                        st, now, mon)
        if summ.status == "running" and any(h.rule == "stale" for h in hits):
            summ.status = "stale"  # a stale alarm (e.g. --alert-on stale=15) is what the header says
        elif summ.status in ("completed", "halted", "failed", "crashed") and st.new_session_pending():
            summ.status = "resuming"  # a --resume holds the lock; its boot line is still to come
        had = bool(self.halted)
        self._maybe_halt(st, summ, hits, now, mon)
        snap = Snapshot(st, summ, hits, mon, now, wrote_halt=bool(self.halted) and not had)
        snap.new, snap.cleared = self.log.update(hits, now)
        self._keep(snap)
        cmd = (self.notify_cmd if self.notify_cmd is not None else mon.notify) or None
        if cmd:
            for a in snap.new:
                err = notify(cmd, a.payload(st.run_name, summ.host), self.notify_timeout)
                if err is not None:
                    self.on_warning(f"notify command for alarm {a.rule} failed: {err}")
        return snap

    def _keep(self, snap: Snapshot) -> None:
        """Write new and cleared alarms to ``RUN/alarms.jsonl`` (an alarm already open there is not
        repeated)."""
        if self._kept is None or not (snap.new or snap.cleared):
            return
        session = snap.state.session_start
        try:
            open_now = self._kept.open_rules(session)
            for a in snap.new:
                if a.rule not in open_now:
                    self._kept.write("alarm", a.rule, a.message, a.evidence, a.since, session)
            for a in snap.cleared:
                if a.rule in open_now:
                    self._kept.write("cleared", a.rule, a.message, a.evidence, snap.time, session)
        except OSError as exc:
            self.on_warning(f"could not keep alarms: {write_failure(exc, self._kept.path)}")
            self._kept = None

    def _maybe_halt(self, st: RunState, summ: RunSummary, hits: list[RuleHit], now: float,
                    mon: MonitorConfig) -> None:
        if not self.halt_rules or self.halted or st.end is not None or st.halt_file is not None:
            return
        if summ.status == "crashed":
            return
        firing = [h for h in evaluate(self.halt_rules, st, now, mon) if h.rule != "crashed"]
        if not firing:
            return
        h = firing[0]
        try:
            rec = write_halt(self.reader.run_dir, watchdog_reason(h.rule, h.message),
                             who=who_am_i("nsa watch"), rule=h.rule, evidence=h.evidence)
        except NSAError as exc:  # a read-only run directory: one line, and the watch stops
            raise RunDirError(f"watchdog rule {h.rule} fired but {exc.message}", exc.hint) from None
        self.halted.append(rec)
        st.halt_file = rec
        if h.rule not in {x.rule for x in hits}:
            hits.append(h)

    def payload(self, snap: Snapshot) -> dict[str, Any]:
        """The machine-readable view of a snapshot (``--json``)."""
        return {"summary": snap.summary.to_dict(), "alarms": [h.to_dict() for h in snap.alarms],
                "rules": [r.describe() for r in resolve(self.alert_rules, snap.monitor)],
                "halt_rules": [r.describe() for r in resolve(self.halt_rules, snap.monitor)],
                "halt_written": self.halted[0] if self.halted else None}

    def crash(self, snap: Snapshot) -> RuleHit | None:
        """The crash alarm of a crashed run (evaluated even when ``crashed`` is not an alert rule)."""
        hit = next((h for h in snap.alarms if h.rule == "crashed"), None)
        if hit is None:
            hit = next(iter(evaluate([ArmedRule("crashed")], snap.state, time.time(),
                                     monitor_config(snap.state))), None)
        return hit

    def halted_the_run(self, snap: Snapshot) -> bool:
        """This watchdog wrote the ``.HALT`` that ended the run (a ``halt`` event after it was written)."""
        if not self.halted or snap.state.end is None:
            return False
        t = float(self.halted[-1].get("time", 0))
        return any(isinstance(h.get("ts"), int | float) and h["ts"] >= t - 1.0 for h in snap.state.halts)

    @property
    def alerts_on_crash(self) -> bool:
        return "crashed" in self._alert_names


def finished(snap: Snapshot, now: float) -> bool:
    """The run is over: crashed, or every rank wrote its end event (or rank 0 did long enough ago), and no
    new session is starting (a ``--resume`` that holds the run lock: the watch waits for its ``boot``)."""
    if snap.summary.status == "resuming":
        return False
    if snap.summary.status == "crashed":
        return True
    end = snap.state.end
    if end is None:
        return False
    if all(r.end is not None for r in snap.state.ranks.values()):
        return True
    return isinstance(end.get("ts"), int | float) and now - float(end["ts"]) > ENDED_GRACE_S


def follow(dog: Watchdog, refresh_s: float, timeout_s: float | None = None,
           clock: Callable[[], float] = time.monotonic) -> Iterator[Snapshot]:
    """``nsa watch``'s loop: a snapshot at once, then one every ``refresh_s`` seconds until the run is over
    (:func:`finished`) or ``timeout_s`` seconds have passed since the call."""
    start = clock()
    snap = dog.poll()
    yield snap
    while not finished(snap, snap.time) and (timeout_s is None or clock() - start <= timeout_s):
        time.sleep(refresh_s)
        snap = dog.poll()
        yield snap


def exit_code(dog: Watchdog, snap: Snapshot, once: bool = False) -> int:
    """What ``nsa watch`` exits with after ``snap``: 1 when the run failed or crashed (``once``: also when an
    alarm fires), 3 when this watchdog's ``.HALT`` stopped it, else 0."""
    if snap.summary.status in ("failed", "crashed") or (once and snap.alarms):
        return 1
    return EXIT_WATCHDOG if not once and dog.halted_the_run(snap) else 0


def line_record(dog: Watchdog, snap: Snapshot) -> dict[str, Any]:
    """One refresh as a JSON line (``nsa watch --json`` in live mode)."""
    s = snap.summary
    return {"time": snap.time, "status": s.status, "step": s.steps_done, "steps_total": s.steps_total,
            "loss": s.last_loss, "tokens_per_s": s.tokens_per_s_last, "eta_s": s.eta_s,
            "new_alarms": [a.rule for a in snap.new], "cleared_alarms": [a.rule for a in snap.cleared],
            **dog.payload(snap)}
