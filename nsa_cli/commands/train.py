"""``nsa train``: parse, train (``nsa.launch.train_run``: one process, or several through torchrun), exit with
its code. The flags that set config keys are derived from the config fields' metadata (``nsa.config.fields``)
when the command is first parsed or its help shown, so ``nsa --help`` loads no config."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.compat import Command
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def train(
    config: Annotated[str | None, options.config()] = None,
    profile: Annotated[str | None, options.profile()] = None,
    set_: Annotated[list[str] | None, options.sets("section.key=value for any config key")] = None,
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", min=1, help="Launch torchrun with "
                                                       "N ranks on this node (runtime.parallel: ddp or "
                                                       "fsdp).")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes of a multi-node run (with "
                                        "--nproc-per-node and --rdzv-endpoint).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This node's index, 0..nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0, which "
                                                      "hosts the rendezvous store (static rendezvous); the "
                                                      "same on every node.")] = None,
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="Job id shared by the nodes of one run.")] = "nsa",
    **flags: Any,
) -> None:
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

        req = TrainRequest(config, profile, flags, set_, nproc_per_node, nnodes, node_rank, rdzv_endpoint,
                           rdzv_id, argv=sys.argv[1:], program=["-m", "nsa_cli"])
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
    """``nsa train`` with its config flags, derived when its options are first read."""

    def complete(self, params: list[Any]) -> list[Any]:
        from nsa.config.fields import train_flags

        sig = inspect.signature(train, eval_str=True)
        base = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]

        def full(**kwargs: Any) -> None:
            train(**kwargs)

        full.__signature__ = sig.replace(parameters=base
                                         + [_flag_param(f)
                                            for f in train_flags()])  # type: ignore[attr-defined]
        sub = typer.Typer(add_completion=False)
        sub.command()(full)
        built = typer.main.get_command(sub)
        self.callback = built.callback
        return super().complete([*built.params])


def register(app: typer.Typer) -> None:
    app.command("train", cls=TrainCommand)(train)  # its options: TrainCommand.complete
