"""``nsa watch``: a live dashboard over a run directory; alarms (record, notify) and, with ``--halt-on``, a
watchdog that writes ``.HALT``. On a terminal a Rich live view; otherwise one plain (or JSON) line per
refresh, so the output is a log of what it saw."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from nsa_cli import options
from nsa_cli.errors import EXIT_OK, fail, user_errors

EPILOG = """\
Examples:

  nsa watch artifacts/tiny                          # live dashboard; waits for the run to start

  nsa watch artifacts/tiny --once                   # one snapshot (cron, scripts)

  nsa watch artifacts/tiny --once --json

  nsa watch artifacts/tiny > watch.log              # not a terminal: one line per refresh

  nsa watch artifacts/tiny --json | jq .status      # JSON lines, one object per refresh

  nsa watch artifacts/m7c-125m --halt-on all        # watchdog: writes .HALT when a rule fires

  nsa watch artifacts/m7c-125m --alert-on all,stale=60 --halt-on nonfinite,stale=600

  nsa watch artifacts/m7c-125m --notify 'curl -fsS --data-binary @- https://hooks.example.com/nsa'

Rules (thresholds default to the run's monitor config): {rules}.
The watch follows a run across resumes: after an end event, while a new `nsa train --resume` holds the
run lock, it waits for the new session. Alarms are kept with the run (RUN/alarms.jsonl; nsa report
judges them).
Exit code: live: 1 when the run crashed or failed, 3 when this watchdog's .HALT stopped it, else 0;
--once: 1 when an alarm fires or the run failed/crashed; 2 bad input (not a run directory, or the run did
not start within --timeout).
"""

METRIC_W, NOW_W = 13, 20  # dashboard table columns; the third (trend/detail) takes the rest


def _spark_row(t: Any, name: str, now: str, values: list[Any], detail_w: int) -> None:
    from nsa_cli import render

    t.add_row(name, now, render.sparkline([v for v in values if v is not None], width=detail_w))


def dashboard(state: Any, summary: Any, alarms: list[Any], gpus: Any = None, *, width: int = 80,
              log: Any = None, now: float | None = None) -> Any:
    """The dashboard as one Rich renderable, laid out for ``width`` columns: no line wraps, sparklines
    hold the newest points (trimmed from the left)."""
    from rich.console import Group
    from rich.panel import Panel

    now = time.time() if now is None else now
    inner = max(20, width - 4)  # panel border and padding
    parts: list[Any] = [*_identity(state, summary, inner), _progress(summary, inner),
                        _metrics(state, summary, gpus, inner, now), *_heartbeats(state, summary, alarms, inner)]
    events = _events(summary, alarms, log)
    if events.plain:
        parts.append(events)
    return Panel(Group(*parts), title="nsa watch", title_align="left", width=width)


def _line(text: str, inner: int, style: str = "") -> Any:
    from rich.text import Text

    from nsa_cli import render

    return Text(render.fit(text, inner), style=style, no_wrap=True, overflow="ellipsis")


def _identity(state: Any, s: Any, inner: int) -> list[Any]:
    """Run name and directory, then config, profile, commit, device, world size and host, packed in lines."""
    from rich.text import Text

    from nsa_cli import render

    env = state.env or {}
    git = env.get("git") or {}
    head = Text(no_wrap=True, overflow="ellipsis")
    name = render.fit(s.run_name, inner)
    head.append(name, style="bold")
    room = inner - len(name) - 2
    if room >= 8:
        head.append("  " + render.fit_left(str(state.run_dir), room))
    commit = (git.get("commit") or "n/a")[:12] + (" (dirty)" if git.get("dirty") else "")
    segments = [f"config {env.get('config_path') or 'n/a'}", f"profile {env.get('profile') or 'none'}",
                f"commit {commit}", f"device {s.device or 'n/a'} {env.get('precision') or ''}".rstrip(),
                f"world {s.world_size}"]
    if s.host:
        segments.append(f"host {s.host} pid {s.pid}")
    return [head] + [_line(x, inner) for x in render.pack(segments, inner)]


def _progress(s: Any, inner: int) -> Any:
    """``RUNNING  step 40/100 ████░░ 40.0%  elapsed 1m02s  ETA 1m30s``."""
    from rich.text import Text

    from nsa_cli import render

    status_style = {"running": "cyan", "completed": "green", "halted": "yellow", "resuming": "cyan"}.get(s.status, "red")
    total = s.steps_total or 0
    frac = min(1.0, s.steps_done / total) if total else 0.0
    running = s.status in ("running", "stale", "resuming")
    tail = (f"  elapsed {render.fmt_duration(s.elapsed_s)}"
            f"  ETA {render.fmt_duration(s.eta_s) if running else '-'}")
    left = f"{s.status.upper()}  step {s.steps_done}/{total or '?'} "
    pct = f" {frac:5.1%}"
    bar_w = min(30, inner - len(left) - len(pct) - len(tail))
    prog = Text(no_wrap=True, overflow="ellipsis")
    prog.append(s.status.upper(), style=f"bold {status_style}")
    prog.append(left[len(s.status):])
    if bar_w >= 6:
        filled = int(frac * bar_w)
        prog.append("█" * filled + "░" * (bar_w - filled) + pct)
    prog.append(tail)
    return prog


def _metrics(state: Any, s: Any, gpus: Any, inner: int, now: float) -> Any:
    """The table of figures: loss, tokens/s, lr, fetch, memory, gates, selection, fallbacks, data, GPUs."""
    from rich.table import Table

    from nsa_cli import render

    detail_w = max(8, inner - METRIC_W - NOW_W - 4)
    t = Table(show_header=True, box=None, pad_edge=False, padding=(0, 1), expand=False)
    t.add_column("metric", style="bold", width=METRIC_W, no_wrap=True, overflow="ellipsis")
    t.add_column("now", justify="right", width=NOW_W, no_wrap=True, overflow="ellipsis")
    t.add_column("trend", width=detail_w, no_wrap=True, overflow="ellipsis")
    series = state.series()
    _spark_row(t, "loss", render.fmt_num(s.last_loss, ".4f"), [p.get("loss") for p in series], detail_w)
    _spark_row(t, "tokens/s", render.fmt_num(s.tokens_per_s_last, ",.0f"),
               [p.get("tokens_per_s") for p in series], detail_w)
    _spark_row(t, "lr/grad norm", f"{render.fmt_num(s.lr, '.2e')} / {render.fmt_num(s.grad_norm, '.3g')}",
               [p.get("grad_norm") for p in (state.progress or series)], detail_w)
    t.add_row("fetch p50/p95", f"{render.fmt_num(s.fetch_p50_ms, '.1f')}/{render.fmt_num(s.fetch_p95_ms, '.1f')} ms", "")
    if s.mem_reserved_mib is not None or s.mem_peak_mib is not None:
        t.add_row("GPU memory", f"{render.fmt_num(s.mem_reserved_mib, ',.0f')} MiB res.",
                  f"peak {render.fmt_num(s.mem_peak_mib, ',.0f')} MiB")
    if s.rss_mib is not None:
        rss = [p.get("rss_mib") for p in state.progress]
        last_rss = next((v for v in reversed(rss) if isinstance(v, int | float)), s.rss_mib)
        _spark_row(t, "host RSS", f"{render.fmt_num(last_rss, ',.0f')} MiB", rss, detail_w)
    shares = s.gate_branch_shares
    t.add_row("gates", f"H {render.fmt_num(s.gate_entropy_mean, '.3f')} coll "
              f"{render.fmt_num(s.gate_collapse_fraction, '.2f')}",
              "cmp/sel/win " + ("/".join(f"{x:.2f}" for x in shares) if shares else "n/a"))
    now_sel, detail_sel = selection_cells(s)
    t.add_row("selection", now_sel, detail_sel)
    t.add_row("fallbacks", str(s.fallback_total), ", ".join(f"{k}: {v}" for k, v in sorted(s.fallback.items())))
    if s.data_source or s.data_fallback:
        t.add_row("data", "SYNTHETIC" if s.data_fallback else "ok", s.data_fallback or s.data_source or "",
                  style="bold red" if s.data_fallback else None)
    if s.gpu_mem_errors:
        t.add_row("GPU mem errors", str(sum(s.gpu_mem_errors.values())),
                  ", ".join(f"{k}: {v}" for k, v in sorted(s.gpu_mem_errors.items())))
    if s.val_loss is not None:
        t.add_row("val loss", render.fmt_num(s.val_loss, ".4f"), "")
    ck = s.last_checkpoint
    if ck:
        age = now - float(ck["ts"]) if isinstance(ck.get("ts"), int | float) else None
        where = f"{render.fmt_duration(age)} ago  " if age is not None else ""
        t.add_row("checkpoint", f"step {ck.get('step')} {ck.get('reason') or ''}".rstrip(),
                  where + render.fit_left(Path(str(ck.get("path") or "")).name, detail_w - len(where)))
    else:
        t.add_row("checkpoint", "none yet", "")
    if gpus is not None and getattr(gpus, "available", False):
        for g in gpus.gpus:
            used = g.memory_total_mib - g.memory_free_mib
            t.add_row(f"GPU{g.index}", f"{render.fmt_num(g.utilization_pct, '.0f')}% "
                      f"{render.fmt_num(g.temperature_c, '.0f')}C {render.fmt_num(g.power_w, '.0f')}W",
                      f"{used:,.0f}/{g.memory_total_mib:,.0f} MiB {g.name}")
    return t


def _heartbeats(state: Any, s: Any, alarms: list[Any], inner: int) -> list[Any]:
    """Each rank's heartbeat age (red while the stale rule fires) and the unreadable lines skipped."""
    from nsa_cli import render

    ages = s.heartbeat_age_s
    stale = any(a.rule == "stale" for a in alarms)
    hb_parts = [f"rank{r} {render.fmt_duration(age)}{' (ended)' if state.ranks[r].end is not None else ''}"
                for r, age in sorted(ages.items())]
    hb_lines = render.pack(hb_parts, inner - len("heartbeat: "), sep="  ")
    hb = [_line(("heartbeat: " if i == 0 else "           ") + x, inner, "bold red" if stale else "")
          for i, x in enumerate(hb_lines)] or [_line("heartbeat: none yet", inner, "yellow")]
    if s.corrupt_lines or s.truncated_lines:
        hb.append(_line(f"{s.corrupt_lines} corrupt / {s.truncated_lines} truncated line(s) skipped", inner, "yellow"))
    return hb


def _events(s: Any, alarms: list[Any], log: Any) -> Any:
    """What happened: a resume pending, a data fallback, the last anomaly and halt, alarms, cleared ones."""
    from rich.text import Text

    from nsa.runs.summary import anomaly_text, halt_checkpoint_text

    events = Text()
    if s.status == "resuming":
        events.append("the run ended, and a new session holds its lock: waiting for its first heartbeat\n", style="cyan")
    if s.data_fallback and not any(a.rule == "data-fallback" for a in alarms):  # else its ALARM line says it
        events.append(f"DATA FALLBACK: {s.data_fallback}\n", style="bold red")
    if s.anomalies:
        events.append(f"last anomaly: {anomaly_text(s.anomalies[-1])}\n", style="red")
    if s.halts:
        h = s.halts[-1]
        events.append(f"last halt: step {h.get('step')} {h.get('reason')} ({halt_checkpoint_text(h.get('checkpoint'))})\n",
                      style="yellow")
    if s.pending_halt:
        events.append(f"pending .HALT: {s.pending_halt.get('reason')}\n", style="yellow")
    if s.end and s.end.get("error"):
        events.append(f"error: {s.end.get('error')}\n", style="red")
    for a in alarms:
        events.append(f"ALARM {a.rule}: {a.message}\n", style="bold red")
    if log is not None:
        from nsa.runs.rules import now_iso

        for old in [x for x in log.history if x.cleared is not None][-3:]:
            events.append(f"cleared {old.rule} at {now_iso(old.cleared)[11:]} (since {now_iso(old.since)[11:]})\n",
                          style="dim")
    events.rstrip()
    return events


def selection_cells(s: Any) -> tuple[str, str]:
    """The dashboard's selection row: ``("recall 0.83 mean", "min 0.61 (L3) | cmp H 0.72 | step 900")`` from
    the last evaluation's diagnostics; ``("–", why)`` for a dense model or before the first evaluation."""
    from nsa_cli import render

    if s.selection_step is None:
        return "–", "none yet (NSA models, at evaluations)"
    if s.sel_recall_mean is None:
        recall, low = "recall –", "sequence too short to select"
    else:
        recall = f"recall {s.sel_recall_mean:.2f} mean"
        where = f" (L{s.sel_recall_min_layer})" if s.sel_recall_min_layer is not None else ""
        low = f"min {render.fmt_num(s.sel_recall_min, '.2f')}{where}"
    return recall, f"{low} | cmp H {render.fmt_num(s.cmp_entropy_mean, '.2f')} | step {s.selection_step}"


def status_line(summary: Any, alarms: list[Any], now: float) -> str:
    """One plain line: time, status, step/total, loss, tokens/s, ETA, alarms."""
    from nsa.runs.rules import now_iso
    from nsa_cli import render

    s = summary
    eta = render.fmt_duration(s.eta_s) if s.status in ("running", "stale", "resuming") else "-"
    return (f"{now_iso(now)} {s.status.upper()} step {s.steps_done}/{s.steps_total or '?'} "
            f"loss {render.fmt_num(s.last_loss, '.4f')} tok/s {render.fmt_num(s.tokens_per_s_last, ',.0f')} "
            f"ETA {eta} alarms {','.join(a.rule for a in alarms) or '-'}")


def watch(
    run_dir: Annotated[Path, options.run_dir()],
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    wait: Annotated[bool | None, typer.Option(
        "--wait/--no-wait", help="Wait for a run directory that does not exist yet or has no heartbeat yet "
        "(default: wait in live mode, not with --once).")] = None,
    alert_on: Annotated[str | None, typer.Option(
        "--alert-on", help="Rules that raise an alarm (default all; thresholds from the run's monitor config), "
        "e.g. all,stale=60 or none.")] = None,
    halt_on: Annotated[str | None, typer.Option(
        "--halt-on", help="Watchdog rules that write .HALT (e.g. all, stale=600,nonfinite).")] = None,
    notify: Annotated[str | None, typer.Option(
        "--notify", help="Shell command run once per new alarm with the alarm as JSON on stdin (default: the "
        "run's monitor.notify in live mode; '' for none).")] = None,
    notify_timeout: Annotated[float, typer.Option("--notify-timeout", help="Seconds a --notify command may run.",
                                                  min=0.1)] = 10.0,
    refresh: Annotated[float, typer.Option("--refresh", help="Seconds between reads.", min=0.01)] = 2.0,
    stale_after: Annotated[float | None, typer.Option(
        "--stale-after", help="Heartbeat age (s) for the stale status and rule (default: monitor.stale_s).",
        min=1)] = None,
    as_json: Annotated[bool, options.json_flag("the state (one object with --once, else one per refresh: JSON lines)")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Stop after this many seconds (waiting included).", min=0)] = None,
) -> None:
    """Live dashboard: identity, progress/ETA, loss, tokens/s and grad-norm sparklines, lr, fetch p50/p95,
    memory, per-GPU utilisation/memory/temperature/power (NVML), gate health, selection recall and compressed
    entropy of the last evaluation, fallbacks, last checkpoint,
    heartbeat age, anomalies, halts and alarms. Exits when the run ends or crashes."""
    from nsa_cli import render

    with user_errors():
        from nsa.runs.reader import RunReader
        from nsa.runs.rules import parse_rules
        from nsa.runs.watchdog import Watchdog, exit_code, follow

        halt_rules = parse_rules(halt_on)
        alert_rules = parse_rules("all" if alert_on is None else alert_on)
    start = time.monotonic()
    path = Path(run_dir)
    if (not once if wait is None else wait) and not _wait_for_start(path, timeout, refresh, as_json):
        raise fail(f"run directory {path} did not start within {timeout:g} s",
                   hint="check the trainer's --out-dir, or give a longer --timeout")
    with user_errors():
        reader = RunReader(path)
    dog = Watchdog(reader, alert_rules, halt_rules, notify_cmd=(notify or "") if once else notify,
                   notify_timeout=notify_timeout, stale_after=stale_after,
                   on_warning=lambda msg: typer.echo(f"warning: {msg}", err=True))
    view = _View(dog, reader)
    if once:
        with user_errors():  # a bad monitor config or an unwritable .HALT: one line
            snap = dog.poll(final=True)
        view.once(snap, as_json)
        raise typer.Exit(exit_code(dog, snap, once=True))
    con = render.console()
    mode = "json" if as_json else ("live" if con.is_terminal else "lines")
    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
    snaps = follow(dog, refresh, left)
    try:
        with user_errors():
            snap = view.run(snaps, mode, con)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_OK) from None
    view.ended(snap, mode, con)
    raise typer.Exit(exit_code(dog, snap))


def _wait_for_start(path: Path, timeout: float | None, refresh: float, as_json: bool) -> bool:
    """Wait for a run that has not started (only for a folder that is missing, empty, or claimed by a trainer;
    anything else is one line, exit 2); False when ``timeout`` passed first. Ctrl-C: exit 0."""
    from nsa.errors import RunDirError
    from nsa.runs.reader import check_run_dir, may_become_run, run_started, wait_for_run
    from nsa.runs.rules import now_iso

    if run_started(path):
        return True
    with user_errors():
        if not may_become_run(path):
            check_run_dir(path)
            raise RunDirError(f"{path} is not a run directory (no heartbeat, config.yaml or .lock)",
                              hint="give the train.out_dir of a run started by `nsa train`")
    what = "to appear" if not path.exists() else "to start (no heartbeat yet)"
    bound = f" (up to {timeout:g} s)" if timeout is not None else ""
    typer.echo(f"{now_iso()} waiting for run directory {path} {what}{bound}", err=as_json)
    try:
        with user_errors():
            return bool(wait_for_run(path, timeout, poll_s=min(refresh, 0.5)))
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_OK) from None


