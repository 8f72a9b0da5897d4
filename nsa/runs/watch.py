"""``nsa watch`` as one call: :func:`open_watch` waits for the run to start (as asked), sets up its
:class:`~nsa.runs.watchdog.Watchdog` and returns a :class:`Watch`: the snapshots to show, and what each says
as a JSON record, as plain log lines, as a dashboard (:mod:`nsa.runs.dashboard`) and as an exit code."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa.errors import RunDirError
from nsa.fileio import json_safe
from nsa.runs.dashboard import Dashboard, dashboard, status_line
from nsa.runs.reader import RunReader, check_run_dir, may_become_run, run_started, wait_for_run
from nsa.runs.rules import now_iso, parse_rules
from nsa.runs.watchdog import Snapshot, Watchdog, exit_code, follow, line_record
from nsa.view import Result, option


@dataclass
class WatchRequest:
    """What ``nsa watch`` was asked (its ``--help`` says each)."""

    run_dir: Path
    once: bool = option(False, "--once", "Print one snapshot and exit.")
    wait: bool | None = option(None, "--wait", "Wait for a run directory that does not exist yet or has no "
                               "heartbeat yet (default: wait in live mode, not with --once).", switch=True)
    alert_on: str | None = option(None, "--alert-on", "Rules that raise an alarm (default all; thresholds "
                                  "from the run's monitor config), e.g. all,stale=60 or none.")
    halt_on: str | None = option(None, "--halt-on", "Watchdog rules that write .HALT (e.g. all, "
                                 "stale=600,nonfinite).")
    notify: str | None = option(None, "--notify", "Shell command run once per new alarm with the alarm as "
                                "JSON on stdin (default: the run's monitor.notify in live mode; '' for "
                                "none).")
    notify_timeout: float = option(10.0, "--notify-timeout", "Seconds a --notify command may run.", min=0.1)
    refresh: float = option(2.0, "--refresh", "Seconds between reads.", min=0.01)
    stale_after: float | None = option(None, "--stale-after", "Heartbeat age (s) for the stale status and "
                                       "rule (default: monitor.stale_s).", min=1)
    timeout: float | None = option(None, "--timeout", "Stop after this many seconds (waiting included).",
                                   min=0)


@dataclass
class OnceResult(Result):
    """``--once``: one snapshot, its JSON and its exit code (the dashboard is the CLI's to draw)."""

    watch: Watch
    snap: Snapshot

    def to_dict(self) -> dict[str, Any]:
        return {**self.watch.dog.payload(self.snap), "config": self.snap.state.config,
                "env": self.snap.state.env}

    @property
    def exit_code(self) -> int:
        return exit_code(self.watch.dog, self.snap, once=True)


class Watch:
    """A run's watchdog and how what it sees reads."""

    def __init__(self, req: WatchRequest, reader: RunReader, warn: Callable[[str], None]) -> None:
        self.req, self.reader = req, reader
        self.dog = Watchdog(reader, parse_rules("all" if req.alert_on is None else req.alert_on),
                            parse_rules(req.halt_on),
                            notify_cmd=(req.notify or "") if req.once else req.notify,
                            notify_timeout=req.notify_timeout, stale_after=req.stale_after, on_warning=warn)
        self.gpu_local: bool | None = None
        self.announced_halt: list[Any] = []  # the .HALT times already reported (lines mode)
        self.start = time.monotonic()

    def once(self) -> OnceResult:
        return OnceResult(self, self.dog.poll(final=True))

    def follow(self) -> Iterator[Snapshot]:
        """Snapshots until the run is over (or ``--timeout``, waiting included)."""
        left = None if self.req.timeout is None else max(0.0,
                                                         self.req.timeout - (time.monotonic() - self.start))
        return follow(self.dog, self.req.refresh, left)

    def exit_code(self, snap: Snapshot) -> int:
        return exit_code(self.dog, snap)

    def dashboard(self, snap: Snapshot) -> Dashboard:
        return dashboard(snap.state, snap.summary, snap.alarms, self.gpus(), log=self.dog.log)

    def gpus(self) -> Any:
        """This host's GPUs (NVML) when the run trains here on CUDA, else None."""
        from nsa.gpuinfo import query_gpus

        boot = self.reader.state.boot
        if self.gpu_local is None and boot is not None:
            self.gpu_local = (boot.get("host") in (None, socket.gethostname())
                              and str((self.reader.state.env or {}).get("device", "")).startswith("cuda"))
        return query_gpus(details=False) if self.gpu_local else None

    def halt_written(self) -> str | None:
        return f"watchdog wrote .HALT: {self.dog.halted[0]['reason']}" if self.dog.halted else None

    def json_line(self, snap: Snapshot) -> str:
        return json.dumps(json_safe(line_record(self.dog, snap)), default=str)

    def lines(self, snap: Snapshot) -> list[str]:
        """A refresh as plain log lines: the status, new and cleared alarms, a .HALT written, pending or acted
        on."""
        st, summ, stamp = snap.state, snap.summary, now_iso(snap.time)
        out = [status_line(summ, snap.alarms, snap.time)]
        out += [f"{stamp} ALARM {a.rule}: {a.message}" for a in snap.new]
        out += [f"{stamp} cleared {a.rule} (since {now_iso(a.since)})" for a in snap.cleared]
        if snap.wrote_halt:
            out.append(f"{stamp} {self.halt_written()}")
        ph = summ.pending_halt
        if ph is not None and ph.get("time") not in self.announced_halt:
            self.announced_halt.append(ph.get("time"))
            out.append(f"{stamp} pending .HALT: {ph.get('reason')} ({ph.get('who') or 'unknown'})")
        # acted on (the trainer retires the file into halts/), or removed
        elif ph is None and self.announced_halt:
            since = self.announced_halt.pop()
            acted = [h for h in st.halts if not isinstance(since, int | float) or float(h.get("ts", 0))
                     >= since - 1.0]
            if acted or st.end is not None:
                out.append(f"{stamp} .HALT acted on at step "
                           f"{(acted[-1] if acted else st.end or {}).get('step')}")
            else:
                out.append(f"{stamp} .HALT removed before the trainer acted on it")
        return out

    def crash_line(self, snap: Snapshot, live: bool) -> str | None:
        """The crash alarm the refreshes did not say (live: always; a log: when crashed is no alert rule)."""
        if snap.summary.status != "crashed":
            return None
        crash = self.dog.crash(snap)
        if crash is None or not (live or not self.dog.alerts_on_crash):
            return None
        return f"ALARM crashed: {crash.message}" if live else f"{now_iso()} ALARM crashed: {crash.message}"


def open_watch(req: WatchRequest, say: Callable[[str], None], warn: Callable[[str], None]) -> Watch:
    """A watch over ``req.run_dir``: its rules checked, the run waited for (``say`` hears the one waiting
    line;
    ``RunDirError`` when it did not start within ``req.timeout``); ``warn`` hears what goes wrong on the
    way."""
    parse_rules(req.halt_on)
    parse_rules("all" if req.alert_on is None else req.alert_on)
    start = time.monotonic()
    path = Path(req.run_dir)
    if (not req.once if req.wait is None else req.wait) and not run_started(path):
        if not may_become_run(path):
            check_run_dir(path)
            raise RunDirError(f"{path} is not a run directory (no heartbeat, config.yaml or .lock)",
                              hint="give the train.out_dir of a run started by `nsa train`")
        what = "to appear" if not path.exists() else "to start (no heartbeat yet)"
        bound = f" (up to {req.timeout:g} s)" if req.timeout is not None else ""
        say(f"{now_iso()} waiting for run directory {path} {what}{bound}")
        if not wait_for_run(path, req.timeout, poll_s=min(req.refresh, 0.5)):
            raise RunDirError(f"run directory {path} did not start within {req.timeout:g} s",
                              hint="check the trainer's --out-dir, or give a longer --timeout")
    watch = Watch(req, RunReader(path), warn)
    watch.start = start
    return watch
