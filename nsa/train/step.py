"""One training step, the trainer's and its benchmark's (``nsa bench train`` times this code, so what it says
is what ``nsa train`` does): forward and backward over ``train.accum`` micro-batches, the gradient norm and
clipping, one all-reduce of everything the ranks must agree on (the step's one host sync), then the optimizer
and schedule."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from nsa.config import RunConfig
from nsa.train import distributed as D
from nsa.train import parallel
from nsa.train.hooks import StepHooks

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # inputs, labels, packed documents' cu_seqlens
HaltRequest = tuple[str, str, str | None]  # source, reason, watch rule


@dataclass
class StepOutcome:
    """One optimizer step's figures, agreed by all ranks through one all-reduce (the step's one sync)."""

    loss: float
    grad_norm: float
    bad: str | None  # "nonfinite_loss" / "nonfinite_grad": the step must not be applied
    halt: HaltRequest | None  # this rank's own halt request (source, reason, watch rule)
    halt_any: bool
    save_now: bool
    fields: dict[str, float]  # the step hooks' telemetry fields (nsa.train.hooks)
    fetch_s: float


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only, fused on CUDA; on FSDP2's shards
    (:class:`parallel.ShardAdamW`)."""
    opt = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device_type == "cuda" else {}
    kind = parallel.ShardAdamW if parallel.any_dtensor(params) else torch.optim.AdamW
    return kind(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), **extra)


def _no_halt() -> HaltRequest | None:
    return None


def _no_save() -> bool:
    return False


@dataclass
class Stepper:
    """What a step touches: ``model`` (its parameters are clipped), ``train_model`` (the wrapped forward:
    DDP/FSDP2, compiled), the optimizer and schedule, the run's autocast, the ranks, the step hooks, where the
    next batch comes from, and (the trainer's) this rank's halt request and save signal."""

    cfg: RunConfig
    model: Any
    train_model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    autocast: Callable[[], AbstractContextManager[Any]]
    device: torch.device
    dist: D.DistInfo
    hooks: StepHooks
    next_batch: Callable[[], Batch]
    halt_request: Callable[[], HaltRequest | None] = _no_halt
    save_requested: Callable[[], bool] = _no_save

    def forward_backward(self) -> StepOutcome:
        """Forward and backward over ``train.accum`` micro-batches, the gradient norm, and one all-reduce
        of everything the ranks must agree on (the step hooks' sums included)."""
        accum = self.cfg.train.accum
        loss_sum = torch.zeros((), device=self.device)
        fetch_s = 0.0
        for micro in range(accum):
            tf = time.perf_counter()
            x, y, cu = self.next_batch()
            fetch_s += time.perf_counter() - tf
            last = micro == accum - 1
            with parallel.gradient_sync(self.train_model, self.model, enabled=last or not self.dist.enabled):
                with self.autocast():
                    out = self.train_model(x, labels=y, cu_seqlens=cu)
                loss = out.loss.float() / accum
                loss.backward()
            loss_sum += loss.detach()
            self.hooks.on_micro_batch(out, y)
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.cfg.optimizer.grad_clip
        dev = self.device
        # FSDP2: this rank's shards; the norm is summed with the flags below
        shards = parallel.grad_shards(params)
        if shards is None:  # whole gradients, identical on all ranks after DDP's all-reduce
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")).float()
        else:
            grad_norm = parallel.sum_of_squares(shards, dev)
        halt = self.halt_request()
        flags = torch.stack([
            loss_sum, (~torch.isfinite(loss_sum)).float(), (~torch.isfinite(grad_norm)).float(),
            torch.tensor(float(halt is not None), device=dev),
                             torch.tensor(float(self.save_requested()), device=dev),
            grad_norm,  # DDP: the norm (the same on every rank); FSDP2: this rank's share of its square
            *self.hooks.step_sums(),
        ])
        D.all_reduce_sum(flags, self.dist)
        if shards is not None and clip > 0:
            parallel.clip_shards(shards, flags[5].sqrt(), clip)  # on the device, before the step's one sync
        loss_t, bad_loss, bad_grad, halt_any, save_any, norm_t, *hook_totals = flags.tolist()  # one sync
        n = self.dist.world_size
        return StepOutcome(
            loss=loss_t / n, grad_norm=norm_t / n if shards is None else math.sqrt(norm_t),
            bad="nonfinite_loss" if bad_loss else "nonfinite_grad" if bad_grad else None,
            halt=halt, halt_any=bool(halt_any), save_now=bool(save_any),
            fields=self.hooks.log_fields(hook_totals),
            fetch_s=fetch_s,
        )

    def apply(self) -> None:
        """The optimizer's and the schedule's step, gradients cleared."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard(self) -> None:
        """Drop the step's gradients (an anomaly: the step is not applied)."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> StepOutcome:
        """One whole step, applied unless it is bad (what ``nsa bench train`` times)."""
        r = self.forward_backward()
        if r.bad is None:
            self.apply()
        else:
            self.discard()
        return r
