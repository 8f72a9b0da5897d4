"""Process-group set-up from torchrun's environment and the few collectives the trainer needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job (single process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class Layout:
    """Data x context ranks: rank ``= data_rank * context_size + context_rank`` (the ranks of one sequence are
    adjacent: on one node, over NVLink); ``context_group`` joins them (None without context parallelism)."""

    data_rank: int = 0
    data_size: int = 1
    context_rank: int = 0
    context_size: int = 1
    context_group: Any = None

    def describe(self) -> str:
        return (f"{self.data_size} data x {self.context_size} context" if self.context_size > 1
                else f"{self.data_size} data")


def layout(info: DistInfo, context: int, device_type: str) -> Layout:
    """This rank's place in the data x context grid (a device mesh; a collective when ``context > 1``)."""
    if context <= 1:
        return Layout(info.rank, info.world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (info.world_size // context, context),
                            mesh_dim_names=("data", "context"))
    return Layout(info.rank // context, info.world_size // context, info.rank % context, context,
                  mesh.get_group("context"))


def env_info() -> DistInfo:
    """Rank, world size and local rank from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return DistInfo(rank=rank, world_size=world, local_rank=local)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device_type: str) -> DistInfo:
    """Join the process group when there is more than one rank: NCCL on CUDA, gloo on CPU."""
    info = env_info()
    if info.world_size <= 1:
        return info
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(info.rank, info.world_size, info.local_rank, backend)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op with one rank)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` as a list indexed by rank (all ranks receive it)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
