"""Options shared by the commands, declared once so that they read the same everywhere: ``--json`` (JSON on
stdout), ``--json-out PATH`` (JSON to a file), ``--config`` (the shipped config names, filled in by
:class:`nsa_cli.compat.Command` from ``nsa.config.named_configs``), ``--set``, ``--profile``, ``--out-dir``
and the run-directory argument (a ``Path`` in every command); and the parsing of comma-separated lists."""

from __future__ import annotations

from typing import Any

import typer

from nsa_cli.compat import CONFIG_NAMES
from nsa_cli.errors import fail

RUN_DIR_HELP = "Run directory (train.out_dir)."
# a short flag means one thing in every command
SHORT = {"--config": "-c", "--profile": "-p", "--out-dir": "-o"}


def json_flag(what: str) -> Any:
    """``--json``: print ``what`` as JSON on stdout (and nothing else there)."""
    return typer.Option("--json", help=f"Print {what} as JSON on stdout.")


def json_out(what: str) -> Any:
    """``--json-out PATH``: write ``what`` as JSON to PATH (the older ``--json PATH`` is still read)."""
    return typer.Option("--json-out", help=f"Write {what} as JSON to this file ('-': stdout, as --json).")


def config(what: str = "Run config") -> Any:
    """``--config``/``-c``: a shipped name or a YAML path."""
    return typer.Option("--config", "-c", help=f"{what}: a shipped name ({CONFIG_NAMES}) or a YAML path.")


def sets(what: str = "Config override section.key=value") -> Any:
    """``--set section.key=value`` (repeatable)."""
    return typer.Option("--set", help=f"{what}; repeatable.")


def profile(what: str = "Hardware profile name or YAML path.") -> Any:
    return typer.Option("--profile", "-p", help=what)


def out_dir(what: str) -> Any:
    return typer.Option("--out-dir", "-o", help=what)


def run_dir(help: str = RUN_DIR_HELP) -> Any:
    """The run-directory argument of watch, halt, dump, sample and eval (a ``Path`` everywhere)."""
    return typer.Argument(help=help)


def ints(text: str | None, flag: str, example: str = "2048,8192", kilo: bool = False,
         zero: bool = False) -> list[int] | None:
    """The positive integers of a comma-separated ``text`` (``kilo``: ``4k`` = 4096; ``zero``: any integer, a
    seed); one line, exit 2, otherwise. ``None`` stays ``None`` (the option not given)."""
    if text is None:
        return None
    out = []
    for part in text.replace(" ", "").split(","):
        scale = 1024 if kilo and part[-1:] in ("k", "K") else 1
        try:
            out += [int(part[:-1] if scale > 1 else part) * scale] if part else []
        except ValueError:
            raise fail(f"{flag} {text!r} must be comma-separated integers",
                       hint=f"e.g. {flag} {example}") from None
    if not out or (not zero and any(v < 1 for v in out)):
        raise fail(f"{flag} {text!r} must list positive integers", hint=f"e.g. {flag} {example}")
    return out
