"""``nsa halt``: ask a run to checkpoint and stop."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa halt artifacts/tiny                                   # write .HALT and return

  nsa halt artifacts/m7c-125m --reason "node maintenance" --wait

  nsa halt artifacts/m7c-125m --wait --timeout 900 --json

The trainer checks .HALT every step: it saves a checkpoint, logs a halt event and exits 0.
Exit code 0 when written (or acknowledged with --wait), 1 on timeout or a crashed trainer, 2 when
RUN_DIR is not a run directory or .HALT cannot be written there (read-only, no permission).
"""


def halt(
    run_dir: Annotated[Path, options.run_dir()],
    reason: Annotated[str, typer.Option(
        "--reason", "-r", help="Why (recorded in .HALT and the heartbeat).")] = "operator request",
    wait: Annotated[bool,
                    typer.Option("--wait",
                                 help="Follow the heartbeat until the trainer acknowledges.")] = False,
    timeout: Annotated[float,
                       typer.Option("--timeout", help="Seconds to wait with --wait.", min=0.1)] = 600.0,
    as_json: Annotated[bool, options.json_flag("the outcome")] = False,
) -> None:
    """Write RUN_DIR/.HALT atomically (reason, time, who); with --wait, report the final checkpoint."""
    out = Output(as_json)
    with user_errors():
        from nsa.runs.halt import halt_run

        if wait:
            out.say(f"writing .HALT in {run_dir}, then waiting up to {timeout:g} s for the trainer to "
                    "acknowledge...")
        outcome = halt_run(run_dir, reason, wait=wait, timeout_s=timeout)
    raise typer.Exit(out.result(outcome))


def register(app: typer.Typer) -> None:
    app.command("halt", epilog=EPILOG)(halt)
