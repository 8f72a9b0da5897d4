"""What is alive at the peak of one NSA forward+backward (CUDA): the allocator's trace replayed, the live
blocks at the highest point grouped by the code that allocated them.

Usage (repo root, GPU): python3 scripts/mem_phases.py [paper|m7c] [S]   (default: paper 65536)
Prints the peak over the inputs, then MiB per allocation site (the innermost ``nsa/`` frame, else the
innermost named C++ frame: cuDNN's backward shows as itself).
"""
from __future__ import annotations

import sys
from collections import Counter

import torch

from nsa.bench.attention import SHAPES
from nsa.ops import NSAParams, compress_avg, nsa_attention


def _site(frames: list[dict]) -> str:
    for f in frames:
        if "/nsa/" in f.get("filename", ""):
            return f"{f['filename'].split('/nsa/')[-1]}:{f['line']} {f['name']}"
    for f in frames:
        name = f.get("name", "")
        if any(k in name for k in ("cudnn", "flash", "efficient", "Backward", "autograd::")):
            return name[:90]
    return frames[0].get("name", "?")[:90] if frames else "?"


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "paper"
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    HQ, H, D = SHAPES[shape]
    dev, dt, p = torch.device("cuda"), torch.bfloat16, NSAParams()
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev, dtype=dt).requires_grad_(True)

    q = rnd(1, S, HQ, D)
    kv = [rnd(1, S, H, D) for _ in range(6)]
    gates = torch.rand(1, S, HQ, 3, generator=gen, device=dev, dtype=dt).requires_grad_(True)
    grad = torch.randn(1, S, HQ, D, generator=gen, device=dev, dtype=dt)

    def step() -> None:
        k_raw, v_raw, k_sel, v_sel, k_win, v_win = kv
        out = nsa_attention(q, compress_avg(k_raw, p), compress_avg(v_raw, p), k_sel, v_sel, k_win, v_win, gates, p)
        out.backward(grad)  # type: ignore[union-attr]
        for t in (q, gates, *kv):
            t.grad = None

    step()  # warm-up: kernels compiled, workspaces sized
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="all")
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base

    live: dict[int, tuple[int, str]] = {}
    best, best_live, cur = -1, {}, 0
    for trace in snap["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
                cur += e["size"]
                if cur > best:
                    best, best_live = cur, dict(live)
            elif e["action"] == "free_completed" and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
    by_site: Counter[str] = Counter()
    for size, site in best_live.values():
        by_site[site] += size
    print(f"{shape} S={S}: peak over the inputs {peak / 2**20:,.0f} MiB (traced allocations at the peak "
          f"{best / 2**20:,.0f} MiB)")
    for site, size in by_site.most_common(14):
        print(f"  {size / 2**20:9,.0f} MiB  {site}")


if __name__ == "__main__":
    main()
