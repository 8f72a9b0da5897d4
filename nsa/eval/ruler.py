"""RULER-style long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated locally from a seed: the needle family (one key; one key among
distractors; one key with several values; several keys asked at once), variable tracking, and common and
frequent word extraction. Nothing is downloaded; the question-answering family (which needs a
reading-comprehension dataset) is left out.

An episode is ``context`` tokens of the run's tokenizer: a haystack (RULER's noise sentences, or the run's
held-out text) with the task's facts inserted at random depths, then a question and its answer. The answer
holds one or more *values* (a number, a variable name, a word); the model reads the whole episode once
(teacher forcing) and gets a value right iff its argmax predicts every token of it. An episode scores the
share of its values it gets right (RULER's ``string_match_all``); a cell (task, context) the mean over its
episodes. Beside the score, the mean negative log-likelihood of the answer values' tokens (``answer_nll``,
nats per token, teacher-forced): a graded reading that still tells models apart while none of them gets a
value right (an early checkpoint). Every episode has its own generator, seeded from ``(seed, "ruler", task,
context, sample index)``, so a score does not depend on the batch size or on which other tasks and contexts
run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nsa.errors import ConfigError

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
RULER_HAYSTACKS = ("noise", "text")
# RULER's noise haystack: the same five sentences over and over
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


@dataclass
class Episode:
    """``tokens [context]`` and the ``(start, end)`` token spans of the answer's values in it."""

    tokens: torch.Tensor
    values: list[tuple[int, int]]


Encode = Callable[[str], list[int]]


def _word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables))


def _words(rng: random.Random, n: int, syllables: int = 3) -> list[str]:
    """``n`` distinct pseudo-words, in the order drawn."""
    out: dict[str, None] = {}
    while len(out) < n:
        out.setdefault(_word(rng, syllables))
    return list(out)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _answer(encode: Encode, head: list[int], values: list[str], sep: str) -> tuple[list[int],
                                                                                   list[tuple[int, int]]]:
    """``head`` + each value (after ``sep``, a space before the first), with the values' spans in the
    result."""
    ids, spans = list(head), []
    for i, v in enumerate(values):
        ids += encode(" " if i == 0 else sep)
        start = len(ids)
        ids += encode(v)
        spans.append((start, len(ids)))
    return ids, spans


