"""Watch rules: conditions on a live run that raise an alarm and, as a watchdog, write ``.HALT``.

Each rule is declared once, as a :class:`Rule` in :data:`RULES` (name, check, aliases, the ``monitor`` field
of its threshold, whether it still speaks once the run has ended, and its help line); the spec parser, the
defaults, the aliases, ``nsa watch``'s help and the docs' table are derived from them.

Spec syntax (``nsa watch --alert-on / --halt-on``): comma-separated ``name`` or ``name=threshold``;
``all`` means every rule, ``none`` no rule. A rule without ``=threshold`` takes its threshold from the
run's own ``monitor`` section (``config.yaml``, ``nsa.config.monitor.MonitorConfig``; its defaults when
absent).

``AlarmLog`` de-duplicates hits across refreshes (new / cleared) and ``notify`` runs a shell command with an
alarm as JSON on stdin; both are what ``nsa watch`` builds its actions from.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from nsa.config.monitor import MonitorConfig
from nsa.errors import ConfigError
from nsa.fileio import json_safe
from nsa.runs.reader import RunState
from nsa.runs.summary import anomaly_text, finite, values

SPIKE_HISTORY, SPIKE_RECENT, LAST_N = 20, 5, 3
Check = Callable[[float | None, RunState, float, MonitorConfig], "RuleHit | None"]


@dataclass(frozen=True)
class Rule:
    """One watch rule, declared once: ``check(threshold or None, state, now, monitor)`` returns a hit or None;
    ``field``: the ``monitor`` field of its threshold (None: it takes none; ``unit`` names it in the help);
    ``after_end``: it still says something once the run has ended; ``help``: what fires it."""

    name: str
    check: Check
    help: str
    field: str | None = None
    unit: str = ""
    aliases: tuple[str, ...] = ()
    after_end: bool = False

    @property
    def default(self) -> float | None:
        return float(MonitorConfig.model_fields[self.field].default) if self.field else None

    def synopsis(self) -> str:
        """``stale=SECONDS`` or ``crashed``: how a spec names it."""
        return f"{self.name}={self.unit}" if self.field else self.name


@dataclass
class ArmedRule:
    """A rule as a watch applies it, with its threshold; ``explicit=False`` when the threshold should come
    from the run's ``monitor`` config (``evaluate`` then uses that instead of ``threshold``)."""

    name: str
    threshold: float | None = None
    explicit: bool = True

    def describe(self) -> str:
        return self.name if self.threshold is None else f"{self.name}={self.threshold:g}"


@dataclass
class RuleHit:
    rule: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_rules(spec: str | None, monitor: MonitorConfig | None = None) -> list[ArmedRule]:
    """``"stale=120,nonfinite"`` -> rules; ``"all"`` -> every rule; ``"none"`` -> no rule; thresholds not
    given come from ``monitor`` (default ``MonitorConfig()``); ``ConfigError`` on a bad spec."""
    if spec is None or not spec.strip():
        return []
    mon = monitor or MonitorConfig()
    rules: dict[str, ArmedRule] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, value = part.partition("=")
        name = canonical(name)
        if name in ("none", "off"):
            continue
        if name in ("all", "default", "defaults"):
            for n in RULES:
                rules.setdefault(n, ArmedRule(n, _monitor_value(mon, n), explicit=False))
            continue
        if name not in RULES:
            raise ConfigError(f"unknown watch rule '{name}'",
                              hint=f"rules: {', '.join(RULES)} (or all, none)")
        threshold = _monitor_value(mon, name)
        explicit = False
        if value.strip():
            if RULES[name].field is None:
                raise ConfigError(f"watch rule '{name}' takes no threshold", hint=f"write just {name}")
            threshold = _parse_threshold(part, name, value)
            explicit = True
        rules[name] = ArmedRule(name, threshold, explicit)
    return list(rules.values())


