"""Causal GQA attention of a chunk of queries at an offset: a context-parallel rank's chunk of a dense block.

Queries at positions ``start .. start+L-1`` see the keys ``0 .. start+i``: the prefix ``0 .. start-1``
whole (a rectangle, no mask) and their own ``L`` causally (a square). SDPA's causal mask is top-left, and an
explicit mask sends it to a kernel that reads a ``[L, start+L]`` mask (93 GiB per GPU and 0.31x per GPU at
CP=2, 131,072, m7c-125m with six dense blocks, 2x H200). Here the library runs the two parts (cuDNN, as the
compressed branch at an offset does: :class:`nsa.ops.cmp_sdpa._Library`), merged by their log-sum-exps;
each part's backward runs from the merged output and log-sum-exp (FlashAttention's backward needs no more),
its dq added, its dk/dv its own keys'. ``math`` is the same contract in plain torch ops (CPU, the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from nsa.ops._triton import cc_major
from nsa.ops.cmp_sdpa import split_bwd, split_fwd

_impl: str | None = None  # set_impl: None (chosen per call) or a kernel for every call


def set_impl(impl: str | None) -> None:
    """Run every chunk by ``impl`` (``cudnn``, ``flash``, ``math``: the tests), or ``None``:
    :func:`library_impl`."""
    global _impl
    _impl = impl


def library_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The kernel for a chunk of these tensors (any layout, head dim last): ``cudnn`` on a CUDA GPU of compute
    capability 9 or more, in bf16/fp16, head dims equal, a multiple of 8 and at most 128 (what cuDNN's fused
    attention takes, as the compressed branch checks); else ``None`` (the caller's masked SDPA)."""
    if _impl is not None:
        return _impl
    D = q.shape[-1]
    ok = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
          and k.shape[-1] == v.shape[-1] == D and D % 8 == 0 and D <= 128)
    return "cudnn" if ok and cc_major(q.device) >= 9 else None  # (cached: a constant under torch.compile)


class _Chunk(torch.autograd.Function):
    """The square (keys ``start ..``) and, past position 0, the rectangle (keys ``.. start``) by the library,
    merged; saves ``q``, ``k``, ``v``, the merged ``o`` and ``lse`` and the parts' seeds."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                impl: str) -> tuple[torch.Tensor, ...]:
        return split_fwd(impl, q, k, v, start, scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        q, k, v, ctx.start, ctx.scale, ctx.impl = inputs
        o, lse, *seeds = output
        ctx.save_for_backward(q, k, v, o, lse, *seeds)
        ctx.mark_non_differentiable(lse, *seeds)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        q, k, v, o, lse, *seeds = ctx.saved_tensors
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq = split_bwd(ctx.impl, do.contiguous(), q, k, v, o, lse, tuple(seeds), ctx.start, ctx.scale, dk, dv)
        return dq, dk, dv, None, None, None

def causal_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, impl: str,
              scale: float | None = None) -> torch.Tensor:
    """Queries ``q [B, HQ, L, D]`` at positions ``start ..`` over ``k/v [B, H, start + L, D]`` (the keys from
    position 0 up to the last query; ``HQ`` a multiple of ``H``, query head ``i`` on KV head ``i // (HQ/H)``
    as SDPA's GQA): ``o [B, HQ, L, Dv]``, differentiable in all three (``impl``: :func:`library_impl`'s)."""
    n = start + q.shape[2]
    if k.shape[2] != n or v.shape[2] != n:
        raise ValueError(f"k/v must hold the {n} keys up to the last query; got {k.shape[2]}")
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if impl == "math":  # plain ops view q by KV head
        q = q.contiguous()
    return _Chunk.apply(q, k, v, start, sc, impl)[0]
