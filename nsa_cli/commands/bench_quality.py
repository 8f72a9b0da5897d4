"""``nsa bench quality``: NSA recipes against dense attention on the same data, tokens, model and seeds."""

from __future__ import annotations

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def _request() -> type:
    from nsa.bench.requests import QualityRequest

    return QualityRequest


def quality(as_json: options.RowsJson = False, json_out: options.RowsJsonOut = None, **fields: str) -> None:
    """Train every arm on the same data and tokens; print held-out loss, selection recall and needle
    accuracy."""
    out = Output(as_json or str(json_out) == "-", always_human=True, wide=True)
    with user_errors():
        from nsa.bench.quality_view import quality_command

        req = options.request(_request(), {**fields, "json_out": None if str(json_out) == "-" else json_out})
        result = quality_command(req, show=lambda block: out.show([block]))
    raise typer.Exit(out.result(result))


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench quality``."""
    app.command("quality", cls=command_class(json_path=True, request=_request))(quality)