def _parse_threshold(part: str, name: str, value: str) -> float:
    try:
        threshold = float(value.strip().lower().removesuffix("ms").removesuffix("s").removesuffix("m"))
    except ValueError:
        raise ConfigError(f"watch rule '{part}': threshold must be a number",
                          hint=f"e.g. {name}={RULES[name].default:g}") from None
    if not math.isfinite(threshold) or threshold <= 0:
        raise ConfigError(f"watch rule '{part}': threshold must be positive",
                          hint=f"e.g. {name}={RULES[name].default:g}")
    fld = RULES[name].field
    assert fld is not None
    try:
        MonitorConfig.model_validate({fld: threshold})
    except ValidationError as exc:
        msg = exc.errors()[0].get("msg", "out of range")
        raise ConfigError(f"watch rule '{part}': {msg.lower()} (monitor.{fld})",
                          hint=f"e.g. {name}={RULES[name].default:g}") from None
    return threshold


def _monitor_value(mon: MonitorConfig, name: str) -> float | None:
    fld = RULES[name].field
    return None if fld is None else float(getattr(mon, fld))


def monitor_config(state: RunState) -> MonitorConfig:
    """The run's ``monitor`` section (``config.yaml``) validated, its defaults when absent; ``ConfigError``
    naming the file when it is invalid."""
    raw = (state.config or {}).get("monitor") or {}
    try:
        return MonitorConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "monitor"
        raise ConfigError(f"{state.files.config}: monitor.{where}: {err.get('msg', 'invalid')}",
                          hint="fix the run's monitor section, or give thresholds with "
                               "--alert-on/--halt-on") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{state.files.config}: monitor section is not a mapping ({exc})") from None


def resolve(rules: list[ArmedRule], monitor: MonitorConfig) -> list[ArmedRule]:
    """The rules with the thresholds they are evaluated with (``monitor``'s for non-explicit ones)."""
    return [r if r.explicit else ArmedRule(r.name, _monitor_value(monitor, r.name), False) for r in rules]


def evaluate(rules: list[ArmedRule], state: RunState, now: float,
             monitor: MonitorConfig | None = None) -> list[RuleHit]:
    """The rules that fire on this state (only those declared ``after_end`` once the run has ended).
    ``monitor``: the thresholds of non-explicit rules and the rules' windows (default: the run's own,
    ``monitor_config``)."""
    mon = monitor if monitor is not None else monitor_config(state)
    ended = state.end is not None
    hits: list[RuleHit] = []
    for rule in rules:
        if ended and not RULES[rule.name].after_end:
            continue
        hit = RULES[rule.name].check(rule.threshold if rule.explicit else None, state, now, mon)
        if hit is not None:
            hits.append(hit)
    return hits


# ------------------------------------------------------------------------------------------- the rules


def _points(state: RunState) -> Sequence[Mapping[str, Any]]:
    """Rank-0 progress events (the heartbeat), else training.csv rows."""
    return state.progress or state.csv_rows


