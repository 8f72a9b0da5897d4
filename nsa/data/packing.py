"""Packing: documents -> one token stream with separators -> fixed sequences of ``seq_len + 1`` tokens.

Each sequence gives inputs ``x = seq[:-1]`` and targets ``y = seq[1:]``; consecutive sequences do
not overlap. :class:`DocumentStream` supplies documents (split, shard, bad-record checks, epochs) and
:class:`SequencePacker` cuts them into sequences while tracking a position that can be restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from nsa.data.records import EMPTY, clean_text
from nsa.data.sources import Source
from nsa.errors import DataError


def pack_sequences(docs: Iterable[Sequence[int]], seq_len: int, eot_id: int) -> Iterator[np.ndarray]:
    """Every full sequence of ``seq_len + 1`` tokens from ``doc0 eot doc1 eot ...`` (the tail is dropped)."""
    need = seq_len + 1
    buf = np.empty(0, dtype=np.int64)
    for doc in docs:
        buf = np.concatenate([buf, np.asarray(doc, dtype=np.int64), np.array([eot_id], dtype=np.int64)])
        while len(buf) >= need:
            yield buf[:need].copy()
            buf = buf[need:]


@dataclass
class StreamCounters:
    """What a stream has read: usable documents, their characters (text sources) and skipped records by
    reason."""

    docs_seen: int = 0
    chars_seen: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


class DocumentStream:
    """Tokenized documents of one split and rank, in source order, epoch after epoch.

    ``pull()`` returns ``(epoch, index, tokens)`` where ``tokens`` ends with ``eot_id``.
    """

    def __init__(
        self,
        source: Source,
        encode: Callable[[str], list[int] | np.ndarray],
        eot_id: int,
        keep: Callable[[int], bool],
        max_doc_chars: int,
        label: str,
    ) -> None:
        self.source, self.encode, self.eot_id, self.keep = source, encode, eot_id, keep
        self.max_doc_chars, self.label = max_doc_chars, label
        self.counters = StreamCounters()
        self.seek(0, 0)

    def seek(self, epoch: int, index: int) -> None:
        """Continue with the first document at or after ``index`` in ``epoch``."""
        self.epoch, self._next = epoch, index
        self._it = self.source.documents(index)
        self._pass_from_zero = index == 0
        self._found = False

    def _tokens(self, raw: object) -> np.ndarray | None:
        if self.source.tokenized:
            tokens = np.asarray(raw, dtype=np.int64)
        else:
            text, reason = clean_text(raw, self.max_doc_chars)
            if text is None:
                self._skip(str(reason))
                return None
            tokens = np.asarray(self.encode(text), dtype=np.int64)
            self.counters.chars_seen += len(text)
        if tokens.size == 0:
            self._skip(EMPTY)
            return None
        return np.concatenate([tokens, np.array([self.eot_id], dtype=np.int64)])

    def _skip(self, reason: str) -> None:
        self.counters.skipped[reason] = self.counters.skipped.get(reason, 0) + 1

    def pull(self) -> tuple[int, int, np.ndarray]:
        while True:
            for raw in self._it:
                index = self._next
                self._next += 1
                if not self.keep(index):
                    continue
                tokens = self._tokens(raw)
                if tokens is None:
                    continue
                self._found = True
                self.counters.docs_seen += 1
                return self.epoch, index, tokens
            if not self.source.finite or (self._pass_from_zero and not self._found):
                raise DataError(
                    f"no usable documents for {self.label}",
                    hint="check data.val_fraction, the number of ranks and the skipped-record counts",
                )
            self.seek(self.epoch + 1, 0)


@dataclass
class Position:
    """Where the next sequence starts: ``offset`` tokens into document ``index`` of ``epoch``."""

    epoch: int = 0
    index: int = 0
    offset: int = 0


class SequencePacker:
    """Cuts a :class:`DocumentStream` into sequences of ``seq_len + 1`` tokens; ``position`` restores it."""

    def __init__(self, stream: DocumentStream, seq_len: int) -> None:
        self.stream, self.need = stream, seq_len + 1
        self._buf = np.empty(0, dtype=np.int64)
        self.position = Position()

    def restore(self, pos: Position) -> None:
        """Continue exactly at ``pos`` (re-reads and re-tokenizes the partly used document)."""
        self.stream.seek(pos.epoch, pos.index)
        self._buf = np.empty(0, dtype=np.int64)
        self.position = Position(pos.epoch, pos.index, 0)
        if pos.offset:
            saved = self.stream.counters
            self.stream.counters = StreamCounters()
            epoch, index, tokens = self.stream.pull()
            self.stream.counters = saved
            if (epoch, index) != (pos.epoch, pos.index) or pos.offset >= len(tokens):
                raise DataError(
                    f"loader position (epoch {pos.epoch}, document {pos.index}, token {pos.offset}) "
                    f"does not match the data of {self.stream.label}",
                    hint="resume with the same data, tokenizer and seq_len",
                )
            self._buf = tokens[pos.offset :]
            self.position = pos

    def next_sequence(self) -> np.ndarray:
        last: tuple[int, int, int] | None = None
        while len(self._buf) < self.need:
            epoch, index, tokens = self.stream.pull()
            self._buf = np.concatenate([self._buf, tokens])
            last = (epoch, index, len(tokens))
        seq, self._buf = self._buf[: self.need], self._buf[self.need :]
        if last is not None:
            epoch, index, length = last
            if len(self._buf):
                self.position = Position(epoch, index, length - len(self._buf))
            else:
                self.position = Position(epoch, index + 1, 0)
        elif len(self._buf):
            self.position = Position(
                self.position.epoch, self.position.index, self.position.offset + self.need
            )
        else:
            self.position = Position(self.position.epoch, self.position.index + 1, 0)
        return seq
