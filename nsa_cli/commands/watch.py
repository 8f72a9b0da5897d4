"""``nsa watch``: a live dashboard over a run directory, and with ``--halt-on`` a watchdog."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from nsa_cli.errors import EXIT_FAILED, EXIT_OK, fail, user_errors

EPILOG = """\
Examples:

  nsa watch artifacts/tiny                          # live dashboard, Ctrl-C to leave

  nsa watch artifacts/tiny --once                   # one snapshot (logs, cron, non-terminals)

  nsa watch artifacts/tiny --once --json

  nsa watch artifacts/m7c-125m --halt-on all        # watchdog: writes .HALT when a rule fires

  nsa watch artifacts/m7c-125m --halt-on stale=600,nonfinite,fetch-stall=5000

Rules: stale=SECONDS, nonfinite, gate-collapse=FRACTION, throughput-drop=RATIO, fetch-stall=MS, all.
Exit code: 0, or 1 when an alarm is firing (--once) or the run failed.
"""


def _snapshot(state: Any, summary: Any, alarms: list[Any], gpus: Any, now: float) -> Any:
    """The dashboard as one Rich renderable."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from nsa_cli import render

    s = summary
    env = state.env or {}
    git = env.get("git") or {}
    head = Text()
    head.append(f"{s.run_name}", style="bold")
    head.append(f"  {state.run_dir}\n")
    head.append(f"config {env.get('config_path') or 'n/a'} | profile {env.get('profile') or 'none'} | "
                f"commit {(git.get('commit') or 'n/a')[:12]}{' (dirty)' if git.get('dirty') else ''} | "
                f"device {s.device or 'n/a'} {env.get('precision') or ''} | world {s.world_size}")

    status_style = {"running": "cyan", "completed": "green", "halted": "yellow"}.get(s.status, "red")
    total = s.steps_total or 0
    frac = (s.steps_done / total) if total else 0.0
    bar_w = 30
    bar = "█" * int(frac * bar_w) + "░" * (bar_w - int(frac * bar_w))
    prog = Text()
    prog.append(f"{s.status.upper()}", style=f"bold {status_style}")
    prog.append(f"  step {s.steps_done}/{total or '?'} {bar} {frac:5.1%}  elapsed {render.fmt_duration(s.elapsed_s)}"
                f"  ETA {render.fmt_duration(s.eta_s) if s.status == 'running' else '-'}")

    series = state.series()
    losses = [p.get("loss") for p in series]
    tps = [p.get("tokens_per_s") for p in series]
    t = Table(show_header=True, box=None, pad_edge=False)
    t.add_column("metric", style="bold")
    t.add_column("now", justify="right")
    t.add_column("trend")
    t.add_row("loss", render.fmt_num(s.last_loss, ".4f"), render.sparkline([v for v in losses if v is not None]))
    t.add_row("tokens/s", render.fmt_num(s.tokens_per_s_last, ",.0f"), render.sparkline([v for v in tps if v is not None]))
    t.add_row("fetch p50/p95", f"{render.fmt_num(s.fetch_p50_ms, '.1f')}/{render.fmt_num(s.fetch_p95_ms, '.1f')} ms", "")
    if s.mem_peak_mib is not None:
        t.add_row("GPU memory", f"peak {render.fmt_num(s.mem_peak_mib, ',.0f')} MiB, reserved "
                  f"{render.fmt_num(s.mem_reserved_mib, ',.0f')} MiB", "")
    if s.rss_mib is not None:
        t.add_row("host RSS", f"{render.fmt_num(s.rss_mib, ',.0f')} MiB", "")
    shares = s.gate_branch_shares
    t.add_row("gates", f"entropy {render.fmt_num(s.gate_entropy_mean, '.3f')}, collapse "
              f"{render.fmt_num(s.gate_collapse_fraction, '.2f')}",
              "cmp/sel/win " + ("/".join(f"{x:.2f}" for x in shares) if shares else "n/a"))
    t.add_row("fallbacks", str(s.fallback_total), ", ".join(f"{k}: {v}" for k, v in sorted(s.fallback.items()))[:80])
    if s.val_loss is not None:
        t.add_row("val loss", render.fmt_num(s.val_loss, ".4f"), "")
    if gpus is not None and gpus.available:
        for g in gpus.gpus:
            t.add_row(f"GPU{g.index}", f"{render.fmt_num(g.utilization_pct, '.0f')}% util, "
                      f"{render.fmt_num(g.temperature_c, '.0f')} C, {render.fmt_num(g.power_w, '.0f')} W",
                      f"{(g.memory_total_mib - g.memory_free_mib):,.0f}/{g.memory_total_mib:,.0f} MiB")
    ages = s.heartbeat_age_s
    hb = Text()
    hb.append("heartbeat age: ")
    for r, age in sorted(ages.items()):
        stale = any(a.rule == "stale" for a in alarms)
        ended = state.ranks[r].end is not None
        hb.append(f"rank{r} {render.fmt_duration(age)}{' (ended)' if ended else ''}  ",
                  style="bold red" if stale and not ended and age > 60 else "")
    if not ages:
        hb.append("no heartbeat yet", style="yellow")
    if s.corrupt_lines or s.truncated_lines:
        hb.append(f"\n{s.corrupt_lines} corrupt / {s.truncated_lines} truncated line(s) skipped", style="yellow")
    events = Text()
    if s.anomalies:
        a = s.anomalies[-1]
        events.append(f"last anomaly: {a.get('kind')} at step {a.get('step')} (value {a.get('value')})\n", style="red")
    if s.halts:
        h = s.halts[-1]
        events.append(f"last halt: step {h.get('step')} {h.get('reason')} (checkpoint {h.get('checkpoint')})\n", style="yellow")
    if s.pending_halt:
        events.append(f"pending .HALT: {s.pending_halt.get('reason')}\n", style="yellow")
    if s.end and s.end.get("error"):
        events.append(f"error: {s.end.get('error')}\n", style="red")
    for a in alarms:
        events.append(f"ALARM {a.rule}: {a.message}\n", style="bold red")
    parts: list[Any] = [head, prog, t, hb]
    if events.plain:
        parts.append(events)
    return Panel(Group(*parts), title="nsa watch", title_align="left")


