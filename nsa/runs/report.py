"""The daily test report: markdown (+ PNG charts) built from a run directory's own files.

Default path: ``Documentation/Reports/<yyyy-mm-dd> Test Engineer Report - <run name> v<N>.md`` with ``N``
one above the highest existing version for that date and name; ``out_dir`` ending in ``.md`` (or naming an
existing file) is the report file itself, replaced only with ``force``. Files are written atomically
(temporary file + rename). Works on a finished, running or crashed run; several runs add a comparison table.

The verdict comes from checks, each shown with its figure and limit: the run's records (non-finite values,
backend fallbacks, loss trend, watchdog halts) and the ``monitor`` limits saved in its ``config.yaml``
(throughput floor, fetch p95, gate entropy and collapse, GPU memory ceiling, eval accuracy), optionally
overridden by a profile's ``monitor:`` block.

Size: the markdown report's sections (run, environment, evaluation, comparison, notes); the judgement is in
``nsa.runs.verdict``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa.errors import NSAError, RunDirError
from nsa.fileio import free_space, write_atomic
from nsa.rundir import RunDir
from nsa.rundir.checkpoints import step_of
from nsa.rundir.env import REDACTED, is_secret
from nsa.rundir.layout import CHECKPOINTS_DIR
from nsa.rundir.records import EVAL_SCHEMA, newer_schema, schema_note
from nsa.runs.alarms import KeptAlarm, kept_alarms
from nsa.runs.charts import Chart, RunSeries, combined_charts, run_charts
from nsa.runs.reader import DEFAULT_STALE_S, RunState, is_run_dir, read_run
from nsa.runs.rules import monitor_config
from nsa.runs.sessions import Session, read_sessions
from nsa.runs.summary import RunSummary, anomaly_text, halt_checkpoint_text, step_ranges, summarize, values
from nsa.runs.verdict import (
    WARN_MARGIN,
    Check,
    HaltRecord,
    Limits,
    anomaly_record_path,
    classify_halts,
    context_label,
    fmt_value,
    overall_verdict,
    profile_limits,
    run_checks,
    run_limits,
    stale_evals,
    verdict,
)
from nsa.view import Block, Line, Result

DEFAULT_OUT = Path("Documentation") / "Reports"
# RUN/eval/<task>.json written by `nsa eval`, in report order
EVAL_TASKS = ("needle", "mqar", "ruler", "loss", "selection")


@dataclass
class ReportResult(Result):
    path: Path
    runs: list[RunSummary]
    verdicts: list[tuple[str, str]]
    images: list[Path] = field(default_factory=list)
    checks: list[list[Check]] = field(default_factory=list)
    limits: list[Limits] = field(default_factory=list)
    # (run name or None for combined, chart)
    charts: list[tuple[str | None, Chart]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def overall(self) -> str:
        """``FAIL`` if any run failed, else ``RUNNING`` if any runs, ``PASS`` if all passed, else
        ``INCOMPLETE``."""
        return overall_verdict(self.verdicts)

    @property
    def failed(self) -> bool:
        return self.overall == "FAIL"

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def view(self) -> list[Block]:
        """Each run's verdict and why, then where the report is."""
        lines = [Line(f"{v}  {s.run_name}: {why}", v, lead=len(v)) for s,
                 (v, why) in zip(self.runs, self.verdicts,
                                                                                           strict=True)]
        return [*lines, Line(f"report: {self.path}")]

    def to_dict(self) -> dict[str, Any]:
        runs = []
        for i, (s, (v, why)) in enumerate(zip(self.runs, self.verdicts, strict=True)):
            run: dict[str, Any] = {"run_dir": s.run_dir, "run_name": s.run_name, "status": s.status,
                                   "verdict": v, "why": why}
            if i < len(self.checks):
                run["checks"] = [c.to_dict() for c in self.checks[i]]
            if i < len(self.limits):
                run["limits"] = {k: {"value": val, "source": self.limits[i].sources.get(k)}
                                 for k, val in self.limits[i].values.items()}
            runs.append(run)
        return {
            "path": str(self.path),
            "verdict": self.overall,
            "images": [str(p) for p in self.images],
            "charts": [{"run": name, **c.to_dict()} for name, c in self.charts],
            "notes": list(self.notes),
            "runs": runs,
        }


def newest_run(root: str | Path = "artifacts") -> Path:
    """The run directory under ``root`` whose files changed last."""
    base = Path(root)
    if not base.is_dir():
        raise RunDirError(f"no run given and {base}/ does not exist",
                          hint="pass a run directory: nsa report RUN_DIR")
    best: tuple[float, Path] | None = None
    for p in [base, *base.rglob("*")]:
        if p.is_dir() and CHECKPOINTS_DIR not in p.parts and is_run_dir(p):
            mtime = max((f.stat().st_mtime for f in p.iterdir() if f.is_file()), default=p.stat().st_mtime)
            if best is None or mtime > best[0]:
                best = (mtime, p)
    if best is None:
        raise RunDirError(f"no run directory under {base}/", hint="pass a run directory: nsa report RUN_DIR")
    return best[1]


@contextlib.contextmanager
def _writing(target: Path) -> Iterator[None]:
    """Turn an ``OSError`` (read-only filesystem, no permission, ...) while writing into one ``NSAError``."""
    try:
        yield
    except OSError as exc:
        why = exc.strerror or str(exc)
        name = str(exc.filename or "")
        where = f" ({name})" if name and ".tmp-" not in name and Path(name) != target else ""
        free = free_space(target)
        raise NSAError(f"cannot write the report to {target}: {why}{where}" + (f" ({free})" if free else ""),
                       hint="free disk space, or choose a writable folder with --out") from None


