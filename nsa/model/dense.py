"""``DenseAttention``: the full-attention baseline (GQA + RoPE + SDPA), same interface as NSA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nsa.model import documents
from nsa.model.cache import DenseLayerCache, ModelCache, NSALayerCache
from nsa.model.context import ContextParallel
from nsa.model.rope import RotaryEmbedding
from nsa.ops import chunk_attention

_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
             attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA on ``[B, heads, S, D]`` with ``k/v`` having fewer heads (GQA); repeats k/v when needed.

    ``is_causal`` is only for square ``q``/``k`` (SDPA aligns the causal mask top-left).
    """
    h = q.shape[1] // k.shape[1]
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError("is_causal needs as many queries as keys; pass an explicit mask instead")
    if h == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if _HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              enable_gqa=True)
    k, v = k.repeat_interleave(h, dim=1), v.repeat_interleave(h, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of ``[B, S, heads, D]`` tensors, ``[B, S, HQ, Dv]`` out."""
    return sdpa_gqa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


class DenseAttention(nn.Module):
    """Causal softmax attention over all past positions: ``forward(x [B, S, dim]) -> [B, S, dim]``."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int, rope_theta: float = 10000.0
    ) -> None:
        super().__init__()
        if n_heads % n_kv_groups:
            raise ValueError(f"model.n_kv_groups={n_kv_groups} must divide model.n_heads={n_heads}")
        self.dim, self.n_heads, self.n_kv_groups, self.d_k, self.d_v = dim, n_heads, n_kv_groups, d_k, d_v
        self.q_proj = nn.Linear(dim, n_heads * d_k, bias=False)
        self.kv_proj = nn.Linear(dim, n_kv_groups * (d_k + d_v), bias=False)
        self.o_proj = nn.Linear(n_heads * d_v, dim, bias=False)
        self.rope = RotaryEmbedding(d_k, rope_theta)
        self.context: ContextParallel | None = None  # set by NSALM.set_context_parallel

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
        """``q [B, S, HQ, Dk]``, ``k [B, S, H, Dk]`` (RoPE'd at ``positions``), ``v [B, S, H, Dv]``."""
        B, S, _ = x.shape
        H = self.n_kv_groups
        q_lin = self.q_proj(x)
        ang = self.rope.angles(positions, q_lin)  # once for q and k
        q = self.rope(q_lin.view(B, S, self.n_heads, self.d_k), positions, ang)
        kv = self.kv_proj(x)
        k = self.rope(kv[..., : H * self.d_k].reshape(B, S, H, self.d_k), positions, ang)
        v = kv[..., H * self.d_k :].reshape(B, S, H, self.d_v)
        return q, k, v

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S, dim]`` -> ``[B, S, dim]``; ``cu_seqlens``: packed documents (:mod:`nsa.model.documents`).
        Under context parallelism (``self.context``) ``x`` holds this rank's rows of the sequence."""
        if self.context is not None:
            return self._forward_context(x, self.context, cu_seqlens)
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device) if cu_seqlens is None else documents.positions(cu_seqlens, B,
            S)
        q, k, v = self.project(x, pos)
        if cu_seqlens is None:
            o = _causal(q, k, v)
        else:
            (o,) = documents.attend(_causal, [q, k, v], cu_seqlens)
        return self.o_proj(o.reshape(B, S, self.n_heads * self.d_v))

    def _forward_context(self, x: torch.Tensor, cp: ContextParallel,
                         cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows (:mod:`nsa.model.context`): keys and values of the whole sequence gathered, each
        chunk attending to the prefix that ends with it (:func:`nsa.ops.chunk_attention.causal_at` where a
        library kernel runs it, else an explicit mask: SDPA's causal mask is top-left); with packed documents
        (``cu_seqlens`` of the whole batch) to that prefix of its own document (the mask)."""
        B, S_local, _ = x.shape
        S = S_local * cp.size
        mine = cp.positions(S, x.device)
        whole = None if cu_seqlens is None else documents.positions(cu_seqlens, B, S)
        q, k, v = self.project(x, mine if whole is None else whole[:, mine])
        k, v = cp.gather(k), cp.gather(v)
        doc = None if whole is None else torch.cumsum(whole == 0, dim=1)  # [B, S]: each position's document
        outs = []
        for i, (start, stop) in enumerate(cp.chunks(S)):
            qc = q[:, i * (S_local // 2):(i + 1) * (S_local // 2)]
            kc, vc = k[:, :stop].transpose(1, 2), v[:, :stop].transpose(1, 2)
            impl = None if doc is not None else chunk_attention.library_impl(qc, kc, vc)
            if impl is not None:  # the prefix and the chunk's own square by the library, merged
                o_c = chunk_attention.causal_at(qc.transpose(1, 2), kc, vc, start, impl)
                outs.append(o_c.transpose(1, 2))
                continue
            keys = torch.arange(stop, device=x.device)
            mask = keys[None, :] <= torch.arange(start, stop, device=x.device)[:, None]
            if doc is not None:  # [B, 1, chunk, keys]: the same document only
                mask = (mask & (doc[:, start:stop, None] == doc[:, None, :stop]))[:, None]
            outs.append(sdpa_gqa(qc.transpose(1, 2), kc, vc, attn_mask=mask).transpose(1, 2))
        o = torch.cat(outs, dim=1)
        return self.o_proj(o.reshape(B, S_local, self.n_heads * self.d_v))

    # decode with a plain KV cache (nsa.model.cache.DenseLayerCache)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype) -> DenseLayerCache:
        return DenseLayerCache.empty(batch_size, self.n_kv_groups, self.d_k, self.d_v, max_len, device=device,
                                     dtype=dtype)

    def prefill(self, x: torch.Tensor, layer: NSALayerCache | DenseLayerCache,
                cache: ModelCache) -> torch.Tensor:
        """Causal forward over ``x [B, P, dim]`` that also stores K/V at positions ``0 .. P-1``."""
        assert isinstance(layer, DenseLayerCache)
        B, S, _ = x.shape
        q, k, v = self.project(x, torch.arange(S, device=x.device))
        layer.k[:, :, :S] = k.transpose(1, 2)
        layer.v[:, :, :S] = v.transpose(1, 2)
        o = _causal(q, k, v)
        return self.o_proj(o.reshape(B, S, self.n_heads * self.d_v))

    def decode(self, x: torch.Tensor, layer: NSALayerCache | DenseLayerCache,
               cache: ModelCache) -> torch.Tensor:
        """One query per sequence at ``cache.lengths`` over cached positions ``<= t`` (explicit mask)."""
        assert isinstance(layer, DenseLayerCache)
        if not torch.compiler.is_compiling():  # a host check; decode_step makes it too
            cache.check_room()
        B = x.shape[0]
        t = cache.lengths
        q, k, v = self.project(x, t[:, None])
        ar = torch.arange(B, device=x.device)
        layer.k[ar, :, t] = k[:, 0]
        layer.v[ar, :, t] = v[:, 0]
        # keys beyond the longest sequence are never needed; a static cache keeps one shape for graphs
        n = cache.max_len if cache.static else cache.host_len + 1
        mask = torch.arange(n, device=x.device)[None, :] <= t[:, None]  # [B, n]
        o = sdpa_gqa(q.transpose(1, 2), layer.k[:, :, :n], layer.v[:, :, :n],
                     attn_mask=mask[:, None, None, :])
        reads = (t + 1)[:, None].expand(B, self.n_kv_groups)
        layer.last_reads = reads
        cache.reads_total += reads.sum(dim=-1)
        return self.o_proj(o.transpose(1, 2).reshape(B, 1, self.n_heads * self.d_v))

    def consume_stats(self) -> dict[str, float | list[float]]:
        return {}

    def take_stat_sums(self) -> torch.Tensor | None:
        return None

    def extra_repr(self) -> str:
        return f"heads={self.n_heads}, kv_groups={self.n_kv_groups}, d_k={self.d_k}, d_v={self.d_v}"
