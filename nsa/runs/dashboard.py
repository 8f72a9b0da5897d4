"""What ``nsa watch``'s dashboard shows, as text: the run's identity, progress, a row per figure (its value
now, a detail or the series its trend line draws), each rank's heartbeat and the events. The CLI lays it out
for its terminal's width (``nsa_cli.render.watch``); the figures, their formats and the event texts are
decided here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa.runs.rules import now_iso
from nsa.runs.summary import anomaly_text, halt_checkpoint_text
from nsa.runs.verdict import fmt_value as num

RUNNING = ("running", "stale", "resuming")


def duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s`` (``n/a`` for none)."""
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "n/a"
    s = int(max(0, seconds))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass
class Row:
    """A figure: ``name``, its value ``now``, and a ``detail`` text or the ``series`` of its trend line;
    ``tail``: text that keeps its end when the detail must be cut (a file name)."""

    name: str
    now: str
    detail: str = ""
    series: list[Any] | None = None
    tail: str = ""
    style: str = ""


@dataclass
class Dashboard:
    name: str
    run_dir: str
    identity: list[str]  # config, profile, commit, device, world, host: segments to pack in lines
    status: str
    steps_done: int
    steps_total: int
    elapsed: str
    eta: str
    rows: list[Row] = field(default_factory=list)
    heartbeats: list[str] = field(default_factory=list)
    stale: bool = False
    skipped: str | None = None  # unreadable heartbeat lines
    events: list[tuple[str, str]] = field(default_factory=list)  # (text, style)


def selection_cells(s: Any) -> tuple[str, str]:
    """The selection row: ``("recall 0.83 mean", "min 0.61 (L3) | cmp H 0.72 | step 900")`` from the last
    evaluation's diagnostics; ``("–", why)`` for a dense model or before the first evaluation."""
    if s.selection_step is None:
        return "–", "none yet (NSA models, at evaluations)"
    if s.sel_recall_mean is None:
        recall, low = "recall –", "sequence too short to select"
    else:
        recall = f"recall {s.sel_recall_mean:.2f} mean"
        where = f" (L{s.sel_recall_min_layer})" if s.sel_recall_min_layer is not None else ""
        low = f"min {num(s.sel_recall_min, '.2f')}{where}"
    return recall, f"{low} | cmp H {num(s.cmp_entropy_mean, '.2f')} | step {s.selection_step}"


def _rows(state: Any, s: Any, gpus: Any, now: float) -> list[Row]:
    """The figures: loss, tokens/s, lr, fetch, memory, gates, selection, fallbacks, data, GPUs."""
    series = state.series()
    rows = [Row("loss", num(s.last_loss, ".4f"), series=[p.get("loss") for p in series]),
            Row("tokens/s", num(s.tokens_per_s_last, ",.0f"), series=[p.get("tokens_per_s") for p in series]),
            Row("lr/grad norm", f"{num(s.lr, '.2e')} / {num(s.grad_norm, '.3g')}",
                series=[p.get("grad_norm") for p in (state.progress or series)]),
            Row("fetch p50/p95", f"{num(s.fetch_p50_ms, '.1f')}/{num(s.fetch_p95_ms, '.1f')} ms")]
    if s.mem_reserved_mib is not None or s.mem_peak_mib is not None:
        rows.append(Row("GPU memory", f"{num(s.mem_reserved_mib, ',.0f')} MiB res.",
                        f"peak {num(s.mem_peak_mib, ',.0f')} MiB"))
    if s.rss_mib is not None:
        rss = [p.get("rss_mib") for p in state.progress]
        last = next((v for v in reversed(rss) if isinstance(v, int | float)), s.rss_mib)
        rows.append(Row("host RSS", f"{num(last, ',.0f')} MiB", series=rss))
    shares = s.gate_branch_shares
    rows.append(Row("gates",
                    f"H {num(s.gate_entropy_mean, '.3f')} coll {num(s.gate_collapse_fraction, '.2f')}",
                    "cmp/sel/win " + ("/".join(f"{x:.2f}" for x in shares) if shares else "n/a")))
    rows.append(Row("selection", *selection_cells(s)))
    rows.append(Row("fallbacks", str(s.fallback_total),
                    ", ".join(f"{k}: {v}" for k, v in sorted(s.fallback.items()))))
    if s.data_source or s.data_fallback:
        rows.append(Row("data", "SYNTHETIC" if s.data_fallback else "ok",
                        s.data_fallback or s.data_source or "", style="bold red" if s.data_fallback else ""))
    if s.gpu_mem_errors:
        rows.append(Row("GPU mem errors", str(sum(s.gpu_mem_errors.values())),
                        ", ".join(f"{k}: {v}" for k, v in sorted(s.gpu_mem_errors.items()))))
    if s.val_loss is not None:
        rows.append(Row("val loss", num(s.val_loss, ".4f")))
    ck = s.last_checkpoint
    if ck:
        age = now - float(ck["ts"]) if isinstance(ck.get("ts"), int | float) else None
        rows.append(Row("checkpoint", f"step {ck.get('step')} {ck.get('reason') or ''}".rstrip(),
                        f"{duration(age)} ago  " if age is not None else "",
                        tail=Path(str(ck.get("path") or "")).name))
    else:
        rows.append(Row("checkpoint", "none yet"))
    for g in gpus.gpus if gpus is not None and getattr(gpus, "available", False) else []:
        used = g.memory_total_mib - g.memory_free_mib
        rows.append(Row(f"GPU{g.index}", f"{num(g.utilization_pct, '.0f')}% {num(g.temperature_c, '.0f')}C "
                                         f"{num(g.power_w, '.0f')}W",
                        f"{used:,.0f}/{g.memory_total_mib:,.0f} MiB {g.name}"))
    return rows