class _Builder:
    """Episodes of one context: the haystack filled to the length the facts, question and answer leave."""

    def __init__(self, encode: Encode, context: int, haystack: str, text_tokens: torch.Tensor | None) -> None:
        self.encode, self.context, self.haystack, self.text = encode, context, haystack, text_tokens
        sentences = [encode(x.strip().rstrip(".") + ". ") for x in NOISE.split(". ") if x.strip()]
        self.noise = [t for x in sentences for t in x]
        ends, at = [], 0
        for x in sentences:
            at += len(x)
            ends.append(at)
        self.noise_ends = ends  # where a sentence of one period of the noise ends (a fact goes in there)

    def filler(self, rng: random.Random, n: int) -> list[int]:
        if n <= 0:
            return []
        if self.haystack == "text":
            assert self.text is not None
            start = rng.randrange(0, max(1, self.text.numel() - n))
            return self.text[start:start + n].tolist()
        reps = -(-n // len(self.noise))
        return (self.noise * reps)[:n]

    def cut(self, rng: random.Random, room: int) -> int:
        """Where a fact goes into a haystack of ``room`` tokens: after a sentence of the noise, anywhere in
        text."""
        if self.haystack == "text" or room < self.noise_ends[0]:
            return rng.randint(0, room)
        period = self.noise_ends[-1]
        ends = [p * period + e for p in range(room // period + 1) for e in self.noise_ends if p * period + e
                <= room]
        return rng.choice(ends)

    def with_facts(self, task: str, rng: random.Random, facts: list[str], tail: list[int],
                   spans: list[tuple[int, int]], ordered: bool = False) -> Episode:
        """``facts`` (sentences) at random depths of the haystack (in this order when ``ordered``), then
        ``tail`` (question and answer; ``spans`` in it)."""
        fact_ids = [self.encode(f + " ") for f in facts]
        room = self.context - len(tail) - sum(len(f) for f in fact_ids)
        if room < 1:
            need = self.context - room + 1
            raise ConfigError(f"context={self.context} is too short for the ruler task {task} (needs >= "
                              f"{need} tokens)", hint="evaluate longer contexts, e.g. --contexts 4k,8k")
        hay = self.filler(rng, room)
        cuts = sorted(self.cut(rng, room) for _ in facts)
        order = list(range(len(facts))) if ordered else rng.sample(range(len(facts)), len(facts))
        ids: list[int] = []
        prev = 0
        for cut, j in zip(cuts, order, strict=True):
            ids += hay[prev:cut] + fact_ids[j]
            prev = cut
        ids += hay[prev:]
        base = len(ids)
        ids += tail
        return Episode(torch.tensor(ids, dtype=torch.long), [(base + a, base + b) for a, b in spans])

    def listing(self, task: str, rng: random.Random, items: list[str], sep: str, tail: list[int],
                spans: list[tuple[int, int]]) -> Episode:
        """``items`` joined by ``sep`` as the whole haystack (truncated nowhere: the caller sized it), padded
        in front with noise to the context, then ``tail``."""
        body = self.encode(sep.join(items) + " ")
        room = self.context - len(tail) - len(body)
        if room < 0:
            raise ConfigError(f"context={self.context} is too short for the ruler task {task} "
                              f"(needs >= {self.context - room} tokens)", hint="evaluate longer contexts")
        ids = self.filler(rng, room) + body
        base = len(ids)
        return Episode(torch.tensor(ids + tail, dtype=torch.long), [(base + a, base + b) for a, b in spans])


def _niah(b: _Builder, task: str, rng: random.Random) -> Episode:
    enc = b.encode
    keys = _words(rng, 4)
    values = [_number(rng) for _ in range(4)]
    if task in ("niah_single", "niah_multikey"):
        facts = [f"One of the special magic numbers for {keys[0]} is: {values[0]}."]
        if task == "niah_multikey":
            facts += [f"One of the special magic numbers for {k} is: {v}." for k,
                      v in zip(keys[1:], values[1:],
                                                                                          strict=True)]
        q = (f"\nWhat is the special magic number for {keys[0]} mentioned in the text above? "
             f"The special magic number for {keys[0]} mentioned in the text above is:")
        tail, spans = _answer(enc, enc(q), [values[0]], ", ")
        return b.with_facts(task, rng, facts, tail, spans)
    if task == "niah_multivalue":
        facts = [f"One of the special magic numbers for {keys[0]} is: {v}." for v in values]
        q = (f"\nWhat are all the special magic numbers for {keys[0]} mentioned in the text above, in the "
             f"order they appear? The special magic numbers for {keys[0]} mentioned in the text above are:")
        tail, spans = _answer(enc, enc(q), values, ", ")
        return b.with_facts(task, rng, facts, tail, spans, ordered=True)
    facts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values, strict=True)]
    asked = rng.sample(range(4), 4)
    names = ", ".join(keys[i] for i in asked[:-1]) + f" and {keys[asked[-1]]}"
    q = (f"\nWhat are the special magic numbers for {names} mentioned in the text above? "
         f"The special magic numbers for {names} mentioned in the text above are:")
    tail, spans = _answer(enc, enc(q), [values[i] for i in asked], ", ")
    return b.with_facts(task, rng, facts, tail, spans)


def _vt(b: _Builder, rng: random.Random, hops: int = 4) -> Episode:
    names: list[str] = []
    while len(names) < hops + 1:
        n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if n not in names:
            names.append(n)
    value = str(rng.randint(10_000, 99_999))
    facts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, hops + 1)]
    q = (f"\nFind all variables that are assigned the value {value} in the text above, in the order they are "
         f"assigned. The variables assigned the value {value} are:")
    tail, spans = _answer(b.encode, b.encode(q), names, " ")
    return b.with_facts("vt", rng, facts, tail, spans, ordered=True)


def _item_tokens(encode: Encode, word: str) -> int:
    return len(encode(f"{1000}. {word} "))  # a list item's length with a four-digit number


