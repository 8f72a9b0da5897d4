"""``nsa eval`` as one call: :func:`evaluate` scores a model (:func:`nsa.eval.run.run_eval`), keeps the
results in the run and where ``--json-out`` asks, and returns an :class:`Evaluation`: the payload, and its
tables (a heading line and a table per grid; one per context for the selection task)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa.errors import NSAError
from nsa.eval.results import context_label, save_results, write_json
from nsa.eval.run import EvalSpec, run_eval
from nsa.view import Block, Cell, Column, Line, Result, Table


def _tone(acc: float) -> str:
    return "green" if acc >= 0.9 else "yellow" if acc >= 0.5 else "red"


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _each_document(settings: dict[str, Any]) -> str:
    """What a heading adds for a run trained with ``data.document_mask`` (read document by document)."""
    return ", each document on its own: data.document_mask" if settings.get("documents") else ""


def _grid(rows: list[dict[str, Any]], key: str, value: str, labels: list[str], keys: list[Any]) -> Table:
    """``rows``' ``value`` (coloured): a row per ``key`` (``keys``, shown as ``labels``), a column per
    context."""
    contexts = sorted({r["context"] for r in rows})
    cell = {(r[key], r["context"]): r[value] for r in rows}
    t = Table.of(None, [f"{key} \\ context", *map(context_label, contexts)])
    for label, k in zip(labels, keys, strict=True):
        cells = [cell.get((k, c)) for c in contexts]
        t.add(label, *("-" if v is None else (f"{v:.2f}", _tone(v)) for v in cells))
    return t


def _selection(payload: dict[str, Any], name: str) -> list[Block]:
    """A heading and table per context: layer, recall, its ceiling, compressed entropy, KL, gates."""
    rows, s = payload["results"], payload["settings"]
    out: list[Block] = []
    for c in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == c]
        out.append(Line(f"selection of {name} at context {context_label(c)} ({here[0]['n']} val sequences, "
                        f"{s['queries']} query positions per layer{_each_document(s)})"))
        short = any(r.get("recall") is None for r in here)
        t = Table.of(None, ("layer", "recall", "recall ceiling", "forced blocks", "compressed entropy", "KL",
                            "gates cmp/sel/win"),
                     caption="–: all blocks selected at this length" if short else None)
        for r in here:
            gates = "/".join(f"{g:.2f}" for g in r["gates"]) if r.get("gates") else "n/a"
            if r.get("recall") is None:
                t.add(str(r["layer"]), "–", "–", "–", "–", "–", gates)
                continue
            t.add(str(r["layer"]), (f"{r['recall']:.3f}", _tone(r["recall"])), _num(r.get("recall_best")),
                  _num(r.get("recall_forced")), _num(r.get("cmp_entropy")), _num(r.get("kl")), gates)
        out.append(t)
    return out


def tables(payload: dict[str, Any]) -> list[Block]:
    """Heading lines and tables of an evaluation's results."""
    task, rows, s = payload["task"], payload["results"], payload["settings"]
    name = Path(str(payload["run"] or payload["checkpoint"])).name
    if task == "selection":
        return _selection(payload, name)
    if task == "needle":
        depths = sorted({r["depth"] for r in rows})
        return [Line(f"needle accuracy of {name} ({s['samples']} samples per cell, haystack "
                     f"{s['haystack']})"),
                _grid(rows, "depth", "accuracy", [f"{d:g}" for d in depths], depths)]
    if task == "ruler":
        tasks = list(dict.fromkeys(r["task"] for r in rows))
        t = _grid(rows, "task", "score", tasks, tasks)
        nll = {r["context"]: r.get("answer_nll") for r in rows if r["task"] == "mean"}
        t.add("answer nll", *("-" if nll.get(c) is None else f"{nll[c]:.3f}" for c in sorted(nll)))
        return [Line(f"RULER-style suite of {name} ({s['samples']} episodes per cell, haystack "
                     f"{s['haystack']}; " "score: the share of answer values right; answer nll: nats per "
                                          "answer token, over the tasks)"), t]
    if task == "mqar":
        t = Table.of(None, ("context", "accuracy", "keys asked"))
        for r in rows:
            t.add(str(r["context"]), (f"{r['accuracy']:.3f}", _tone(r["accuracy"])), str(r["n"]))
        return [Line(f"MQAR accuracy of {name} ({s['pairs']} pairs, {s['queries']} queries, {s['samples']} "
                     "samples)"),
                t]
    t = Table(None, [*(Column(c) for c in ("context", "loss", "bits/byte", "tokens")),
                     Column("loss by position in the window", "left")])
    for r in rows:
        loss, bpb = r["loss"], r["bits_per_byte"]
        by_pos: Cell = "  ".join(f"{b['start']}-{b['end']}: {b['loss']:.3f}"
                                 for b in r.get("by_position", []))
        t.add(str(r["context"]), "n/a" if loss is None else f"{loss:.4f}",
              "n/a" if bpb is None else f"{bpb:.4f}", f"{r['n']:,}", by_pos)
    return [Line(f"held-out loss of {name} on the val split ({s['samples']} sequences per context"
                 f"{_each_document(s)})"), t]


@dataclass
class Evaluation(Result):
    """An evaluation's payload (``task, run, checkpoint, step, weights, results, settings, env``), the files
    it was saved to, and a warning when the run directory could not keep it."""

    payload: dict[str, Any]
    saved: list[Path] = field(default_factory=list)
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.payload

    def view(self) -> list[Block]:
        warn = [Line(f"warning: results not saved in the run directory: {self.warning}", err=True,
                     wrap=False)]
        return [*tables(self.payload), *(warn if self.warning else []),
                *(Line(f"saved {p}") for p in self.saved)]


def evaluate(path: str | Path, spec: EvalSpec, *, save: bool = True, json_out: Path | None = None,
             say: Callable[[str], None] | None = None) -> Evaluation:
    """Score the model at ``path`` on ``spec`` (:func:`nsa.eval.run.run_eval`); keep the results under
    ``RUN/eval/`` (``save``; a run directory that cannot be written is a warning) and in ``json_out``."""
    result = Evaluation(run_eval(path, spec, say=say))
    if save:
        try:
            result.saved = save_results(result.payload["run"], result.payload)
        except NSAError as exc:
            result.warning = exc.one_line()
    if json_out is not None:
        try:
            result.saved.append(write_json(json_out, result.payload))
        except OSError as exc:
            raise NSAError(f"cannot write --json-out {json_out}: {exc.strerror or exc}",
                           hint="choose a writable path") from None
    return result
