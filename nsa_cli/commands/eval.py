"""``nsa eval``: does a trained model retrieve (needle, MQAR, the RULER-style suite), what is its held-out
loss, and how well does an NSA model's selection find what dense attention reads (selection)?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import fail, user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa eval artifacts/tiny --task needle --contexts 64,128 --depths 0,0.5,1 --samples 16

  nsa eval artifacts/prod --task needle --contexts 4k,16k --haystack text

  nsa eval artifacts/prod --task mqar --contexts 4096 --pairs 8 --queries 8

  nsa eval artifacts/prod/checkpoints/step_00050000 --task loss --contexts 2048,8192 --json-out loss.json

  nsa eval artifacts/tiny --task mqar --contexts 128 --json | jq .results

  nsa eval artifacts/tiny --task selection --contexts 128,512 --samples 8

  nsa eval artifacts/prod --task ruler --contexts 4k,16k,32k --samples 16

  nsa eval artifacts/prod/hf --task ruler --contexts 4k --ruler-tasks niah_single,vt

{tasks}

Results go to RUN/eval/<task>.json (and RUN/eval/needle.png, a depth x context heat map) unless
--no-save; `nsa report RUN` shows them. --json prints the same payload on stdout (the table goes to
stderr), --json-out PATH writes it there.
Exit code 0 on success, 2 for bad input (unknown task, a context above model.max_seq_len or too
short for the task, a depth outside [0, 1], a path without weights, the selection task on a dense model).
"""

def _floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise fail(f"{flag} {text!r} must be comma-separated numbers",
                   hint="e.g. 0,0.25,0.5,0.75,1") from None
    if not out:
        raise fail(f"{flag} {text!r} lists nothing", hint="e.g. 0,0.5,1")
    return out


Contexts = Annotated[str | None, typer.Option("--contexts", help="Comma-separated context lengths (4k = "
                                              "4096); default the run's train.seq_len.")]
Depths = Annotated[str, typer.Option("--depths", help="Needle depths in [0, 1] (0 = first token).")]
Samples = Annotated[int | None, typer.Option("--samples", min=1, help="Episodes per cell (needle 32, mqar "
                                             "32, ruler 16) or val sequences per context (loss 16, selection "
                                             "8).")]
Queries = Annotated[int | None, typer.Option("--queries", min=1, help="MQAR keys asked (default: --pairs); "
                                             "selection: query positions per layer (default 64).")]
Haystack = Annotated[str, typer.Option("--haystack", help="random (uniform filler; ruler: RULER's noise "
                                       "sentences) or text (the run's val split).")]


def eval_cmd(
    path: Annotated[Path, options.run_dir("Run directory, its export/ folder, a checkpoint folder or file.")],
    task: Annotated[str, typer.Option("--task", help="needle, mqar, ruler, loss or selection (NSA models).")],
    contexts: Contexts = None,
    depths: Depths = "0,0.25,0.5,0.75,1",
    samples: Samples = None,
    pairs: Annotated[int, typer.Option("--pairs", min=1, help="MQAR key/value pairs per episode.")] = 8,
    queries: Queries = None,
    haystack: Haystack = "random",
    ruler_tasks: Annotated[str | None, typer.Option(
        "--ruler-tasks", help="The ruler task's families, comma-separated (default: all).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the episodes (results are reproducible).")] = 0,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", min=1, help="Sequences per forward (default: about 32k tokens).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    as_json: Annotated[bool, options.json_flag("the results")] = False,
    json_out: Annotated[Path | None, options.json_out("the results")] = None,
    no_save: Annotated[bool, typer.Option("--no-save", help="Do not write RUN/eval/<task>.json (and "
                                          "needle.png).")] = False,
) -> None:
    """Score a trained model on needle retrieval or MQAR at chosen contexts, its held-out loss, or (NSA
    models) its selection recall, compressed entropy, scorer KL and gates per layer.

    Example: nsa eval artifacts/tiny --task needle --contexts 64,128 --depths 0,0.5,1 --samples 16
    """
    out = Output(as_json or str(json_out) == "-", always_human=True)
    with user_errors():
        from nsa.eval.run import EvalSpec
        from nsa.eval.view import evaluate

        spec = EvalSpec(task, options.ints(contexts, "--contexts", "4096,16384 or 4k,16k", kilo=True),
                        _floats(depths, "--depths") if task == "needle" else [], samples, pairs, queries,
                        haystack, seed, batch_size, device)
        if ruler_tasks is not None:
            spec.ruler_tasks = [t for t in ruler_tasks.replace(" ", "").split(",") if t]
        json_file = None if json_out is None or str(json_out) == "-" else json_out
        result = evaluate(path, spec, save=not no_save, json_out=json_file,
                          say=lambda line: out.say(line, err=True, wrap=False))
    raise typer.Exit(out.result(result))


def _tasks() -> dict[str, str]:
    from nsa.eval.run import TASK_NOTES

    return {"{tasks}": TASK_NOTES}


def register(app: typer.Typer) -> None:
    app.command("eval", epilog=EPILOG, cls=command_class(json_path=True, texts=_tasks))(eval_cmd)
