"""``nsa bench decode``: NSA vs dense decode steps (attention-only and whole model), as a table or JSON."""

from __future__ import annotations

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def _request() -> type:
    from nsa.bench.requests import DecodeRequest

    return DecodeRequest


def decode(as_json: options.RowsJson = False, json_out: options.RowsJsonOut = None, **fields: str) -> None:
    """Milliseconds per decode step and keys read per step: NSA caches vs a dense KV cache."""
    with user_errors():
        from nsa.bench.decode import decode_command

        result = decode_command(options.request(_request(), fields))
    raise typer.Exit(Output(as_json, json_out, always_human=True, wide=True).result(result))


def register(bench_app: typer.Typer) -> None:
    """Add ``decode`` to the ``nsa bench`` sub-app."""
    bench_app.command("decode", cls=command_class(json_path=True, request=_request))(decode)
