"""The ``nsa`` command. Command modules import torch and the library only inside their functions.

Every command is registered here, statically: a command module that fails to import is an error of ``nsa``
itself (the traceback names the module), never a command missing from ``nsa --help``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer._click import exceptions as click  # typer vendors its click; its exceptions live here
from typer.core import TyperGroup

from nsa import __version__
from nsa.errors import NSAError
from nsa_cli import render
from nsa_cli.commands import (
    ack,
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
from nsa_cli.errors import EXIT_INTERRUPTED, EXIT_USAGE, STATE, usage_line


class Group(TyperGroup):
    """The ``nsa`` group: a usage error (``--steps abc``, an unknown option) is one ``error:`` line with a
    hint and exit code 2, not a box; Ctrl-C outside a command's own handling exits 130 with one line."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False,
                              windows_expand_args=windows_expand_args, **extra)
        except click.NoArgsIsHelpError as exc:  # `nsa`, `nsa bench`: the help, exit 2
            if not standalone_mode:
                raise
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            if not standalone_mode:
                raise
            render.echo(usage_line(exc) if isinstance(exc, click.UsageError)
                        else f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            if not standalone_mode:
                raise
            render.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if standalone_mode:
            code = rv if isinstance(rv, int) else 0
            if code == EXIT_USAGE and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                _rank_exit(code)
            sys.exit(code)
        return rv


def _rank_exit(code: int) -> None:
    """A torchrun rank refused its input (said in one line, its files closed, its process group destroyed):
    exit now, without the interpreter's teardown, where the distributed runtime's threads can outlive the
    store another node's launcher has closed and abort the process ("terminate called without an active
    exception", exit -6 instead of 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


app = typer.Typer(
    name="nsa",
    cls=Group,
    help="Train and operate Native Sparse Attention language models.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module exposes ``register(app)``; order is the order of ``nsa --help``.
COMMAND_MODULES = (preflight, smoke, train, watch, ack, halt, dump, report, sample, eval_command, export,
                   profiles, bench)


def _version(value: bool) -> None:
    if value:
        render.echo(f"nsa {__version__}")
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
            import traceback

            traceback.print_exc()
        render.echo(f"error: {exc.one_line()}", err=True)
        sys.exit(2)
