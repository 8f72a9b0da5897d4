"""The ``nsa`` command. Command modules import torch and the library only inside their functions.

Every command is registered here, statically: a command module that fails to import is an error of ``nsa``
itself (the traceback names the module), never a command missing from ``nsa --help``.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from nsa import __version__
from nsa.errors import NSAError
from nsa_cli.commands import (
    bench,
    dump,
    export,
    halt,
    preflight,
    profiles,
    report,
    sample,
    smoke,
    train,
    watch,
)
from nsa_cli.commands import eval as eval_command
from nsa_cli.errors import STATE

app = typer.Typer(
    name="nsa",
    help="Train and operate Native Sparse Attention language models.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module exposes ``register(app)``; order is the order of ``nsa --help``.
COMMAND_MODULES = (preflight, smoke, train, watch, halt, dump, report, sample, eval_command, export, profiles, bench)



def _version(value: bool) -> None:
    if value:
        typer.echo(f"nsa {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Train and operate Native Sparse Attention language models.

    Examples: nsa preflight --profile h100-80g | nsa train --config tiny --steps 60 | nsa watch artifacts/run
    """
    STATE["debug"] = debug


for _module in COMMAND_MODULES:
    _module.register(app)


def main() -> None:
    """Console entry point: user errors become one line and exit code 2."""
    try:
        app(standalone_mode=True)
    except NSAError as exc:  # raised outside a command's own handler
        if STATE["debug"]:
            raise
        typer.echo(f"error: {exc.one_line()}", err=True)
        sys.exit(2)
