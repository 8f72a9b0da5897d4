"""A long-range retrieval task: find the value of a key seen far back in random filler.

Each sequence is uniform filler tokens with one ``key, value`` pair at an even position at least
``gap`` tokens before the end; the last two tokens repeat the key and its value. Only the repeated
value is scored (labels ``-100`` elsewhere), so the loss is ``ln(n_values)`` until the model reads
the pair back from ``gap`` or more positions away. Token layout: keys ``0 .. n_keys-1``, values
``n_keys .. n_keys+n_values-1``, filler the rest of the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa.errors import ConfigError


@dataclass(frozen=True)
class RetrievalTask:
    """Sequences of ``seq_len`` model inputs whose needle sits ``>= gap`` positions before the query."""

    seq_len: int
    gap: int
    vocab_size: int = 256
    n_keys: int = 32
    n_values: int = 32

    def __post_init__(self) -> None:
        if self.gap < 1 or self.gap > self.seq_len - 3:
            raise ConfigError(f"retrieval gap={self.gap} must be in 1 .. seq_len-3={self.seq_len - 3}")
        if self.vocab_size < self.n_keys + self.n_values + 2:
            raise ConfigError(
                f"vocab_size={self.vocab_size} leaves no filler after {self.n_keys} keys and {self.n_values} "
                "values"
            )

    @property
    def chance_loss(self) -> float:
        """Loss of a model that knows the value range but not the value: ``ln(n_values)``."""
        return float(torch.log(torch.tensor(float(self.n_values))))

    def batch(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of shape ``[batch_size, seq_len]`` (int64, on the CPU).

        ``labels[:, -1]`` is the value; every other label is ``-100``. The pair's key sits at an even
        position ``p`` with ``p + 1 <= seq_len - 1 - gap``, so the value is ``>= gap`` positions before
        the final (query) position.
        """
        full = self.seq_len + 1
        first_filler = self.n_keys + self.n_values
        x = torch.randint(first_filler, self.vocab_size, (batch_size, full), generator=generator)
        key = torch.randint(0, self.n_keys, (batch_size,), generator=generator)
        value = torch.randint(self.n_keys, first_filler, (batch_size,), generator=generator)
        last_pos = (full - 3 - self.gap) // 2  # p <= full - 3 - gap, i.e. query (full-2) - value (p+1) >= gap
        pos = torch.randint(0, last_pos + 1, (batch_size,), generator=generator) * 2
        rows = torch.arange(batch_size)
        x[rows, pos] = key
        x[rows, pos + 1] = value
        x[:, -2] = key
        x[:, -1] = value
        inputs = x[:, :-1].contiguous()
        labels = torch.full_like(inputs, -100)
        labels[:, -1] = value
        return inputs, labels


@dataclass(frozen=True)
class TaskLayout:
    """Token ids of the needle and MQAR tasks for a vocabulary: values are the 32 highest ids, keys the
    32 below them (the end-of-text id excluded), filler everything lower. For a byte vocabulary that
    puts keys and values above ASCII, so real text can be the haystack."""

    keys: tuple[int, ...]
    values: tuple[int, ...]
    filler_max: int  # filler ids are 0 .. filler_max - 1, eot excluded
    eot_id: int

    @classmethod
    def for_vocab(cls, vocab_size: int, eot_id: int, n: int = 32) -> TaskLayout:
        top = [t for t in range(vocab_size - 1, -1, -1) if t != eot_id][: 2 * n]
        if vocab_size < 2 * n + 8:
            raise ConfigError(f"vocab_size={vocab_size} is too small for the retrieval tasks (needs "
                              f"{2 * n + 8})")
        return cls(keys=tuple(sorted(top[n:])), values=tuple(sorted(top[:n])), filler_max=min(top),
                   eot_id=eot_id)

    def filler(self, rng: torch.Generator, size: int) -> torch.Tensor:
        """Uniform filler ids (never eot, keys or values)."""
        skip = self.eot_id < self.filler_max
        draw = torch.randint(0, self.filler_max - int(skip), (size,), generator=rng)
        return draw + (draw >= self.eot_id).long() if skip else draw

    def clean(self, haystack: torch.Tensor) -> torch.Tensor:
        """A real-text haystack with every id that would read as a key, value or eot replaced by filler 32
        (a space in a byte vocabulary), so the needle is the only key/value in it."""
        out = haystack.clone()
        bad = (out >= self.filler_max) | (out == self.eot_id)
        out[bad] = 32 if self.filler_max > 32 and self.eot_id != 32 else 1
        return out


def needle_position(context: int, depth: float) -> int:
    """Where a needle at ``depth`` (0 = first token, 1 = just before the question) starts in ``context``
    tokens: the pair sits at ``p, p+1`` and the question (the key again) at ``context - 2``."""
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth={depth} must be in [0, 1]")
    if context < 6:
        raise ConfigError(f"context={context} is too short for a needle (needs >= 6)")
    return round(depth * (context - 4))


def needle_episode(layout: TaskLayout, rng: torch.Generator, context: int, depth: float,
                   haystack: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """``(tokens [context], answer positions)``: filler (or ``haystack``), a key/value pair at
    ``needle_position(context, depth)``, the key again at ``context - 2`` and its value last. The model
    reads ``tokens`` and is scored where the next token is the value (position ``context - 2``)."""
    p = needle_position(context, depth)
    out = layout.filler(rng, context) if haystack is None else layout.clean(haystack[:context])
    if out.numel() < context:
        raise ConfigError(f"the haystack has {out.numel()} tokens, fewer than context={context}")
    key = layout.keys[int(torch.randint(0, len(layout.keys), (1,), generator=rng))]
    value = layout.values[int(torch.randint(0, len(layout.values), (1,), generator=rng))]
    out[p], out[p + 1] = key, value
    out[context - 2], out[context - 1] = key, value
    return out, [context - 2]


def mqar_episode(layout: TaskLayout, rng: torch.Generator, context: int, pairs: int,
                 queries: int | None = None, haystack: torch.Tensor | None = None) -> tuple[torch.Tensor,
                     list[int]]:
    """Multi-query associative recall: ``pairs`` key/value pairs (distinct keys) at random even slots
    of the filler, then ``queries`` of them asked again (key, value) in random order at the end. Scored
    at each asked key's position (the next token is its value)."""
    q = pairs if queries is None else queries
    if not 1 <= q <= pairs <= len(layout.keys):
        raise ConfigError(f"mqar needs 1 <= queries ({q}) <= pairs ({pairs}) <= {len(layout.keys)}")
    region = context - 2 * q  # the pairs live in positions 0 .. region-1
    slots = region // 2
    if slots < pairs:
        raise ConfigError(f"context={context} is too short for {pairs} pairs and {q} queries")
    out = layout.filler(rng, context) if haystack is None else layout.clean(haystack[:context])
    keys = torch.tensor(layout.keys)[torch.randperm(len(layout.keys), generator=rng)[:pairs]]
    vals = torch.tensor(layout.values)[torch.randint(0, len(layout.values), (pairs,), generator=rng)]
    where = torch.randperm(slots, generator=rng)[:pairs] * 2
    out[where], out[where + 1] = keys, vals
    asked = torch.randperm(pairs, generator=rng)[:q]
    out[region::2], out[region + 1 :: 2] = keys[asked], vals[asked]
    return out, list(range(region, context, 2))
