"""``nsa bench attention`` and ``nsa bench train``: timings as a table, or JSON (``--json``: stdout;
``--json-out PATH``: a file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.commands import bench_decode, bench_quality, bench_retrieval
from nsa_cli.compat import command_class
from nsa_cli.errors import fail, user_errors

bench_app = typer.Typer(help="Benchmarks: NSA attention kernels, training steps and decode against dense attention; retrieval learning.",
                        no_args_is_help=True)


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise fail(f"{name}={text!r} must be comma-separated integers", hint=f"e.g. {name} 2048,8192") from None
    if not out or any(v < 1 for v in out):
        raise fail(f"{name}={text!r} must list positive integers", hint=f"e.g. {name} 2048,8192")
    return out


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _parse_tune(items: list[str] | None) -> dict[str, int | str]:
    """``--tune key=value`` overrides of the Triton block shapes (tuning sweeps), checked against
    :data:`nsa.ops.TUNE_KEYS` and passed to the benchmark (nothing global is changed)."""
    from nsa.ops import TUNE_KEYS

    out: dict[str, int | str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--tune {item!r} must be key=value", hint="e.g. --tune sel_bm=16")
        if key not in TUNE_KEYS:
            raise fail(f"--tune {key} is not a tile setting", hint=f"one of {', '.join(sorted(TUNE_KEYS))}")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


@bench_app.command("attention", cls=command_class(json_path=True))
def attention(
    seq_lens: Annotated[str | None, typer.Option("--seq-lens", help="Comma-separated sequence lengths [default: 2048..131072, --tiny: 64,128].")] = None,
    shape: Annotated[list[str] | None, typer.Option("--shape", help="paper (HQ=64,H=4,D=128), m7c (HQ=12,H=2,D=64) or HQ,H,D; repeatable.")] = None,
    batch: Annotated[int, typer.Option("--batch", min=1)] = 1,
    backend: Annotated[str, typer.Option("--backend", help="nsa.ops backend: auto, triton, torch, reference.")] = "auto",
    peer: Annotated[bool, typer.Option("--peer/--no-peer", help="Time fla-core's parallel_nsa when importable.")] = True,
    dense: Annotated[bool, typer.Option("--dense/--no-dense", help="Time dense causal SDPA.")] = True,
    warmup_ms: Annotated[int, typer.Option("--warmup-ms", min=1)] = 25,
    rep_ms: Annotated[int, typer.Option("--rep-ms", min=1)] = 100,
    tiny: Annotated[bool, typer.Option("--tiny", help="CPU-sized run (seq 64,128; tiny shape; small NSA blocks).")] = False,
    tune: Annotated[list[str] | None, typer.Option("--tune", help="Triton tile override key=value (sweeps), e.g. sel_bm=16.")] = None,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph", help="Time every side as CUDA-graph replays (no launch overhead).")] = False,
    stages: Annotated[bool, typer.Option("--stages", help="Also time each Triton stage alone, against its roofline (FLOPs at --peak-tflops, bytes at --peak-tbps).")] = False,
    peak_tflops: Annotated[float, typer.Option("--peak-tflops", min=1.0, help="Matrix-product rate of the stage table's roofline.")] = 750.0,
    peak_tbps: Annotated[float, typer.Option("--peak-tbps", min=0.1, help="Memory bandwidth (TB/s) of the stage table's roofline.")] = 3.0,
    profile_step: Annotated[bool, typer.Option("--profile-step", help="Profile one more NSA forward+backward per row: kernels by time and launches (CPU: operators), in the JSON.")] = False,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
) -> None:
    """Forward and forward+backward time and peak memory: NSA vs dense causal SDPA (and fla-core); with
    --stages each Triton stage's time against the machine's bound."""
    with user_errors():
        tuned = _parse_tune(tune)
        from rich.console import Console
        from rich.table import Table

        from nsa.bench.attention import DEFAULT_SEQ_LENS, SHAPES, TINY_SEQ_LENS, bench_attention
        from nsa.envinfo import environment
        from nsa_cli import render

        if backend not in ("auto", "triton", "torch", "reference"):
            raise fail(f"--backend {backend!r} is not one of auto, triton, torch, reference")
        shapes: list[tuple[str, int, int, int]] = []
        for s in shape or (["tiny"] if tiny else ["paper", "m7c"]):
            if s in SHAPES:
                shapes.append((s, *SHAPES[s]))
            elif s == "tiny":
                shapes.append(("tiny", 4, 2, 16))
            else:
                parts = _ints(s, "--shape")
                if len(parts) != 3 or parts[0] % parts[1]:
                    raise fail(f"--shape {s!r} must be paper, m7c or HQ,H,D with H dividing HQ")
                shapes.append((f"{parts[0]}x{parts[1]}x{parts[2]}", parts[0], parts[1], parts[2]))
        if seq_lens is None:
            lens = list(TINY_SEQ_LENS if tiny else DEFAULT_SEQ_LENS)
        else:
            lens = _ints(seq_lens, "--seq-lens")
        import torch

        if not tiny and not torch.cuda.is_available():
            raise fail("no CUDA device for bench attention", hint="use --tiny on a CPU machine")
        if stages and (tiny or backend in ("torch", "reference")):
            raise fail("--stages times the Triton kernels on a CUDA device",
                       hint="leave out --tiny and --backend torch/reference, or --stages")
        import time

        t0 = time.monotonic()

        def progress(msg: str) -> None:
            typer.echo(f"[{time.monotonic() - t0:6.1f}s] {msg}", err=True)

        rows = bench_attention(shapes, lens, tiny=tiny, batch=batch, backend=backend, peer=peer, dense=dense,
                               warmup_ms=warmup_ms, rep_ms=rep_ms, cuda_graph=cuda_graph, tune=tuned,
                               progress=progress, profile=profile_step)
        graphed = ", CUDA graphs" if rows[0].cuda_graph else ""
        table = Table(title=f"NSA vs dense attention ({rows[0].device}, {rows[0].dtype}, batch {batch}{graphed})")
        for col in ("shape", "S", "nsa fwd ms", "dense fwd ms", "fwd x", "nsa f+b ms", "dense f+b ms", "f+b x",
                    "peer f+b ms", "vs peer", "nsa TFLOP/s", "nsa MiB", "dense MiB", "nsa saved MiB",
                    "dense saved MiB"):
            table.add_column(col, justify="right")
        for r in rows:
            d = r.to_dict()
            table.add_row(r.shape, str(r.seq_len), _fmt(r.nsa_fwd_ms), _fmt(r.dense_fwd_ms), _fmt(r.speedup_fwd, ".2f"),
                          _fmt(r.nsa_fwdbwd_ms), _fmt(r.dense_fwdbwd_ms), _fmt(r.speedup_fwdbwd, ".2f"),
                          _fmt(r.peer_fwdbwd_ms), _fmt(r.vs_peer_fwdbwd, ".2f"), _fmt(d["nsa_fwd_tflops"]),
                          _fmt(r.nsa_peak_mib, ".0f"), _fmt(r.dense_peak_mib, ".0f"),
                          _fmt(r.nsa_saved_mib, ".1f"), _fmt(r.dense_saved_mib, ".1f"))
        Console(width=200, stderr=as_json).print(table)
        for r in rows:
            for note in r.notes:
                typer.echo(f"note ({r.shape}, S={r.seq_len}): {note}", err=as_json)
            for note in r.noisy:
                typer.echo(f"warning ({r.shape}, S={r.seq_len}): {note}", err=True)
            if r.kernels:
                top = ", ".join(f"{k['name'][:40]} {k['ms']:.1f} ms" for k in r.kernels[:5])
                typer.echo(f"profile ({r.shape}, S={r.seq_len}): {r.launches} launches; {top}", err=as_json)
        stage_list = _stage_table(shapes, lens, batch, tuned, warmup_ms, rep_ms, peak_tflops, peak_tbps,
                                  progress, as_json) if stages else []
        render.json_outputs({"command": "bench attention", "environment": environment(), "tune": tuned,
                             "rows": [r.to_dict() for r in rows],
                             **({"stages": [r.to_dict() for r in stage_list],
                                 "roofline": {"peak_tflops": peak_tflops, "peak_tbps": peak_tbps}} if stages else {})},
                            as_json=as_json, json_out=json_out)


def _stage_table(shapes: list[tuple[str, int, int, int]], lens: list[int], batch: int, tuned: dict[str, int | str],
                 warmup_ms: int, rep_ms: int, peak_tflops: float, peak_tbps: float,
                 progress: Callable[[str], None], as_json: bool) -> list[Any]:
    """Each Triton stage timed alone per shape and length, printed against its roofline."""
    from rich.console import Console
    from rich.table import Table

    from nsa.bench.attention import kernel_breakdown, stage_cmp_path, stage_rows

    out = []
    for name, HQ, H, D in shapes:
        for S in lens:
            progress(f"{name} S={S}: each Triton stage alone")
            path = stage_cmp_path(S, HQ, H, D)
            times = kernel_breakdown(S, HQ, H, D, batch=batch, warmup_ms=warmup_ms, rep_ms=rep_ms, tune=tuned,
                                     cmp_path=path)
            out.extend(stage_rows(name, S, HQ, H, D, times, batch=batch, peak_tflops=peak_tflops,
                                  peak_tbps=peak_tbps, cmp_path=path))
    table = Table(title=f"NSA stages against the roofline ({peak_tflops:g} TFLOP/s, {peak_tbps:g} TB/s)")
    for col in ("shape", "S", "stage", "ms", "TFLOP/s", "GB/s", "roofline ms", "bound", "of roofline"):
        table.add_column(col, justify="right")
    for r in out:
        table.add_row(r.shape, str(r.seq_len), r.stage + (f" ({r.path})" if r.path not in ("", "kernel") else ""),
                      f"{r.ms:.3f}", f"{r.tflops:.0f}",
                      f"{r.mbytes / r.ms:.0f}" if r.ms > 0 else "-", f"{r.roofline_ms:.3f}", r.bound,
                      f"{r.of_roofline:.0%}")
    Console(width=200, stderr=as_json).print(table)
    return out


@bench_app.command("train", cls=command_class(json_path=True))
def train(
    config: Annotated[str, typer.Option("--config", help=options.config_help())] = "m7c-125m",
    seq_lens: Annotated[str, typer.Option("--seq-lens", help="Comma-separated sequence lengths.")] = "2048,16384",
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Batch size per sequence length.")] = "16,2",
    attention: Annotated[list[str] | None, typer.Option("--attention", help="nsa and/or dense; repeatable.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1)] = 10,
    warmup: Annotated[int, typer.Option("--warmup", min=0)] = 3,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value; repeatable.")] = None,
    tiny: Annotated[bool, typer.Option("--tiny", help="CPU-sized run: tiny config, seq 64, batch 2, 2 steps.")] = False,
    tune: Annotated[list[str] | None, typer.Option("--tune", help="Triton tile override key=value (sweeps).")] = None,
    modes: Annotated[str | None, typer.Option(
        "--modes", help="eager and/or compiled, comma-separated (default: both on CUDA, eager on CPU).")] = None,
    profile_step: Annotated[bool, typer.Option(
        "--profile-step", help="Profile one more step per row: kernels by time and launches (CPU: operators), in the JSON.")] = False,
    trace_dir: Annotated[Path | None, typer.Option(
        "--trace-dir", help="Also write that step's Chrome trace here, one file per row and rank (implies --profile-step).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", min=1, help="Run on N ranks of this node through torchrun (DDP, or FSDP with --set runtime.parallel=fsdp).")] = None,
    context_parallel: Annotated[int, typer.Option("--context-parallel", min=1, help="Ranks that share each sequence (docs/training.md, 'Training longer than one GPU holds').")] = 1,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
) -> None:
    """Training-step tokens/s, MFU and peak memory: NSA model vs the same model with dense attention,
    eager and compiled; on several ranks with --nproc-per-node (and context parallelism)."""
    with user_errors():
        from nsa.train.distributed import launched_by_torchrun

        under_torchrun = launched_by_torchrun()
        if context_parallel > 1 and nproc_per_node is None and not under_torchrun:
            raise fail(f"--context-parallel {context_parallel} needs ranks to share the sequence",
                       hint=f"add --nproc-per-node {context_parallel}")
        if nproc_per_node is not None and nproc_per_node % context_parallel:
            raise fail(f"--context-parallel {context_parallel} must divide --nproc-per-node {nproc_per_node}")
        tuned = _parse_tune(tune)
        from rich.console import Console
        from rich.table import Table

        from nsa.bench.train import bench_train, speedups
        from nsa.config import load_run_config
        from nsa.envinfo import environment
        from nsa.train.telemetry import MFU_FORMULA
        from nsa_cli import render

        atts = tuple(attention or ["nsa", "dense"])
        if any(a not in ("nsa", "dense") for a in atts):
            raise fail(f"--attention {list(atts)} must be nsa and/or dense")
        if tiny:
            config, lens, bss, steps, warmup = "tiny", [64], [2], 2, 1
        else:
            lens, bss = _ints(seq_lens, "--seq-lens"), _ints(batch_sizes, "--batch-sizes")
            if len(lens) != len(bss):
                raise fail("--batch-sizes needs one value per --seq-lens value")
        resolved = load_run_config(config=config, sets=set_)
        import torch

        device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
        names = [m.strip() for m in (modes or ("eager,compiled" if device == "cuda" else "eager")).split(",") if m.strip()]
        if not names or any(m not in ("eager", "compiled") for m in names):
            raise fail(f"--modes {modes!r} must be eager and/or compiled")
        flags = tuple(m == "compiled" for m in dict.fromkeys(names))
        if context_parallel > 1 and (bad := [n for n in lens if n % (2 * context_parallel)]):
            raise fail(f"--seq-lens {','.join(map(str, bad))}: each must split into {2 * context_parallel} equal "
                       f"chunks for --context-parallel {context_parallel}")
        if nproc_per_node is not None and not under_torchrun:
            import sys

            from nsa.train.launch import launch
            from nsa_cli.commands.train import torchrun_argv

            argv = torchrun_argv(nproc_per_node, sys.argv[1:])
            typer.echo(f"launching: {' '.join(argv[1:])}", err=True)
            if code := launch(argv):
                raise typer.Exit(code)
            return
        from nsa.bench.train import join_ranks

        ranks = join_ranks(context_parallel, device) if under_torchrun else None
        main = ranks is None or ranks[0].is_main

        def progress(r: Any) -> None:
            what = r.error or f"{r.tokens_per_s:,.0f} tokens/s, {r.step_ms:.1f} ms/step, peak {_fmt(r.peak_mib, '.0f')} MiB"
            if main:
                where = f" ranks {r.ranks}" if r.world_size > 1 else ""
                typer.echo(f"{r.attention} {r.mode} S={r.seq_len} b={r.batch_size}{where}: {what}", err=True)

        rows = bench_train(resolved.config, lens, bss, attentions=atts, steps=steps, warmup=warmup, device=device,
                           modes=flags, on_row=progress, tune=tuned, profile=profile_step, ranks=ranks,
                           trace_dir=trace_dir)
        if ranks is not None:
            from nsa.train.distributed import shutdown

            shutdown()
        if not main:
            return
        world = rows[0].world_size
        table = Table(title=f"training step ({rows[0].device}, config {config}, ranks {rows[0].ranks}; path: the "
                      "attention path that ran; batch: per data rank)")
        for col in ("attention", "path", "mode", "S", "batch", "params M", "step ms", "tokens/s", "tok/s/GPU", "MFU",
                    "peak MiB", "compile s"):
            table.add_column(col, justify="right")
        for r in rows:
            if r.error:
                table.add_row(r.attention, r.path, r.mode, str(r.seq_len), str(r.batch_size), "", r.error, "", "", "",
                              "", "")
                continue
            table.add_row(r.attention, r.path, r.mode, str(r.seq_len), str(r.batch_size), f"{r.params_m:.1f}",
                          f"{r.step_ms:.1f}", f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s_per_gpu:,.0f}",
                          _fmt(r.mfu, ".1%") if r.mfu else "-", _fmt(r.peak_mib, ".0f"),
                          _fmt(r.compile_s, ".0f") if r.compile_s else "-")
        Console(width=200, stderr=as_json).print(table)
        typer.echo(f"MFU: {MFU_FORMULA} (world_size {world})", err=as_json)
        ratio = speedups(rows)
        for key, x in ratio.items():
            typer.echo(f"{key}: NSA/dense tokens/s = {x:.2f}", err=as_json)
        for r in rows:
            if r.fallbacks:
                typer.echo(f"fallbacks ({r.attention}, S={r.seq_len}): {r.fallbacks}", err=as_json)
            if r.kernels:
                top = ", ".join(f"{k['name'][:40]} {k['ms']:.1f} ms" for k in r.kernels[:5])
                typer.echo(f"profile ({r.attention} {r.mode}, S={r.seq_len}): {r.launches} launches; {top}", err=as_json)
        render.json_outputs({"command": "bench train", "config": config, "environment": environment(), "tune": tuned,
                             "rows": [r.to_dict() for r in rows], "nsa_over_dense": ratio},
                            as_json=as_json, json_out=json_out)


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench`` with its commands (attention, train, decode, retrieval)."""
    bench_decode.register(bench_app)
    bench_retrieval.register(bench_app)
    bench_quality.register(bench_app)
    app.add_typer(bench_app, name="bench")
