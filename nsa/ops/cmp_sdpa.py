"""The compressed branch as square causal GQA attention, run by a library kernel (cuDNN or FlashAttention).

Query ``t`` sees compressed tokens ``0 .. m`` with ``m = floor((t - l + 1) / d)``: the ``d`` consecutive
positions ``t = m*d + l - 1 + r`` (``r < d``) share one key set. Stacking those ``d`` positions with a
group's ``G`` heads as query heads makes the branch ordinary causal attention over ``N = S_cmp`` *virtual*
positions with ``G*d`` query heads per KV head, the shape dense attention kernels run at full speed; their
log-sum-exp feeds the block scores. Positions ``t < l - 1`` see no token (zeros, ``lse = +inf``).

Layouts: *rows* ``[B, S, HQ, ...]`` (the op's) and *virtual* ``[B, H*G*d, N, ...]`` (heads ordered
``(kv head, group head, r)``, so SDPA's GQA maps query head ``i`` to KV head ``i // (G*d)``). One strided
copy moves a tensor between them; the virtual rows past position ``S - 1`` are zeros.

Queries at an offset (a context-parallel chunk at positions ``q_start ..``, its keys from position 0 up to
its last query): virtual rows ``n0 ..`` (:func:`geometry`), the first one possibly shared with earlier
queries (their slots zeros); they see the tokens before ``n0`` whole and their own causally, which the
library runs as two calls merged by their log-sum-exps (:class:`_Library`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nsa.ops._triton import interpreting, regroup, tuned

IMPLS = ("cudnn", "flash", "math")
LOG2E = 1.4426950408889634


def geometry(S: int, l: int, d: int, q_start: int = 0) -> tuple[int, int, int]:  # noqa: E741
    """The virtual rows of query rows ``0 .. S-1`` at positions ``q_start ..``: ``(n0, origin, N)``: the first
    virtual row's number ``n0`` (its keys are compressed tokens ``0 .. n0 + i`` for virtual row ``i``), the
    row index ``origin`` where that row's ``r = 0`` sits (negative: its first ``-origin`` positions belong to
    earlier queries; positive: rows before it see no token), and the number of virtual rows ``N``."""
    n0 = max(0, (q_start - (l - 1)) // d)
    origin = n0 * d + (l - 1) - q_start
    return n0, origin, max(0, -(-(S - origin) // d))


def _segments(S: int, origin: int, d: int, N: int) -> list[tuple[int, int, int, int, int]]:
    """How rows ``0 .. S-1`` fill ``N`` virtual rows from row index ``origin``: ``(k0, k1, ra, rb, s0)`` =
    virtual rows ``k0 .. k1-1``, offsets ``ra .. rb-1`` in each, from row ``s0`` on (whole virtual rows in one
    segment; a partial first or last row alone)."""
    out = []
    k = 0
    if origin < 0 and N > 0:  # the first virtual row starts before row 0
        rb = min(d, S - origin)
        out.append((0, 1, -origin, rb, 0))
        k = 1
    k_full = max(k, min(N, (S - origin) // d))  # the virtual rows wholly inside rows 0 .. S-1 end here
    if k_full > k:
        out.append((k, k_full, 0, d, origin + k * d))
    if k_full < N and origin + k_full * d < S:  # a partial last row
        out.append((k_full, k_full + 1, 0, S - (origin + k_full * d), origin + k_full * d))
    return out


def _views(x: torch.Tensor, xv: torch.Tensor, H: int, d: int, seg: tuple[int, int, int, int, int]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows view and the virtual view of one segment (``[B, rows, d', H, G, *t]`` both)."""
    k0, k1, ra, rb, s0 = seg
    tail = list(range(5, xv.dim() + 2))
    v = xv.unflatten(1, (H, -1, d)).permute(0, 4, 3, 1, 2, *tail)  # [B, N, d, H, G, *t]
    rows = x[:, s0: s0 + (k1 - k0 - 1) * d + (rb - ra)].unflatten(2, (H, -1))
    if k1 - k0 > 1:
        return rows.unflatten(1, (k1 - k0, d)), v[:, k0:k1]
    return rows.unsqueeze(1), v[:, k0:k1, ra:rb]


