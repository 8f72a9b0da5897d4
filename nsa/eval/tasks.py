"""Scoring a language model on needle retrieval, MQAR and held-out loss, and measuring an NSA model's
selection (recall of the dense attention mass, compressed entropy, scorer KL, gates per layer) on held-out
data.

A model is anything whose ``forward(input_ids [B, S])`` returns an object with ``.logits [B, S, V]``
(``NSALM``, the dense baseline, or a test stub). Retrieval episodes come from ``nsa.data.retrieval``;
the model reads an episode's tokens and is right at an answer position ``t`` iff
``argmax(logits[t]) == tokens[t + 1]``. Every episode has its own generator, seeded from
``(seed, task, context, depth, sample index)``, so a result does not depend on the batch size or on
which other contexts and depths are evaluated.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from nsa.data.loader import build_loader
from nsa.data.retrieval import TaskLayout, mqar_episode, needle_episode
from nsa.data.tokenizers import ByteTokenizer
from nsa.errors import ConfigError
from nsa.eval.ruler import (
    RULER_HAYSTACKS,
    RULER_TASKS,
    check_ruler_tasks,
    grade_episodes,
    ruler_episode,
    summarise,
)
from nsa.model.documents import from_separators
from nsa.rundir.records import SELECTION_FIELDS

TASKS = ("needle", "mqar", "loss", "selection", "ruler")
HAYSTACKS = ("random", "text")
TOKENS_PER_BATCH = 32768  # the automatic batch size keeps about this many tokens per forward
NEEDLE_MIN_CONTEXT = 6


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (or None): CUDA when visible, else the CPU; ``cuda`` without a GPU is a ``ConfigError``."""
    name = "auto" if device is None else str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} must be auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but no CUDA device is visible", hint="use --device cpu")
    return torch.device(name)


def min_context(task: str, pairs: int | None = None, queries: int | None = None) -> int:
    """The shortest context a task can use (needle: 6; mqar: ``2 * (pairs + queries)``; loss, selection: 2;
    ruler: 256, each of its tasks more as it needs)."""
    if task == "needle":
        return NEEDLE_MIN_CONTEXT
    if task == "mqar":
        p = pairs or 1
        return 2 * (p + (queries or p))
    if task in ("loss", "selection"):
        return 2
    if task == "ruler":
        return 256  # a question and its answer (each task checks its own length when it builds an episode)
    raise ConfigError(f"unknown task {task!r}", hint=f"use one of {', '.join(TASKS)}")


def check_contexts(contexts: Sequence[int], task: str, max_seq_len: int | None = None,
                   pairs: int | None = None, queries: int | None = None) -> list[int]:
    """The contexts as ints, or a ``ConfigError`` for an empty list, one above ``max_seq_len`` or one
    too short for ``task``."""
    out = [int(c) for c in contexts]
    if not out:
        raise ConfigError("no contexts given", hint="e.g. --contexts 4096,16384")
    shortest = min_context(task, pairs, queries)
    for c in out:
        if max_seq_len is not None and c > max_seq_len:
            raise ConfigError(f"context={c} exceeds the model's model.max_seq_len={max_seq_len}",
                              hint=f"use contexts <= {max_seq_len}")
        if c < shortest:
            what = f" with {pairs} pairs and {queries or pairs} queries" if task == "mqar" else ""
            raise ConfigError(f"context={c} is too short for the {task} task{what} (needs >= {shortest})")
    return out


def check_depths(depths: Sequence[float]) -> list[float]:
    """The depths as floats, or a ``ConfigError`` for an empty list or a depth outside [0, 1]."""
    out = [float(d) for d in depths]
    if not out:
        raise ConfigError("no depths given", hint="e.g. --depths 0,0.25,0.5,0.75,1")
    for d in out:
        if not 0.0 <= d <= 1.0:  # also rejects NaN
            raise ConfigError(f"depth={d} must be in [0, 1]",
                              hint="0 = the first token, 1 = just before the question")
    return out


