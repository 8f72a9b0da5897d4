"""Triton backend of the NSA ops: same calls as :mod:`nsa.ops.reference`, kernels in ``nsa/ops/_triton``.

Forward of ``nsa_attention``: compressed branch (o_cmp + lse) -> block importance and top-n (unless
``block_idx`` is given) -> selected branch -> window branch -> gate combine. Backward: the gate gradient
(one pass over ``do`` and the three branch outputs), then per branch dq (accumulated in fp32) and dk/dv.
No step reads a device value on the host, so forward and backward never synchronise.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (tiny shapes, for CI).
"""

from __future__ import annotations

from typing import Any

import torch

from nsa.ops._triton import interpreting
from nsa.ops.indexing import check_hparams, check_shapes, num_cmp
from nsa.ops.torch_path import compress_avg as _torch_compress_avg

_GPU_DTYPES = (torch.bfloat16, torch.float16)
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MAX_BLOCKS = 16384


def supports(*tensors: torch.Tensor) -> str | None:
    """None when these kernels can serve a call on ``tensors``, else a short reason."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton not installed"
    interp = interpreting()
    for i, t in enumerate(tensors):
        if t.device.type != "cuda" and not (interp and t.device.type == "cpu"):
            return f"{t.device.type} tensor"
        # the first tensor (q) sets the compute dtype; float32 k/v/gates (autocast) are cast to it
        allowed = _CPU_DTYPES if t.device.type == "cpu" else (_GPU_DTYPES if i == 0 else _CPU_DTYPES)
        if t.is_floating_point() and t.dtype not in allowed:
            return f"dtype {str(t.dtype).removeprefix('torch.')}"
        if t.dim() == 4 and t.shape[-1] != 3 and t.shape[-1] > MAX_HEAD_DIM:
            return f"head dim {t.shape[-1]}"
    cuda = [t for t in tensors if t.is_cuda]
    if cuda and torch.cuda.get_device_capability(cuda[0].device)[0] < 8:
        return "compute capability < 8.0"
    return None


def compress_avg(x: torch.Tensor, l: int, d: int) -> torch.Tensor:  # noqa: E741
    """Mean pooling is bandwidth-bound elementwise work: the vectorised torch op serves it."""
    return _torch_compress_avg(x, l, d)


def _cmp_geometry(l: int, d: int) -> dict[str, Any]:  # noqa: E741
    return {"stride": d, "off": l - 1, "win": 0}


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    n_sel: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Top-``n_sel`` blocks per query and group: int32 ``[B, S, H, n_sel]``, ascending, -1 padded."""
    from nsa.ops._triton.range_attn import range_fwd
    from nsa.ops._triton.scores import select_top

    check_hparams(l, d, l_sel, n_sel)
    Dk = q.shape[-1]
    scale = Dk**-0.5 if scale is None else float(scale)
    with torch.no_grad():
        q, k_cmp = _dense_last(q), _dense_last(k_cmp.to(q.dtype))
        lse = range_fwd(q, k_cmp, k_cmp, None, scale=scale, **_cmp_geometry(l, d))
        return select_top(q, k_cmp, lse, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale)


# ---------------------------------------------------------------------------------------------------
# The kernels as PyTorch custom operators (torch.library): opaque to torch.compile, with fake (meta)
# implementations for tracing and a registered autograd formula, so a whole compiled NSA model keeps
# one graph (fullgraph=True) and Inductor fuses the projection / RoPE / gate / combine glue around them.

_FWD_OUT = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor]


@torch.library.custom_op("nsa::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
    k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, block_idx: torch.Tensor | None,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float,  # noqa: E741
) -> _FWD_OUT:
    """Forward kernels: ``(out, block_idx, o3, lse_cmp, lse_sel, lse_win, work)``; everything after
    ``block_idx`` is kept for the backward (``work``: the selected branch's pair list, or empty)."""
    from nsa.ops._triton.range_attn import range_fwd
    from nsa.ops._triton.scores import select_top
    from nsa.ops._triton.selection import canonical_blocks, sel_fwd

    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = (_dense_last(t) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win,
                                                                                v_win))
    B, S, HQ, _ = q.shape
    Dv = v_sel.shape[-1]
    o3 = torch.empty(B, S, HQ, 3, Dv, device=q.device, dtype=q.dtype)
    lse_c = range_fwd(q, k_cmp, v_cmp, o3[:, :, :, 0], scale=scale, **_cmp_geometry(l, d))
    if block_idx is None:
        idx = select_top(q, k_cmp, lse_c, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale)
    else:
        idx = canonical_blocks(block_idx, l_sel)  # same key set; a new tensor (outputs may not alias inputs)
    lse_s, work = sel_fwd(q, k_sel, v_sel, idx, o3[:, :, :, 1], l_sel=l_sel, scale=scale)
    out = torch.empty(B, S, HQ, Dv, device=q.device, dtype=q.dtype)
    # the window branch goes last and writes the gated sum of the three branches too
    lse_w = range_fwd(q, k_win, v_win, o3[:, :, :, 2], scale=scale, stride=1, off=0, win=w,
                      combine=(gates.contiguous(), out))
    return out, idx, o3, lse_c, lse_s, lse_w, work


