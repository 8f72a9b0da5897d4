"""The batch loader: background prefetch, fetch-time stats and a checkpointable position."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np
import torch

from nsa.config.data import DataConfig
from nsa.data.packing import DocumentStream, Position, SequencePacker
from nsa.data.sources import Source, open_source
from nsa.data.split import belongs
from nsa.data.tokenizers import Tokenizer
from nsa.errors import DataError

STATE_VERSION = 1
FETCH_WINDOW = 200  # fetch times kept for the percentiles


class Loader:
    """Yields ``(x, y)`` LongTensors ``[batch_size, seq_len]``; ``state_dict()`` is the consumer's position.

    With ``prefetch_depth > 0`` a daemon thread prepares batches ahead into a bounded queue; the
    thread starts at the first ``next()`` (so a ``load_state_dict`` right after construction wastes nothing).
    """

    def __init__(
        self,
        source: Source,
        tokenizer: Tokenizer,
        *,
        data_cfg: DataConfig,
        seq_len: int,
        batch_size: int,
        split: str,
        rank: int,
        world_size: int,
        device: torch.device | str | None,
        warnings: list[str] | None = None,
    ) -> None:
        self.source, self.tokenizer, self.cfg = source, tokenizer, data_cfg
        self.seq_len, self.batch_size, self.split = seq_len, batch_size, split
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else None
        self._cuda = self.device is not None and self.device.type == "cuda"
        self.warnings: list[str] = list(warnings or [])
        self.description = source.describe()
        keep = partial(
            belongs, split=split, val_fraction=data_cfg.val_fraction, rank=rank, world_size=world_size
        )
        label = f"split {split} of {source.name} on rank {rank}/{world_size}"
        self._stream = DocumentStream(
            source, getattr(tokenizer, "encode_array", tokenizer.encode), tokenizer.eot_id, keep,
                                      data_cfg.max_doc_chars,
            label
        )
        self._packer = SequencePacker(self._stream, seq_len)
        mask_fn = getattr(source, "target_mask", None)
        mask = mask_fn() if callable(mask_fn) else None
        # [seq_len] bool: where y holds an answer of a synthetic task (None for text and random tokens)
        self.answer_mask: torch.Tensor | None = torch.tensor(mask,
                                                             dtype=torch.bool) if mask is not None else None
        if data_cfg.loss_on == "answers" and self.answer_mask is None:
            raise DataError(
                f"data.loss_on=answers needs a task with answers, not {source.describe()}",
                hint="use data.source=synthetic with data.synthetic_task=needle, mqar or assoc_recall, or "
                     "data.loss_on=all",
            )
        self._depth = data_cfg.prefetch_depth
        self._fetch_ms: deque[float] = deque(maxlen=FETCH_WINDOW)
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(self._depth, 1))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._state = self._snapshot(batches=0, tokens_seen=0)

    # producing -------------------------------------------------------------------------------------
    def _snapshot(self, batches: int, tokens_seen: int) -> dict[str, Any]:
        counters = self._stream.counters
        return {
            "version": STATE_VERSION,
            "source": self.source.name,
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "tokenizer": self.tokenizer.name,
            "position": asdict(self._packer.position),
            "batches": batches,
            "tokens_seen": tokens_seen,
            "docs_seen": counters.docs_seen,
            "chars_seen": counters.chars_seen,
            "skipped": dict(counters.skipped),
        }

    def _produce(self, batches: int, tokens_seen: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        seqs = np.stack([self._packer.next_sequence() for _ in range(self.batch_size)])
        batch = torch.from_numpy(seqs)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.cfg.loss_on == "answers":
            assert self.answer_mask is not None
            y = y.clone()  # with one row, contiguous() returns views that share x's storage
            y[:, ~self.answer_mask] = -100
        if self._cuda:
            x, y = x.pin_memory(), y.pin_memory()
        state = self._snapshot(batches + 1, tokens_seen + self.batch_size * self.seq_len)
        return x, y, state

    def _run(
        self, q: queue.Queue[tuple[str, Any]], stop: threading.Event, batches: int, tokens_seen: int
    ) -> None:
        def put(item: tuple[str, Any]) -> None:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        try:
            while not stop.is_set():
                x, y, state = self._produce(batches, tokens_seen)
                batches, tokens_seen = state["batches"], state["tokens_seen"]
                put(("batch", (x, y, state)))
        except BaseException as exc:
            put(("error", exc))

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=max(self._depth, 1))
        self._thread = threading.Thread(
            target=self._run,
            args=(self._queue, self._stop, self._state["batches"], self._state["tokens_seen"]),
            name=f"nsa-loader-{self.split}-r{self.rank}",
            daemon=True,
        )
        self._thread.start()

    def _halt(self, strict: bool = True) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=30)
        if strict and thread.is_alive():
            raise DataError(
                "the loader thread did not stop within 30 s (a stalled read?)",
                hint="check the data source; restart the run if it persists",
            )

    # consuming -------------------------------------------------------------------------------------
    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._error is not None:
            raise self._error
        t0 = time.perf_counter()
        if self._depth == 0:
            x, y, state = self._produce(self._state["batches"], self._state["tokens_seen"])
        else:
            if self._thread is None:
                self._start()
            kind, payload = self._queue.get()
            if kind == "error":
                self._error = payload
                self._halt()
                raise payload
            x, y, state = payload
        if self.device is not None:
            x = x.to(self.device, non_blocking=self._cuda)
            y = y.to(self.device, non_blocking=self._cuda)
        self._fetch_ms.append((time.perf_counter() - t0) * 1000.0)
        self._state = state
        return x, y

    def stats(self) -> dict[str, Any]:
        """Fetch-time percentiles (recent window, ms), counters, skipped records by reason, warnings
        (the loader's and the source's)."""
        times = np.array(self._fetch_ms, dtype=np.float64)
        state = self._state
        return {
            "source": self.description,
            "split": self.split,
            "fetch_p50_ms": float(np.percentile(times, 50)) if times.size else None,
            "fetch_p95_ms": float(np.percentile(times, 95)) if times.size else None,
            "fetch_last_ms": float(times[-1]) if times.size else None,
            "batches": state["batches"],
            "docs_seen": state["docs_seen"],
            "chars_seen": state.get("chars_seen", 0),
            "tokens_seen": state["tokens_seen"],
            "epoch": state["position"]["epoch"],
            "skipped": dict(state["skipped"]),
            "skipped_total": sum(state["skipped"].values()),
            "queue_depth": self._queue.qsize() if self._thread is not None else 0,
            "warnings": [*self.warnings, *self._source_warnings()],
        }

    def _source_warnings(self) -> list[str]:
        """The source's own warnings (e.g. malformed local JSON lines), if it has any."""
        fn = getattr(self.source, "warnings", None)
        return [str(w) for w in fn()] if callable(fn) else []

    # position --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch returned by ``next()`` (not what the thread made ahead)."""
        return {
            **self._state,
            "position": dict(self._state["position"]),
            "skipped": dict(self._state["skipped"]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the loader that produced ``state`` would have continued."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        for key, mine in (
            ("source", self.source.name),
            ("tokenizer", self.tokenizer.name),
        ):
            if state.get(key) != mine:
                raise DataError(
                    f"loader state is for data.{key}={state.get(key)!r}, this run has {mine!r}",
                    hint="resume with the same data settings, or start a new run",
                )
        if state.get("seq_len") != self.seq_len:
            # text continues at the same token whatever the window length (a length curriculum)
            if self.source.one_length:
                raise DataError(
                    f"loader state is for train.seq_len={state.get('seq_len')!r}, this run has "
                    f"{self.seq_len!r} " "and synthetic episodes are laid out for one length",
                    hint=f"resume with --seq-len {state.get('seq_len')}, or start a new run",
                )
            self.warnings.append(f"windows of {self.seq_len} tokens from here (the checkpoint's were "
                                 f"{state.get('seq_len')}), continuing at the same token")
        pos = Position(**state["position"])
        same_shard = (state.get("split"), state.get("rank"), state.get("world_size")) == (
            self.split,
            self.rank,
            self.world_size,
        )
        if not same_shard:
            pos = Position(pos.epoch, pos.index, 0)
            self.warnings.append(
                f"loader state was saved for split {state.get('split')} rank {state.get('rank')}/"
                f"{state.get('world_size')}; resuming at document {pos.index} without its partial document"
            )
        self._halt()
        self._error = None
        self._packer.restore(pos)
        self._stream.counters.docs_seen = int(state.get("docs_seen", 0))
        self._stream.counters.chars_seen = int(state.get("chars_seen", 0))  # absent in states saved before it
        self._stream.counters.skipped = dict(state.get("skipped", {}))
        self._state = {**self._snapshot(int(state.get("batches", 0)), int(state.get("tokens_seen", 0)))}

    def close(self) -> None:
        """Stop the prefetch thread (a thread stuck in a read is left behind; it is a daemon)."""
        self._halt(strict=False)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def slowest_position(states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """The loader state to resume from on another number of ranks: the saved rank furthest behind (lowest
    epoch, document, offset). Every new rank continues its own shard from that document, so no document
    is skipped; the faster ranks' last few documents are read again."""
    return min(states,
               key=lambda s: (s["position"]["epoch"], s["position"]["index"], s["position"]["offset"]))


def build_loader(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    split: str = "train",
    device: torch.device | str | None = None,
) -> Loader:
    """Open the configured source and return a :class:`Loader` for one split and rank."""
    if split not in ("train", "val"):
        raise DataError(f"unknown split {split!r}", hint="use train or val")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world_size {world_size}")
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
    if split == "val" and data_cfg.val_fraction <= 0:
        raise DataError("the val split is empty (data.val_fraction=0)", hint="set data.val_fraction > 0")
    source, warnings = open_source(
        data_cfg, seed=seed, seq_len=seq_len, vocab_size=tokenizer.vocab_size, eot_id=tokenizer.eot_id
    )
    return Loader(
        source,
        tokenizer,
        data_cfg=data_cfg,
        seq_len=seq_len,
        batch_size=batch_size,
        split=split,
        rank=rank,
        world_size=world_size,
        device=device,
        warnings=warnings,
    )