def _check_mqar(layout: TaskLayout, pairs: int, queries: int) -> None:
    if not 1 <= queries <= pairs <= len(layout.keys):
        raise ConfigError(f"mqar needs 1 <= queries ({queries}) <= pairs ({pairs}) <= {len(layout.keys)}",
                          hint="e.g. --pairs 8 --queries 8")


def _model_max_seq_len(model: nn.Module) -> int | None:
    cfg = getattr(model, "model_cfg", None)
    value = getattr(cfg, "max_seq_len", None)
    return int(value) if isinstance(value, int) else None


def _batch_size(batch_size: int | None, context: int, count: int) -> int:
    if batch_size is not None:
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        return batch_size
    return max(1, min(count, TOKENS_PER_BATCH // context))


def _seed(seed: int, *parts: object) -> int:
    """A seed from ``(seed, *parts)`` by a stable hash (the same on every machine)."""
    key = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def _generator(seed: int, *parts: object) -> torch.Generator:
    """A torch generator seeded from ``(seed, *parts)`` (:func:`_seed`)."""
    return torch.Generator().manual_seed(_seed(seed, *parts))


def _episode_setup(model: nn.Module, task: str, contexts: Sequence[int], samples: int,
                   max_seq_len: int | None, pairs: int | None = None,
                   queries: int | None = None) -> list[int]:
    """The checked contexts of an episode task (against ``max_seq_len``, default the model's); ``samples >=
    1``."""
    limit = max_seq_len if max_seq_len is not None else _model_max_seq_len(model)
    ctxs = check_contexts(contexts, task, limit, pairs, queries)
    if samples < 1:
        raise ConfigError(f"samples={samples} must be >= 1")
    return ctxs


@contextlib.contextmanager
def _inference(model: nn.Module, device: torch.device) -> Iterator[None]:
    """``eval()`` mode, no gradients, bf16 autocast on CUDA; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            yield
    finally:
        consume = getattr(model, "consume_stats", None)
        if callable(consume):  # gate statistics of evaluation belong to nobody
            consume()
        model.train(was_training)


def _device_of(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None and str(device) != "auto":
        return resolve_device(device)
    param = next(model.parameters(), None)
    return param.device if param is not None else resolve_device("auto")


def _correct(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
             device: torch.device) -> torch.Tensor:
    """Per episode, how many answer positions the model gets right: ``tokens [B, S]``, ``positions [B,
    Q]``."""
    x = tokens.to(device)
    pos = positions.to(device)
    logits = model(x).logits
    at = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))  # [B, Q, V]
    return (at.argmax(-1) == x.gather(1, pos + 1)).sum(1).cpu()


def _score(model: nn.Module, episodes: list[tuple[torch.Tensor, list[int]]], device: torch.device,
           batch_size: int) -> list[int]:
    out: list[int] = []
    for i in range(0, len(episodes), batch_size):
        chunk = episodes[i : i + batch_size]
        tokens = torch.stack([t for t, _ in chunk])
        positions = torch.tensor([p for _, p in chunk], dtype=torch.long)
        out += _correct(model, tokens, positions, device).tolist()
    return out


def _haystack(text_tokens: torch.Tensor | None, haystack: str, rng: torch.Generator,
              context: int) -> torch.Tensor | None:
    if haystack == "random":
        return None
    assert text_tokens is not None
    start = int(torch.randint(0, text_tokens.numel() - context + 1, (1,), generator=rng))
    return text_tokens[start : start + context]


def _check_haystack(haystack: str, text_tokens: torch.Tensor | None, contexts: list[int]) -> None:
    if haystack not in HAYSTACKS:
        raise ConfigError(f"haystack {haystack!r} must be random or text")
    if haystack == "text":
        if text_tokens is None:
            raise ConfigError("haystack=text needs text_tokens (see nsa.eval.text_haystack)")
        if text_tokens.numel() < max(contexts):
            raise ConfigError(f"the text haystack has {text_tokens.numel()} tokens, fewer than "
                              f"context={max(contexts)}")


def eval_needle(
    model: nn.Module,
    layout: TaskLayout,
    contexts: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int = 0,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    haystack: str = "random",
    text_tokens: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """Needle in a haystack: rows ``{"context", "depth", "accuracy", "n"}`` (``n`` = episodes), one per
    (context, depth), contexts outer. ``max_seq_len`` defaults to the model's ``model_cfg.max_seq_len``."""
    ctxs = _episode_setup(model, "needle", contexts, samples, max_seq_len)
    deps = check_depths(depths)
    _check_haystack(haystack, text_tokens, ctxs)
    dev = _device_of(model, device)
    rows: list[dict[str, Any]] = []
    with _inference(model, dev):
        for c in ctxs:
            episodes = []
            for d in deps:
                for i in range(samples):
                    rng = _generator(seed, "needle", c, d, i)
                    episodes.append(needle_episode(layout, rng, c, d,
                                                   _haystack(text_tokens, haystack, rng, c)))
            correct = _score(model, episodes, dev, _batch_size(batch_size, c, len(episodes)))
            for j, d in enumerate(deps):
                hits = sum(correct[j * samples : (j + 1) * samples])
                rows.append({"context": c, "depth": d, "accuracy": hits / samples, "n": samples})
    return rows


def eval_mqar(
    model: nn.Module,
    layout: TaskLayout,
    contexts: Sequence[int],
    samples: int,
    pairs: int = 8,
    queries: int | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    haystack: str = "random",
    text_tokens: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """Multi-query associative recall: rows ``{"context", "accuracy", "n"}``, accuracy over every asked
    key (``n`` = keys asked = ``samples * queries``)."""
    q = pairs if queries is None else queries
    _check_mqar(layout, pairs, q)
    ctxs = _episode_setup(model, "mqar", contexts, samples, max_seq_len, pairs, q)
    _check_haystack(haystack, text_tokens, ctxs)
    dev = _device_of(model, device)
    rows: list[dict[str, Any]] = []
    with _inference(model, dev):
        for c in ctxs:
            episodes = []
            for i in range(samples):
                rng = _generator(seed, "mqar", c, pairs, q, i)
                episodes.append(mqar_episode(layout, rng, c, pairs, q,
                                             _haystack(text_tokens, haystack, rng, c)))
            correct = _score(model, episodes, dev, _batch_size(batch_size, c, len(episodes)))
            n = samples * q
            rows.append({"context": c, "accuracy": sum(correct) / n, "n": n})
    return rows


def _utf8_bytes(tokenizer: Any, ids: list[int]) -> int:
    """UTF-8 bytes that ``ids`` stand for: for the byte tokenizer one per id but the separator (exact even
    where a row splits a multi-byte character); otherwise the length of the decoded text."""
    if isinstance(tokenizer, ByteTokenizer):
        return sum(1 for i in ids if i != tokenizer.eot_id)
    return len(tokenizer.decode(ids).encode("utf-8"))


def _val_loader(run_cfg: Any, tokenizer: Any, context: int, batch_size: int,
                device: torch.device | None) -> Any:
    return build_loader(run_cfg.data, tokenizer, split="val", seq_len=context, batch_size=batch_size,
                        seed=run_cfg.train.seed, device=device)


def _documents(run_cfg: Any, tokenizer: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The packed documents of a batch (``cu_seqlens``) when the run trained with ``data.document_mask``: its
    held-out loss is read as it was trained, each document on its own."""
    return from_separators(x, tokenizer.eot_id) if run_cfg.data.document_mask else None


def eval_loss(
    model: nn.Module,
    run_cfg: Any,
    tokenizer: Any,
    contexts: Sequence[int],
    batches: int,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    max_seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """Held-out loss on the run's validation split: rows ``{"context", "loss", "bits_per_byte", "n",
    "by_position"}``.

    ``loss`` is the mean cross-entropy (nats) over the ``n`` scored target tokens (labels ``-100``
    excluded); ``bits_per_byte`` = total nats / ln 2 / UTF-8 bytes the scored targets decode to
    (None when they decode to no bytes; for the byte tokenizer ``loss / ln 2`` but for separators).
    A run trained with ``data.document_mask`` is read so too (positions restart at each document).
    ``by_position``: the same loss over the targets at positions ``[start, end)`` of the window
    (:func:`position_buckets`: does longer context help, and where does a model lose?), ``{"start", "end",
    "loss", "n"}``. The loader is seeded with ``train.seed``: the same first ``batches`` batches of the
    split every time."""
    limit = max_seq_len if max_seq_len is not None else _model_max_seq_len(model)
    ctxs = check_contexts(contexts, "loss", limit)
    if batches < 1:
        raise ConfigError(f"batches={batches} must be >= 1")
    dev = _device_of(model, device)
    rows: list[dict[str, Any]] = []
    with _inference(model, dev):
        for c in ctxs:
            n_bytes = 0
            pos_nats = torch.zeros(c, dtype=torch.float64)
            pos_tokens = torch.zeros(c, dtype=torch.int64)
            with _val_loader(run_cfg, tokenizer, c, _batch_size(batch_size, c, 8), dev) as loader:
                for _ in range(batches):
                    x, y = next(loader)
                    cu = _documents(run_cfg, tokenizer, x)
                    logits = (model(x) if cu is None else model(x, cu_seqlens=cu)).logits.float()
                    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                           y.reshape(-1), ignore_index=-100,
                                                           reduction="none").view(y.shape)
                    keep = y != -100
                    pos_nats += (ce.double() * keep).sum(0).cpu()
                    pos_tokens += keep.sum(0).cpu()
                    for row, mask in zip(y.cpu().tolist(), keep.cpu().tolist(), strict=True):
                        n_bytes += _utf8_bytes(tokenizer, [t for t, k in zip(row, mask, strict=True) if k])
            nats, tokens = float(pos_nats.sum()), int(pos_tokens.sum())
            loss = nats / tokens if tokens else float("nan")
            bpb = nats / math.log(2) / n_bytes if n_bytes else None
            by_position = [{"start": a, "end": b, "loss": float(pos_nats[a:b].sum()) / n, "n": n}
                           for a, b in position_buckets(c) if (n := int(pos_tokens[a:b].sum()))]
            rows.append({"context": c, "loss": loss, "bits_per_byte": bpb, "n": tokens,
                         "by_position": by_position})
    return rows


def position_buckets(context: int, first: int = 64) -> list[tuple[int, int]]:
    """``[start, end)`` position ranges of a window: ``[0, first)``, then doubling (``[64, 128)``,
    ``[128, 256)``, ...), the last ending at ``context``; the same edges at every context, so windows of
    2k and 8k compare bucket by bucket."""
    edges = [0]
    e = first
    while e < context:
        edges.append(e)
        e *= 2
    edges.append(context)
    return list(itertools.pairwise(edges))


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def eval_selection(
    model: nn.Module,
    run_cfg: Any,
    tokenizer: Any,
    contexts: Sequence[int],
    batches: int,
    queries: int = 64,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    max_seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """An NSA model's selection diagnostics on the run's validation split (``NSALM.selection_report`` with
    ``queries`` positions per layer), averaged over ``batches`` batches per context: rows ``{"context",
    "layer", "recall", "recall_best", "recall_forced", "cmp_entropy", "kl", "gates", "n"}`` (``n`` =
    sequences;
    ``recall_best``: recall's ceiling, a perfect scorer's; ``recall_forced``: the forced blocks' share),
    contexts outer. The numbers (``SELECTION_FIELDS``) are None at a context too short for selection to choose
    (every block is selected). The loader is seeded with ``train.seed`` (the same batches every time). A model
    without NSA layers is a ``ConfigError``."""
    report = getattr(model, "selection_report", None)
    if not callable(report) or getattr(getattr(model, "model_cfg", None), "attention", "nsa") == "dense":
        raise ConfigError("the selection task needs an NSA model (this one has dense attention)",
                          hint="evaluate a run trained with model.attention: nsa")
    limit = max_seq_len if max_seq_len is not None else _model_max_seq_len(model)
    ctxs = check_contexts(contexts, "selection", limit)
    if batches < 1:
        raise ConfigError(f"batches={batches} must be >= 1")
    if queries < 1:
        raise ConfigError(f"queries={queries} must be >= 1")
    dev = _device_of(model, device)
    rows: list[dict[str, Any]] = []
    with _inference(model, dev):
        for c in ctxs:
            per_layer: dict[int, list[dict[str, Any]]] = {}
            sequences = 0
            with _val_loader(run_cfg, tokenizer, c, _batch_size(batch_size, c, 8), dev) as loader:
                for _ in range(batches):
                    x, _ = next(loader)
                    sequences += x.shape[0]
                    cu = _documents(run_cfg, tokenizer, x)  # a masked run: each document probed on its own
                    for r in (report(x, queries) if cu is None else report(x, queries, cu_seqlens=cu)):
                        per_layer.setdefault(int(r["layer"]), []).append(r)
            if not per_layer:
                raise ConfigError("the selection task needs an NSA model (this one has no NSA layers)")
            for layer, reps in sorted(per_layer.items()):
                gates = [r["gates"] for r in reps if r.get("gates") is not None]
                row: dict[str, Any] = {"context": c, "layer": layer}
                row.update({k: _mean([r.get(k) for r in reps]) for k in SELECTION_FIELDS})
                row["gates"] = [sum(float(g[i]) for g in gates) / len(gates)
                                for i in range(3)] if gates else None
                row["n"] = sequences
                rows.append(row)
    return rows


def text_haystack(run_cfg: Any, tokenizer: Any, tokens: int, seq_len: int | None = None) -> torch.Tensor:
    """``tokens`` consecutive-ish token ids (1-D, CPU) of the run's validation split, for
    ``haystack="text"``: the inputs of successive val-loader sequences, concatenated."""
    if tokens < 1:
        raise ConfigError(f"tokens={tokens} must be >= 1")
    length = max(2, min(tokens, seq_len or tokens))
    parts: list[torch.Tensor] = []
    have = 0
    with _val_loader(run_cfg, tokenizer, length, 1, None) as loader:
        while have < tokens:
            x, _ = next(loader)
            parts.append(x[0])
            have += x.shape[1]
    return torch.cat(parts)[:tokens]


def eval_ruler(
    model: nn.Module,
    tokenizer: Any,
    contexts: Sequence[int],
    samples: int,
    tasks: Sequence[str] = RULER_TASKS,
    seed: int = 0,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    haystack: str = "noise",
    text_tokens: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """RULER-style tasks (:mod:`nsa.eval.ruler`): rows ``{"task", "context", "score", "answer_nll", "n"}``
    (``score``: the mean share of an episode's answer values the model gets right; ``answer_nll``: the mean
    NLL of the answer tokens, nats; ``n`` episodes), contexts outer, then one
    ``task = "mean"`` row per context. ``haystack``: ``noise`` (RULER's sentences) or ``text``
    (``text_tokens``)."""
    ctxs = _episode_setup(model, "ruler", contexts, samples, max_seq_len)
    names = check_ruler_tasks(tasks)
    if haystack not in RULER_HAYSTACKS:
        raise ConfigError(f"haystack {haystack!r} must be noise or text for the ruler task")
    if haystack == "text":
        _check_haystack("text", text_tokens, ctxs)
    dev = _device_of(model, device)
    rows: list[dict[str, Any]] = []
    with _inference(model, dev):
        for c in ctxs:
            for task in names:
                episodes = []
                for i in range(samples):
                    rng = random.Random(_seed(seed, "ruler", task, c, i))
                    episodes.append(ruler_episode(task, tokenizer.encode, c, rng, haystack, text_tokens))
                graded = grade_episodes(model, episodes, dev, _batch_size(batch_size, c, len(episodes)))
                rows.append({"task": task, "context": c, "score": sum(g[0] for g in graded) / len(graded),
                             "answer_nll": sum(g[1] for g in graded) / len(graded), "n": len(graded)})
    return rows + summarise(rows)
