"""Operator signals. Handlers only set flags (or dump stacks); the training loop acts on them.

SIGTERM / SIGINT: halt gracefully (checkpoint, ``halt`` event, exit 0), said at once on stderr. A second
SIGINT (Ctrl-C twice) stops at once (``KeyboardInterrupt``; the run is recorded ``interrupted``), except
inside a checkpoint write (:meth:`SignalFlags.critical`): that write is finished first and the stop comes
right after it; a third Ctrl-C stops at once and the partial checkpoint is dropped (the write's own error,
``torch.save``'s ``RuntimeError`` around the interrupt, becomes that ``KeyboardInterrupt``). Repeated SIGTERMs
do not stop at once (a scheduler and torchrun may both send one).
One request is one signal: the same signal again within :data:`SAME_REQUEST_S` seconds is a copy, not a
second request. A signal sent to a process group reaches the trainer and its parent, and ``uv run`` forwards
it once more (SIGTERM at once, SIGINT 200 ms later): without this, one SIGINT from a scheduler read as
Ctrl-C twice. For the same reason the handlers stay a moment after the run ends
(:meth:`SignalFlags.uninstall`), so a copy still on its way does not kill a process that halted cleanly.
SIGUSR1: append the stacks of all threads to ``stackdump_rank{r}.txt``. The C-level signal handler
writes the signal number to a wakeup pipe (``signal.set_wakeup_fd``) and a dumper thread formats
``sys._current_frames()`` under the GIL, so the dump works while the main thread is blocked inside C
code that released the GIL (a stuck collective, a stalled read) and never reads another thread's
frames while that thread runs (``faulthandler``'s all-thread dump can crash the process that way).
SIGUSR2: save a checkpoint now and continue.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO

INTERRUPTED = "SIGINT received twice (Ctrl-C)"  # the KeyboardInterrupt's text: the operator's abort
SAME_REQUEST_S = 1.0  # the same signal again within this many seconds is a copy of the first (uv run: 200 ms)


def is_copy(signum: int, last: tuple[int, float] | None, now: float) -> bool:
    """A signal ``signum`` at ``now`` (monotonic seconds) repeats ``last`` (its number and time) within
    :data:`SAME_REQUEST_S`: one request delivered twice."""
    return last is not None and last[0] == signum and now - last[1] < SAME_REQUEST_S


class SignalFlags:
    """Flags set by signal handlers; ``install`` / ``uninstall`` manage the handlers."""

    def __init__(self) -> None:
        self.halt_source: str | None = None  # "SIGTERM" or "SIGINT" once asked to halt
        self.save_now = False
        self.abort_pending = False  # Ctrl-C twice inside a checkpoint write: stop when it is complete
        self.said: list[str] = []  # what the handlers said on stderr (the trainer copies it to its log)
        self._critical = 0
        self._last: tuple[int, float] | None = None  # the last signal acted on: number, monotonic time
        self._dropping = False  # a third Ctrl-C cut a checkpoint write
        self._closing = False
        self._previous: dict[int, object] = {}
        self._dump_file: IO[str] | None = None
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._dumper: threading.Thread | None = None

    # -- handlers ---------------------------------------------------------------------------------
    def _on_halt(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._closing:  # the run is over; a copy of its last signal is no new request
            return
        if is_copy(signum, self._last, now):
            self._say(f"{name} again within {SAME_REQUEST_S:g} s: the same request (a copy, e.g. forwarded "
                      f"by uv run), not a second one")
            return
        self._last = (signum, now)
        if self.halt_source is not None and signum == signal.SIGINT:  # Ctrl-C twice: stop now
            if self._critical and not self.abort_pending:
                self.abort_pending = True
                self._say("Ctrl-C again: stopping as soon as the checkpoint being written is complete "
                          "(Ctrl-C once more drops it)")
                return
            self._say("Ctrl-C again: stopping now" + (", dropping the partial "
                                                      "checkpoint" if self._critical else ""))
            self._dropping = bool(self._critical)
            raise KeyboardInterrupt(INTERRUPTED)
        if self.halt_source is None:  # repeated SIGTERMs (scheduler + torchrun) keep the graceful halt
            self.halt_source = name
            again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            self._say(f"{name} received: halting after this step with a checkpoint{again}")

    def _say(self, text: str) -> None:
        """One line on stderr now (a handler may run while the main thread writes to ``sys.stderr``: then
        straight to file descriptor 2)."""
        self.said.append(text)
        line = f"{text}\n"
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (RuntimeError, OSError, ValueError, AttributeError):  # a reentrant call, a closed stream
            with contextlib.suppress(OSError):
                os.write(2, line.encode())

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A stretch that a second Ctrl-C must not cut (a checkpoint write): the stop it asks for comes
        right after (``KeyboardInterrupt``); a third Ctrl-C still cuts it."""
        self._critical += 1
        try:
            yield
        except BaseException as exc:
            # torch.save's RuntimeError around it
            if self._dropping and not isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt(INTERRUPTED) from None
            raise
        finally:
            self._critical -= 1
        if not self._critical and self.abort_pending:
            raise KeyboardInterrupt(INTERRUPTED)

    def _on_save(self, signum: int, frame: FrameType | None) -> None:
        self.save_now = True

    # -- management -------------------------------------------------------------------------------
    def install(self, stackdump_path: Path | None = None) -> None:
        """Install handlers (main thread only; elsewhere this is a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._closing = False
        for sig, handler in (
            (signal.SIGTERM, self._on_halt),
            (signal.SIGINT, self._on_halt),
            (signal.SIGUSR2, self._on_save),
        ):
            self._previous[sig] = signal.signal(sig, handler)
        if stackdump_path is not None:
            self._dump_file = open(stackdump_path, "a")  # noqa: SIM115 - kept open for the dumper
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._pipe = (r, w)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._dumper = threading.Thread(target=self._dump_loop, args=(r,), name="nsa-stackdump",
                                            daemon=True)
            self._dumper.start()

    def _dump_loop(self, fd: int) -> None:
        """Wait for signal numbers on the wakeup pipe; on SIGUSR1 append every thread's stack."""
        while True:
            select.select([fd], [], [])
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:  # the write end was closed: uninstall
                return
            if signal.SIGUSR1 in data and self._dump_file is not None:
                with_stacks = dump_stacks()
                try:
                    self._dump_file.write(with_stacks)
                    self._dump_file.flush()
                except (OSError, ValueError):
                    return

    def uninstall(self) -> None:
        """Restore the previous handlers, first waiting out :data:`SAME_REQUEST_S` after the last signal (a
        copy of it still on its way is absorbed here, not by a default handler that would kill the
        process)."""
        self._closing = True
        if self._last is not None and self._previous:
            time.sleep(max(0.0, self._last[1] + SAME_REQUEST_S - time.monotonic()))
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            r, w = self._pipe
            os.close(w)  # the dumper reads end-of-file and returns
            if self._dumper is not None:
                self._dumper.join(timeout=5)
            os.close(r)
            self._pipe, self._dumper = None, None
        if self._dump_file is not None:
            self._dump_file.close()
            self._dump_file = None


def dump_stacks() -> str:
    """Every thread's Python stack, most recent call first, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"# stack dump {time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}"]
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread {names.get(ident, '?')} ({ident:#x}) (most recent call first):")
        for entry in reversed(traceback.extract_stack(frame)):
            lines.append(f'  File "{entry.filename}", line {entry.lineno} in {entry.name}')
    return "\n".join(lines) + "\n\n"
