"""Learning-rate schedule: linear warmup, then cosine decay to a floor, counted in optimizer steps."""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the update that follows ``step`` completed optimizer steps.

    Warmup is clamped to ``total_steps``; during warmup the multiplier rises linearly to 1 at the last
    warmup update; afterwards it follows half a cosine from 1 down to ``min_lr_ratio`` at the last step.
    """
    warmup = min(warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepping once per optimizer step; its state is the step count (checkpointable)."""

    def fn(step: int) -> float:
        return lr_multiplier(step, total_steps, warmup_steps, min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def schedule_lrs(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[float]:
    """The learning rates ``scheduler``'s lambdas give for its current step (what the next update uses)."""
    step = scheduler.last_epoch
    return [float(base * fn(step)) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