def _cwe(b: _Builder, rng: random.Random, n_common: int = 10) -> Episode:
    enc = b.encode
    q = (f"\nWhat are the {n_common} most common words in the numbered list above, in the order they first "
         f"appear? The {n_common} most common words in the list above are:")
    common = _words(rng, n_common)
    tail_len = len(enc(q)) + sum(len(enc(" " + w)) for w in common)
    per_item = _item_tokens(enc, common[0])
    fit = (b.context - tail_len) // per_item
    rare = [w for w in _words(rng, n_common + max(0, fit)) if w not in common]  # as many as the list can hold
    f_common = max(2, min(30, fit // (3 * n_common)))  # each common word this often, each other word once
    n_rare = min(len(rare), fit - n_common * f_common)
    if n_rare < 0:
        raise ConfigError(f"context={b.context} is too short for the ruler task cwe (needs >= "
                          f"{tail_len + per_item * 2 * n_common} tokens)", hint="evaluate longer contexts")
    items = common * f_common + rare[:n_rare]
    rng.shuffle(items)
    first = [w for i, w in enumerate(items) if w in common and w not in items[:i]]
    tail, spans = _answer(enc, enc(q), first, " ")
    while True:  # the list numbers may run longer than the estimate: drop the last rare words until it fits
        numbered = [f"{i + 1}. {w}" for i, w in enumerate(items)]
        over = len(enc(" ".join(numbered) + " ")) - (b.context - len(tail))
        rare_at = [i for i, w in enumerate(items) if w not in common]
        if over <= 0 or not rare_at:
            # too short even without them: it says so
            return b.listing("cwe", rng, numbered, " ", tail, spans)
        for i in reversed(rare_at[-(-over // per_item):]):
            del items[i]


def _fwe(b: _Builder, rng: random.Random, top: int = 3) -> Episode:
    enc = b.encode
    q = (f"\nWhat are the {top} most frequent coded words in the text above, most frequent first? "
         f"The {top} most frequent coded words in the text above are:")
    words = _words(rng, 60, syllables=2)
    tail_len = len(enc(q)) + sum(len(enc(" " + w)) for w in words[:top])
    fit = (b.context - tail_len) // max(len(enc(w + " ")) for w in words)
    if fit < 2 * top + 3:
        raise ConfigError(f"context={b.context} is too short for the ruler task fwe (needs >= "
                          f"{tail_len + 5 * (2 * top + 3)} tokens)", hint="evaluate longer contexts")
    # Zipf-like counts, the first `top` strictly ordered and ahead of the rest
    weights = [1.0 / (i + 1) ** 1.5 for i in range(len(words))]
    scale = fit / sum(weights)
    counts = [max(1, int(w * scale)) for w in weights]
    for i in range(top):
        counts[i] = max(counts[i], counts[i + 1] + top - i + 1)
    while sum(counts) > fit and counts[-1] >= 1:
        counts.pop()
        words.pop()
        if len(counts) <= top + 1:
            break
    items = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
    rng.shuffle(items)
    tail, spans = _answer(enc, enc(q), words[:top], " ")
    return b.listing("fwe", rng, items, " ", tail, spans)


def ruler_episode(task: str, encode: Encode, context: int, rng: random.Random, haystack: str = "noise",
                  text_tokens: torch.Tensor | None = None) -> Episode:
    """One episode of ``task`` (:data:`RULER_TASKS`) of exactly ``context`` tokens."""
    if task not in RULER_TASKS:
        raise ConfigError(f"unknown ruler task {task!r}", hint=f"choose from {', '.join(RULER_TASKS)}")
    b = _Builder(encode, context, haystack, text_tokens)
    if task.startswith("niah"):
        ep = _niah(b, task, rng)
    elif task == "vt":
        ep = _vt(b, rng)
    elif task == "cwe":
        ep = _cwe(b, rng)
    else:
        ep = _fwe(b, rng)
    assert ep.tokens.numel() == context, (task, ep.tokens.numel(), context)
    return ep


def check_ruler_tasks(tasks: Sequence[str]) -> list[str]:
    """The task names, or a ``ConfigError`` naming an unknown one."""
    out = list(tasks)
    unknown = [t for t in out if t not in RULER_TASKS]
    if unknown or not out:
        raise ConfigError(f"unknown ruler task(s) {', '.join(unknown) or '(none given)'}",
                          hint=f"choose from {', '.join(RULER_TASKS)}")
    return out


def _values_right(logits: torch.Tensor, tokens: torch.Tensor, values: list[tuple[int, int]]) -> float:
    """Share of ``values`` whose every token the argmax at the position before predicts."""
    pred = logits.argmax(-1)
    right = [bool((pred[a - 1:b - 1] == tokens[a:b]).all()) for a, b in values]
    return sum(right) / len(right)


def _values_nll(logits: torch.Tensor, tokens: torch.Tensor, values: list[tuple[int, int]]) -> float:
    """Mean negative log-likelihood (nats) of the values' tokens, each from the position before it."""
    at = torch.cat([torch.arange(a - 1, b - 1, device=tokens.device) for a, b in values])
    logp = torch.log_softmax(logits[at].float(), dim=-1)
    return float(-logp.gather(-1, tokens[at + 1, None]).mean())


def grade_episodes(model: nn.Module, episodes: list[Episode], device: torch.device,
                   batch_size: int) -> list[tuple[float, float]]:
    """Each episode's ``(share of values right, answer NLL)`` (one forward per batch of equal-length
    episodes)."""
    out: list[tuple[float, float]] = []
    for i in range(0, len(episodes), batch_size):
        chunk = episodes[i:i + batch_size]
        x = torch.stack([e.tokens for e in chunk]).to(device)
        logits = model(x).logits
        out += [(_values_right(logits[j], x[j], e.values), _values_nll(logits[j], x[j], e.values))
                for j, e in enumerate(chunk)]
    return out


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of ``task = "mean"``: per context, the mean score (and answer NLL) over the tasks that ran
    there."""
    out = []
    for c in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == c]
        out.append({"task": "mean", "context": c, "score": sum(r["score"] for r in here) / len(here),
                    "answer_nll": sum(r["answer_nll"] for r in here) / len(here), "n": len(here)})
    return out