@attention_fwd.register_fake
def _attention_fwd_fake(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
    k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, block_idx: torch.Tensor | None,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float,  # noqa: E741
) -> _FWD_OUT:
    from nsa.ops._triton.selection import sel_mode, work_shape

    B, S, HQ, _ = q.shape
    H, Dv = k_sel.shape[2], v_sel.shape[-1]
    f32, i32 = torch.float32, torch.int32
    work = (q.new_empty(0, dtype=i32) if sel_mode(HQ // H, q.device) == "row"
            else q.new_empty(*work_shape(B, S, H, n_sel, l_sel, q.device), dtype=i32))
    return (q.new_empty(B, S, HQ, Dv), q.new_empty(B, S, H, n_sel, dtype=i32), q.new_empty(B, S, HQ, 3, Dv),
            q.new_empty(B, S, HQ, dtype=f32), q.new_empty(B, S, HQ, dtype=f32), q.new_empty(B, S, HQ, dtype=f32),
            work)


_BWD_OUT = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor, torch.Tensor]


@torch.library.custom_op("nsa::attention_bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
    v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, idx: torch.Tensor,
    o3: torch.Tensor, lse_c: torch.Tensor, lse_s: torch.Tensor, lse_w: torch.Tensor, work: torch.Tensor,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float,  # noqa: E741
) -> _BWD_OUT:
    """Backward kernels: ``(dq, dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates)``."""
    from nsa.ops._triton.range_attn import range_bwd
    from nsa.ops._triton.selection import sel_bwd

    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = (_dense_last(t) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win,
                                                                                v_win))
    gates = gates.contiguous()
    do = do.contiguous()
    # dq of the three branches accumulates in fp32; the compressed dq kernel (first) also writes the gate
    # gradient dg of all three from o3, and the window dq kernel (last) writes dq in q's dtype
    dg = torch.empty(*q.shape[:3], 3, device=q.device, dtype=torch.float32)
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dq_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk_c, dv_c = range_bwd(q, k_cmp, v_cmp, do, lse_c, gates, dg, dq, branch=0, accum=False,
                           scale=scale, o3=o3, **_cmp_geometry(l, d))
    dk_s, dv_s = sel_bwd(q, k_sel, v_sel, idx, do, lse_s, gates, dg, dq, branch=1, accum=True,
                         l_sel=l_sel, scale=scale, work=work)
    dk_w, dv_w = range_bwd(q, k_win, v_win, do, lse_w, gates, dg, dq, branch=2, accum=True,
                           scale=scale, stride=1, off=0, win=w, dq_out=dq_out)
    return (dq_out, dk_c, dv_c, dk_s.to(k_sel.dtype), dv_s.to(v_sel.dtype), dk_w, dv_w,
            dg.to(gates.dtype))


@attention_bwd.register_fake
def _attention_bwd_fake(
    do: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
    v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, idx: torch.Tensor,
    o3: torch.Tensor, lse_c: torch.Tensor, lse_s: torch.Tensor, lse_w: torch.Tensor, work: torch.Tensor,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float,  # noqa: E741
) -> _BWD_OUT:
    return tuple(t.new_empty(t.shape) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates))  # type: ignore[return-value]


_HP = ("l", "d", "l_sel", "n_sel", "w", "scale")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: _FWD_OUT) -> None:
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, _block_idx, *hp = inputs
    _, idx, o3, lse_c, lse_s, lse_w, work = output
    ctx.save_for_backward(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, idx, o3, lse_c, lse_s, lse_w, work)
    ctx.hp = dict(zip(_HP, hp, strict=True))
    ctx.mark_non_differentiable(idx, o3, lse_c, lse_s, lse_w, work)


def _backward(ctx: Any, do: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    grads = attention_bwd(do, *ctx.saved_tensors, **ctx.hp)
    return (*grads, None, None, None, None, None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    n_sel: int,
    w: int,
    scale: float | None = None,
    block_idx: torch.Tensor | None = None,
    return_block_idx: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated NSA attention ``[B, S, HQ, Dv]`` (and the blocks used, with ``return_block_idx``)."""
    check_hparams(l, d, l_sel, n_sel, w)
    S = check_shapes(q, k_sel, name="k_sel")[1]
    n_c = num_cmp(S, l, d)
    if k_cmp.shape[1] != n_c or v_cmp.shape[1] != n_c:
        raise ValueError(f"k_cmp/v_cmp must hold S_cmp={n_c} tokens for S={S}, l={l}, d={d}; "
                         f"got {k_cmp.shape[1]} and {v_cmp.shape[1]}")
    if -(-S // l_sel) > MAX_BLOCKS:
        raise ValueError(f"S={S} gives more than {MAX_BLOCKS} selection blocks of l_sel={l_sel}")
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if block_idx is not None:
        block_idx = block_idx.to(device=q.device, dtype=torch.int32).contiguous()
    # kernels take strides for [B, S, heads]; only the feature dim must be contiguous (views of a fused
    # projection pass as they are); gates are read as contiguous rows of 3
    args = [_dense_last(t.to(q.dtype)) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)]
    gates = gates.to(q.dtype).contiguous()
    out, idx, *_ = attention_fwd(*args, gates, block_idx, l, d, l_sel, n_sel, w, sc)
    return (out, idx) if return_block_idx else out
