"""The trainer's events (``nsa.train.events.Event``) on a console: a Rich progress bar on a terminal, plain
log lines otherwise."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

TONE_STYLE = {"plain": "", "headline": "bold cyan", "good": "bold green", "caution": "bold yellow",
              "bad": "bold red"}


class RichReporter:
    """Renders the trainer's events (texts printed verbatim: never read as markup)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._progress: Progress | None = None
        self._task: Any = None

    def __call__(self, event: Any) -> None:
        kind = event.kind
        if kind == "start" and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  eta {task.fields[eta]}"),
                TimeElapsedColumn(), console=self.console, transient=False,
            )
            self._task = self._progress.add_task("train", total=event.total, completed=event.step, loss="?",
                                                 tps="?", eta="?")
            self._progress.start()
        elif kind == "message":
            self.console.print(Text(event.text, style=TONE_STYLE.get(event.tone, "")), soft_wrap=True)
        elif kind == "warning":
            self.console.print(Text.assemble(("WARNING", "bold red"), " ", event.text), soft_wrap=True)
        elif kind == "step" and self._progress is not None:
            if event.row is not None:
                self._progress.update(self._task, completed=event.step, **event.figures())
            else:
                self._progress.update(self._task, completed=event.step)
        elif kind == "log" and self._progress is None:
            self.console.print(Text(event.text), soft_wrap=True)
        elif kind == "stop" and self._progress is not None:
            self._progress.stop()
            self._progress = None
