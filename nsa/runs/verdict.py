"""The report's judgement of a run: checks with figure and limit (the run's records, the ``monitor``
limits saved in its ``config.yaml``, optionally a profile's), the halts classified, and the verdict."""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nsa.config.monitor import MonitorConfig
from nsa.config.profiles import load_profile
from nsa.errors import ConfigError
from nsa.rundir import RunDir
from nsa.rundir.checkpoints import recorded_sha256, sha256_file
from nsa.rundir.layout import EXPORT_DIR, EXPORT_INFO, EXPORT_WEIGHTS, WATCHDOG_PREFIX, watchdog_rule
from nsa.rundir.records import HaltFile
from nsa.runs.alarms import KeptAlarm
from nsa.runs.reader import halt_record
from nsa.runs.sessions import Session, earlier_trouble
from nsa.runs.summary import RunSummary, finite

RETRIEVAL_TASKS = ("needle", "mqar")  # the tasks whose accuracy monitor.min_eval_accuracy judges
# monitor.* keys that judge the report's verdict (MonitorConfig fields)
LIMIT_KEYS = ("min_tokens_per_s", "max_fetch_p95_ms", "gate_entropy_min", "gate_entropy_early_min",
              "gate_entropy_early_steps", "gate_collapse_max", "max_memory_gib", "min_eval_accuracy",
              "throughput_drop_ratio", "throughput_tail_min_s", "min_selection_recall")
WINDOW_MIN_POINTS = 3  # a throughput window holds at least this many progress points (and a tenth of the run)
# fetch p95 windows from this step on hold >= 20 fetches: one slow first fetch is no p95
FETCH_SETTLED_STEP = 20
WARN_MARGIN = 0.1  # a figure within 10% of its limit (still on the right side) is a WARN
def fmt_value(v: Any, spec: str = ".4g", unit: str = "") -> str:
    """A figure as the report shows it (``n/a`` for a missing one)."""
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        return f"{v:{spec}}{unit}"
    except (TypeError, ValueError):
        return str(v)


def anomaly_record_path(run_dir: str | Path, record: Any) -> Path:
    """Where an ``anomaly`` event's ``record`` is: it names ``anomalies/step_N.json`` relative to the run,
    absolute, or relative to the trainer's working directory (the run directory already in it)."""
    p = Path(str(record))
    if p.is_absolute():
        return p
    here = RunDir(run_dir).anomalies / p.name
    return here if here.exists() or not p.exists() else p


def context_label(c: Any) -> str:
    """A context length as the report names it (``16K`` for 16384)."""
    return f"{c // 1024}K" if isinstance(c, int) and c >= 1024 and c % 1024 == 0 else str(c)


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


# ------------------------------------------------------------------------------------------ limits


def _limit_value(key: str, value: Any) -> float | None:
    """``value`` validated as ``monitor.<key>`` (``ConfigError`` when invalid)."""
    from pydantic import ValidationError

    try:
        return getattr(MonitorConfig.model_validate({key: value}), key)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise ConfigError(f"monitor.{key}={value!r}: {exc.errors()[0]['msg']}") from None


def run_limits(config: dict[str, Any] | None, sources: dict[str, str] | None = None,
               override: dict[str, Any] | None = None, override_label: str = "--limits",
               unreadable: bool = False) -> Limits:
    """The report limits of a run: ``MonitorConfig`` defaults < the run's saved ``monitor`` section <
    ``override`` (a profile's ``monitor:`` block). A saved value that does not validate is ignored;
    ``unreadable``: the run's config.yaml could not be read (each default says so)."""
    defaults = MonitorConfig()
    saved = (config or {}).get("monitor")
    saved = saved if isinstance(saved, dict) else {}
    values: dict[str, float | None] = {}
    where: dict[str, str] = {}
    for key in LIMIT_KEYS:
        values[key], where[key] = getattr(defaults,
                                          key), "default, config.yaml unreadable" if unreadable else "default"
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
    """``(monitor block, label)`` of a hardware profile, for ``--limits``; ``ConfigError`` when it has
    none."""

    prof = load_profile(name_or_path)
    if not prof.monitor:
        raise ConfigError(f"profile '{prof.name}' has no monitor: block, so --limits would change nothing",
                          hint="add e.g. monitor: {min_tokens_per_s: 20000, max_memory_gib: 70} to it, or "
                               "leave out --limits")
    return dict(prof.monitor), f"--limits {prof.name}"


