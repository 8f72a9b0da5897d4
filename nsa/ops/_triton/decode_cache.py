"""Fused write half of a decode step: one kernel stores the new token in every NSA cache and (phi =
mean pooling) emits the compressed token it completes.

Same call and result as the torch path of ``nsa.ops.decode_cache.append_token`` (its reference), which
takes three indexed writes plus a gather, a mean and another write: four to six launches per layer and
step where this is one. One program per (sequence, KV group); no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import interpreting, next_pow2
from nsa.ops.cache_layout import DecodeCaches, NewToken


@triton.jit
def _put_row(DST, b, g, slot, sb, sh, ss, x, c, c_ok):
    tl.store(DST + b * sb + g * sh + slot * ss + c, x.to(DST.dtype.element_ty), mask=c_ok)


@triton.jit
def _append_kernel(
    T, KS_N, VS_N, KW_N, VW_N, KR_N, VR_N, KS, VS, KW, VW, RK, RV, KC, VC,
    ks_nb, ks_nh, vs_nb, vs_nh, kw_nb, kw_nh, vw_nb, vw_nh, kr_nb, kr_nh, vr_nb, vr_nh,  # new rows
    ks_b, ks_h, ks_s, vs_b, vs_h, vs_s, kw_b, kw_h, kw_s, vw_b, vw_h, vw_s,
    rk_b, rk_h, rk_s, rv_b, rv_h, rv_s, kc_b, kc_h, kc_s, vc_b, vc_h, vc_s,
    R, C,
    H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, EMIT_MEAN: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    g = pid % H
    t = tl.load(T + b).to(tl.int64)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    k_ok = ck < DK
    v_ok = cv < DV
    k_sel = tl.load(KS_N + b * ks_nb + g * ks_nh + ck, mask=k_ok)
    v_sel = tl.load(VS_N + b * vs_nb + g * vs_nh + cv, mask=v_ok)
    k_win = tl.load(KW_N + b * kw_nb + g * kw_nh + ck, mask=k_ok)
    v_win = tl.load(VW_N + b * vw_nb + g * vw_nh + cv, mask=v_ok)
    k_raw = tl.load(KR_N + b * kr_nb + g * kr_nh + ck, mask=k_ok)
    v_raw = tl.load(VR_N + b * vr_nb + g * vr_nh + cv, mask=v_ok)
    if EMIT_MEAN:
        # the block t-l+1 .. t is the whole ring once t is in it: sum the other l-1 rows (read before
        # this program overwrites slot t % l) and add the new row
        j = (t - (L - 1)) // D
        emit = (t >= L - 1) & ((t - (L - 1)) % D == 0) & (j < C)
        e = emit.to(tl.int32)  # 0 or 1: the store masks below are `col < D * e`
        r = tl.arange(0, L)
        other = (r != t % L)[:, None]
        rk = tl.load(RK + b * rk_b + g * rk_h + r[:, None] * rk_s + ck[None, :], mask=other & k_ok[None, :],
                     other=0.0)
        rv = tl.load(RV + b * rv_b + g * rv_h + r[:, None] * rv_s + cv[None, :], mask=other & v_ok[None, :],
                     other=0.0)
        k_mean = (tl.sum(rk.to(tl.float32), 0) + k_raw.to(tl.float32)) / L
        v_mean = (tl.sum(rv.to(tl.float32), 0) + v_raw.to(tl.float32)) / L
        jj = tl.where(emit, j, 0)
        _put_row(KC, b, g, jj, kc_b, kc_h, kc_s, k_mean, ck, ck < DK * e)
        _put_row(VC, b, g, jj, vc_b, vc_h, vc_s, v_mean, cv, cv < DV * e)
    _put_row(KS, b, g, t, ks_b, ks_h, ks_s, k_sel, ck, k_ok)
    _put_row(VS, b, g, t, vs_b, vs_h, vs_s, v_sel, cv, v_ok)
    _put_row(KW, b, g, t % R, kw_b, kw_h, kw_s, k_win, ck, k_ok)
    _put_row(VW, b, g, t % R, vw_b, vw_h, vw_s, v_win, cv, v_ok)
    _put_row(RK, b, g, t % L, rk_b, rk_h, rk_s, k_raw, ck, k_ok)
    _put_row(RV, b, g, t % L, rv_b, rv_h, rv_s, v_raw, cv, v_ok)


def append_unsupported(t: torch.Tensor, new: NewToken, caches: DecodeCaches) -> str | None:
    """None when the kernel can serve these tensors, else a short reason (the caller falls back)."""
    interp = interpreting()
    for x in (t, *new, *caches):
        if not (x.is_cuda or (interp and x.device.type == "cpu")):
            return f"{x.device.type} tensor"
        if x.dtype == torch.float64:  # the block mean accumulates in fp32
            return "float64"
    if any(x.stride(-1) != 1 for x in caches):
        return "a cache whose last dim is not contiguous"
    return None


def append_token_triton(t: torch.Tensor, new: NewToken, caches: DecodeCaches, *, l: int, d: int,  # noqa: E741
                        emit_mean: bool) -> None:
    """``nsa.ops.decode_cache.append_token`` in one launch (callers check ``append_unsupported`` first)."""
    B, H, l_ring, Dk = caches.ring_k.shape
    Dv = caches.ring_v.shape[-1]
    if l_ring != l:
        raise ValueError(f"the compression ring holds {l_ring} rows, expected l={l}")
    t = t.to(dtype=torch.int64).contiguous()
    rows = [x if x.stride(-1) == 1 else x.contiguous() for x in new]
    row_st = [s for x in rows for s in x.stride()[:2]]
    cache_st = [s for x in caches for s in x.stride()[:3]]
    _append_kernel[(B * H,)](
        t, *rows, *caches, *row_st, *cache_st,
        caches.k_win.shape[2], caches.k_cmp.shape[2] - 1,
        H=H, L=l, D=d, DK=Dk, DV=Dv, BDK=max(16, next_pow2(Dk)), BDV=max(16, next_pow2(Dv)),
        EMIT_MEAN=emit_mean, num_warps=1 if max(Dk, Dv) <= 64 else 2,
    )
