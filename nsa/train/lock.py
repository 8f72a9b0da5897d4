"""The one-writer lock of a run directory (``RUN/.lock``), torch-free: ``nsa train`` takes it before it
imports torch when it resumes a run, so ``nsa watch`` sees the new session coming within a second."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from nsa.errors import RunDirError
from nsa.rundir.layout import LOCK_FILE, read_lock


class RunLock:
    """The one-writer lock of a run directory: an exclusive ``flock`` on ``<run>/.lock`` held for the
    whole run. The kernel releases it when the process ends, however it ends (SIGKILL included), so a
    lock is never stale. The file names the holder (pid, host, start time) for the error a second
    writer gets; readers (``nsa watch``, ``report``, ``halt``) never take it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self._previous = b""  # the last holder's record, put back by abandon()

    def acquire(self) -> None:
        """Take the lock or raise ``RunDirError`` naming the process that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = read_lock(self.path.parent)
            who = (f"PID {holder.get('pid')} on {holder.get('host')}" if holder else "another process")
            raise RunDirError(
                f"run directory {self.path.parent} is in use by {who} (another nsa train is writing it)",
                hint=f"wait for it to end, stop it with: nsa halt {self.path.parent}, or choose another "
                     "--out-dir",
            ) from None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}) + "\n"
        with contextlib.suppress(OSError):
            self._previous = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self._fd = fd

    def abandon(self) -> None:
        """Release a lock taken for a start that was then refused (bad input): the file names the last holder
        again, so ``nsa dump`` and ``nsa watch`` are not pointed at a process that never trained."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._previous, 0)
        self.close()

    def close(self) -> None:
        """Release the lock (the file stays; its content names the last holder)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
