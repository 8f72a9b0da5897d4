"""Where a context-parallel training step spends its time (issue 32): the ``m7c-125m`` NSA model, one sequence of
``--seq-len`` positions, forward + backward (+ AdamW) in bf16, on one GPU (``python3 scripts/cp_profile.py``) or
split over the ranks of ``torchrun --nproc-per-node N scripts/cp_profile.py`` (context parallelism over all of
them). Prints milliseconds per step, tokens/s (whole and per GPU) and peak memory per rank; ``--profile DIR``
writes rank 0's operator tables (by CUDA time and by host time) there; ``--probe S1,S2,..`` instead tries one
step at each length and reports the peak memory, stopping at the first that does not fit (under torchrun an
out-of-memory ends the launch: probe one length per launch there).

    torchrun --nproc-per-node 2 scripts/cp_profile.py --seq-len 65536 --profile out/
    torchrun --nproc-per-node 2 scripts/cp_profile.py --seq-len 262144 --compile --cmp-path cudnn
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nsa.config import load_run_config
from nsa.model import build_model
from nsa.model.context import ContextParallel


def _model(seq_len: int, args: argparse.Namespace, cp: ContextParallel | None) -> torch.nn.Module:
    sets = [f"model.max_seq_len={max(seq_len, 2048)}", "data.source=embedded",
            f"runtime.gradient_checkpointing={str(args.grad_ckpt).lower()}", *args.set]
    cfg = load_run_config(args.config, environ={}, sets=sets).config
    torch.manual_seed(0)
    model = build_model(cfg).cuda()
    model.set_gradient_checkpointing(args.grad_ckpt)
    if cp is not None:
        model.set_context_parallel(cp)
    return model


def _step(forward, model, opt, ids, labels) -> None:  # type: ignore[no-untyped-def]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = forward(ids, labels=labels).loss
    loss.backward()
    if dist.is_initialized():  # the data-parallel part of a CP step: every rank's gradient summed
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _setup(seq_len: int, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cp = ContextParallel(dist.group.WORLD, rank, world) if world > 1 else None
    model = _model(seq_len, args, cp)
    forward = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, seq_len + 1), generator=g).cuda()
    x, y = ids[:, :-1], ids[:, 1:]
    if cp is not None:
        x, y = cp.shard(x), cp.shard(y)
    return model, forward, opt, x, y, world, rank


def measure(args: argparse.Namespace) -> dict[str, float]:
    S = args.seq_len
    model, forward, opt, x, y, world, rank = _setup(S, args)
    for _ in range(args.warmup):
        _step(forward, model, opt, x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        _step(forward, model, opt, x, y)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    row = {"seq_len": S, "world": world, "compile": args.compile, "grad_ckpt": args.grad_ckpt, "ms_per_step": ms,
           "tokens_per_s": S / ms * 1e3, "tokens_per_s_per_gpu": S / ms * 1e3 / world,
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    if args.profile is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                _step(forward, model, opt, x, y)
            torch.cuda.synchronize()
        if rank == 0:
            out = Path(args.profile)
            out.mkdir(parents=True, exist_ok=True)
            tag = f"w{world}-s{S}{'-c' if args.compile else ''}"
            avg = prof.key_averages()
            table = avg.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
            host = avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
            (out / f"kernels-{tag}.txt").write_text(table + "\n\nby host time\n" + host)
            print(table, flush=True)
    return row


def probe(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for S in (int(s) for s in args.probe.split(",")):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ok = True
        try:
            model, forward, opt, x, y, world, _ = _setup(S, args)
            t0 = time.perf_counter()
            _step(forward, model, opt, x, y)
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            if dist.is_initialized():  # the other ranks wait in a collective: let torchrun end them all
                raise
            ok, s = False, float("nan")
        rows.append({"seq_len": S, "world": world if ok else None, "fits": ok, "step_s": s,
                     "peak_mib": torch.cuda.max_memory_allocated() / 2**20})
        print(json.dumps(rows[-1]), flush=True)
        model = forward = opt = None  # type: ignore[assignment]
        if not ok:
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="m7c-125m")
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--profile", default=None, help="folder for rank 0's kernel table and trace")
    ap.add_argument("--probe", default=None, help="comma-separated lengths: one step each, stop at the first OOM")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--set", action="append", default=[], help="run-config override, as nsa train --set")
    ap.add_argument("--cmp-path", default=None, help="the compressed branch's path where it can serve (cudnn: "
                    "also the chunks at an offset, a rectangle and a causal square merged by lse)")
    args = ap.parse_args()
    if args.cmp_path:
        from nsa.ops import triton_path

        triton_path.set_cmp_path(args.cmp_path)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        result: object = probe(args) if args.probe else measure(args)
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"rank {rank}", json.dumps(result), flush=True)
        if args.json_out and rank == 0:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps(result, indent=1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
