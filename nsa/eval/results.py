"""The evaluation payload (JSON) and where it is saved: ``RUN/eval/<task>.json`` (+ ``needle.png``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nsa.envinfo import environment
from nsa.errors import RunDirError
from nsa.fileio import json_safe, write_atomic, write_failure
from nsa.rundir import RunDir
from nsa.rundir.checkpoints import weights_identity
from nsa.rundir.layout import CHECKPOINTS_DIR, EXPORT_DIR, is_run_dir
from nsa.rundir.records import EVAL_SCHEMA


def run_dir_of(path: str | Path) -> Path:
    """The run directory a model path belongs to: the folder holding ``checkpoints/`` for a checkpoint,
    the run for its ``export/`` folder, else the folder given (or holding the file given)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    if folder.name == EXPORT_DIR and (is_run_dir(folder.parent)
                                      or RunDir(folder.parent).checkpoints.is_dir()):
        return folder.parent
    if folder.parent.name == CHECKPOINTS_DIR:
        return folder.parent.parent
    return folder


def build_payload(task: str, rows: list[dict[str, Any]], *, run: str | Path | None,
                  checkpoint: str | Path | None, settings: dict[str, Any],
                  env: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"task", "run", "checkpoint", "step", "weights", "results", "settings", "env"}``: ``step`` and
    ``weights`` (the file's SHA-256) say which weights were evaluated, so a report can tell an evaluation of
    an earlier step (stale) from one of the model as it is (``env`` defaults to
    :func:`nsa.envinfo.environment`); non-finite numbers become null."""
    if env is None:
        env = environment()
    step, digest = weights_identity(Path(checkpoint)) if checkpoint is not None else (None, None)
    payload = {"schema": EVAL_SCHEMA, "task": task, "run": None if run is None else str(run),
               "checkpoint": None if checkpoint is None else str(checkpoint), "step": step,
               "weights": {"path": None if checkpoint is None else str(checkpoint), "sha256": digest},
               "results": rows, "settings": settings, "env": env}
    return dict(json_safe(payload))


def to_json(payload: dict[str, Any]) -> str:
    """The payload as indented JSON text (ends with a newline)."""
    return json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n"


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write the payload to ``path`` atomically (temporary file + rename); parents are created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = to_json(payload)
    write_atomic(p, lambda tmp: tmp.write_text(text))
    return p


def context_label(context: int) -> str:
    """``4096 -> "4K"``, ``100 -> "100"``."""
    return f"{context // 1024}K" if context >= 1024 and context % 1024 == 0 else str(context)


def needle_heatmap(payload: dict[str, Any], path: str | Path) -> Path:
    """The needle results as a heat map (x = context, y = depth, colour = accuracy, cells annotated),
    written atomically as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    contexts = sorted({int(r["context"]) for r in rows})
    depths = sorted({float(r["depth"]) for r in rows})
    acc = {(int(r["context"]), float(r["depth"])): r["accuracy"] for r in rows}
    grid = [[acc.get((c, d)) for c in contexts] for d in depths]
    values = [[float("nan") if v is None else float(v) for v in line] for line in grid]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(contexts) + 2.5), max(3.0, 0.55 * len(depths) + 1.8)),
                           dpi=100)
    try:
        im = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                dark = v is not None and not 0.2 <= v <= 0.8  # the colour map's dark ends
                ax.text(j, i, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=9,
                        color="white" if dark else "black")
        ax.set_xticks(range(len(contexts)), [context_label(c) for c in contexts])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (0 = first token)")
        name = Path(str(payload.get("run") or "model")).name
        ax.set_title(f"needle retrieval: {name}")
        fig.colorbar(im, ax=ax, label="accuracy")
        fig.tight_layout()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return p


def save_results(run_dir: str | Path | None, payload: dict[str, Any]) -> list[Path]:
    """Write ``run_dir/eval/<task>.json`` (and ``needle.png`` for the needle task), atomically; returns
    the paths (none when ``run_dir`` is None). A folder that cannot be written raises ``RunDirError``."""
    if run_dir is None:
        return []
    files = RunDir(run_dir)
    folder = files.eval
    try:
        paths = [write_json(files.eval_result(payload["task"]), payload)]
        if payload["task"] == "needle":
            paths.append(needle_heatmap(payload, files.needle_png))
    except OSError as exc:  # the files written before stay whole (atomic writes)
        raise RunDirError(write_failure(exc, folder).replace("cannot write ", "cannot write the results to ",
                                                             1),
                          hint="free disk space or make the run directory writable; --json-out PATH keeps "
                               "them elsewhere") from None
    return paths
