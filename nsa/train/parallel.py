"""Data parallelism of the trainer: DDP (every rank holds the whole model) or FSDP2 (``fully_shard`` per
block: parameters, gradients and optimizer state sharded over the ranks; ``runtime.parallel: fsdp``).

FSDP: bf16 parameters with fp32 gradient reduction when the run trains in bf16 (fp16 likewise), full
precision otherwise; ``runtime.fsdp_cpu_offload`` keeps the sharded parameters and optimizer state in
host memory. ``torch.compile`` wraps each block before it is sharded (``runtime.compile_scope``: the whole
model instead). The blocks are sharded in units of ``runtime.fsdp_unit_blocks`` (auto: the whole model one
unit up to 1B parameters, else one block a unit), and the last unit stays gathered after its forward (the
backward needs it first). A sharded model's checkpoint state is a ``torch.distributed.checkpoint`` (DCP)
state: every rank writes its own shards (:mod:`nsa.train.state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nsa.config import RunConfig
from nsa.errors import CheckpointError
from nsa.train import distributed as D


def sharded(cfg: RunConfig, dist: D.DistInfo) -> bool:
    """FSDP is in use: requested and more than one process (a single process trains unwrapped)."""
    return cfg.runtime.parallel == "fsdp" and dist.enabled


def shard(model: Any, cfg: RunConfig, precision: str, device_type: str) -> None:
    """``fully_shard`` each unit of ``runtime.fsdp_unit_blocks`` blocks, then the root (embedding, final norm,
    head), in place."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    kw: dict[str, Any] = {"reshard_after_forward": cfg.runtime.fsdp_reshard_after_forward}
    if low is not None and device_type == "cuda":
        reduce = low if cfg.runtime.fsdp_reduce_dtype == "low" else torch.float32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)
    if cfg.runtime.fsdp_cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    per_unit = cfg.runtime.fsdp_units(sum(p.numel() for p in model.parameters()))
    for last, unit in units(model.block_list(), per_unit):
        # the last unit's parameters are gathered again at once by the backward: kept
        fully_shard(unit, **{**kw, "reshard_after_forward": kw["reshard_after_forward"] and not last})
    # the root (embedding, final norm, head; every block when units are 0) is the backward's first unit too:
    # kept
    # gathered (resharding it cost a second whole-model gather a step at 125M: 5 ms of host time on 2x H200)
    fully_shard(model, **{**kw, "reshard_after_forward": False})


def units(blocks: list[Any], per_unit: int) -> list[tuple[bool, Any]]:
    """The ``fully_shard`` units of the blocks, ``per_unit`` consecutive blocks each (a block alone, or a list
    that FSDP2 gathers and reduce-scatters as one), with whether each is the last; none for ``per_unit`` 0
    (the root unit holds every block)."""
    if per_unit <= 0:
        return []
    groups = [blocks[i:i + per_unit] for i in range(0, len(blocks), per_unit)]
    return [(j == len(groups) - 1, g[0] if len(g) == 1 else g) for j, g in enumerate(groups)]


def wrap(model: Any, cfg: RunConfig, dist: D.DistInfo, precision: str, device_type: str,
         compiled: bool) -> Any:
    """The module the training step calls: sharded (FSDP) or replicated (DDP), then compiled when asked.

    DDP is compiled from the outside (``torch.compile(DDP(model))``, as PyTorch advises): Dynamo's DDP
    optimizer then splits the graph at the gradient buckets, so each bucket's all-reduce overlaps the rest of
    the backward (measured on 2x H200, m7c-125m at 2k: 1.95x one GPU against 1.91x the other way round)."""
    per_block = compiled and cfg.runtime.compiles_blocks(sharded(cfg, dist))
    if compiled:
        # a fresh compile per training session: graphs left by an earlier session of this process (a length
        # curriculum's short phase) would make this one's new sizes symbolic ("automatic dynamic"), which
        # broke
        # Inductor on the NSA operator (an AssertionError at the 8k phase of `nsa bench quality` curricula)
        torch._dynamo.reset()
    mode = cfg.torch_compile_mode(dist.world_size)
    if per_block:  # before sharding, as torchtitan does: FSDP2's hooks then run between the blocks' graphs
        for block in model.block_list():
            block.compile(mode=mode)
    if sharded(cfg, dist):
        shard(model, cfg, precision, device_type)
    elif dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[dist.local_rank] if device_type == "cuda" else None)
    if not compiled or per_block:
        return model
    return torch.compile(model, mode=mode)


