"""``nsa bench attention`` and ``nsa bench train``: timings as a table, or JSON (``--json``: stdout;
``--json-out PATH``: a file)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.commands import bench_decode, bench_quality, bench_retrieval
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

bench_app = typer.Typer(help="Benchmarks: NSA attention kernels, training steps and decode against dense "
                             "attention; retrieval learning.", no_args_is_help=True)
Tune = Annotated[list[str] | None, typer.Option("--tune", help="Triton tile override key=value (sweeps), "
                                                "e.g. sel_bm=16.")]
Tiny = typer.Option("--tiny", help="CPU-sized run (seq 64,128; tiny shape; small NSA blocks).")


@bench_app.command("attention", cls=command_class(json_path=True))
def attention(
    seq_lens: Annotated[str | None, typer.Option("--seq-lens", help="Comma-separated sequence lengths "
                                                 "[default: 2048..131072, --tiny: 64,128].")] = None,
    shape: Annotated[list[str] | None, typer.Option("--shape", help="paper (HQ=64,H=4,D=128), m7c "
                                                    "(HQ=12,H=2,D=64) or HQ,H,D; repeatable.")] = None,
    batch: Annotated[int, typer.Option("--batch", min=1)] = 1,
    backend: Annotated[str,
                       typer.Option("--backend",
                                    help="nsa.ops backend: auto, triton, torch, reference.")] = "auto",
    peer: Annotated[bool,
                    typer.Option("--peer/--no-peer",
                                 help="Time fla-core's parallel_nsa when importable.")] = True,
    dense: Annotated[bool, typer.Option("--dense/--no-dense", help="Time dense causal SDPA.")] = True,
    warmup_ms: Annotated[int, typer.Option("--warmup-ms", min=1)] = 25,
    rep_ms: Annotated[int, typer.Option("--rep-ms", min=1)] = 100,
    tiny: Annotated[bool, Tiny] = False,
    tune: Tune = None,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Time every side as CUDA-graph replays (no "
                                             "launch overhead).")] = False,
    stages: Annotated[bool, typer.Option("--stages", help="Also time each Triton stage alone, against its "
                                         "roofline (FLOPs at --peak-tflops, bytes at --peak-tbps).")] = False,
    peak_tflops: Annotated[float, typer.Option("--peak-tflops", min=1.0, help="Matrix-product rate of the "
                                               "stage table's roofline.")] = 750.0,
    peak_tbps: Annotated[float, typer.Option("--peak-tbps", min=0.1, help="Memory bandwidth (TB/s) of the "
                                             "stage table's roofline.")] = 3.0,
    profile_step: Annotated[bool, typer.Option("--profile-step", help="Profile one more NSA forward+backward "
                                               "per row: kernels by time and launches (CPU: operators), in "
                                               "the JSON.")] = False,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
) -> None:
    """Forward and forward+backward time and peak memory: NSA vs dense causal SDPA (and fla-core); with
    --stages each Triton stage's time against the machine's bound."""
    out = Output(as_json, json_out, always_human=True, wide=True)
    with user_errors():
        from nsa.bench.attention import AttentionRequest, attention_command

        req = AttentionRequest(options.ints(seq_lens, "--seq-lens"), shape, batch, backend, peer, dense,
                               warmup_ms, rep_ms, tiny, tune, cuda_graph, stages, peak_tflops, peak_tbps,
                               profile_step)
        result = attention_command(req, say=lambda line: out.say(line, err=True, wrap=False))
    raise typer.Exit(out.result(result))


@bench_app.command("train", cls=command_class(json_path=True))
def train(
    config: Annotated[str, options.config()] = "m7c-125m",
    seq_lens: Annotated[str,
                        typer.Option("--seq-lens", help="Comma-separated sequence lengths.")] = "2048,16384",
    batch_sizes: Annotated[str,
                           typer.Option("--batch-sizes", help="Batch size per sequence length.")] = "16,2",
    attention: Annotated[list[str] | None,
                         typer.Option("--attention", help="nsa and/or dense; repeatable.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1)] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0)] = 3,
    set_: Annotated[list[str] | None, options.sets("Config override key=value")] = None,
    tiny: Annotated[bool,
                    typer.Option("--tiny",
                                 help="CPU-sized run: tiny config, seq 64, batch 2, 2 steps.")] = False,
    tune: Tune = None,
    modes: Annotated[str | None, typer.Option("--modes", help="eager and/or compiled, comma-separated "
                                              "(default: both on CUDA, eager on CPU).")] = None,
    profile_step: Annotated[bool, typer.Option("--profile-step", help="Profile one more step per row: "
                                               "kernels by time and launches (CPU: operators), in the "
                                               "JSON.")] = False,
    trace_dir: Annotated[Path | None, typer.Option("--trace-dir", help="Also write that step's Chrome trace "
                                                   "here, one file per row and rank (implies "
                                                   "--profile-step).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", min=1, help="Run on N ranks of "
                                                       "this node through torchrun (DDP, or FSDP with --set "
                                                       "runtime.parallel=fsdp).")] = None,
    context_parallel: Annotated[int, typer.Option("--context-parallel", min=1, help="Ranks that share each "
                                                  "sequence (docs/training.md, 'Training longer than one GPU "
                                                  "holds').")] = 1,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
) -> None:
    """Training-step tokens/s, MFU and peak memory: NSA model vs the same model with dense attention,
    eager and compiled; on several ranks with --nproc-per-node (and context parallelism)."""
    out = Output(as_json, json_out, always_human=True, wide=True)
    with user_errors():
        from nsa.bench.train import TrainBenchRequest, train_command

        lens = [] if tiny else options.ints(seq_lens, "--seq-lens") or []
        req = TrainBenchRequest(config, lens,
                                [] if tiny else options.ints(batch_sizes, "--batch-sizes") or [],
                                tuple(attention or ["nsa", "dense"]), steps, warmup, set_, tiny, tune, modes,
                                profile_step, trace_dir, nproc_per_node, context_parallel)
        result = train_command(req, argv=sys.argv[1:], program=["-m", "nsa_cli"],
                               say=lambda line: out.say(line, err=True, wrap=False))
    raise typer.Exit(out.result(result))


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench`` with its commands (attention, train, decode, retrieval)."""
    bench_decode.register(bench_app)
    bench_retrieval.register(bench_app)
    bench_quality.register(bench_app)
    app.add_typer(bench_app, name="bench")
