"""``nsa sample``: continue a prompt with a trained model, streaming the text as it is generated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import user_errors
from nsa_cli.render import Output


def sample(
    path: Annotated[Path, options.run_dir("Run directory, its export/ folder, a checkpoint folder or file.")],
    prompt: Annotated[str,
                      typer.Option("--prompt", help="Text to continue (empty: start a new document).")] = "",
    max_new_tokens: Annotated[int,
                              typer.Option("--max-new-tokens", "-n", min=1,
                                           help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 = greedy.")] = 0.8,
    top_k: Annotated[int | None,
                     typer.Option("--top-k", min=1, help="Sample among the k most likely tokens.")] = None,
    top_p: Annotated[float | None,
                     typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = None,
    seed: Annotated[int | None,
                    typer.Option("--seed", help="Seed of the sampler (reproducible output).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    stop_at_eot: Annotated[bool, typer.Option("--stop-at-eot/--no-stop-at-eot",
                                              help="Stop at the end-of-document token.")] = True,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph/--no-cuda-graph",
                                             help="Replay each decode step as a CUDA graph (CUDA "
                                                  "only).")] = False,
) -> None:
    """Generate a continuation of --prompt with the run's exported model (or newest checkpoint).

    Example: nsa sample artifacts/tiny --prompt "Once upon a time" --max-new-tokens 100 --seed 1
    """
    out = Output()
    with user_errors():
        from nsa.eval.sampler import sample_text

        sampling = sample_text(path, prompt, max_new_tokens, device=device, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, stop_at_eot=stop_at_eot,
                               cuda_graph=cuda_graph)
        out.say(sampling.header, err=True, wrap=False)
        for piece in sampling.pieces:
            out.stream(piece)
        out.stream("\n")


def register(app: typer.Typer) -> None:
    app.command("sample",
                cls=command_class(short={"-p": ("--prompt", "-p means --profile in every command")}))(sample)
