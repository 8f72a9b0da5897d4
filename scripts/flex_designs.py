"""Issue 31's third designs by a library: the window branch and the selected branch as FlexAttention
(``torch.nn.attention.flex_attention``, compiled) beside our Triton stages, same inputs, same process.

- window: causal with ``q - kv < w`` (a block mask FlexAttention skips whole tiles by), GQA;
- selected: the per-position top-n blocks as a ``mask_mod`` over a ``[B, H, S, n_blocks]`` table (the
  tiles of 128 positions run the union of their rows' blocks: the "selection as a block mask in one
  FlashAttention-style pass" of kernels.md, for short sequences).

Ours: ``kernel_breakdown`` stages ``win_fwd``/``win_bwd`` (with the gate combine and gate gradient the
library passes lack) and ``sel_fwd``/``sel_bwd``. Each FlexAttention output is first checked against SDPA
with the same boolean mask at a small length.

Usage (repo root, GPU): python3 scripts/flex_designs.py [paper:65536:window,m7c:8192,...]   (a third field: that
design only; --check: CPU, masks only)
JSON lines to $OUT/flex.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from nsa.bench.attention import kernel_breakdown
from nsa.bench.requests import SHAPES
from nsa.ops import NSAParams, compress_avg, nsa_attention


def _inputs(S: int, HQ: int, H: int, D: int, dev: str, dtype: torch.dtype, p: NSAParams) -> dict[str, Any]:
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev, dtype=dtype)

    q, k_raw, v_raw, k, v = rnd(1, S, HQ, D), rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, H, D)
    gates = torch.rand(1, S, HQ, 3, generator=gen, device=dev, dtype=dtype)
    with torch.no_grad():
        _, idx = nsa_attention(q, compress_avg(k_raw, p), compress_avg(v_raw, p), k, v, k, v, gates, p,
                               return_block_idx=True)
    NB = -(-S // p.l_sel)
    table = torch.zeros(1, H, S, NB + 1, dtype=torch.bool, device=dev)  # column NB takes the -1 pads
    table.scatter_(3, idx.long().where(idx >= 0, NB).permute(0, 2, 1, 3), True)
    return {"q": q.transpose(1, 2).contiguous(), "k": k.transpose(1, 2).contiguous(),
            "v": v.transpose(1, 2).contiguous(), "table": table[..., :NB].contiguous()}


def _mask_mods(x: dict[str, Any], HQ: int, H: int, p: NSAParams) -> dict[str, Callable[..., Any]]:
    G, w, ls, table = HQ // H, p.w, p.l_sel, x["table"]

    def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w)

    def selected(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return table[b, h // G, q_idx, kv_idx // ls] & (kv_idx <= q_idx)

    return {"window": window, "selected": selected}


def _dense_mask(mod: Callable[..., Any], HQ: int, S: int, dev: str) -> torch.Tensor:
    h = torch.arange(HQ, device=dev)[:, None, None]
    qi = torch.arange(S, device=dev)[None, :, None]
    ki = torch.arange(S, device=dev)[None, None, :]
    return mod(torch.zeros_like(h), h, qi, ki)[None]


def check(dev: str = "cpu", S: int = 1024) -> None:
    """FlexAttention with each mask equals SDPA with the same boolean mask (float32)."""
    HQ, H, D, p = 4, 2, 16, NSAParams(l=32, d=16, l_sel=64, n_sel=4, w=128)
    x = _inputs(S, HQ, H, D, dev, torch.float32, p)
    for name, mod in _mask_mods(x, HQ, H, p).items():
        bm = create_block_mask(mod, 1, HQ, S, S, device=dev)
        got = flex_attention(x["q"], x["k"], x["v"], block_mask=bm, enable_gqa=True)
        kk, vv = (t.repeat_interleave(HQ // H, 1) for t in (x["k"], x["v"]))
        want = F.scaled_dot_product_attention(x["q"], kk, vv, attn_mask=_dense_mask(mod, HQ, S, dev))
        err = float((got - want).abs().max())
        print(f"check {name}: max |flex - sdpa| = {err:.2e}")
        assert err < 1e-4, name


def bench(shape: str, S: int, log: Any, designs: tuple[str, ...] = ("window", "selected")) -> None:
    import triton.testing

    HQ, H, D = SHAPES[shape]
    p = NSAParams()
    x = _inputs(S, HQ, H, D, "cuda", torch.bfloat16, p)
    flex = torch.compile(flex_attention, dynamic=False)
    row: dict[str, Any] = {"shape": shape, "S": S, "device": torch.cuda.get_device_name()}
    ours = kernel_breakdown(S, HQ, H, D, only=tuple(f"{d[:3]}_{part}" for d in designs for part in ("fwd", "bwd")))
    row.update({f"ours_{k}": v for k, v in ours.items()})
    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    do = torch.randn_like(q)
    for name, mod in _mask_mods(x, HQ, H, p).items():
        if name not in designs or (name == "selected" and S > 16384):  # a per-head mask of S x S evaluations: short sequences only
            continue
        bm = torch.compile(create_block_mask)(mod, 1, HQ if name == "selected" else None, S, S, device="cuda")
        row[f"flex_{name}_density"] = round(1.0 - float(bm.sparsity()) / 100, 4)  # share of tiles run

        def fwd(bm: Any = bm) -> torch.Tensor:
            out: torch.Tensor = flex(q, k, v, block_mask=bm, enable_gqa=True)
            return out

        def fwdbwd(fwd: Callable[[], torch.Tensor] = fwd) -> None:
            torch.autograd.grad(fwd(), (q, k, v), do)

        with torch.no_grad():
            row[f"flex_{name}_fwd"] = float(triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median"))
        row[f"flex_{name}_fwdbwd"] = float(triton.testing.do_bench(fwdbwd, warmup=25, rep=100, return_mode="median"))
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    torch.cuda.empty_cache()


def main() -> None:
    if "--check" in sys.argv:
        check()
        return
    runs = (sys.argv[1] if len(sys.argv) > 1 else "m7c:8192,m7c:16384,paper:8192,paper:16384,paper:65536").split(",")
    check("cuda")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "flex.jsonl"), "a") as log:
        for run in runs:
            shape, S, *only = run.split(":")
            bench(shape, int(S), log, tuple(only) or ("window", "selected"))


if __name__ == "__main__":
    main()
