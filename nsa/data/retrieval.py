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
                f"vocab_size={self.vocab_size} leaves no filler after {self.n_keys} keys and {self.n_values} values"
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
