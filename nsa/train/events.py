"""What the trainer tells people, as structured events: whoever listens renders them (the CLI draws a
Rich progress bar and colours, :class:`PlainReporter` writes plain lines), and every event with text is
also a plain, time-stamped line in the run's log file (``train.log``; ``train_rank{r}.log`` on other ranks).

Texts are plain (no markup): a renderer must not interpret brackets in them (config values such as
``[1, 0, 0]`` appear verbatim). ``tone`` says how a line may be emphasised.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

Kind = Literal["start", "message", "warning", "step", "log", "stop"]
Tone = Literal["plain", "headline", "good", "caution", "bad"]


@dataclass(frozen=True)
class Event:
    """``start`` (``step`` of ``total``), ``message``/``warning`` (``text``, ``tone``), ``step`` (a finished
    step; ``row`` on log steps: loss, tokens/s, eta), ``log`` (``row`` and its ``text`` line), ``stop``."""

    kind: Kind
    step: int = 0
    total: int = 0
    text: str = ""
    tone: Tone = "plain"
    row: dict[str, Any] | None = None

    def figures(self) -> dict[str, str]:
        """A log step's figures as a progress bar shows them: ``loss``, ``tps`` (tokens/s), ``eta``."""
        row = self.row or {}
        return {"loss": f"{row['loss']:.4f}", "tps": rate_text(row.get("tokens_per_s")),
                "eta": eta_text(row.get("eta_s"))}


Reporter = Callable[[Event], None]


def eta_text(seconds: float | None) -> str:
    return "?" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def rate_text(tps: float | None) -> str:
    if tps is None:
        return "?"
    return f"{tps / 1000:.1f}k" if tps >= 1000 else f"{tps:.0f}"


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def log_line(row: dict[str, Any], total: int) -> str:
    """The one line of a log step (``train.log`` and consoles without a progress bar)."""
    return (
        f"step {row['step']:>6}/{total} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"grad {row['grad_norm']:.2f} | {rate_text(row['tokens_per_s'])} tok/s | "
        f"{row['step_time_s'] * 1000:.0f} ms/step | fetch p50/p95 {_ms(row.get('fetch_p50_ms'))}/"
        f"{_ms(row.get('fetch_p95_ms'))} ms | eta {eta_text(row['eta_s'])}"
    )


def event_line(event: Event) -> str | None:
    """The plain text of an event (``None``: nothing to print)."""
    if event.kind == "warning":
        return f"WARNING {event.text}"
    if event.kind in ("message", "log"):
        return event.text
    return None


class PlainReporter:
    """Plain lines on a stream (default stdout): the reporter of library callers and tests."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout

    def __call__(self, event: Event) -> None:
        line = event_line(event)
        if line is not None:
            with contextlib.suppress(OSError, ValueError):
                print(line, file=self.stream, flush=True)

    def text(self) -> str:
        """What was written, when the stream keeps it (``io.StringIO``)."""
        getvalue = getattr(self.stream, "getvalue", None)
        return str(getvalue()) if callable(getvalue) else ""


class Output:
    """The trainer's side: events to ``reporter`` (only when ``enabled``, i.e. rank 0) and lines to the
    run's log file (every rank its own)."""

    def __init__(self, reporter: Reporter | None, total: int, enabled: bool = True) -> None:
        self.reporter: Reporter = reporter or PlainReporter()
        self.total = total
        self.enabled = enabled
        self._file: IO[str] | None = None

    def attach_log(self, path: Path) -> None:
        """Also write every line, time-stamped, to ``path`` (appended: a resume continues it)."""
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the run

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _emit(self, event: Event) -> None:
        line = event_line(event)
        if line is not None:
            self.record(line)
        if self.enabled:
            self.reporter(event)

    def record(self, line: str) -> None:
        """``line`` into the log file only (what was already said elsewhere, e.g. by a signal handler)."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk must not stop training output
                self._file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def start(self, step: int) -> None:
        self._emit(Event("start", step=step, total=self.total))

    def message(self, text: str, tone: Tone = "plain") -> None:
        self._emit(Event("message", text=text, tone=tone))

    def warn(self, text: str) -> None:
        self._emit(Event("warning", text=text, tone="bad"))

    def step(self, step: int, row: dict[str, Any] | None = None) -> None:
        self._emit(Event("step", step=step, total=self.total, row=row))

    def log(self, row: dict[str, Any]) -> None:
        self._emit(Event("log", step=int(row["step"]), total=self.total, text=log_line(row, self.total),
                         row=row))

    def stop(self) -> None:
        self._emit(Event("stop"))
