"""The ``nsa`` command. Command modules import torch and the library only inside their functions."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated

import typer

from nsa import __version__

app = typer.Typer(
    name="nsa",
    help="Train and operate Native Sparse Attention language models.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module exposes ``register(app)``; order is the order of ``nsa --help``.
COMMAND_MODULES = ["preflight", "smoke", "train", "watch", "halt", "dump", "report", "sample", "eval", "profiles", "bench"]

STATE = {"debug": False}


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


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"nsa_cli.commands.{name}")
        except ModuleNotFoundError as exc:  # a command still being written in this checkout
            if exc.name == f"nsa_cli.commands.{name}":
                continue
            raise
        module.register(app)


_register_all()


def main() -> None:
    """Console entry point: user errors become one line and exit code 2."""
    from nsa.errors import NSAError

    try:
        app(standalone_mode=True)
    except NSAError as exc:  # raised outside a command's own handler
        if STATE["debug"]:
            raise
        typer.echo(f"error: {exc.one_line()}", err=True)
        sys.exit(2)
