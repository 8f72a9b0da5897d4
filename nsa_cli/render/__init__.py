"""The one output sink of the commands: what reaches stdout and stderr is written here, and nowhere else in
the CLI. :class:`Output` renders a library result (``nsa.view.Result``) as JSON or as its view (lines and
tables, as Rich renders them: colours off under NO_COLOR or when not a terminal, wide when piped)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

# the view's style names (nsa.view) as Rich styles; any other name is used as a Rich style itself
STYLES = {"good": "bold green", "caution": "bold yellow", "bad": "bold red", "headline": "bold cyan",
          "ok": "green", "warn": "yellow", "poor": "red", "strong": "bold", "PASS": "bold green",
          "WARN": "bold yellow", "FAIL": "bold red", "RUNNING": "bold cyan", "INCOMPLETE": "bold yellow",
          "acknowledged": "green", "written": "green", "timeout": "red", "crashed": "red", "ended": "yellow",
          "already-ended": "yellow"}
SPARK = "▁▂▃▄▅▆▇█"


def console(stderr: bool = False, width: int | None = None) -> Console:
    """A console: colours off under NO_COLOR or when not a terminal (Rich's own rules), wide when piped."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=width or (None if stream.isatty() else 120), highlight=False,
                   soft_wrap=False)


def echo(text: str, err: bool = False, nl: bool = True) -> None:
    """A line as it is (no colour, no wrapping): errors, usage lines, JSON lines, streamed text."""
    typer.echo(text, err=err, nl=nl)


def error(message: str, hint: str | None = None) -> None:
    """``error: message (hint: ...)`` on stderr."""
    echo(f"error: {message}" + (f" (hint: {hint})" if hint else ""), err=True)


def table(t: Any) -> Table:
    """A view's table (``nsa.view.Table``) as a Rich table."""
    out = Table(title=t.title, caption=t.caption, title_justify="left" if t.title_left else "center")
    get = STYLES.get  # a style name of the view, else a Rich style
    for c in t.columns:
        out.add_column(c.name, justify=c.justify, style=get(c.style, c.style) or None, no_wrap=c.no_wrap)
    for row in t.rows:
        out.add_row(*(Text(c) if isinstance(c, str) else Text(c[0], style=get(c[1], c[1])) for c in row))
    return out


class Output:
    """A command's one output sink (as the ``hf`` CLI's). With ``--json`` (or ``--json-out -``) the result's
    JSON is the only thing on stdout and every human line goes to stderr; without it the human lines and
    tables go to stdout. ``json_out``: the JSON also written to that file (said in one line).
    ``always_human``: the view is shown with the JSON too (on stderr: the benchmarks, eval); ``wide``: tables
    200 columns wide."""

    def __init__(self, as_json: bool = False, json_out: Path | None = None, *, always_human: bool = False,
                 wide: bool = False) -> None:
        self.as_json = as_json or str(json_out) == "-"
        self.json_out = None if json_out is None or str(json_out) == "-" else Path(json_out)
        self.always_human = always_human
        self.console = console(stderr=self.as_json, width=200 if wide else None)

    def say(self, text: str, style_name: str = "", err: bool = False, lead: int = 0,
            wrap: bool = True) -> None:
        """A human line (printed verbatim: never read as markup), in ``style_name`` (its first ``lead``
        characters only, when given); ``err``: on stderr in every mode; ``wrap``: at the console's width."""
        line = Text(text)
        if style_name:
            line.stylize(STYLES.get(style_name, style_name), 0, lead or len(text))
        (console(stderr=True) if err and not self.as_json else self.console).print(line, soft_wrap=not wrap)

    def show(self, blocks: list[Any]) -> None:
        """A view (``nsa.view`` blocks): its lines and tables, in order."""
        for b in blocks:
            if hasattr(b, "columns"):
                self.console.print(table(b))
            else:
                self.say(b.text, b.style, b.err, b.lead, b.wrap)

    def result(self, res: Any) -> int:
        """``res`` (``nsa.view.Result``): its view (unless only JSON is asked for), its JSON file and JSON on
        stdout as asked (none for a result without a payload: a launcher, another rank's); its exit code."""
        if not self.as_json or self.always_human:
            self.show(res.view())
        if res.to_dict() is None:
            return int(res.exit_code)
        if self.json_out is not None:
            try:
                self.json_out.parent.mkdir(parents=True, exist_ok=True)
                self.json_out.write_text(res.json_file_text() + "\n")
            except OSError as exc:
                error(f"cannot write --json-out {self.json_out}: {exc.strerror or exc}",
                      "choose a writable path")
                return 2
            self.say(f"saved {self.json_out}", wrap=False)
        if self.as_json:
            sys.stdout.write(res.to_json() + "\n")
        return int(res.exit_code)

    def stream(self, piece: str) -> None:
        """Generated text as it comes (no newline)."""
        echo(piece, nl=False)


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode blocks for the last ``width`` finite values."""
    vals = [v for v in values if isinstance(v, int | float) and math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1)) if span > 0 else 3] for v in vals)


def fit_left(text: str, width: int) -> str:
    """``text``, or its end with a leading ``…`` when longer than ``width`` (paths keep their tail)."""
    if width <= 0:
        return ""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def fit(text: str, width: int) -> str:
    """``text``, or its start with a trailing ``…`` when longer than ``width``."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[:width - 1] + "…"


def pack(segments: list[str], width: int, sep: str = " | ") -> list[str]:
    """Segments joined by ``sep`` into lines of at most ``width`` characters, never splitting a segment
    (a segment longer than a line is shortened with ``…``)."""
    lines: list[str] = []
    cur = ""
    for seg in (fit(s, width) for s in segments if s):
        if cur and len(cur) + len(sep) + len(seg) <= width:
            cur += sep + seg
        else:
            if cur:
                lines.append(cur)
            cur = seg
    if cur:
        lines.append(cur)
    return lines
