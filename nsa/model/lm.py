"""``NSALM``: embedding, pre-norm blocks (NSA or dense attention), final norm and LM head."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nsa.config import ModelConfig, NSAConfig, RunConfig
from nsa.errors import NSAError
from nsa.model.attention import NSAAttention
from nsa.model.block import Block
from nsa.model.cache import ModelCache
from nsa.model.compress import BlockMLP
from nsa.model.context import ContextParallel
from nsa.model.diagnostics import ScorerParams
from nsa.model.generate import generate
from nsa.model.norm import RMSNorm
from nsa.model.stats import N_FIELDS, summarise


class LMOutput(NamedTuple):
    """``logits [B, S, V]`` and the mean cross-entropy (float32) when labels were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


def _run_block(block: Block, calls: list[int], x: torch.Tensor,
               cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Run ``block``; calls after the first are checkpoint recomputes and add no statistics."""
    calls[0] += 1
    if calls[0] > 1 and isinstance(block.attn, NSAAttention):
        with block.attn.diag.suppress():
            return block(x, cu_seqlens)
    return block(x, cu_seqlens)


def _block_decode(block: Block, x: torch.Tensor, layer: Any, cache: ModelCache) -> torch.Tensor:
    """One block's decode step (the unit ``NSALM.compile_decode`` compiles)."""
    x = x + block.attn.decode(block.attn_norm(x), layer, cache)
    return x + block.mlp(block.mlp_norm(x))


class NSALM(nn.Module):
    """Decoder-only language model; ``model_cfg.attention`` picks NSA (default) or the dense baseline, and
    ``model_cfg.dense_layers`` the blocks of an NSA model that attend densely (a hybrid stack).

    ``forward(input_ids [B, S], labels=None) -> LMOutput``. ``labels`` are the targets aligned with the
    inputs (``labels[:, t]`` is the token that should follow ``input_ids[:, t]``; no shift inside),
    ``-100`` ignored.
    """

    def __init__(self, model_cfg: ModelConfig, nsa_cfg: NSAConfig | None = None, backend: str | None = None,
                 scorer: ScorerParams | None = None) -> None:
        super().__init__()
        self.model_cfg = model_cfg
        self.nsa_cfg = nsa_cfg or NSAConfig()
        self.backend = backend
        m = model_cfg
        self.tok_emb = nn.Embedding(m.vocab_size, m.dim)
        self.blocks = nn.ModuleList(Block(m, self.nsa_cfg, backend, i, scorer) for i in range(m.n_layers))
        self.norm = RMSNorm(m.dim, m.norm_eps)
        self.head = nn.Linear(m.dim, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.gradient_checkpointing = False
        self._block_decode: Any = _block_decode
        self.apply(functools.partial(_init_weights, std=m.init_std))

    # ------------------------------------------------------------------------------------------
    # training forward

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> LMOutput:
        """Logits (and the mean loss over ``labels``, ``-100`` ignored) of ``input_ids [B, S]``.

        ``cu_seqlens``: packed documents, int32 boundaries over the flattened ``B*S`` rows including every
        row start (:func:`nsa.model.documents.from_separators`); each document attends only to itself
        and its positions restart at 0."""
        x = self.tok_emb(input_ids)
        use_ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.block_list():
            if use_ckpt:
                x = checkpoint(functools.partial(_run_block, block, [0]), x, cu_seqlens, use_reentrant=False)
            else:
                x = block(x, cu_seqlens)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            wide = logits if logits.dtype == torch.float64 else logits.float()  # never narrower than float32
            loss = F.cross_entropy(wide.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return LMOutput(logits, loss)

    def block_list(self) -> list[Block]:
        """The blocks, typed (wrappers such as FSDP keep their ``attn``/``mlp`` attributes)."""
        return cast(list[Block], list(self.blocks))

    def set_context_parallel(self, cp: ContextParallel | None) -> None:
        """Split every sequence over ``cp``'s ranks (:mod:`nsa.model.context`): ``forward`` then takes this
        rank's rows (``cp.shard(input_ids)``, same for ``labels``) and returns their logits and mean loss;
        ``None`` goes back to whole sequences. (A group of one runs the chunked arithmetic alone.)"""
        for block in self.block_list():
            block.attn.context = cp

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each block in the backward pass (``torch.utils.checkpoint``, non-reentrant)."""
        self.gradient_checkpointing = bool(enabled)

    # ------------------------------------------------------------------------------------------
    # statistics

    def consume_stats(self) -> dict[str, Any]:
        """Gate/selection statistics over all NSA layers since the last call (one device transfer).

        Keys: ``gate_entropy_mean``, ``gate_branch_shares`` ([cmp, sel, win]), ``gate_mean``,
        ``gate_collapse_fraction``, ``sel_keys_mean`` and ``gate_entropy_per_layer``; empty for the
        dense model or when no training forward ran.
        """
        sums = []
        for block in self.block_list():
            acc = block.attn.take_stat_sums()
            if acc is not None:
                sums.append(acc)
        if not sums:
            return {}
        rows = torch.stack([s.to(sums[0].device) for s in sums]).tolist()  # the one transfer
        total = [sum(r[k] for r in rows) for k in range(N_FIELDS)]
        out: dict[str, Any] = dict(summarise(total))
        if out:
            out["gate_entropy_per_layer"] = [r[0] / r[8] if r[8] > 0 else None for r in rows]
        return out

    @torch.no_grad()
    def selection_report(self, input_ids: torch.Tensor, queries: int = 64,
                         cu_seqlens: torch.Tensor | None = None) -> list[dict[str, Any]]:
        """Per NSA layer, on one forward over ``input_ids [B, S]`` (eval mode, one sequence per row, or the
        packed documents of ``cu_seqlens``: each probed on its own, merged by length):
        ``layer``, selection ``recall`` (share of dense attention mass inside the selected blocks),
        ``cmp_entropy`` (compressed attention entropy / log of its visible tokens), the scorer's ``kl``
        and the mean ``gates`` [cmp, sel, win] (:mod:`nsa.model.selection`). Empty for dense models."""
        layers = [(i, b.attn) for i, b in enumerate(self.block_list()) if isinstance(b.attn, NSAAttention)]
        if not layers:
            return []
        was_training = self.training
        self.eval()
        for _, attn in layers:
            attn.diag.arm_probe(queries)
        try:
            self(input_ids, cu_seqlens=cu_seqlens)  # through __call__: wrappers' hooks (FSDP2 gathers) run
        finally:
            reports = [{"layer": i, **attn.diag.take_probe()} for i, attn in layers]
            self.train(was_training)
        return reports

    def set_scorer(self, scorer: ScorerParams) -> None:
        """The scorer and alignment losses of every NSA layer from now on (given at construction; a schedule
        switches them off: ``scorer.until``)."""
        for block in self.block_list():
            if isinstance(block.attn, NSAAttention):
                block.attn.diag.set_scorer(scorer)

    # ------------------------------------------------------------------------------------------
    # sizes

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (shared tensors once); ``exclude_embedding`` drops the input embedding
        unless it is tied to the head (then it is a matmul and counts)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.model_cfg.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    def attended_keys_mean(self, seq_len: int, attention: str | None = None) -> float:
        """Mean number of keys one query reads over positions ``0 .. seq_len-1`` (all branches) in a layer of
        ``attention`` (``nsa`` or ``dense``; default: the model's ``model.attention``).

        NSA: ``N_c(t) + sel(t) + min(w, t+1)`` with ``sel(t) = t+1`` while all blocks fit in ``n_sel``,
        else ``(n_sel-1)*l_sel + t % l_sel + 1``; dense: ``t + 1``.
        """
        t = torch.arange(seq_len, dtype=torch.float64)
        if (attention or self.model_cfg.attention) == "dense":
            return float((t + 1).mean())
        n = self.nsa_cfg
        n_c = torch.clamp(torch.div(t + 1 - n.l, n.d, rounding_mode="floor") + 1, min=0)
        full = (t // n.l_sel) < n.n_sel
        sel = torch.where(full, t + 1, (n.n_sel - 1) * n.l_sel + torch.remainder(t, n.l_sel) + 1)
        win = torch.clamp(t + 1, max=n.w)
        return float((n_c + sel + win).mean())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) for MFU.

        ``6 * N + 6 * n_heads * (d_k + d_v) * sum over layers of K_layer(seq_len)`` where ``N`` is
        ``num_params(exclude_embedding=True)`` (every weight matmul: 2 FLOPs forward, 4 backward) and
        ``K`` is ``attended_keys_mean`` of the layer's attention: one query reads ``K`` keys per head, costing
        ``2 * d_k * K`` (scores) + ``2 * d_v * K`` (weighted values) forward, times 3 with the backward. For
        dense causal attention ``K = (S + 1) / 2``; for NSA ``K`` is about ``N_c + n_sel*l_sel + w``.
        Selection scoring and compression are not counted beyond their weights.
        """
        m = self.model_cfg
        keys = {a: self.attended_keys_mean(seq_len, a) for a in ("nsa", "dense")}
        attn = 6.0 * m.n_heads * (m.d_k + m.d_v) * sum(keys[m.layer_attention(i)] for i in range(m.n_layers))
        return 6.0 * self.num_params(exclude_embedding=True) + attn

    # ------------------------------------------------------------------------------------------
    # inference with caches (nsa.model.cache / nsa.model.generate)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> ModelCache:
        """Empty per-layer caches for ``batch_size`` sequences of up to ``max_len`` positions."""
        p = next(self.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        layers = [blk.attn.new_cache(batch_size, max_len, device, dtype) for blk in self.block_list()]
        return ModelCache.of_layers(layers, max_len, batch_size, device)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """Run ``input_ids [B, P]`` (sequence ``b`` holds ``lengths[b]`` real tokens at positions
        ``0 .. lengths[b]-1``, right padding after) and fill ``cache``; returns logits ``[B, P, V]``."""
        if input_ids.shape[1] > cache.max_len:
            raise NSAError(f"prefill of {input_ids.shape[1]} positions exceeds the cache of {cache.max_len}",
                           hint="create the cache with a larger max_len")
        cache.start(lengths)
        x = self.tok_emb(input_ids)
        for block, layer in zip(self.block_list(), cache.layers, strict=True):
            x = x + block.attn.prefill(block.attn_norm(x), layer, cache)
            x = x + block.mlp(block.mlp_norm(x))
        return self.head(self.norm(x))

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """Append one token per sequence (``tokens [B]``, at position ``cache.lengths``); logits ``[B,
        V]``."""
        cache.check_room()
        logits = self.decode_device_step(tokens, cache)
        cache.advance_host()
        return logits

    def compile_decode(self, enabled: bool = True) -> None:
        """Run each block's decode step through ``torch.compile`` (static shapes; the blocks share one
        compiled graph per cache shape), which fuses the step's many small kernels. Pair it with a static
        cache (``cache.static``, as CUDA-graph decoding uses): the dense model's step depends on the
        host-side length otherwise and would recompile as the cache grows."""
        self._block_decode = torch.compile(_block_decode, dynamic=False) if enabled else _block_decode

    @torch.no_grad()
    def decode_device_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """The device work of ``decode_step`` (no host counters): what a CUDA graph captures."""
        x = self.tok_emb(tokens)[:, None, :]
        for block, layer in zip(self.block_list(), cache.layers, strict=True):
            x = self._block_decode(block, x, layer, cache)
        cache.advance_device()
        return self.head(self.norm(x))[:, 0]

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 attention_mask: torch.Tensor | None = None, cuda_graph: bool = False) -> torch.Tensor:
        """Prompt ``[B, P]`` (left padding marked by ``attention_mask`` 0) -> ``[B, P + max_new_tokens]``.

        Greedy when ``temperature == 0``; see ``nsa.model.generate.generate``.
        """
        return generate(self, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, attention_mask=attention_mask, cuda_graph=cuda_graph)


def _init_weights(module: nn.Module, std: float) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, BlockMLP):
        nn.init.normal_(module.pos, mean=0.0, std=std)
    elif isinstance(module, NSAAttention):  # after its own layers (``apply`` visits children first)
        module.scale_fast_kv_init()


def build_model(run_cfg: RunConfig, scorer: ScorerParams | None = None) -> NSALM:
    """The model of a run config: NSA or dense (``model.attention``), ops backend from
    ``runtime.attn_backend`` (``auto`` -> the dispatcher decides per call); ``scorer``: the selection losses
    its NSA layers train with (:meth:`ScorerParams.of_config`; default off: evaluation, decoding, export)."""
    backend = run_cfg.runtime.attn_backend
    return NSALM(run_cfg.model, run_cfg.nsa, backend=None if backend == "auto" else backend, scorer=scorer)
