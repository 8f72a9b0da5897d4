"""``nsa bench decode``: NSA vs dense decode steps (attention-only and whole model), as a table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def decode(
    contexts: Annotated[str | None,
                        typer.Option("--contexts",
                                     help="Comma-separated context lengths [default: 1024..65536; --tiny: "
                                          "64,128].")] = None,
    batches: Annotated[str | None,
                       typer.Option("--batches",
                                    help="Comma-separated batch sizes [default: 1,32; --tiny: 1,2].")] = None,
    shape: Annotated[list[str] | None,
                     typer.Option("--shape",
                                  help="paper (HQ=64,H=4,D=128) and/or m7c (HQ=12,H=2,D=64); "
                                       "repeatable.")] = None,
    mode: Annotated[list[str] | None,
                    typer.Option("--mode",
                                 help="attention and/or model; repeatable [default: both].")] = None,
    config: Annotated[str | None,
                      options.config("Config of the model rows [default: m7c-125m; --tiny: tiny]")] = None,
    model_contexts: Annotated[str | None,
                              typer.Option("--model-contexts",
                                           help="Contexts of the model rows [default: 2048,65536].")] = None,
    set_: Annotated[list[str] | None, options.sets(
        "Override of the model rows' config, key=value (e.g. model.dense_layers=[] for every block "
        "NSA)")] = None,
    backend: Annotated[str,
                       typer.Option("--backend",
                                    help="NSA decode path: auto (fused Triton step on CUDA), triton, or "
                                         "torch.")] = "auto",
    compile: Annotated[bool,
                       typer.Option("--compile",
                                    help="NSA op / each block's decode step through torch.compile.")] = False,
    graphs: Annotated[bool,
                      typer.Option("--graphs/--no-graphs",
                                   help="Also time CUDA-graph replays of each step.")] = True,
    tiny: Annotated[bool,
                    typer.Option("--tiny",
                                 help="CPU-sized run (tiny shape and config, contexts 64/128).")] = False,
    as_json: Annotated[bool, options.json_flag("rows and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("rows and environment")] = None,
) -> None:
    """Milliseconds per decode step and keys read per step: NSA caches vs a dense KV cache."""
    with user_errors():
        from nsa.bench.decode import decode_command

        result = decode_command(
            tiny=tiny, contexts=options.ints(contexts, "--contexts", "1024,65536"), shapes=shape,
            batches=options.ints(batches, "--batches", "1,32"), model_config=config, sets=set_, graphs=graphs,
            model_contexts=options.ints(model_contexts, "--model-contexts", "2048,65536"),
            modes=tuple(mode or ["attention", "model"]), backend=backend, compile=compile)
    raise typer.Exit(Output(as_json, json_out, always_human=True, wide=True).result(result))


def register(bench_app: typer.Typer) -> None:
    """Add ``decode`` to the ``nsa bench`` sub-app."""
    bench_app.command("decode", cls=command_class(json_path=True))(decode)