class _View:
    """How ``nsa watch`` shows what its watchdog sees: a Rich live dashboard on a terminal, else one plain (or
    JSON) line per refresh."""

    def __init__(self, dog: Any, reader: Any) -> None:
        self.dog, self.reader = dog, reader
        self.gpu_local: bool | None = None
        self.announced_halt: list[Any] = []  # the .HALT times already reported (lines mode)

    def gpus(self) -> Any:
        from nsa.checks.gpu import query_gpus

        boot = self.reader.state.boot
        if self.gpu_local is None and boot is not None:
            self.gpu_local = (boot.get("host") in (None, socket.gethostname())
                              and str((self.reader.state.env or {}).get("device", "")).startswith("cuda"))
        return query_gpus(details=False) if self.gpu_local else None

    def panel(self, snap: Any, width: int) -> Any:
        return dashboard(snap.state, snap.summary, snap.alarms, self.gpus(), width=width, log=self.dog.log)

    def once(self, snap: Any, as_json: bool) -> None:
        from nsa_cli import render

        if as_json:
            render.print_json({**self.dog.payload(snap), "config": snap.state.config,
                                               "env": snap.state.env})
            return
        con = render.console()
        con.print(self.panel(snap, con.width))
        if self.dog.halted:
            con.print(f"[bold red]watchdog wrote .HALT[/]: {self.dog.halted[0]['reason']}")

    def run(self, snaps: Any, mode: str, con: Any) -> Any:
        """Show every snapshot of ``snaps``; the last one."""
        last = next(snaps)
        if mode != "live":
            self.line(last, mode)
            for last in snaps:
                self.line(last, mode)
            return last
        from rich.live import Live

        with Live(self.panel(last, con.width), console=con, auto_refresh=False, transient=False) as live:
            for last in snaps:
                live.update(self.panel(last, con.width), refresh=True)
        return last

    def line(self, snap: Any, mode: str) -> None:
        from nsa.fileio import json_safe
        from nsa.runs.rules import now_iso
        from nsa.runs.watchdog import line_record

        st, summ, now = snap.state, snap.summary, snap.time
        if mode == "json":
            typer.echo(json.dumps(json_safe(line_record(self.dog, snap)), default=str))
            return
        stamp = now_iso(now)
        typer.echo(status_line(summ, snap.alarms, now))
        for a in snap.new:
            typer.echo(f"{stamp} ALARM {a.rule}: {a.message}")
        for a in snap.cleared:
            typer.echo(f"{stamp} cleared {a.rule} (since {now_iso(a.since)})")
        if snap.wrote_halt:
            typer.echo(f"{stamp} watchdog wrote .HALT: {self.dog.halted[0]['reason']}")
        ph = summ.pending_halt
        if ph is not None and ph.get("time") not in self.announced_halt:
            self.announced_halt.append(ph.get("time"))
            typer.echo(f"{stamp} pending .HALT: {ph.get('reason')} ({ph.get('who') or 'unknown'})")
        elif ph is None and self.announced_halt:  # acted on (the trainer retires the file into halts/), or removed
            since = self.announced_halt.pop()
            acted = [h for h in st.halts if not isinstance(since, int | float) or float(h.get("ts", 0)) >= since - 1.0]
            if acted or st.end is not None:
                h = acted[-1] if acted else st.end or {}
                typer.echo(f"{stamp} .HALT acted on at step {h.get('step')}")
            else:
                typer.echo(f"{stamp} .HALT removed before the trainer acted on it")

    def ended(self, snap: Any, mode: str, con: Any) -> None:
        """The last words: a crash alarm the lines did not say, the .HALT this watchdog wrote."""
        from nsa.runs.rules import now_iso

        if snap.summary.status == "crashed":
            crash = self.dog.crash(snap)
            if crash is not None and (mode == "live" or not self.dog.alerts_on_crash):
                line = f"ALARM crashed: {crash.message}"
                typer.echo(line if mode == "live" else f"{now_iso()} {line}", err=mode == "json")
        if mode == "live" and self.dog.halted:
            con.print(f"[bold red]watchdog wrote .HALT[/]: {self.dog.halted[0]['reason']}")


class WatchCommand(TyperCommand):
    """``nsa watch``: its help lists the rules from their declarations (``nsa.runs.rules.RULES``), read when
    the help is shown (so ``nsa --help`` stays light)."""

    @property  # type: ignore[override]
    def epilog(self) -> str:
        from nsa.runs.rules import synopsis

        return EPILOG.replace("{rules}", synopsis())

    @epilog.setter
    def epilog(self, value: str | None) -> None:
        """Click assigns the epilog at construction; it is derived above, so the value is not kept."""


def register(app: typer.Typer) -> None:
    app.command("watch", cls=WatchCommand)(watch)
