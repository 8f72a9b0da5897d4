"""Issue 53's window design: the sliding window as two library triangles, timed beside our range kernels.

Measured (H200, 2026-11-29, docs/kernels.md "Issue 53, eighth stop"): 2-4.5x slower than our range kernels
(cuDNN fwd/bwd 19.7/28.6 ms at paper 64k against 4.4/13.2); kept as the record of that design, not used.

Query ``t`` sees keys ``t-w+1 .. t``. In chunks of ``w`` positions, chunk ``c``'s queries see their own chunk
causally (a causal square) and the chunk before strictly above the diagonal; with rows and keys reversed that
part is a causal square too, one row and one key shorter. So the window is two calls of a library kernel that
skips masked tiles (cuDNN's fused attention; ``flash``: PyTorch's FlashAttention-2), merged by their
log-sum-exps; each half's backward runs from the merged output and log-sum-exp (FlashAttention's backward needs
no more: ring attention does the same), its dq added, its dk/dv its own keys'. The chunks are views of ``[B, S,
H, D]`` (no copy); the reversed half copies ``q``, ``o``, ``do`` and its outputs.

Ours (``kernel_breakdown`` stages ``win_fwd``/``win_bwd``) also forms the gate combine and the gate gradient,
which this probe does not: the bytes those move are reported beside (``combine_gb``) so the two can be set side
by side.

Usage (repo root, GPU): python3 scripts/window_designs.py [paper:65536 m7c:65536 ...]   (default paper:65536
paper:131072 m7c:65536; --check: the plain-torch path against a banded reference in float64 on the CPU, forward
and every gradient). JSON lines to $OUT/window.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from nsa.ops.cmp_sdpa import _lib_bwd, _lib_fwd, _merge


def _chunks(x: torch.Tensor, w: int) -> torch.Tensor:
    """``[B, S, Hx, D]`` as ``[B * S/w, Hx, w, D]`` (a view)."""
    B, S, Hx, D = x.shape
    return x.view(B * (S // w), w, Hx, D).transpose(1, 2)


def _rev(x: torch.Tensor, B: int, chunks: slice, keep: slice) -> torch.Tensor:
    """Chunks ``chunks`` of every batch row of a chunked tensor, positions reversed, then the reversed
    positions ``keep`` (a copy, ``[B * len(chunks), Hx, len(keep), D]``)."""
    n, Hx, w, D = x.shape
    y = x.reshape(B, n // B, Hx, w, D)[:, chunks].flip(3)[:, :, :, keep]
    return y.reshape(-1, Hx, y.shape[3], D).contiguous()


def _orig(w: int, keep: slice, device: torch.device) -> torch.Tensor:
    """The positions (in chunk order) of the reversed positions ``keep``."""
    return (w - 1 - torch.arange(w, device=device))[keep]


def _by_chunk(x: torch.Tensor, B: int) -> torch.Tensor:
    """A contiguous chunked tensor ``[B * n, Hx, w, ...]`` as ``[B, n, Hx, w, ...]``."""
    return x.view(B, x.shape[0] // B, *x.shape[1:])


def window_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, scale: float,
               impl: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """The window branch ``[B, S, HQ, Dv]`` (S a multiple of ``w``) and what its backward needs."""
    B, S, HQ, _ = q.shape
    qc, kc, vc = _chunks(q, w), _chunks(k, w), _chunks(v, w)
    o_a, lse_a, seed_a, off_a = _lib_fwd(impl, qc, kc, vc, True, scale)
    o_a = o_a.contiguous()
    # the chunk before, reversed: query t'' = w-1-t (1 .. w-1) sees keys j'' = w-1-j (0 .. t''-1) of chunk c-1
    later, earlier, qkeep, kkeep = slice(1, None), slice(0, -1), slice(1, None), slice(0, w - 1)
    q_b = _rev(qc, B, later, qkeep)
    k_b, v_b = _rev(kc, B, earlier, kkeep), _rev(vc, B, earlier, kkeep)
    o_b, lse_b, seed_b, off_b = _lib_fwd(impl, q_b, k_b, v_b, True, scale)
    pos = _orig(w, qkeep, q.device)
    o_bf = torch.zeros_like(o_a)
    lse_bf = torch.full_like(lse_a, float("-inf"))
    _by_chunk(o_bf, B)[:, later, :, pos] = _by_chunk(o_b.contiguous(), B)
    _by_chunk(lse_bf.view(-1, HQ, w), B)[:, later, :, pos] = _by_chunk(lse_b.reshape(-1, HQ, w - 1), B)
    o, lse = _merge(o_a, lse_a, o_bf, lse_bf)
    out = o.transpose(1, 2).reshape(B, S, HQ, -1)
    state = dict(qc=qc, kc=kc, vc=vc, q_b=q_b, k_b=k_b, v_b=v_b, o=o, lse=lse, lse_b_shape=lse_b.shape,
                 seeds=(seed_a, off_a, seed_b, off_b))
    return out, state


def window_bwd(do: torch.Tensor, st: dict[str, Any], w: int, scale: float,
               impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`window_fwd` (``[B, S, Hx, D]`` each)."""
    B, S, HQ, _ = do.shape
    qc, kc, vc, o, lse = st["qc"], st["kc"], st["vc"], st["o"], st["lse"]
    seed_a, off_a, seed_b, off_b = st["seeds"]
    doc = _chunks(do, w).contiguous()  # the library's backward reads do in o's layout (o is contiguous)
    dq, dk, dv = (g.contiguous() for g in _lib_bwd(impl, doc, qc, kc, vc, o, lse, seed_a, off_a, True, scale))
    later, earlier, qkeep, kkeep = slice(1, None), slice(0, -1), slice(1, None), slice(0, w - 1)
    do_b, o_b = _rev(doc, B, later, qkeep), _rev(o, B, later, qkeep)
    qpos, kpos = _orig(w, qkeep, do.device), _orig(w, kkeep, do.device)
    lse_b = _by_chunk(lse.reshape(-1, HQ, w), B)[:, later, :, qpos].reshape(st["lse_b_shape"]).contiguous()
    dq_b, dk_b, dv_b = _lib_bwd(impl, do_b, st["q_b"], st["k_b"], st["v_b"], o_b, lse_b, seed_b, off_b, True,
                                scale)
    _by_chunk(dq, B)[:, later, :, qpos] += _by_chunk(dq_b.contiguous(), B)
    _by_chunk(dk, B)[:, earlier, :, kpos] += _by_chunk(dk_b.contiguous(), B)
    _by_chunk(dv, B)[:, earlier, :, kpos] += _by_chunk(dv_b.contiguous(), B)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(B, S, x.shape[1], -1)

    return rows(dq), rows(dk), rows(dv)


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, scale: float) -> torch.Tensor:
    """The window in plain ops (the reference): GQA, key ``j`` seen by query ``t`` when ``t-w < j <= t``."""
    S, HQ = q.shape[1], q.shape[2]
    H = k.shape[2]
    kk, vv = (x.repeat_interleave(HQ // H, dim=2) for x in (k, v))
    s = torch.einsum("bthd,bjhd->bhtj", q, kk) * scale
    t = torch.arange(S)
    seen = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - w)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    return torch.einsum("bhtj,bjhd->bthd", p, vv)


def check(S: int = 48, w: int = 8) -> None:
    """The two triangles (plain-torch library stand-in) against the banded reference, float64, seed 0:
    output and dq, dk, dv (GQA, two batch rows)."""
    gen = torch.Generator().manual_seed(0)
    B, HQ, H, D = 2, 6, 2, 16
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, H, H))
    do = torch.randn(B, S, HQ, D, generator=gen, dtype=torch.float64)
    scale = D**-0.5
    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = _banded(*ref_in, w, scale)
    ref.backward(do)
    out, st = window_fwd(q, k, v, w, scale, "math")
    grads = window_bwd(do, st, w, scale, "math")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_in, strict=True):
        torch.testing.assert_close(g, r.grad, rtol=1e-10, atol=1e-10, msg=name)
    print(json.dumps({"check": "ok", "S": S, "w": w}), flush=True)


