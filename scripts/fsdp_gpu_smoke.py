"""One-GPU FSDP2 smoke check (docs/benchmarks/fsdp-gpu-smoke.md): a one-rank NCCL process group, the
``m7c-125m`` NSA model sharded by ``nsa.train.parallel.shard``, compiled, bf16 autocast, 6 AdamW steps
against the unsharded model; then a DCP save/load of the shards and the whole-state gather.

Run from the repository root on a CUDA machine: ``python3 scripts/fsdp_gpu_smoke.py``.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nsa.config import load_run_config
from nsa.model import build_model
from nsa.train import parallel
from nsa.train.distributed import DistInfo


def train(sharded: bool, steps: int = 6) -> list[float]:
    cfg = load_run_config("m7c-125m", environ={}, sets=["runtime.parallel=fsdp"]).config
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg).cuda()
    if sharded:
        parallel.shard(model, cfg, "bf16", "cuda")
    forward = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(0, 256, (8, 2049), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    t0 = time.time()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(float(loss.detach()), 4))
    torch.cuda.synchronize()
    name = "fsdp" if sharded else "plain"
    print(name, losses, "grad norm", round(float(norm), 3), "s", round(time.time() - t0, 1),
          "peak GiB", round(torch.cuda.max_memory_allocated() / 2**30, 1), flush=True)
    if sharded:
        state = parallel.ShardedState(model, opt)
        with tempfile.TemporaryDirectory() as tmp:
            dcp.save({"sharded": state.state_dict()}, checkpoint_id=tmp)
            template = {"sharded": state.state_dict()}
            dcp.load(template, checkpoint_id=tmp)
            state.load_state_dict(template["sharded"])
        full = parallel.full_model_state(model, DistInfo())
        assert full is not None
        print("DCP round trip ok; whole state:", len(full), "tensors", flush=True)
    return losses


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        a, b = train(True), train(False)
        print("largest loss difference", max(abs(x - y) for x, y in zip(a, b, strict=True)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