def watch(
    run_dir: Annotated[str, typer.Argument(help="Run directory (train.out_dir).")],
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    halt_on: Annotated[str | None, typer.Option("--halt-on", help="Watchdog rules that write .HALT (e.g. all, stale=600,nonfinite).")] = None,
    refresh: Annotated[float, typer.Option("--refresh", help="Seconds between reads.", min=0.1)] = 2.0,
    stale_after: Annotated[float, typer.Option("--stale-after", help="Heartbeat age (s) shown as an alarm.", min=1)] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="With --once: print the snapshot as JSON.")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Stop watching after this many seconds.")] = None,
) -> None:
    """Live dashboard: identity, progress/ETA, loss and tokens/s sparklines, fetch p50/p95, memory, GPU
    utilisation, gate health, fallbacks, heartbeat age, anomalies and halts. Reads files incrementally."""
    from nsa_cli import render

    with user_errors():
        from nsa.checks.gpu import query_gpus
        from nsa.errors import NSAError
        from nsa.runs.halt import who_am_i, write_halt
        from nsa.runs.reader import RunReader
        from nsa.runs.rules import Rule, default_rules, evaluate, parse_rules
        from nsa.runs.summary import summarize

        halt_rules = parse_rules(halt_on)
        reader = RunReader(run_dir)
    shown_rules = {r.name: r for r in default_rules()}
    shown_rules["stale"] = Rule("stale", stale_after)
    shown_rules.update({r.name: r for r in halt_rules})
    local = None

    def gpus() -> Any:
        nonlocal local
        boot = reader.state.boot or {}
        import socket

        if local is None:
            local = boot.get("host") in (None, socket.gethostname())
        return query_gpus() if local and str((reader.state.env or {}).get("device", "")).startswith("cuda") else None

    halted_by_us: list[dict[str, Any]] = []

    def step() -> tuple[Any, Any, list[Any]]:
        now = time.time()
        st = reader.poll(final=once)
        summ = summarize(st, now, stale_after)
        hits = evaluate(list(shown_rules.values()), st, now)
        if halt_rules and not halted_by_us and st.end is None and st.halt_file is None:
            names = {r.name for r in halt_rules}
            firing = [h for h in hits if h.rule in names]
            if firing:
                h = firing[0]
                try:
                    rec = write_halt(reader.run_dir, f"watchdog: {h.message}", who=who_am_i("nsa watch"),
                                     rule=h.rule, evidence=h.evidence)
                except NSAError as exc:  # a read-only run directory: say so in one line, stop watching
                    raise fail(f"watchdog rule {h.rule} fired but {exc.message}", hint=exc.hint) from None
                halted_by_us.append(rec)
                st.halt_file = rec
        return st, summ, hits

    if once:
        st, summ, hits = step()
        if as_json:
            render.print_json(render.jsonable({
                "summary": summ.to_dict(),
                "alarms": [h.to_dict() for h in hits],
                "halt_written": halted_by_us[0] if halted_by_us else None,
                "config": st.config, "env": st.env,
            }))
        else:
            render.console().print(_snapshot(st, summ, hits, gpus(), time.time()))
            if halted_by_us:
                render.console().print(f"[bold red]watchdog wrote .HALT[/]: {halted_by_us[0]['reason']}")
        raise typer.Exit(EXIT_FAILED if hits or summ.status in ("failed", "crashed") else EXIT_OK)

    from rich.live import Live

    con = render.console()
    start = time.monotonic()
    st, summ, hits = step()
    try:
        with Live(_snapshot(st, summ, hits, gpus(), time.time()), console=con, auto_refresh=False,
                  transient=False) as live:
            while True:
                if st.end is not None and all(r.end is not None for r in st.ranks.values()):
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    break
                time.sleep(refresh)
                st, summ, hits = step()
                live.update(_snapshot(st, summ, hits, gpus(), time.time()), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_OK) from None
    if not con.is_terminal:
        con.print()
    if halted_by_us:
        con.print(f"[bold red]watchdog wrote .HALT[/]: {halted_by_us[0]['reason']}")
    raise typer.Exit(EXIT_FAILED if summ.status in ("failed", "crashed") else EXIT_OK)


def register(app: typer.Typer) -> None:
    app.command("watch", epilog=EPILOG)(watch)
