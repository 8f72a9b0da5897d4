"""``nsa eval`` as a library call: :func:`run_eval` loads a trained model, scores it on one task at the
requested contexts and returns the payload (``nsa.eval.results``) that ``RUN/eval/<task>.json`` holds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nsa.data.retrieval import TaskLayout
from nsa.data.tokenizers import get_tokenizer
from nsa.errors import CheckpointError, ConfigError
from nsa.eval.results import build_payload, run_dir_of
from nsa.eval.ruler import RULER_TASKS, check_ruler_tasks
from nsa.eval.tasks import (
    HAYSTACKS,
    TASKS,
    TOKENS_PER_BATCH,
    check_contexts,
    check_depths,
    eval_loss,
    eval_mqar,
    eval_needle,
    eval_ruler,
    eval_selection,
    resolve_device,
    text_haystack,
)
from nsa.hf import is_hf_folder, read_hf
from nsa.model import build_model
from nsa.model.load import LoadedModel, load_model
from nsa.rundir.layout import is_run_dir

# what the ruler and selection tasks measure (``nsa eval --help`` shows it)
TASK_NOTES = """\
The ruler task (RULER's families, generated locally from --seed; nsa.eval.ruler): niah_single, niah_multikey,
niah_multivalue, niah_multiquery (needles of 7-digit numbers under pseudo-word keys), vt (variable tracking
through 4 hops), cwe (the 10 most common words of a numbered list), fwe (the 3 most frequent coded words). The
haystack is RULER's noise sentences (--haystack random, the default) or the run's val split (--haystack text).
A value is right when the model predicts every token of it reading the episode once; a cell scores the mean
share of values right; the mean row averages the tasks. A Hugging Face export (nsa export --format hf)
evaluates like its run.

The selection task (NSA models) measures per layer, on the run's val split: recall (share of the dense
attention mass, same q/k, inside the selected blocks; 1 = nothing lost), its ceiling (the mass in the best
blocks selection could choose: below 1 when dense attention spreads over more blocks than it keeps),
compressed entropy (1 = uniform), the scorer KL and the mean gates; averaged over --samples sequences at
--queries positions per layer (default 64). At a context <= n_sel * l_sel every block is selected and recall
is not measured."""
DEFAULT_SAMPLES = {"needle": 32, "mqar": 32, "loss": 16, "selection": 8, "ruler": 16}
SELECTION_QUERIES = 64  # query positions per layer of the selection task


@dataclass
class EvalSpec:
    """What to evaluate: ``task`` at ``contexts`` (None: the run's ``train.seq_len``); ``samples`` episodes
    per cell (needle, mqar) or val sequences per context (loss, selection), default :data:`DEFAULT_SAMPLES`;
    ``queries``: MQAR keys asked (default ``pairs``) or the selection task's positions per layer (default
    :data:`SELECTION_QUERIES`)."""

    task: str
    contexts: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples: int | None = None
    pairs: int = 8
    queries: int | None = None
    haystack: str = "random"
    seed: int = 0
    batch_size: int | None = None
    device: str = "auto"
    ruler_tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))

    def check(self) -> None:
        """``ConfigError`` for what can be checked before a model is loaded (task, haystack, depths,
        contexts)."""
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}", hint=f"use --task {'|'.join(TASKS)}")
        if self.haystack not in HAYSTACKS:
            raise ConfigError(f"--haystack {self.haystack!r} must be random or text")
        if self.task == "needle":
            self.depths = check_depths(self.depths)
        if self.task == "ruler":
            self.ruler_tasks = check_ruler_tasks(self.ruler_tasks)
        if self.contexts is not None:
            check_contexts(self.contexts, self.task, None, self.pairs, self.mqar_queries)

    @property
    def mqar_queries(self) -> int:
        return self.pairs if self.queries is None else self.queries


def _load(path: str | Path, device: torch.device) -> LoadedModel:
    """The model at ``path``: a run directory, its export, a checkpoint, or an export in the Hugging Face
    format (``nsa export --format hf``), which evaluates as the run it came from."""
    if not is_hf_folder(path):
        return load_model(path, device=device)
    state, cfg, weights = read_hf(path)
    model = build_model(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:  # as load_model says it
        raise CheckpointError(f"{weights} does not match its config: {exc}") from None
    return LoadedModel(model.to(device).eval(), cfg, weights)


def run_eval(path: str | Path, spec: EvalSpec, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load the model at ``path`` (a run directory, its export, a checkpoint, a Hugging Face export), score it
    on ``spec`` and return the payload (``task, run, checkpoint, step, weights, results, settings, env``).
    ``say`` hears one line naming the weights, device and contexts before the work starts. ``ConfigError`` /
    ``RunDirError`` /
    ``CheckpointError`` for bad input."""
    spec.check()
    task, q = spec.task, spec.mqar_queries
    n = spec.samples or DEFAULT_SAMPLES[task]
    dev = resolve_device(spec.device)
    loaded = _load(path, dev)
    cfg, model = loaded.config, loaded.model
    if task == "selection" and cfg.model.attention != "nsa":
        raise ConfigError(f"the selection task needs an NSA model; {loaded.source} has {cfg.model.attention} "
                          "attention", hint="evaluate a run trained with model.attention: nsa")
    limit = cfg.model.max_seq_len
    contexts = spec.contexts if spec.contexts is not None else [min(cfg.train.seq_len, limit)]
    if spec.contexts is None:
        check_contexts(contexts, task, None, spec.pairs, q)
    contexts = check_contexts(contexts, task, limit, spec.pairs, q)
    tok = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    if say is not None:
        say(f"[{loaded.source}, {dev}, task {task}, contexts {','.join(map(str, contexts))}]")
    settings: dict[str, Any] = {"samples": n, "depths": spec.depths if task == "needle" else None,
                                "contexts": contexts,
                                "haystack": spec.haystack if task in ("needle", "mqar") else None,
                                "pairs": spec.pairs if task == "mqar" else None,
                                "queries": q if task == "mqar" else None, "seed": spec.seed,
                                "batch_size": spec.batch_size, "device": str(dev)}
    if task in ("loss", "selection"):
        bs = spec.batch_size or max(1, min(n, TOKENS_PER_BATCH // max(contexts)))
        batches = math.ceil(n / bs)
        settings.update(samples=batches * bs, batch_size=bs, batches=batches, seed=cfg.train.seed,
                        documents=cfg.data.document_mask)  # a masked run is read document by document
        if task == "loss":
            rows = eval_loss(model, cfg, tok, contexts, batches, batch_size=bs, device=dev, max_seq_len=limit)
        else:
            sq = spec.queries or SELECTION_QUERIES
            settings.update(queries=sq)
            rows = eval_selection(model, cfg, tok, contexts, batches, queries=sq, batch_size=bs, device=dev,
                                  max_seq_len=limit)
    elif task == "ruler":
        # random filler means RULER's noise sentences here
        hay = "text" if spec.haystack == "text" else "noise"
        settings.update(haystack=hay, tasks=spec.ruler_tasks)
        text = text_haystack(cfg, tok, 2 * max(contexts), seq_len=max(contexts)) if hay == "text" else None
        rows = eval_ruler(model, tok, contexts, n, spec.ruler_tasks, seed=spec.seed, device=dev,
                          batch_size=spec.batch_size, haystack=hay, text_tokens=text, max_seq_len=limit)
    else:
        layout = TaskLayout.for_vocab(min(cfg.model.vocab_size, tok.vocab_size), tok.eot_id)
        text = text_haystack(cfg, tok, 2 * max(contexts),
                             seq_len=max(contexts)) if spec.haystack == "text" else None
        if task == "needle":
            rows = eval_needle(model, layout, contexts, spec.depths, n, seed=spec.seed, device=dev,
                               batch_size=spec.batch_size, haystack=spec.haystack, text_tokens=text,
                               max_seq_len=limit)
        else:
            rows = eval_mqar(model, layout, contexts, n, pairs=spec.pairs, queries=q, seed=spec.seed,
                             device=dev, batch_size=spec.batch_size, haystack=spec.haystack, text_tokens=text,
                             max_seq_len=limit)
    return build_payload(task, rows, run=_run_of(path), checkpoint=loaded.source, settings=settings)


def _run_of(path: str | Path) -> Path | None:
    """The run directory the results belong to; for a Hugging Face export the run that holds it, else none
    (the results are not written into an export that may travel)."""
    if not is_hf_folder(path):
        return run_dir_of(path)
    parent = Path(path).resolve().parent
    return parent if is_run_dir(parent) else None
