"""The daily test report: markdown (+ PNG charts) built from a run directory's own files.

Default path: ``Documentation/Reports/<yyyy-mm-dd> Test Engineer Report - <run name> v<N>.md`` with ``N``
one above the highest existing version for that date and name; ``out_dir`` ending in ``.md`` (or naming an
existing file) is the report file itself, replaced only with ``force``. Files are written atomically
(temporary file + rename). Works on a finished, running or crashed run; several runs add a comparison table.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa.errors import NSAError, RunDirError
from nsa.fileio import write_atomic
from nsa.runs.reader import RunState, is_run_dir, read_run
from nsa.runs.summary import RunSummary, step_ranges, summarize

DEFAULT_OUT = Path("Documentation") / "Reports"
EVAL_TASKS = ("needle", "mqar", "loss")  # RUN/eval/<task>.json written by `nsa eval`, in report order


@dataclass
class ReportResult:
    path: Path
    runs: list[RunSummary]
    verdicts: list[tuple[str, str]]
    images: list[Path] = field(default_factory=list)

    @property
    def overall(self) -> str:
        """``FAIL`` if any run failed, else ``RUNNING`` if any runs, ``PASS`` if all passed, else ``INCOMPLETE``."""
        return overall_verdict(self.verdicts)

    @property
    def failed(self) -> bool:
        return self.overall == "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "verdict": self.overall,
            "images": [str(p) for p in self.images],
            "runs": [
                {"run_dir": s.run_dir, "run_name": s.run_name, "status": s.status, "verdict": v, "why": why}
                for s, (v, why) in zip(self.runs, self.verdicts, strict=True)
            ],
        }


def newest_run(root: str | Path = "artifacts") -> Path:
    """The run directory under ``root`` whose files changed last."""
    base = Path(root)
    if not base.is_dir():
        raise RunDirError(f"no run given and {base}/ does not exist", hint="pass a run directory: nsa report RUN_DIR")
    best: tuple[float, Path] | None = None
    for p in [base, *base.rglob("*")]:
        if p.is_dir() and "checkpoints" not in p.parts and is_run_dir(p):
            mtime = max((f.stat().st_mtime for f in p.iterdir() if f.is_file()), default=p.stat().st_mtime)
            if best is None or mtime > best[0]:
                best = (mtime, p)
    if best is None:
        raise RunDirError(f"no run directory under {base}/", hint="pass a run directory: nsa report RUN_DIR")
    return best[1]


def verdict(s: RunSummary) -> tuple[str, str]:
    """``(PASS|FAIL|RUNNING|INCOMPLETE, why)`` from the run's own records."""
    problems = []
    if s.nonfinite_losses or s.anomalies:
        problems.append(f"{s.nonfinite_losses} non-finite loss(es), {len(s.anomalies)} anomaly record(s)")
    if s.fallback_total:
        problems.append(f"{s.fallback_total} backend fallback(s)")
    if s.first_loss is not None and s.last_loss is not None and not s.loss_decreased and s.steps_done > 1:
        problems.append(f"loss did not decrease ({s.first_loss:.3f} -> {_fmt(s.last_loss, '.3f')})")
    progress = f"{s.steps_done}/{s.steps_total or '?'} steps"
    if s.status in ("failed", "crashed"):
        err = (s.end or {}).get("error")
        return "FAIL", f"run {s.status} at step {s.steps_done}" + (f": {err}" if err else "")
    if s.status == "stale":
        return "FAIL", f"heartbeat stale at step {s.steps_done} (no end event)"
    if problems:
        return "FAIL", "; ".join(problems) + f" ({progress})"
    if s.status == "running":
        return "RUNNING", f"in progress, {progress}, no problems so far"
    if s.status == "halted":
        why = (s.halts[-1].get("reason") if s.halts else None) or "halt"
        return "PASS", f"halted on request ({why}) at {progress}, healthy until then"
    if s.status == "completed":
        loss = f", loss {s.first_loss:.3f} -> {s.last_loss:.3f}" if s.first_loss is not None and s.last_loss is not None else ""
        return "PASS", f"completed {progress}{loss}"
    return "INCOMPLETE", f"status {s.status}, {progress}"


def overall_verdict(verdicts: list[tuple[str, str]]) -> str:
    """The report's overall verdict from the per-run ``(verdict, why)`` pairs."""
    names = [v for v, _ in verdicts]
    if "FAIL" in names:
        return "FAIL"
    if "RUNNING" in names:
        return "RUNNING"
    return "PASS" if all(v == "PASS" for v in names) else "INCOMPLETE"


