"""The curves of a quality benchmark (``nsa bench quality --chart``): each arm's training loss over the
steps and its held-out loss by position in the window, the mean over its seeds (a sweep's arms at their
best learning rate), drawn from the benchmark's JSON result (a saved one too: ``quality_chart(json.load(f), path)``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nsa.runs.charts import median_window, pyplot, rolling_median, save_figure


def _best_rows(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The rows to draw: every row, or in a sweep only those of each arm's best learning rate (renamed to
    the arm)."""
    rows: list[Mapping[str, Any]] = list(payload.get("rows") or [])
    sweep = payload.get("lr_sweep") or {}
    if not sweep:
        return rows
    out: list[Mapping[str, Any]] = []
    for r in rows:
        arm, _, lr = str(r["arm"]).partition("@lr=")
        best = (sweep.get(arm) or {}).get("best_lr")
        if lr and best is not None and abs(float(lr) - float(best)) <= 1e-12 * max(1.0, float(best)):
            out.append({**r, "arm": f"{arm} (lr {float(best):g})"})
    return out


def _mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> tuple[list[float], list[float]]:
    """Steps every seed logged and the mean loss there."""
    by_step: dict[float, list[float]] = defaultdict(list)
    for curve in curves:
        for step, loss in curve:
            by_step[float(step)].append(float(loss))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(curves))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def quality_chart(payload: Mapping[str, Any], path: Path) -> list[str]:
    """Write the two panels to ``path`` (PNG); returns the arms drawn (empty: nothing to draw, no file)."""
    by_arm: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in _best_rows(payload):
        if r.get("loss_curve") or r.get("loss_by_position"):
            by_arm[str(r["arm"])].append(r)
    if not by_arm:
        return []
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, rows in by_arm.items():
        n = len(rows)
        steps, loss = _mean_curve([r["loss_curve"] for r in rows if r.get("loss_curve")])
        if steps:
            left.plot(steps, rolling_median(loss, median_window(len(loss))), label=f"{arm} ({n} seed{'s' * (n > 1)})", linewidth=1.2)
        spans: dict[tuple[int, int], list[float]] = defaultdict(list)
        for r in rows:
            for b in r.get("loss_by_position") or []:
                spans[(int(b["start"]), int(b["end"]))].append(float(b["loss"]))
        if spans:
            keys = sorted(spans)
            right.plot([max(1, (a + b) / 2) for a, b in keys], [sum(spans[k]) / len(spans[k]) for k in keys],
                       marker="o", markersize=3, label=arm, linewidth=1.2)
    left.set_xlabel("step")
    left.set_ylabel("training loss (mean over seeds, rolling median)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set_xscale("log", base=2)
    right.set_xlabel("position in the window (bucket centre)")
    right.set_ylabel("held-out loss (mean over seeds)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    seq = next((s.split("=", 1)[1] for s in payload.get("sets") or [] if s.startswith("train.seq_len=")), None)
    fig.suptitle(f"bench quality: config {payload.get('config')}, {payload.get('steps')} steps"
                 + (f", S={seq}" if seq else ""), fontsize=10)
    save_figure(fig, path)
    return list(by_arm)
