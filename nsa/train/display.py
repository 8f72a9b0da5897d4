"""Output for people: a Rich progress bar on a terminal (rank 0), plain log lines otherwise, and every
line also in the run's log file (``train.log``; ``train_rank{r}.log`` for other ranks)."""

from __future__ import annotations

import contextlib
import datetime
import time
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def _rate(tps: float | None) -> str:
    if tps is None:
        return "?"
    return f"{tps / 1000:.1f}k" if tps >= 1000 else f"{tps:.0f}"


class Display:
    """Step, loss, tokens/s and ETA; ``enabled=False`` (ranks other than 0) prints nothing."""

    def __init__(self, console: Console | None, steps_total: int, enabled: bool = True) -> None:
        self.console = console or Console()
        self.enabled = enabled
        self.steps_total = steps_total
        self._progress: Progress | None = None
        self._task: Any = None
        self._file: IO[str] | None = None
        self._file_console: Console | None = None

    def attach_log(self, path: Path) -> None:
        """Also write every line (plain text, time-stamped) to ``path`` (appended: a resume continues it)."""
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the run
        self._file_console = Console(file=self._file, width=200, color_system=None, force_terminal=False,
                                     highlight=False, soft_wrap=True)

    def _to_file(self, *args: Any, **kwargs: Any) -> None:
        if self._file_console is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        if args and isinstance(args[0], str):
            args = (f"{stamp} {args[0]}", *args[1:])
        else:
            self._file_console.print(stamp, end=" ")
        kwargs.pop("soft_wrap", None)
        with contextlib.suppress(OSError):  # a full disk must not stop training output
            self._file_console.print(*args, **kwargs)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._file_console = None

    def start(self, step: int) -> None:
        if not self.enabled or not self.console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  eta {task.fields[eta]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=self.steps_total, completed=step, loss="?", tps="?", eta="?")
        self._progress.start()

    def print(self, *args: Any, **kwargs: Any) -> None:
        self._to_file(*args, **kwargs)
        if self.enabled:
            kwargs.setdefault("soft_wrap", True)
            self.console.print(*args, **kwargs)

    def warn(self, message: str) -> None:
        self._to_file(f"[bold red]WARNING[/] {message}")
        if self.enabled:
            self.console.print(f"[bold red]WARNING[/] {message}", soft_wrap=True)

    def step(self, step: int, loss: float | None = None, tps: float | None = None, eta_s: float | None = None) -> None:
        if self._progress is not None and loss is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tps=_rate(tps), eta=_eta(eta_s))
        elif self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log(self, row: dict[str, Any]) -> None:
        """One plain line per log step: in the log file always, on the console when there is no live
        progress bar."""
        line = (
            f"step {row['step']:>6}/{self.steps_total} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad {row['grad_norm']:.2f} | {_rate(row['tokens_per_s'])} tok/s | "
            f"{row['step_time_s'] * 1000:.0f} ms/step | fetch p50/p95 {_ms(row.get('fetch_p50_ms'))}/"
            f"{_ms(row.get('fetch_p95_ms'))} ms | eta {_eta(row['eta_s'])}"
        )
        self._to_file(line, markup=False)
        if not self.enabled or self._progress is not None:
            return
        self.console.print(line, highlight=False, soft_wrap=True, markup=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
