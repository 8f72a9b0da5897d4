"""``nsa bench quality``: NSA recipes against dense attention on the same data, tokens, model and seeds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import fail, user_errors

if TYPE_CHECKING:
    from rich.console import Console

    from nsa.bench.quality import QualityRow, QualitySpec

# --tiny: the CPU setting of the CI test (tests/test_quality_bench.py)
TINY_STEPS, TINY_NEEDLE_STEPS, TINY_NEEDLE_SEQ, TINY_NEEDLE_GAP = 40, 60, 128, 48
TINY_SETS = ["train.batch_size=4", "eval.batches=2", "logging.every=20"]


def _csv(text: str, flag: str) -> list[str]:
    """The comma-separated items of ``text``; a comma inside brackets stays in its item (``nsa.fixed_gates=[0,0,1]``)."""
    out = [p for p in re.split(r",(?![^\[]*\])", text.replace(" ", "")) if p]
    if not out:
        raise fail(f"{flag} {text!r} lists nothing", hint=f"e.g. {flag} dense,nsa")
    return out


def quality(
    config: Annotated[str | None, typer.Option("--config", help=options.config_help("Base run config of every arm"))] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value for every arm; repeatable.")] = None,
    arms: Annotated[str, typer.Option("--arms", help="Comma-separated arms: dense, nsa, nsa-half, nsa-window, nsa-uniform, nsa-scorer, dense-warm, dense-curriculum, nsa-curriculum (a quarter of the steps on 4x shorter windows first), dense-ladder, nsa-ladder (a quarter at 16x shorter, a quarter at 4x shorter), dense-ladder-half, nsa-ladder-half (half at 16x shorter, a quarter at 4x shorter), or label=key=value;key=value (NSA plus overrides), label=<arm>;key=value (that arm plus overrides).")] = "dense,nsa",
    seeds: Annotated[str, typer.Option("--seeds", help="Comma-separated seeds; every arm trains once per seed.")] = "0",
    lrs: Annotated[str | None, typer.Option("--lrs", help="Comma-separated learning rates: every arm trains at each, and is compared with dense at its best (e.g. 5e-4,1e-3,2e-3).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="Training steps per arm [default: the config's].")] = None,
    task: Annotated[str, typer.Option("--task", help="text (held-out loss, selection recall), needle (single-needle retrieval) or both.")] = "text",
    needle_seq_len: Annotated[int, typer.Option("--needle-seq-len", min=8)] = 2048,
    needle_gap: Annotated[int, typer.Option("--needle-gap", min=1)] = 600,
    needle_steps: Annotated[int, typer.Option("--needle-steps", min=1)] = 5000,
    needle_batch: Annotated[int, typer.Option("--needle-batch", min=1)] = 16,
    queries: Annotated[int, typer.Option("--queries", min=1, help="Query positions per layer for selection recall.")] = 64,
    parallel: Annotated[int, typer.Option("--parallel", min=1, help="Runs at once, each in a process of its own, dealt over the visible GPUs (more runs than GPUs share them) or, on CPU, over the cores; the same runs and rows.")] = 1,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-o", help="Run directories go to OUT_DIR/<arm>/seed<N> (replaced).")] = Path("artifacts/quality"),
    tiny: Annotated[bool, typer.Option("--tiny", help="CPU-sized run (the CI test): config tiny, 40 steps, needle S=128 gap 48, 60 steps.")] = False,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
    saved: Annotated[list[Path] | None, typer.Option("--from", help="Train nothing: read these saved --json-out files of one sweep (repeatable: runs of several calls merged; a sweep cut short: its <json-out>.rows.jsonl) and print, save and chart them as one; the training options are not used.")] = None,
    against_: Annotated[list[str] | None, typer.Option("--against", help="Also read every other arm against this one, paired by seed (mean +- sd of the per-seed differences, and whether they are within noise): any arm, NSA ones included; repeatable; works with --from.")] = None,
    chart: Annotated[Path | None, typer.Option("--chart", help="Also draw each arm's training loss and held-out loss by position (mean over seeds; a sweep's arms at their best rate) to this PNG (the equal-time runs' against GPU seconds to <name>-time.png).")] = None,
    budget: Annotated[str, typer.Option("--budget", help="tokens (every arm --steps), time (every arm the GPU time the reference arm spends on --steps: each arm's step probed alone on its GPU first, its steps scaled by the reference's step time over its own) or both (the two sets of runs, read side by side).")] = "tokens",
    time_reference: Annotated[str | None, typer.Option("--time-reference", help="The arm whose GPU time every arm gets under --budget time/both [default: the slowest].")] = None,
    probe_steps: Annotated[int, typer.Option("--probe-steps", min=1, help="Timed steps of each arm's step probe (--budget time/both).")] = 10,
) -> None:
    """Train every arm on the same data and tokens; print held-out loss, selection recall and needle accuracy."""
    with user_errors():
        import json

        from rich.console import Console

        from nsa.bench.quality import (
            BUDGETS,
            QualitySpec,
            parse_arm,
            probe_step_ms,
            run_quality,
        )
        from nsa.bench.quality_saved import partial_header
        from nsa.config import load_run_config
        from nsa.envinfo import environment

        if saved:
            _from_saved(saved, as_json, json_out, chart, against_ or [])
            return
        if task not in ("text", "needle", "both"):
            raise fail(f"--task {task!r} must be text, needle or both")
        if budget not in BUDGETS:
            raise fail(f"--budget {budget!r} must be one of {', '.join(BUDGETS)}", hint="e.g. --budget both")
        if budget != "tokens" and task != "text":
            raise fail(f"--budget {budget} applies to --task text, not {task}", hint="pass --task text")
        arm_list = [parse_arm(a) for a in _csv(arms, "--arms")]
        _check_against(against_ or [], {a.name for a in arm_list})
        if time_reference is not None and time_reference not in {a.name for a in arm_list}:
            raise fail(f"--time-reference {time_reference!r} is not one of the arms "
                       f"({', '.join(a.name for a in arm_list)})", hint="name an arm by its label, e.g. nsa")
        try:
            seed_list = [int(s) for s in _csv(seeds, "--seeds")]
        except ValueError:
            raise fail(f"--seeds {seeds!r} must be comma-separated integers", hint="e.g. --seeds 0,1") from None
        try:
            lr_list = [float(x) for x in _csv(lrs, "--lrs")] if lrs is not None else []
        except ValueError:
            raise fail(f"--lrs {lrs!r} must be comma-separated numbers", hint="e.g. --lrs 5e-4,1e-3,2e-3") from None
        if any(not 0 < lr < 1 for lr in lr_list):
            raise fail(f"--lrs {lrs!r}: each learning rate must be between 0 and 1", hint="e.g. --lrs 5e-4,1e-3,2e-3")
        sets = list(set_ or [])
        cfg_name = config or ("tiny" if tiny else "m7c-125m")
        if tiny:
            sets = [*TINY_SETS, *sets]
            steps = steps or TINY_STEPS
            needle_steps, needle_seq_len, needle_gap = TINY_NEEDLE_STEPS, TINY_NEEDLE_SEQ, TINY_NEEDLE_GAP
        base = load_run_config(config=cfg_name, sets=sets).config  # bad config: one line before any training
        if parallel > 1:
            from nsa.bench import fanout

            fanout.slots(parallel)  # more runs at once than CPU cores: one line before any training
        steps = steps or base.train.steps
        console = Console(width=200, stderr=as_json)

        def log(line: str) -> None:
            if "eval step" in line or line.startswith(("done", "anomaly")) or " acc " in line:
                console.print(f"  {line}", highlight=False, markup=False)

        spec = QualitySpec(cfg_name, sets, arm_list, seed_list, steps, out_dir, task=task, queries=queries,
                           needle_seq_len=needle_seq_len, needle_gap=needle_gap, needle_steps=needle_steps,
                           needle_batch=needle_batch, needle_eval_samples=64 if tiny else 256,
                           device="cpu" if tiny else None, lrs=lr_list, parallel=parallel, against=against_ or [],
                           budget=budget, time_reference=time_reference, probe_steps=probe_steps)
        if budget != "tokens":  # each arm's step alone on its GPU, before any training run
            spec.step_ms = probe_step_ms(spec, lambda line: console.print(line, highlight=False, markup=False))
            _show_probes(console, spec)
        env = environment()
        partial = None if json_out is None else json_out.with_name(json_out.name + ".rows.jsonl")
        if partial is not None:  # the sweep first (rows none yet): a sweep cut short reads back with --from
            partial.write_text(json.dumps(partial_header(spec, env)) + "\n")

        def keep(row: QualityRow) -> None:  # each finished run at once: a sweep cut short keeps its rows
            if partial is not None:
                with partial.open("a") as fh:
                    fh.write(json.dumps(row.to_dict()) + "\n")

        rows = run_quality(spec, say=lambda line: console.print(line, highlight=False, markup=False), log=log,
                           on_row=keep)
        _show(console, spec, rows)
        _save(console, spec, rows, env, as_json, json_out, chart, f"S={base.train.seq_len}")


def _check_against(baselines: list[str], arms: set[str]) -> None:
    """``--against`` names arms of the sweep: one line before anything runs otherwise."""
    for b in baselines:
        if b not in arms:
            raise fail(f"--against {b!r} is not one of the arms ({', '.join(sorted(arms))})",
                       hint="name an arm by its label, e.g. --against nsa-ladder")


def _from_saved(paths: list[Path], as_json: bool, json_out: Path | None, chart: Path | None,
                baselines: list[str]) -> None:
    """``--from``: the saved runs of one sweep, merged, shown and saved as one (nothing trained)."""
    from dataclasses import replace

    from rich.console import Console

    from nsa.bench.quality import at_best_lr
    from nsa.bench.quality_saved import merge_sweeps

    spec, rows, extra = merge_sweeps(paths)
    _check_against(baselines, {r.arm for r in at_best_lr(rows)[0]})
    spec = replace(spec, against=baselines)
    console = Console(width=200, stderr=as_json)
    console.print(f"{len(rows)} runs from {len(paths)} saved sweep(s): "
                  + ", ".join(f"{s['path']} ({s['runs']})" for s in extra["merged_from"]), highlight=False, markup=False)
    seq = next((x.split("=", 1)[1] for x in spec.sets if x.startswith("train.seq_len=")), None)
    _show(console, spec, rows)
    _save(console, spec, rows, extra["environment"], as_json, json_out, chart, f"S={seq}" if seq else "merged",
          merged_from=extra["merged_from"])


def _show_probes(console: Console, spec: QualitySpec) -> None:
    """The probed step of each arm and the steps it gets at equal GPU time."""
    from rich.table import Table

    steps, ref = spec.time_steps(), spec.reference()
    table = Table(title=f"equal GPU time: each arm's step probed alone on its GPU ({spec.probe_steps} timed steps); "
                        f"reference {ref}, {spec.steps} steps")
    for col in ("arm", "step ms", f"vs {ref}", "steps", "GPU s"):
        table.add_column(col, justify="right")
    for a in spec.arms:
        ms = spec.step_ms[a.name]
        table.add_row(a.name, f"{ms:.1f}", f"{spec.step_ms[ref] / ms:.2f}x", str(steps[a.name]),
                      f"{steps[a.name] * ms / 1e3:.0f}")
    console.print(table)


BUDGET_TITLES = {"tokens": "equal tokens", "time": "equal GPU time"}


def _fig(x: Any, spec: str = ".4f") -> str:
    """A figure of the tables, ``-`` for none."""
    return "-" if x is None else format(x, spec)


def _show(console: Console, spec: QualitySpec, rows: list[QualityRow]) -> None:
    """The tables of a quality benchmark: runs, then per budget the rate sweep, arms over seeds and the --against
    readings, then loss by position, by context and selection of the first budget's runs."""
    from rich.table import Table

    from nsa.bench.quality import of_budget, relative_to_dense

    cfg_name, steps, seed_list = spec.config, spec.steps, spec.seeds
    timed = spec.budget != "tokens"
    table = Table(title=f"quality: config {cfg_name}, {steps} steps" + (f" (reference of the equal-time runs: "
                  f"{spec.reference()})" if timed and spec.step_ms else "") + f", seeds {','.join(map(str, seed_list))}")
    for col in ("arm", "seed", *(("budget", "steps", "step ms", "GPU s") if timed else ()), "held-out loss",
                "vs dense (arm mean)", "recall mean", "recall min", "recall ceiling", "cmp entropy", "needle acc",
                "steps to 0.5", "s"):
        table.add_column(col, justify="right")

    rel = {b: relative_to_dense(of_budget(rows, b)) for b in spec.budgets()}
    for r in rows:
        d = rel.get(r.budget, {}).get(r.arm)
        budget_cols = (BUDGET_TITLES[r.budget], str(r.steps), _fig(r.step_ms, ".1f"), _fig(r.gpu_seconds, ".1f"))
        table.add_row(r.arm, str(r.seed), *(budget_cols if timed else ()), _fig(r.val_loss),
                      "-" if d is None else f"{100 * d:+.1f}%",
                      _fig(r.recall_mean, ".3f"), _fig(r.recall_min, ".3f"), _fig(r.recall_best_mean, ".3f"),
                      _fig(r.cmp_entropy_mean, ".3f"),
                      _fig(r.needle_acc, ".3f"), "-" if r.needle_steps_to_target is None else str(r.needle_steps_to_target),
                      f"{r.seconds:.0f}")
    console.print(table)
    for budget in spec.budgets():
        _show_readings(console, spec, of_budget(rows, budget), f": {BUDGET_TITLES[budget]}" if timed else "")
    rows = of_budget(rows, spec.budgets()[0])
    by_pos = [r for r in rows if r.loss_by_position and r.seed == seed_list[0]]
    if by_pos:
        spans = [(b["start"], b["end"]) for b in max((r.loss_by_position for r in by_pos), key=len)]
        positions = Table(title=f"held-out loss by position in the window (seed {seed_list[0]})")
        positions.add_column("arm", justify="right")
        for a, b in spans:
            positions.add_column(f"{a}-{b}", justify="right")
        for r in by_pos:
            got = {(b["start"], b["end"]): b["loss"] for b in r.loss_by_position}
            positions.add_row(r.arm, *(_fig(got.get(span), ".3f") for span in spans))
        console.print(positions)
    by_ctx = [r for r in rows if len(r.loss_by_context) > 1 and r.seed == seed_list[0]]
    if by_ctx:
        ctxs = sorted({c["context"] for r in by_ctx for c in r.loss_by_context})
        contexts = Table(title=f"held-out loss of the same tokens read in windows of each length (seed {seed_list[0]})")
        contexts.add_column("arm", justify="right")
        for c in ctxs:
            contexts.add_column(f"{c}", justify="right")
        for r in by_ctx:
            got = {c["context"]: c["loss"] for c in r.loss_by_context}
            contexts.add_row(r.arm, *(_fig(got.get(c), ".4f") for c in ctxs))
        console.print(contexts)
    for r in rows:
        if r.selection and r.seed == seed_list[0]:
            layers = Table(title=f"selection per layer: {r.arm} (seed {r.seed}, held-out batches)")
            for col in ("layer", "recall", "recall ceiling", "forced blocks", "cmp entropy", "scorer KL",
                        "gates cmp / sel / win"):
                layers.add_column(col, justify="right")
            for L in r.selection:
                layers.add_row(str(L["layer"]), _fig(L.get("recall"), ".3f"), _fig(L.get("recall_best"), ".3f"),
                               _fig(L.get("recall_forced"), ".3f"), _fig(L.get("cmp_entropy"), ".3f"),
                               _fig(L.get("kl"), ".3f"), " / ".join(f"{g:.2f}" for g in L["gates"]))
            console.print(layers)


