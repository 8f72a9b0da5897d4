"""Kernels by CUDA time of one NSA op forward+backward (Triton backend), `torch.profiler`.

Usage (repo root, GPU): python3 scripts/op_profile.py [--ops] [--tune key=value ...] paper:65536 m7c:32768 ...
(`--tune`: tile overrides, `nsa.ops.TUNE_KEYS`, e.g. `--tune sel_partial_mib=256` for the selection in query chunks)
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nsa.bench.attention import SHAPES
from nsa.ops import NSAParams, compress_avg, nsa_attention, tile_overrides


def profile_op(shape: str, S: int, p: NSAParams = NSAParams()) -> None:
    HQ, H, D = SHAPES[shape]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)

    q = r(1, S, HQ, D)
    kr, vr, ks, vs, kw, vw = (r(1, S, H, D) for _ in range(6))
    gates = torch.rand(1, S, HQ, 3, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    do = torch.randn(1, S, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        o = nsa_attention(q, compress_avg(kr, p), compress_avg(vr, p), ks, vs, kw, vw, gates, p, backend="triton")
        o.backward(do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if OPS else [ProfilerActivity.CUDA]
    with profile(activities=acts, record_shapes=OPS) as prof:
        step()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0][:70]
            per[name][0] += e.device_time_total / 1e3
            per[name][1] += 1
    total = sum(v[0] for v in per.values())
    print(f"== {shape} S={S}: {total:.2f} ms of kernels, {sum(int(v[1]) for v in per.values())} launches")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:24]:
        print(f"{ms:9.3f} ms {int(n):4d}x  {name}")
    if OPS:  # the PyTorch operators behind the kernels (which copy, which fill), by their own CUDA time
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=30,
                                                                 max_name_column_width=48, max_shapes_column_width=70))


OPS = "--ops" in sys.argv  # also the operator table (names and input shapes)


def _args(argv: list[str]) -> tuple[list[str], dict[str, int | str]]:
    """The ``shape:S`` arguments and the ``--tune key=value`` overrides (numbers as ints)."""
    shapes, tune, it = [], {}, iter(argv)
    for a in it:
        if a == "--tune":
            key, _, val = next(it).partition("=")
            tune[key] = int(val) if val.lstrip("-").isdigit() else val
        elif a != "--ops":
            shapes.append(a)
    return shapes or ["paper:65536"], tune


if __name__ == "__main__":
    shapes, tune = _args(sys.argv[1:])
    with tile_overrides(tune):
        for arg in shapes:
            shape, S = arg.split(":")
            profile_op(shape, int(S))
            torch.cuda.empty_cache()
