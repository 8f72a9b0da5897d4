"""Rotary position embedding (rotate-half layout), computed in float32 at explicit positions."""

from __future__ import annotations

import torch
from torch import nn

from nsa.ops.rotary import rotate


@torch.library.custom_op("nsa::rope_angles", mutates_args=())
def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``positions[..., None] * inv_freq`` (``[..., D/2]`` in ``inv_freq``'s dtype).

    An operator of its own so that a compiled step computes the table once (one small kernel) and every
    rotation reads it: Inductor would otherwise inline ``cos``/``sin`` into each rotation's kernel and
    evaluate them once per element of every head and batch row (a third of a 125M model's elementwise time at
    2k)."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq
    return freqs.cos(), freqs.sin()


@rope_angles.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, inv_freq.shape[0])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


class RotaryEmbedding(nn.Module):
    """RoPE over the last dim of ``x [B, S, H, D]`` at ``positions`` (``[S]`` shared or ``[B, S]``).

    Angles are ``pos * theta ** (-2i / D)`` in float32 (float64 for float64 inputs), so the same position
    gives bit-identical rotations in a full forward and in a one-token decode step. Nothing is stored as a
    buffer, so casting the model to bf16 never degrades the frequencies.
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

    def table(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at ``positions`` (``[S]`` or ``[B, S]``) as ``[1|B, S, D/2]``, in float32 (float64
        for a float64 ``like``): the table :func:`nsa.ops.rotary.split_rotate` reads."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        cos, sin = rope_angles(positions, self.inv_freq(like.device, dtype))
        return (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)

    def angles(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`table` as ``[1|B, S, 1, D/2]``: compute it once and rotate several tensors at the same
        positions with it."""
        cos, sin = self.table(positions, like)
        return cos[:, :, None, :], sin[:, :, None, :]

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x`` rotated at ``positions``; ``angles``: :meth:`angles` of them, already computed."""
        cos, sin = self.angles(positions, x) if angles is None else angles
        return rotate(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
