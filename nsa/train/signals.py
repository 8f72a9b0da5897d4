"""Operator signals. Handlers only set flags (or dump stacks); the training loop acts on them.

SIGTERM / SIGINT: halt gracefully (checkpoint, ``halt`` event, exit 0). A second SIGINT (Ctrl-C twice)
stops at once; repeated SIGTERMs do not (a scheduler and torchrun may both send one).
SIGUSR1: append the stacks of all threads to ``stackdump_rank{r}.txt`` (works even while the main
thread is blocked inside C code, e.g. a stuck collective). SIGUSR2: save a checkpoint now and continue.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import IO


class SignalFlags:
    """Flags set by signal handlers; ``install`` / ``uninstall`` manage the handlers."""

    def __init__(self) -> None:
        self.halt_source: str | None = None  # "SIGTERM" or "SIGINT" once asked to halt
        self.save_now = False
        self._previous: dict[int, object] = {}
        self._dump_file: IO[str] | None = None

    # -- handlers ---------------------------------------------------------------------------------
    def _on_halt(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.halt_source is not None and signum == signal.SIGINT:  # Ctrl-C twice: stop now
            raise KeyboardInterrupt(f"{name} received twice")
        if self.halt_source is None:  # repeated SIGTERMs (scheduler + torchrun) keep the graceful halt
            self.halt_source = name

    def _on_save(self, signum: int, frame: FrameType | None) -> None:
        self.save_now = True

    # -- management -------------------------------------------------------------------------------
    def install(self, stackdump_path: Path | None = None) -> None:
        """Install handlers (main thread only; elsewhere this is a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in (
            (signal.SIGTERM, self._on_halt),
            (signal.SIGINT, self._on_halt),
            (signal.SIGUSR2, self._on_save),
        ):
            self._previous[sig] = signal.signal(sig, handler)
        if stackdump_path is not None:
            self._dump_file = open(stackdump_path, "a")  # noqa: SIM115 - kept open for faulthandler
            faulthandler.register(signal.SIGUSR1, file=self._dump_file, all_threads=True, chain=False)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._dump_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._dump_file.close()
            self._dump_file = None