@contextlib.contextmanager
def _writing(target: Path) -> Iterator[None]:
    """Turn an ``OSError`` (read-only filesystem, no permission, ...) while writing into one ``NSAError``."""
    try:
        yield
    except OSError as exc:
        why = exc.strerror or str(exc)
        name = str(exc.filename or "")
        where = f" ({name})" if name and ".tmp-" not in name and Path(name) != target else ""
        raise NSAError(f"cannot write the report to {target}: {why}{where}",
                       hint="choose a writable folder with --out") from None


def _fmt(v: Any, spec: str = ".4g", unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        return f"{v:{spec}}{unit}"
    except (TypeError, ValueError):
        return str(v)


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


def _charts(states: list[RunState], summaries: list[RunSummary], folder: Path) -> dict[str, Path]:
    """Loss and tokens/s PNGs (matplotlib, Agg): one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for key, title, fname in (("loss", "training loss", "loss.png"), ("tokens_per_s", "tokens/s", "tokens_per_s.png")):
        fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
        drawn = False
        for st, s in zip(states, summaries, strict=True):
            pts = [(p["step"], p[key]) for p in st.series()
                   if isinstance(p.get("step"), int | float) and isinstance(p.get(key), int | float)
                   and math.isfinite(p[key])]
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], label=s.run_name, linewidth=1.2)
                drawn = True
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if drawn and len(states) > 1:
            ax.legend(fontsize=8)
        if not drawn:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        path = folder / fname
        try:
            write_atomic(path, functools.partial(fig.savefig, format="png"))
        finally:
            plt.close(fig)
        out[key] = path
    return out


def _dotted(tree: dict[str, Any] | None, dotted: str) -> Any:
    node: Any = tree or {}
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _cfg(st: RunState, section: str, key: str) -> Any:
    return ((st.config or {}).get(section) or {}).get(key)


def _run_section(st: RunState, s: RunSummary, v: tuple[str, str], out_dir: Path, images: dict[str, Path] | None) -> list[str]:
    env = st.env or {}
    versions = env.get("versions") or {}
    git = env.get("git") or {}
    L = [f"## Run `{s.run_name}`", ""]
    L += [f"**Verdict: {v[0]}** — {v[1]}", ""]
    L += ["| | |", "|---|---|"]
    L.append(f"| Run directory | {_link(st.run_dir, out_dir, str(st.run_dir))} |")
    L.append(f"| Status | {s.status} ({s.steps_done}/{s.steps_total or '?'} steps, world size {s.world_size}) |")
    dirty = git.get("dirty")
    L.append(f"| Branch / commit | {git.get('branch') or 'n/a'} / `{git.get('commit') or 'n/a'}`"
             f" ({'dirty' if dirty else 'clean' if dirty is False else 'dirty state unknown'}) |")
    gpus = env.get("gpus") or []
    gpu_text = ", ".join(sorted(set(map(str, gpus)))) + f" x{len(gpus)}" if gpus else (env.get("device_name") or s.device or "n/a")
    L.append(f"| Device | {gpu_text} ({env.get('device') or 'n/a'}, {env.get('precision') or 'n/a'}) |")
    L.append(f"| Driver | {env.get('driver') or 'n/a'} |")
    L.append("| Python / torch / CUDA / triton / flash-attn | " + " / ".join(
        str(versions.get(k) or "n/a") for k in ("python", "torch", "cuda", "triton", "flash_attn")) + " |")
    L.append(f"| Profile | {env.get('profile') or 'none'} |")
    settings = env.get("nsa_settings") or {}
    L.append("| NSA_* environment | " + (", ".join(f"`{k}={val}`" for k, val in sorted(settings.items())) or "none") + " |")
    overrides = {k: v for k, v in st.config_sources.items() if not v.startswith("config")}
    if overrides:
        L.append("| Settings above the config file | " + ", ".join(
            f"`{k}={_dotted(st.config, k)}` ({v})" for k, v in sorted(overrides.items())) + " |")
    unknown = env.get("nsa_unknown_variables") or []
    if unknown:
        L.append(f"| Unknown NSA_* (ignored) | {', '.join(unknown)} |")
    L.append(f"| Config | `{env.get('config_path') or 'n/a'}`: seq_len {_cfg(st, 'train', 'seq_len')}, batch "
             f"{_cfg(st, 'train', 'batch_size')} x accum {_cfg(st, 'train', 'accum')}, steps {_cfg(st, 'train', 'steps')}, "
             f"attention backend {_cfg(st, 'runtime', 'attn_backend')} |")
    L.append(f"| Model | dim {_cfg(st, 'model', 'dim')}, {_cfg(st, 'model', 'n_layers')} layers, "
             f"{_cfg(st, 'model', 'n_heads')} heads / {_cfg(st, 'model', 'n_kv_groups')} KV groups; NSA l={_cfg(st, 'nsa', 'l')} "
             f"d={_cfg(st, 'nsa', 'd')} l_sel={_cfg(st, 'nsa', 'l_sel')} n_sel={_cfg(st, 'nsa', 'n_sel')} w={_cfg(st, 'nsa', 'w')} |")
    L.append("")
    L += ["### Training", "", "| metric | value |", "|---|---|"]
    L.append(f"| loss first / last / min | {_fmt(s.first_loss, '.4f')} / {_fmt(s.last_loss, '.4f')} / {_fmt(s.min_loss, '.4f')} |")
    L.append(f"| validation loss (last) | {_fmt(s.val_loss, '.4f')} |")
    L.append(f"| tokens/s median / last | {_fmt(s.tokens_per_s_median, ',.0f')} / {_fmt(s.tokens_per_s_last, ',.0f')} |")
    L.append(f"| step time median | {_fmt(s.step_time_s_median, '.4f', ' s')} |")
    L.append(f"| tokens seen | {_fmt(s.tokens_seen, ',.0f')} |")
    L.append(f"| elapsed | {_fmt(s.elapsed_s, '.1f', ' s')} |")
    L.append(f"| fetch p50 / p95 | {_fmt(s.fetch_p50_ms, '.1f', ' ms')} / {_fmt(s.fetch_p95_ms, '.1f', ' ms')} |")
    L.append(f"| peak GPU memory (allocator peak) | {_mib(s.mem_peak_mib)} |")
    L.append(f"| reserved GPU memory (last) | {_mib(s.mem_reserved_mib)} |")
    L.append(f"| host RSS (peak) | {_mib(s.rss_mib)} |")
    L.append(f"| MFU | {_fmt(s.mfu, '.1%') if s.mfu is not None else 'n/a'} |")
    L.append("")
    ranges = step_ranges(st.series())
    if ranges:
        L += ["### Tokens/s trend", "", "| steps | mean tokens/s | min | max | points |", "|---|---|---|---|---|"]
        for r in ranges:
            L.append(f"| {r['from_step']}–{r['to_step']} | {r['mean']:,.0f} | {r['min']:,.0f} | {r['max']:,.0f} | {r['points']} |")
        L.append("")
    if images:
        L += [f"![loss curve]({_rel(images['loss'], out_dir)})", "",
              f"![tokens/s]({_rel(images['tokens_per_s'], out_dir)})", ""]
    L += ["### Gate health and counters", "", "| metric | value |", "|---|---|"]
    shares = s.gate_branch_shares
    L.append(f"| gate entropy (mean) | {_fmt(s.gate_entropy_mean, '.3f')} |")
    L.append("| branch shares cmp / sel / win | " + (" / ".join(f"{x:.3f}" for x in shares) if shares else "n/a") + " |")
    L.append(f"| collapsed-gate fraction | {_fmt(s.gate_collapse_fraction, '.3f')} |")
    L.append(f"| selected keys per query (mean) | {_fmt(s.sel_keys_mean, '.1f')} |")
    L.append("| fallback counters | " + (", ".join(f"`{k}`: {n}" for k, n in sorted(s.fallback.items())) or "none (0)") + " |")
    L.append(f"| unreadable heartbeat/CSV lines | {s.corrupt_lines} corrupt, {s.truncated_lines} truncated |")
    L.append("")
    L += _eval_section(st.run_dir, out_dir, (images or {}).get("needle"))
    L += ["### Anomalies and halts", ""]
    if not s.anomalies and not s.halts and not s.pending_halt:
        L += ["None.", ""]
    for a in s.anomalies:
        rec = a.get("record")
        link = f" — {_link(st.run_dir / rec if not Path(str(rec)).is_absolute() else Path(str(rec)), out_dir)}" if rec else ""
        L.append(f"- anomaly `{a.get('kind')}` at step {a.get('step')}, value {a.get('value')}{link}")
    for h in s.halts:
        L.append(f"- halt at step {h.get('step')}: {h.get('reason')} (source {h.get('source')}, checkpoint {h.get('checkpoint')})")
    if s.pending_halt:
        L.append(f"- pending `.HALT` (not yet acted on): {s.pending_halt.get('reason')}")
    if s.end and s.end.get("error"):
        L.append(f"- end error: `{s.end.get('error')}`")
    L.append("")
    L += ["### Artifacts", ""]
    for name in ("config.yaml", "env.json", "training.csv", "val.csv", "metrics.json", "heartbeat_rank0.jsonl", "tb", "export",
                 "eval"):
        p = st.run_dir / name
        if p.exists():
            L.append(f"- {_link(p, out_dir, name)}")
    for c in s.checkpoints[-3:]:
        if c.get("path"):
            p = Path(str(c["path"]))
            p = p if p.is_absolute() else st.run_dir / p
            if not p.exists():
                p = st.run_dir / "checkpoints" / Path(str(c["path"])).name
            L.append(f"- checkpoint ({c.get('reason')}, step {c.get('step')}): {_link(p, out_dir, p.name)}")
    L.append("")
    return L


def _eval_payloads(run_dir: Path) -> list[tuple[str, dict[str, Any] | None]]:
    """``(task, payload or None when unreadable)`` for each ``RUN/eval/<task>.json`` present."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    for task in EVAL_TASKS:
        p = run_dir / "eval" / f"{task}.json"
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
    src = run_dir / "eval" / "needle.png"
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


def _ctx(c: Any) -> str:
    return f"{c // 1024}K" if isinstance(c, int) and c >= 1024 and c % 1024 == 0 else str(c)


def _eval_section(run_dir: Path, out_dir: Path, needle_png: Path | None) -> list[str]:
    """The "Evaluation" section: one table per ``nsa eval`` task found in ``RUN/eval/`` (nothing when none)."""
    found = _eval_payloads(run_dir)
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
        source = f"checkpoint `{ckpt}`, {when}, seed {st.get('seed')}"
        if task == "needle":
            contexts = sorted({r.get("context") for r in rows if isinstance(r.get("context"), int)})
            depths = sorted({r.get("depth") for r in rows if isinstance(r.get("depth"), int | float)})
            acc = {(r.get("context"), r.get("depth")): r.get("accuracy") for r in rows}
            L += ["#### Needle retrieval", "",
                  f"Accuracy of the value after the repeated key; rows = needle depth (0 = first token), columns = "
                  f"context. {st.get('samples')} samples per cell, haystack {st.get('haystack')}; {source}.", ""]
            L.append("| depth / context | " + " | ".join(_ctx(c) for c in contexts) + " |")
            L.append("|---|" + "---|" * len(contexts))
            for d in depths:
                L.append(f"| {d:g} | " + " | ".join(_fmt(acc.get((c, d)), ".2f") for c in contexts) + " |")
            L.append("")
            if needle_png is not None:
                L += [f"![needle retrieval heat map]({_rel(needle_png, out_dir)})", ""]
        elif task == "mqar":
            L += ["#### Multi-query associative recall", "",
                  f"{st.get('pairs')} pairs, {st.get('queries')} queries, {st.get('samples')} samples per context, "
                  f"haystack {st.get('haystack')}; {source}.", "",
                  "| context | accuracy | keys asked |", "|---|---|---|"]
            L += [f"| {_ctx(r.get('context'))} | {_fmt(r.get('accuracy'), '.3f')} | {_fmt(r.get('n'), ',')} |" for r in rows]
            L.append("")
        else:
            L += ["#### Held-out loss", "",
                  f"Validation split, {st.get('samples')} sequences per context; {source}.", "",
                  "| context | loss | bits/byte | tokens |", "|---|---|---|---|"]
            L += [f"| {_ctx(r.get('context'))} | {_fmt(r.get('loss'), '.4f')} | {_fmt(r.get('bits_per_byte'), '.4f')} "
                  f"| {_fmt(r.get('n'), ',')} |" for r in rows]
            L.append("")
    return L


def _comparison(states: list[RunState], summaries: list[RunSummary], verdicts: list[tuple[str, str]]) -> list[str]:
    L = ["## Comparison", "", "| run | S | batch x accum | backend | device | status | step time (s) | tokens/s | peak memory | final loss | verdict |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for st, s, v in zip(states, summaries, verdicts, strict=True):
        L.append(
            f"| {s.run_name} | {_cfg(st, 'train', 'seq_len')} | {_cfg(st, 'train', 'batch_size')} x {_cfg(st, 'train', 'accum')} "
            f"| {_cfg(st, 'runtime', 'attn_backend')} | {s.device or 'n/a'} | {s.status} | {_fmt(s.step_time_s_median, '.4f')} "
            f"| {_fmt(s.tokens_per_s_median, ',.0f')} | {_mib(s.mem_peak_mib) if s.mem_peak_mib is not None else _mib(s.rss_mib) + ' RSS' if s.rss_mib else 'n/a'} "
            f"| {_fmt(s.last_loss, '.4f')} | {v[0]} |"
        )
    L.append("")
    return L


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
) -> ReportResult:
    """Write the report and its charts; returns the path and each run's verdict.

    ``out_dir`` is a folder (versioned file name inside), or the report file itself when it ends in
    ``.md`` or names an existing file; an existing report file is replaced only with ``force``. A path
    that cannot be written raises ``NSAError`` and leaves no partial report behind."""
    dirs = [Path(p) for p in run_dirs] if run_dirs else [newest_run(artifacts_root)]
    now = time.time() if now is None else now
    states = [read_run(p) for p in dirs]
    summaries = [summarize(st, now) for st in states]
    verdicts = [verdict(s) for s in summaries]
    target = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    as_file = not target.is_dir() and (target.suffix.lower() == ".md" or target.exists())
    if as_file and target.exists() and not force:
        raise NSAError(f"report file {target} already exists", hint="pass --force to replace it, or another --out")
    out = target.parent if as_file else target
    with _writing(target):
        out.mkdir(parents=True, exist_ok=True)
        return _write_report(states, summaries, verdicts, out, target if as_file else None,
                             date or dt.date.today().isoformat(), title, charts, now)


def _write_report(
    states: list[RunState],
    summaries: list[RunSummary],
    verdicts: list[tuple[str, str]],
    out: Path,
    file: Path | None,
    date: str,
    title: str | None,
    charts: bool,
    now: float,
) -> ReportResult:
    """Charts, then the markdown (atomically) in ``out`` (at ``file`` when given)."""
    names = [s.run_name for s in summaries]
    name = _safe_name(title or (names[0] if len(names) == 1 else " vs ".join(names) if len(names) <= 3 else f"{len(names)} runs"))
    n = next_version(out, date, name)
    path = file or out / f"{date} Test Engineer Report - {name} v{n}.md"
    heading = f"{date} Test Engineer Report - {name}" + ("" if file else f" v{n}")
    images: list[Path] = []
    per_run: list[dict[str, Path] | None] = []
    if charts:
        folder = out / "assets" / (_slug(path.stem) if file else f"{date}-{_slug(name)}-v{n}")
        combined = _charts(states, summaries, folder) if len(states) > 1 else None
        for i, (st, s) in enumerate(zip(states, summaries, strict=True)):
            run_folder = folder / f"run{i + 1}-{_slug(s.run_name)}" if len(states) > 1 else folder
            imgs = _charts([st], [s], run_folder)
            needle = _copy_eval_chart(st.run_dir, run_folder)
            if needle is not None:
                imgs["needle"] = needle
            per_run.append(imgs)
            images += list(imgs.values())
        if combined:
            images += list(combined.values())
    else:
        combined = None
        per_run = [None] * len(states)

    overall = overall_verdict(verdicts)
    L = [f"# {heading}", ""]
    L.append(f"Generated {dt.datetime.fromtimestamp(now, dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} by `nsa report` from the run "
             "directories' own files (heartbeat, training.csv, env.json, config.yaml, metrics.json).")
    L.append("")
    L += [f"**Overall verdict: {overall}**", ""]
    for s, (v, why) in zip(summaries, verdicts, strict=True):
        L.append(f"- `{s.run_name}`: **{v}** — {why}")
    L.append("")
    if len(states) > 1:
        L += _comparison(states, summaries, verdicts)
        if combined:
            L += [f"![loss, all runs]({_rel(combined['loss'], out)})", "",
                  f"![tokens/s, all runs]({_rel(combined['tokens_per_s'], out)})", ""]
    for st, s, verdict_, run_imgs in zip(states, summaries, verdicts, per_run, strict=True):
        L += _run_section(st, s, verdict_, out, run_imgs)
    text = "\n".join(L).rstrip() + "\n"
    write_atomic(path, lambda tmp: tmp.write_text(text))
    return ReportResult(path, summaries, verdicts, images)
