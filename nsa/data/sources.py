"""Document sources: deterministic streams of raw records that can restart at any document index.

``Source.documents(start)`` yields the raw record of document ``start``, ``start + 1``, ... (text for
``embedded``/``local``/``fineweb_edu``, which the loader checks with :func:`nsa.data.records.clean_text`;
token id arrays for ``synthetic``). Finite sources end; the loader starts them again for the next epoch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from nsa.data.config import DataConfig
from nsa.errors import DataError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
OFFLINE_HINT = (
    "check the network (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE must be unset), use data.source=embedded or "
    "local, or set data.synthetic_on_fail=true"
)


class Source(Protocol):
    """A deterministic, restartable stream of documents."""

    name: str
    finite: bool  # True: ends, and the loader restarts it at index 0 for the next epoch
    tokenized: bool  # True: records are token id lists (synthetic), else text

    def documents(self, start: int) -> Iterator[Any]: ...

    def describe(self) -> str: ...


class EmbeddedSource:
    """The corpus shipped in ``nsa/data/corpus`` (standard-library docstrings)."""

    name = "embedded"
    finite = True
    tokenized = False

    def __init__(self) -> None:
        from nsa.data.corpus import load_corpus

        self._docs = load_corpus()

    def documents(self, start: int) -> Iterator[Any]:
        return islice(self._docs, start, None)

    def describe(self) -> str:
        chars = sum(len(d) for d in self._docs)
        return (
            f"embedded: {len(self._docs)} documents, {chars / 1e6:.1f}M characters (Python stdlib docstrings)"
        )


def _format_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


def resolve_local_files(path: str) -> tuple[str, list[str]]:
    """``(format, files)`` for a file or a folder of JSONL/JSON/Parquet/.txt files (optionally .gz)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path={path} does not exist", hint="point data.path at a file or folder of data"
        )
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".") and _format_of(p)
        )
    formats = {_format_of(p) for p in files}
    if not files or None in formats:
        raise DataError(
            f"data.path={path}: no .jsonl, .json, .parquet or .txt files there",
            hint="use JSONL, Parquet or text files (optionally gzipped)",
        )
    if len(formats) > 1:
        raise DataError(
            f"data.path={path} mixes formats ({', '.join(sorted(str(f) for f in formats))})",
            hint="keep one format per folder",
        )
    return str(formats.pop()), [str(p.resolve()) for p in files]


def _records(ds: Any, start: int, field: str) -> Iterator[Any]:
    """The ``field`` of each record of a ``datasets`` stream from record ``start`` on (skipped lazily)."""
    if start:
        ds = ds.skip(start)
    for record in ds:
        yield record.get(field)


