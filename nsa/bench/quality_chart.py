"""The curves of a quality benchmark (``nsa bench quality --chart``): each arm's training loss over the
steps and its held-out loss by position in the window, the mean over its seeds (a sweep's arms at their
best learning rate, :func:`nsa.bench.quality.at_best_lr`). Saved results draw the same way:
``nsa bench quality --from F.json --chart PNG``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from nsa.bench.quality import QualityRow, at_best_lr
from nsa.runs.charts import finish_axis, median_window, pyplot, rolling_median, save_figure


def _mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> tuple[list[float], list[float]]:
    """Steps every seed logged and the mean loss there."""
    by_step: dict[float, list[float]] = defaultdict(list)
    for curve in curves:
        for step, loss in curve:
            by_step[float(step)].append(float(loss))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(curves))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def quality_chart(rows: Sequence[QualityRow], path: Path, title: str, gpu_seconds: bool = False) -> list[str]:
    """Write the two panels to ``path`` (PNG); returns the arms drawn (empty: nothing to draw, no file).
    ``gpu_seconds``: the training loss against GPU seconds (steps x each arm's probed step), not steps: the
    x-axis of an equal-time comparison."""
    best, sweep = at_best_lr(list(rows))
    by_arm: dict[str, list[QualityRow]] = defaultdict(list)
    for r in best:
        if r.loss_curve or r.loss_by_position:
            by_arm[f"{r.arm} (lr {sweep[r.arm]['best_lr']:g})" if r.arm in sweep else r.arm].append(r)
    if not by_arm:
        return []
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, arm_rows in by_arm.items():
        n = len(arm_rows)
        steps, loss = _mean_curve([r.loss_curve for r in arm_rows if r.loss_curve])
        per_step = arm_rows[0].step_ms / 1e3 if gpu_seconds and arm_rows[0].step_ms else None
        if per_step is not None:
            steps = [x * per_step for x in steps]
        if steps:
            left.plot(steps, rolling_median(loss, median_window(len(loss))),
                      label=f"{arm} ({n} seed{'s' * (n > 1)})", linewidth=1.2)
        spans: dict[tuple[int, int], list[float]] = defaultdict(list)
        for r in arm_rows:
            for b in r.loss_by_position:
                spans[(int(b["start"]), int(b["end"]))].append(float(b["loss"]))
        if spans:
            keys = sorted(spans)
            right.plot([max(1, (a + b) / 2) for a, b in keys], [sum(spans[k]) / len(spans[k]) for k in keys],
                       marker="o", markersize=3, label=arm, linewidth=1.2)
    left.set_xlabel("GPU seconds (steps x the arm's probed step)" if gpu_seconds else "step")
    finish_axis(left, "training loss (mean over seeds, rolling median)")
    right.set_xscale("log", base=2)
    right.set_xlabel("position in the window (bucket centre)")
    finish_axis(right, "held-out loss (mean over seeds)")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    return list(by_arm)
