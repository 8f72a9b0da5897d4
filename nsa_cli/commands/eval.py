"""``nsa eval``: does a trained model retrieve (needle, MQAR, the RULER-style suite), what is its held-out loss, and
how well does an NSA model's selection find what dense attention reads (selection)?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import fail, user_errors

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

The ruler task (RULER's families, generated locally from --seed; nsa.eval.ruler): niah_single, niah_multikey,
niah_multivalue, niah_multiquery (needles of 7-digit numbers under pseudo-word keys), vt (variable tracking
through 4 hops), cwe (the 10 most common words of a numbered list), fwe (the 3 most frequent coded words). The
haystack is RULER's noise sentences (--haystack random, the default) or the run's val split (--haystack text).
A value is right when the model predicts every token of it reading the episode once; a cell scores the mean
share of values right; the mean row averages the tasks. A Hugging Face export (nsa export --format hf) evaluates
like its run.

The selection task (NSA models) measures per layer, on the run's val split: recall (share of the dense
attention mass, same q/k, inside the selected blocks; 1 = nothing lost), its ceiling (the mass in the best
blocks selection could choose: below 1 when dense attention spreads over more blocks than it keeps),
compressed entropy (1 = uniform), the scorer KL and the mean gates; averaged over --samples sequences at --queries positions
per layer (default 64). At a context <= n_sel * l_sel every block is selected and recall is not measured.

Results go to RUN/eval/<task>.json (and RUN/eval/needle.png, a depth x context heat map) unless
--no-save; `nsa report RUN` shows them. --json prints the same payload on stdout (the table goes to
stderr), --json-out PATH writes it there.
Exit code 0 on success, 2 for bad input (unknown task, a context above model.max_seq_len or too
short for the task, a depth outside [0, 1], a path without weights, the selection task on a dense model).
"""

def _ints(text: str, flag: str) -> list[int]:
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        try:
            out.append(int(part[:-1] if scale > 1 else part) * scale)
        except ValueError:
            raise fail(f"{flag} {text!r} must be comma-separated integers", hint="e.g. 4096,16384 or 4k,16k") from None
    if not out:
        raise fail(f"{flag} {text!r} lists nothing", hint="e.g. 4096,16384")
    return out


def _floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise fail(f"{flag} {text!r} must be comma-separated numbers", hint="e.g. 0,0.25,0.5,0.75,1") from None
    if not out:
        raise fail(f"{flag} {text!r} lists nothing", hint="e.g. 0,0.5,1")
    return out


def _each_document(settings: dict[str, Any]) -> str:
    """What a heading adds for a run trained with ``data.document_mask`` (read document by document)."""
    return ", each document on its own: data.document_mask" if settings.get("documents") else ""


def _style(acc: float) -> str:
    return "green" if acc >= 0.9 else "yellow" if acc >= 0.5 else "red"


def _selection_tables(payload: dict[str, Any]) -> list[tuple[str, Any]]:
    """One heading and table per context: layer, recall, its ceiling, compressed entropy, KL, gates."""
    from rich.table import Table

    from nsa.eval.results import context_label

    rows, s = payload["results"], payload["settings"]
    name = Path(str(payload["run"] or payload["checkpoint"])).name
    out = []
    for c in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == c]
        heading = (f"selection of {name} at context {context_label(c)} ({here[0]['n']} val sequences, "
                   f"{s['queries']} query positions per layer{_each_document(s)})")
        short = any(r.get("recall") is None for r in here)
        t = Table(caption="–: all blocks selected at this length" if short else None)
        for col in ("layer", "recall", "recall ceiling", "forced blocks", "compressed entropy", "KL", "gates cmp/sel/win"):
            t.add_column(col, justify="right")
        for r in here:
            gates = "/".join(f"{g:.2f}" for g in r["gates"]) if r.get("gates") else "n/a"
            if r.get("recall") is None:
                t.add_row(str(r["layer"]), "–", "–", "–", "–", "–", gates)
                continue
            rec = r["recall"]
            t.add_row(str(r["layer"]), f"[{_style(rec)}]{rec:.3f}[/]", _num(r.get("recall_best")),
                      _num(r.get("recall_forced")), _num(r.get("cmp_entropy")), _num(r.get("kl")), gates)
        out.append((heading, t))
    return out


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _tables(payload: dict[str, Any]) -> list[tuple[str, Any]]:
    """Heading lines and Rich tables of the results (one per context for the selection task)."""
    if payload["task"] == "selection":
        return _selection_tables(payload)
    return [_table(payload)]


def _grid(rows: list[dict[str, Any]], key: str, value: str, labels: list[str], keys: list[Any]) -> Any:
    """A Rich table of ``rows``' ``value`` (coloured): a row per ``key`` (``keys``, shown as ``labels``), a column
    per context."""
    from rich.table import Table

    from nsa.eval.results import context_label

    contexts = sorted({r["context"] for r in rows})
    cell = {(r[key], r["context"]): r[value] for r in rows}
    t = Table()
    t.add_column(f"{key} \\ context", justify="right")
    for c in contexts:
        t.add_column(context_label(c), justify="right")
    for label, k in zip(labels, keys, strict=True):
        cells = [cell.get((k, c)) for c in contexts]
        t.add_row(label, *("-" if v is None else f"[{_style(v)}]{v:.2f}[/]" for v in cells))
    return t


