"""Designs of the block-scoring pass (issue 53), timed beside the library's in one process (CUDA).

Usage (repo root, GPU): python3 scripts/score_designs.py [shape:S ...]   (default paper:65536 paper:131072
m7c:65536; env SCORE_DESIGNS=next: only the designs not yet measured, SCORE_LIBRARY_ONLY=1: the library's alone;
--sweep with SCORE_SWEEP=prec: only the product's precisions, SCORE_REF=ieee: blocks against the fp32 product).
For each shape: the library's scoring pass and top-n alone, then each design of the scoring kernel (one Triton
kernel, its choices as constexpr flags), its P checked against the library's on the rows' visible blocks;
ablations (no exp, no head sum) bound what the products alone cost. JSON lines go to $OUT/score.jsonl.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from nsa.bench.requests import SHAPES
from nsa.ops._triton import next_pow2, tile_overrides
from nsa.ops._triton.range_attn import LOG2E
from nsa.ops._triton.scores import _block_scores, top_blocks
from nsa.ops.triton_path import Stages, compress_avg
from nsa.params import NSAParams


@triton.jit
def _scores_design(
    Q, K, LSE, P,
    sqb, sqs, sqh, skb, sks, skh,
    S, T0, T1, NK, NB, HQ, Q0, scale_log2,
    HG: tl.constexpr, HGP: tl.constexpr, H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr,
    DK: tl.constexpr, BDK: tl.constexpr, BM: tl.constexpr, BJ: tl.constexpr, NBC: tl.constexpr,
    NBCP: tl.constexpr, HS: tl.constexpr, SPLIT: tl.constexpr, AB: tl.constexpr, WS: tl.constexpr,
):
    """HS 0: W product (tf32) then the head sum as a reshape (the library's); 1: head sum (reshape) first,
    then W elementwise on [BT, BJ]; 2: head sum as a tf32 product with a 0/1 matrix first, then W elementwise.
    SPLIT: masks only on the chunks a row of the tile cannot see whole. AB 1: no exp; AB 2: no W, no head sum."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    BT: tl.constexpr = BM // HGP
    PB: tl.constexpr = LS // D
    HALO: tl.constexpr = L // D - 1
    t0 = T0 + pid * BT
    r = tl.arange(0, BM)
    pos = t0 + r // HGP
    head = g * HG + r % HGP
    row_ok = (pos < T1) & (r % HGP < HG)
    ck = tl.arange(0, BDK)
    pos64 = pos.to(tl.int64)
    q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    lse = tl.load(LSE + (b * S + pos64) * HQ + head, mask=row_ok, other=float("inf"))
    apos = Q0 + pos
    t_last = Q0 + tl.minimum(t0 + BT - 1, T1 - 1)
    n_blk = t_last // LS + 1
    jj = tl.arange(0, BJ)
    bb = tl.arange(0, NBCP)
    t2 = tl.arange(0, BT)
    tpos2 = (t0 + t2).to(tl.int64)
    # W[j, b] of a chunk whose first token is c0 * PB - HALO (loop-invariant): overlap / l
    o = jj[:, None] - bb[None, :] * PB - HALO
    w_inv = tl.where(bb[None, :] < NBC, (tl.minimum(o + HALO + 1, PB) - tl.maximum(o, 0)).to(tl.float32) * D / L,
                     0.0)
    w_inv = tl.maximum(w_inv, 0.0)
    # chunks every row of the tile sees whole: their last token jl = c0*PB - HALO + BJ - 1 <= jlim
    jlim = (Q0 + t0 - L + 1) // D
    num = jlim + HALO - BJ + 1
    n_full = tl.where((num >= 0) & (SPLIT != 0), (num // PB) // NBC + 1, 0)
    n_full = tl.minimum(n_full, (n_blk + NBC - 1) // NBC)
    ti = tl.arange(0, 16)
    E = tl.where((r[None, :] // HGP == ti[:, None]) & (ti[:, None] < BT), 1.0, 0.0)
    n_all = (n_blk + NBC - 1) // NBC
    # chunk 0 holds the tokens before 0 (masked); then the whole chunks without masks, then the rest
    _chunk(q, K, P, lse, apos, b, g, bh, 0, jj, bb, tpos2, w_inv, E, skb, sks, skh, T0, T1, NK, NB,
           scale_log2, HGP, L, D, BT, PB, HALO, BJ, NBC, NBCP, DK, BDK, HS, AB, True)
    for ci in tl.range(1, n_full, warp_specialize=WS):  # WS: Triton's warp specialisation of the loop
        _chunk(q, K, P, lse, apos, b, g, bh, ci, jj, bb, tpos2, w_inv, E, skb, sks, skh, T0, T1, NK, NB,
               scale_log2, HGP, L, D, BT, PB, HALO, BJ, NBC, NBCP, DK, BDK, HS, AB, False)
    for ci in range(tl.maximum(n_full, 1), n_all):
        _chunk(q, K, P, lse, apos, b, g, bh, ci, jj, bb, tpos2, w_inv, E, skb, sks, skh, T0, T1, NK, NB,
               scale_log2, HGP, L, D, BT, PB, HALO, BJ, NBC, NBCP, DK, BDK, HS, AB, True)


@triton.jit
def _chunk(q, K, P, lse, apos, b, g, bh, ci, jj, bb, tpos2, w_inv, E, skb, sks, skh, T0, T1, NK, NB, scale_log2,
           HGP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, PB: tl.constexpr,
           HALO: tl.constexpr, BJ: tl.constexpr, NBC: tl.constexpr, NBCP: tl.constexpr, DK: tl.constexpr,
           BDK: tl.constexpr, HS: tl.constexpr, AB: tl.constexpr, MASK: tl.constexpr):
    ck = tl.arange(0, BDK)
    c0 = ci * NBC
    j = c0 * PB - HALO + jj
    j64 = j.to(tl.int64)
    k = tl.load(K + b * skb + j64[:, None] * sks + g * skh + ck[None, :],
                mask=(j[:, None] >= 0) & (j[:, None] < NK) & (ck[None, :] < DK), other=0.0)
    s = tl.dot(q, tl.trans(k))
    if AB == 1:
        x = s * scale_log2 - lse[:, None]
    else:
        x = tl.exp2(s * scale_log2 - lse[:, None])
    if MASK:
        vis = (j[None, :] * D + L - 1 <= apos[:, None]) & (j[None, :] < NK) & (j[None, :] >= 0)
        x = tl.where(vis, x, 0.0)
    blk = c0 + bb
    if AB == 2:
        tl.store(P + (bh * (T1 - T0) + tpos2[:, None] - T0) * NB + blk[None, :],
                 tl.sum(tl.reshape(tl.sum(tl.reshape(x, [BT, HGP, BJ]), 1), [BT, BJ // NBCP, NBCP]), 1),
                 mask=(tpos2[:, None] < T1) & (blk[None, :] < NB))
    else:
        if HS == 0:
            rows = tl.dot(x, w_inv, input_precision="tf32")
            pp = tl.sum(tl.reshape(rows, [BT, HGP, NBCP]), 1)
        else:
            if HS == 1:
                xs = tl.sum(tl.reshape(x, [BT, HGP, BJ]), 1)
            else:
                xs16 = tl.dot(E, x, input_precision="tf32")
                if BT < 16:
                    xs = tl.sum(tl.reshape(xs16, [16 // BT, BT, BJ]), 0)
                else:
                    xs = xs16
            pp = tl.sum(xs[:, :, None] * w_inv[None, :, :], 1)
        tl.store(P + (bh * (T1 - T0) + tpos2[:, None] - T0) * NB + blk[None, :], pp,
                 mask=(tpos2[:, None] < T1) & (bb[None, :] < NBC) & (blk[None, :] < NB))


def design_scores(q, k_cmp, lse, P, t0, t1, *, p: NSAParams, scale: float, bm: int, warps: int, stages: int,
                  bj: int, hs: int, split: int, ab: int = 0, ws: int = 0) -> None:  # type: ignore[no-untyped-def]
    B, S, HQ, DK = q.shape
    NK, H = k_cmp.shape[1], k_cmp.shape[2]
    h = HQ // H
    hp = next_pow2(h)
    bt = bm // hp
    per_blk, halo = p.l_sel // p.d, p.l // p.d - 1
    nbc = (bj - halo) // per_blk
    if hs == 2 and bt > 16:
        raise ValueError("hs=2 needs at most 16 positions a tile")
    _scores_design[(triton.cdiv(t1 - t0, bt), B * H)](
        q, k_cmp, lse, P, *q.stride()[:3], *k_cmp.stride()[:3], S, t0, t1, NK, P.shape[-1], HQ, 0,
        scale * LOG2E, HG=h, HGP=hp, H=H, L=p.l, D=p.d, LS=p.l_sel, DK=DK, BDK=max(16, next_pow2(DK)), BM=bm, BJ=bj,
        NBC=nbc, NBCP=max(16, next_pow2(nbc)), HS=hs, SPLIT=split, AB=ab, WS=bool(ws),
        num_warps=warps, num_stages=stages)


def bench(fn) -> float:  # type: ignore[no-untyped-def]
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def run(shape: str, S: int, log) -> None:  # type: ignore[no-untyped-def]
    HQ, H, D = SHAPES[shape]
    p = NSAParams()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, S, HQ, D, generator=gen, device=dev, dtype=torch.bfloat16)
    k_raw, v_raw, k_sel, v_sel = (torch.randn(1, S, H, D, generator=gen, device=dev, dtype=torch.bfloat16)
                                  for _ in range(4))
    gates = torch.rand(1, S, HQ, 3, generator=gen, device=dev, dtype=torch.bfloat16)
    k_cmp, v_cmp = compress_avg(k_raw, p).contiguous(), compress_avg(v_raw, p).contiguous()
    st = Stages(q, k_cmp, v_cmp, k_sel, v_sel, k_sel, v_sel, gates, p, D**-0.5)
    st.start_forward()
    st.cmp_fwd()
    lse, scale = st.lse_c, D**-0.5
    NB = -(-S // p.l_sel)
    slab = max(1024, (128 << 20) // (H * NB * 4))
    t1 = min(S, slab)
    t0 = S - t1  # the last slab: the most blocks per row
    P_ref = torch.zeros(H, t1, NB, device=dev, dtype=torch.float32)
    _block_scores(q, k_cmp, lse, P_ref, t0, S, l=p.l, d=p.d, l_sel=p.l_sel, scale=scale)
    idx = torch.empty(1, S, H, p.n_sel, device=dev, dtype=torch.int32)
    tpos = torch.arange(t0, S, device=dev)
    valid = torch.arange(NB, device=dev)[None, :] <= (tpos // p.l_sel)[:, None]
    n_slabs = -(-S // slab)

    def emit(name: str, ms: float, **extra: object) -> None:
        row = {"shape": shape, "S": S, "design": name, "ms_slab": round(ms, 4), "slabs": n_slabs, **extra}
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    emit("library-scores", bench(lambda: _block_scores(q, k_cmp, lse, P_ref, t0, S, l=p.l, d=p.d,
                                                       l_sel=p.l_sel, scale=scale)))
    emit("library-topn", bench(lambda: top_blocks(P_ref, idx, t0, S, l_sel=p.l_sel)))
    with tile_overrides({"topn_forced": 0}):  # every round searched, the forced blocks' too (before)
        emit("library-topn-all-rounds", bench(lambda: top_blocks(P_ref, idx, t0, S, l_sel=p.l_sel)))
    with tile_overrides({"topn_key": 64}):  # 64-bit keys alone (before: the rounds without the 32-bit pass)
        emit("library-topn-key64", bench(lambda: top_blocks(P_ref, idx, t0, S, l_sel=p.l_sel)))
    for warps in (2, 4):  # more warps a row (1 was best for the 64-bit keys)
        with tile_overrides({"topn_warps": warps}):
            emit(f"library-topn-warps{warps}", bench(lambda: top_blocks(P_ref, idx, t0, S, l_sel=p.l_sel)))
    emit("library-select-whole-op", bench(st.select) / n_slabs)
    if os.environ.get("SCORE_LIBRARY_ONLY"):
        return
    big = HQ // H >= 16
    bms = [(128, 8), (64, 4)] if big else [(64, 4), (128, 8), (128, 4)]
    P = torch.zeros_like(P_ref)
    designs = [(*d, 0) for d in (
        (bms[0], 2, 64, 0, 0), (bms[0], 2, 64, 0, 1), (bms[0], 2, 64, 1, 1), (bms[0], 2, 64, 2, 1),
        (bms[0], 2, 128, 1, 1), (bms[0], 2, 128, 2, 1), (bms[0], 3, 64, 1, 1), (bms[1], 2, 64, 1, 1),
        (bms[1], 2, 64, 2, 1), (bms[-1], 2, 64, 2, 1),
    )]
    # the kept design (4 warps), and its loop under Triton's warp specialisation (issue 53's next design)
    designs += [((128, 4), st, 64, 0, 1, ws) for st, ws in ((2, 0), (2, 1), (3, 1))] + [(bms[0], 2, 64, 0, 1, 1)]
    if os.environ.get("SCORE_DESIGNS") == "next":
        designs = designs[-4:]
    for (bm, warps), stages, bj, hs, split, ws in designs:
        name = f"bm{bm}-w{warps}-s{stages}-bj{bj}-hs{hs}-split{split}" + ("-ws" if ws else "")
        kw = dict(p=p, scale=scale, bm=bm, warps=warps, stages=stages, bj=bj, hs=hs, split=split, ws=ws)
        try:
            P.zero_()
            design_scores(q, k_cmp, lse, P, t0, S, **kw)  # type: ignore[arg-type]
            err = ((P - P_ref).abs() * valid).max().item() / P_ref.abs().max().item()
            ms = bench(functools.partial(design_scores, q, k_cmp, lse, P, t0, S, **kw))  # type: ignore[arg-type]
            emit(name, ms, rel_err=err)
            if hs == 1 and split and bj == 64 and stages == 2 and bm == bms[0][0]:
                for ab in (1, 2):
                    emit(f"{name}-ablate{ab}", bench(functools.partial(design_scores, q, k_cmp, lse, P, t0, S,
                                                                       ab=ab, **kw)))  # type: ignore[arg-type]
        except Exception as exc:  # a design that does not compile must not stop the others
            emit(name, -1.0, error=f"{type(exc).__name__}: {str(exc)[:300]}")

    torch.cuda.empty_cache()


def sweep(shape: str, S: int, log, tunes: list[dict[str, int | str]]) -> dict[str, int | str]:  # type: ignore[no-untyped-def]
    """The whole select stage (every slab: scores, then top-n) as the op runs it, under each tile override;
    beside it the former kernels (``old_scores.py`` at the repo root, when present: the file before this
    change). Returns the fastest override."""
    import importlib.util

    from nsa.ops._triton.scores import select_top

    HQ, H, D = SHAPES[shape]
    p = NSAParams()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, S, HQ, D, generator=gen, device=dev, dtype=torch.bfloat16)
    k_raw, v_raw = (torch.randn(1, S, H, D, generator=gen, device=dev, dtype=torch.bfloat16) for _ in range(2))
    gates = torch.rand(1, S, HQ, 3, generator=gen, device=dev, dtype=torch.bfloat16)
    k_cmp, v_cmp = compress_avg(k_raw, p).contiguous(), compress_avg(v_raw, p).contiguous()
    st = Stages(q, k_cmp, v_cmp, k_raw, v_raw, k_raw, v_raw, gates, p, D**-0.5)
    st.start_forward()
    st.cmp_fwd()
    kw = dict(l=p.l, d=p.d, l_sel=p.l_sel, n_sel=p.n_sel, scale=D**-0.5)

    def emit(name: str, ms: float, **extra: object) -> None:
        row = {"shape": shape, "S": S, "select": name, "ms": round(ms, 3), **extra}
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    # SCORE_REF=ieee: blocks compared with the overlap product in fp32 (the spec's arithmetic), else the default's
    with tile_overrides({"score_prec": "ieee"} if os.environ.get("SCORE_REF") == "ieee" else {}):
        ref = select_top(q, k_cmp, st.lse_c, **kw)  # type: ignore[arg-type]
    if os.path.exists("old_scores.py"):
        spec = importlib.util.spec_from_file_location("old_scores", "old_scores.py")
        old = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(old)  # type: ignore[union-attr]
        same = float((old.select_top(q, k_cmp, st.lse_c, **kw) == ref).float().mean())
        emit("before", bench(lambda: old.select_top(q, k_cmp, st.lse_c, **kw)), same_blocks=same)
    best: tuple[float, dict[str, int | str]] = (float("inf"), {})
    for tune in tunes:
        try:
            with tile_overrides(tune):
                same = float((select_top(q, k_cmp, st.lse_c, **kw) == ref).float().mean())
                ms = bench(lambda: select_top(q, k_cmp, st.lse_c, **kw))
            emit("now", ms, tune=tune, same_blocks=same)
            best = min(best, (ms, tune), key=lambda x: x[0])
        except Exception as exc:
            emit("now", -1.0, tune=tune, error=f"{type(exc).__name__}: {str(exc)[:300]}")

    torch.cuda.empty_cache()
    return best[1]


def main() -> None:
    """``python3 scripts/score_designs.py shape:S ...``: the designs; ``--sweep shape:S ...``: the library's
    select stage under tile overrides (the first shape of each name sweeps, later lengths take its best)."""
    args = sys.argv[1:]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "score.jsonl"), "a") as log:
        if args and args[0] == "--sweep":
            best: dict[str, dict[str, int | str]] = {}
            for item in args[1:] or ["paper:65536", "m7c:65536", "paper:131072"]:
                shape, S = item.split(":")
                tiles = [(128, 8), (64, 4), (128, 4)] if shape == "paper" else [(64, 4), (128, 4), (128, 8)]
                grid: list[dict[str, int | str]] = [{}]
                if shape in best:
                    grid.append(best[shape])
                else:
                    if os.environ.get("SCORE_SWEEP") != "prec":
                        grid += [{"score_bm": bm, "score_warps": w, "score_stages": st, "score_bj": bj}
                                 for bm, w in tiles for st in (2, 3) for bj in (64, 128)]
                    grid += [{"score_prec": x} for x in ("tf32", "bf16", "fp16", "ieee")] + [{"topn_key": 64}]
                best[shape] = sweep(shape, int(S), log, grid)
            return
        for item in args or ["paper:65536", "paper:131072", "m7c:65536"]:
            shape, S = item.split(":")
            run(shape, int(S), log)


if __name__ == "__main__":
    main()
