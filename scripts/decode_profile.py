"""Kernel-time breakdown of one decode step on CUDA (device machine helper, not part of the package).

python3 scripts/decode_profile.py OUT.json [attention[:BACKEND]] [sweep] [model]
- attention: the NSA decode op at 64k, batch 1 and 32, paper and m7c shapes: kernels by device time;
- sweep: CUDA-graph time of the fused step under tuning overrides (``nsa.ops.tile_overrides``);
- model: one compiled ``NSALM.decode_step`` of m7c-125m (NSA and dense) at 2k and 64k, batch 1:
  CUDA-graph time and kernels. (The ``model:gemm-gates`` variant, which patched the layer's gate MLP into plain
  Linear layers, is gone: the layer chooses by the rows, ``NSAAttention.gate_logits``.)
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from nsa.bench.profile import profile_kernels
from nsa.bench.requests import SHAPES as NAMED
from nsa.ops import NSAParams

SHAPES = tuple((name, *hq_h_d) for name, hq_h_d in NAMED.items())  # (name, HQ, H, D)
HP = NSAParams()  # the paper's hyper-parameters


def kernels(fn: Callable[[], Any], reps: int = 10) -> dict[str, float]:
    """Device microseconds per call, by kernel name, heaviest first (:func:`nsa.bench.profile.profile_kernels`)."""
    prof = profile_kernels(fn, "cuda", reps=reps, warmup=3)
    return {k["name"]: k["ms"] * 1e3 for k in prof.kernels}


def step_args(HQ: int, H: int, D: int, B: int, T: int = 65537) -> tuple[torch.Tensor, ...]:
    """Random bf16 caches for a query at position ``T - 1`` (the benchmark's layout)."""
    from nsa.ops.indexing import num_cmp

    C = num_cmp(T, HP.l, HP.d)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16)

    return (r(B, HQ, D), torch.full((B,), T - 1, device="cuda"), r(B, H, C + 1, D), r(B, H, C + 1, D),
            r(B, H, T, D), r(B, H, T, D), r(B, H, HP.w, D), r(B, H, HP.w, D),
            torch.rand(B, HQ, 3, device="cuda", dtype=torch.bfloat16))


def _op(args: tuple[torch.Tensor, ...], backend: str) -> torch.Tensor:
    from nsa.ops.decode import nsa_decode

    return nsa_decode(*args, HP, backend=backend).o


def attention_rows(out: dict[str, Any], backend: str) -> None:
    for shape, HQ, H, D in SHAPES:
        for B in (1, 32):
            k = kernels(functools.partial(_op, step_args(HQ, H, D, B), backend))
            key = f"attn-{backend}-{shape}-64k-b{B}"
            out[key] = k
            print(key, f"total {sum(k.values()):.1f} us, {len(k)} kernels", flush=True)
            for name, us in list(k.items())[:8]:
                print(f"   {us:8.1f} us  {name}")
            torch.cuda.empty_cache()


def sweep(out: dict[str, Any]) -> None:
    from nsa.bench.decode import _graph
    from nsa.bench.timing import make_timer
    from nsa.ops import tile_overrides

    timer = make_timer(torch.device("cuda"), 25, 100)
    variants: list[dict[str, int | str]] = [{}, {"dec_rank_block": 16}, {"dec_score_warps": 8},
                                            {"dec_part_prec": "tf32"}]
    for shape, HQ, H, D in SHAPES:
        for B in (1, 32):
            args = step_args(HQ, H, D, B)
            line = []
            for var in variants:
                with tile_overrides(var):  # the graph captures the kernels launched with these tiles
                    g = _graph(functools.partial(_op, args, "triton"), torch.device("cuda"))
                ms = timer(g) if g is not None else float("nan")
                out[f"sweep-{shape}-b{B}-{var}"] = ms
                line.append(f"{var or 'base'}={ms * 1000:.1f}us")
            print(shape, B, " ".join(line), flush=True)


def _model_step(model: Any, cache: Any, base: torch.Tensor, tok: torch.Tensor, ctx: int) -> None:
    cache.lengths.copy_(base)
    cache.host_len = ctx
    model.decode_step(tok, cache)


def model_rows(out: dict[str, Any], variant: str = "") -> None:
    from nsa.bench.decode import _graph
    from nsa.bench.timing import make_timer
    from nsa.config import load_named
    from nsa.model import build_model

    if variant:
        raise SystemExit(f"model:{variant}: no such variant (model:gemm-gates, a patch of the layer, is gone)")
    timer = make_timer(torch.device("cuda"), 25, 100)
    for ctx in (2048, 65536):
        for attention in ("nsa",) if variant else ("nsa", "dense"):
            cfg = load_named("m7c-125m")
            cfg.model.attention = attention
            cfg.model.max_seq_len = max(cfg.model.max_seq_len, ctx + 1)
            torch.manual_seed(0)
            model = build_model(cfg).to("cuda", torch.bfloat16).eval()
            torch._dynamo.reset()
            model.compile_decode()
            cache = model.new_cache(1, ctx + 1)
            base = torch.full((1,), ctx, dtype=torch.int64, device="cuda")
            cache.start(base)
            tok = torch.randint(0, 256, (1,), device="cuda")
            step = functools.partial(_model_step, model, cache, base, tok, ctx)
            with torch.no_grad():
                k = kernels(step, reps=5)
                g = _graph(step, torch.device("cuda"))
                gms = timer(g) if g is not None else float("nan")
            key = f"model-{attention}{variant}-{ctx}-b1-compiled"
            out[key] = k
            out[key + "-graph-ms"] = gms
            print(f"model {attention} {variant} ctx {ctx} b1 compiled graph {gms * 1000:.1f} us", flush=True)
            print(key, f"total {sum(k.values()):.1f} us, {len(k)} kernel names", flush=True)
            for name, us in list(k.items())[:12]:
                print(f"   {us:8.1f} us  {name}")
            del model, cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    path, what = sys.argv[1], sys.argv[2:] or ["attention", "model"]
    res: dict[str, Any] = {}
    for w in what:
        name, _, arg = w.partition(":")
        if name == "attention":
            attention_rows(res, arg or "triton")
        elif name == "sweep":
            sweep(res)
        elif name == "model":
            model_rows(res, arg)
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
