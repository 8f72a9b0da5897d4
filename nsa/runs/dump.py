"""Asking a live trainer for its stacks (``nsa dump RUN``): SIGUSR1 to the process that holds the run lock
(``RUN/.lock`` names it; the process must hold that file open, so a reused PID is never signalled), and to
the other ranks of the run on this host; then wait for ``stackdump_rank{r}.txt`` to grow."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nsa.errors import RunDirError
from nsa.rundir.layout import LOCK_FILE, STACKDUMP, read_lock
from nsa.runs.reader import RunReader, check_run_dir, pid_alive
from nsa.view import Block, Line, Result


@dataclass
class DumpOutcome(Result):
    """``ok``: a dump appeared; ``message`` says what happened; ``text`` is what rank 0's file gained."""

    ok: bool
    message: str
    run_dir: str
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid signalled
    files: list[str] = field(default_factory=list)
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def view(self) -> list[Block]:
        """The stacks, then what happened (an error line on stderr when no dump appeared)."""
        stacks = [Line(self.text.rstrip(), wrap=False)] if self.text else []
        return [*stacks,
                Line(self.message, wrap=False) if self.ok else Line(f"error: {self.message}", err=True,
                                                                              wrap=False)]


def _holds_lock(pid: int, lock: Path) -> bool | None:
    """Whether process ``pid`` has ``lock`` open (the trainer keeps its lock's descriptor); None when it
    cannot be asked (another user's process)."""
    import psutil

    try:
        files = psutil.Process(pid).open_files()
    except psutil.AccessDenied:
        return None
    except psutil.Error:
        return False
    target = os.path.realpath(lock)
    return any(os.path.realpath(f.path) == target for f in files)


def trainer_pids(run_dir: str | Path) -> dict[int, int]:
    """``{rank: pid}`` of the run's live trainer processes on this host: rank 0 from ``RUN/.lock`` (it must
    hold the lock open), the other ranks from their latest ``boot`` line. ``RunDirError`` (one line) when
    there is no lock, the trainer runs on another host or belongs to another user; empty when it is not
    running."""
    run = check_run_dir(run_dir)
    holder = read_lock(run)
    if not holder or not isinstance(holder.get("pid"), int):
        raise RunDirError(f"{run} has no run lock ({LOCK_FILE}): no trainer has run there",
                          hint="give the train.out_dir of a run started by `nsa train`")
    if holder.get("host") not in (None, socket.gethostname()):
        raise RunDirError(f"the trainer of {run} runs on host {holder.get('host')} (PID {holder['pid']}), "
                          "not here", hint=f"run `nsa dump {run}` on {holder.get('host')}")
    pid = int(holder["pid"])
    if pid_alive(holder) is not True:
        return {}
    held = _holds_lock(pid, run / LOCK_FILE)
    if held is None:
        raise RunDirError(f"the trainer of {run} (PID {pid}) belongs to another user",
                          hint="run nsa dump as that user (or with sudo)")
    if not held:
        return {}  # the PID was reused by another process: the trainer is gone
    pids = {0: pid}
    st = RunReader(run).poll()
    for rank, rs in sorted(st.ranks.items()):
        boot = rs.boot or {}
        if rank != 0 and rs.end is None and pid_alive(boot) is True and isinstance(boot.get("pid"), int):
            pids[rank] = int(boot["pid"])
    return pids


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def dump_stacks(run_dir: str | Path, timeout_s: float = 10.0, poll_s: float = 0.1) -> DumpOutcome:
    """Send SIGUSR1 to the run's trainer processes on this host and wait up to ``timeout_s`` for rank 0's
    ``stackdump_rank0.txt`` to grow; the outcome holds the new text."""
    run = Path(run_dir)
    pids = trainer_pids(run)
    if not pids:
        holder = read_lock(run) or {}
        return DumpOutcome(False, f"the trainer of {run} (PID {holder.get('pid')}) is not running (the run "
                                  "ended or crashed); nothing to dump", str(run))
    files = {rank: run / STACKDUMP.format(rank=rank) for rank in pids}
    main = files[min(files)]
    start = _size(main)
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue  # a rank that exited since it was listed: nothing to dump there
        except PermissionError:
            raise RunDirError(f"not allowed to signal the trainer of {run} (PID {pid})",
                              hint="run nsa dump as the user who started the run") from None
    deadline = time.monotonic() + timeout_s
    while _size(main) <= start and time.monotonic() < deadline:
        time.sleep(poll_s)
    time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))  # let a dump being written finish
    text = ""
    if _size(main) > start:
        with open(main, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    grown = bool(text)
    shown = ", ".join(f"rank {r} PID {p}" for r, p in pids.items())
    message = (f"stacks of {shown} appended to {', '.join(str(f) for f in files.values())}" if grown else
               f"sent SIGUSR1 to {shown}, but {main} did not grow within {timeout_s:g} s (the trainer may "
               "still be starting: its dump handler is installed once set-up is done)")
    return DumpOutcome(grown, message, str(run), pids, [str(f) for f in files.values()], text)
