"""Packed documents at the paper shape (CUDA): fwd+bwd of compression + ``nsa_attention`` for one sequence,
the same rows as packed documents (``cu_seqlens``) and the documents one call each
(docs/benchmarks/attention-h100.md). Usage: ``python3 scripts/packed_documents_bench.py``."""

from __future__ import annotations

import functools

import torch
import triton.testing

from nsa.ops import NSAParams, compress_avg, nsa_attention

P = NSAParams()
DEV = "cuda"
HQ, H, D = 64, 4, 128


def inputs(T: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(1)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=DEV, dtype=torch.bfloat16).requires_grad_(True)

    q = rnd(1, T, HQ, D)
    raw = [rnd(1, T, H, D) for _ in range(6)]
    gates = torch.rand(1, T, HQ, 3, generator=gen, device=DEV, dtype=torch.bfloat16).requires_grad_(True)
    return q, raw, gates


def step(q: torch.Tensor, raw: list[torch.Tensor], gates: torch.Tensor, cu: torch.Tensor | None = None) -> None:
    kr, vr, ks, vs, kw, vw = raw
    kc = compress_avg(kr, P, cu_seqlens=cu)
    vc = compress_avg(vr, P, cu_seqlens=cu)
    o = nsa_attention(q, kc, vc, ks, vs, kw, vw, gates, P,
                      cu_seqlens=cu)
    assert isinstance(o, torch.Tensor)
    o.sum().backward()


def lengths(T: int, mix: str, gen: torch.Generator) -> list[int]:
    if mix == "8 x 8k":
        return [8192] * 8
    lo, hi = (1024, 16384) if T == 65536 else (256, 4096)
    out: list[int] = []
    while sum(out) < T:
        out.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - T
    return [x for x in out if x > 0]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for T, mix in ((65536, "uniform 1k-16k"), (65536, "8 x 8k"), (32768, "uniform 256-4k")):
        lens = lengths(T, mix, gen)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        q, raw, gates = inputs(T)
        one = triton.testing.do_bench(functools.partial(step, q, raw, gates), warmup=25, rep=200)
        packed = triton.testing.do_bench(functools.partial(step, q, raw, gates, cu), warmup=25, rep=200)
        each = 0.0
        for n in sorted(set(lens)):
            qq, rr, gg = inputs(n)
            each += lens.count(n) * triton.testing.do_bench(functools.partial(step, qq, rr, gg), warmup=10, rep=60)
        print(f"T={T} docs={len(lens)} ({mix}) | one sequence {one:.2f} ms | packed cu_seqlens {packed:.2f} ms | "
              f"documents one by one {each:.2f} ms | packed/one-by-one {packed / each:.2f}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
