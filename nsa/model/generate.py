"""Sampling and generation with caches: prefill once, then one cached decode step per new token."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from nsa.errors import NSAError
from nsa.model.cache import ModelCache


class NSALM(Protocol):
    """What generation needs of a language model with caches (``nsa.model.lm.NSALM`` is one)."""

    training: bool

    def new_cache(self, batch_size: int, max_len: int, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> ModelCache: ...

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: ModelCache) -> torch.Tensor: ...

    def decode_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor: ...

    def decode_device_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor: ...

    def eval(self) -> object: ...

    def train(self, mode: bool = True) -> object: ...


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of ``logits [B, V]``: argmax when ``temperature == 0``, else sampling from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` tokens and/or the smallest set whose
    probability reaches ``top_p``. Runs on the device (no host sync)."""
    if temperature < 0:
        raise NSAError(f"temperature={temperature} must be >= 0")
    if temperature == 0:
        return logits.argmax(dim=-1)
    x = logits.float() / temperature
    if top_k is not None and top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def right_align(prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                        torch.Tensor]:
    """Left-padded prompts ``[B, P]`` -> ids with each sequence's real tokens at positions
    ``0 .. len-1`` (padding moved to the end) and ``lengths [B]``."""
    B, P = prompt_ids.shape
    if attention_mask is None:
        return prompt_ids, torch.full((B,), P, dtype=torch.int64, device=prompt_ids.device)
    mask = attention_mask.to(device=prompt_ids.device).bool()
    lengths = mask.sum(dim=1).to(torch.int64)
    pad = P - lengths
    expected = torch.arange(P, device=mask.device)[None, :] >= pad[:, None]
    if not bool(torch.equal(mask, expected)):
        raise NSAError("attention_mask must mark left padding: zeros, then ones up to the end of each row")
    if int(lengths.min()) < 1:
        raise NSAError("every prompt needs at least one token")
    idx = (torch.arange(P, device=mask.device)[None, :] + pad[:, None]).clamp(max=P - 1)
    return torch.gather(prompt_ids, 1, idx), lengths


class GraphedDecoder:
    """``NSALM.decode_step`` captured once as a CUDA graph and replayed for every new token.

    A decode step has static shapes once the cache is sized (``cache.static``), so after a warm-up at
    the current position (whose writes the real step overwrites; the counters are restored) the
    device work is captured; a call copies the tokens in, replays, and advances the host counters.
    The returned logits buffer is overwritten by the next call.
    """

    def __init__(self, model: NSALM, cache: ModelCache, tokens: torch.Tensor) -> None:
        cache.static = True
        self.model, self.cache = model, cache
        self.tokens = tokens.clone()
        lengths, reads = cache.lengths.clone(), cache.reads_total.clone()
        side = torch.cuda.Stream(tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                model.decode_device_step(self.tokens, cache)
                cache.lengths.copy_(lengths)
                cache.reads_total.copy_(reads)
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.decode_device_step(self.tokens, cache)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.check_room()
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.cache.advance_host()
        return self.logits


@torch.no_grad()
def generate_stream(model: NSALM, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    attention_mask: torch.Tensor | None = None, cache: ModelCache | None = None,
                    cuda_graph: bool = False) -> Iterator[torch.Tensor]:
    """Yield the next token ``[B]`` of every sequence, ``max_new_tokens`` times (see ``generate``).

    ``cuda_graph`` (CUDA only) replays the decode step as a CUDA graph (``GraphedDecoder``); if the
    capture fails it warns and decodes eagerly.
    """
    if max_new_tokens < 0:
        raise NSAError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if max_new_tokens == 0:
        return
    ids, lengths = right_align(prompt_ids, attention_mask)
    B, P = ids.shape
    if cache is None:
        cache = model.new_cache(B, P + max_new_tokens)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(seed)
    logits = model.prefill(ids, lengths, cache)
    last = logits[torch.arange(B, device=ids.device), lengths - 1]
    step: Callable[[torch.Tensor], torch.Tensor] | None = None
    for i in range(max_new_tokens):
        tok = sample_next(last, temperature, top_k, top_p, gen)
        yield tok
        if i + 1 < max_new_tokens:
            if step is None:
                step = _step_fn(model, cache, tok, cuda_graph)
            last = step(tok)


def _step_fn(model: NSALM, cache: ModelCache, tok: torch.Tensor, cuda_graph: bool) -> Callable[[torch.Tensor],
    torch.Tensor]:
    if not (cuda_graph and tok.is_cuda):
        return functools.partial(model.decode_step, cache=cache)
    try:
        return GraphedDecoder(model, cache, tok)
    except RuntimeError as exc:
        warnings.warn(f"CUDA graph capture of the decode step failed ({exc}); decoding eagerly", stacklevel=3)
        cache.static = False
        return functools.partial(model.decode_step, cache=cache)


def generate(model: NSALM, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             attention_mask: torch.Tensor | None = None, cuda_graph: bool = False) -> torch.Tensor:
    """``prompt_ids [B, P]`` (left padding where ``attention_mask`` is 0) -> ``[B, P + max_new_tokens]``.

    Each sequence keeps its own positions (the padding is neither stored nor attended). Greedy when
    ``temperature == 0``. Per step the only work is the cached decode and on-device sampling.
    """
    was_training = model.training
    model.eval()
    try:
        new = list(generate_stream(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, attention_mask=attention_mask,
                                   cuda_graph=cuda_graph))
    finally:
        model.train(was_training)
    if not new:
        return prompt_ids
    return torch.cat([prompt_ids, torch.stack(new, dim=1).to(prompt_ids.dtype)], dim=1)
