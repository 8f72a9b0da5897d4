"""``nsa bench retrieval``: does the model learn long-range retrieval, and in how many steps?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def retrieval(
    config: Annotated[str, options.config("Config of the model and nsa sections")] = "retrieval",
    set_: Annotated[list[str] | None, options.sets()] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", min=8, help="Model inputs per sequence.")] = 2048,
    gap: Annotated[int,
                   typer.Option("--gap", min=1,
                                help="The needle sits at least this many positions before the query.")] = 600,
    variants: Annotated[str,
                        typer.Option("--variants",
                                     help="Comma-separated: nsa, dense, window (NSA's window branch "
                                          "alone).")] = "dense,nsa",
    seeds: Annotated[str,
                     typer.Option("--seeds",
                                  help="Comma-separated seeds; each variant trains once per seed.")] = "0",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 6000,
    batch: Annotated[int, typer.Option("--batch", min=1)] = 16,
    lr: Annotated[float, typer.Option("--lr", min=0.0)] = 1e-3,
    eval_every: Annotated[int, typer.Option("--eval-every", min=1)] = 100,
    eval_samples: Annotated[int, typer.Option("--eval-samples", min=1)] = 256,
    target: Annotated[float,
                      typer.Option("--target", min=0.0, max=1.0,
                                   help="Accuracy whose first step is reported.")] = 0.5,
    tiny: Annotated[bool,
                    typer.Option("--tiny",
                                 help="CPU-sized run (the CI test's setting): 2-layer dim-32 model, S=128, "
                                      "gap 48, 1200 steps; overrides --seq-len, --gap, --steps.")] = False,
    as_json: Annotated[bool, options.json_flag("the curves and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("the curves and environment")] = None,
) -> None:
    """Train each variant from scratch on key/value retrieval beyond the window; report steps to --target."""
    out = Output(as_json, json_out, always_human=True, wide=True)
    with user_errors():
        from nsa.bench.retrieval import RetrievalRecipe, retrieval_command

        result = retrieval_command(
            config, list(set_ or []), [v for v in variants.replace(" ", "").split(",") if v],
            options.ints(seeds, "--seeds", "0,1", zero=True) or [], seq_len=seq_len, gap=gap, tiny=tiny,
            recipe=RetrievalRecipe(steps=steps, batch_size=batch, lr=lr, eval_every=eval_every,
                                   eval_samples=eval_samples, target=target), say=out.say)
    raise typer.Exit(out.result(result))


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench retrieval``."""
    app.command("retrieval", cls=command_class(json_path=True))(retrieval)
