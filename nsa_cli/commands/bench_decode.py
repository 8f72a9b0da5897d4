"""``nsa bench decode``: NSA vs dense decode steps (attention-only and whole model), as a table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import fail, user_errors


def _ints(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise fail(f"{name}={text!r} must be comma-separated integers", hint=f"e.g. {name} 1024,65536") from None
    if not out or any(v < 1 for v in out):
        raise fail(f"{name}={text!r} must list positive integers")
    return out


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def decode(
    contexts: Annotated[str | None, typer.Option("--contexts", help="Comma-separated context lengths [default: 1024..65536; --tiny: 64,128].")] = None,
    batches: Annotated[str | None, typer.Option("--batches", help="Comma-separated batch sizes [default: 1,32; --tiny: 1,2].")] = None,
    shape: Annotated[list[str] | None, typer.Option("--shape", help="paper (HQ=64,H=4,D=128) and/or m7c (HQ=12,H=2,D=64); repeatable.")] = None,
    mode: Annotated[list[str] | None, typer.Option("--mode", help="attention and/or model; repeatable [default: both].")] = None,
    config: Annotated[str | None, typer.Option("--config", help=options.config_help("Config of the model rows [default: m7c-125m; --tiny: tiny]"))] = None,
    model_contexts: Annotated[str | None, typer.Option("--model-contexts", help="Contexts of the model rows [default: 2048,65536].")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override of the model rows' config, key=value (e.g. model.dense_layers=[] for every block NSA); repeatable.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="NSA decode path: auto (fused Triton step on CUDA), triton, or torch.")] = "auto",
    compile: Annotated[bool, typer.Option("--compile", help="NSA op / each block's decode step through torch.compile.")] = False,
    graphs: Annotated[bool, typer.Option("--graphs/--no-graphs", help="Also time CUDA-graph replays of each step.")] = True,
    tiny: Annotated[bool, typer.Option("--tiny", help="CPU-sized run (tiny shape and config, contexts 64/128).")] = False,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
) -> None:
    """Milliseconds per decode step and keys read per step: NSA caches vs a dense KV cache."""
    with user_errors():
        import torch
        from rich.console import Console
        from rich.table import Table

        from nsa.bench.decode import SHAPES, TINY_SHAPES, bench_decode
        from nsa.envinfo import environment
        from nsa_cli import render

        modes = tuple(mode or ["attention", "model"])
        if any(m not in ("attention", "model") for m in modes):
            raise fail(f"--mode {list(modes)} must be attention and/or model")
        known = TINY_SHAPES if tiny else SHAPES
        if shape and any(s not in known for s in shape):
            raise fail(f"--shape {shape} must be among: {', '.join(known)}")
        if backend not in ("auto", "torch", "triton"):
            raise fail(f"--backend {backend!r} must be auto, torch or triton")
        if not tiny and not torch.cuda.is_available():
            raise fail("no CUDA device for bench decode", hint="use --tiny on a CPU machine")
        rows = bench_decode(tiny=tiny, contexts=_ints(contexts, "--contexts"), batches=_ints(batches, "--batches"),
                            shapes=shape, model_config=config, model_contexts=_ints(model_contexts, "--model-contexts"),
                            modes=modes, graphs=graphs, backend=backend, compile=compile, sets=set_)
        if not rows:
            raise fail("nothing to measure")
        how = backend + (", compiled" if compile else "")
        table = Table(title=f"decode step: NSA ({how}) vs dense ({rows[0].device}, {rows[0].dtype})")
        for col in ("mode", "shape", "context", "batch", "nsa ms", "dense ms", "nsa graph ms", "dense graph ms",
                    "speed-up", "reads nsa", "reads dense", "reads x"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(r.mode, r.shape, str(r.context), str(r.batch), _fmt(r.nsa_ms), _fmt(r.dense_ms),
                          _fmt(r.nsa_graph_ms), _fmt(r.dense_graph_ms), _fmt(r.speedup, ".2f"),
                          _fmt(r.nsa_reads, ".0f"), _fmt(r.dense_reads, ".0f"), _fmt(r.reads_ratio, ".1f"))
        Console(width=200, stderr=as_json).print(table)
        for r in rows:
            for note in r.notes:
                typer.echo(f"note ({r.mode} {r.shape}, context {r.context}, batch {r.batch}): {note}", err=as_json)
        payload = {"command": "bench decode", "environment": environment(), "rows": [r.to_dict() for r in rows]}
        render.json_outputs(payload, as_json=as_json, json_out=json_out)


def register(bench_app: typer.Typer) -> None:
    """Add ``decode`` to the ``nsa bench`` sub-app."""
    bench_app.command("decode", cls=command_class(json_path=True))(decode)
