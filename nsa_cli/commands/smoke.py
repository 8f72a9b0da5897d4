"""``nsa smoke``: preflight + parity + a short training run + a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import Command
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

# How long the CPU smoke takes (the README says the same; tests/test_cli_help.py holds them together).
CPU_DURATION = "under a minute"

EPILOG = f"""\
Examples:

  nsa smoke                                       # CPU: offline, embedded corpus, tiny config, {CPU_DURATION}

  nsa smoke --profile h100-80g                    # m7c-125m, 200 steps, the profile's floors

  nsa smoke --profile cpu --steps 30 --out-dir artifacts/smoke-cpu --json

Criteria: run completed, loss decreased, no non-finite values, tokens/s >= the profile's floor, fetch
p95 under its limit, gate health, fallback counters at zero, heartbeat fresh. Exit 1 on any FAIL.
"""


def smoke(
    profile: Annotated[str | None,
                       options.profile("Hardware profile (default: detected; cpu without CUDA).")] = None,
    steps: Annotated[int | None, typer.Option(
        "--steps", help="Training steps (default: the profile's smoke.steps).", min=2)] = None,
    config: Annotated[str | None, options.config("Run config (default: the profile's smoke.config)")] = None,
    out_dir: Annotated[Path | None, options.out_dir(
        "Run directory (default artifacts/smoke-<profile>-<time>).")] = None,
    skip_preflight: Annotated[bool, typer.Option(
        "--skip-preflight", help="Go straight to parity and training.")] = False,
    as_json: Annotated[bool, options.json_flag("the result")] = False,
) -> None:
    """Preflight, parity of every fast path on this device against the reference, a short training run,
    then a verdict against explicit criteria."""
    out = Output(as_json)
    with user_errors():
        from nsa.checks.smoke import run_smoke
        from nsa_cli.render.train import RichReporter

        report = run_smoke(profile, steps, config=config, out_dir=out_dir, skip_preflight=skip_preflight,
                           reporter=RichReporter(out.console),
                           on_stage=lambda name,
                           _: None if as_json else out.say(f"smoke: {name} done", "dim"))
    raise typer.Exit(out.result(report))


def register(app: typer.Typer) -> None:
    app.command("smoke", epilog=EPILOG, cls=Command)(smoke)
