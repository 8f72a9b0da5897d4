"""``nsa watch`` on a console: the dashboard (``nsa.runs.dashboard``) laid out as one Rich panel for the
terminal's width (no line wraps; trend lines hold the newest points), a live view of it, or one plain (or
JSON) line per refresh."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from nsa_cli import render

METRIC_W, NOW_W = 13, 20  # dashboard table columns; the third (trend/detail) takes the rest
STATUS_STYLE = {"running": "cyan", "completed": "green", "halted": "yellow", "resuming": "cyan"}


def dashboard(state: Any, summary: Any, alarms: list[Any], gpus: Any = None, *, width: int = 80,
              log: Any = None, now: float | None = None) -> Any:
    """The dashboard of a run as one Rich renderable, laid out for ``width`` columns."""
    from nsa.runs.dashboard import dashboard as view

    return panel(view(state, summary, alarms, gpus, log, now), width)


def _line(text: str, inner: int, style: str = "") -> Text:
    return Text(render.fit(text, inner), style=style, no_wrap=True, overflow="ellipsis")


def panel(d: Any, width: int) -> Panel:
    inner = max(20, width - 4)  # panel border and padding
    head = Text(no_wrap=True, overflow="ellipsis")
    name = render.fit(d.name, inner)
    head.append(name, style="bold")
    if inner - len(name) - 2 >= 8:
        head.append("  " + render.fit_left(d.run_dir, inner - len(name) - 2))
    parts: list[Any] = [head, *(_line(x, inner) for x in render.pack(d.identity, inner)), _progress(d, inner),
                        _figures(d, inner)]
    beats = render.pack(d.heartbeats, inner - len("heartbeat: "), sep="  ")
    parts += [_line(("heartbeat: " if i == 0 else "           ") + x, inner, "bold red" if d.stale else "")
              for i, x in enumerate(beats)] or [_line("heartbeat: none yet", inner, "yellow")]
    if d.skipped:
        parts.append(_line(d.skipped, inner, "yellow"))
    if d.events:
        events = Text()
        for text, style in d.events:
            events.append(text + "\n", style=style)
        events.rstrip()
        parts.append(events)
    return Panel(Group(*parts), title="nsa watch", title_align="left", width=width)


def _progress(d: Any, inner: int) -> Text:
    """``RUNNING  step 40/100 ████░░ 40.0%  elapsed 1m02s  ETA 1m30s``."""
    frac = min(1.0, d.steps_done / d.steps_total) if d.steps_total else 0.0
    tail = f"  elapsed {d.elapsed}  ETA {d.eta}"
    left = f"{d.status.upper()}  step {d.steps_done}/{d.steps_total or '?'} "
    pct = f" {frac:5.1%}"
    bar_w = min(30, inner - len(left) - len(pct) - len(tail))
    prog = Text(no_wrap=True, overflow="ellipsis")
    prog.append(d.status.upper(), style=f"bold {STATUS_STYLE.get(d.status, 'red')}")
    prog.append(left[len(d.status):])
    if bar_w >= 6:
        filled = int(frac * bar_w)
        prog.append("█" * filled + "░" * (bar_w - filled) + pct)
    prog.append(tail)
    return prog


def _figures(d: Any, inner: int) -> Table:
    detail_w = max(8, inner - METRIC_W - NOW_W - 4)
    t = Table(show_header=True, box=None, pad_edge=False, padding=(0, 1), expand=False)
    t.add_column("metric", style="bold", width=METRIC_W, no_wrap=True, overflow="ellipsis")
    t.add_column("now", justify="right", width=NOW_W, no_wrap=True, overflow="ellipsis")
    t.add_column("trend", width=detail_w, no_wrap=True, overflow="ellipsis")
    for r in d.rows:
        detail = (render.sparkline([v for v in r.series if v is not None], width=detail_w)
                  if r.series is not None
                  else r.detail + (render.fit_left(r.tail, detail_w - len(r.detail)) if r.tail else ""))
        t.add_row(r.name, r.now, detail, style=r.style or None)
    return t


def follow(watch: Any, mode: str, con: Any) -> Any:
    """Show every refresh of ``watch`` (a live dashboard, or a line per refresh: ``lines``, ``json``); the
    last."""
    snaps = watch.follow()
    if mode != "live":
        for last in snaps:
            for line in [watch.json_line(last)] if mode == "json" else watch.lines(last):
                render.echo(line)
        return last
    last = next(snaps)
    from rich.live import Live

    with Live(panel(watch.dashboard(last), con.width), console=con, auto_refresh=False,
              transient=False) as live:
        for last in snaps:
            live.update(panel(watch.dashboard(last), con.width), refresh=True)
    return last


def ended(watch: Any, snap: Any, mode: str, con: Any) -> None:
    """The last words: a crash alarm the lines did not say, the .HALT this watchdog wrote."""
    line = watch.crash_line(snap, mode == "live")
    if line is not None:
        render.echo(line, err=mode == "json")
    if mode == "live":
        _halt_written(watch, con)


def once(watch: Any, result: Any, con: Any) -> None:
    con.print(panel(watch.dashboard(result.snap), con.width))
    _halt_written(watch, con)


def _halt_written(watch: Any, con: Any) -> None:
    if (line := watch.halt_written()) is not None:
        text = Text(line)
        text.stylize("bold red", 0, len("watchdog wrote .HALT"))
        con.print(text)
