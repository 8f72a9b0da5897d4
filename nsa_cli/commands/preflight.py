"""``nsa preflight``: is this machine ready for a run?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import Command
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa preflight                                  # this machine, default config

  nsa preflight --profile cpu --config tiny

  nsa preflight --profile h100-80g --config m7c-125m --json > preflight.json

Exit code 0 when nothing FAILs (WARNs are fine), 1 on any FAIL, 2 on a usage error.
"""


def preflight(
    profile: Annotated[str | None, options.profile()] = None,
    config: Annotated[str | None, options.config()] = None,
    out_dir: Annotated[Path | None, options.out_dir(
        "Where the run will write (disk check); default train.out_dir.")] = None,
    sets: Annotated[list[str] | None, options.sets()] = None,
    data_timeout: Annotated[float, typer.Option("--data-timeout", help="Dataset probe timeout, seconds.",
                                                min=0.1)] = 10.0,
    as_json: Annotated[bool, options.json_flag("the checks")] = False,
) -> None:
    """Check Python, torch, Triton, flash-attn, GPUs (NVML), bf16, an NSA forward+backward against the
    reference, disk, RAM, dataset, tokenizer, config and git: PASS / WARN / FAIL with a fix hint each."""
    with user_errors():
        from nsa.checks.preflight import run_preflight

        report = run_preflight(profile, config, out_dir=out_dir, data_timeout_s=data_timeout, sets=sets)
    raise typer.Exit(Output(as_json).result(report))


def register(app: typer.Typer) -> None:
    app.command("preflight", epilog=EPILOG, cls=Command)(preflight)