def _crashed(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    if state.process_alive() is not False or state.new_session_pending():
        return None  # alive, unknown, or already being resumed
    boot = state.boot or {}
    last = (state.rank0.last if state.rank0 else None) or {}
    ages = state.heartbeat_age(now)
    age = ages.get(state.rank0.rank) if state.rank0 else None
    return RuleHit("crashed", f"trainer process {boot.get('pid')} on {boot.get('host')} is gone without an "
                   f"end event (last step {state.steps_done}, last heartbeat {age or 0:.0f} s ago)",
                   {"pid": boot.get("pid"), "host": boot.get("host"), "step": state.steps_done,
                    "last_event": last.get("event"),
                    "heartbeat_age_s": None if age is None else round(age, 1)})


def _stale(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    ages = state.heartbeat_age(now)
    limit = th or mon.stale_s
    old = {r: a for r, a in ages.items() if a > limit and state.ranks[r].end is None}
    if not old:
        return None
    rank, age = max(old.items(), key=lambda kv: kv[1])
    last = state.ranks[rank].last or {}
    return RuleHit("stale",
                   f"rank {rank} heartbeat is {age:.0f} s old (> {limit:g} s) at step {last.get('step')}",
                   {"rank": rank, "age_s": round(age, 1), "last_event": last.get("event"),
                    "step": last.get("step")})


def _nonfinite(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    if state.anomalies:
        a = state.anomalies[-1]
        return RuleHit("nonfinite", f"anomaly {anomaly_text(a)}",
                       {k: a.get(k) for k in ("step", "kind", "value", "record")})
    for p in reversed(state.series()[-50:]):
        if "loss" in p and not finite(p.get("loss")):
            return RuleHit("nonfinite", f"non-finite loss at step {p.get('step')}",
                           {"step": p.get("step"), "loss": str(p.get("loss"))})
    return None


def _gate_entropy(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    vals = values(state.progress, "gate_entropy_mean")[-LAST_N:]
    last = state.progress[-1] if state.progress else {}
    step = int(last["step"]) if finite(last.get("step")) else None
    limit = mon.entropy_min_at(step) if th is None else th
    if len(vals) < LAST_N or max(vals) >= limit:
        return None
    stage = "" if th is not None else (" (early steps)" if limit == mon.gate_entropy_early_min and
                                       mon.gate_entropy_early_min != mon.gate_entropy_min else "")
    return RuleHit("gate-entropy", f"mean gate entropy {vals[-1]:.3f} < {limit:g}{stage} for {LAST_N} points",
                   {"step": last.get("step"), "gate_entropy_mean": vals,
                    "gate_branch_shares": last.get("gate_branch_shares")})


def _gate_collapse(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    vals = values(state.progress, "gate_collapse_fraction")[-LAST_N:]
    limit = mon.gate_collapse_max if th is None else th
    if len(vals) < LAST_N or min(vals) <= limit:
        return None
    last = state.progress[-1]
    return RuleHit("gate-collapse", f"collapsed-gate fraction {vals[-1]:.2f} > {limit:g} for {LAST_N} points",
                   {"step": last.get("step"), "gate_collapse_fraction": vals,
                    "gate_entropy_mean": last.get("gate_entropy_mean"),
                    "gate_branch_shares": last.get("gate_branch_shares")})


def _grad_spike(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    pts = [(p.get("step"), float(p["grad_norm"])) for p in _points(state) if finite(p.get("grad_norm"))]
    ratio = th or mon.grad_spike_ratio
    worst: tuple[float, int, float, float] | None = None  # (ratio, index, value, median)
    for i in range(max(SPIKE_HISTORY, len(pts) - SPIKE_RECENT), len(pts)):
        med = statistics.median(v for _, v in pts[i - SPIKE_HISTORY:i])
        if med > 0 and pts[i][1] > ratio * med and (worst is None or pts[i][1] / med > worst[0]):
            worst = (pts[i][1] / med, i, pts[i][1], med)
    if worst is None:
        return None
    _, i, value, med = worst
    return RuleHit("grad-spike", f"grad norm {value:.3g} at step {pts[i][0]} > {ratio:g} x median {med:.3g} "
                   f"of the previous {SPIKE_HISTORY} points",
                   {"step": pts[i][0], "grad_norm": value, "median_previous": med,
                    "ratio": round(value / med, 2)})


def _loss_plateau(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    by_step: dict[int, float] = {}
    for p in _points(state):  # a resumed run re-logs steps: the latest value of a step wins
        if finite(p.get("step")) and finite(p.get("loss")):
            by_step[int(p["step"])] = float(p["loss"])
    if len(by_step) < 2:
        return None
    steps = sorted(by_step)
    span = mon.plateau_steps
    last, min_drop = steps[-1], (mon.plateau_min_drop if th is None else th)
    if steps[0] > last - span:
        return None  # not enough history
    w = max(1, span // 10)  # compare medians of a tenth of the span at each end (noise)
    now_vals = [by_step[s] for s in steps if s > last - w]
    then_steps = [s for s in steps if last - span - w < s <= last
                  - span] or [max(s for s in steps if s <= last - span)]
    then_vals = [by_step[s] for s in then_steps]
    before, after = statistics.median(then_vals), statistics.median(now_vals)
    if before == 0:
        return None
    drop = (before - after) / abs(before)
    if drop >= min_drop:
        return None
    return RuleHit("loss-plateau", f"loss fell {drop:.2%} over the last {span} steps ({before:.4f} -> "
                   f"{after:.4f}; < {min_drop:.2%})",
                   {"from_step": then_steps[-1], "to_step": last, "loss_then": before, "loss_now": after,
                    "relative_drop": drop, "plateau_steps": span})


def _memory_creep(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    pts: Sequence[Mapping[str, Any]] = state.session_progress()
    key = "mem_reserved_mib" if any(finite(p.get("mem_reserved_mib")) for p in pts) else "rss_mib"
    vals = [(p.get("step"), float(p[key])) for p in pts if finite(p.get(key))]
    if len(vals) < 10:
        return None
    warm = max(1, len(vals) // 10)
    base_pts = vals[warm:2 * warm]
    base = statistics.median(v for _, v in base_pts)
    current = statistics.median(v for _, v in vals[-LAST_N:])
    ratio = th or mon.memory_creep_ratio
    if base <= 0 or current <= ratio * base:
        return None
    what = "reserved GPU memory" if key == "mem_reserved_mib" else "host RSS"
    return RuleHit("memory-creep", f"{what} {current:,.0f} MiB > {ratio:g} x {base:,.0f} MiB after warm-up "
                   f"(step {base_pts[0][0]})",
                   {"step": vals[-1][0], "metric": key, "current_mib": current, "baseline_mib": base,
                    "baseline_steps": [base_pts[0][0], base_pts[-1][0]], "ratio": round(current / base, 3)})


def _throughput_drop(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    progress: Sequence[Mapping[str, Any]] = state.session_progress()
    pts = [(float(p["ts"]), float(p["tokens_per_s"]), p.get("step")) for p in progress
           if finite(p.get("ts")) and finite(p.get("tokens_per_s"))]
    if len(pts) < 10:
        return None
    body = pts[len(pts) // 5:]  # skip the warm-up fifth
    ratio = th or mon.throughput_drop_ratio

    def split(base: float) -> int:  # index where the trailing run of slow points starts
        k = len(body)
        while k > 0 and body[k - 1][1] < ratio * base:
            k -= 1
        return k

    k = split(statistics.median(v for _, v, _ in body))
    if k < 5:
        return None
    base = statistics.median(v for _, v, _ in body[:k])  # the run's median without the slow stretch
    k = split(base)
    if k < 5 or k == len(body):
        return None
    slow = body[k:]
    since = body[k - 1][0]  # the first slow point's tokens/s covers the time since the last normal point
    lasted = slow[-1][0] - since
    if base <= 0 or lasted < mon.throughput_window_s:
        return None
    recent = statistics.median(v for _, v, _ in slow)
    return RuleHit("throughput-drop", f"tokens/s {recent:,.0f} < {ratio:g} x the run's median {base:,.0f} "
                   f"for {lasted:.0f} s (>= {mon.throughput_window_s:g} s) since step {slow[0][2]}",
                   {"step": slow[-1][2], "since_step": slow[0][2], "recent_tokens_per_s": recent,
                    "baseline_tokens_per_s": base, "seconds": round(lasted, 1)})


def _fetch_stall(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    last: Mapping[str, Any] | None = state.last_progress
    if not last or not finite(last.get("fetch_p95_ms")):
        return None
    p95 = float(last["fetch_p95_ms"])
    limit = th or mon.fetch_stall_ms
    if p95 <= limit:
        return None
    return RuleHit("fetch-stall", f"data fetch p95 {p95:.0f} ms > {limit:g} ms",
                   {"step": last.get("step"), "fetch_p95_ms": p95, "fetch_p50_ms": last.get("fetch_p50_ms")})


def _data_fallback(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    why = state.data_fallback
    if why is None:
        return None
    ready = state.loader_ready or {}
    return RuleHit("data-fallback",
                   f"training on synthetic data, not data.source={ready.get('source', '?')}: {why}",
                   {"step": ready.get("step"), "source": ready.get("source"),
                    "source_used": ready.get("source_used"), "warning": why})


def _counter_total(value: Any) -> int | None:
    if not isinstance(value, dict):
        return None
    return int(sum(v for v in value.values() if finite(v)))


def _fallback_rise(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    pts = [(p.get("step"), total, p["fallback"]) for p in state.session_progress()
           if (total := _counter_total(p.get("fallback"))) is not None]
    if len(pts) < LAST_N + 1:
        return None
    (s0, before, _), (s1, after, last) = pts[-LAST_N - 1], pts[-1]
    rose = [s for s in range(len(pts) - LAST_N, len(pts)) if pts[s][1] > pts[s - 1][1]]
    if after <= before or not rose:
        return None
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(last.items()))
    return RuleHit("fallback-rise", f"backend fallback counters rose {before} -> {after} over steps "
                   f"{s0}-{s1} (torch path used for: {reasons})",
                   {"step": s1, "from_step": s0, "before": before, "after": after, "fallback": last})


def _gpu_errors(th: float | None, state: RunState, now: float, mon: MonitorConfig) -> RuleHit | None:
    for rank, rs in sorted(state.ranks.items()):
        first, last = rs.first_progress or {}, rs.last_progress or {}
        e0, e1 = first.get("gpu_mem_errors"), last.get("gpu_mem_errors")
        t0, t1 = _counter_total(e0), _counter_total(e1)
        if t0 is None or t1 is None or t1 <= t0:
            continue
        assert isinstance(e0, dict) and isinstance(e1, dict)
        changes = ", ".join(f"{k} {e0.get(k, 0)} -> {v}" for k, v in sorted(e1.items()) if v != e0.get(k, 0))
        return RuleHit("gpu-errors", f"GPU memory errors on rank {rank} rose during the run ({changes}; "
                       f"steps {first.get('step')}-{last.get('step')}); Xid events are in the kernel log "
                       "(dmesg | grep -i xid)",
                       {"step": last.get("step"), "rank": rank, "before": e0, "now": e1})
    return None


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("crashed", _crashed,
         "the trainer process (rank 0, this host) is gone and the heartbeat has no end event",
         aliases=("crash", "dead")),
    Rule("stale", _stale, "a rank's heartbeat is older than S seconds and the run has not ended", "stale_s",
         "SECONDS", ("heartbeat",)),
    Rule("nonfinite", _nonfinite, "a non-finite loss in the log, or an anomaly event",
         aliases=("nan", "non-finite"), after_end=True),
    Rule("gate-entropy", _gate_entropy, "mean gate entropy below H for the last 3 points "
         "(gate_entropy_early_min before step gate_entropy_early_steps)", "gate_entropy_min", "NATS",
         ("entropy",)),
    Rule("gate-collapse", _gate_collapse, "collapsed-gate fraction above F for the last 3 points",
         "gate_collapse_max", "FRACTION", ("collapse",)),
    Rule("grad-spike", _grad_spike,
         "a grad norm among the last 5 points above R x the median of the 20 before it", "grad_spike_ratio",
         "RATIO", ("grad", "spike")),
    Rule("loss-plateau", _loss_plateau, "relative loss drop over the last plateau_steps steps below D",
         "plateau_min_drop", "DROP", ("plateau",)),
    Rule("memory-creep", _memory_creep,
         "reserved GPU memory (RSS on a CPU run) above R x its level after warm-up", "memory_creep_ratio",
         "RATIO", ("memory", "mem")),
    Rule("throughput-drop", _throughput_drop,
         "tokens/s below R x the run's median for throughput_window_s seconds", "throughput_drop_ratio",
         "RATIO", ("throughput",)),
    Rule("fetch-stall", _fetch_stall, "data fetch p95 above MS", "fetch_stall_ms", "MS", ("fetch",)),
    Rule("data-fallback", _data_fallback, "the run trains on synthetic tokens because its data source failed",
         aliases=("data", "synthetic"), after_end=True),
    Rule("fallback-rise", _fallback_rise, "backend fallback counters rose over the last 3 points",
         aliases=("fallback", "fallbacks")),
    Rule("gpu-errors", _gpu_errors, "a rank's GPU memory errors (uncorrected ECC, retired pages) rose",
         aliases=("ecc", "xid", "gpu")),
)}
ALIASES: dict[str, str] = {alias: r.name for r in RULES.values() for alias in r.aliases}


def synopsis() -> str:
    """Every rule as a spec names it (``crashed, stale=SECONDS, ...; all; none``): ``nsa watch``'s help."""
    return ", ".join(r.synopsis() for r in RULES.values()) + "; all; none"


def canonical(name: str) -> str:
    """A rule's name from itself or an alias (``crash`` -> ``crashed``), as given otherwise."""
    key = name.strip().lower()
    return ALIASES.get(key, key)


# ------------------------------------------------------------------------------------------- actions


@dataclass
class Alarm:
    """One firing of a rule, from the refresh it appeared on until it cleared."""

    rule: str
    message: str
    evidence: dict[str, Any]
    since: float
    cleared: float | None = None

    def payload(self, run: str, host: str | None = None) -> dict[str, Any]:
        """What ``notify`` sends: ``{"run", "rule", "message", "evidence", "time", "host"}``."""
        return {"run": run, "rule": self.rule, "message": self.message, "evidence": self.evidence,
                "time": self.since, "host": host or socket.gethostname()}


class AlarmLog:
    """De-duplicates hits across refreshes: a rule that keeps firing is one alarm until it clears."""

    def __init__(self) -> None:
        self.active: dict[str, Alarm] = {}
        self.history: list[Alarm] = []  # every alarm of this watch, oldest first

    def update(self, hits: list[RuleHit], now: float) -> tuple[list[Alarm], list[Alarm]]:
        """``(new, cleared)`` alarms after this refresh's hits; a firing alarm's message follows the hit."""
        firing = {h.rule: h for h in hits}
        cleared = [a for name, a in self.active.items() if name not in firing]
        for a in cleared:
            a.cleared = now
            del self.active[a.rule]
        new: list[Alarm] = []
        for name, h in firing.items():
            if name in self.active:
                self.active[name].message, self.active[name].evidence = h.message, h.evidence
                continue
            a = Alarm(h.rule, h.message, h.evidence, now)
            self.active[name] = a
            self.history.append(a)
            new.append(a)
        return new, cleared


def notify(command: str, payload: dict[str, Any], timeout_s: float = 10.0) -> str | None:
    """Run ``command`` through the shell with ``payload`` as one JSON line on stdin; None when it exited 0,
    else why not (non-zero exit with its stderr's last line, timeout, cannot start). Never raises; on a
    timeout the command's whole process group is killed."""
    data = json.dumps(json_safe(payload), default=str) + "\n"
    try:
        proc = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except (OSError, ValueError) as exc:
        return f"could not run it ({exc})"
    try:
        _, err = proc.communicate(data, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"timed out after {timeout_s:g} s"
    except OSError as exc:  # e.g. the command exited without reading stdin (broken pipe)
        proc.wait()
        if proc.returncode == 0:
            return None
        return f"exit status {proc.returncode} ({exc})"
    if proc.returncode != 0:
        tail = (err or "").strip().splitlines()
        return f"exit status {proc.returncode}" + (f": {tail[-1][:200]}" if tail else "")
    return None


def now_iso(t: float | None = None) -> str:
    """Local time as ``YYYY-mm-ddTHH:MM:SS`` (the watch's line log)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() if t is None else t))
