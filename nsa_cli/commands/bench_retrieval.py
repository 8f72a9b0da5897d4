"""``nsa bench retrieval``: does the model learn long-range retrieval, and in how many steps?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def _request() -> type:
    from nsa.bench.requests import RetrievalRequest

    return RetrievalRequest


def retrieval(
    as_json: Annotated[bool, options.json_flag("the curves and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("the curves and environment")] = None,
    **fields: str,
) -> None:
    """Train each variant from scratch on key/value retrieval beyond the window; report steps to --target."""
    out = Output(as_json, json_out, always_human=True, wide=True)
    with user_errors():
        from nsa.bench.retrieval import retrieval_command

        result = retrieval_command(options.request(_request(), fields), say=out.say)
    raise typer.Exit(out.result(result))


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench retrieval``."""
    app.command("retrieval", cls=command_class(json_path=True, request=_request))(retrieval)
