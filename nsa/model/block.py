"""The LLaMA-style pre-norm block: ``x + attn(norm(x))``, then ``x + swiglu(norm(x))``."""

from __future__ import annotations

import torch
from torch import nn

from nsa.config import ModelConfig, NSAConfig
from nsa.model.attention import NSAAttention
from nsa.model.dense import DenseAttention
from nsa.model.diagnostics import ScorerParams
from nsa.model.gates import GateParams
from nsa.model.norm import RMSNorm, SwiGLU


def make_attention(
    model_cfg: ModelConfig, nsa_cfg: NSAConfig, backend: str | None = None, layer: int = 0,
    scorer: ScorerParams | None = None,
) -> NSAAttention | DenseAttention:
    """Block ``layer``'s attention: ``NSAAttention`` (with the selection losses ``scorer``), or
    ``DenseAttention`` for a dense model (``model.attention = dense``) and the layers of
    ``model.dense_layers``."""
    m = model_cfg
    if m.layer_attention(layer) == "dense":
        return DenseAttention(m.dim, m.n_heads, m.n_kv_groups, m.d_k, m.d_v, rope_theta=m.rope_theta)
    n = nsa_cfg
    return NSAAttention(m.dim, m.n_heads, m.n_kv_groups, m.d_k, m.d_v, n.params(), GateParams.of_config(n),
                        phi=n.phi, shared_kv=n.shared_kv, rope_theta=m.rope_theta, backend=backend,
                        window_query=n.window_query, kv_speed=n.kv_speed, scorer=scorer)


class Block(nn.Module):
    """Pre-norm decoder block with NSA or dense attention and a SwiGLU MLP."""

    def __init__(self, model_cfg: ModelConfig, nsa_cfg: NSAConfig, backend: str | None = None, layer: int = 0,
                 scorer: ScorerParams | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(model_cfg.dim, model_cfg.norm_eps)
        self.attn: NSAAttention | DenseAttention = make_attention(model_cfg, nsa_cfg, backend, layer, scorer)
        self.mlp_norm = RMSNorm(model_cfg.dim, model_cfg.norm_eps)
        self.mlp = SwiGLU(model_cfg.dim, model_cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))
