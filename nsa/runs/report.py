"""The daily test report: markdown (+ PNG charts) built from a run directory's own files.

Default path: ``Documentation/Reports/<yyyy-mm-dd> Test Engineer Report - <run name> v<N>.md`` with ``N``
one above the highest existing version for that date and name; ``out_dir`` ending in ``.md`` (or naming an
existing file) is the report file itself, replaced only with ``force``. Files are written atomically
(temporary file + rename). Works on a finished, running or crashed run; several runs add a comparison table.

The verdict comes from checks, each shown with its figure and limit: the run's records (non-finite values,
backend fallbacks, loss trend, watchdog halts) and the ``monitor`` limits saved in its ``config.yaml``
(throughput floor, fetch p95, gate entropy and collapse, GPU memory ceiling, eval accuracy), optionally
overridden by a profile's ``monitor:`` block.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nsa.config.monitor import MonitorConfig
from nsa.errors import ConfigError, NSAError, RunDirError
from nsa.fileio import write_atomic
from nsa.runs.charts import Chart, RunSeries, combined_charts, run_charts
from nsa.runs.env import REDACTED, is_secret
from nsa.runs.layout import HALTS_DIR, parse_halt
from nsa.runs.reader import RunState, is_run_dir, read_halt_file, read_run
from nsa.runs.summary import RunSummary, step_ranges, summarize

DEFAULT_OUT = Path("Documentation") / "Reports"
EVAL_TASKS = ("needle", "mqar", "loss")  # RUN/eval/<task>.json written by `nsa eval`, in report order
RETRIEVAL_TASKS = ("needle", "mqar")  # the tasks whose accuracy monitor.min_eval_accuracy judges
# monitor.* keys that judge the report's verdict (MonitorConfig fields)
LIMIT_KEYS = ("min_tokens_per_s", "max_fetch_p95_ms", "gate_entropy_min", "gate_collapse_max", "max_memory_gib",
              "min_eval_accuracy")
FETCH_SETTLED_STEP = 20  # fetch p95 windows from this step on hold >= 20 fetches: one slow first fetch is no p95
WARN_MARGIN = 0.1  # a figure within 10% of its limit (still on the right side) is a WARN
# watchdog reasons written by `nsa watch --halt-on` ("watchdog: <rule message>") -> rule, when .HALT is gone
RULE_PATTERNS = (
    ("stale", re.compile(r"heartbeat .*\bold\b|\bstale\b", re.I)),
    ("nonfinite", re.compile(r"non-?finite|\banomaly\b|\bnan\b", re.I)),
    ("gate-collapse", re.compile(r"collapse", re.I)),
    ("throughput-drop", re.compile(r"tokens/s|throughput", re.I)),
    ("fetch-stall", re.compile(r"\bfetch\b", re.I)),
)


@dataclass
class Check:
    """One line of a run's verdict: what was measured, against what, and the result.

    ``result``: ``PASS``, ``FAIL``, ``WARN`` (within 10% of the limit, or the figure cannot be trusted),
    ``not set`` (no limit: not judged) or ``n/a`` (no figure: not judged)."""

    name: str
    figure: str
    limit: str
    result: str
    why: str = ""  # the sentence the verdict quotes for FAIL / WARN
    key: str | None = None  # the monitor.* key of a limit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Limits:
    """The report limits of one run (``monitor.*``) and where each value came from."""

    values: dict[str, float | None]
    sources: dict[str, str]


@dataclass
class HaltRecord:
    """A halt of the run: a ``halt`` event (acted on) or a ``.HALT`` the trainer never acted on.

    ``by``: ``watchdog`` (``nsa watch --halt-on``), ``operator`` (``nsa halt`` or a hand-written file),
    ``signal`` (SIGTERM/SIGINT) or ``anomaly`` (non-finite loss/gradient)."""

    reason: str
    by: str
    source: str
    rule: str | None = None
    step: int | None = None
    checkpoint: str | None = None
    acted: bool = True
    where: str = "heartbeat"  # heartbeat, .HALT (pending) or halts/<file> (archived at a restart)

    @property
    def hung(self) -> bool:
        return self.by == "watchdog" and self.rule == "stale"

    def describe(self) -> str:
        who = f"watchdog rule `{self.rule or '?'}`" if self.by == "watchdog" else self.by
        at = f" at step {self.step}" if self.step is not None else ""
        state = "" if self.acted else f" (not acted on: {self.where})"
        return f"{who}{at}: {self.reason}{state}"


@dataclass
class ReportResult:
    path: Path
    runs: list[RunSummary]
    verdicts: list[tuple[str, str]]
    images: list[Path] = field(default_factory=list)
    checks: list[list[Check]] = field(default_factory=list)
    limits: list[Limits] = field(default_factory=list)
    charts: list[tuple[str | None, Chart]] = field(default_factory=list)  # (run name or None for combined, chart)
    notes: list[str] = field(default_factory=list)

    @property
    def overall(self) -> str:
        """``FAIL`` if any run failed, else ``RUNNING`` if any runs, ``PASS`` if all passed, else ``INCOMPLETE``."""
        return overall_verdict(self.verdicts)

    @property
    def failed(self) -> bool:
        return self.overall == "FAIL"

    def to_dict(self) -> dict[str, Any]:
        runs = []
        for i, (s, (v, why)) in enumerate(zip(self.runs, self.verdicts, strict=True)):
            run: dict[str, Any] = {"run_dir": s.run_dir, "run_name": s.run_name, "status": s.status, "verdict": v,
                                   "why": why}
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


# ------------------------------------------------------------------------------------------ limits


def _limit_value(key: str, value: Any) -> float | None:
    """``value`` validated as ``monitor.<key>`` (``ConfigError`` when invalid)."""
    from pydantic import ValidationError

    try:
        return getattr(MonitorConfig.model_validate({key: value}), key)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise ConfigError(f"monitor.{key}={value!r}: {exc.errors()[0]['msg']}") from None


def run_limits(config: dict[str, Any] | None, sources: dict[str, str] | None = None,
               override: dict[str, Any] | None = None, override_label: str = "--limits") -> Limits:
    """The report limits of a run: ``MonitorConfig`` defaults < the run's saved ``monitor`` section <
    ``override`` (a profile's ``monitor:`` block). A saved value that does not validate is ignored."""
    defaults = MonitorConfig()
    saved = (config or {}).get("monitor")
    saved = saved if isinstance(saved, dict) else {}
    values: dict[str, float | None] = {}
    where: dict[str, str] = {}
    for key in LIMIT_KEYS:
        values[key], where[key] = getattr(defaults, key), "default"
        if key in saved:
            try:
                values[key] = _limit_value(key, saved[key])
                origin = (sources or {}).get(f"monitor.{key}")
                where[key] = f"config.yaml, from {origin}" if origin else "config.yaml"
            except ConfigError:
                where[key] = f"default (config.yaml's {saved[key]!r} is not valid)"
        if override and key in override:
            values[key], where[key] = _limit_value(key, override[key]), override_label
    return Limits(values, where)


def profile_limits(name_or_path: str | Path) -> tuple[dict[str, Any], str]:
    """``(monitor block, label)`` of a hardware profile, for ``--limits``; ``ConfigError`` when it has none."""
    from nsa.config.profiles import load_profile

    prof = load_profile(name_or_path)
    if not prof.monitor:
        raise ConfigError(f"profile '{prof.name}' has no monitor: block, so --limits would change nothing",
                          hint="add e.g. monitor: {min_tokens_per_s: 20000, max_memory_gib: 70} to it, or leave out --limits")
    return dict(prof.monitor), f"--limits {prof.name}"


# ------------------------------------------------------------------------------------------- halts


def guess_rule(reason: str) -> str | None:
    """The watch rule behind a ``watchdog: ...`` reason (when its ``.HALT`` with ``rule`` is gone)."""
    text = reason.removeprefix("watchdog:")
    return next((rule for rule, pat in RULE_PATTERNS if pat.search(text)), None)


def _read_halt_record(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    data, _ = parse_halt(text)
    if not data.get("reason") and set(data) == {"reason"}:
        data["reason"] = "(empty .HALT)"
    return data


def classify_halts(s: RunSummary) -> list[HaltRecord]:
    """Every halt of the run: its ``halt`` events, matched by reason to the ``.HALT`` records (those archived
    in ``halts/`` at a restart, then the current file) for the watchdog's ``rule``, then the records that no
    event acted on."""
    records: list[tuple[str, dict[str, Any]]] = []  # oldest first, as the halt events
    with contextlib.suppress(OSError):
        for p in sorted((Path(s.run_dir) / HALTS_DIR).glob("HALT-*")):
            archived = _read_halt_record(p)
            if archived is not None:
                records.append((f"halts/{p.name}", archived))
    current = read_halt_file(s.run_dir)  # the file itself: the rule is wanted also once the trainer acted on it
    if current is not None:
        records.append((".HALT", current))
    used: set[int] = set()
    out: list[HaltRecord] = []

    def by_of(reason: str, rule: Any) -> str:
        return "watchdog" if rule or reason.startswith("watchdog:") else "operator"

    for h in s.halts:
        reason, source = str(h.get("reason") or ""), str(h.get("source") or "")
        rec: dict[str, Any] = {}
        if source == "file":
            for i, (_, r) in enumerate(records):
                if i not in used and str(r.get("reason") or "").strip()[:500] == reason.strip()[:500]:
                    used.add(i)
                    rec = r
                    break
        rule = rec.get("rule") if isinstance(rec.get("rule"), str) else None
        by = ("anomaly" if source == "anomaly" else "signal" if source in ("SIGTERM", "SIGINT")
              else by_of(reason, rule))
        if by == "watchdog" and rule is None:
            rule = guess_rule(reason)
        step = h.get("step") if isinstance(h.get("step"), int) else None
        ck = h.get("checkpoint")
        out.append(HaltRecord(reason, by, source, rule, step, str(ck) if ck else None))
    for i, (where, r) in enumerate(records):
        if i in used:
            continue
        reason = str(r.get("reason") or "")
        rule = r.get("rule") if isinstance(r.get("rule"), str) else None
        by = by_of(reason, rule)
        if by == "watchdog" and rule is None:
            rule = guess_rule(reason)
        ev: dict[str, Any] = r["evidence"] if isinstance(r.get("evidence"), dict) else {}
        step = ev.get("step") if isinstance(ev.get("step"), int) else None
        out.append(HaltRecord(reason, by, "file", rule, step, None, acted=False, where=where))
    return out


# ------------------------------------------------------------------------------------------ checks


def _g(v: float) -> str:
    return f"{v:,g}" if abs(v) >= 1000 else f"{v:g}"


def _judge(name: str, key: str, limits: Limits, figure: float | None, shown: str, unit: str, *, floor: bool,
           strict: bool = False, margin: bool = True, missing: str = "no figure") -> Check:
    """A limit check: ``floor`` (figure >= limit) or ceiling (figure <= limit; ``strict``: < limit)."""
    lim = limits.values.get(key)
    src = limits.sources.get(key, "default")
    if lim is None:
        return Check(name, shown if figure is not None else missing, f"not set (`monitor.{key}`)", "not set", key=key)
    op = ">=" if floor else "<" if strict else "<="
    limit_text = f"{op} {_g(lim)}{unit} (`monitor.{key}`, {src})"
    if figure is None:
        return Check(name, missing, limit_text, "n/a", key=key)
    bad = figure < lim if floor else (figure >= lim if strict else figure > lim)
    if bad:
        side = "below the minimum" if floor else "at or above the maximum" if strict else "above the ceiling"
        return Check(name, shown, limit_text, "FAIL", f"{name} {shown} {side} {_g(lim)}{unit}", key)
    near = margin and (figure < lim * (1 + WARN_MARGIN) if floor else figure > lim * (1 - WARN_MARGIN))
    if near:
        return Check(name, shown, limit_text, "WARN", f"{name} {shown} within {WARN_MARGIN:.0%} of its limit {_g(lim)}{unit}", key)
    return Check(name, shown, limit_text, "PASS", key=key)


def eval_accuracy(evals: Sequence[tuple[str, dict[str, Any] | None]]) -> tuple[float | None, str, list[str]]:
    """``(lowest needle/mqar accuracy, where, unreadable task files)`` of ``RUN/eval``."""
    low: float | None = None
    where = ""
    bad: list[str] = []
    for task, data in evals:
        if task not in RETRIEVAL_TASKS:
            continue
        if data is None:
            bad.append(f"eval/{task}.json")
            continue
        for r in data["results"]:
            acc = r.get("accuracy")
            if isinstance(acc, int | float) and not isinstance(acc, bool) and math.isfinite(acc) and (low is None or acc < low):
                low = float(acc)
                depth = f" depth {r['depth']:g}" if isinstance(r.get("depth"), int | float) else ""
                where = f"{task} context {_ctx(r.get('context'))}{depth}"
    return low, where, bad


def fetch_p95_worst(progress: Sequence[dict[str, Any]]) -> tuple[float, int] | None:
    """``(worst fetch p95, its step)`` over the heartbeat's progress points from step
    :data:`FETCH_SETTLED_STEP` on (earlier windows hold too few fetches for a p95 that one slow start-up
    fetch does not set); the last point when none is that late."""
    pts = [(float(p["fetch_p95_ms"]), int(p["step"])) for p in progress
           if isinstance(p.get("fetch_p95_ms"), int | float) and isinstance(p.get("step"), int | float)
           and math.isfinite(p["fetch_p95_ms"])]
    settled = [x for x in pts if x[1] >= FETCH_SETTLED_STEP]
    if settled:
        return max(settled, key=lambda x: x[0])
    return pts[-1] if pts else None


def run_checks(s: RunSummary, limits: Limits | None = None, evals: Sequence[tuple[str, dict[str, Any] | None]] = (),
               halts: list[HaltRecord] | None = None, progress: Sequence[dict[str, Any]] = ()) -> list[Check]:
    """Every check of the verdict, in report order (see :class:`Check`); ``progress``: the rank-0 heartbeat
    points, for the worst fetch p95 (else the summary's last)."""
    limits = limits or run_limits(None)
    halts = classify_halts(s) if halts is None else halts
    out: list[Check] = []
    n_bad = s.nonfinite_losses + len(s.anomalies)
    out.append(Check("non-finite values", f"{s.nonfinite_losses} loss(es), {len(s.anomalies)} anomaly record(s)", "none",
                     "FAIL" if n_bad else "PASS",
                     f"{s.nonfinite_losses} non-finite loss(es), {len(s.anomalies)} anomaly record(s)" if n_bad else ""))
    out.append(Check("backend fallbacks", f"{s.fallback_total}", "none", "FAIL" if s.fallback_total else "PASS",
                     f"{s.fallback_total} backend fallback(s)" if s.fallback_total else ""))
    if s.first_loss is not None and s.last_loss is not None and s.steps_done > 1:
        shown = f"{s.first_loss:.3f} -> {_fmt(s.last_loss, '.3f')}"
        out.append(Check("loss trend", shown, "last < first", "PASS" if s.loss_decreased else "FAIL",
                         "" if s.loss_decreased else f"loss did not decrease ({shown})"))
    else:
        out.append(Check("loss trend", "fewer than 2 logged losses", "last < first", "n/a"))
    wd = [h for h in halts if h.by == "watchdog"]
    if wd:
        h = wd[0]
        what = "hung: the watchdog's stale-heartbeat rule" if h.hung else f"watchdog rule `{h.rule or '?'}`"
        act = (f"halted the run at step {h.step}" if h.acted else "wrote .HALT, not acted on yet" if h.where == ".HALT"
               else f"wrote a .HALT that a restart archived unobeyed ({h.where})")
        more = f" (+{len(wd) - 1} more watchdog halt(s))" if len(wd) > 1 else ""
        out.append(Check("halts", "; ".join(x.describe() for x in halts), "no watchdog halt", "FAIL",
                         f"{what} {act}: {h.reason}{more}"))
    else:
        figure = "; ".join(x.describe() for x in halts) if halts else "none"
        out.append(Check("halts", figure, "no watchdog halt", "PASS"))
    tps = s.tokens_per_s_median
    out.append(_judge("throughput", "min_tokens_per_s", limits, tps,
                      f"median {_fmt(tps, ',.0f')} tokens/s", " tokens/s", floor=True))
    worst = fetch_p95_worst(progress)
    fetch: float | None
    if worst is not None:
        fetch, fetch_text = worst[0], f"worst {worst[0]:,.1f} ms at step {worst[1]} (last {_fmt(s.fetch_p95_ms, ',.1f')} ms)"
    else:
        fetch, fetch_text = s.fetch_p95_ms, f"{_fmt(s.fetch_p95_ms, ',.1f')} ms"
    out.append(_judge("fetch p95", "max_fetch_p95_ms", limits, fetch, fetch_text, " ms", floor=False))
    out.append(_judge("gate entropy", "gate_entropy_min", limits, s.gate_entropy_mean,
                      f"{_fmt(s.gate_entropy_mean, '.3f')} nats (last)", " nats", floor=True,
                      missing="no gate statistics (dense model or no progress yet)"))
    out.append(_judge("gate collapse", "gate_collapse_max", limits, s.gate_collapse_fraction,
                      f"{_fmt(s.gate_collapse_fraction, '.3f')} (last)", "", floor=False, strict=True,
                      missing="no gate statistics (dense model or no progress yet)"))
    gib = s.mem_peak_mib / 1024 if s.mem_peak_mib is not None else None
    out.append(_judge("peak GPU memory", "max_memory_gib", limits, gib, f"{_fmt(gib, '.2f')} GiB", " GiB", floor=False,
                      missing="no GPU memory figure (CPU run" + (f"; host RSS peak {s.rss_mib / 1024:.2f} GiB)"
                                                                 if s.rss_mib is not None else ")")))
    low, where, bad = eval_accuracy(evals)
    if bad and limits.values.get("min_eval_accuracy") is not None:
        out.append(Check("eval accuracy", f"{', '.join(bad)} unreadable", f">= {limits.values['min_eval_accuracy']:g}",
                         "WARN", f"{', '.join(bad)} could not be read", "min_eval_accuracy"))
    else:
        out.append(_judge("eval accuracy", "min_eval_accuracy", limits, low,
                          f"lowest {low:.3f} ({where})" if low is not None else "", "", floor=True, margin=False,
                          missing="no needle/mqar results in eval/"))
    return out


def verdict(s: RunSummary, checks: list[Check] | None = None) -> tuple[str, str]:
    """``(PASS|FAIL|RUNNING|INCOMPLETE, why)`` from the run's status and its checks (:func:`run_checks`;
    with ``checks=None`` the default limits and the halts found in the run directory)."""
    checks = run_checks(s) if checks is None else checks
    fails = [c.why for c in checks if c.result == "FAIL"]
    warns = [c.why for c in checks if c.result == "WARN"]
    progress = f"{s.steps_done}/{s.steps_total or '?'} steps"
    extra = "".join(f"; {f}" for f in fails)
    if s.status in ("failed", "crashed"):
        err = (s.end or {}).get("error")
        return "FAIL", f"run {s.status} at step {s.steps_done}" + (f": {err}" if err else "") + extra
    if s.status == "stale":
        return "FAIL", f"heartbeat stale at step {s.steps_done} (no end event)" + extra
    if fails:
        return "FAIL", "; ".join(fails) + f" ({progress})"
    warned = f"; WARN: {'; '.join(warns)}" if warns else ""
    if s.status == "running":
        return "RUNNING", f"in progress, {progress}, no problems so far" + warned
    if s.status == "halted":
        why = (s.halts[-1].get("reason") if s.halts else None) or "halt"
        return "PASS", f"halted on request ({why}) at {progress}, healthy until then" + warned
    if s.status == "completed":
        loss = f", loss {s.first_loss:.3f} -> {s.last_loss:.3f}" if s.first_loss is not None and s.last_loss is not None else ""
        return "PASS", f"completed {progress}{loss}" + warned
    return "INCOMPLETE", f"status {s.status}, {progress}" + warned


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
    charts: dict[str, Path] = field(default_factory=dict)


def _cell(text: Any) -> str:
    """``text`` as inline code in a table cell (pipes escaped, backticks fenced)."""
    t = str(text).replace("\n", " ").replace("|", "\\|")
    return f"`` {t} ``" if "`" in t else f"`{t}`"


def session_boots(st: RunState) -> list[dict[str, Any]]:
    """Every ``boot`` event of rank 0's heartbeat (one per session; the reader keeps only the last)."""
    r0 = st.rank0
    path = st.run_dir / f"heartbeat_rank{r0.rank if r0 else 0}.jsonl"
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


def _steps(events: Sequence[dict[str, Any]]) -> list[float]:
    return [float(e["step"]) for e in events if isinstance(e.get("step"), int | float) and not isinstance(e.get("step"), bool)]


def resume_step(boot: dict[str, Any]) -> int | None:
    """The step a session resumed at: its checkpoint's ``step_NNNNNNNN`` (a ``boot`` is written at step 0)."""
    m = re.search(r"step_(\d+)", str(boot.get("resumed_from") or ""))
    if m:
        return int(m.group(1))
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
         "config.yaml; `--limits PROFILE` overrides them); \"not set\" and \"n/a\" do not judge, WARN = within "
         f"{WARN_MARGIN:.0%} of the limit.", "",
         "| check | figure | limit | result |", "|---|---|---|---|"]
    for c in run.checks:
        result = f"**{c.result}**" if c.result in ("FAIL", "WARN") else c.result
        L.append(f"| {c.name} | {c.figure.replace('|', '/')} | {c.limit} | {result} |")
    L.append("")
    return L


def _env_section(env: dict[str, Any]) -> list[str]:
    """``NSA_*`` settings and the other recorded variables (CUDA_*, NCCL_*, PYTORCH_*, ...), secrets redacted."""
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
        L += ["Other variables (CUDA_\\*, NCCL_\\*, PYTORCH_\\*, ...) were not recorded in this run's env.json.", ""]
    elif not rows:
        L += ["None set.", ""]
    L += ["Values of names containing TOKEN, KEY, SECRET, PASSWORD, CREDENTIAL or AUTH are redacted.", ""]
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
    sessions = f", {len(run.boots)} sessions" if len(run.boots) > 1 else ""
    L.append(f"| Status | {s.status} ({s.steps_done}/{s.steps_total or '?'} steps, world size {s.world_size}{sessions}) |")
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
    L.append("| NSA_* environment | " + (", ".join(
        f"`{k}={REDACTED if is_secret(str(k)) else val}`" for k, val in sorted(settings.items())) or "none") + " |")
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
    L += _env_section(env)
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
    L += _img(run, "loss", "loss curve with validation points; dotted: checkpoints, red: halts, green dashed: resumes", out_dir)
    L += _img(run, "tokens_per_s", "tokens/s, rolling median", out_dir)
    L += _img(run, "lr_grad", "learning rate and gradient norm", out_dir)
    L += _img(run, "memory", "memory: GPU allocated/reserved/peak and host RSS", out_dir)
    L += _img(run, "fetch", "data fetch latency p50/p95", out_dir)
    L += ["### Gate health and counters", "", "| metric | value |", "|---|---|"]
    shares = s.gate_branch_shares
    L.append(f"| gate entropy (mean) | {_fmt(s.gate_entropy_mean, '.3f')} |")
    L.append("| branch shares cmp / sel / win | " + (" / ".join(f"{x:.3f}" for x in shares) if shares else "n/a") + " |")
    L.append(f"| collapsed-gate fraction | {_fmt(s.gate_collapse_fraction, '.3f')} |")
    L.append(f"| selected keys per query (mean) | {_fmt(s.sel_keys_mean, '.1f')} |")
    L.append("| fallback counters | " + (", ".join(f"`{k}`: {n}" for k, n in sorted(s.fallback.items())) or "none (0)") + " |")
    L.append(f"| unreadable heartbeat/CSV lines | {s.corrupt_lines} corrupt, {s.truncated_lines} truncated |")
    L.append("")
    L += _img(run, "gates", "gate entropy, collapsed-gate fraction and branch shares", out_dir)
    L += _eval_section(st.run_dir, out_dir, run.charts.get("needle"))
    L += ["### Anomalies and halts", ""]
    resumes = [b for b in run.boots if b.get("resumed_from")]
    if not s.anomalies and not run.halts and not resumes:
        L += ["None.", ""]
    for a in s.anomalies:
        rec = a.get("record")
        link = f" — {_link(st.run_dir / rec if not Path(str(rec)).is_absolute() else Path(str(rec)), out_dir)}" if rec else ""
        L.append(f"- anomaly `{a.get('kind')}` at step {a.get('step')}, value {a.get('value')}{link}")
    for h in run.halts:
        tag = " — **hung** (stale heartbeat)" if h.hung else " — **watchdog**" if h.by == "watchdog" else ""
        if h.acted:
            L.append(f"- halt at step {h.step} by {h.by}{tag}: {h.reason} (source {h.source}, checkpoint {h.checkpoint})")
        elif h.where == ".HALT":
            L.append(f"- pending `.HALT` (not yet acted on) by {h.by}{tag}: {h.reason}")
        else:
            L.append(f"- `.HALT` found at a restart and archived to `{h.where}` (not obeyed) by {h.by}{tag}: {h.reason}")
    for b in resumes:
        L.append(f"- resumed at step {resume_step(b)} from `{b.get('resumed_from')}`")
    if s.end and s.end.get("error"):
        L.append(f"- end error: `{s.end.get('error')}`")
    L.append("")
    L += ["### Artifacts", ""]
    for name in ("config.yaml", "env.json", "training.csv", "val.csv", "metrics.json", "heartbeat_rank0.jsonl", "tb", "export",
                 "eval", "halts"):
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


def _prepare(run_dir: Path, now: float, override: tuple[dict[str, Any], str] | None) -> _Run:
    """Read one run and derive its limits, halts, checks and verdict."""
    st = read_run(run_dir)
    s = summarize(st, now)
    limits = run_limits(st.config, st.config_sources, *(override or (None,)))
    evals = _eval_payloads(st.run_dir)
    halts = classify_halts(s)
    checks = run_checks(s, limits, evals, halts, st.progress)
    return _Run(st, s, limits, evals, halts, session_boots(st), checks, verdict(s, checks))


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
) -> ReportResult:
    """Write the report and its charts; returns the path and each run's verdict.

    ``out_dir`` is a folder (versioned file name inside), or the report file itself when it ends in
    ``.md`` or names an existing file; an existing report file is replaced only with ``force``. A path
    that cannot be written raises ``NSAError`` and leaves no partial report behind. ``limits`` names a
    hardware profile whose ``monitor:`` block overrides each run's saved limits; ``notes`` fill the
    "Engineer's notes and deviations" section (:func:`read_notes`)."""
    dirs = [Path(p) for p in run_dirs] if run_dirs else [newest_run(artifacts_root)]
    now = time.time() if now is None else now
    override = profile_limits(limits) if limits is not None else None
    runs = [_prepare(p, now, override) for p in dirs]
    target = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    as_file = not target.is_dir() and (target.suffix.lower() == ".md" or target.exists())
    if as_file and target.exists() and not force:
        raise NSAError(f"report file {target} already exists", hint="pass --force to replace it, or another --out")
    out = target.parent if as_file else target
    with _writing(target):
        out.mkdir(parents=True, exist_ok=True)
        return _write_report(runs, out, target if as_file else None, date or dt.date.today().isoformat(), title,
                             charts, now, list(notes))


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
    name = _safe_name(title or (names[0] if len(names) == 1 else " vs ".join(names) if len(names) <= 3 else f"{len(names)} runs"))
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
    L.append(f"Generated {dt.datetime.fromtimestamp(now, dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} by `nsa report` from the run "
             "directories' own files (heartbeat, training.csv, env.json, config.yaml, metrics.json).")
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
