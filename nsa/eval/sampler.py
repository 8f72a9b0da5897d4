"""Continue a prompt with a trained model: load it where it runs best, check the request, and yield the
text as it is generated (whole characters only: a multi-byte character waits for its last byte)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nsa.data.tokenizers import get_tokenizer
from nsa.errors import ConfigError
from nsa.model.generate import generate_stream
from nsa.model.load import load_model


def pick_device(device: str) -> str:
    """``auto`` -> ``cuda`` when visible, else ``cpu``; a request the machine cannot serve is a
    ConfigError."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device {device!r} must be auto, cpu or cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda but no CUDA device is visible", hint="use --device cpu")
    return device


@dataclass
class Sampler:
    """A loaded model with its tokenizer on one device (the run's precision on a GPU, float32 on a CPU)."""

    model: Any
    tokenizer: Any
    config: Any
    source: str
    device: str

    @classmethod
    def open(cls, path: str | Path, device: str = "auto") -> Sampler:
        device = pick_device(device)
        loaded = load_model(path, device="cpu")
        cfg = loaded.config
        if device == "cuda":
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.runtime.precision, torch.float32)
            loaded.model.to(device=device, dtype=dtype)
        return cls(loaded.model, get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path), cfg,
                   str(loaded.source), device)

    def encode(self, prompt: str, max_new_tokens: int) -> list[int]:
        """The prompt's ids (an empty prompt starts a new document), checked against the model's limits."""
        ids: list[int] = self.tokenizer.encode(prompt) or [self.tokenizer.eot_id]
        m = self.config.model
        if len(ids) + max_new_tokens > m.max_seq_len:
            raise ConfigError(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                              f"model.max_seq_len={m.max_seq_len}")
        if any(i >= m.vocab_size for i in ids):
            raise ConfigError(f"the tokenizer '{self.config.data.tokenizer}' produced ids beyond "
                              f"model.vocab_size={m.vocab_size}")
        return ids

    def stream(self, ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_at_eot: bool = True, cuda_graph: bool = False) -> Iterator[str]:
        """Pieces of new text as they become whole characters; their concatenation is the decoded output."""

        prompt = torch.tensor([ids], dtype=torch.long, device=self.device)
        new: list[int] = []
        printed = ""
        for t in generate_stream(self.model, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, cuda_graph=cuda_graph):
            token = int(t[0])
            if stop_at_eot and token == self.tokenizer.eot_id:
                break
            new.append(token)
            text = self.tokenizer.decode(new)
            if text.endswith("\ufffd") or not text.startswith(printed):
                continue  # an incomplete multi-byte character: wait for the rest
            yield text[len(printed):]
            printed = text
        text = self.tokenizer.decode(new)
        rest = text[len(printed):] if text.startswith(printed) else "\n" + text
        if rest:
            yield rest


@dataclass
class Sampling:
    """``nsa sample``: where the model came from (``header``) and the continuation's pieces as generated."""

    header: str
    pieces: Iterator[str]


def sample_text(path: str | Path, prompt: str, max_new_tokens: int, *, device: str = "auto",
                **stream: Any) -> Sampling:
    """Open the model at ``path`` on ``device`` and start continuing ``prompt`` (``stream``: the sampling
    options of :meth:`Sampler.stream`); the request is checked before the first piece."""
    sampler = Sampler.open(path, device)
    ids = sampler.encode(prompt, max_new_tokens)
    return Sampling(f"[{sampler.source}, {sampler.device}, {len(ids)} prompt tokens]",
                    sampler.stream(ids, max_new_tokens, **stream))
