"""``nsa report``: the daily test report (markdown + PNG charts) from run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa report                                      # newest run under artifacts/

  nsa report artifacts/tiny

  nsa report artifacts/s512 artifacts/s1024 artifacts/s2048 --title "Selection perf matrix"

  nsa report artifacts/tiny --out /tmp/reports --json

  nsa report artifacts/tiny --out /tmp/tiny.md --force      # this file, replaced if it exists

  nsa report artifacts/m7c-125m --limits strict-h100.yaml   # a profile whose monitor: block sets the limits

  nsa report artifacts/m7c-125m --note "restarted after a node reboot" --note-file deviations.md

Default output: Documentation/Reports/<yyyy-mm-dd> Test Engineer Report - <run name> v<N>.md
The verdict checks each figure against the run's saved monitor.* limits (throughput floor over the median
and the slowest window, the tail against the run's median, fetch p95, gate entropy/collapse, GPU memory
ceiling, eval accuracy; a limit not set does not judge); a run that trained on synthetic data after its
source failed, that nsa watch raised alarms on (RUN/alarms.jsonl), or whose heartbeat is older than its
own monitor.stale_s is FAIL; a watchdog halt (a hang: stale heartbeat) is FAIL, an operator's halt is not.
Exit code 0 for PASS, RUNNING or INCOMPLETE, 1 when the verdict is FAIL, 2 for bad input or an
output path that cannot be written.
"""


def report(
    run_dirs: Annotated[list[Path] | None,
                        typer.Argument(help="Run directories (default: newest under artifacts/).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Report folder (default Documentation/Reports), or a .md file to write.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the --out file if it exists.")] = False,
    title: Annotated[str | None,
                     typer.Option("--title", help="Name used in the title and file name.")] = None,
    artifacts: Annotated[Path,
                         typer.Option("--artifacts",
                                      help="Where to look for the newest run.")] = Path("artifacts"),
    no_charts: Annotated[bool, typer.Option("--no-charts", help="Skip the PNG charts.")] = False,
    limits: Annotated[str | None, typer.Option(
        "--limits",
                                               help="Profile name or YAML path whose monitor: block "
                                                    "overrides the runs' saved limits.")] = None,
    note: Annotated[list[str] | None, typer.Option(
        "--note", help="Engineer's note or deviation for the report; repeatable.")] = None,
    note_file: Annotated[list[str] | None, typer.Option(
        "--note-file", help="Markdown/text file of notes ('-': stdin); repeatable.")] = None,
    as_json: Annotated[bool, options.json_flag("the report path and verdicts")] = False,
) -> None:
    """Verdict with its checks (figure, limit, result), git state, versions, profile and environment
    (NSA_*, CUDA_*, NCCL_*, PYTORCH_*; secrets redacted), config, tokens/s trend, charts (loss with
    validation points and checkpoint/halt/resume markers, tokens/s, memory, gates, fetch, lr/grad norm),
    gate health, counters, evaluation, anomalies/halts/resumes, notes and links to artifacts."""
    with user_errors():
        from nsa.runs.report import build_report

        res = build_report(run_dirs or None, out, artifacts_root=artifacts, title=title, charts=not no_charts,
                           force=force, limits=limits, notes=note or [], note_files=note_file or [])
    raise typer.Exit(Output(as_json).result(res))


def register(app: typer.Typer) -> None:
    app.command("report", epilog=EPILOG, cls=command_class(
        short={"-o": ("--out", "-o means --out-dir in every command")}))(report)
