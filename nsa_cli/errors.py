"""Turning library errors into one line and an exit code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from nsa.errors import NSAError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_WATCHDOG = 3  # the watchdog halted the run (nsa.rundir.layout.EXIT_WATCHDOG; kept light: no import here)


def fail(message: str, hint: str | None = None, code: int = EXIT_USAGE) -> typer.Exit:
    """Print ``error: message (hint: ...)`` to stderr and return the Exit to raise."""
    text = f"error: {message}" + (f" (hint: {hint})" if hint else "")
    typer.echo(text, err=True)
    return typer.Exit(code)


# process-wide CLI state: ``--debug`` (set by the app's callback) shows tracebacks instead of one line
STATE = {"debug": False}


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Wrap a command body: ``NSAError`` -> one line on stderr, exit 2 (traceback with --debug)."""
    try:
        yield
    except NSAError as exc:
        if STATE["debug"]:
            raise
        raise fail(exc.message, exc.hint) from None
    except FileNotFoundError as exc:
        if STATE["debug"]:
            raise
        raise fail(f"file not found: {exc.filename}") from None
