"""The compressed branch on each path (our Triton kernels, cuDNN or FlashAttention-2 on virtual rows), on a
CUDA machine: whole op, stages, the select split and compiled training (docs/benchmarks/cmp-sdpa-h200.md).

Usage (repo root, GPU):
  python3 scripts/cmp_paths.py op OUT.json paper,m7c 8192,16384,65536 [kernel,cudnn,flash]
  python3 scripts/cmp_paths.py stages OUT.json paper:65536,m7c:32768 [kernel,cudnn]
  python3 scripts/cmp_paths.py select OUT.json m7c:65536,paper:65536
  python3 scripts/cmp_paths.py train OUT.json 32768x2
Each result prints as one JSON line and the list is rewritten to OUT.json after every row.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from nsa.bench.attention import bench_one, kernel_breakdown
from nsa.bench.requests import SHAPES
from nsa.ops import NSAParams, compress_avg, tile_overrides, triton_path


def _emit(rows: list[dict[str, Any]], row: dict[str, Any], out: str) -> None:
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=1)


def op(out: str, shapes: str, lens: str, paths: str = "kernel,cudnn,flash") -> None:
    rows: list[dict[str, Any]] = []
    names = paths.split(",")
    bench_one("m7c", 4096, 12, 2, 64, peer=False)  # the first timing of a process is warm-up
    for shape in shapes.split(","):
        HQ, H, D = SHAPES[shape]
        for S in (int(x) for x in lens.split(",")):
            for path in names:
                triton_path.set_cmp_path(path)
                r = bench_one(shape, S, HQ, H, D, peer=False, dense=path == names[0])
                _emit(rows, {"shape": shape, "S": S, "path": path, "fwd": r.nsa_fwd_ms, "fwdbwd": r.nsa_fwdbwd_ms,
                             "peak": r.nsa_peak_mib, "dense_fwd": r.dense_fwd_ms,
                             "dense_fwdbwd": r.dense_fwdbwd_ms, "dense_peak": r.dense_peak_mib}, out)
                torch.cuda.empty_cache()
    triton_path.set_cmp_path(None)


def stages(out: str, specs: str, paths: str = "kernel,cudnn") -> None:
    rows: list[dict[str, Any]] = []
    kernel_breakdown(4096, 12, 2, 64)
    for spec in specs.split(","):
        shape, S = spec.split(":")
        HQ, H, D = SHAPES[shape]
        for path in paths.split(","):
            t = kernel_breakdown(int(S), HQ, H, D, cmp_path=path)
            _emit(rows, {"shape": shape, "S": int(S), "path": path, **t, "total": sum(t.values())}, out)
            torch.cuda.empty_cache()


def select(out: str, specs: str) -> None:
    rows: list[dict[str, Any]] = []
    for spec in specs.split(","):
        shape, S = spec.split(":")
        for row in _select_split(shape, int(S)):
            _emit(rows, row, out)
        torch.cuda.empty_cache()


def _select_split(shape: str, S: int) -> list[dict[str, Any]]:
    """Block scoring and top-n timed apart, with and without padded heads and with a bf16 overlap product."""
    import triton.testing

    from nsa.ops._triton.range_attn import range_fwd
    from nsa.ops._triton.scores import _block_scores, select_top, top_blocks

    p = NSAParams()
    HQ, H, D = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = compress_avg(torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g), p).contiguous()
    lse = range_fwd(q, kc, kc, None, stride=p.d, off=p.l - 1, win=0, scale=D**-0.5)
    P = torch.empty(H, S, -(-S // p.l_sel), device="cuda", dtype=torch.float32)
    idx = torch.empty(1, S, H, p.n_sel, device="cuda", dtype=torch.int32)

    def sel() -> torch.Tensor:
        return select_top(q, kc, lse, l=p.l, d=p.d, l_sel=p.l_sel, n_sel=p.n_sel, scale=D**-0.5)

    fns: dict[str, Callable[[], Any]] = {
        "scores": lambda: _block_scores(q, kc, lse, P, 0, S, l=p.l, d=p.d, l_sel=p.l_sel, scale=D**-0.5),
        "topn": lambda: top_blocks(P, idx, 0, S, l_sel=p.l_sel), "select": sel}
    base, rows = sel(), []
    for tune in ({}, {"score_pad": 0}, {"score_prec": "bf16"}):
        with tile_overrides(tune):
            row: dict[str, Any] = {"shape": shape, "S": S, "tune": tune}
            row.update({k: triton.testing.do_bench(f, warmup=10, rep=50) for k, f in fns.items()})
            row["blocks_equal_to_default"] = float((sel() == base).float().mean())
        rows.append(row)
    return rows


def train(out: str, specs: str) -> None:
    from nsa.bench.train import bench_train_step
    from nsa.config import load_run_config

    rows: list[dict[str, Any]] = []
    cfg = load_run_config(config="m7c-125m", sets=["data.source=embedded"]).config
    for spec in specs.split(","):
        S, bs = (int(v) for v in spec.split("x"))
        for att, path in (("dense", None), ("nsa", "kernel"), ("nsa", "cudnn")):
            triton_path.set_cmp_path(path)
            r = bench_train_step(cfg, attention=att, seq_len=S, batch_size=bs, steps=6, warmup=3, compiled=True)
            _emit(rows, {"S": S, "batch": bs, "attention": att, "path": path, "step_ms": r.step_ms,
                         "tokens_per_s": r.tokens_per_s, "peak_mib": r.peak_mib, "error": r.error}, out)
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    triton_path.set_cmp_path(None)


if __name__ == "__main__":
    commands: dict[str, Callable[..., None]] = {"op": op, "stages": stages, "select": select, "train": train}
    if len(sys.argv) < 4 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](*sys.argv[2:])
