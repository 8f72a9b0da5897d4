"""The report's PNG charts (matplotlib, Agg backend), one function per chart.

Each chart returns a :class:`Chart` record naming its file and what it drew (points per series, vertical
markers per kind, panels), so the report and its tests can see the figure's content without reading the
image. Charts without any data are skipped, except loss and tokens/s, which say "no data yet".

Size: one chart builder per report figure, kept together so they share axes, styles and the data-free checks.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nsa.fileio import write_atomic

WIDTH, PANEL_H = 8.0, 2.6
SCALE_RATIO = 3.0  # tokens/s of several runs: one panel per run when their medians differ more than this
BRANCHES = ("cmp", "sel", "win")


@dataclass
class RunSeries:
    """What the charts of one run draw (taken from its run directory by the report)."""

    name: str
    points: Sequence[Mapping[str, Any]]  # per-step rows: training.csv, else rank-0 progress events
    progress: Sequence[Mapping[str, Any]]  # rank-0 heartbeat progress events (memory, gates, fetch)
    val: list[tuple[float, float]] = field(default_factory=list)  # (step, validation loss)
    checkpoints: list[float] = field(default_factory=list)  # steps
    halts: list[float] = field(default_factory=list)
    resumes: list[float] = field(default_factory=list)
    limits: dict[str, float | None] = field(default_factory=dict)  # monitor.* limits drawn as lines


@dataclass
class Chart:
    """One written PNG and what it shows."""

    name: str
    title: str
    path: Path
    series: dict[str, int] = field(default_factory=dict)  # label -> points drawn
    markers: dict[str, int] = field(default_factory=dict)  # vertical marker kind -> lines drawn
    panels: int = 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        return out


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def xy(rows: Sequence[Mapping[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    """Steps and finite values of ``key`` (times ``scale``), in row order."""
    xs: list[float] = []
    ys: list[float] = []
    for r in rows:
        x, y = _num(r.get("step")), _num(r.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y * scale)
    return xs, ys


def rolling_median(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling median (the window shrinks at the ends)."""
    half = max(0, window // 2)
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def median_window(n: int) -> int:
    """Odd window of about a tenth of the points, 1 to 51."""
    w = max(1, min(51, n // 10))
    return w if w % 2 else w + 1


def save_figure(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` as PNG, atomically, and close it."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.tight_layout()
        write_atomic(path, functools.partial(fig.savefig, format="png"))
    finally:
        plt.close(fig)


def finish_axis(ax: Any, ylabel: str, *, legend: bool = True) -> None:
    """The y label, a light grid and a small legend (when anything is labelled)."""
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if legend and handles:
        ax.legend(fontsize=7, loc="best", framealpha=0.85)


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)


def _limit_line(ax: Any, value: float | None, text: str) -> int:
    if value is None:
        return 0
    ax.axhline(value, color="tab:red", linestyle="--", linewidth=1.0, alpha=0.8, label=f"{text} {value:g}")
    return 1


def _vlines(ax: Any, steps: Sequence[float], label: str, **style: Any) -> int:
    for i, s in enumerate(sorted(set(steps))):
        ax.axvline(s, label=label if i == 0 else None, **style)
    return len(set(steps))


def _log_if_wide(ax: Any, values: Sequence[float], ratio: float = 50.0) -> None:
    pos = [v for v in values if v > 0]
    if pos and len(pos) == len(values) and max(pos) / min(pos) > ratio:
        ax.set_yscale("log")


# ------------------------------------------------------------------------------------------- one run


def loss_chart(run: RunSeries, path: Path) -> Chart:
    """Training loss, validation points, and vertical markers for checkpoints, halts and resumes."""
    plt = pyplot()
    chart = Chart("loss", f"loss - {run.name}", path)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4), dpi=100)
    xs, ys = xy(run.points, "loss")
    if xs:
        ax.plot(xs, ys, color="tab:blue", linewidth=1.2, label="training loss")
        chart.series["training loss"] = len(xs)
    if run.val:
        ax.plot([s for s, _ in run.val], [v for _, v in run.val], linestyle="none", marker="o", markersize=5,
                color="tab:orange", markeredgecolor="black", markeredgewidth=0.5, label="validation loss",
                zorder=3)
        chart.series["validation loss"] = len(run.val)
    marks = {
        "checkpoint": _vlines(ax, run.checkpoints, "checkpoint", color="0.45", linestyle=":", linewidth=0.9),
        # a resume usually sits on the step of the halt before it: the halt drawn wide, the resume dashed on
        # top
        "halt": _vlines(ax, run.halts, "halt", color="tab:red", linestyle="-", linewidth=2.6, alpha=0.55),
        "resume": _vlines(ax, run.resumes, "resume", color="tab:green", linestyle="--", linewidth=1.3),
    }
    chart.markers = {k: n for k, n in marks.items() if n}
    if not xs and not run.val:
        _no_data(ax)
    ax.set_title(chart.title)
    ax.set_xlabel("step")
    finish_axis(ax, "loss (nats/token)")
    save_figure(fig, path)
    return chart


def _tps_panel(ax: Any, run: RunSeries, color: str | None, label_prefix: str, chart: Chart,
               floor: bool) -> float | None:
    """Raw tokens/s (faint) and its rolling median on ``ax``; returns the median of the run."""
    xs, ys = xy(run.points, "tokens_per_s")
    if not xs:
        return None
    w = median_window(len(ys))
    med = rolling_median(ys, w)
    raw = ax.plot(xs, ys, linewidth=0.7, alpha=0.3, color=color)[0]
    ax.plot(xs, med, linewidth=1.8, color=raw.get_color(), label=f"{label_prefix}rolling median ({w} points)")
    chart.series[f"{label_prefix}tokens/s"] = len(xs)
    chart.series[f"{label_prefix}rolling median"] = len(med)
    if floor:
        _limit_line(ax, run.limits.get("min_tokens_per_s"), "floor")
    top = max(max(med), sorted(ys)[int(0.98 * (len(ys) - 1))])
    lim = run.limits.get("min_tokens_per_s") if floor else None
    ax.set_ylim(0, 1.15 * max(top, lim or 0.0))
    return statistics.median(ys)


def tokens_chart(run: RunSeries, path: Path) -> Chart:
    """Tokens/s: the raw points faintly, their rolling median, and the throughput floor when set."""
    plt = pyplot()
    chart = Chart("tokens_per_s", f"tokens/s - {run.name}", path)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2), dpi=100)
    if _tps_panel(ax, run, "tab:blue", "", chart, floor=True) is None:
        _no_data(ax)
    ax.set_title(chart.title + " (raw faint, rolling median bold)")
    ax.set_xlabel("step")
    finish_axis(ax, "tokens/s")
    save_figure(fig, path)
    return chart


def memory_chart(run: RunSeries, path: Path) -> Chart | None:
    """GPU allocator counters (allocated, reserved, peak) and host RSS in GiB, with the ceiling."""
    plt = pyplot()
    chart = Chart("memory", f"memory - {run.name}", path)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2), dpi=100)
    top = 0.0
    for key, label, color, style in (("mem_allocated_mib", "GPU allocated", "tab:blue", "-"),
                                     ("mem_reserved_mib", "GPU reserved", "tab:orange", "-"),
                                     ("mem_peak_mib", "GPU peak (allocator)", "tab:purple", "-."),
                                     ("rss_mib", "host RSS", "tab:gray", "-")):
        xs, ys = xy(run.progress, key, 1 / 1024)
        if xs:
            ax.plot(xs, ys, color=color, linestyle=style, linewidth=1.5, label=label)
            chart.series[label] = len(xs)
            top = max(top, *ys)
    if not chart.series:
        plt.close(fig)
        return None
    gpu = any(k.startswith("GPU") for k in chart.series)
    ceiling = run.limits.get("max_memory_gib") if gpu else None  # a GPU ceiling says nothing about host RSS
    _limit_line(ax, ceiling, "GPU ceiling (GiB)")
    ax.set_ylim(0, 1.15 * max(top, ceiling or 0.0) or 1.0)
    ax.set_title(chart.title + ("" if gpu else " (no GPU counters: host RSS only)"))
    ax.set_xlabel("step")
    finish_axis(ax, "GiB")
    save_figure(fig, path)
    return chart


def gpu_chart(run: RunSeries, path: Path) -> Chart | None:
    """GPU utilisation (%) and GPU memory used (GiB, every process: NVML) over the steps, what ``nvidia-smi
    dmon`` shows; None without NVML figures (a CPU run)."""
    util_x, util_y = xy(run.progress, "gpu_util_pct")
    mem_x, mem_y = xy(run.progress, "gpu_mem_used_mib", 1 / 1024)
    if not util_x and not mem_x:
        return None
    plt = pyplot()
    chart = Chart("gpu", f"GPU utilisation and memory - {run.name}", path)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2), dpi=100)
    if util_x:
        ax.plot(util_x, util_y, color="tab:green", linewidth=1.5, label="utilisation (%)")
        chart.series["utilisation (%)"] = len(util_x)
    ax.set_ylim(0, 105)
    ax.set_xlabel("step")
    ax.set_ylabel("%")
    if mem_x:
        ax2 = ax.twinx()
        ax2.plot(mem_x, mem_y, color="tab:orange", linewidth=1.5, label="memory used (GiB)")
        ax2.set_ylim(0, 1.15 * max(mem_y) or 1.0)
        ax2.set_ylabel("GiB")
        chart.series["memory used (GiB)"] = len(mem_x)
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [x.get_label() for x in lines], loc="best", fontsize=8)
    elif util_x:
        ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(chart.title)
    save_figure(fig, path)
    return chart


def gates_chart(run: RunSeries, path: Path) -> Chart | None:
    """Gate entropy (with its minimum), collapsed-gate fraction (with its maximum) and branch shares."""
    ent = xy(run.progress, "gate_entropy_mean")
    col = xy(run.progress, "gate_collapse_fraction")
    shares: list[tuple[list[float], list[float]]] = [([], []) for _ in BRANCHES]
    for p in run.progress:
        s, v = _num(p.get("step")), p.get("gate_branch_shares")
        if s is None or not isinstance(v, list) or len(v) != len(BRANCHES):
            continue
        vals = [_num(x) for x in v]
        if all(x is not None for x in vals):
            for i, x in enumerate(vals):
                shares[i][0].append(s)
                shares[i][1].append(float(x or 0.0))
    if not ent[0] and not col[0] and not shares[0][0]:
        return None
    plt = pyplot()
    chart = Chart("gates", f"gates - {run.name}", path, panels=3)
    fig, axes = plt.subplots(3, 1, figsize=(WIDTH, 3 * PANEL_H), dpi=100, sharex=True)
    if ent[0]:
        axes[0].plot(*ent, color="tab:purple", linewidth=1.3, label="mean gate entropy")
        chart.series["gate entropy"] = len(ent[0])
    ent_min = run.limits.get("gate_entropy_min")
    _limit_line(axes[0], ent_min, "minimum")
    axes[0].set_ylim(0, 1.15 * max([*ent[1], ent_min or 0.0, 0.1]))
    finish_axis(axes[0], "entropy (nats)")
    axes[0].set_title(chart.title)
    if col[0]:
        axes[1].plot(*col, color="tab:brown", linewidth=1.3, label="collapsed-gate fraction")
        chart.series["collapse fraction"] = len(col[0])
    _limit_line(axes[1], run.limits.get("gate_collapse_max"), "maximum")
    axes[1].set_ylim(-0.02, 1.02)
    finish_axis(axes[1], "fraction")
    for name, (xs, ys) in zip(BRANCHES, shares, strict=True):
        if xs:
            axes[2].plot(xs, ys, linewidth=1.3, label=f"{name} share")
            chart.series[f"{name} share"] = len(xs)
    axes[2].set_ylim(0, 1.02)  # shares sum to 1
    axes[2].set_xlabel("step")
    finish_axis(axes[2], "branch share")
    save_figure(fig, path)
    return chart


def fetch_chart(run: RunSeries, path: Path) -> Chart | None:
    """Data fetch latency p50/p95 (heartbeat windows; training.csv's per-step fetch otherwise), with the
    ceiling."""
    plt = pyplot()
    chart = Chart("fetch", f"data fetch latency - {run.name}", path)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2), dpi=100)
    values: list[float] = []
    for key, label in (("fetch_p50_ms", "p50"), ("fetch_p95_ms", "p95")):
        xs, ys = xy(run.progress, key)
        if xs:
            ax.plot(xs, ys, linewidth=1.3, label=label)
            chart.series[label] = len(xs)
            values += ys
    if not chart.series:
        xs, ys = xy(run.points, "fetch_ms")
        if xs:
            ax.plot(xs, ys, linewidth=1.0, label="per step (training.csv)")
            chart.series["per step"] = len(xs)
            values += ys
    if not chart.series:
        plt.close(fig)
        return None
    _limit_line(ax, run.limits.get("max_fetch_p95_ms"), "p95 ceiling (ms)")
    ceiling = run.limits.get("max_fetch_p95_ms")
    _log_if_wide(ax, values + ([ceiling] if ceiling else []))
    ax.set_title(chart.title)
    ax.set_xlabel("step")
    finish_axis(ax, "ms")
    save_figure(fig, path)
    return chart


def lr_grad_chart(run: RunSeries, path: Path) -> Chart | None:
    """Learning rate and global gradient norm (before clipping), one panel each."""
    lr, gn = xy(run.points, "lr"), xy(run.points, "grad_norm")
    if not lr[0] and not gn[0]:
        return None
    plt = pyplot()
    chart = Chart("lr_grad", f"learning rate and gradient norm - {run.name}", path, panels=2)
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 2 * PANEL_H + 0.4), dpi=100, sharex=True)
    if lr[0]:
        axes[0].plot(*lr, color="tab:green", linewidth=1.3, label="learning rate")
        chart.series["learning rate"] = len(lr[0])
        axes[0].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes[0].set_title(chart.title)
    finish_axis(axes[0], "lr", legend=False)
    if gn[0]:
        axes[1].plot(*gn, color="tab:red", linewidth=1.0, label="gradient norm")
        chart.series["gradient norm"] = len(gn[0])
        _log_if_wide(axes[1], gn[1], 20.0)
    axes[1].set_xlabel("step")
    finish_axis(axes[1], "grad norm", legend=False)
    save_figure(fig, path)
    return chart


RUN_CHARTS: tuple[tuple[str, Callable[[RunSeries, Path], Chart | None]], ...] = (
    ("loss.png", loss_chart),
    ("tokens_per_s.png", tokens_chart),
    ("memory.png", memory_chart),
    ("gpu.png", gpu_chart),
    ("gates.png", gates_chart),
    ("fetch.png", fetch_chart),
    ("lr_grad.png", lr_grad_chart),
)


def run_charts(run: RunSeries, folder: Path) -> list[Chart]:
    """Every chart of one run that has data (loss and tokens/s always) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for fname, draw in RUN_CHARTS:
        chart = draw(run, folder / fname)
        if chart is not None:
            out.append(chart)
    return out


# ------------------------------------------------------------------------------------------ several runs


def combined_loss_chart(runs: Sequence[RunSeries], path: Path) -> Chart:
    """Training loss of every run (one colour each) with its validation points."""
    plt = pyplot()
    chart = Chart("loss", "loss - all runs", path)
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6), dpi=100)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        xs, ys = xy(run.points, "loss")
        if xs:
            ax.plot(xs, ys, color=color, linewidth=1.2, label=f"{run.name}")
            chart.series[f"{run.name} training loss"] = len(xs)
        if run.val:
            ax.plot([s for s, _ in run.val], [v for _, v in run.val], linestyle="none", marker="o",
                    markersize=5, color=color, markeredgecolor="black", markeredgewidth=0.5,
                    label=f"{run.name} validation", zorder=3)
            chart.series[f"{run.name} validation loss"] = len(run.val)
    if not chart.series:
        _no_data(ax)
    ax.set_title(chart.title + " (lines: training, dots: validation)")
    ax.set_xlabel("step")
    finish_axis(ax, "loss (nats/token)")
    save_figure(fig, path)
    return chart


def tokens_medians(runs: Sequence[RunSeries]) -> list[float | None]:
    meds: list[float | None] = []
    for run in runs:
        ys = xy(run.points, "tokens_per_s")[1]
        meds.append(statistics.median(ys) if ys else None)
    return meds


def split_panels(runs: Sequence[RunSeries]) -> bool:
    """Whether the runs' median tokens/s differ by more than :data:`SCALE_RATIO` (then one panel each)."""
    meds = [m for m in tokens_medians(runs) if m is not None and m > 0]
    return len(meds) > 1 and max(meds) / min(meds) > SCALE_RATIO


def combined_tokens_chart(runs: Sequence[RunSeries], path: Path) -> Chart:
    """Tokens/s rolling medians of every run: overlaid, or one panel per run when their scales differ > 3x."""
    plt = pyplot()
    chart = Chart("tokens_per_s", "tokens/s - all runs", path)
    if split_panels(runs):
        chart.panels = len(runs)
        fig, axes = plt.subplots(len(runs), 1, figsize=(WIDTH, 1.0 + 2.0 * len(runs)), dpi=100, sharex=True)
        for i, (ax, run) in enumerate(zip(axes, runs, strict=True)):
            if _tps_panel(ax, run, f"C{i % 10}", f"{run.name} ", chart, floor=True) is None:
                _no_data(ax)
            ax.set_title(f"{run.name}", fontsize=9, loc="left")
            finish_axis(ax, "tokens/s")
        fig.suptitle(chart.title + " (one panel per run: scales differ > 3x; raw faint, rolling median bold)",
                     fontsize=10)
        axes[-1].set_xlabel("step")
    else:
        fig, ax = plt.subplots(figsize=(WIDTH, 3.4), dpi=100)
        tops = []
        for i, run in enumerate(runs):
            if _tps_panel(ax, run, f"C{i % 10}", f"{run.name} ", chart, floor=False) is not None:
                tops.append(ax.get_ylim()[1])
        if tops:
            ax.set_ylim(0, max(tops))
        else:
            _no_data(ax)
        ax.set_title(chart.title + " (raw faint, rolling median bold)")
        ax.set_xlabel("step")
        finish_axis(ax, "tokens/s")
    save_figure(fig, path)
    return chart


def combined_charts(runs: Sequence[RunSeries], folder: Path) -> list[Chart]:
    """The comparison charts of several runs: loss and tokens/s."""
    folder.mkdir(parents=True, exist_ok=True)
    return [combined_loss_chart(runs, folder / "loss.png"),
            combined_tokens_chart(runs, folder / "tokens_per_s.png")]
