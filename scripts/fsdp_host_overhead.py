"""Host time of FSDP2's gradient clipping (issue 54): `clip_grad_norm_` over plain parameters, over FSDP2's DTensors,
and the trainer's shard path (`nsa.train.parallel.grad_shards` / `sum_of_squares` / `clip_shards`), on meta tensors
(no arithmetic, no communication: what is left is dispatch, which the GPU waits on in a step without CUDA graphs).

Usage (repo root, any machine): torchrun --nproc-per-node 2 scripts/fsdp_host_overhead.py [--config m7c-125m]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from nsa.config import load_run_config
from nsa.model import build_model
from nsa.train import parallel


def timed(fn: Callable[[], object], reps: int = 10) -> float:
    """Mean ms of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def meta_params(cfg: object, sharded: bool) -> list[torch.Tensor]:
    """The model's parameters on the meta device (FSDP2's DTensors when ``sharded``), each with a gradient."""
    with torch.device("meta"):
        model = build_model(cfg)  # type: ignore[arg-type]
    if sharded:
        for block in model.block_list():
            fully_shard(block)
        fully_shard(model)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def dtensor_norm_and_scale(params: list[torch.Tensor]) -> None:
    """``clip_grad_norm_``'s own ops (its final all-reduce cannot run on meta tensors)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, (1.0 / (total + 1e-6)).clamp(max=1.0))


def shard_path(params: list[torch.Tensor]) -> None:
    s = parallel.grad_shards(params)
    assert s is not None
    parallel.clip_shards(s, parallel.sum_of_squares(s, torch.device("meta")).sqrt(), 1.0)


def main() -> None:
    dist.init_process_group("gloo")
    config = sys.argv[sys.argv.index("--config") + 1] if "--config" in sys.argv else "m7c-125m"
    cfg = load_run_config(config=config, environ={}).config
    plain, sharded = meta_params(cfg, False), meta_params(cfg, True)
    rows = [("plain: clip_grad_norm_", timed(lambda: torch.nn.utils.clip_grad_norm_(plain, 1.0))),
            ("FSDP2: clip_grad_norm_'s ops on DTensors", timed(lambda: dtensor_norm_and_scale(sharded))),
            ("FSDP2: the trainer's shard path", timed(lambda: shard_path(sharded)))]
    if dist.get_rank() == 0:
        print(f"{config}, {len(plain)} parameters, {dist.get_world_size()} ranks, host ms a step (meta tensors):")
        for name, ms in rows:
            print(f"  {name:44s} {ms:8.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
