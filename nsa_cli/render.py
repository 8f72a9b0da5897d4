"""Shared Rich helpers: consoles that respect NO_COLOR and non-terminals, tables, sparklines, JSON."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from nsa.fileio import json_safe

STATUS_STYLE = {"PASS": "bold green", "WARN": "bold yellow", "FAIL": "bold red", "RUNNING": "bold cyan",
                "INCOMPLETE": "bold yellow", "acknowledged": "green", "written": "green", "timeout": "red",
                "crashed": "red", "ended": "yellow", "already-ended": "yellow"}
SPARK = "▁▂▃▄▅▆▇█"


def console(stderr: bool = False) -> Console:
    """A console: colours off under NO_COLOR or when not a terminal (Rich's own rules), wide when piped."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def styled(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def print_json(data: Any) -> None:
    """Machine-readable output on stdout (no colour, no wrapping; non-finite numbers as null, paths as text)."""
    sys.stdout.write(json.dumps(json_safe(data), indent=2, default=_default, allow_nan=False) + "\n")


def json_outputs(payload: Any, *, as_json: bool, json_out: Any = None, indent: int = 2) -> None:
    """The two JSON outputs of a command: ``--json`` prints ``payload`` on stdout (and nothing else goes
    there), ``--json-out PATH`` writes it to PATH (``-``: stdout, as ``--json``) and says so (on stderr with
    ``--json``, else on stdout)."""
    from pathlib import Path

    to_stdout = as_json or str(json_out) == "-"
    if json_out is not None and str(json_out) != "-":
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=indent, default=_default) + "\n")
        print(f"saved {path}", file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout:
        print_json(payload)


class Output:
    """A command's one output sink (as the ``hf`` CLI's): with ``--json`` the result is the only thing on stdout
    and every human line goes to stderr; without it the human lines and tables go to stdout. ``result`` prints
    the payload as JSON, or calls the human rendering."""

    def __init__(self, as_json: bool = False) -> None:
        self.as_json = as_json
        self.console = console(stderr=as_json)

    def say(self, text: str) -> None:
        """A human line (printed verbatim: never read as markup)."""
        self.console.print(text, highlight=False, markup=False)

    def show(self, renderable: Any) -> None:
        """A table or styled text."""
        self.console.print(renderable)

    def warn(self, text: str) -> None:
        print(f"warning: {text}", file=sys.stderr)

    def result(self, payload: Any, human: Any = None) -> None:
        """``payload`` as JSON on stdout with ``--json``; else ``human()`` when given."""
        if self.as_json:
            print_json(payload)
        elif human is not None:
            human()


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, set):
        return sorted(obj)
    return str(obj)


def checks_table(report: Any, title: str) -> Table:
    """A CheckReport as a table: status, check, reason, hint."""
    t = Table(title=title, title_justify="left", show_lines=False, expand=False)
    t.add_column("status", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("reason")
    t.add_column("hint", style="dim")
    for c in report.checks:
        t.add_row(styled(c.status.value), c.name, c.reason, c.hint)
    return t


def counts_line(report: Any) -> Text:
    n = report.counts()
    verdict = "FAIL" if n["FAIL"] else "PASS"
    text = Text()
    text.append(verdict, style=STATUS_STYLE[verdict])
    text.append(f": {n['PASS']} passed, {n['WARN']} warning(s), {n['FAIL']} failed")
    return text


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode blocks for the last ``width`` finite values."""
    vals = [v for v in values if isinstance(v, int | float) and math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1)) if span > 0 else 3] for v in vals)


def fmt_num(v: Any, spec: str = ",.4g", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a" if v is None else str(v)
    try:
        return f"{v:{spec}}{unit}"
    except (TypeError, ValueError):
        return str(v)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    s = int(max(0, seconds))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


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
