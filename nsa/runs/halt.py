"""Asking a run to stop: write ``.HALT`` atomically, then optionally follow the heartbeat until the
trainer acknowledges (``halt`` event, final checkpoint) or a timeout."""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nsa.errors import NSAError
from nsa.rundir import RunDir
from nsa.rundir.layout import HALT_FILE, WATCHDOG_PREFIX, read_halt
from nsa.rundir.records import HaltEvent, HaltFile
from nsa.runs.reader import DEFAULT_STALE_S, RunReader, check_run_dir
from nsa.view import Block, Line, Result


def who_am_i(tool: str = "nsa halt") -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()} ({tool}, pid {os.getpid()})"


@contextlib.contextmanager
def _halt_lock(run: Path) -> Iterator[None]:
    """Writers of one run's ``.HALT`` one at a time (``flock`` on the run directory; where the filesystem
    has no locks, none)."""
    try:
        fd = os.open(run, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_halt(
    run_dir: str | Path,
    reason: str,
    *,
    who: str | None = None,
    rule: str | None = None,
    evidence: dict[str, Any] | None = None,
) -> HaltFile:
    """Write ``RUN_DIR/.HALT`` (JSON) atomically: a temporary file renamed over the target.

    A request still pending (a ``.HALT`` the trainer has not acted on yet) is kept: the file then holds every
    request under ``requests`` and their reasons joined by ``; `` (two operators halting at once both stay on
    record; writers take turns). Raises ``NSAError`` naming the directory when it cannot be written."""
    run = Path(run_dir)
    record: HaltFile = {"reason": reason, "time": time.time(), "who": who or who_am_i()}
    if rule is not None:
        record["rule"] = rule
    if evidence is not None:
        record["evidence"] = evidence
    tmp = run / f".HALT.tmp-{os.getpid()}-{time.time_ns()}"
    try:
        with _halt_lock(run):
            merged = _merge(read_halt(run), record)
            tmp.write_text(json.dumps(merged, indent=2, default=str) + "\n")
            os.replace(tmp, RunDir(run).halt)
    except OSError as exc:
        raise NSAError(
            f"could not write {HALT_FILE} in {run}: {exc.strerror or exc}",
            hint="make the run directory writable, or send the trainer SIGTERM: it checkpoints and stops too",
        ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return merged


def _merge(pending: HaltFile | None, record: HaltFile) -> HaltFile:
    """``record`` after the ``pending`` request(s): all under ``requests``, the reasons joined, the first
    watchdog rule (and its evidence) kept."""
    if pending is None:
        return record
    earlier = pending.get("requests") or [{k: v for k, v in pending.items() if k != "requests"}]
    requests = [*earlier, record]
    merged: HaltFile = {**record, "reason": "; ".join(str(r.get("reason") or "") for r in requests),
                        "requests": requests}  # type: ignore[typeddict-item]
    ruled = next((r for r in requests if isinstance(r.get("rule"), str)), None)
    if ruled is not None:
        merged["rule"] = ruled["rule"]
        if "evidence" in ruled:
            merged["evidence"] = ruled["evidence"]
    return merged


@dataclass
class HaltOutcome(Result):
    """What happened after asking: ``acknowledged``, ``ended`` (finished another way), ``crashed``,
    ``timeout``, ``written`` (no wait) or ``already-ended`` (nothing written)."""

    outcome: str
    message: str
    run_dir: str
    halt: HaltFile | None = None
    checkpoint: str | None = None
    end_status: str | None = None
    step: int | None = None
    waited_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome in ("acknowledged", "written", "already-ended", "ended")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def view(self) -> list[Block]:
        return [Line(f"{self.outcome}: {self.message}", self.outcome, lead=len(self.outcome))]


def wait_for_ack(
    reader: RunReader, since: float, timeout_s: float, poll_s: float = 0.5, stale_s: float = DEFAULT_STALE_S
) -> HaltOutcome:
    """Follow the heartbeat until a ``halt`` (and then ``end``) event after ``since``, or a timeout."""
    t0 = time.monotonic()
    run = str(reader.run_dir)
    halt_ev: HaltEvent | None = None
    while True:
        st = reader.poll()
        if halt_ev is None:
            halt_ev = next((h for h in st.halts if float(h.get("ts", 0)) >= since - 1.0), None)
        end = st.end
        if end is not None and float(end.get("ts", 0)) >= since - 1.0:
            ck = (halt_ev or {}).get("checkpoint")
            if ck is None:
                ck = next((c.get("path") for c in reversed(st.checkpoints) if c.get("reason") == "halt"),
                          None)
            status = str(end.get("status"))
            waited = time.monotonic() - t0
            if halt_ev is not None or status == "halted":
                where = f"checkpoint {ck}" if ck else "no checkpoint recorded"
                return HaltOutcome("acknowledged", f"run halted at step {end.get('step')} ({where})", run,
                                   checkpoint=ck, end_status=status, step=end.get("step"), waited_s=waited)
            return HaltOutcome("ended", f"run ended with status {status} before acting on the halt", run,
                               end_status=status, step=end.get("step"), waited_s=waited)
        if st.status(time.time(), stale_s) == "crashed":
            return HaltOutcome("crashed",
                               f"trainer process is gone without an end event (last step {st.steps_done})",
                               run, step=st.steps_done, waited_s=time.monotonic() - t0)
        if time.monotonic() - t0 >= timeout_s:
            seen = "saw its halt event but no end yet" if halt_ev else "no halt event yet"
            return HaltOutcome("timeout", f"no acknowledgement within {timeout_s:g} s ({seen}; last step "
                               f"{st.steps_done})", run, step=st.steps_done, waited_s=timeout_s)
        time.sleep(poll_s)


def halted_by_watchdog(run_dir: str | Path) -> bool:
    """Whether the run's latest session ended halted by the watchdog (``nsa watch --halt-on``): its ``halt``
    event's reason starts with ``watchdog:``. What a launcher of several ranks exits with
    (``EXIT_WATCHDOG``)."""
    st = RunReader(run_dir, check=False).poll(final=True)
    t0 = st.session_start or 0.0
    if st.end is None or st.end.get("status") != "halted":
        return False
    halts = [h for h in st.halts if isinstance(h.get("ts"), int | float) and h["ts"] >= t0]
    return bool(halts) and str(halts[-1].get("reason") or "").startswith(WATCHDOG_PREFIX)


def halt_run(
    run_dir: str | Path,
    reason: str = "operator request",
    *,
    wait: bool = False,
    timeout_s: float = 600.0,
    who: str | None = None,
    poll_s: float = 0.5,
    force: bool = False,
) -> HaltOutcome:
    """Ask the trainer of ``run_dir`` to checkpoint and stop; with ``wait`` follow it until it does."""
    path = check_run_dir(run_dir)
    reader = RunReader(path)
    st = reader.poll()
    if st.end is not None and not force:
        return HaltOutcome("already-ended",
                           f"run already ended (status {st.end.get('status')}); nothing written",
                           str(path), end_status=str(st.end.get("status")), step=st.end.get("step"))
    record = write_halt(path, reason, who=who)
    if not wait:
        return HaltOutcome("written", f"wrote {RunDir(path).halt}; the trainer stops at its next step",
                           str(path), halt=record, step=st.steps_done)
    out = wait_for_ack(reader, record["time"], timeout_s, poll_s)
    out.halt = record
    return out
