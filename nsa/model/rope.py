"""Rotary position embedding (rotate-half layout), computed in float32 at explicit positions."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """RoPE over the last dim of ``x [B, S, H, D]`` at ``positions`` (``[S]`` shared or ``[B, S]``).

    Angles are ``pos * theta ** (-2i / D)`` in float32 (float64 for float64 inputs), so the same position gives bit-identical
    rotations in a full forward and in a one-token decode step. Nothing is stored as a buffer, so
    casting the model to bf16 never degrades the frequencies.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE head dim {head_dim} must be even")
        self.head_dim = head_dim
        self.theta = float(theta)
        self._inv_freq: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def inv_freq(self, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a constant Inductor folds; a cache lookup would add a guard on
            return self._compute(device, dtype)  # the dict's keys and recompile once the cache is filled
        f = self._inv_freq.get((device, dtype))
        if f is None:
            f = self._inv_freq[(device, dtype)] = self._compute(device, dtype)
        return f

    def _compute(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        exps = torch.arange(0, self.head_dim, 2, dtype=dtype, device=device) / self.head_dim
        return self.theta ** (-exps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        freqs = positions.to(dtype)[..., None] * self.inv_freq(x.device, dtype)  # [S|B,S, D/2]
        if freqs.dim() == 2:
            freqs = freqs[None]
        cos, sin = freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]  # [1|B, S, 1, D/2]
        half = self.head_dim // 2
        xf = x.to(dtype)
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
