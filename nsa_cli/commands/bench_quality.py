"""``nsa bench quality``: NSA recipes against dense attention on the same data, tokens, model and seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

HELP = {
    "arms": "Comma-separated arms: dense, nsa, nsa-half, nsa-window, nsa-uniform, nsa-scorer, dense-warm, "
            "dense-curriculum, nsa-curriculum (a quarter of the steps on 4x shorter windows first), "
            "dense-ladder, nsa-ladder (a quarter at 16x shorter, a quarter at 4x shorter), "
            "dense-ladder-half, nsa-ladder-half (half at 16x shorter, a quarter at 4x shorter), or "
            "label=key=value;key=value (NSA plus overrides), label=<arm>;key=value (that arm plus "
            "overrides).",
    "lrs": "Comma-separated learning rates: every arm trains at each, and is compared with dense at its best "
           "(e.g. 5e-4,1e-3,2e-3).",
    "task": "text (held-out loss, selection recall), needle (single-needle retrieval) or both.",
    "parallel": "Runs at once, each in a process of its own, dealt over the visible GPUs (more runs than "
                "GPUs share them) or, on CPU, over the cores; the same runs and rows.",
    "tiny": "CPU-sized run (the CI test): config tiny, 40 steps, needle S=128 gap 48, 60 steps.",
    "from": "Train nothing: read these saved --json-out files of one sweep (repeatable: runs of several "
            "calls merged; a sweep cut short: its <json-out>.rows.jsonl) and print, save and chart them as "
            "one; the training options are not used.",
    "against": "Also read every other arm against this one, paired by seed (mean +- sd of the per-seed "
               "differences, and whether they are within noise): any arm, NSA ones included; repeatable; "
               "works with --from.",
    "chart": "Also draw each arm's training loss and held-out loss by position (mean over seeds; a sweep's "
             "arms at their best rate) to this PNG (the equal-time runs' against GPU seconds to "
             "<name>-time.png).",
    "budget": "tokens (every arm --steps), time (every arm the GPU time the reference arm spends on --steps: "
              "each arm's step probed alone on its GPU first, its steps scaled by the reference's step time "
              "over its own) or both (the two sets of runs, read side by side).",
    "time_reference": "The arm whose GPU time every arm gets under --budget time/both [default: the "
                      "slowest].",
}


def quality(
    config: Annotated[str | None, options.config("Base run config of every arm")] = None,
    set_: Annotated[list[str] | None, options.sets("Config override key=value for every arm")] = None,
    arms: Annotated[str, typer.Option("--arms", help=HELP["arms"])] = "dense,nsa",
    seeds: Annotated[str,
                     typer.Option("--seeds",
                                  help="Comma-separated seeds; every arm trains once per seed.")] = "0",
    lrs: Annotated[str | None, typer.Option("--lrs", help=HELP["lrs"])] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="Training steps per arm [default: the "
                                              "config's].")] = None,
    task: Annotated[str, typer.Option("--task", help=HELP["task"])] = "text",
    needle_seq_len: Annotated[int, typer.Option("--needle-seq-len", min=8)] = 2048,
    needle_gap: Annotated[int, typer.Option("--needle-gap", min=1)] = 600,
    needle_steps: Annotated[int, typer.Option("--needle-steps", min=1)] = 5000,
    needle_batch: Annotated[int, typer.Option("--needle-batch", min=1)] = 16,
    queries: Annotated[int, typer.Option("--queries", min=1, help="Query positions per layer for selection "
                                         "recall.")] = 64,
    parallel: Annotated[int, typer.Option("--parallel", min=1, help=HELP["parallel"])] = 1,
    out_dir: Annotated[Path,
                       options.out_dir("Run directories go to OUT_DIR/<arm>/seed<N> (replaced).")] = Path(
        "artifacts/quality"),
    tiny: Annotated[bool, typer.Option("--tiny", help=HELP["tiny"])] = False,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
    saved: Annotated[list[Path] | None, typer.Option("--from", help=HELP["from"])] = None,
    against_: Annotated[list[str] | None, typer.Option("--against", help=HELP["against"])] = None,
    chart: Annotated[Path | None, typer.Option("--chart", help=HELP["chart"])] = None,
    budget: Annotated[str, typer.Option("--budget", help=HELP["budget"])] = "tokens",
    time_reference: Annotated[str | None,
                              typer.Option("--time-reference", help=HELP["time_reference"])] = None,
    probe_steps: Annotated[int, typer.Option("--probe-steps", min=1, help="Timed steps of each arm's step "
                                             "probe (--budget time/both).")] = 10,
) -> None:
    """Train every arm on the same data and tokens; print held-out loss, selection recall and needle
    accuracy."""
    out = Output(as_json or str(json_out) == "-", always_human=True, wide=True)
    with user_errors():
        from nsa.bench.quality_view import QualityRequest, quality_command

        req = QualityRequest(config, list(set_ or []), arms, seeds, lrs, steps, task, needle_seq_len,
                             needle_gap, needle_steps, needle_batch, queries, parallel, out_dir, tiny,
                             list(saved or []), list(against_ or []), chart, budget, time_reference,
                             probe_steps, None if str(json_out) == "-" else json_out)
        result = quality_command(req, show=lambda block: out.show([block]))
    raise typer.Exit(out.result(result))


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench quality``."""
    app.command("quality", cls=command_class(json_path=True))(quality)