def _show_readings(console: Console, spec: QualitySpec, rows: list[QualityRow], budget: str) -> None:
    """One budget's readings: the rate sweep, each arm over its seeds against dense, and the --against arms."""
    from rich.table import Table

    from nsa.bench.quality import against, at_best_lr, summarise_arms

    lr_list = spec.lrs

    summary_rows = rows
    if lr_list:
        summary_rows, sweep = at_best_lr(rows)
        best = Table(title=f"learning-rate sweep: held-out loss, mean over the seeds{budget}")
        best.add_column("arm", justify="right")
        for lr in lr_list:
            best.add_column(f"lr {lr:g}", justify="right")
        best.add_column("best", justify="right")
        for arm, sw in sweep.items():
            best.add_row(arm, *(_fig(sw["mean_by_lr"].get(lr)) for lr in lr_list), f"{sw['best_lr']:g}")
        console.print(best)
        for arm, sw in sweep.items():
            if sw["edge"]:  # the optimum may lie past the rates tried
                console.print(f"note: {arm}'s best rate {sw['best_lr']:g} is the {sw['edge']} tried{budget}; "
                              f"extend the sweep {'down' if sw['edge'] == 'lowest' else 'up'} to be sure",
                              highlight=False, markup=False)
    over_seeds = Table(title="arms over their seeds (vs dense: paired by seed, mean +- sd)"
                       + (", each arm at its best learning rate" if lr_list else "") + budget)
    for col in ("arm", "seeds", "held-out loss mean +- sd", "vs dense", "reading"):
        over_seeds.add_column(col, justify="right")
    for a in summarise_arms(summary_rows):
        spread = "" if a.sd is None else f" +- {a.sd:.4f}"
        diff = ("-" if a.vs_dense is None else f"{100 * a.vs_dense:+.1f}%"
                + ("" if a.vs_dense_sd is None else f" +- {100 * a.vs_dense_sd:.1f}%")
                + ("" if a.baseline in (None, "dense") else f" (vs {a.baseline})"))
        over_seeds.add_row(a.arm, str(a.seeds), f"{a.mean:.4f}{spread}", diff, a.reading)
    console.print(over_seeds)
    for b in spec.against:
        if not any(r.arm == b for r in summary_rows):
            continue
        paired = Table(title=f"arms against {b} (paired by seed, mean +- sd)"
                       + (", each arm at its best learning rate" if lr_list else "") + budget)
        for col in ("arm", "seeds", "held-out loss mean +- sd", f"vs {b}", "per seed", "reading"):
            paired.add_column(col, justify="right")
        for a in against(summary_rows, b):
            spread = "" if a.sd is None else f" +- {a.sd:.4f}"
            diff = ("-" if a.vs_dense is None else f"{100 * a.vs_dense:+.1f}%"
                    + ("" if a.vs_dense_sd is None else f" +- {100 * a.vs_dense_sd:.1f}%"))
            per_seed = " / ".join(f"{100 * d:+.1f}" for d in a.per_seed) or "-"
            paired.add_row(a.arm, str(a.seeds), f"{a.mean:.4f}{spread}", diff, per_seed, a.reading)
        console.print(paired)