def _events(s: Any, alarms: list[Any], log: Any) -> list[tuple[str, str]]:
    """What happened: a resume pending, a data fallback, the last anomaly and halt, alarms, cleared ones."""
    out = []
    if s.status == "resuming":
        out.append(("the run ended, and a new session holds its lock: waiting for its first heartbeat",
                    "cyan"))
    if s.data_fallback and not any(a.rule == "data-fallback" for a in alarms):  # else its ALARM line says it
        out.append((f"DATA FALLBACK: {s.data_fallback}", "bold red"))
    if s.anomalies:
        out.append((f"last anomaly: {anomaly_text(s.anomalies[-1])}", "red"))
    if s.halts:
        h = s.halts[-1]
        out.append((f"last halt: step {h.get('step')} {h.get('reason')} "
                    f"({halt_checkpoint_text(h.get('checkpoint'))})", "yellow"))
    if s.pending_halt:
        out.append((f"pending .HALT: {s.pending_halt.get('reason')}", "yellow"))
    if s.end and s.end.get("error"):
        out.append((f"error: {s.end.get('error')}", "red"))
    out += [(f"ALARM {a.rule}: {a.message}", "bold red") for a in alarms]
    for old in [x for x in log.history if x.cleared is not None][-3:] if log is not None else []:
        out.append((f"cleared {old.rule} at {now_iso(old.cleared)[11:]} (since {now_iso(old.since)[11:]})",
                    "dim"))
    return out


def dashboard(state: Any, s: Any, alarms: list[Any], gpus: Any = None, log: Any = None,
              now: float | None = None) -> Dashboard:
    """The dashboard of a run's ``state``, its summary ``s`` and firing ``alarms`` (``gpus``: this host's NVML
    probe, ``log``: the watch's alarm log, for the alarms it cleared)."""
    now = time.time() if now is None else now
    env = state.env or {}
    git = env.get("git") or {}
    commit = (git.get("commit") or "n/a")[:12] + (" (dirty)" if git.get("dirty") else "")
    identity = [f"config {env.get('config_path') or 'n/a'}", f"profile {env.get('profile') or 'none'}",
                f"commit {commit}", f"device {s.device or 'n/a'} {env.get('precision') or ''}".rstrip(),
                f"world {s.world_size}", *([f"host {s.host} pid {s.pid}"] if s.host else [])]
    beats = [f"rank{r} {duration(age)}{' (ended)' if state.ranks[r].end is not None else ''}"
             for r, age in sorted(s.heartbeat_age_s.items())]
    skipped = (f"{s.corrupt_lines} corrupt / {s.truncated_lines} truncated line(s) skipped"
               if s.corrupt_lines or s.truncated_lines else None)
    return Dashboard(s.run_name, str(state.run_dir), identity, s.status, s.steps_done, s.steps_total or 0,
                     duration(s.elapsed_s), duration(s.eta_s) if s.status in RUNNING else "-",
                     _rows(state, s, gpus, now), beats, any(a.rule == "stale" for a in alarms), skipped,
                     _events(s, alarms, log))


def status_line(summary: Any, alarms: list[Any], now: float) -> str:
    """One plain line: time, status, step/total, loss, tokens/s, ETA, alarms."""
    s = summary
    eta = duration(s.eta_s) if s.status in RUNNING else "-"
    return (f"{now_iso(now)} {s.status.upper()} step {s.steps_done}/{s.steps_total or '?'} "
            f"loss {num(s.last_loss, '.4f')} tok/s {num(s.tokens_per_s_last, ',.0f')} "
            f"ETA {eta} alarms {','.join(a.rule for a in alarms) or '-'}")
