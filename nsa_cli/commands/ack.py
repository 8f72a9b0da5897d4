"""``nsa ack``: acknowledge the open alarms ``nsa watch`` kept with a run, with a reason kept in the run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa ack artifacts/m7c-125m --reason "node rebooted; resumed from step 20000"

  nsa ack artifacts/m7c-125m --rule crashed --rule stale --reason "NFS outage, resumed" --json

An alarm of RUN/alarms.jsonl fails `nsa report` while it is open. It closes by itself when a later session
of the run ends cleanly (completed, or halted on request); otherwise acknowledge it here: one "ack" record
per alarm (rule, session, reason, who) is appended to RUN/alarms.jsonl, and the report lists the alarm as
acknowledged with the reason. Exit code 0 when acknowledged (or nothing was open), 2 without --reason, for a
rule with no open alarm, or when RUN_DIR is not a run directory or cannot be written.
"""


def ack(
    run_dir: Annotated[Path, options.run_dir()],
    reason: Annotated[str, typer.Option(
        "--reason", help="Why the alarm needs no further action (required; kept in the run).")],
    rule: Annotated[list[str] | None, typer.Option(
        "--rule", help="Only this rule's alarms (repeatable; default every open alarm).")] = None,
    as_json: Annotated[bool, options.json_flag("the alarms acknowledged")] = False,
) -> None:
    """Acknowledge the open alarms of RUN_DIR (all, or --rule's), with a reason kept in RUN/alarms.jsonl."""
    with user_errors():
        from nsa.runs.alarms import ack_run

        done = ack_run(run_dir, reason, rule or None)
    raise typer.Exit(Output(as_json).result(done))


def register(app: typer.Typer) -> None:
    app.command("ack", epilog=EPILOG)(ack)
