"""Numbers derived from a run's state: progress, throughput, fetch latency, memory, gates, counters."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nsa.rundir.records import SELECTION_FIELDS, AnomalyEvent, CheckpointEvent, EndEvent, HaltEvent, HaltFile
from nsa.runs.reader import DEFAULT_STALE_S, RunState


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def finite(v: Any) -> bool:
    x = _num(v)
    return x is not None and math.isfinite(x)


def values(points: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """The finite numbers of ``key`` over ``points`` (records of nsa.rundir.records), in order."""
    return [float(p[key]) for p in points if finite(p.get(key))]


def percentile(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return None
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def anomaly_text(a: Mapping[str, Any]) -> str:
    """``nonfinite_loss at step 7 (value nan)``: a non-finite value the heartbeat wrote as null reads as
    such."""
    value = a.get("value")
    shown = "non-finite" if value is None else str(value)
    return f"{a.get('kind')} at step {a.get('step')} (value {shown})"


def halt_checkpoint_text(checkpoint: Any) -> str:
    """``checkpoint <path>``, or what a halt without one means (an anomaly before the first save)."""
    return f"checkpoint {checkpoint}" if checkpoint else "no checkpoint to resume from"


def step_ranges(points: Sequence[Mapping[str, Any]], n: int = 5,
                key: str = "tokens_per_s") -> list[dict[str, Any]]:
    """Split the points into up to ``n`` step ranges with the mean and count of ``key`` (a trend table)."""
    pts = [(int(p["step"]), float(p[key])) for p in points if finite(p.get("step")) and finite(p.get(key))]
    if not pts:
        return []
    n = max(1, min(n, len(pts)))
    size = math.ceil(len(pts) / n)
    out = []
    for i in range(0, len(pts), size):
        chunk = pts[i:i + size]
        vals = [v for _, v in chunk]
        out.append({"from_step": chunk[0][0], "to_step": chunk[-1][0], "mean": statistics.fmean(vals),
                    "min": min(vals), "max": max(vals), "points": len(vals)})
    return out


@dataclass
class RunSummary:
    run_dir: str
    run_name: str
    status: str
    steps_done: int
    steps_total: int | None
    world_size: int
    first_loss: float | None = None
    last_loss: float | None = None
    min_loss: float | None = None
    nonfinite_losses: int = 0
    tokens_per_s_last: float | None = None
    tokens_per_s_median: float | None = None
    step_time_s_median: float | None = None
    tokens_seen: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None  # smoothed: remaining steps x the recent wall-clock pace (see smoothed_eta)
    eta_s_trainer: float | None = None  # the trainer's own estimate in the last progress line
    lr: float | None = None
    grad_norm: float | None = None
    last_checkpoint: CheckpointEvent | None = None
    host: str | None = None
    pid: int | None = None
    fetch_p50_ms: float | None = None
    fetch_p95_ms: float | None = None
    mem_peak_mib: float | None = None
    mem_reserved_mib: float | None = None
    rss_mib: float | None = None
    gate_entropy_mean: float | None = None
    gate_branch_shares: list[float] | None = None
    gate_collapse_fraction: float | None = None
    sel_keys_mean: float | None = None
    mfu: float | None = None
    fallback: dict[str, int] = field(default_factory=dict)
    fallback_total: int = 0
    heartbeat_age_s: dict[int, float] = field(default_factory=dict)
    anomalies: list[AnomalyEvent] = field(default_factory=list)
    halts: list[HaltEvent] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    end: EndEvent | None = None
    val_loss: float | None = None
    pending_halt: HaltFile | None = None
    corrupt_lines: int = 0
    truncated_lines: int = 0
    device: str | None = None
    profile: str | None = None
    config_path: str | None = None
    commit: str | None = None
    data_source: str | None = None  # what the loader read (its description at start)
    data_warnings: list[str] = field(default_factory=list)
    data_fallback: str | None = None  # why the run trained on synthetic tokens instead of its source
    # GPU memory error counters (all ranks' last), when telemetry has them
    gpu_mem_errors: dict[str, int] | None = None
    gpu_mem_errors_new: int | None = None  # how many of them appeared during the current session
    scorer_kl: float | None = None  # the scorer loss of the last progress line (scorer.weight > 0)
    align_nll: float | None = None  # the alignment loss of the last progress line (scorer.align > 0)
    # the selection diagnostics of the last evaluation that has them (NSA models; see last_selection)
    selection_step: int | None = None
    selection: list[dict[str, Any]] | None = None  # per layer: layer, recall, cmp_entropy, kl, gates
    sel_recall_mean: float | None = None
    sel_recall_min: float | None = None
    sel_recall_min_layer: int | None = None
    cmp_entropy_mean: float | None = None

    @property
    def loss_decreased(self) -> bool:
        return self.first_loss is not None and self.last_loss is not None and self.last_loss < self.first_loss

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["heartbeat_age_s"] = {str(k): v for k, v in self.heartbeat_age_s.items()}
        out["loss_decreased"] = self.loss_decreased
        return out


def summarize(state: RunState, now: float, stale_s: float = DEFAULT_STALE_S) -> RunSummary:
    """The run's figures at ``now``; ``stale_s``: heartbeat age that makes a running run stale (pass the run's
    own ``monitor.stale_s``)."""
    series = state.series()
    # the heartbeat writes a non-finite loss as null, the CSV as nan/inf: both count as non-finite
    losses = [_num(p.get("loss")) for p in series if "loss" in p]
    finite_losses = [v for v in losses if v is not None and math.isfinite(v)]
    nonfinite = sum(1 for v in losses if v is None or not math.isfinite(v))
    s = RunSummary(
        run_dir=str(state.run_dir),
        run_name=state.run_name,
        status=state.status(now, stale_s),
        steps_done=state.steps_done,
        steps_total=state.steps_total,
        world_size=state.world_size,
        first_loss=finite_losses[0] if finite_losses else None,
        last_loss=losses[-1] if losses else None,
        min_loss=min(finite_losses) if finite_losses else None,
        nonfinite_losses=nonfinite + sum(1 for a in state.anomalies if a.get("kind") == "nonfinite_loss"),
        heartbeat_age_s=state.heartbeat_age(now),
        anomalies=list(state.anomalies),
        halts=list(state.halts),
        checkpoints=list(state.checkpoints),
        end=state.end,
        pending_halt=state.pending_halt,
        corrupt_lines=state.corrupt_lines,
        truncated_lines=state.truncated_lines,
    )
    tps = [float(p["tokens_per_s"]) for p in series if finite(p.get("tokens_per_s"))]
    if tps:
        s.tokens_per_s_last = tps[-1]
        s.tokens_per_s_median = statistics.median(tps[len(tps) // 5:] or tps)  # skip warm-up fifth
    st = [float(p["step_time_s"]) for p in series if finite(p.get("step_time_s"))]
    if st:
        s.step_time_s_median = statistics.median(st[len(st) // 5:] or st)
    last = state.last_progress or {}
    last_row = series[-1] if series else {}
    s.tokens_seen = _num(last.get("tokens_seen")) or _num(last_row.get("tokens_seen"))
    s.elapsed_s = _num(last.get("elapsed_s")) or _num(last_row.get("elapsed_s"))
    s.eta_s_trainer = _num(last.get("eta_s"))
    s.eta_s = smoothed_eta(state)
    if s.eta_s is None:
        s.eta_s = s.eta_s_trainer
    s.lr = _num(last.get("lr")) if "lr" in last else _num(last_row.get("lr"))
    s.grad_norm = _num(last.get("grad_norm")) if "grad_norm" in last else _num(last_row.get("grad_norm"))
    s.last_checkpoint = state.checkpoints[-1] if state.checkpoints else None
    s.fetch_p50_ms = _num(last.get("fetch_p50_ms"))
    s.fetch_p95_ms = _num(last.get("fetch_p95_ms"))
    if s.fetch_p95_ms is None:
        fetch = values(state.csv_rows, "fetch_ms")
        s.fetch_p50_ms, s.fetch_p95_ms = percentile(fetch, 0.5), percentile(fetch, 0.95)
    peaks = values(state.progress, "mem_peak_mib")
    # every rank's latest
    peaks += values([rs.last_progress for rs in state.ranks.values() if rs.last_progress], "mem_peak_mib")
    s.mem_peak_mib = max(peaks) if peaks else None
    s.mem_reserved_mib = _num(last.get("mem_reserved_mib"))
    rss = values(state.progress, "rss_mib")
    s.rss_mib = max(rss) if rss else None
    s.gate_entropy_mean = _num(last.get("gate_entropy_mean"))
    shares = last.get("gate_branch_shares")
    s.gate_branch_shares = [float(x) for x in shares] if isinstance(shares,
                                                                    list) and all(finite(x)
                                                                                  for x in shares) else None
    s.gate_collapse_fraction = _num(last.get("gate_collapse_fraction"))
    s.sel_keys_mean = _num(last.get("sel_keys_mean"))
    s.mfu = _num(last.get("mfu"))
    s.scorer_kl = _num(last.get("scorer_kl")) if "scorer_kl" in last else _num(last_row.get("scorer_kl"))
    s.align_nll = _num(last.get("align_nll")) if "align_nll" in last else _num(last_row.get("align_nll"))
    sel = last_selection(state)
    if sel is not None:
        s.selection_step, s.selection = sel["step"], sel["layers"]
        s.sel_recall_mean, s.sel_recall_min = sel["recall_mean"], sel["recall_min"]
        s.sel_recall_min_layer, s.cmp_entropy_mean = sel["recall_min_layer"], sel["cmp_entropy_mean"]
    fb: dict[str, int] = {}
    for rs in state.ranks.values():
        d = (rs.last_progress or {}).get("fallback")
        if isinstance(d, dict):
            for k, v in d.items():
                if finite(v):
                    fb[str(k)] = fb.get(str(k), 0) + int(v)
    s.fallback = fb
    s.fallback_total = sum(fb.values())
    ready = state.loader_ready or {}
    s.data_source = str(ready.get("description") or ready.get("source") or "") or None
    s.data_warnings, s.data_fallback = state.data_warnings, state.data_fallback
    s.gpu_mem_errors, s.gpu_mem_errors_new = gpu_errors(state)
    if state.val_rows:
        s.val_loss = _num(state.val_rows[-1].get("val_loss"))
    elif state.evals:
        s.val_loss = _num(state.evals[-1].get("val_loss"))
    boot = state.boot or {}
    env = state.env or {}
    s.device = str(env.get("device_name") or boot.get("device") or env.get("device") or "") or None
    s.profile = env.get("profile") if isinstance(env.get("profile"), str) else None
    s.config_path = env.get("config_path") if isinstance(env.get("config_path"), str) else None
    git: dict[str, Any] = env["git"] if isinstance(env.get("git"), dict) else {}
    s.commit = str(git.get("commit") or env.get("commit")
                   or "") or None  # type: ignore[typeddict-item]  # older env.json
    s.host = str(boot["host"]) if boot.get("host") else None
    s.pid = int(boot["pid"]) if isinstance(boot.get("pid"), int) and not isinstance(boot.get("pid"),
                                                                                    bool) else None
    return s


def _layer(r: Any) -> dict[str, Any] | None:
    """One layer of an ``eval`` event's ``selection`` with its numbers checked (None when it is not a
    layer)."""
    if not isinstance(r, dict) or not finite(r.get("layer")):
        return None
    gates = r.get("gates")
    return {"layer": int(r["layer"]), **{k: _num(r.get(k)) for k in SELECTION_FIELDS},
            "gates": [float(g) for g in gates] if isinstance(gates, list) and all(finite(g) for g in gates)
            else None}


def last_selection(state: RunState) -> dict[str, Any] | None:
    """The selection diagnostics of the last evaluation that has them: ``{"step", "layers", "recall_mean",
    "recall_min", "recall_min_layer", "cmp_entropy_mean"}`` from rank 0's ``eval`` events (their ``selection``
    list), else from ``val.csv``'s columns (no per-layer list); None for a dense model, a run before these
    diagnostics, or one without an evaluation yet."""
    for ev in reversed(state.evals):
        raw = ev.get("selection")
        layers = [x for x in map(_layer, raw) if x is not None] if isinstance(raw, list) else []
        if not layers and _num(ev.get("sel_recall_mean")) is None:
            continue
        recalls = [(r["recall"], r["layer"]) for r in layers if r["recall"] is not None]
        low = min(recalls) if recalls else None
        ents = [r["cmp_entropy"] for r in layers if r["cmp_entropy"] is not None]
        mean, ent = _num(ev.get("sel_recall_mean")), _num(ev.get("cmp_entropy_mean"))
        return {"step": int(ev["step"]) if finite(ev.get("step")) else None, "layers": layers,
                "recall_mean": statistics.fmean(v for v, _ in recalls) if mean is None and recalls else mean,
                "recall_min": low[0] if low else _num(ev.get("sel_recall_min")),
                "recall_min_layer": low[1] if low else None,
                "cmp_entropy_mean": statistics.fmean(ents) if ent is None and ents else ent}
    for row in reversed(state.val_rows):
        if _num(row.get("sel_recall_mean")) is not None or _num(row.get("cmp_entropy_mean")) is not None:
            return {"step": int(row["step"]) if finite(row.get("step")) else None, "layers": [],
                    "recall_mean": _num(row.get("sel_recall_mean")),
                    "recall_min": _num(row.get("sel_recall_min")), "recall_min_layer": None,
                    "cmp_entropy_mean": _num(row.get("cmp_entropy_mean"))}
    return None


def gpu_errors(state: RunState) -> tuple[dict[str, int] | None, int | None]:
    """``(counters summed over the ranks' last progress lines, how many appeared this session)`` of the
    heartbeat's ``gpu_mem_errors`` (uncorrected ECC errors, retired pages); ``(None, None)`` without them."""
    total: dict[str, int] = {}
    new = 0
    seen = False
    for rs in state.ranks.values():
        last = (rs.last_progress or {}).get("gpu_mem_errors")
        first = (rs.first_progress or {}).get("gpu_mem_errors")
        if not isinstance(last, dict):
            continue
        seen = True
        for k, v in last.items():
            if finite(v):
                total[str(k)] = total.get(str(k), 0) + int(v)
                before = _num(first.get(k)) if isinstance(first, dict) else None
                new += max(0, int(v) - int(before)) if before is not None else 0
    return (total, new) if seen else (None, None)


def smoothed_eta(state: RunState, window_s: float = 300.0, min_points: int = 3) -> float | None:
    """Remaining steps x the wall-clock seconds per step over the current session's progress points of the
    last ``window_s`` seconds (at least ``min_points``; heartbeat ``ts``), so one slow or fast interval moves
    the estimate by its share of the window instead of replacing it. Falls back to the median
    ``step_time_s`` of those points; None when nothing is known."""
    total, done = state.steps_total, state.steps_done
    if total is None:
        return None
    remaining = max(0, total - done)
    if remaining == 0:
        return 0.0
    pts = [(float(p["ts"]), float(p["step"])) for p in state.session_progress()
           if finite(p.get("ts")) and finite(p.get("step"))]
    if pts:
        last_ts = pts[-1][0]
        recent = [q for q in pts if q[0] >= last_ts - window_s]
        if len(recent) < min_points:
            recent = pts[-min_points:]
        dt, dstep = recent[-1][0] - recent[0][0], recent[-1][1] - recent[0][1]
        if dt > 0 and dstep > 0:
            return remaining * dt / dstep
    times = [float(p["step_time_s"]) for p in (state.session_progress() or state.series())[-20:]
             if finite(p.get("step_time_s"))]
    return remaining * statistics.median(times) if times else None
