"""``nsa dump``: the stacks of a live trainer (SIGUSR1 to the process holding the run lock)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa dump artifacts/m7c-125m           # stacks of every thread, printed and kept in stackdump_rank0.txt

  nsa dump artifacts/m7c-125m --json

The trainer's PID comes from RUN/.lock (the process must hold that lock open, so another process that got
the same PID is never signalled); the other ranks on this host from their boot lines. It is the process
a `kill -USR1 $(pgrep ...)` line may miss (that finds the tmux/bash wrapper, or another user's run).
Exit code 0 when a dump appeared, 1 when the trainer is not running or no dump appeared within --timeout,
2 when RUN_DIR is not a run directory, the trainer runs on another host or belongs to another user.
"""


def dump(
    run_dir: Annotated[Path, options.run_dir()],
    timeout: Annotated[float,
                       typer.Option("--timeout", help="Seconds to wait for the dump.", min=0.1)] = 10.0,
    as_json: Annotated[bool, options.json_flag("the outcome (the stacks in 'text')")] = False,
) -> None:
    """Send SIGUSR1 to the run's trainer (PID from RUN/.lock): it appends every thread's stack to
    stackdump_rank{r}.txt, even while blocked in a collective or a read; print what it wrote."""
    with user_errors():
        from nsa.runs.dump import dump_stacks

        outcome = dump_stacks(run_dir, timeout_s=timeout)
    raise typer.Exit(Output(as_json).result(outcome))


def register(app: typer.Typer) -> None:
    app.command("dump", epilog=EPILOG)(dump)