@contextlib.contextmanager
def gradient_sync(train_model: Any, model: Any, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter of a micro-batch that is not the last one."""
    if enabled:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(train_model, "no_sync"):  # DDP
        with train_model.no_sync():
            yield
    else:
        yield


def grad_shards(params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """This rank's gradient shards as plain tensors (views: scaling them scales the gradients) when the
    parameters are FSDP2's DTensors, else None. Every element of a sharded gradient lives on exactly one
    rank."""
    from torch.distributed.tensor import DTensor

    if not any_dtensor(params):
        return None
    return [g.to_local() for p in params if isinstance(g := p.grad, DTensor)]


def any_dtensor(params: Sequence[torch.Tensor]) -> bool:
    """Some of ``params`` are DTensors (FSDP2 sharded them)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


class ShardAdamW(torch.optim.AdamW):
    """AdamW whose update runs on this rank's shards of FSDP2's DTensor parameters, gradients and moments as
    plain tensors: AdamW is elementwise, so the arithmetic is the same, and the fused kernel launches without
    DTensor's dispatch (m7c-125m on 2x H200: 6.2 ms of host time a step against 1.0 for DDP's whole tensors).
    The state stays DTensors, so checkpoints (DCP) are unchanged."""

    def _init_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    *lists_and_steps: Any) -> Any:
        has_complex = super()._init_group(group, params, grads, *lists_and_steps)  # type: ignore[misc]
        for tensors in (params, grads, *[x for x in lists_and_steps if isinstance(x, list)]):
            tensors[:] = [local(t) for t in tensors]
        return has_complex


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage: updating it updates the DTensor), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def sum_of_squares(shards: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm of ``shards`` (float32): summed over the ranks, the whole gradient's."""
    if not shards:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(shards)).float().square().sum()


@torch.no_grad()
def clip_shards(shards: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """``clip_grad_norm_``'s scaling of the gradient shards by the whole gradient's norm (a device tensor: no
    sync).

    The norm's squares ride the step's one all-reduce (:class:`nsa.train.step.Stepper`), where
    ``clip_grad_norm_`` over DTensors would all-reduce it on its own and dispatch through DTensor's sharding
    propagation (host time on meta tensors, m7c-125m, 2 ranks: 4.9 ms against 4.2 here;
    `scripts/fsdp_host_overhead.py`)."""
    if shards:
        torch._foreach_mul_(shards, (max_norm / (total_norm + 1e-6)).clamp(max=1.0))


class ShardedState:
    """Model and optimizer state of a sharded model as DCP state dicts (each rank its shards)."""

    sharded = True

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


class WholeIntoShards:
    """A sharded model's ``model`` or (with ``optimizer``) ``optimizer`` component in the whole form of an
    unsharded checkpoint: loading gives every rank the whole state and each keeps its shards
    (``set_*_state_dict(full_state_dict=True)``); ``state_dict`` gathers the whole state back (a
    collective)."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            return get_model_state_dict(self.model, options=full)
        return by_number(self.model, self.optimizer,
                         get_optimizer_state_dict(self.model, self.optimizer, options=full))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        if self.optimizer is None:
            set_model_state_dict(self.model, state, options=full)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, by_name(self.model, self.optimizer, state),
                                     options=full)


def _numbering(model: Any, optimizer: torch.optim.Optimizer, count: int) -> list[str]:
    """Parameter names in ``torch.optim``'s numbering (group order) of ``optimizer``."""
    names = {id(p): n for n, p in model.named_parameters()}
    ours = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if len(ours) != count:
        raise CheckpointError(f"the checkpoint's optimizer holds {count} parameters, this model {len(ours)}")
    return ours


def by_name(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim`` state dict (parameters numbered in group order) keyed by parameter names instead,
    the form of ``torch.distributed.checkpoint.state_dict``; ``optimizer`` was built as the one saved."""
    numbers = [i for g in state["param_groups"] for i in g["params"]]
    name_of = dict(zip(numbers, _numbering(model, optimizer, len(numbers)), strict=True))
    return {"state": {name_of[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def by_number(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`by_name`: names back to ``torch.optim``'s numbers."""
    names = [n for g in state["param_groups"] for n in g["params"]]
    number_of = {n: i for i, n in enumerate(_numbering(model, optimizer, len(names)))}
    return {"state": {number_of[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [number_of[n] for n in g["params"]]}
                             for g in state["param_groups"]]}


def load_views(model: Any, optimizer: torch.optim.Optimizer, *, run_sharded: bool,
               ckpt_sharded: bool) -> dict[str, Any]:
    """The components that load a checkpoint's weights into this run, whichever way each was sharded:
    shards (DCP reshards to any number of ranks, or to whole tensors), a whole state into shards, or whole
    into whole."""
    if ckpt_sharded:
        return {"sharded": ShardedState(model, optimizer)}
    if run_sharded:
        return {"model": WholeIntoShards(model), "optimizer": WholeIntoShards(model, optimizer)}
    return {"model": model, "optimizer": optimizer}


def full_model_state(model: Any, dist: D.DistInfo) -> dict[str, Any] | None:
    """The whole model's state on rank 0 (CPU), gathered from the shards (a collective: every rank calls
    it); ``None`` on other ranks. Unsharded models: their own state dict."""
    full = WholeIntoShards(model).state_dict()
    return full if dist.is_main else None
