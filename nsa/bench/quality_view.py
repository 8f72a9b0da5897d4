"""``nsa bench quality`` as one call: :func:`quality_command` checks a :class:`QualityRequest`, probes and
trains every arm (:func:`nsa.bench.quality.run_quality`) or reads saved sweeps (``--from``), and returns the
tables, the JSON payload and the charts; what happens on the way (each run, the probed steps) is shown as it
happens."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nsa.bench.quality import (
    BUDGETS,
    QualityRow,
    QualitySpec,
    against,
    at_best_lr,
    of_budget,
    parse_arm,
    probe_step_ms,
    quality_payload,
    relative_to_dense,
    run_quality,
    summarise_arms,
)
from nsa.bench.requests import QualityRequest
from nsa.errors import ConfigError
from nsa.view import Block, Line, Payload, Table, fig

# --tiny: the CPU setting of the CI test (tests/test_quality_bench.py)
TINY_STEPS, TINY_NEEDLE_STEPS, TINY_NEEDLE_SEQ, TINY_NEEDLE_GAP = 40, 60, 128, 48
TINY_SETS = ["train.batch_size=4", "eval.batches=2", "logging.every=20"]
BUDGET_TITLES = {"tokens": "equal tokens", "time": "equal GPU time"}
Show = Callable[[Block], None]


def _csv(text: str, flag: str) -> list[str]:
    """The comma-separated items of ``text``; a comma inside brackets stays in its item
    (``nsa.fixed_gates=[0,0,1]``)."""
    out = [p for p in re.split(r",(?![^\[]*\])", text.replace(" ", "")) if p]
    if not out:
        raise ConfigError(f"{flag} {text!r} lists nothing", hint=f"e.g. {flag} dense,nsa")
    return out


def _numbers(text: str | None, flag: str, kind: type, example: str) -> list[Any]:
    try:
        return [kind(x) for x in _csv(text, flag)] if text is not None else []
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise ConfigError(f"{flag} {text!r} must be comma-separated {what}",
                          hint=f"e.g. {flag} {example}") from None


def _check_against(baselines: list[str], arms: set[str]) -> None:
    """``--against`` names arms of the sweep: one line before anything runs otherwise."""
    for b in baselines:
        if b not in arms:
            raise ConfigError(f"--against {b!r} is not one of the arms ({', '.join(sorted(arms))})",
                              hint="name an arm by its label, e.g. --against nsa-ladder")


def _spec(req: QualityRequest) -> tuple[QualitySpec, str]:
    """The request checked and made a :class:`QualitySpec` (one line, exit 2, before any training otherwise),
    and the sequence length of its text runs."""
    from nsa.config import load_run_config

    if req.task not in ("text", "needle", "both"):
        raise ConfigError(f"--task {req.task!r} must be text, needle or both")
    if req.budget not in BUDGETS:
        raise ConfigError(f"--budget {req.budget!r} must be one of {', '.join(BUDGETS)}",
                          hint="e.g. --budget both")
    if req.budget != "tokens" and req.task != "text":
        raise ConfigError(f"--budget {req.budget} applies to --task text, not {req.task}",
                          hint="pass --task text")
    arms = [parse_arm(a) for a in _csv(req.arms, "--arms")]
    _check_against(req.against, {a.name for a in arms})
    if req.time_reference is not None and req.time_reference not in {a.name for a in arms}:
        raise ConfigError(f"--time-reference {req.time_reference!r} is not one of the arms "
                          f"({', '.join(a.name for a in arms)})", hint="name an arm by its label, e.g. nsa")
    seeds = _numbers(req.seeds, "--seeds", int, "0,1")
    lrs = _numbers(req.lrs, "--lrs", float, "5e-4,1e-3,2e-3")
    if any(not 0 < lr < 1 for lr in lrs):
        raise ConfigError(f"--lrs {req.lrs!r}: each learning rate must be between 0 and 1",
                          hint="e.g. --lrs 5e-4,1e-3,2e-3")
    sets, config, steps = list(req.sets), req.config or ("tiny" if req.tiny else "m7c-125m"), req.steps
    needle = (req.needle_steps, req.needle_seq_len, req.needle_gap)
    if req.tiny:
        sets, steps, needle = [*TINY_SETS, *sets], steps or TINY_STEPS, (TINY_NEEDLE_STEPS, TINY_NEEDLE_SEQ,
                                                                          TINY_NEEDLE_GAP)
    base = load_run_config(config=config, sets=sets).config  # bad config: one line before any training
    if req.parallel > 1:
        from nsa.bench import fanout

        fanout.slots(req.parallel)  # more runs at once than CPU cores: one line before any training
    spec = QualitySpec(config, sets, arms, seeds, steps or base.train.steps, req.out_dir, task=req.task,
                       queries=req.queries, needle_seq_len=needle[1], needle_gap=needle[2],
                       needle_steps=needle[0], needle_batch=req.needle_batch,
                       needle_eval_samples=64 if req.tiny else 256, device="cpu" if req.tiny else None,
                       lrs=lrs, parallel=req.parallel, against=req.against, budget=req.budget,
                       time_reference=req.time_reference, probe_steps=req.probe_steps)
    return spec, f"S={base.train.seq_len}"


def quality_command(req: QualityRequest, show: Show) -> Payload:
    """``nsa bench quality``: train every arm (or read ``req.saved``), ``show`` each run's lines and the
    probed steps as they come; the tables, the payload (also kept in ``req.json_out``, and each finished run
    at once in ``<json-out>.rows.jsonl``: a sweep cut short reads back with ``--from``) and the charts."""
    from nsa.bench.quality_saved import partial_header
    from nsa.envinfo import environment

    if req.saved:
        return _from_saved(req)
    spec, length = _spec(req)

    def say(line: str) -> None:
        show(Line(line))

    def log(line: str) -> None:
        if "eval step" in line or line.startswith(("done", "anomaly")) or " acc " in line:
            say(f"  {line}")

    if spec.budget != "tokens":  # each arm's step alone on its GPU, before any training run
        spec.step_ms = probe_step_ms(spec, say)
        show(_probes(spec))
    env = environment()
    partial = None if req.json_out is None else req.json_out.with_name(req.json_out.name + ".rows.jsonl")
    if partial is not None:  # the sweep first (rows none yet): a sweep cut short reads back with --from
        partial.write_text(json.dumps(partial_header(spec, env)) + "\n")

    def keep(row: QualityRow) -> None:  # each finished run at once: a sweep cut short keeps its rows
        if partial is not None:
            with partial.open("a") as fh:
                fh.write(json.dumps(row.to_dict()) + "\n")

    rows = run_quality(spec, say=say, log=log, on_row=keep)
    return _result(req, spec, rows, quality_payload(spec, rows, env), length)


def _from_saved(req: QualityRequest) -> Payload:
    """``--from``: the saved runs of one sweep, merged, shown and saved as one (nothing trained)."""
    from nsa.bench.quality_saved import merge_sweeps

    spec, rows, extra = merge_sweeps(req.saved)
    _check_against(req.against, {r.arm for r in at_best_lr(rows)[0]})
    spec = replace(spec, against=req.against)
    seq = next((x.split("=", 1)[1] for x in spec.sets if x.startswith("train.seq_len=")), None)
    payload = quality_payload(spec, rows, extra["environment"])
    payload["merged_from"] = extra["merged_from"]
    head = Line(f"{len(rows)} runs from {len(req.saved)} saved sweep(s): "
                + ", ".join(f"{s['path']} ({s['runs']})" for s in extra["merged_from"]))
    return _result(req, spec, rows, payload, f"S={seq}" if seq else "merged", [head])


def _result(req: QualityRequest, spec: QualitySpec, rows: list[QualityRow], payload: dict[str, Any],
            length: str, head: list[Block] | None = None) -> Payload:
    """The tables, the payload kept in ``req.json_out``, then the charts (after the results are kept: a chart
    that cannot be written loses nothing)."""
    from nsa.bench.quality_chart import quality_chart

    result = Payload(payload, [*(head or []), *_tables(spec, rows)], indent=1)
    if req.json_out is not None and str(req.json_out) != "-":
        req.json_out.parent.mkdir(parents=True, exist_ok=True)
        req.json_out.write_text(result.json_file_text() + "\n")
        result.blocks.append(Line(f"saved {req.json_out}", wrap=False))
    for budget in spec.budgets() if req.chart is not None else []:
        assert req.chart is not None
        path = req.chart if budget == spec.budgets()[0] else req.chart.with_name(
            f"{req.chart.stem}-{budget}{req.chart.suffix}")
        what = (f"{spec.steps} steps" if budget == "tokens"
                else f"equal GPU time of {spec.reference()}'s {spec.steps} steps")
        if quality_chart(of_budget(rows, budget), path,
                         f"bench quality: config {spec.config}, {what}, {length}",
                         gpu_seconds=budget == "time"):
            result.blocks.append(Line(f"saved {path}"))
    return result


def _probes(spec: QualitySpec) -> Table:
    """The probed step of each arm and the steps it gets at equal GPU time."""
    steps, ref = spec.time_steps(), spec.reference()
    t = Table.of(f"equal GPU time: each arm's step probed alone on its GPU ({spec.probe_steps} timed steps); "
                 f"reference {ref}, {spec.steps} steps", ("arm", "step ms", f"vs {ref}", "steps", "GPU s"))
    for a in spec.arms:
        ms = spec.step_ms[a.name]
        t.add(a.name, f"{ms:.1f}", f"{spec.step_ms[ref] / ms:.2f}x", str(steps[a.name]),
              f"{steps[a.name] * ms / 1e3:.0f}")
    return t


def _tables(spec: QualitySpec, rows: list[QualityRow]) -> list[Block]:
    """The tables of a quality benchmark: runs, then per budget the rate sweep, arms over seeds and the
    --against readings, then loss by position, by context and selection of the first budget's runs."""
    timed, seed0 = spec.budget != "tokens", spec.seeds[0]
    t = Table.of(f"quality: config {spec.config}, {spec.steps} steps" + (
        f" (reference of the equal-time runs: {spec.reference()})" if timed and spec.step_ms else "")
        + f", seeds {','.join(map(str, spec.seeds))}",
        ("arm", "seed", *(("budget", "steps", "step ms", "GPU s") if timed else ()), "held-out loss",
         "vs dense (arm mean)", "recall mean", "recall min", "recall ceiling", "cmp entropy", "needle acc",
         "steps to 0.5", "s"))
    rel = {b: relative_to_dense(of_budget(rows, b)) for b in spec.budgets()}
    for r in rows:
        d = rel.get(r.budget, {}).get(r.arm)
        budget = (BUDGET_TITLES[r.budget], str(r.steps), fig(r.step_ms, ".1f"), fig(r.gpu_seconds, ".1f"))
        t.add(r.arm, str(r.seed), *(budget if timed else ()), fig(r.val_loss, ".4f"),
              "-" if d is None else f"{100 * d:+.1f}%", fig(r.recall_mean, ".3f"), fig(r.recall_min, ".3f"),
              fig(r.recall_best_mean, ".3f"), fig(r.cmp_entropy_mean, ".3f"), fig(r.needle_acc, ".3f"),
              "-" if r.needle_steps_to_target is None else str(r.needle_steps_to_target), f"{r.seconds:.0f}")
    out: list[Block] = [t]
    for b in spec.budgets():
        out += _readings(spec, of_budget(rows, b), f": {BUDGET_TITLES[b]}" if timed else "")
    rows = of_budget(rows, spec.budgets()[0])
    by_pos = [r for r in rows if r.loss_by_position and r.seed == seed0]
    if by_pos:
        spans = [(b["start"], b["end"]) for b in max((r.loss_by_position for r in by_pos), key=len)]
        t = Table.of(f"held-out loss by position in the window (seed {seed0})",
                     ["arm", *(f"{a}-{b}" for a, b in spans)])
        for r in by_pos:
            got = {(b["start"], b["end"]): b["loss"] for b in r.loss_by_position}
            t.add(r.arm, *(fig(got.get(span), ".3f") for span in spans))
        out.append(t)
    by_ctx = [r for r in rows if len(r.loss_by_context) > 1 and r.seed == seed0]
    if by_ctx:
        ctxs = sorted({c["context"] for r in by_ctx for c in r.loss_by_context})
        t = Table.of(f"held-out loss of the same tokens read in windows of each length (seed {seed0})",
                     ["arm", *map(str, ctxs)])
        for r in by_ctx:
            got = {c["context"]: c["loss"] for c in r.loss_by_context}
            t.add(r.arm, *(fig(got.get(c), ".4f") for c in ctxs))
        out.append(t)
    for r in (r for r in rows if r.selection and r.seed == seed0):
        t = Table.of(f"selection per layer: {r.arm} (seed {r.seed}, held-out batches)", (
            "layer", "recall", "recall ceiling", "forced blocks", "cmp entropy", "scorer KL",
                                                                                         "gates cmp / sel / "
                                                                                         "win"))
        for L in r.selection:
            t.add(str(L["layer"]), *(fig(L.get(k), ".3f") for k in ("recall", "recall_best", "recall_forced",
                                                                     "cmp_entropy", "kl")),
                  " / ".join(f"{g:.2f}" for g in L["gates"]))
        out.append(t)
    return out