class LocalSource:
    """JSONL, Parquet or text files read through ``datasets`` streaming (``.txt``: one document per paragraph)."""

    name = "local"
    finite = True
    tokenized = False

    def __init__(self, path: str, text_field: str) -> None:
        self.path = path
        self.format, self.files = resolve_local_files(path)
        self.field = "text" if self.format == "text" else text_field
        self._check_field()

    def _dataset(self) -> Any:
        from datasets import load_dataset

        kwargs: dict[str, Any] = {}
        if self.format == "text":
            # undecodable bytes become U+FFFD, which clean_text counts as invalid_utf8
            kwargs = {"sample_by": "paragraph", "encoding_errors": "replace"}
        try:
            return load_dataset(self.format, data_files=self.files, split="train", streaming=True, **kwargs)
        except Exception as exc:
            raise DataError(
                f"data.path={self.path}: cannot read {self.format} files: {_one_line(exc)}"
            ) from None

    def _check_field(self) -> None:
        try:
            first = next(iter(self._dataset()), None)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(
                f"data.path={self.path}: cannot read {self.format} files: {_one_line(exc)}"
            ) from None
        if first is None:
            raise DataError(f"data.path={self.path} holds no records", hint="check the files are not empty")
        if self.field not in first:
            raise DataError(
                f"data.text_field={self.field!r} is not a field of {self.path} (fields: {', '.join(first)})",
                hint="set data.text_field to the field holding the text",
            )

    def documents(self, start: int) -> Iterator[Any]:
        return _records(self._dataset(), start, self.field)

    def describe(self) -> str:
        return f"local: {len(self.files)} {self.format} file(s) at {self.path}, field {self.field!r}"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def first_record_within(fn: Any, timeout_s: float, what: str) -> tuple[Any, float]:
    """Run ``fn()`` in a daemon thread; its result and seconds taken, or DataError after ``timeout_s``."""
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

    def work() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:
            box.put((False, exc))

    t0 = time.perf_counter()
    threading.Thread(target=work, name="nsa-data-probe", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise DataError(f"{what}: no data within data.timeout_s={timeout_s:g}s", hint=OFFLINE_HINT) from None
    if not ok:
        raise DataError(f"{what} is unreachable: {_one_line(value)}", hint=OFFLINE_HINT) from None
    return value, time.perf_counter() - t0


class HFStreamSource:
    """A Hugging Face dataset streamed with ``load_dataset(..., streaming=True)`` (fineweb-edu by default)."""

    name = "fineweb_edu"
    finite = True
    tokenized = False

    def __init__(
        self, dataset: str, config: str | None, split: str, text_field: str, timeout_s: float
    ) -> None:
        self.dataset, self.config, self.split, self.field = dataset, config, split, text_field
        self.label = f"{dataset}/{config} split {split}"
        first, self.first_s = first_record_within(
            lambda: next(iter(self._dataset()), None), timeout_s, f"data source {self.label}"
        )
        if first is None:
            raise DataError(f"{self.label} is empty", hint="check data.hf_dataset, hf_config and hf_split")
        if self.field not in first:
            raise DataError(
                f"data.text_field={self.field!r} is not a field of {self.label} (fields: {', '.join(first)})",
                hint="set data.text_field",
            )

    def _dataset(self) -> Any:
        from datasets import load_dataset

        return load_dataset(self.dataset, self.config, split=self.split, streaming=True)

    def documents(self, start: int) -> Iterator[Any]:
        return _records(self._dataset(), start, self.field)

    def describe(self) -> str:
        return f"fineweb_edu: {self.label} reachable (first record in {self.first_s:.1f}s)"


class SyntheticSource:
    """Token documents of exactly ``seq_len`` tokens, episode ``i`` generated from ``(seed, i)``.

    ``random``: uniform tokens (nothing to learn). ``assoc_recall``: ``n`` key/value pairs, a gap of
    one repeated filler token, then every key once more (shuffled) each followed by its value::

        k1 v1 ... kn vn  g g ... g  q1 a1 ... qn an      (n = clamp(seq_len // 16, 1, 8))

    Each answer is ``seq_len - 4n`` or more tokens after its pair, so only attention that reaches back
    past the gap (beyond a sliding window shorter than that) can predict it.
    """

    name = "synthetic"
    finite = False
    tokenized = True
    KEY_IDS = 16  # keys and values each come from 16 token ids
    MAX_PAIRS = 8  # a 2-layer d=64 transformer learns recall across a 96-token gap in ~2k steps of batch 32

    def __init__(self, task: str, seed: int, seq_len: int, vocab_size: int, eot_id: int) -> None:
        if seq_len < 8:
            raise DataError(f"synthetic data needs train.seq_len >= 8, got {seq_len}")
        self.task, self.seed, self.seq_len = task, seed, seq_len
        alphabet = np.array([t for t in range(min(vocab_size, 256)) if t != eot_id], dtype=np.int64)
        if len(alphabet) < 2 * self.KEY_IDS + 1:
            raise DataError(f"synthetic data needs a vocabulary of at least 34 tokens, got {vocab_size}")
        self.alphabet = alphabet
        self.gap = int(alphabet[0])
        self.keys = alphabet[1 : 1 + self.KEY_IDS]
        self.values = alphabet[1 + self.KEY_IDS : 1 + 2 * self.KEY_IDS]
        self.n_pairs = max(1, min(seq_len // 16, self.MAX_PAIRS))
        self.query_start = seq_len - 2 * self.n_pairs

    def episode(self, index: int) -> np.ndarray:
        """Document ``index``: ``seq_len`` token ids (int64)."""
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, index])
        if self.task == "random":
            return rng.choice(self.alphabet, size=self.seq_len)
        n = self.n_pairs
        keys = rng.choice(self.keys, size=n, replace=False)
        vals = rng.choice(self.values, size=n)
        order = rng.permutation(n)
        out = np.full(self.seq_len, self.gap, dtype=np.int64)
        out[0 : 2 * n : 2], out[1 : 2 * n : 2] = keys, vals
        out[self.query_start :: 2], out[self.query_start + 1 :: 2] = keys[order], vals[order]
        return out

    def target_mask(self) -> list[bool]:
        """Per target position ``t`` of a packed sequence: True where ``y[:, t]`` is a query's answer.

        Episodes fill whole sequences (episode + separator = ``seq_len + 1`` tokens), so this holds for
        every row; the loss on these positions falls only with recall across the gap.
        """
        start = self.query_start
        return [t >= start and (t - start) % 2 == 0 for t in range(self.seq_len)]

    def documents(self, start: int) -> Iterator[Any]:
        index = start
        while True:
            yield self.episode(index)
            index += 1

    def describe(self) -> str:
        detail = (
            f", {self.n_pairs} pairs recalled across a {self.query_start - 2 * self.n_pairs}-token gap"
            if self.task == "assoc_recall"
            else ""
        )
        return f"synthetic: {self.task}, seed {self.seed}, {self.seq_len} tokens per episode{detail}"


def _hf_source(cfg: DataConfig) -> HFStreamSource:
    return HFStreamSource(cfg.hf_dataset, cfg.hf_config, cfg.hf_split, cfg.text_field, cfg.timeout_s)


def open_source(
    cfg: DataConfig, *, seed: int, seq_len: int, vocab_size: int, eot_id: int
) -> tuple[Source, list[str]]:
    """The configured source and any warnings (a fallback to synthetic data is one, to record loudly)."""
    if cfg.source == "embedded":
        return EmbeddedSource(), []
    if cfg.source == "local":
        if not cfg.path:
            raise DataError("data.path is required when data.source=local")
        return LocalSource(cfg.path, cfg.text_field), []
    if cfg.source == "synthetic":
        return SyntheticSource(cfg.synthetic_task, seed, seq_len, vocab_size, eot_id), []
    if cfg.source == "fineweb_edu":
        try:
            return _hf_source(cfg), []
        except DataError as exc:
            if not cfg.synthetic_on_fail:
                raise
            warning = (
                f"data source fineweb_edu failed ({exc.message}); TRAINING ON SYNTHETIC "
                f"{cfg.synthetic_task} DATA INSTEAD (data.synthetic_on_fail=true)"
            )
            return SyntheticSource(cfg.synthetic_task, seed, seq_len, vocab_size, eot_id), [warning]
    raise DataError(f"unknown data.source={cfg.source!r}")


def open_source_probe(data_cfg: DataConfig, timeout_s: float) -> str:
    """Quick reachability check for ``nsa preflight``: a one-line description, or DataError."""
    cfg = data_cfg.model_copy(update={"timeout_s": timeout_s, "synthetic_on_fail": False})
    if cfg.source == "synthetic":
        return f"synthetic: {cfg.synthetic_task} (generated, always available)"
    try:
        source, _ = open_source(cfg, seed=0, seq_len=128, vocab_size=256, eot_id=0)
    except DataError as exc:
        if data_cfg.source == "fineweb_edu" and data_cfg.synthetic_on_fail:
            exc.hint = "data.synthetic_on_fail=true: a run would train on synthetic data instead"
        raise
    return source.describe()
