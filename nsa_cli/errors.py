"""Turning library errors into one line (through the output sink, :mod:`nsa_cli.render`) and an exit code."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import typer

from nsa.errors import NSAError
from nsa_cli import render

EXIT_OK, EXIT_USAGE = 0, 2
EXIT_INTERRUPTED = 130  # the operator's Ctrl-C (128 + SIGINT, as shells report it)

# process-wide CLI state: ``--debug`` (set by the app's callback) shows tracebacks instead of one line
STATE = {"debug": False}


def fail(message: str, hint: str | None = None, code: int = EXIT_USAGE) -> typer.Exit:
    """Print ``error: message (hint: ...)`` to stderr and return the Exit to raise."""
    render.error(message, hint)
    return typer.Exit(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Wrap a command body: ``NSAError`` -> one line on stderr, exit 2 (with ``--debug`` the traceback first,
    and still exit 2)."""
    try:
        yield
    except NSAError as exc:
        debug_traceback()
        raise fail(exc.message, exc.hint) from None
    except FileNotFoundError as exc:
        debug_traceback()
        raise fail(f"file not found: {exc.filename}") from None


def debug_traceback() -> None:
    """With ``--debug``: the traceback of the exception being handled, on stderr."""
    if STATE["debug"]:
        traceback.print_exc(file=sys.stderr)


def usage_line(exc: Any) -> str:
    """A click usage error as one line: ``error: Invalid value for '--steps': ... (hint: nsa train
    --help)``."""
    text = " ".join(str(exc.format_message()).split())
    ctx = getattr(exc, "ctx", None)
    where = f"{ctx.command_path} --help" if ctx is not None else "nsa --help"
    return f"error: {text} (hint: {where})"