def bench(shape: str, S: int, log: Any, impl: str) -> None:
    import triton.testing

    from nsa.bench.attention import kernel_breakdown
    from nsa.bench.requests import SHAPES
    from nsa.params import NSAParams

    HQ, H, D = SHAPES[shape]
    w = NSAParams().w
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, S, h, D, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (HQ, H, H))
    do = torch.randn_like(q)
    scale = D**-0.5
    row: dict[str, Any] = {"shape": shape, "S": S, "w": w, "impl": impl, "device": torch.cuda.get_device_name()}
    row.update({f"ours_{k_}": v_ for k_, v_ in kernel_breakdown(S, HQ, H, D, only=("win_fwd", "win_bwd")).items()})
    ref_out = window_fwd(q[:, :2048], k[:, :2048], v[:, :2048], w, scale, impl)[0]
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :2048].transpose(1, 2), k[:, :2048].transpose(1, 2), v[:, :2048].transpose(1, 2),
        attn_mask=_band_mask(2048, w), scale=scale, enable_gqa=True).transpose(1, 2)
    row["max_err_2k"] = float((ref_out.float() - want.float()).abs().max())
    st = window_fwd(q, k, v, w, scale, impl)[1]
    row["fwd_ms"] = float(triton.testing.do_bench(lambda: window_fwd(q, k, v, w, scale, impl), warmup=25, rep=100,
                                                  return_mode="median"))
    row["bwd_ms"] = float(triton.testing.do_bench(lambda: window_bwd(do, st, w, scale, impl), warmup=25, rep=100,
                                                  return_mode="median"))
    # what our stages move besides the window: o3's three branch outputs read and o written (forward); do,
    # the window's output read again for the gate gradient (backward), bf16
    row["combine_gb"] = round(S * HQ * D * 2 * (3 + 1 + 2) / 1e9, 3)
    row["flop_fwd_g"] = round(4 * S * w * HQ * D / 1e9, 1)
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    torch.cuda.empty_cache()


def _band_mask(S: int, w: int) -> torch.Tensor:
    t = torch.arange(S, device="cuda")
    return (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - w)


def main() -> None:
    if "--check" in sys.argv:
        check()
        check(S=64, w=16)
        return
    impl = os.environ.get("WINDOW_IMPL", "cudnn")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "window.jsonl"), "a") as log:
        for item in [a for a in sys.argv[1:] if ":" in a] or ["paper:65536", "paper:131072", "m7c:65536"]:
            shape, S = item.split(":")
            bench(shape, int(S), log, impl)


if __name__ == "__main__":
    main()