def _readings(spec: QualitySpec, rows: list[QualityRow], budget: str) -> list[Block]:
    """One budget's readings: the rate sweep, each arm over its seeds against dense, and the --against
    arms."""
    out: list[Block] = []
    summary_rows, best_lr = rows, ", each arm at its best learning rate" if spec.lrs else ""
    if spec.lrs:
        summary_rows, sweep = at_best_lr(rows)
        t = Table.of(f"learning-rate sweep: held-out loss, mean over the seeds{budget}",
                     ["arm", *(f"lr {lr:g}" for lr in spec.lrs), "best"])
        for arm, sw in sweep.items():
            t.add(arm, *(fig(sw["mean_by_lr"].get(lr), ".4f") for lr in spec.lrs), f"{sw['best_lr']:g}")
        out.append(t)
        out += [Line(f"note: {arm}'s best rate {sw['best_lr']:g} is the {sw['edge']} tried{budget}; extend "
                     f"the sweep {'down' if sw['edge'] == 'lowest' else 'up'} to be sure")
                for arm, sw in sweep.items() if sw["edge"]]  # the optimum may lie past the rates tried
    t = Table.of("arms over their seeds (vs dense: paired by seed, mean +- sd)" + best_lr + budget,
                 ("arm", "seeds", "held-out loss mean +- sd", "vs dense", "reading"))
    for a in summarise_arms(summary_rows):
        vs = "" if a.vs_dense is None or a.baseline in (None, "dense") else f" (vs {a.baseline})"
        t.add(a.arm, str(a.seeds), _mean(a), _diff(a) + vs, a.reading)
    out.append(t)
    for b in spec.against:
        if not any(r.arm == b for r in summary_rows):
            continue
        t = Table.of(f"arms against {b} (paired by seed, mean +- sd)" + best_lr + budget,
                     ("arm", "seeds", "held-out loss mean +- sd", f"vs {b}", "per seed", "reading"))
        for a in against(summary_rows, b):
            t.add(a.arm, str(a.seeds), _mean(a), _diff(a),
                  " / ".join(f"{100 * d:+.1f}" for d in a.per_seed) or "-", a.reading)
        out.append(t)
    return out


def _mean(a: Any) -> str:
    return f"{a.mean:.4f}" + ("" if a.sd is None else f" +- {a.sd:.4f}")


def _diff(a: Any) -> str:
    return ("-" if a.vs_dense is None else f"{100 * a.vs_dense:+.1f}%"
            + ("" if a.vs_dense_sd is None else f" +- {100 * a.vs_dense_sd:.1f}%"))
