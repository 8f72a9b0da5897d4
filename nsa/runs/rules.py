"""Watch rules: conditions on a live run that raise an alarm and, as a watchdog, write ``.HALT``.

Spec syntax (``nsa watch --halt-on``): comma-separated ``name`` or ``name=threshold``; ``all`` means
every rule with its default threshold. Rules:

- ``stale=SECONDS``: a rank's heartbeat is older than this (default 300) and the run has not ended;
- ``nonfinite``: a non-finite loss in the log or an ``anomaly`` event;
- ``gate-collapse=FRACTION``: the collapsed-gate fraction is at least this (default 0.5) for the last
  3 progress points;
- ``throughput-drop=RATIO``: median tokens/s of the last 5 points below RATIO (default 0.5) times the
  median of the earlier points (after the first fifth);
- ``fetch-stall=MS``: data fetch p95 above this (default 2000 ms).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from nsa.errors import ConfigError
from nsa.runs.reader import RunState
from nsa.runs.summary import finite

DEFAULTS: dict[str, float | None] = {
    "stale": 300.0,
    "nonfinite": None,
    "gate-collapse": 0.5,
    "throughput-drop": 0.5,
    "fetch-stall": 2000.0,
}
ALIASES = {"nan": "nonfinite", "non-finite": "nonfinite", "collapse": "gate-collapse",
           "throughput": "throughput-drop", "fetch": "fetch-stall", "heartbeat": "stale"}


@dataclass
class Rule:
    name: str
    threshold: float | None = None

    def describe(self) -> str:
        return self.name if self.threshold is None else f"{self.name}={self.threshold:g}"


@dataclass
class RuleHit:
    rule: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_rules(spec: str | None) -> list[Rule]:
    """``"stale=120,nonfinite"`` -> rules; ``"all"`` -> every rule; ``ConfigError`` on a bad spec."""
    if spec is None or not spec.strip():
        return []
    rules: dict[str, Rule] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, value = part.partition("=")
        name = ALIASES.get(name.strip().lower(), name.strip().lower())
        if name in ("all", "default", "defaults"):
            for n, t in DEFAULTS.items():
                rules.setdefault(n, Rule(n, t))
            continue
        if name not in DEFAULTS:
            raise ConfigError(f"unknown watch rule '{name}'", hint=f"rules: {', '.join(DEFAULTS)} (or all)")
        threshold = DEFAULTS[name]
        if value.strip():
            if threshold is None:
                raise ConfigError(f"watch rule '{name}' takes no threshold", hint=f"write just {name}")
            try:
                threshold = float(value.rstrip("s").rstrip("m"))
            except ValueError:
                raise ConfigError(f"watch rule '{part}': threshold must be a number",
                                  hint=f"e.g. {name}={DEFAULTS[name]:g}") from None
            if not math.isfinite(threshold) or threshold <= 0:
                raise ConfigError(f"watch rule '{part}': threshold must be positive")
        rules[name] = Rule(name, threshold)
    return list(rules.values())


def default_rules() -> list[Rule]:
    return [Rule(n, t) for n, t in DEFAULTS.items()]


def _progress_values(state: RunState, key: str) -> list[float]:
    return [float(p[key]) for p in state.progress if finite(p.get(key))]


def evaluate(rules: list[Rule], state: RunState, now: float) -> list[RuleHit]:
    """The rules that fire on this state (none once the run has ended)."""
    ended = state.end is not None
    hits: list[RuleHit] = []
    for rule in rules:
        hit = None if ended and rule.name != "nonfinite" else _RULES[rule.name](rule, state, now)
        if hit is not None:
            hits.append(hit)
    return hits


def _stale(rule: Rule, state: RunState, now: float) -> RuleHit | None:
    ages = state.heartbeat_age(now)
    limit = rule.threshold or 300.0
    old = {r: a for r, a in ages.items() if a > limit and state.ranks[r].end is None}
    if not old:
        return None
    rank, age = max(old.items(), key=lambda kv: kv[1])
    last = state.ranks[rank].last or {}
    return RuleHit("stale", f"rank {rank} heartbeat is {age:.0f} s old (> {limit:g} s) at step {last.get('step')}",
                   {"rank": rank, "age_s": round(age, 1), "last_event": last.get("event"), "step": last.get("step")})


def _nonfinite(rule: Rule, state: RunState, now: float) -> RuleHit | None:
    if state.anomalies:
        a = state.anomalies[-1]
        return RuleHit("nonfinite", f"anomaly {a.get('kind')} at step {a.get('step')} (value {a.get('value')})",
                       {k: a.get(k) for k in ("step", "kind", "value", "record")})
    for p in reversed(state.series()[-50:]):
        if "loss" in p and not finite(p.get("loss")):
            return RuleHit("nonfinite", f"non-finite loss at step {p.get('step')}",
                           {"step": p.get("step"), "loss": str(p.get("loss"))})
    return None


def _gate_collapse(rule: Rule, state: RunState, now: float) -> RuleHit | None:
    vals = _progress_values(state, "gate_collapse_fraction")[-3:]
    limit = rule.threshold or 0.5
    if len(vals) < 3 or min(vals) < limit:
        return None
    last = state.progress[-1]
    return RuleHit("gate-collapse", f"collapsed-gate fraction {vals[-1]:.2f} >= {limit:g} for 3 points",
                   {"step": last.get("step"), "gate_collapse_fraction": vals,
                    "gate_entropy_mean": last.get("gate_entropy_mean"),
                    "gate_branch_shares": last.get("gate_branch_shares")})


def _throughput_drop(rule: Rule, state: RunState, now: float) -> RuleHit | None:
    vals = _progress_values(state, "tokens_per_s")
    if len(vals) < 12:
        return None
    recent = statistics.median(vals[-5:])
    earlier = vals[len(vals) // 5:-5]
    if not earlier:
        return None
    base = statistics.median(earlier)
    ratio = rule.threshold or 0.5
    if base <= 0 or recent >= ratio * base:
        return None
    return RuleHit("throughput-drop", f"tokens/s {recent:.0f} < {ratio:g} x baseline {base:.0f}",
                   {"step": state.progress[-1].get("step"), "recent_tokens_per_s": recent,
                    "baseline_tokens_per_s": base})


def _fetch_stall(rule: Rule, state: RunState, now: float) -> RuleHit | None:
    last = state.last_progress
    if not last or not finite(last.get("fetch_p95_ms")):
        return None
    p95 = float(last["fetch_p95_ms"])
    limit = rule.threshold or 2000.0
    if p95 <= limit:
        return None
    return RuleHit("fetch-stall", f"data fetch p95 {p95:.0f} ms > {limit:g} ms",
                   {"step": last.get("step"), "fetch_p95_ms": p95, "fetch_p50_ms": last.get("fetch_p50_ms")})


_RULES = {
    "stale": _stale,
    "nonfinite": _nonfinite,
    "gate-collapse": _gate_collapse,
    "throughput-drop": _throughput_drop,
    "fetch-stall": _fetch_stall,
}