def _mib(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f} MiB ({v / 1024:.2f} GiB)"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"


def _safe_name(text: str) -> str:
    return re.sub(r"[\\/:*?\"<>|]+", "-", text).strip() or "run"


def next_version(out_dir: Path, date: str, name: str) -> int:
    pattern = re.compile(re.escape(f"{date} Test Engineer Report - {name} v") + r"(\d+)\.md$")
    versions = [int(m.group(1)) for p in out_dir.glob("*.md") if (m := pattern.match(p.name))]
    return max(versions, default=0) + 1


def _rel(target: Path, start: Path) -> str:
    rel = os.path.relpath(target.resolve(), start.resolve())
    return rel.replace(os.sep, "/")


def _link(target: Path, start: Path, text: str | None = None) -> str:
    rel = _rel(target, start)
    return f"[{text or target.name}](<{rel}>)"


def _dotted(tree: dict[str, Any] | None, dotted: str) -> Any:
    node: Any = tree or {}
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _cfg(st: RunState, section: str, key: str) -> Any:
    return ((st.config or {}).get(section) or {}).get(key)


@dataclass
class _Run:
    """One run's state, summary and everything the report derives from them."""

    st: RunState
    s: RunSummary
    limits: Limits
    evals: list[tuple[str, dict[str, Any] | None]]
    halts: list[HaltRecord]
    boots: list[dict[str, Any]]
    checks: list[Check]
    verdict: tuple[str, str]
    alarms: list[KeptAlarm] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    charts: dict[str, Path] = field(default_factory=dict)
    stale: dict[str, str] = field(default_factory=dict)  # eval results not of the model as it is now, by task


def _cell(text: Any) -> str:
    """``text`` as inline code in a table cell (pipes escaped, backticks fenced)."""
    t = str(text).replace("\n", " ").replace("|", "\\|")
    return f"`` {t} ``" if "`" in t else f"`{t}`"


def session_boots(st: RunState) -> list[dict[str, Any]]:
    """Every ``boot`` event of rank 0's heartbeat (one per session; the reader keeps only the last)."""
    r0 = st.rank0
    path = st.files.heartbeat(r0.rank if r0 else 0)
    out: list[dict[str, Any]] = []
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            if b'"boot"' not in line:
                continue
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and ev.get("event") == "boot":
                    out.append(ev)
    return out


def _steps(events: Sequence[Mapping[str, Any]]) -> list[float]:
    return [float(e["step"]) for e in events if isinstance(e.get("step"), int | float)
            and not isinstance(e.get("step"), bool)]


def resume_step(boot: dict[str, Any]) -> int | None:
    """The step a session resumed at: its checkpoint's ``step_NNNNNNNN`` (a ``boot`` is written at step 0)."""
    if (at := step_of(str(boot.get("resumed_from") or ""))) >= 0:
        return at
    step = boot.get("step")
    return step if isinstance(step, int) and step > 0 else None


def chart_series(run: _Run) -> RunSeries:
    """What the charts of a run draw: per-step rows, progress events, validation points and markers."""
    st = run.st
    val_src = st.val_rows or st.evals
    val = [(float(r["step"]), float(r["val_loss"])) for r in val_src
           if isinstance(r.get("step"), int | float) and isinstance(r.get("val_loss"), int | float)
           and math.isfinite(r["val_loss"])]
    return RunSeries(
        name=run.s.run_name,
        points=st.series(),
        progress=st.progress,
        val=val,
        checkpoints=_steps(st.checkpoints),
        halts=_steps(st.halts),
        resumes=[float(x) for b in run.boots if b.get("resumed_from") and (x := resume_step(b)) is not None],
        limits=dict(run.limits.values),
    )


def _checks_section(run: _Run) -> list[str]:
    L = ["### Verdict checks", "",
         "Each check with its figure and limit. Limits are the run's `monitor.*` settings (saved in its "
         "config.yaml; `--limits PROFILE` overrides them); \"not set\" and \"n/a\" do not judge, WARN = "
         f"within {WARN_MARGIN:.0%} of the limit.", "",
         "| check | figure | limit | result |", "|---|---|---|---|"]
    for c in run.checks:
        result = f"**{c.result}**" if c.result in ("FAIL", "WARN") else c.result
        L.append(f"| {c.name} | {c.figure.replace('|', '/')} | {c.limit} | {result} |")
    L.append("")
    return L