def _save(console: Console, spec: QualitySpec, rows: list[QualityRow], environment: dict[str, Any], as_json: bool,
          json_out: Path | None, chart: Path | None, length: str, merged_from: list[dict[str, Any]] | None = None) -> None:
    """The JSON outputs, then the chart (after the results are out: a chart that cannot be written loses nothing)."""
    from nsa.bench.quality import quality_payload
    from nsa_cli import render

    payload = quality_payload(spec, rows, environment)
    if merged_from is not None:
        payload["merged_from"] = merged_from
    render.json_outputs(payload, as_json=as_json, json_out=json_out, indent=1)
    if chart is not None:
        from nsa.bench.quality import of_budget
        from nsa.bench.quality_chart import quality_chart

        for budget in spec.budgets():
            path = chart if budget == spec.budgets()[0] else chart.with_name(f"{chart.stem}-{budget}{chart.suffix}")
            what = f"{spec.steps} steps" if budget == "tokens" else f"equal GPU time of {spec.reference()}'s {spec.steps} steps"
            title = f"bench quality: config {spec.config}, {what}, {length}"
            if quality_chart(of_budget(rows, budget), path, title, gpu_seconds=budget == "time"):
                console.print(f"saved {path}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench quality``."""
    app.command("quality", cls=command_class(json_path=True))(quality)