# ------------------------------------------------------------------------------------------- halts


def classify_halts(s: RunSummary) -> list[HaltRecord]:
    """Every halt of the run: its ``halt`` events (which name a watchdog's ``rule``; older ones are matched by
    reason to the ``.HALT`` records archived in ``halts/`` and the current file, or read from the reason's
    ``watchdog: <rule>:``), then the records that no event acted on."""
    records: list[tuple[str, HaltFile]] = []  # oldest first, as the halt events
    with contextlib.suppress(OSError):
        for p in sorted(RunDir(s.run_dir).halts.glob("HALT-*")):
            archived = halt_record(p)
            if archived is not None:
                records.append((f"halts/{p.name}", archived))
    current = halt_record(s.run_dir)  # the file itself: the rule is wanted also once the trainer acted on it
    if current is not None:
        records.append((".HALT", current))
    used: set[int] = set()
    out: list[HaltRecord] = []

    def by_of(reason: str, rule: Any) -> str:
        return "watchdog" if rule or reason.startswith(WATCHDOG_PREFIX) else "operator"

    for h in s.halts:
        reason, source = str(h.get("reason") or ""), str(h.get("source") or "")
        rec: HaltFile = {}
        if source == "file":
            for i, (_, r) in enumerate(records):
                if i not in used and str(r.get("reason") or "").strip()[:500] == reason.strip()[:500]:
                    used.add(i)
                    rec = r
                    break
        rule = next((r for r in (h.get("rule"), rec.get("rule"), watchdog_rule(reason))
                     if isinstance(r, str)), None)
        by = ("anomaly" if source == "anomaly" else "signal" if source in ("SIGTERM", "SIGINT")
              else by_of(reason, rule))
        step = h.get("step") if isinstance(h.get("step"), int) else None
        ck = h.get("checkpoint")
        out.append(HaltRecord(reason, by, source, rule, step, str(ck) if ck else None))
    for i, (where, r) in enumerate(records):
        if i in used:
            continue
        reason = str(r.get("reason") or "")
        rule = next((x for x in (r.get("rule"), watchdog_rule(reason)) if isinstance(x, str)), None)
        by = by_of(reason, rule)
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
        return Check(name, shown if figure is not None else missing, f"not set (`monitor.{key}`)", "not set",
                     key=key)
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
        return Check(name, shown, limit_text, "WARN",
                     f"{name} {shown} within {WARN_MARGIN:.0%} of its limit {_g(lim)}{unit}", key)
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
            if isinstance(acc, int | float) and not isinstance(acc,
                                                               bool) and math.isfinite(acc) and (low is None
                                                                   or acc < low):
                low = float(acc)
                depth = f" depth {r['depth']:g}" if isinstance(r.get("depth"), int | float) else ""
                where = f"{task} context {context_label(r.get('context'))}{depth}"
    return low, where, bad


def fetch_p95_worst(progress: Sequence[Mapping[str, Any]]) -> tuple[float, int] | None:
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


@dataclass
class Window:
    """A stretch of consecutive progress points and their median tokens/s."""

    tokens_per_s: float
    from_step: int
    to_step: int
    points: int
    seconds: float | None = None  # wall time the window covers (heartbeat ts), None without it

    def steps(self) -> str:
        return f"steps {self.from_step}-{self.to_step}"