def _when(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if t is not None else "n/a"


def _sessions_section(sessions: Sequence[Session]) -> list[str]:
    """The run's history: one row per ``nsa train`` start (fresh or resumed), how it ended and its steps."""
    if not sessions:
        return []
    L = ["### Sessions", "", "| # | started | ended | how it ended | steps |", "|---|---|---|---|---|"]
    for x in sessions:
        ended = "still running" if x.status == "running" else _when(x.end)
        how = x.how().replace("|", "/")
        L.append(f"| {x.index} | {_when(x.start)} | {ended} | {how} | {x.first_step} -> {x.last_step} |")
    L.append("")
    return L


def _env_section(env: Mapping[str, Any]) -> list[str]:
    """``NSA_*`` settings and the other recorded variables (CUDA_*, NCCL_*, PYTORCH_*, ...), secrets
    redacted."""
    L = ["### Environment variables", ""]
    nsa: dict[str, Any] = env["nsa_settings"] if isinstance(env.get("nsa_settings"), dict) else {}
    other = env.get("environment")
    rows = sorted((str(k), v) for k, v in nsa.items())
    rows += sorted((str(k), v) for k, v in other.items()) if isinstance(other, dict) else []
    if rows:
        L += ["| variable | value |", "|---|---|"]
        L += [f"| {_cell(k)} | {_cell(REDACTED if is_secret(k) else v)} |" for k, v in rows]
        L.append("")
    if not isinstance(other, dict):
        L += ["Other variables (CUDA_\\*, NCCL_\\*, PYTORCH_\\*, ...) were not recorded in this run's "
              "env.json.", ""]
    elif not rows:
        L += ["None set.", ""]
    L += ["Values of names with a word ending in TOKEN, KEY, SECRET, PASSWORD, CREDENTIAL or AUTH (HF_TOKEN, "
          "WANDB_API_KEY) are redacted; NSA_TOKENIZER names a tokenizer and is shown.", ""]
    return L


def _img(run: _Run, key: str, alt: str, out_dir: Path) -> list[str]:
    p = run.charts.get(key)
    return [f"![{alt}]({_rel(p, out_dir)})", ""] if p is not None else []


def _run_section(run: _Run, out_dir: Path) -> list[str]:
    st, s, v = run.st, run.s, run.verdict
    env = st.env or {}
    versions = env.get("versions") or {}
    git = env.get("git") or {}
    L = [f"## Run `{s.run_name}`", ""]
    L += [f"**Verdict: {v[0]}** — {v[1]}", ""]
    L += _checks_section(run)
    L += ["### Run", "", "| | |", "|---|---|"]
    L.append(f"| Run directory | {_link(st.run_dir, out_dir, str(st.run_dir))} |")
    log = st.files.train_log
    if log.exists():
        L.append(f"| Log | {_link(log, out_dir, log.name)} (every line the trainer printed) |")
    sessions = f", {len(run.sessions)} sessions" if len(run.sessions) > 1 else ""
    L.append(f"| Status | {s.status} ({s.steps_done}/{s.steps_total or '?'} steps, world size "
             f"{s.world_size}{sessions}) |")
    dirty = git.get("dirty")
    L.append(f"| Branch / commit | {git.get('branch') or 'n/a'} / `{git.get('commit') or 'n/a'}`"
             f" ({'dirty' if dirty else 'clean' if dirty is False else 'dirty state unknown'}) |")
    gpus = env.get("gpus") or []
    gpu_text = ", ".join(sorted(set(map(str, gpus)))) + f" x{len(gpus)}" if gpus else (env.get("device_name")
                                                                                       or s.device or "n/a")
    L.append(f"| Device | {gpu_text} ({env.get('device') or 'n/a'}, {env.get('precision') or 'n/a'}) |")
    L.append(f"| Driver | {env.get('driver') or 'n/a'} |")
    L.append("| Python / torch / CUDA / triton / flash-attn | " + " / ".join(
        str(versions.get(k) or "n/a") for k in ("python", "torch", "cuda", "triton", "flash_attn")) + " |")
    L.append(f"| Profile | {env.get('profile') or 'none'} |")
    settings = env.get("nsa_settings") or {}
    L.append("| NSA_* environment | " + (", ".join(
        f"`{k}={REDACTED if is_secret(str(k)) else val}`" for k, val in sorted(settings.items())) or "none")
             + " |")
    overrides = {k: v for k, v in st.config_sources.items() if not v.startswith("config")}
    if overrides:
        L.append("| Settings above the config file | " + ", ".join(
            f"`{k}={_dotted(st.config, k)}` ({v})" for k, v in sorted(overrides.items())) + " |")
    unknown = env.get("nsa_unknown_variables") or []
    if unknown:
        L.append(f"| Unknown NSA_* (ignored) | {', '.join(unknown)} |")
    if st.config_error is not None:
        L.append(f"| Config | `{env.get('config_path') or 'n/a'}`; **{st.config_error.replace('|', '/')}**: "
                 "the run's settings are unknown |")
    else:
        L.append(f"| Config | `{env.get('config_path') or 'n/a'}`: seq_len {_cfg(st, 'train', 'seq_len')}, "
                 f"batch {_cfg(st, 'train', 'batch_size')} x accum {_cfg(st, 'train', 'accum')}, steps "
                 f"{_cfg(st, 'train', 'steps')}, attention backend {_cfg(st, 'runtime', 'attn_backend')} |")
    source = _cfg(st, "data", "source")
    data = (f"**SYNTHETIC tokens instead of data.source={source}**: {s.data_fallback}" if s.data_fallback
            else (s.data_source or f"data.source={source}"))
    L.append(f"| Data | {data.replace('|', '/')} |")
    for w in s.data_warnings:
        if w != s.data_fallback:
            L.append(f"| Data warning | {w.replace('|', '/')} |")
    if st.config is not None:
        L.append(f"| Model | dim {_cfg(st, 'model', 'dim')}, {_cfg(st, 'model', 'n_layers')} layers, "
                 f"{_cfg(st, 'model', 'n_heads')} heads / {_cfg(st, 'model', 'n_kv_groups')} KV groups; NSA "
                 f"l={_cfg(st, 'nsa', 'l')} d={_cfg(st, 'nsa', 'd')} l_sel={_cfg(st, 'nsa', 'l_sel')} "
                 f"n_sel={_cfg(st, 'nsa', 'n_sel')} w={_cfg(st, 'nsa', 'w')} |")
    else:
        L.append("| Model | unknown (no readable config.yaml) |")
    L.append("")
    L += _sessions_section(run.sessions)
    L += _env_section(env)
    L += ["### Training", "", "| metric | value |", "|---|---|"]
    L.append(f"| loss first / last / min | {fmt_value(s.first_loss, '.4f')} / "
             f"{fmt_value(s.last_loss, '.4f')} / {fmt_value(s.min_loss, '.4f')} |")
    L.append(f"| validation loss (last) | {fmt_value(s.val_loss, '.4f')} |")
    L.append(f"| tokens/s median / last | {fmt_value(s.tokens_per_s_median, ',.0f')} / "
             f"{fmt_value(s.tokens_per_s_last, ',.0f')} |")
    L.append(f"| step time median | {fmt_value(s.step_time_s_median, '.4f', ' s')} |")
    L.append(f"| tokens seen | {fmt_value(s.tokens_seen, ',.0f')} |")
    L.append(f"| elapsed | {fmt_value(s.elapsed_s, '.1f', ' s')} |")
    L.append(f"| fetch p50 / p95 | {fmt_value(s.fetch_p50_ms, '.1f', ' ms')} / "
             f"{fmt_value(s.fetch_p95_ms, '.1f', ' ms')} |")
    L.append(f"| peak GPU memory (allocator peak) | {_mib(s.mem_peak_mib)} |")
    L.append(f"| reserved GPU memory (last) | {_mib(s.mem_reserved_mib)} |")
    L.append(f"| host RSS (peak) | {_mib(s.rss_mib)} |")
    util, used = values(st.progress, "gpu_util_pct"), values(st.progress, "gpu_mem_used_mib")
    if util or used:
        L.append("| GPU utilisation median / min (NVML) | "
                 f"{fmt_value(statistics.median(util) if util else None, '.0f', '%')} / "
                 f"{fmt_value(min(util) if util else None, '.0f', '%')} |")
        L.append(f"| GPU memory used, peak (NVML, every process) | {_mib(max(used) if used else None)} |")
    L.append(f"| MFU | {fmt_value(s.mfu, '.1%') if s.mfu is not None else 'n/a'} |")
    L.append("")
    ranges = step_ranges(st.series())
    if ranges:
        L += ["### Tokens/s trend", "", "| steps | mean tokens/s | min | max | points |",
              "|---|---|---|---|---|"]
        for r in ranges:
            L.append(f"| {r['from_step']}–{r['to_step']} | {r['mean']:,.0f} | {r['min']:,.0f} | "
                     f"{r['max']:,.0f} | {r['points']} |")
        L.append("")
    L += _img(run, "loss",
              "loss curve with validation points; dotted: checkpoints, red: halts, green dashed: resumes",
              out_dir)
    L += _img(run, "tokens_per_s", "tokens/s, rolling median", out_dir)
    L += _img(run, "lr_grad", "learning rate and gradient norm", out_dir)
    L += _img(run, "memory", "memory: GPU allocated/reserved/peak and host RSS", out_dir)
    L += _img(run, "gpu", "GPU utilisation and memory used over the steps (NVML)", out_dir)
    L += _img(run, "fetch", "data fetch latency p50/p95", out_dir)
    L += ["### Gate health and counters", "", "| metric | value |", "|---|---|"]
    shares = s.gate_branch_shares
    L.append(f"| gate entropy (mean) | {fmt_value(s.gate_entropy_mean, '.3f')} |")
    L.append("| branch shares cmp / sel / win | "
             + (" / ".join(f"{x:.3f}" for x in shares) if shares else "n/a") + " |")
    L.append(f"| collapsed-gate fraction | {fmt_value(s.gate_collapse_fraction, '.3f')} |")
    L.append(f"| selected keys per query (mean) | {fmt_value(s.sel_keys_mean, '.1f')} |")
    L.append("| fallback counters | "
             + (", ".join(f"`{k}`: {n}" for k, n in sorted(s.fallback.items())) or "none (0)") + " |")
    L.append(f"| unreadable heartbeat/CSV lines | {s.corrupt_lines} corrupt, {s.truncated_lines} truncated |")
    L.append("")
    L += _img(run, "gates", "gate entropy, collapsed-gate fraction and branch shares", out_dir)
    L += selection_section(s)
    L += _eval_section(run, out_dir, run.charts.get("needle"))
    L += ["### Anomalies, halts and alarms", ""]
    resumes = [b for b in run.boots if b.get("resumed_from")]
    if not s.anomalies and not run.halts and not resumes and not run.alarms:
        L += ["None.", ""]
    for a in s.anomalies:
        rec = a.get("record")
        link = f" — {_link(anomaly_record_path(st.run_dir, rec), out_dir)}" if rec else ""
        L.append(f"- anomaly `{anomaly_text(a)}`{link}")
    for h in run.halts:
        tag = " — **hung** (stale heartbeat)" if h.hung else " — **watchdog**" if h.by == "watchdog" else ""
        if h.acted:
            L.append(f"- halt at step {h.step} by {h.by}{tag}: {h.reason} (source {h.source}, "
                     f"{halt_checkpoint_text(h.checkpoint)})")
        elif h.where == ".HALT":
            L.append(f"- pending `.HALT` (not yet acted on) by {h.by}{tag}: {h.reason}")
        else:
            L.append(f"- `.HALT` found at a restart and archived to `{h.where}` (not obeyed) by {h.by}{tag}: "
                     f"{h.reason}")
    for b in resumes:
        L.append(f"- resumed at step {resume_step(b)} from `{b.get('resumed_from')}`")
    for al in run.alarms:
        L.append(f"- alarm {al.describe()} (kept by nsa watch in `alarms.jsonl`; {al.state})")
    if s.end and s.end.get("error"):
        L.append(f"- end error: `{s.end.get('error')}`")
    L.append("")
    L += ["### Artifacts", ""]
    rd = st.files
    for p in (rd.config, rd.env, rd.train_log, rd.train_csv, rd.val_csv, rd.metrics, rd.heartbeat(0),
              rd.tensorboard, rd.export, rd.eval, rd.halts, rd.alarms, rd.anomalies):
        name = p.name
        if p.exists():
            L.append(f"- {_link(p, out_dir, name)}")
    for c in s.checkpoints[-3:]:
        if c.get("path"):
            p = Path(str(c["path"]))
            p = p if p.is_absolute() else st.run_dir / p
            if not p.exists():
                p = rd.checkpoints / Path(str(c["path"])).name
            L.append(f"- checkpoint ({c.get('reason')}, step {c.get('step')}): {_link(p, out_dir, p.name)}")
    L.append("")
    return L


RECALL_LOW = 0.5  # a layer whose selection recall is below this misses most of what dense attention reads
# compressed attention entropy (normalised) above this: near uniform, the block scores say little
CMP_FLAT = 0.95


def selection_reading(layers: Sequence[dict[str, Any]]) -> str:
    """One line that reads a per-layer selection table: which layers lose most of the dense attention mass,
    which score blocks from a near-uniform compressed attention."""
    recalls = [(r["layer"], r["recall"]) for r in layers if r.get("recall") is not None]
    if not recalls:
        return ("Every block is selected at this sequence length (seq_len <= n_sel * l_sel): recall is 1 by "
                "construction.")
    low = [i for i, v in recalls if v < RECALL_LOW]
    flat = [r["layer"] for r in layers if r.get("cmp_entropy") is not None and r["cmp_entropy"] > CMP_FLAT]
    worst = min(recalls, key=lambda x: x[1])
    parts = [f"recall below {RECALL_LOW:g} in layer{'s' if len(low) > 1 else ''} {', '.join(map(str, low))}: "
             "selection misses most of what dense attention reads there" if low else
             f"recall at least {RECALL_LOW:g} in every layer (lowest {worst[1]:.2f}, layer {worst[0]})"]
    if flat:
        parts.append(f"compressed attention near uniform (entropy > {CMP_FLAT:g}) in "
                     f"layer{'s' if len(flat) > 1 else ''} {', '.join(map(str, flat))}: its block scores "
                     "carry little information")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def selection_section(s: RunSummary) -> list[str]:
    """"Selection (last evaluation, step N)": per NSA layer recall, compressed entropy, scorer KL and gates,
    and one line reading them (nothing for a run without the diagnostics: dense, or before the first eval)."""
    if s.selection_step is None:
        return []
    L = [f"### Selection (last evaluation, step {s.selection_step})", "",
         "On the first held-out batch: recall = share of dense attention mass (same q/k) inside the selected "
         "blocks (1 = nothing lost); ceiling = the mass of the best blocks selection could choose (a perfect "
         "scorer's recall); forced blocks = the share in the blocks every query keeps (first, current, "
         "previous); compressed entropy = compressed attention entropy / log(visible tokens) "
         "(1 = uniform); scorer KL = KL(dense block mass || the compressed branch's block scores); gates = "
         "mean gate per branch.", ""]
    if s.selection:
        L += ["| layer | recall | ceiling | forced blocks | compressed entropy | scorer KL | gates cmp / sel "
              "/ win |", "|---|---|---|---|---|---|---|"]
        for r in s.selection:
            gates = " / ".join(f"{g:.3f}" for g in r["gates"]) if r.get("gates") else "n/a"
            L.append(f"| {r['layer']} | {fmt_value(r.get('recall'), '.3f')} | "
                     f"{fmt_value(r.get('recall_best'), '.3f')} | {fmt_value(r.get('recall_forced'), '.3f')} "
                     f"| {fmt_value(r.get('cmp_entropy'), '.3f')} | {fmt_value(r.get('kl'), '.3f')} | "
                     f"{gates} |")
        L += ["", selection_reading(s.selection), ""]
    else:  # val.csv alone (no heartbeat): the means only
        L += [f"Mean recall {fmt_value(s.sel_recall_mean, '.3f')}, lowest "
              f"{fmt_value(s.sel_recall_min, '.3f')}, compressed entropy "
              f"{fmt_value(s.cmp_entropy_mean, '.3f')} (val.csv; no per-layer figures).", ""]
    if s.scorer_kl is not None:
        L += [f"Scorer loss (training, last log step): {s.scorer_kl:.4f}.", ""]
    if s.align_nll is not None:
        L += [f"Alignment loss (training, last log step): {s.align_nll:.4f} (-log of the dense attention "
              f"mass selection kept: recall about {math.exp(-s.align_nll):.3f} on training batches).", ""]
    return L


def _eval_payloads(run_dir: Path) -> list[tuple[str, dict[str, Any] | None]]:
    """``(task, payload or None when unreadable)`` for each ``RUN/eval/<task>.json`` present."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    for task in EVAL_TASKS:
        p = RunDir(run_dir).eval_result(task)
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            data = None
        ok = isinstance(data, dict) and isinstance(data.get("results"), list) and all(
            isinstance(r, dict) for r in data["results"])
        out.append((task, data if ok else None))
    return out


def _copy_eval_chart(run_dir: Path, folder: Path) -> Path | None:
    """Copy ``RUN/eval/needle.png`` into the report's assets folder (None when absent or unreadable)."""
    src = RunDir(run_dir).needle_png
    try:
        data = src.read_bytes() if src.is_file() else None
    except OSError:
        data = None
    if data is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    dst = folder / "needle.png"
    write_atomic(dst, lambda tmp: tmp.write_bytes(data))
    return dst


def _eval_section(run: _Run, out_dir: Path, needle_png: Path | None) -> list[str]:
    """The "Evaluation" section: one table per ``nsa eval`` task found in ``RUN/eval/`` (nothing when
    none)."""
    found, run_dir = run.evals, run.st.run_dir
    if not found:
        return []
    L = ["### Evaluation", ""]
    for task, data in found:
        if data is None:
            L += [f"- `eval/{task}.json` could not be read", ""]
            continue
        rows, st = data["results"], data.get("settings") or {}
        ckpt = str(data.get("checkpoint") or "n/a")
        with contextlib.suppress(ValueError):
            ckpt = Path(ckpt).relative_to(run_dir).as_posix()
        when = (data.get("env") or {}).get("date") or "n/a"
        step = data.get("step")
        source = (f"weights `{ckpt}` (step {step if isinstance(step, int) else 'not recorded'}), {when}, "
                  f"seed {st.get('seed')}")
        stale = run.stale.get(task)
        if stale:
            L += [f"**STALE** `eval/{task}.json`: {stale}.", ""]
        if task == "needle":
            contexts = sorted({r.get("context") for r in rows if isinstance(r.get("context"), int)})
            depths = sorted({r.get("depth") for r in rows if isinstance(r.get("depth"), int | float)})
            acc = {(r.get("context"), r.get("depth")): r.get("accuracy") for r in rows}
            L += ["#### Needle retrieval", "",
                  "Accuracy of the value after the repeated key; rows = needle depth (0 = first token), "
                  f"columns = context. {st.get('samples')} samples per cell, haystack {st.get('haystack')}; "
                  f"{source}.", ""]
            L.append("| depth / context | " + " | ".join(context_label(c) for c in contexts) + " |")
            L.append("|---|" + "---|" * len(contexts))
            for d in depths:
                L.append(f"| {d:g} | " + " | ".join(fmt_value(acc.get((c, d)), ".2f") for c in contexts)
                         + " |")
            L.append("")
            if needle_png is not None:
                L += [f"![needle retrieval heat map]({_rel(needle_png, out_dir)})", ""]
        elif task == "mqar":
            L += ["#### Multi-query associative recall", "",
                  f"{st.get('pairs')} pairs, {st.get('queries')} queries, {st.get('samples')} samples per "
                  f"context, haystack {st.get('haystack')}; {source}.", "",
                  "| context | accuracy | keys asked |", "|---|---|---|"]
            L += [f"| {context_label(r.get('context'))} | {fmt_value(r.get('accuracy'), '.3f')} | "
                  f"{fmt_value(r.get('n'), ',')} |" for r in rows]
            L.append("")
        elif task == "ruler":
            contexts = sorted({r.get("context") for r in rows if isinstance(r.get("context"), int)})
            names = list(dict.fromkeys(str(r.get("task")) for r in rows))
            score = {(str(r.get("task")), r.get("context")): r.get("score") for r in rows}
            L += ["#### RULER-style suite", "",
                  "Share of answer values right (every token of a value predicted, reading the episode "
                  f"once); rows = task, columns = context, `mean` = over the tasks. {st.get('samples')} "
                  f"episodes per cell, haystack {st.get('haystack')}; {source}.", ""]
            L.append("| task / context | " + " | ".join(context_label(c) for c in contexts) + " |")
            L.append("|---|" + "---|" * len(contexts))
            L += [f"| {n} | " + " | ".join(fmt_value(score.get((n, c)), ".2f") for c in contexts) + " |"
                  for n in names]
            nll = {r.get("context"): r.get("answer_nll") for r in rows if r.get("task") == "mean"}
            if any(v is not None for v in nll.values()):  # files from before the answer NLL have none
                L.append("| answer NLL (nats per answer token, over the tasks) | "
                         + " | ".join(fmt_value(nll.get(c), ".3f") for c in contexts) + " |")
            L.append("")
        elif task == "selection":
            L += ["#### Selection (nsa eval)", "",
                  f"Validation split, {st.get('samples')} sequences per context, {st.get('queries')} query "
                  f"positions per layer; {source}. Recall \"–\": every block is selected at that length.", "",
                  "| context | layer | recall | ceiling | forced blocks | compressed entropy | scorer KL "
                  "| gates cmp / sel / win |",
                  "|---|---|---|---|---|---|---|---|"]
            for r in rows:
                gates = r.get("gates")
                shown = " / ".join(fmt_value(g, ".3f") for g in gates) if isinstance(gates, list) else "n/a"
                recall = "–" if r.get("recall") is None else fmt_value(r.get("recall"), ".3f")
                L.append(f"| {context_label(r.get('context'))} | {r.get('layer')} | {recall} "
                         f"| {fmt_value(r.get('recall_best'), '.3f')} | "
                         f"{fmt_value(r.get('recall_forced'), '.3f')} | "
                         f"{fmt_value(r.get('cmp_entropy'), '.3f')} | {fmt_value(r.get('kl'), '.3f')} | "
                         f"{shown} |")
            L.append("")
        else:
            L += ["#### Held-out loss", "",
                  f"Validation split, {st.get('samples')} sequences per context; {source}.", "",
                  "| context | loss | bits/byte | tokens |", "|---|---|---|---|"]
            L += [f"| {context_label(r.get('context'))} | {fmt_value(r.get('loss'), '.4f')} | "
                  f"{fmt_value(r.get('bits_per_byte'), '.4f')} | "
                  f"{fmt_value(r.get('n'), ',')} |" for r in rows]
            L.append("")
    return L


def kernel_path(st: RunState, s: RunSummary) -> str:
    """Which attention path ran: the configured backend (``auto`` resolved from the device and Triton),
    with the torch path's share when calls fell back (the heartbeat's fallback counters)."""
    if _cfg(st, "model", "attention") == "dense":
        return "dense (SDPA)"
    backend = str(_cfg(st, "runtime", "attn_backend") or "auto")
    if backend == "auto":
        env = st.env or {}
        cuda = str(env.get("device") or s.device or "").startswith("cuda")
        backend = "triton" if cuda and (env.get("versions") or {}).get("triton") else "torch"
    if s.fallback_total and backend != "torch":
        backend = f"{backend} + torch fallback ({s.fallback_total:,} calls)"
    dense = _cfg(st, "model", "dense_layers") or []
    return f"{backend}; blocks {','.join(map(str, dense))} dense (SDPA)" if dense else backend


def _comparison(states: list[RunState], summaries: list[RunSummary],
                verdicts: list[tuple[str, str]]) -> list[str]:
    L = ["## Comparison", "",
         "`kernel path`: the attention path that ran (the configured backend, `auto` resolved; calls that "
         "fell back to the torch path counted). Tokens/s are of all ranks together.", "",
         "| run | S | batch x accum | world size | kernel path | device | status | step time (s) | tokens/s "
         "| peak memory | final loss | val loss | verdict |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for st, s, v in zip(states, summaries, verdicts, strict=True):
        mem = (_mib(s.mem_peak_mib) if s.mem_peak_mib is not None
               else _mib(s.rss_mib) + " RSS" if s.rss_mib else "n/a")
        L.append(
            f"| {s.run_name} | {_cfg(st, 'train', 'seq_len')} | {_cfg(st, 'train', 'batch_size')} x "
            f"{_cfg(st, 'train', 'accum')} | {s.world_size} | {kernel_path(st, s)} | {s.device or 'n/a'} | "
            f"{s.status} | {fmt_value(s.step_time_s_median, '.4f')} | "
            f"{fmt_value(s.tokens_per_s_median, ',.0f')} | "
            f"{mem} | {fmt_value(s.last_loss, '.4f')} | {fmt_value(s.val_loss, '.4f')} | {v[0]} |"
        )
    L.append("")
    return L


def read_notes(texts: Sequence[str] = (), files: Sequence[str | Path] = ()) -> list[str]:
    """The engineer's notes: each ``--note`` text, then each ``--note-file`` (``-``: standard input).

    Raises ``NSAError`` naming a note file that cannot be read."""
    out = [t.strip() for t in texts if t.strip()]
    for f in files:
        p = Path(f)
        hint = "give a readable UTF-8 text file to --note-file, or the text itself with --note"
        try:
            text = sys.stdin.read() if str(f) == "-" else p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NSAError(f"note file {p} does not exist", hint=hint) from None
        except UnicodeDecodeError:
            raise NSAError(f"note file {p} is not UTF-8 text", hint=hint) from None
        except OSError as exc:
            raise NSAError(f"cannot read note file {p}: {exc.strerror or exc}", hint=hint) from None
        if text.strip():
            out.append(text.strip())
    return out


def _notes_section(notes: Sequence[str]) -> list[str]:
    L = ["## Engineer's notes and deviations", ""]
    if not notes:
        return [*L, "None recorded (add them with `nsa report --note TEXT` or `--note-file PATH`).", ""]
    for note in notes:
        L += [f"- {note}"] if "\n" not in note else ["", note, ""]
    L.append("")
    return L


def _stale_s(st: RunState) -> float:
    """The run's own ``monitor.stale_s`` (its default when the section is missing or invalid)."""
    try:
        return monitor_config(st).stale_s
    except NSAError:
        return DEFAULT_STALE_S


def _prepare(run_dir: Path, now: float, override: tuple[dict[str, Any], str] | None) -> _Run:
    """Read one run and derive its limits, halts, kept alarms, checks and verdict."""
    st = read_run(run_dir)
    s = summarize(st, now, _stale_s(st))
    block, label = override if override is not None else (None, "--limits")
    limits = run_limits(st.config, st.config_sources, block, label, unreadable=st.config_error is not None)
    evals = _eval_payloads(st.run_dir)
    halts = classify_halts(s)
    sessions = read_sessions(st.run_dir, s.status)
    alarms = kept_alarms(st.run_dir, sessions)
    notes = [*st.schema_notes, *(schema_note(f"eval/{task}.json", v, EVAL_SCHEMA) for task, data in evals
                                 if (v := newer_schema(data, EVAL_SCHEMA)) is not None)]
    stale = stale_evals(evals, s.steps_done, st.run_dir)
    checks = run_checks(s, limits, evals, halts, st.progress, alarms, sessions, st.config_error, notes, stale)
    return _Run(st, s, limits, evals, halts, session_boots(st), checks, verdict(s, checks), alarms, sessions,
                stale=stale)


def build_report(
    run_dirs: list[str] | list[Path] | list[str | Path] | None = None,
    out_dir: str | Path | None = None,
    *,
    artifacts_root: str | Path = "artifacts",
    date: str | None = None,
    title: str | None = None,
    charts: bool = True,
    now: float | None = None,
    force: bool = False,
    limits: str | Path | None = None,
    notes: Sequence[str] = (),
    note_files: Sequence[str | Path] = (),
) -> ReportResult:
    """Write the report and its charts; returns the path and each run's verdict.

    ``out_dir`` is a folder (versioned file name inside), or the report file itself when it ends in
    ``.md`` or names an existing file; an existing report file is replaced only with ``force``. A path
    that cannot be written raises ``NSAError`` and leaves no partial report behind. ``limits`` names a
    hardware profile whose ``monitor:`` block overrides each run's saved limits; ``notes`` and the texts of
    ``note_files`` fill the "Engineer's notes and deviations" section (:func:`read_notes`)."""
    notes = read_notes(notes, note_files)
    dirs = [Path(p) for p in run_dirs] if run_dirs else [newest_run(artifacts_root)]
    now = time.time() if now is None else now
    override = profile_limits(limits) if limits is not None else None
    runs = [_prepare(p, now, override) for p in dirs]
    target = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    as_file = not target.is_dir() and (target.suffix.lower() == ".md" or target.exists())
    if as_file and target.exists() and not force:
        raise NSAError(f"report file {target} already exists",
                       hint="pass --force to replace it, or another --out")
    out = target.parent if as_file else target
    with _writing(target):
        out.mkdir(parents=True, exist_ok=True)
        return _write_report(runs, out, target if as_file else None, date or dt.date.today().isoformat(),
                             title, charts, now, list(notes))


def _write_report(
    runs: list[_Run],
    out: Path,
    file: Path | None,
    date: str,
    title: str | None,
    charts: bool,
    now: float,
    notes: list[str],
) -> ReportResult:
    """Charts, then the markdown (atomically) in ``out`` (at ``file`` when given)."""
    names = [r.s.run_name for r in runs]
    name = _safe_name(title
                      or (names[0] if len(names) == 1 else " vs ".join(names) if len(names) <= 3
                          else f"{len(names)} runs"))
    n = next_version(out, date, name)
    path = file or out / f"{date} Test Engineer Report - {name} v{n}.md"
    heading = f"{date} Test Engineer Report - {name}" + ("" if file else f" v{n}")
    images: list[Path] = []
    drawn: list[tuple[str | None, Chart]] = []
    combined: dict[str, Path] = {}
    if charts:
        folder = out / "assets" / (_slug(path.stem) if file else f"{date}-{_slug(name)}-v{n}")
        for i, run in enumerate(runs):
            run_folder = folder / f"run{i + 1}-{_slug(run.s.run_name)}" if len(runs) > 1 else folder
            for c in run_charts(chart_series(run), run_folder):
                run.charts[c.name] = c.path
                drawn.append((run.s.run_name, c))
            needle = _copy_eval_chart(run.st.run_dir, run_folder)
            if needle is not None:
                run.charts["needle"] = needle
            images += list(run.charts.values())
        if len(runs) > 1:
            for c in combined_charts([chart_series(r) for r in runs], folder):
                combined[c.name] = c.path
                drawn.append((None, c))
                images.append(c.path)

    verdicts = [r.verdict for r in runs]
    overall = overall_verdict(verdicts)
    L = [f"# {heading}", ""]
    L.append(f"Generated {dt.datetime.fromtimestamp(now, dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} by `nsa "
             "report` from the run directories' own files (heartbeat, training.csv, env.json, config.yaml, "
             "metrics.json).")
    L.append("")
    L += [f"**Overall verdict: {overall}**", ""]
    for r in runs:
        L.append(f"- `{r.s.run_name}`: **{r.verdict[0]}** — {r.verdict[1]}")
    L.append("")
    L += _notes_section(notes)
    if len(runs) > 1:
        L += _comparison([r.st for r in runs], [r.s for r in runs], verdicts)
        if combined:
            L += [f"![loss, all runs (lines: training, dots: validation)]({_rel(combined['loss'], out)})", "",
                  f"![tokens/s, all runs]({_rel(combined['tokens_per_s'], out)})", ""]
    for r in runs:
        L += _run_section(r, out)
    text = "\n".join(L).rstrip() + "\n"
    write_atomic(path, lambda tmp: tmp.write_text(text))
    return ReportResult(path, [r.s for r in runs], verdicts, images, [r.checks for r in runs],
                        [r.limits for r in runs], drawn, notes)
