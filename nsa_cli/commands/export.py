"""``nsa export``: a trained model in another format (Hugging Face transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.errors import fail, user_errors
from nsa_cli.render import Output

FORMATS = ("hf",)

EPILOG = """\
Examples:

  nsa export artifacts/tiny --format hf artifacts/tiny-hf

  nsa export artifacts/m7c-125m/checkpoints/step_00050000 --format hf m7c-hf --overwrite --json

OUT then loads offline with transformers (trust_remote_code: the folder carries its modelling code):
AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True), AutoTokenizer.from_pretrained(OUT).
With the nsa package installed it decodes with nsa's kernels and caches; without it, with a standalone torch
implementation (slow). train.init_from=OUT starts a new run from it. Exit code 0 when written, 2 on bad input
(no weights at RUN, weights that do not match their recorded SHA-256, OUT not empty without --overwrite, OUT
that holds the run or any run directory or is not an earlier export, OUT that cannot be written, a tokenizer
whose files are not on this machine).
"""


def export(
    path: Annotated[Path, options.run_dir("Run directory, its export/ folder, a checkpoint folder or file.")],
    out: Annotated[Path, typer.Argument(help="Folder to write (created; must be empty unless --overwrite).")],
    fmt: Annotated[str,
                   typer.Option("--format",
                                help=f"Output format: {', '.join(FORMATS)} (Hugging Face).")] = "hf",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export at OUT.")] = False,
    as_json: Annotated[bool, options.json_flag("what was written")] = False,
) -> None:
    """Write a trained model (its export/ or newest verified checkpoint) to OUT in another format."""
    if fmt not in FORMATS:
        raise fail(f"--format {fmt} is not a known format", hint=f"use one of: {', '.join(FORMATS)}")
    with user_errors():
        from nsa.hf import export_hf

        result = export_hf(path, out, overwrite=overwrite)
    raise typer.Exit(Output(as_json).result(result))


def register(app: typer.Typer) -> None:
    app.command("export", epilog=EPILOG)(export)
