"""The compressed branch as square causal GQA attention, run by a library kernel (cuDNN or FlashAttention).

Query ``t`` sees compressed tokens ``0 .. m`` with ``m = floor((t - l + 1) / d)``: the ``d`` consecutive
positions ``t = m*d + l - 1 + r`` (``r < d``) share one key set. Stacking those ``d`` positions with a
group's ``G`` heads as query heads makes the branch ordinary causal attention over ``N = S_cmp`` *virtual*
positions with ``G*d`` query heads per KV head, the shape dense attention kernels run at full speed; their
log-sum-exp feeds the block scores. Positions ``t < l - 1`` see no token (zeros, ``lse = +inf``).

Layouts: *rows* ``[B, S, HQ, ...]`` (the op's) and *virtual* ``[B, H*G*d, N, ...]`` (heads ordered
``(kv head, group head, r)``, so SDPA's GQA maps query head ``i`` to KV head ``i // (G*d)``). One strided
copy moves a tensor between them; the virtual rows past position ``S - 1`` are zeros.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nsa.ops.indexing import num_cmp

IMPLS = ("cudnn", "flash", "math")
LOG2E = 1.4426950408889634


def _rows_parts(x: torch.Tensor, H: int, l: int, d: int, n_full: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    """Views of rows ``x [B, S, HQ, *t]``: the ``n_full`` whole virtual rows ``[B, n_full, d, H, G, *t]`` and the
    partial last one ``[B, rem, H, G, *t]``."""
    G = x.shape[2] // H
    full = x[:, l - 1: l - 1 + n_full * d].unflatten(1, (n_full, d)).unflatten(3, (H, G))
    part = x[:, l - 1 + n_full * d:].unflatten(2, (H, G))
    return full, part


def _virtual_parts(xv: torch.Tensor, H: int, d: int, n_full: int, rem: int) -> tuple[torch.Tensor, ...]:
    """Views of virtual ``xv [B, H*G*d, N, *t]`` matching :func:`_rows_parts`, and the padding past ``S - 1``."""
    tail = list(range(5, xv.dim() + 2))
    v = xv.unflatten(1, (H, -1, d)).permute(0, 4, 3, 1, 2, *tail)  # [B, N, d, H, G, *t]
    if n_full == v.shape[1]:
        return v, v[:, :0, 0], v[:, :0]
    return v[:, :n_full], v[:, n_full, :rem], v[:, n_full, rem:]


def _split(S: int, l: int, d: int, N: int) -> tuple[int, int]:  # noqa: E741
    span = max(0, S - (l - 1))
    n_full = min(span // d, N)
    return n_full, span - n_full * d


def to_virtual(x: torch.Tensor, H: int, l: int, d: int, mul: torch.Tensor | None = None) -> torch.Tensor:  # noqa: E741
    """Rows ``x [B, S, HQ, *t]`` (times ``mul``, broadcast to ``x``) as a new virtual tensor
    ``[B, H*G*d, S_cmp, *t]``, zeros past ``S - 1``: one pass over ``x``."""
    B, S, HQ = x.shape[:3]
    N = num_cmp(S, l, d)
    n_full, rem = _split(S, l, d, N)
    xv = x.new_empty(B, HQ * d, N, *x.shape[3:])
    v_full, v_part, v_pad = _virtual_parts(xv, H, d, n_full, rem)
    v_pad.zero_()
    for src, dst, m in zip(_rows_parts(x, H, l, d, n_full), (v_full, v_part),
                           _rows_parts(mul, H, l, d, n_full) if mul is not None else (None, None), strict=True):
        if m is None:
            dst.copy_(src)
        else:
            torch.mul(src, m, out=dst)
    return xv


def to_rows(xv: torch.Tensor, dst: torch.Tensor, H: int, l: int, d: int, *, fill: float = 0.0,  # noqa: E741
            mul: float = 1.0) -> None:
    """Write virtual ``xv`` (times ``mul``) into rows ``dst [B, S, HQ, *t]`` (any strides); the first ``l - 1``
    positions get ``fill``."""
    S = dst.shape[1]
    n_full, rem = _split(S, l, d, xv.shape[2])
    dst[:, : min(l - 1, S)].fill_(fill)
    for src, out in zip(_virtual_parts(xv, H, d, n_full, rem)[:2], _rows_parts(dst, H, l, d, n_full), strict=True):
        if mul == 1.0:
            out.copy_(src)
        else:
            torch.mul(src, mul, out=out)


class _Virtual(torch.autograd.Function):
    """:func:`to_virtual` with its gradient (the inverse copy; zeros at the positions no virtual row holds)."""

    @staticmethod
    def forward(x: torch.Tensor, H: int, l: int, d: int) -> torch.Tensor:  # noqa: E741
        return to_virtual(x, H, l, d)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, ctx.H, ctx.l, ctx.d = inputs
        ctx.rows_shape = x.shape

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dx = g.new_empty(ctx.rows_shape)
        to_rows(g, dx, ctx.H, ctx.l, ctx.d)
        return dx, None, None, None


def _attend_math(qv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention in plain torch ops (float32 or wider inside), for CPU and the tests."""
    B, HR, N, D = qv.shape
    H = k.shape[1]
    f = torch.promote_types(qv.dtype, torch.float32)
    s = torch.einsum("bhrnd,bhmd->bhrnm", qv.view(B, H, HR // H, N, D).to(f), k.to(f)) * scale
    causal = torch.ones(N, N, dtype=torch.bool, device=qv.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhrnm,bhmd->bhrnd", torch.exp(s - lse[..., None]), v.to(f))
    return o.reshape(B, HR, N, v.shape[-1]).to(qv.dtype), lse.reshape(B, HR, N)


class _Library(torch.autograd.Function):
    """The branch by a library kernel on the virtual rows, saving ``q`` (which the NSA op keeps anyway) and
    regrouping it again in the backward instead of keeping the virtual copy (one ``q``-sized buffer less)."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l: int, d: int, scale: float,  # noqa: E741
                impl: str) -> tuple[torch.Tensor, ...]:
        qv = to_virtual(q, k.shape[1], l, d)
        if impl == "cudnn":
            o, lse, _cq, _ck, _mq, _mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qv, k, v, None, True, 0.0, True, False, scale=scale)
        else:
            o, lse, _cq, _ck, _mq, _mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
                qv, k, v, 0.0, True, False, scale=scale)
        return o, lse, seed, offset

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        q, k, v, ctx.l, ctx.d, ctx.scale, ctx.impl = inputs
        o, lse, seed, offset = output
        ctx.save_for_backward(q, k, v, o, lse, seed, offset)
        ctx.mark_non_differentiable(lse, seed, offset)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        q, k, v, o, lse, seed, offset = ctx.saved_tensors
        H, N = k.shape[1], k.shape[2]
        qv = to_virtual(q, H, ctx.l, ctx.d)
        if ctx.impl == "cudnn":
            dqv, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, qv, k, v, o, lse, seed, offset, None, None, None, N, N, 0.0, True, scale=ctx.scale)
        else:
            dqv, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do, qv, k, v, o, lse, None, None, N, N, 0.0, True, seed, offset, scale=ctx.scale)
        del qv
        dq = q.new_empty(q.shape)
        to_rows(dqv, dq, H, ctx.l, ctx.d)
        return dq, dk, dv, None, None, None, None


def attend(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, l: int, d: int, scale: float,  # noqa: E741
           impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed branch of queries ``q [B, S, HQ, D]`` over ``k_cmp/v_cmp [B, S_cmp, H, D]`` (positions
    from 0, ``S_cmp = num_cmp(S)``): virtual ``(o [B, HQ*d, S_cmp, Dv], lse [B, HQ*d, S_cmp])``, lse in
    natural log (float32). Differentiable in ``q``, ``k_cmp``, ``v_cmp`` (``impl``: one of :data:`IMPLS`)."""
    H = k_cmp.shape[2]
    k, v = k_cmp.transpose(1, 2), v_cmp.transpose(1, 2)
    if impl in ("cudnn", "flash"):
        o, lse, *_ = _Library.apply(q, k, v, l, d, scale, impl)
        return o, lse.reshape(o.shape[:3])
    if impl == "math":
        return _attend_math(_Virtual.apply(q, H, l, d), k, v, scale)
    raise ValueError(f"unknown compressed-branch kernel '{impl}': choose one of {', '.join(IMPLS)}")


def take(o_v: torch.Tensor, lse_v: torch.Tensor, o_dst: torch.Tensor, H: int, l: int, d: int) -> torch.Tensor:  # noqa: E741
    """Write :func:`attend`'s output into the op's row slot ``o_dst [B, S, HQ, Dv]``; return the rows' lse
    ``[B, S, HQ]`` in the kernels' convention (log2 domain, ``+inf`` where no token is visible)."""
    to_rows(o_v, o_dst, H, l, d)
    lse = torch.empty(o_dst.shape[:3], device=o_dst.device, dtype=torch.float32)
    to_rows(lse_v, lse, H, l, d, fill=math.inf, mul=LOG2E)
    return lse


def grad_out(do: torch.Tensor, gate: torch.Tensor, H: int, l: int, d: int) -> torch.Tensor:  # noqa: E741
    """The gradient of :func:`attend`'s output from the op's ``do [B, S, HQ, Dv]`` and the branch's gate
    ``[B, S, HQ]``: ``gate * do`` in the virtual layout, one pass."""
    return to_virtual(do, H, l, d, mul=gate.unsqueeze(-1))
