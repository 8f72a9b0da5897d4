"""``nsa bench attention`` and ``nsa bench train``: timings as a table, or JSON (``--json``: stdout;
``--json-out PATH``: a file). Their options are the fields of the library's requests
(``nsa.bench.requests``)."""

from __future__ import annotations

import sys

import typer

from nsa_cli import options
from nsa_cli.commands import bench_decode, bench_quality, bench_retrieval
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

bench_app = typer.Typer(help="Benchmarks: NSA attention kernels, training steps and decode against dense "
                             "attention; retrieval learning.", no_args_is_help=True)


def _attention() -> type:
    from nsa.bench.requests import AttentionRequest

    return AttentionRequest


@bench_app.command("attention", cls=command_class(json_path=True, request=_attention))
def attention(as_json: options.RowsJson = False, json_out: options.RowsJsonOut = None, **fields: str) -> None:
    """Forward and forward+backward time and peak memory: NSA vs dense causal SDPA (and fla-core); with
    --stages each Triton stage's time against the machine's bound."""
    out = Output(as_json, json_out, always_human=True, wide=True)
    with user_errors():
        from nsa.bench.attention import attention_command

        result = attention_command(options.request(_attention(), fields),
                                   say=lambda line: out.say(line, err=True, wrap=False))
    raise typer.Exit(out.result(result))


def _train() -> type:
    from nsa.bench.requests import TrainBenchRequest

    return TrainBenchRequest


@bench_app.command("train", cls=command_class(json_path=True, request=_train))
def train(as_json: options.RowsJson = False, json_out: options.RowsJsonOut = None, **fields: str) -> None:
    """Training-step tokens/s, MFU and peak memory: NSA model vs the same model with dense attention,
    eager and compiled; on several ranks with --nproc-per-node (and context parallelism)."""
    out = Output(as_json, json_out, always_human=True, wide=True)
    with user_errors():
        from nsa.bench.train import train_command

        result = train_command(options.request(_train(), fields), argv=sys.argv[1:],
                               program=["-m", "nsa_cli"],
                               say=lambda line: out.say(line, err=True, wrap=False))
    raise typer.Exit(out.result(result))


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench`` with its commands (attention, train, decode, retrieval, quality)."""
    bench_decode.register(bench_app)
    bench_retrieval.register(bench_app)
    bench_quality.register(bench_app)
    app.add_typer(bench_app, name="bench")
