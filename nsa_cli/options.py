"""Options shared by the commands, declared once so that they read the same everywhere: ``--json`` (JSON on
stdout), ``--json-out PATH`` (JSON to a file), ``--config`` (the shipped config names, listed by
``nsa.config.named_configs``) and the run-directory argument (a ``Path`` in every command)."""

from __future__ import annotations

from typing import Any

import typer

from nsa.configs import named_configs  # a leaf: lists nsa/configs/*.yaml without loading the config package

RUN_DIR_HELP = "Run directory (train.out_dir)."


def json_flag(what: str) -> Any:
    """``--json``: print ``what`` as JSON on stdout (and nothing else there)."""
    return typer.Option("--json", help=f"Print {what} as JSON on stdout.")


def json_out(what: str) -> Any:
    """``--json-out PATH``: write ``what`` as JSON to PATH (the older ``--json PATH`` is still read)."""
    return typer.Option("--json-out", help=f"Write {what} as JSON to this file ('-': stdout, as --json).")


def config_help(what: str = "Run config") -> str:
    """Help of ``--config``: the shipped names, from the one function that lists them."""
    return f"{what}: a shipped name ({', '.join(named_configs())}) or a YAML path."


def run_dir(help: str = RUN_DIR_HELP) -> Any:
    """The run-directory argument of watch, halt, dump, sample and eval (a ``Path`` everywhere)."""
    return typer.Argument(help=help)
