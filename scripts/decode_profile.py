"""Kernel-time breakdown of one decode step on CUDA (device machine helper, not part of the package).

python3 scripts/decode_profile.py OUT.json [attention|model ...]
Attention rows: the NSA decode op (given backend) at 64k, batch 1 and 32, paper and m7c shapes.
Model rows: one NSALM.decode_step of m7c-125m (NSA and dense), compiled, at 2k and 64k, batch 1.
Prints the top kernels by summed device time per step.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def kernels(fn, reps: int = 10) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name[:90]] += ev.device_time / reps  # us per step
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def attention_rows(out: dict, backend: str) -> None:
    from nsa.ops.decode import nsa_decode
    from nsa.ops.indexing import num_cmp

    for shape, HQ, H, D in (("paper", 64, 4, 128), ("m7c", 12, 2, 64)):
        for B in (1, 32):
            T = 65537
            l, d, l_sel, n_sel, w = 32, 16, 64, 16, 512
            C, R = num_cmp(T, l, d), w
            dev, dt = "cuda", torch.bfloat16
            r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
            args = (r(B, HQ, D), torch.full((B,), T - 1, device=dev), r(B, H, C + 1, D), r(B, H, C + 1, D),
                    r(B, H, T, D), r(B, H, T, D), r(B, H, R, D), r(B, H, R, D),
                    torch.rand(B, HQ, 3, device=dev, dtype=dt))
            k = kernels(lambda: nsa_decode(*args, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, backend=backend))
            key = f"attn-{backend}-{shape}-64k-b{B}"
            out[key] = k
            print(key, f"total {sum(k.values()):.1f} us, {len(k)} kernels", flush=True)
            for name, us in list(k.items())[:8]:
                print(f"   {us:8.1f} us  {name}")
            torch.cuda.empty_cache()


def model_rows(out: dict, variant: str = "") -> None:
    from nsa.config import load_named
    from nsa.model import build_model
    from nsa.model.attention import NSAAttention

    if variant == "gemm-gates":  # A/B: the gate MLP as plain Linear layers in the decode step too
        NSAAttention.gate_logits = lambda self, x: self.gate_mlp(x)
    for ctx in (2048, 65536):
        for attention in (("nsa",) if variant else ("nsa", "dense")):
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

            def step() -> None:
                cache.lengths.copy_(base)
                cache.host_len = ctx
                model.decode_step(tok, cache)

            with torch.no_grad():
                k = kernels(step, reps=5)
            from nsa.bench.decode import _graph
            from nsa.bench.timing import make_timer

            with torch.no_grad():
                g = _graph(step, torch.device("cuda"))
                gms = make_timer(torch.device("cuda"), 25, 100)(g)
            print(f"model {attention} {variant} ctx {ctx} b1 compiled graph {gms * 1000:.1f} us", flush=True)
            key = f"model-{attention}{variant}-{ctx}-b1-compiled"
            out[key + "-graph-ms"] = gms
            out[key] = k
            print(key, f"total {sum(k.values()):.1f} us, {len(k)} kernel names", flush=True)
            for name, us in list(k.items())[:12]:
                print(f"   {us:8.1f} us  {name}")
            del model, cache
            torch.cuda.empty_cache()


def sweep(out: dict) -> None:
    """CUDA-graph time of the fused step at 64k under TUNE variants (nsa.ops._triton.TUNE)."""
    from nsa.bench.decode import _graph
    from nsa.bench.timing import make_timer
    from nsa.ops._triton import TUNE
    from nsa.ops.decode import nsa_decode
    from nsa.ops.indexing import num_cmp

    timer = make_timer(torch.device("cuda"), 25, 100)
    variants = [{}, {"dec_rank_block": 16}, {"dec_score_warps": 8}, {"dec_part_prec": "tf32"}]
    for shape, HQ, H, D in (("paper", 64, 4, 128), ("m7c", 12, 2, 64)):
        for B in (1, 32):
            T = 65537
            l, d, l_sel, n_sel, w = 32, 16, 64, 16, 512
            C, R = num_cmp(T, l, d), w
            r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            args = (r(B, HQ, D), torch.full((B,), T - 1, device="cuda"), r(B, H, C + 1, D), r(B, H, C + 1, D),
                    r(B, H, T, D), r(B, H, T, D), r(B, H, R, D), r(B, H, R, D),
                    torch.rand(B, HQ, 3, device="cuda", dtype=torch.bfloat16))
            line = []
            for var in variants:
                TUNE.clear()
                TUNE.update(var)
                g = _graph(lambda: nsa_decode(*args, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, backend="triton").o,
                           torch.device("cuda"))
                ms = timer(g) if g is not None else float("nan")
                out[f"sweep-{shape}-b{B}-{var}"] = ms
                line.append(f"{var or 'base'}={ms * 1000:.1f}us")
            TUNE.clear()
            print(shape, B, " ".join(line), flush=True)


if __name__ == "__main__":
    path, what = sys.argv[1], sys.argv[2:] or ["attention", "model"]
    res: dict = {}
    for w in what:
        if w.startswith("attention"):
            attention_rows(res, w.split(":")[1] if ":" in w else "triton")
        elif w.startswith("model"):
            model_rows(res, w.split(":")[1] if ":" in w else "")
        elif w == "sweep":
            sweep(res)
    json.dump(res, open(path, "w"), indent=1)
