"""Saved quality sweeps: a ``nsa bench quality`` JSON read back, and several merged into one.

A sweep spread over several calls or machines (one learning rate here, two more seeds there) is one sweep
again when the runs share the base config, the overrides other than the learning rate, the steps and the
task: :func:`merge_sweeps` checks that, joins arms, seeds, rates and rows, and refuses a run found twice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nsa.bench.quality import Arm, QualityRow, QualitySpec, quality_payload
from nsa.errors import ConfigError

# the one override a merged sweep may differ in (each run's rate is in its arm name)
_LR_SET = "optimizer.lr="


def partial_header(spec: QualitySpec, environment: dict[str, Any]) -> dict[str, Any]:
    """The first line of a sweep's ``<json-out>.rows.jsonl`` (a row per finished run follows): the sweep as
    its JSON would give it, without rows, so that a sweep cut short reads back (:func:`read_sweep`)."""
    return {"sweep": quality_payload(spec, [], environment)}


def _payload(path: Path) -> Any:
    """A ``--json-out`` file's object, or that of a ``.rows.jsonl`` one: its header's sweep with the rows
    after it."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not lines or not isinstance(lines[0], dict) or not isinstance(lines[0].get("sweep"), dict):
            raise
        return {**lines[0]["sweep"], "rows": lines[1:]}


def read_sweep(path: Path) -> tuple[QualitySpec, list[QualityRow], dict[str, Any]]:
    """The spec, rows and environment of one saved ``nsa bench quality --json-out`` file, or of the
    ``.rows.jsonl`` beside it (a sweep cut short: the runs that finished)."""
    try:
        payload = _payload(Path(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file",
                          hint="give the --json-out file of a bench quality run") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable as JSON ({type(exc).__name__})",
                          hint="give the --json-out file of a bench quality run (or its "
                               ".rows.jsonl)") from None
    if not isinstance(payload, dict) or payload.get("command") != "bench quality" or "rows" not in payload:
        raise ConfigError(f"{path} is not the JSON of nsa bench quality", hint="give its --json-out file")
    try:
        arms = [Arm(a["name"], tuple(a["sets"]), _warm(a), tuple(a.get("warm_sets", [])))
                for a in payload["arms"]]
        timed = payload.get("equal_time") or {}
        spec = QualitySpec(payload["config"], list(payload["sets"]), arms, [int(s) for s in payload["seeds"]],
                           int(payload["steps"]), Path(path).parent, task=payload.get("task", "text"),
                           lrs=[float(x) for x in payload.get("lrs") or []],
                           budget=payload.get("budget", "tokens"), time_reference=timed.get("reference"),
                           step_ms={str(k): float(v) for k, v in (timed.get("step_ms") or {}).items()},
                           probe_steps=int(timed.get("probe_steps") or 10))
        rows = [QualityRow.from_dict(r) for r in payload["rows"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: a bench quality JSON with a missing or malformed field ({exc})",
                          hint="give the --json-out file of a bench quality run, as written") from None
    env = payload.get("environment")
    return spec, rows, env if isinstance(env, dict) else {}


def _warm(arm: dict[str, Any]) -> tuple[tuple[float, int], ...]:
    """An arm's warm phases as saved: ``warm`` pairs, or one phase as ``warm_frac``/``warm_len_div`` (before
    2026-11-26)."""
    if "warm" in arm:
        return tuple((float(f), int(d)) for f, d in arm["warm"])
    frac = float(arm.get("warm_frac") or 0.0)
    return ((frac, int(arm.get("warm_len_div") or 1)),) if frac > 0 else ()


def _same_base(sets: list[str]) -> list[str]:
    return [s for s in sets if not s.startswith(_LR_SET)]


def merge_sweeps(paths: Sequence[Path]) -> tuple[QualitySpec, list[QualityRow], dict[str, Any]]:
    """One sweep from several saved ones: the first file's spec with every file's arms, seeds, rates and
    rows, and ``{"environment": the first file's, "merged_from": [{"path", "runs"}]}``. ``ConfigError``
    naming the file and the difference when they are not runs of one sweep."""
    if not paths:
        raise ConfigError("no saved sweep given", hint="e.g. --from a.json --from b.json")
    saved = [(Path(p), *read_sweep(Path(p))) for p in paths]
    first, spec, _, environment = saved[0]
    if len({bool(s.lrs) for _, s, _, _ in saved}) > 1:
        raise ConfigError("a sweep over learning rates cannot be merged with runs at the config's rate",
                          hint="merge only --lrs sweeps, or only runs without --lrs")
    arms: dict[str, Arm] = {}
    seen: dict[tuple[str, int, str], Path] = {}
    seeds: list[int] = []
    lrs: list[float] = []
    rows: list[QualityRow] = []
    for path, other, more, _ in saved:
        mine_sets, their_sets = _same_base(spec.sets), _same_base(other.sets)
        for what, mine, theirs in (("config", spec.config, other.config), ("steps", spec.steps, other.steps),
                                   ("task", spec.task, other.task), ("sets", mine_sets, their_sets),
                                   ("budget", spec.budget, other.budget)):
            if mine != theirs:
                diff = (", ".join(sorted(set(mine_sets) ^ set(their_sets))) if what == "sets"
                        else f"{mine} vs {theirs}")
                raise ConfigError(f"{path} is not a run of the sweep in {first}: its {what} differ ({diff})",
                                  hint="merge only runs of the same base config, steps and task")
        for arm in other.arms:
            if arms.setdefault(arm.name, arm) != arm:
                raise ConfigError(f"{path}: arm {arm.name} differs from the one of the same name before it",
                                  hint="give the arms different names")
        for r in more:
            if (r.arm, r.seed, r.budget) in seen:
                raise ConfigError(f"{path}: {r.arm} seed {r.seed} is also in "
                                  f"{seen[(r.arm, r.seed, r.budget)]}", hint="merge each run once")
            seen[(r.arm, r.seed, r.budget)] = path
            rows.append(r)
        seeds += [s for s in other.seeds if s not in seeds]
        lrs += [x for x in other.lrs if x not in lrs]
    step_ms: dict[str, float] = {}  # each arm's step as the first file that probed it says
    for _, s, _, _ in reversed(saved):
        step_ms.update(s.step_ms)
    merged = QualitySpec(spec.config, _same_base(spec.sets) if lrs else spec.sets, list(arms.values()), seeds,
                         spec.steps, spec.out_dir, task=spec.task, lrs=sorted(lrs), budget=spec.budget,
                         time_reference=spec.time_reference, step_ms=step_ms, probe_steps=spec.probe_steps)
    return merged, rows, {"environment": environment,
                          "merged_from": [{"path": str(p), "runs": len(r)} for p, _, r, _ in saved]}


__all__ = ["merge_sweeps", "partial_header", "read_sweep"]
