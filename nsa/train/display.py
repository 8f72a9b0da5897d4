"""Output for people (rank 0): a Rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


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
        if self.enabled:
            kwargs.setdefault("soft_wrap", True)
            self.console.print(*args, **kwargs)

    def warn(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"[bold red]WARNING[/] {message}", soft_wrap=True)

    def step(self, step: int, loss: float | None = None, tps: float | None = None, eta_s: float | None = None) -> None:
        if self._progress is not None and loss is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tps=_rate(tps), eta=_eta(eta_s))
        elif self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log(self, row: dict[str, Any]) -> None:
        """One plain line per log step (only when there is no live progress bar)."""
        if not self.enabled or self._progress is not None:
            return
        self.console.print(
            f"step {row['step']:>6}/{self.steps_total} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad {row['grad_norm']:.2f} | {_rate(row['tokens_per_s'])} tok/s | "
            f"{row['step_time_s'] * 1000:.0f} ms/step | eta {_eta(row['eta_s'])}",
            highlight=False,
            soft_wrap=True,
        )

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