def throughput_windows(points: Sequence[Mapping[str, Any]]) -> tuple[float, Window, Window] | None:
    """``(median, slowest window, last window)`` of tokens/s over the points after the warm-up fifth; windows
    of a tenth of them (at least :data:`WINDOW_MIN_POINTS`), counted back from the last point so the last
    window is the run's tail. None with fewer than two windows of points."""
    pts = [(int(p["step"]), float(p["tokens_per_s"]), float(p["ts"]) if finite(p.get("ts")) else None)
           for p in points if finite(p.get("step")) and finite(p.get("tokens_per_s"))]
    skip = len(pts) // 5
    body = pts[skip:]
    width = max(WINDOW_MIN_POINTS, len(body) // 10)
    if len(body) < 2 * width:
        return None
    wins = []
    for end in range(len(body), width - 1, -width):
        chunk = body[end - width:end]
        # the window's start
        before = pts[skip + end - width - 1][2] if skip + end - width > 0 else chunk[0][2]
        seconds = chunk[-1][2] - before if chunk[-1][2] is not None and before is not None else None
        wins.append(Window(statistics.median(v for _, v, _ in chunk), chunk[0][0], chunk[-1][0], len(chunk),
                           seconds))
    median = statistics.median(v for _, v, _ in body)
    return median, min(wins, key=lambda w: w.tokens_per_s), wins[0]


def _throughput_checks(s: RunSummary, limits: Limits, progress: Sequence[Mapping[str, Any]]) -> list[Check]:
    """The floor (median and slowest window) and the tail against the run's own median."""
    wins = throughput_windows(progress)
    tps = s.tokens_per_s_median
    if wins is None:
        floor = _judge("throughput", "min_tokens_per_s", limits, tps,
                       f"median {fmt_value(tps, ',.0f')} tokens/s", " tokens/s", floor=True)
        return [floor,
                Check("throughput tail", "too few progress points for windows", ">= ratio x the median",
                             "n/a", key="throughput_drop_ratio")]
    median, worst, tail = wins
    shown = f"median {median:,.0f} tokens/s, slowest window {worst.tokens_per_s:,.0f} ({worst.steps()})"
    floor = _judge("throughput", "min_tokens_per_s", limits, min(worst.tokens_per_s, median), shown,
                   " tokens/s", floor=True)
    ratio = limits.values.get("throughput_drop_ratio") or MonitorConfig().throughput_drop_ratio
    src = limits.sources.get("throughput_drop_ratio", "default")
    limit = f">= {ratio:g} x the median (`monitor.throughput_drop_ratio`, {src})"
    tail_x, worst_x = (tail.tokens_per_s / median if median else 1.0,
                       worst.tokens_per_s / median if median else 1.0)
    figure = (f"last {tail.points} points ({tail.steps()}) {tail.tokens_per_s:,.0f} tokens/s = {tail_x:.2f}x "
              f"the median {median:,.0f}")
    min_s = limits.values.get("throughput_tail_min_s")
    min_s = MonitorConfig().throughput_tail_min_s if min_s is None else min_s
    brief = tail.seconds is not None and tail.seconds < min_s
    if tail_x < ratio and brief:
        check = Check("throughput tail", f"{figure}, for {tail.seconds:.1f} s", limit, "WARN",
                      f"tokens/s fell to {tail_x:.2f}x the median over the last {tail.seconds:.1f} s only "
                      f"(< monitor.throughput_tail_min_s {min_s:g} s: a brief slowdown, not a collapse)",
                      "throughput_drop_ratio")
    elif tail_x < ratio:
        check = Check("throughput tail", figure, limit, "FAIL",
                      f"throughput collapsed at the end: {tail.tokens_per_s:,.0f} tokens/s over "
                      f"{tail.steps()}, {tail_x:.2f}x the run's median {median:,.0f}",
                      "throughput_drop_ratio")
    elif worst_x < ratio:
        check = Check("throughput tail",
                      f"{figure}; slowest {worst.tokens_per_s:,.0f} ({worst.steps()}) = {worst_x:.2f}x",
                      limit, "WARN",
                      f"throughput dipped to {worst_x:.2f}x the median over {worst.steps()} and recovered",
                      "throughput_drop_ratio")
    else:
        check = Check("throughput tail", figure, limit, "PASS", key="throughput_drop_ratio")
    return [floor, check]


def run_checks(s: RunSummary, limits: Limits | None = None,
               evals: Sequence[tuple[str, dict[str, Any] | None]] = (), halts: list[HaltRecord] | None = None,
               progress: Sequence[Mapping[str, Any]] = (), alarms: Sequence[KeptAlarm] = (),
               sessions: Sequence[Session] = (), config_error: str | None = None,
               schema_notes: Sequence[str] = (), stale: Mapping[str, str] | None = None) -> list[Check]:
    """Every check of the verdict, in report order (see :class:`Check`); ``progress``: the rank-0 heartbeat
    points, for the throughput windows and the worst fetch p95 (else the summary's figures); ``alarms``: those
    ``nsa watch`` kept with the run (``RUN/alarms.jsonl``, judged: only open ones fail); ``sessions``: the
    run's history (an earlier session that crashed, failed or was interrupted is a WARN); ``config_error``:
    why the run's ``config.yaml`` cannot be read (a WARN: its limits are unknown, the defaults judge);
    ``stale``: :func:`stale_evals` of ``evals`` when the caller has it (each weights file hashed once)."""
    limits = limits or run_limits(None)
    halts = classify_halts(s) if halts is None else halts
    out: list[Check] = []
    if config_error is not None:
        out.append(Check("run config", config_error, "config.yaml readable", "WARN",
                         f"{config_error}; the run's settings are unknown and every limit below is the "
                         "default"))
    if schema_notes:
        out.append(Check("record formats", "; ".join(schema_notes), "formats this nsa reads", "WARN",
                         "; ".join(schema_notes)))
    n_bad = s.nonfinite_losses + len(s.anomalies)
    out.append(Check("non-finite values",
                     f"{s.nonfinite_losses} loss(es), {len(s.anomalies)} anomaly record(s)", "none",
                     "FAIL" if n_bad else "PASS",
                     f"{s.nonfinite_losses} non-finite loss(es), {len(s.anomalies)} anomaly "
                     "record(s)" if n_bad else ""))
    out.append(Check("backend fallbacks", f"{s.fallback_total}", "none",
                     "FAIL" if s.fallback_total else "PASS",
                     f"{s.fallback_total} backend fallback(s)" if s.fallback_total else ""))
    out.append(_data_check(s))
    if s.first_loss is not None and s.last_loss is not None and s.steps_done > 1:
        shown = f"{s.first_loss:.3f} -> {fmt_value(s.last_loss, '.3f')}"
        out.append(Check("loss trend", shown, "last < first", "PASS" if s.loss_decreased else "FAIL",
                         "" if s.loss_decreased else f"loss did not decrease ({shown})"))
    else:
        out.append(Check("loss trend", "fewer than 2 logged losses", "last < first", "n/a"))
    wd = [h for h in halts if h.by == "watchdog"]
    if wd:
        h = wd[0]
        what = "hung: the watchdog's stale-heartbeat rule" if h.hung else f"watchdog rule `{h.rule or '?'}`"
        act = (f"halted the run at step {h.step}" if h.acted else "wrote .HALT, not acted on "
                                                                  "yet" if h.where == ".HALT"
               else f"wrote a .HALT that a restart archived unobeyed ({h.where})")
        more = f" (+{len(wd) - 1} more watchdog halt(s))" if len(wd) > 1 else ""
        out.append(Check("halts", "; ".join(x.describe() for x in halts), "no watchdog halt", "FAIL",
                         f"{what} {act}: {h.reason}{more}"))
    else:
        figure = "; ".join(x.describe() for x in halts) if halts else "none"
        out.append(Check("halts", figure, "no watchdog halt", "PASS"))
    out.append(_alarms_check(alarms))
    out.append(_sessions_check(sessions))
    out += _throughput_checks(s, limits, progress)
    worst = fetch_p95_worst(progress)
    fetch: float | None
    if worst is not None:
        fetch, fetch_text = (worst[0],
                             f"worst {worst[0]:,.1f} ms at step {worst[1]} (last "
                             f"{fmt_value(s.fetch_p95_ms, ',.1f')} ms)")
    else:
        fetch, fetch_text = s.fetch_p95_ms, f"{fmt_value(s.fetch_p95_ms, ',.1f')} ms"
    out.append(_judge("fetch p95", "max_fetch_p95_ms", limits, fetch, fetch_text, " ms", floor=False))
    early = limits.values.get("gate_entropy_early_steps")
    entropy_key = ("gate_entropy_early_min" if early is not None and s.steps_done < early
                   else "gate_entropy_min")
    out.append(_judge("gate entropy", entropy_key, limits, s.gate_entropy_mean,
                      f"{fmt_value(s.gate_entropy_mean, '.3f')} nats (last, step {s.steps_done})", " nats",
                      floor=True, missing="no gate statistics (dense model or no progress yet)"))
    out.append(_judge("gate collapse", "gate_collapse_max", limits, s.gate_collapse_fraction,
                      f"{fmt_value(s.gate_collapse_fraction, '.3f')} (last)", "", floor=False,
                      missing="no gate statistics (dense model or no progress yet)"))
    gib = s.mem_peak_mib / 1024 if s.mem_peak_mib is not None else None
    out.append(_judge("peak GPU memory", "max_memory_gib", limits, gib, f"{fmt_value(gib, '.2f')} GiB",
                      " GiB", floor=False,
                      missing="no GPU memory figure (CPU run" + (f"; host RSS peak {s.rss_mib / 1024:.2f} "
                                                                 "GiB)"
                                                                 if s.rss_mib is not None else ")")))
    out.append(_gpu_errors_check(s))
    out.append(_selection_check(s, limits))
    if stale is None:
        stale = stale_evals(evals, s.steps_done, s.run_dir)
    low, where, bad = eval_accuracy(evals)
    if bad and limits.values.get("min_eval_accuracy") is not None:
        out.append(Check("eval accuracy", f"{', '.join(bad)} unreadable",
                         f">= {limits.values['min_eval_accuracy']:g}", "WARN",
                         f"{', '.join(bad)} could not be read", "min_eval_accuracy"))
    else:
        check = _judge("eval accuracy", "min_eval_accuracy", limits, low,
                       f"lowest {low:.3f} ({where})" if low is not None else "", "", floor=True, margin=False,
                       missing="no needle/mqar results in eval/")
        stale_retrieval = [f"eval/{task}.json {why}" for task, why in stale.items()
                           if task in RETRIEVAL_TASKS]
        if stale_retrieval:
            check.figure += f" (STALE: {'; '.join(stale_retrieval)})"
        out.append(check)
    out.append(_eval_freshness_check(evals, stale))
    out.append(weights_check(s.run_dir))
    return out


def eval_staleness(data: dict[str, Any], steps_done: int, run_dir: str | Path | None = None) -> str | None:
    """Why an ``nsa eval`` result is not of the model as it is now: it evaluated the weights of an earlier
    step (``is of step 20; the run is at step 40``) or other bytes than its weights file, a file of
    ``run_dir``, holds now (their SHA-256 differs); None when current (or neither was recorded)."""
    step = data.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step < steps_done:
        return f"is of step {step}; the run is at step {steps_done}"
    weights = data.get("weights")
    path, want = (weights.get("path"), weights.get("sha256")) if isinstance(weights, dict) else (None, None)
    if isinstance(path, str) and isinstance(want, str) and run_dir is not None:
        try:
            file = Path(path).resolve()
            # recorded relative to another directory, or not ours
            if Path(run_dir).resolve() not in file.parents:
                return None
            got = sha256_file(file)
        except OSError:  # the file is gone (pruned): nothing to compare
            return None
        if got != want:
            return f"evaluated weights of SHA-256 {want[:12]}...; {path} now holds {got[:12]}..."
    return None


def stale_evals(evals: Sequence[tuple[str, dict[str, Any] | None]], steps_done: int,
                run_dir: str | Path | None) -> dict[str, str]:
    """``{task: why}`` for each ``nsa eval`` result that is not of the model as it is now
    (:func:`eval_staleness`)."""
    return {task: why for task, data in evals
            if data is not None and (why := eval_staleness(data, steps_done, run_dir))}


def _eval_freshness_check(evals: Sequence[tuple[str, dict[str, Any] | None]],
                          stale: Mapping[str, str]) -> Check:
    """WARN for each ``nsa eval`` result that is not of the model as it is now (:func:`stale_evals`)."""
    limit = "of the run's last step and its weights as they are"
    found = [(task, data) for task, data in evals if data is not None]
    if not found:
        return Check("eval freshness", "no results in eval/", limit, "n/a")
    stale_lines = [f"eval/{task}.json {why}" for task, why in stale.items()]
    if stale_lines:
        return Check("eval freshness", "STALE: " + "; ".join(stale_lines), limit, "WARN",
                     f"{stale_lines[0]}: re-run nsa eval")
    return Check("eval freshness", ", ".join(f"eval/{task}.json" for task, _ in found) + " current", limit,
                 "PASS")


def weights_check(run_dir: str | Path) -> Check:
    """FAIL when ``export/model.safetensors`` does not match the SHA-256 that ``export.json`` records
    (computed from the file: bytes corrupted on disk or changed since the run wrote them)."""
    weights = RunDir(run_dir).export / EXPORT_WEIGHTS
    limit = f"the SHA-256 recorded in {EXPORT_DIR}/{EXPORT_INFO}"
    if not weights.is_file():
        return Check("export weights", f"no {EXPORT_DIR}/{EXPORT_WEIGHTS}", limit, "n/a")
    want, _ = recorded_sha256(weights)
    if want is None:
        return Check("export weights", f"no SHA-256 recorded for {EXPORT_DIR}/{EXPORT_WEIGHTS}", limit, "n/a")
    try:
        got = sha256_file(weights)
    except OSError as exc:
        return Check("export weights", f"unreadable: {exc.strerror or exc}", limit, "FAIL",
                     f"{EXPORT_DIR}/{EXPORT_WEIGHTS} cannot be read: {exc.strerror or exc}")
    if got != want:
        return Check("export weights", f"SHA-256 {got[:12]}... (recorded {want[:12]}...)", limit, "FAIL",
                     f"{EXPORT_DIR}/{EXPORT_WEIGHTS} does not match the SHA-256 in {EXPORT_INFO} (corrupted "
                     f"on disk or changed since the run wrote it)")
    return Check("export weights", f"SHA-256 {got[:12]}... matches", limit, "PASS")


def _alarms_check(alarms: Sequence[KeptAlarm]) -> Check:
    """FAIL on the open alarms ``nsa watch`` kept; WARN on superseded ones (an earlier session's, the run
    resumed and still running); resolved and acknowledged ones are listed and pass."""
    limit = "none open (`alarms.jsonl`; resolved by a later clean session or `nsa ack`)"
    if not alarms:
        return Check("watch alarms", "none kept", limit, "PASS")
    figure = "; ".join(a.describe() for a in alarms)
    open_ = [a for a in alarms if a.counts]
    if open_:
        rules = sorted({a.rule for a in open_})
        return Check("watch alarms", figure, limit, "FAIL",
                     f"{len(open_)} open alarm(s) raised by nsa watch ({', '.join(rules)}): "
                     f"{open_[0].describe()} (close one with nsa ack RUN --reason TEXT)")
    superseded = [a for a in alarms if a.state == "superseded"]
    if superseded:
        return Check("watch alarms", figure, limit, "WARN",
                     f"alarm {superseded[0].describe()} of an earlier session")
    return Check("watch alarms", figure, limit, "PASS")


def _sessions_check(sessions: Sequence[Session]) -> Check:
    """WARN when a session before the last did not end cleanly (crashed, failed, interrupted, halted by the
    watchdog): the run recovered, and the report says from what."""
    limit = "every earlier session ended cleanly"
    if not sessions:
        return Check("sessions", "no boot event", limit, "n/a")
    figure = f"{len(sessions)} session(s): " + "; ".join(
        f"{x.index} {x.status} at step {x.last_step}" for x in sessions)
    trouble = earlier_trouble(list(sessions))
    if not trouble:
        return Check("sessions", figure, limit, "PASS")
    t = trouble[0]
    nxt = sessions[t.index] if t.index < len(sessions) else None
    after = f"; session {nxt.index} resumed at step {nxt.first_step}" if nxt is not None else ""
    more = f" (+{len(trouble) - 1} more)" if len(trouble) > 1 else ""
    return Check("sessions", figure, limit, "WARN",
                 f"session {t.index} {t.how()} at step {t.last_step}{after}{more}")


def _selection_check(s: RunSummary, limits: Limits) -> Check:
    """The last evaluation's mean selection recall against ``monitor.min_selection_recall`` (informational
    while that is not set)."""
    shown = ""
    if s.sel_recall_mean is not None:
        where = f" in layer {s.sel_recall_min_layer}" if s.sel_recall_min_layer is not None else ""
        shown = (f"mean {s.sel_recall_mean:.3f}, lowest {fmt_value(s.sel_recall_min, '.3f')}{where} "
                 f"(evaluation at step {s.selection_step})")
    missing = ("sequence too short to select (seq_len <= n_sel * l_sel)" if s.selection_step is not None
               else "no selection diagnostics (dense model, eval.selection_queries 0, or no evaluation yet)")
    return _judge("selection recall", "min_selection_recall", limits, s.sel_recall_mean, shown, "",
                  floor=True, margin=False, missing=missing)


def _data_check(s: RunSummary) -> Check:
    """FAIL when the run trained on synthetic tokens instead of its source; WARN on other loader warnings."""
    limit = "the configured source, no loader warnings"
    if s.data_fallback:
        return Check("data source", f"SYNTHETIC tokens: {s.data_fallback}", limit, "FAIL",
                     f"trained on synthetic data, not its configured source: {s.data_fallback}")
    shown = s.data_source or "n/a"
    if s.data_warnings:
        return Check("data source", f"{shown}; {len(s.data_warnings)} warning(s): {s.data_warnings[0]}",
                     limit, "WARN", f"data warnings: {'; '.join(s.data_warnings)}")
    return Check("data source", shown, limit, "PASS" if s.data_source else "n/a")


def _gpu_errors_check(s: RunSummary) -> Check:
    """GPU memory errors (uncorrected ECC, retired pages) that appeared during the run: FAIL."""
    if s.gpu_mem_errors is None:
        return Check("GPU memory errors", "no GPU error telemetry (CPU run, or NVML unavailable)", "none new",
                     "n/a")
    shown = ", ".join(f"{k} {v}" for k, v in sorted(s.gpu_mem_errors.items())) or "0"
    if s.gpu_mem_errors_new:
        return Check("GPU memory errors", f"{s.gpu_mem_errors_new} new ({shown})", "none new", "FAIL",
                     f"{s.gpu_mem_errors_new} GPU memory error(s) during the run ({shown}): drain the node")
    return Check("GPU memory errors", f"none new ({shown})", "none new", "PASS")


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
        return "FAIL", f"run {s.status} at step {s.steps_done}" + (f": {err}" if err
                                                                   else "") + resume_hint(s) + extra
    if s.status == "interrupted":
        return "INCOMPLETE", f"interrupted by the operator (Ctrl-C) at {progress}" + resume_hint(s) + extra
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
        loss = (f", loss {s.first_loss:.3f} -> "
                f"{s.last_loss:.3f}" if s.first_loss is not None and s.last_loss is not None else "")
        return "PASS", f"completed {progress}{loss}" + warned
    return "INCOMPLETE", f"status {s.status}, {progress}" + warned


def resume_hint(s: RunSummary) -> str:
    """``; resume from step_00000010 with nsa train --resume auto`` (the last checkpoint the heartbeat
    recorded), or that there is none."""
    ck = (s.last_checkpoint or {}).get("path")
    if not ck:
        return "; no checkpoint to resume from"
    return f"; resume from {Path(str(ck)).name} with nsa train --resume auto"


def overall_verdict(verdicts: list[tuple[str, str]]) -> str:
    """The report's overall verdict from the per-run ``(verdict, why)`` pairs."""
    names = [v for v, _ in verdicts]
    if "FAIL" in names:
        return "FAIL"
    if "RUNNING" in names:
        return "RUNNING"
    return "PASS" if all(v == "PASS" for v in names) else "INCOMPLETE"

