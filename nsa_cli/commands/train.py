"""``nsa train``: parse, train (``nsa.launch.train_run``: one process, or several through torchrun), exit with
its code. The flags that set config keys are derived from the config fields' metadata (``nsa.config.fields``)
when the command is first parsed or its help shown, so ``nsa --help`` loads no config."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.compat import Command
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def train(**given: str) -> None:
    """Train a model; writes the run directory (checkpoints, heartbeats, CSV, TensorBoard, export).

    Halt with a .HALT file in the run directory (nsa halt), SIGTERM or Ctrl-C: checkpoint, then exit 0.

    Precedence, lowest to highest: defaults < --config (or the older CONFIG=path) < --profile < NSA_*
    environment < flags < --set.
    Exit codes: 0 completed or halted on request (nsa halt, SIGTERM/SIGINT), 1 failed (non-finite
    loss/gradients or a crash), 2 bad input, 3 halted by the watchdog (nsa watch --halt-on).
    Example: nsa train --config tiny --steps 60
    """
    out = Output()
    with user_errors():
        from nsa.launch import TrainRequest, train_run
        from nsa_cli.render.train import RichReporter

        names = {f.name for f in dataclasses.fields(TrainRequest)}
        req = options.request(TrainRequest, {k: v for k, v in given.items() if k in names} | {
            "flags": {k: v for k, v in given.items() if k not in names}, "argv": sys.argv[1:],
            "program": ["-m", "nsa_cli"]})
        outcome = train_run(req, reporter=RichReporter(out.console), say=lambda line: out.say(line, err=True))
    raise typer.Exit(out.result(outcome))


def _flag_param(flag: Any) -> inspect.Parameter:
    """A config flag (``nsa.config.fields.Flag``) as a keyword parameter Typer reads: a ``--x/--no-x`` switch
    for a boolean, a ``Path`` for a directory, unset (``None``) by default."""
    decls = [f"{flag.flag}/--no-{flag.flag[2:]}"] if flag.kind is bool else [flag.flag]
    kind = Path if flag.name.endswith("_dir") else flag.kind
    opt = typer.Option(*decls, *([options.SHORT[flag.flag]] if flag.flag in options.SHORT else []),
                       help=flag.help)
    return inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[kind | None, opt])


class TrainCommand(Command):
    """``nsa train`` with its config flags (after its own options), derived when its options are first
    read."""

    derive_first = False

    def derive(self) -> list[inspect.Parameter]:
        from nsa.config.fields import train_flags
        from nsa.launch import TrainRequest

        return [*options.request_params(TrainRequest), *(_flag_param(f) for f in train_flags())]


def register(app: typer.Typer) -> None:
    app.command("train", cls=TrainCommand)(train)  # its options: TrainCommand.complete