def to_virtual(x: torch.Tensor, H: int, l: int, d: int, mul: torch.Tensor | None = None,  # noqa: E741
               q_start: int = 0, dot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows ``x [B, S, HQ, *t]`` at positions ``q_start ..`` (times ``mul``, broadcast to ``x``) as a new
    virtual tensor ``[B, H*G*d, N, *t]`` (:func:`geometry`), zeros where no row is: one pass over ``x``.
    ``dot=(o_v, dg)``: also ``dg[..., 0] = sum(x * o)`` per row, ``o`` the rows of virtual ``o_v`` (zeros
    where no virtual row holds a row), ``dg [B, S, HQ, 3]``."""
    B, S, HQ = x.shape[:3]
    _, origin, N = geometry(S, l, d, q_start)
    if dot is not None:
        o_v, dg = dot
        if origin > 0:
            dg[:, : min(origin, S), :, 0] = 0.0
        if _triton_copy(x) and o_v.stride(-1) == 1 and dg.is_contiguous():
            return regroup.to_virtual(x, mul, d, origin, N, dot=(o_v, dg))
        o = torch.empty_like(x)
        to_rows(o_v, o, H, l, d, q_start=q_start)
        dg[..., 0] = (x.float() * o.float()).sum(-1)
    if _triton_copy(x):
        return regroup.to_virtual(x, mul, d, origin, N)
    xv = x.new_empty(B, HQ * d, N, *x.shape[3:])
    segs = _segments(S, origin, d, N)
    if not segs:
        xv.zero_()
    elif segs[0][2] > 0 or segs[-1][3] < d or segs[-1][1] < N:
        _zero_pads(xv, H, d, segs)
    for seg in segs:
        src, dst = _views(x, xv, H, d, seg)
        if mul is None:
            dst.copy_(src)
        else:
            torch.mul(src, _views(mul, xv, H, d, seg)[0], out=dst)
    return xv


def _triton_copy(x: torch.Tensor) -> bool:
    """Whether a layout copy of ``x`` runs as one Triton pass (:mod:`nsa.ops._triton.regroup`; tile key
    ``cmp_copy``: ``triton`` by default on CUDA, where it measured 2.9 ms faster at paper 64k on an H100;
    ``torch`` elsewhere) instead of PyTorch's strided copy."""
    return (x.dim() == 4 and x.stride(-1) == 1 and (x.is_cuda or interpreting())
            and tuned("cmp_copy", "triton" if x.is_cuda else "torch") == "triton")


def _zero_pads(xv: torch.Tensor, H: int, d: int, segs: list[tuple[int, int, int, int, int]]) -> None:
    """Zero the virtual slots no row fills: before the first segment's offset, after the last one's."""
    tail = list(range(5, xv.dim() + 2))
    v = xv.unflatten(1, (H, -1, d)).permute(0, 4, 3, 1, 2, *tail)
    k0, _, ra, _, _ = segs[0]
    v[:, k0, :ra].zero_()
    _, k1, _, rb, _ = segs[-1]
    v[:, k1 - 1, rb:].zero_()
    v[:, k1:].zero_()


def to_rows(xv: torch.Tensor, dst: torch.Tensor, H: int, l: int, d: int, *, fill: float = 0.0,  # noqa: E741
            mul: float = 1.0, q_start: int = 0) -> None:
    """Write virtual ``xv`` (times ``mul``) into rows ``dst [B, S, HQ, *t]`` at positions ``q_start ..`` (any
    strides); rows no virtual row holds (positions before ``l - 1``) get ``fill``."""
    S = dst.shape[1]
    _, origin, N = geometry(S, l, d, q_start)
    if origin > 0:
        dst[:, : min(origin, S)].fill_(fill)
    if mul == 1.0 and _triton_copy(dst):
        regroup.to_rows(xv, dst, d, origin)
        return
    for seg in _segments(S, origin, d, N):
        out, src = _views(dst, xv, H, d, seg)
        if mul == 1.0:
            out.copy_(src)
        else:
            torch.mul(src, mul, out=out)


class _Virtual(torch.autograd.Function):
    """:func:`to_virtual` with its gradient (the inverse copy; zeros at the positions no virtual row
    holds)."""

    @staticmethod
    def forward(x: torch.Tensor, H: int, l: int, d: int, q_start: int) -> torch.Tensor:  # noqa: E741
        return to_virtual(x, H, l, d, q_start=q_start)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, ctx.H, ctx.l, ctx.d, ctx.q_start = inputs
        ctx.rows_shape = x.shape

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dx = g.new_empty(ctx.rows_shape)
        to_rows(g, dx, ctx.H, ctx.l, ctx.d, q_start=ctx.q_start)
        return dx, None, None, None, None


def _scores(qv: torch.Tensor, k: torch.Tensor, scale: float, n0: int) -> torch.Tensor:
    """Scores ``[B, H, G*d, N, n0 + N]`` in float32 or wider, virtual row ``i`` seeing keys ``0 .. n0 +
    i``."""
    B, HR, N, D = qv.shape
    H, NK = k.shape[1], k.shape[2]
    f = torch.promote_types(qv.dtype, torch.float32)
    s = torch.einsum("bhrnd,bhmd->bhrnm", qv.view(B, H, HR // H, N, D).to(f), k.to(f)) * scale
    seen = torch.arange(NK, device=qv.device)[None, :] <= n0 + torch.arange(N, device=qv.device)[:, None]
    return s.masked_fill(~seen, float("-inf"))


def _attend_math(qv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 n0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention in plain torch ops (float32 or wider inside), for CPU and the tests; virtual row
    ``i`` sees keys ``0 .. n0 + i``."""
    B, HR, N, _ = qv.shape
    s = _scores(qv, k, scale, n0)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhrnm,bhmd->bhrnd", torch.exp(s - lse[..., None]), v.to(s.dtype))
    return o.reshape(B, HR, N, v.shape[-1]).to(qv.dtype), lse.reshape(B, HR, N)


# The library kernels behind one call each: forward ``(o, lse, seed, offset)`` (lse in the library's own
# shape, natural log) and backward ``(dq, dk, dv)`` from any ``o``/``lse`` (the merged ones of a split
# branch). ``math`` is the same contract in plain torch ops: it runs the split path on CPU in the tests.

def _lib_fwd(impl: str, qv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, ...]:
    if impl == "cudnn":
        o, lse, _cq, _ck, _mq, _mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qv, k, v, None, True, 0.0, causal, False, scale=scale)
        return o, lse, seed, offset
    if impl == "flash":
        o, lse, _cq, _ck, _mq, _mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            qv, k, v, 0.0, causal, False, scale=scale)
        return o, lse, seed, offset
    o, lse = _attend_math(qv, k, v, scale, n0=0 if causal else k.shape[2])
    return o, lse, lse.new_empty(0), lse.new_empty(0)


def _lib_bwd(impl: str, do: torch.Tensor, qv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, NK = qv.shape[2], k.shape[2]
    if impl == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, qv, k, v, o, lse, seed, offset, None, None, None, N, NK, 0.0, causal, scale=scale)
        return dq, dk, dv
    if impl == "flash":  # FlashAttention's backward reads do, o and lse as dense rows: a slice of KV heads
        # (bwd_heads) of a batch of several is not (its dq came out wrong: tests/test_cmp_sdpa.py)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.contiguous(), qv, k, v, o.contiguous(), lse.contiguous(), None, None, N, NK, 0.0, causal, seed,
            offset, scale=scale)
        return dq, dk, dv
    # FlashAttention's backward in plain ops: P from the given lse, delta from the given o
    B, HR, _, D = qv.shape
    H = k.shape[1]
    s = _scores(qv, k, scale, 0 if causal else NK)
    p = torch.exp(s - lse.view(B, H, HR // H, N, 1))
    dov = do.view(B, H, HR // H, N, -1).to(s.dtype)
    dv = torch.einsum("bhrnm,bhrnd->bhmd", p, dov)
    dp = torch.einsum("bhrnd,bhmd->bhrnm", dov, v.to(s.dtype))
    delta = (dov * o.view(B, H, HR // H, N, -1).to(s.dtype)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhrnm,bhmd->bhrnd", ds, k.to(s.dtype)).reshape(B, HR, N, D)
    dk = torch.einsum("bhrnm,bhrnd->bhmd", ds, qv.view(B, H, HR // H, N, D).to(s.dtype))
    return dq.to(qv.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor,
    torch.Tensor]:
    """Two attention outputs over disjoint key sets as one: ``o`` weighted by each part's share, ``lse`` their
    log-sum-exp (the library's lse shape kept)."""
    lse = torch.logaddexp(l1, l2)
    f = torch.promote_types(o1.dtype, torch.float32)
    w1 = torch.exp(l1 - lse).reshape(o1.shape[:3]).unsqueeze(-1).to(f)
    o = (o1.to(f) * w1 + o2.to(f) * (1.0 - w1)).to(o1.dtype)
    return o, lse


def split_fwd(impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n0: int,
              scale: float) -> tuple[torch.Tensor, ...]:
    """Queries ``q [B, HQ, N, D]`` seeing the keys ``0 .. n0-1`` whole and the next ``N`` causally (``k/v
    [B, H, n0 + N, D]``): the causal square by the library and, past ``n0 = 0``, the rectangle, merged by
    their log-sum-exps. ``(o, lse, seed, offset, seed_r, offset_r)``: the merged output and lse, the parts'
    seeds."""
    o, lse, seed, offset = _lib_fwd(impl, q, k[:, :, n0:], v[:, :, n0:], True, scale)
    if n0 == 0:  # no rectangle part: its seeds are placeholders of their own (the same tensor twice among the
        # outputs and saved tensors breaks Dynamo's saved-tensor wiring of a function under compile)
        return o, lse, seed, offset, seed.new_empty(0), offset.new_empty(0)
    o_r, lse_r, seed_r, offset_r = _lib_fwd(impl, q, k[:, :, :n0], v[:, :, :n0], False, scale)
    o, lse = _merge(o_r, lse_r, o, lse)
    return o, lse, seed, offset, seed_r, offset_r


def split_bwd(impl: str, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, seeds: tuple[torch.Tensor, ...], n0: int, scale: float, dk: torch.Tensor,
              dv: torch.Tensor) -> torch.Tensor:
    """:func:`split_fwd`'s backward from its merged ``o`` and ``lse`` (FlashAttention's backward needs no
    more): each part's dk/dv written into ``dk``/``dv`` at its own keys, the parts' dq summed and returned."""
    seed, offset, seed_r, offset_r = seeds
    dq, dk[:, :, n0:], dv[:, :, n0:] = _lib_bwd(impl, do, q, k[:, :, n0:], v[:, :, n0:], o, lse, seed, offset,
                                                True, scale)
    if n0 > 0:
        dq_r, dk[:, :, :n0], dv[:, :, :n0] = _lib_bwd(impl, do, q, k[:, :, :n0], v[:, :, :n0], o, lse, seed_r,
                                                      offset_r, False, scale)
        dq += dq_r
    return dq


class _Library(torch.autograd.Function):
    """The branch by a library kernel on the virtual rows, saving ``q`` (which the NSA op keeps anyway) and
    regrouping it again in the backward instead of keeping the virtual copy (one ``q``-sized buffer less).

    Queries at an offset (virtual rows ``n0 ..``, :func:`geometry`) see the keys ``0 .. n0-1`` whole and the
    rest causally: two calls, a rectangle without a mask and the causal square, merged by their
    log-sum-exps; each part's backward runs from the merged ``o`` and ``lse`` (FlashAttention's backward
    needs no more), its dq added and its dk/dv the gradient of its own keys."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l: int, d: int, scale: float,  # noqa: E741
                impl: str, q_start: int) -> tuple[torch.Tensor, ...]:
        n0 = geometry(q.shape[1], l, d, q_start)[0]
        return split_fwd(impl, to_virtual(q, k.shape[1], l, d, q_start=q_start), k, v, n0, scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        q, k, v, ctx.l, ctx.d, ctx.scale, ctx.impl, ctx.q_start = inputs
        o, lse, *seeds = output
        ctx.save_for_backward(q, k, v, o, lse, *seeds)
        ctx.mark_non_differentiable(lse, *seeds)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        q, k, v, o, lse, seed, offset, seed_r, offset_r = ctx.saved_tensors
        B, S, HQ, D = q.shape
        H = k.shape[1]
        n0, _, N = geometry(S, ctx.l, ctx.d, ctx.q_start)
        G = HQ // H
        R = G * ctx.d  # virtual heads per KV head
        dq, dk, dv = q.new_empty(q.shape), torch.empty_like(k), torch.empty_like(v)
        # the library's backward a few KV heads at a time: its buffers (q's virtual copy, its dq and the
        # library's fp32 accumulator and copies: ~5 GiB at paper 64k in one call) scale with the chunk
        step = bwd_heads(B, R, N, D, q.element_size(), H)
        for h0 in range(0, H, step):
            h1 = min(H, h0 + step)
            r = slice(h0 * R, h1 * R)  # those KV heads' virtual heads
            qs, dq_s = q[:, :, h0 * G: h1 * G], dq[:, :, h0 * G: h1 * G]
            qv = to_virtual(qs, h1 - h0, ctx.l, ctx.d, q_start=ctx.q_start)
            dqv = split_bwd(ctx.impl, do[:, r], qv, k[:, h0:h1], v[:, h0:h1], o[:, r], lse[:, r],
                            (seed, offset, seed_r, offset_r), n0, ctx.scale, dk[:, h0:h1], dv[:, h0:h1])
            del qv
            to_rows(dqv, dq_s, h1 - h0, ctx.l, ctx.d, q_start=ctx.q_start)
            del dqv
        return dq, dk, dv, None, None, None, None, None


def bwd_heads(B: int, R: int, N: int, D: int, itemsize: int, H: int) -> int:
    """KV heads per call of the library's backward: as many as keep one call's virtual ``q`` within the tile
    key ``cmp_bwd_mib`` (default 256 MiB; at least one head): paper 64k (1 GiB of virtual ``q``) in four
    calls, 16k and shorter in one."""
    per_head = B * R * N * D * itemsize
    limit = int(tuned("cmp_bwd_mib", 256)) * 2**20
    return max(1, min(H, limit // max(1, per_head)))


def attend(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, l: int, d: int,  # noqa: E741
           scale: float,
           impl: str, q_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed branch of queries ``q [B, S, HQ, D]`` at positions ``q_start ..`` over ``k_cmp/v_cmp
    [B, S_cmp, H, D]`` (tokens from position 0, up to the last query's): virtual ``(o [B, HQ*d, N, Dv], lse
    [B, HQ*d, N])`` (:func:`geometry`), lse in natural log (float32). Differentiable in ``q``, ``k_cmp``,
    ``v_cmp`` (``impl``: one of :data:`IMPLS`)."""
    H = k_cmp.shape[2]
    k, v = k_cmp.transpose(1, 2), v_cmp.transpose(1, 2)
    n0, _, N = geometry(q.shape[1], l, d, q_start)
    if k.shape[2] != n0 + N:
        raise ValueError(f"k_cmp must hold the {n0 + N} compressed tokens up to the last query; got "
                         f"{k.shape[2]}")
    if impl in ("cudnn", "flash") or (impl == "math" and n0 > 0):
        o, lse, *_ = _Library.apply(q, k, v, l, d, scale, impl, q_start)
        return o, lse.reshape(o.shape[:3])
    if impl == "math":
        return _attend_math(_Virtual.apply(q, H, l, d, q_start), k, v, scale)
    raise ValueError(f"unknown compressed-branch kernel '{impl}': choose one of {', '.join(IMPLS)}")


def take(o_v: torch.Tensor, lse_v: torch.Tensor, o_dst: torch.Tensor, H: int, l: int, d: int,  # noqa: E741
         q_start: int = 0) -> torch.Tensor:
    """Write :func:`attend`'s output into the op's row slot ``o_dst [B, S, HQ, Dv]``; return the rows' lse
    ``[B, S, HQ]`` in the kernels' convention (log2 domain, ``+inf`` where no token is visible)."""
    to_rows(o_v, o_dst, H, l, d, q_start=q_start)
    lse = torch.empty(o_dst.shape[:3], device=o_dst.device, dtype=torch.float32)
    to_rows(lse_v, lse, H, l, d, fill=math.inf, mul=LOG2E, q_start=q_start)
    return lse


def grad_out(do: torch.Tensor, gate: torch.Tensor, H: int, l: int, d: int,  # noqa: E741
             q_start: int = 0, o_v: torch.Tensor | None = None,
             dg: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of :func:`attend`'s output from the op's ``do [B, S, HQ, Dv]`` and the branch's gate
    ``[B, S, HQ]``: ``gate * do`` in the virtual layout, one pass; with ``o_v`` (that output) and ``dg``
    (``[B, S, HQ, 3]``), the gate's gradient ``sum(do * o)`` into ``dg[..., 0]`` in the same pass."""
    dot = (o_v, dg) if o_v is not None and dg is not None else None
    return to_virtual(do, H, l, d, mul=gate.unsqueeze(-1), q_start=q_start, dot=dot)