def _table(payload: dict[str, Any]) -> tuple[str, Any]:
    """A heading line and the Rich table of the results."""
    from rich.table import Table


    task, rows, s = payload["task"], payload["results"], payload["settings"]
    name = Path(str(payload["run"] or payload["checkpoint"])).name
    if task == "needle":
        heading = f"needle accuracy of {name} ({s['samples']} samples per cell, haystack {s['haystack']})"
        depths = sorted({r["depth"] for r in rows})
        return heading, _grid(rows, "depth", "accuracy", [f"{d:g}" for d in depths], depths)
    if task == "ruler":
        heading = (f"RULER-style suite of {name} ({s['samples']} episodes per cell, haystack {s['haystack']}; "
                   "score: the share of answer values right; answer nll: nats per answer token, over the tasks)")
        tasks = list(dict.fromkeys(r["task"] for r in rows))
        t = _grid(rows, "task", "score", tasks, tasks)
        nll = {r["context"]: r.get("answer_nll") for r in rows if r["task"] == "mean"}
        t.add_row("answer nll", *("-" if nll.get(c) is None else f"{nll[c]:.3f}" for c in sorted(nll)))
        return heading, t
    if task == "mqar":
        heading = f"MQAR accuracy of {name} ({s['pairs']} pairs, {s['queries']} queries, {s['samples']} samples)"
        t = Table()
        for col in ("context", "accuracy", "keys asked"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r["context"]), f"[{_style(r['accuracy'])}]{r['accuracy']:.3f}[/]", str(r["n"]))
        return heading, t
    heading = f"held-out loss of {name} on the val split ({s['samples']} sequences per context{_each_document(s)})"
    t = Table()
    for col in ("context", "loss", "bits/byte", "tokens"):
        t.add_column(col, justify="right")
    t.add_column("loss by position in the window", justify="left")
    for r in rows:
        loss, bpb = r["loss"], r["bits_per_byte"]
        by_pos = "  ".join(f"{b['start']}-{b['end']}: {b['loss']:.3f}" for b in r.get("by_position", []))
        t.add_row(str(r["context"]), "n/a" if loss is None else f"{loss:.4f}", "n/a" if bpb is None else f"{bpb:.4f}",
                  f"{r['n']:,}", by_pos)
    return heading, t


def eval_cmd(
    path: Annotated[Path, options.run_dir("Run directory, its export/ folder, a checkpoint folder or file.")],
    task: Annotated[str, typer.Option("--task", help="needle, mqar, ruler, loss or selection (NSA models).")],
    contexts: Annotated[str | None, typer.Option(
        "--contexts", help="Comma-separated context lengths (4k = 4096); default the run's train.seq_len.")] = None,
    depths: Annotated[str, typer.Option("--depths", help="Needle depths in [0, 1] (0 = first token).")] = "0,0.25,0.5,0.75,1",
    samples: Annotated[int | None, typer.Option(
        "--samples", min=1, help="Episodes per cell (needle 32, mqar 32, ruler 16) or val sequences per context "
        "(loss 16, selection 8).")] = None,
    pairs: Annotated[int, typer.Option("--pairs", min=1, help="MQAR key/value pairs per episode.")] = 8,
    queries: Annotated[int | None, typer.Option(
        "--queries", min=1, help="MQAR keys asked (default: --pairs); selection: query positions per layer (default 64).")] = None,
    haystack: Annotated[str, typer.Option(
        "--haystack", help="random (uniform filler; ruler: RULER's noise sentences) or text (the run's val split).")] = "random",
    ruler_tasks: Annotated[str | None, typer.Option(
        "--ruler-tasks", help="The ruler task's families, comma-separated (default: all).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the episodes (results are reproducible).")] = 0,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", min=1, help="Sequences per forward (default: about 32k tokens).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    as_json: Annotated[bool, options.json_flag("the results")] = False,
    json_out: Annotated[Path | None, options.json_out("the results")] = None,
    no_save: Annotated[bool, typer.Option("--no-save", help="Do not write RUN/eval/<task>.json (and needle.png).")] = False,
) -> None:
    """Score a trained model on needle retrieval or MQAR at chosen contexts, its held-out loss, or (NSA models)
    its selection recall, compressed entropy, scorer KL and gates per layer.

    Example: nsa eval artifacts/tiny --task needle --contexts 64,128 --depths 0,0.5,1 --samples 16
    """
    from nsa_cli import render

    with user_errors():
        from nsa.errors import NSAError
        from nsa.eval.results import save_results, to_json, write_json
        from nsa.eval.run import EvalSpec, run_eval

        spec = EvalSpec(task, contexts=_ints(contexts, "--contexts") if contexts is not None else None,
                        depths=_floats(depths, "--depths") if task == "needle" else [], samples=samples, pairs=pairs,
                        queries=queries, haystack=haystack, seed=seed, batch_size=batch_size, device=device)
        if ruler_tasks is not None:
            spec.ruler_tasks = [t for t in ruler_tasks.replace(" ", "").split(",") if t]
        to_stdout = as_json or str(json_out) == "-"
        console = render.console(stderr=to_stdout)
        payload = run_eval(path, spec, say=lambda line: typer.echo(line, err=True))
        for heading, table in _tables(payload):
            console.print(heading, highlight=False)
            console.print(table)
        written: list[Path] = []
        if not no_save:
            try:
                written = save_results(payload["run"], payload)
            except NSAError as exc:
                typer.echo(f"warning: results not saved in the run directory: {exc.one_line()}", err=True)
        if json_out is not None and str(json_out) != "-":
            try:
                written.append(write_json(json_out, payload))
            except OSError as exc:
                raise fail(f"cannot write --json-out {json_out}: {exc.strerror or exc}", hint="choose a writable path") from None
        if to_stdout:
            typer.echo(to_json(payload), nl=False)
        for p in written:
            console.print(f"saved {p}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("eval", epilog=EPILOG, cls=command_class(json_path=True))(eval_cmd)
