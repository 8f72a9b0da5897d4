"""The compression function phi: mean pooling or the paper's learnable block MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nsa.ops import NSAParams, compress_avg


def blocks_of(x: torch.Tensor, l: int, d: int) -> torch.Tensor:  # noqa: E741
    """Raw rows ``[B, S, H, D]`` -> compression blocks ``[B, S_cmp, H, l, D]`` (block ``j`` = rows ``j*d ..
    j*d+l-1``)."""
    B, S, H, D = x.shape
    if l > S:
        return x.new_zeros(B, 0, H, l, D)
    return x.unfold(1, l, d).transpose(-1, -2)


class BlockMLP(nn.Module):
    """phi = MLP over one block: ``x + pos [l, D]`` -> flatten ``l*D`` -> Linear -> SiLU -> Linear -> ``D``.

    The intra-block position embedding tells the MLP where in the block each raw row sits (paper
    Sec. 3.3.1). The same MLP serves every head.
    """

    def __init__(self, l: int, dim: int, hidden: int | None = None) -> None:  # noqa: E741
        super().__init__()
        self.l, self.dim = l, dim
        hidden = hidden or dim
        self.pos = nn.Parameter(torch.zeros(l, dim))
        self.fc1 = nn.Linear(l * dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., l, D]`` -> ``[..., D]``."""
        x = (blocks + self.pos.to(blocks.dtype)).flatten(-2)
        return self.fc2(F.silu(self.fc1(x)))


class Compressor(nn.Module):
    """phi for keys and values of one layer: ``avg`` (``nsa.ops.compress_avg``) or ``mlp`` (``BlockMLP``)."""

    def __init__(self, phi: str, hp: NSAParams, d_k: int, d_v: int, backend: str | None = None) -> None:
        super().__init__()
        if phi not in ("avg", "mlp"):
            raise ValueError(f"nsa.phi='{phi}' must be 'avg' or 'mlp'")
        self.phi, self.hp, self.backend = phi, hp, backend
        self.mlp_k = BlockMLP(hp.l, d_k) if phi == "mlp" else None
        self.mlp_v = BlockMLP(hp.l, d_v) if phi == "mlp" else None

    def forward(self, k_raw: torch.Tensor, v_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw (RoPE'd) keys and values ``[B, S, H, D]`` -> compressed ``[B, S_cmp, H, D]``."""
        if self.mlp_k is None or self.mlp_v is None:
            return (
                compress_avg(k_raw, self.hp, backend=self.backend),
                compress_avg(v_raw, self.hp, backend=self.backend),
            )
        l, d = self.hp.l, self.hp.d  # noqa: E741
        return self.mlp_k(blocks_of(k_raw, l, d)), self.mlp_v(blocks_of(v_raw, l, d))

    def one_block(self, k_blk: torch.Tensor, v_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One block per row: ``[..., l, D]`` (raw rows in position order) -> ``[..., D]`` (decode)."""
        if self.mlp_k is None or self.mlp_v is None:
            return k_blk.mean(dim=-2), v_blk.mean(dim=-2)
        return self.mlp_k(k_blk), self.mlp_v(v_blk)
