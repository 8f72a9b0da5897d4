"""A Native Sparse Attention language model for Hugging Face ``transformers`` (written by ``nsa export
--format hf``).

This file is copied next to the weights and loaded with ``trust_remote_code=True``::

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    out = model.generate(ids, max_new_tokens=64)

It imports only ``torch`` and ``transformers`` (and the ``nsa`` package when it is importable):

- ``nsa_impl="auto"`` (the default): the ``nsa`` package's layer (its kernels: Triton on CUDA) and its decode
  caches (compressed, selected, window) when ``nsa`` is importable, so ``generate`` decodes as fast as
  ``nsa sample`` and greedy output is identical; otherwise the standalone torch implementation below, with a
  warning (slow: every branch is a dense masked attention, and decoding keeps the raw keys and values of each
  sequence and recomputes the compressed stream each step).
- ``nsa_impl="package"``: the ``nsa`` package or an error; ``nsa_impl="standalone"``: never the package.
  Pass either to ``from_pretrained(..., nsa_impl=...)``.

The standalone implementation follows the ``nsa`` project's contract (docs/nsa-semantics.md): compressed
branch over visible compressed tokens only (zero where none is), block importance from the compressed
probabilities (overlap / l, summed over the heads of a group), forced blocks (current, initial, previous)
then the highest scores with ties to the lower index, selected branch over the chosen blocks' positions
<= t, window of ``w`` positions, outputs mixed by the gates (cmp, sel, win). ``window_query``: the window
branch attends with queries of its own projection (``q_win_proj``); the other branches and the block choice
keep
``q_proj``'s. ``kv_speed``: the weights hold ``kv_proj``'s compressed and selected rows (its first two thirds)
divided by ``kv_speed``; the layer multiplies them back (``kv_weight``).

Conventions that differ from ``nsa``'s own model: ``labels`` are shifted inside (transformers' rule);
a plain ``model(ids)`` builds no cache (pass ``use_cache=True`` for one); beam search decodes without a
cache (correct, slower).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:  # the nsa package, when installed: its layers and decode caches
    from nsa.model.attention import NSAAttention as _PkgNSAAttention
    from nsa.model.cache import ModelCache as _PkgModelCache
    from nsa.model.dense import DenseAttention as _PkgDenseAttention
    from nsa.model.gates import GateParams as _PkgGateParams
    from nsa.ops import NSAParams as _PkgNSAParams

    _PKG_ERROR: str | None = None
except ImportError as _exc:  # a machine without nsa: the standalone torch implementation below
    _PKG_ERROR = f"{type(_exc).__name__}: {_exc}"

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of config.json's NSA fields and the weight names; nsa.hf.format.FORMAT_VERSION
IMPLEMENTATIONS = ("auto", "package", "standalone")

# transformers renamed `past_key_values` to `cache` (5.x): the output field and generate's keyword follow it
_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
_CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"
_GENERATE_CACHE_KWARG = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


class NSAConfig(PretrainedConfig):
    """The model (LLaMA-style decoder) and its NSA hyper-parameters.

    ``nsa`` holds ``l, d, l_sel, n_sel, w, phi, gate, shared_kv, gate_hidden, gate_bias, gate_scale,
    fixed_gates, window_query, kv_speed`` (a config.json written before the last two existed has the paper's
    layer: ``window_query=False, kv_speed=1.0``, the defaults here); ``attention`` is ``nsa`` or ``dense``,
    and
    ``dense_layers`` the layers of an NSA model that attend densely (none: every layer NSA);
    ``nsa_impl`` picks the implementation (module docstring); ``nsa_ops_backend`` is passed to the ``nsa``
    package's layers (its ``runtime.attn_backend``).
    """

    model_type = "nsa"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # noqa: RUF012 (transformers' attribute)

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        num_key_value_heads: int = 2,
        head_dim: int = 64,
        v_head_dim: int = 64,
        intermediate_size: int = 3072,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 65536,
        attention: str = "nsa",
        dense_layers: list[int] | None = None,
        nsa: dict[str, Any] | None = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        nsa_impl: str = "auto",
        nsa_ops_backend: str = "auto",
        nsa_format_version: int = FORMAT_VERSION,
        **kwargs: Any,
    ) -> None:
        if nsa_format_version != FORMAT_VERSION:
            raise ValueError(f"config.json is NSA format version {nsa_format_version}; this modelling code "
                             f"reads version {FORMAT_VERSION} (export the run again with this nsa version)")
        if nsa_impl not in IMPLEMENTATIONS:
            raise ValueError(f"nsa_impl={nsa_impl!r} must be one of {', '.join(IMPLEMENTATIONS)}")
        if attention not in ("nsa", "dense"):
            raise ValueError(f"attention={attention!r} must be 'nsa' or 'dense'")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.attention = attention
        self.dense_layers = sorted(int(i) for i in dense_layers or ())
        defaults = {"l": 32, "d": 16, "l_sel": 64, "n_sel": 16, "w": 512, "phi": "avg", "gate": "sigmoid",
                    "shared_kv": False, "gate_hidden": None, "gate_bias": [-2.0, -2.0, 2.0],
                    "gate_scale": 0.1, "fixed_gates": None, "window_query": False, "kv_speed": 1.0}
        self.nsa = {**defaults, **(nsa or {})}
        self.initializer_range = initializer_range
        self.nsa_impl = nsa_impl
        self.nsa_ops_backend = nsa_ops_backend
        self.nsa_format_version = nsa_format_version
        kwargs["tie_word_embeddings"] = tie_word_embeddings
        super().__init__(**kwargs)


# ----------------------------------------------------------------------------------------------------------
# shared pieces (the same arithmetic as the nsa package's model, so both paths agree to the bit)


class NSARMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalised in float32 and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class NSAMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half) of ``x [B, S, H, D]`` at ``positions`` (``[S]`` or ``[B, S]``),
    float32."""
    D = x.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = theta ** (-(torch.arange(0, D, 2, dtype=dtype, device=x.device) / D))
    freqs = positions.to(dtype)[..., None] * inv
    if freqs.dim() == 2:
        freqs = freqs[None]
    cos, sin = freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]
    xf = x.to(dtype)
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where ``mask``; rows without any key give zeros (never NaN)."""
    if scores.shape[-1] == 0:
        return scores
    s = scores.float().masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * mask
    den = e.sum(dim=-1, keepdim=True)
    return torch.where(den > 0, e / den.clamp_min(1e-30), torch.zeros_like(e)).to(scores.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """``q [Sq, H, h, Dk]`` over ``k/v [T, H, D]`` where ``mask [Sq, H|1, 1, T]``: ``[Sq, H, h, Dv]``."""
    p = _masked_softmax(torch.einsum("qgik,tgk->qgit", q, k) * scale, mask)
    return torch.einsum("qgit,tgv->qgiv", p, v)


def nsa_reference(q: torch.Tensor, q_pos: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                  k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                  gates: torch.Tensor, *, l: int, d: int, l_sel: int, n_sel: int, w: int,  # noqa: E741
                  scale: float, q_win: torch.Tensor | None = None) -> torch.Tensor:
    """NSA for one sequence: queries ``q [Sq, HQ, Dk]`` at positions ``q_pos [Sq]`` over raw keys/values
    ``[T, H, D]`` (positions ``0 .. T-1``) and the compressed stream ``[C, H, D]``; gates ``[Sq, HQ, 3]``
    (cmp, sel, win) -> ``[Sq, HQ, Dv]``. Query head ``i`` belongs to group ``i // (HQ // H)``. ``q_win``: the
    window branch's own queries (``q``'s shape); ``None``: ``q``."""
    Sq, HQ, Dk = q.shape
    T, H, Dv = v_sel.shape
    h = HQ // H
    qg = q.view(Sq, H, h, Dk)
    t = q_pos.to(torch.int64)[:, None]  # [Sq, 1]
    pos = torch.arange(T, device=q.device)[None, :]  # [1, T]

    # compressed branch: token j is visible to t iff j*d + l - 1 <= t
    C = k_cmp.shape[0]
    j = torch.arange(C, device=q.device)
    vis = ((j * d + l - 1)[None, :] <= t)[:, None, None, :]  # [Sq, 1, 1, C]
    p_cmp = _masked_softmax(torch.einsum("qgik,cgk->qgic", qg, k_cmp) * scale, vis)  # [Sq, H, h, C]
    o_cmp = torch.einsum("qgic,cgv->qgiv", p_cmp, v_cmp)

    # block importance: p_slc(b) = sum_j p_cmp(j) * overlap(j, b) / l, summed over the heads of a group
    nb = -(-T // l_sel)
    b = torch.arange(nb, device=q.device)
    lo = torch.maximum((j * d)[:, None], (b * l_sel)[None, :])
    hi = torch.minimum((j * d + l)[:, None], ((b + 1) * l_sel)[None, :])
    overlap = (hi - lo).clamp(min=0).to(p_cmp.dtype)  # [C, nb]
    P = torch.einsum("qgic,cb->qgb", p_cmp, overlap) / l  # [Sq, H, nb]

    # top-n: candidates b <= t // l_sel; forced current, initial, previous first; then score, ties to lower b
    bt = t // l_sel  # [Sq, 1]
    cand = b[None, :] <= bt
    pri = torch.zeros(Sq, nb, dtype=torch.int64, device=q.device)
    pri = torch.where((b[None, :] == bt - 1) & (bt >= 1), 1, pri)
    pri = torch.where(b[None, :] == 0, 2, pri)
    pri = torch.where(b[None, :] == bt, 3, pri)
    pri = torch.where(cand, pri, -1)[:, None, :].expand(Sq, H, nb)
    by_score = torch.argsort(-P, dim=-1, stable=True)
    order = torch.gather(by_score, -1, torch.argsort(-torch.gather(pri, -1, by_score), dim=-1, stable=True))
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(nb, device=q.device).expand_as(order))
    chosen = (rank < torch.clamp(bt + 1, max=n_sel)[:, :, None]) & cand[:, None, :]  # [Sq, H, nb]
    sel_mask = (torch.gather(chosen, -1, (pos // l_sel).expand(Sq, T)[:, None, :].expand(Sq, H, T))
                & (pos <= t)[:, None, :])[:, :, None, :]  # [Sq, H, 1, T]
    o_sel = _attend(qg, k_sel, v_sel, sel_mask, scale)

    win_mask = ((pos <= t) & (pos > t - w))[:, None, None, :]
    o_win = _attend(qg if q_win is None else q_win.view(Sq, H, h, Dk), k_win, v_win, win_mask, scale)

    g = gates.view(Sq, H, h, 3).to(o_cmp.dtype)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    return o.reshape(Sq, HQ, Dv)


class BlockMLP(nn.Module):
    """phi = MLP over one compression block: ``(block + pos).flatten() -> fc1 -> SiLU -> fc2``."""

    def __init__(self, l: int, dim: int) -> None:  # noqa: E741
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(l, dim))
        self.fc1 = nn.Linear(l * dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1((blocks + self.pos.to(blocks.dtype)).flatten(-2))))


class Compressor(nn.Module):
    """phi of keys and values: mean pooling (``avg``) or ``BlockMLP`` (``mlp``), over ``[T, H, D]`` rows."""

    def __init__(self, phi: str, l: int, d: int, d_k: int, d_v: int) -> None:  # noqa: E741
        super().__init__()
        self.phi, self.l, self.d = phi, l, d
        self.mlp_k = BlockMLP(l, d_k) if phi == "mlp" else None
        self.mlp_v = BlockMLP(l, d_v) if phi == "mlp" else None

    def forward(self, x: torch.Tensor, mlp: BlockMLP | None) -> torch.Tensor:
        T, H, D = x.shape
        if self.l > T:
            return x.new_zeros(0, H, D)
        blocks = x.unfold(0, self.l, self.d)  # [C, H, D, l]
        return blocks.mean(dim=-1) if mlp is None else mlp(blocks.transpose(-1, -2))


class StandaloneNSAAttention(nn.Module):
    """The NSA layer in plain torch (the parameters of the nsa package's ``NSAAttention``, same names):
    ``q_win_proj`` with ``window_query``; ``kv_proj`` holds the stored weights (``kv_weight``: as used)."""

    def __init__(self, config: NSAConfig) -> None:
        super().__init__()
        c, n = config, config.nsa
        self.n_heads, self.n_kv, self.d_k, self.d_v = (c.num_attention_heads, c.num_key_value_heads,
                                                       c.head_dim,
                                                      c.v_head_dim)
        self.hp = {k: int(n[k]) for k in ("l", "d", "l_sel", "n_sel", "w")}
        self.gate, self.theta, self.scale = n["gate"], float(c.rope_theta), c.head_dim ** -0.5
        self.n_branches = 1 if n["shared_kv"] else 3
        self.gate_bias = tuple(float(v) for v in n["gate_bias"])
        self.gate_scale = float(n["gate_scale"])
        self.fixed_gates = None if n["fixed_gates"] is None else tuple(float(v) for v in n["fixed_gates"])
        dim = c.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.d_k, bias=False)
        self.kv_proj = nn.Linear(dim, self.n_branches * self.n_kv * (self.d_k + self.d_v), bias=False)
        self.compress = Compressor(n["phi"], self.hp["l"], self.hp["d"], self.d_k, self.d_v)
        gh = n["gate_hidden"] or max(1, dim // 4)
        self.gate_mlp = nn.Sequential(nn.Linear(dim, gh), nn.SiLU(), nn.Linear(gh, self.n_heads * 3))
        self.o_proj = nn.Linear(self.n_heads * self.d_v, dim, bias=False)
        self.q_win_proj = nn.Linear(dim, self.n_heads * self.d_k, bias=False) if n["window_query"] else None
        self.kv_speed = 1.0 if n["shared_kv"] else float(n["kv_speed"])

    def kv_weight(self) -> torch.Tensor:
        """``kv_proj``'s weight as the layer uses it: the compressed and selected rows (the first two thirds)
        times ``kv_speed`` (the package's ``NSAAttention.kv_weight``, the same product)."""
        w = self.kv_proj.weight
        if self.kv_speed == 1.0:
            return w
        rows = self.n_kv * (self.d_k + self.d_v)
        gain = torch.tensor([self.kv_speed] * (2 * rows) + [1.0] * rows, device=w.device)[:, None]
        return w * gain.to(w.dtype)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Queries (``q``; ``qw``: the window's, with ``window_query``), the three branches' raw K/V (keys
        rotated) and activated gates of ``x [B, S, dim]``."""
        B, S, _ = x.shape
        H, Dk, Dv = self.n_kv, self.d_k, self.d_v
        q = rope(self.q_proj(x).view(B, S, self.n_heads, Dk), positions, self.theta)
        kv = F.linear(x, self.kv_weight()).view(B, S, self.n_branches, H * (Dk + Dv))
        ks = [rope(kv[:, :, i, : H * Dk].reshape(B, S, H, Dk), positions, self.theta)
              for i in range(self.n_branches)]
        vs = [kv[:, :, i, H * Dk:].reshape(B, S, H, Dv) for i in range(self.n_branches)]
        if self.n_branches == 1:
            ks, vs = ks * 3, vs * 3
        if self.fixed_gates is not None:
            gates = torch.tensor(self.fixed_gates, device=x.device, dtype=q.dtype).expand(B, S, self.n_heads,
                                                                                          3)
        else:
            offset = torch.tensor(self.gate_bias, device=x.device, dtype=x.dtype).repeat(self.n_heads)
            g = (offset + self.gate_scale * self.gate_mlp(x)).view(B, S, self.n_heads, 3)
            gates = torch.sigmoid(g) if self.gate == "sigmoid" else torch.softmax(g, dim=-1)
        out = {"q": q, "kc": ks[0], "vc": vs[0], "ks": ks[1], "vs": vs[1], "kw": ks[2], "vw": vs[2],
               "gates": gates}
        if self.q_win_proj is not None:
            out["qw"] = rope(self.q_win_proj(x).view(B, S, self.n_heads, Dk), positions, self.theta)
        return out

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, gates: torch.Tensor, raw: dict[str, torch.Tensor],
               q_win: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: ``q [Sq, HQ, Dk]`` (``q_win``: the window's, same shape) at ``q_pos`` over its raw
        rows
        ``raw[name] [T, H, D]`` -> ``[Sq, HQ*Dv]``."""
        k_cmp = self.compress(raw["kc"], self.compress.mlp_k)
        v_cmp = self.compress(raw["vc"], self.compress.mlp_v)
        o = nsa_reference(q, q_pos, k_cmp, v_cmp, raw["ks"], raw["vs"], raw["kw"], raw["vw"], gates,
                          scale=self.scale, q_win=q_win, **self.hp)
        return o.reshape(q.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device)
        p = self.project(x, pos)
        q_win = p.get("qw")
        rows = [self.attend(p["q"][b], pos, p["gates"][b], {k: v[b] for k, v in p.items()},
                            None if q_win is None else q_win[b]) for b in range(B)]
        return self.o_proj(torch.stack(rows))


class StandaloneDenseAttention(nn.Module):
    """Causal softmax attention with GQA and RoPE (the nsa package's ``DenseAttention``, same names)."""

    def __init__(self, config: NSAConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.d_k, self.d_v = (c.num_attention_heads, c.num_key_value_heads,
                                                       c.head_dim,
                                                      c.v_head_dim)
        self.theta, self.scale = float(c.rope_theta), c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.d_k, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, self.n_kv * (self.d_k + self.d_v), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.d_v, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        B, S, _ = x.shape
        H = self.n_kv
        q = rope(self.q_proj(x).view(B, S, self.n_heads, self.d_k), positions, self.theta)
        kv = self.kv_proj(x)
        k = rope(kv[..., : H * self.d_k].reshape(B, S, H, self.d_k), positions, self.theta)
        v = kv[..., H * self.d_k:].reshape(B, S, H, self.d_v)
        return {"q": q, "k": k, "v": v}

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, gates: Any, raw: dict[str, torch.Tensor],
               q_win: torch.Tensor | None = None) -> torch.Tensor:
        Sq, HQ, Dk = q.shape
        T = raw["k"].shape[0]
        mask = (torch.arange(T, device=q.device)[None, :] <= q_pos[:, None])[:, None, None, :]
        o = _attend(q.view(Sq, self.n_kv, HQ // self.n_kv, Dk), raw["k"], raw["v"], mask, self.scale)
        return o.reshape(Sq, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device)
        p = self.project(x, pos)
        return self.o_proj(torch.stack([self.attend(p["q"][b], pos, None, {k: v[b] for k, v in p.items()})
                                        for b in range(B)]))


def _triple(values: Any) -> tuple[float, float, float]:
    a, b, c = (float(v) for v in values)
    return a, b, c


def _dense_layer(config: NSAConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` attends densely (a dense model, or one of ``dense_layers``)."""
    return config.attention == "dense" or layer in config.dense_layers


def _package_attention(config: NSAConfig, layer: int) -> nn.Module:
    """The nsa package's attention of decoder layer ``layer`` (same parameter names as the standalone one)."""
    c, n = config, config.nsa
    backend = None if c.nsa_ops_backend == "auto" else c.nsa_ops_backend
    if _dense_layer(c, layer):
        return _PkgDenseAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                  c.v_head_dim, rope_theta=c.rope_theta)
    hp = _PkgNSAParams(l=int(n["l"]), d=int(n["d"]), l_sel=int(n["l_sel"]), n_sel=int(n["n_sel"]),
                       w=int(n["w"]))
    fixed = None if n["fixed_gates"] is None else _triple(n["fixed_gates"])
    gates = _PkgGateParams(kind=n["gate"], hidden=n["gate_hidden"], bias=_triple(n["gate_bias"]),
                           scale=float(n["gate_scale"]), fixed=fixed)
    return _PkgNSAAttention(
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.v_head_dim, hp, gates,
        phi=n["phi"], shared_kv=bool(n["shared_kv"]), rope_theta=c.rope_theta, backend=backend,
        window_query=bool(n["window_query"]), kv_speed=float(n["kv_speed"]),
    )


def _standalone_attention(config: NSAConfig, layer: int) -> nn.Module:
    return StandaloneDenseAttention(config) if _dense_layer(config, layer) else StandaloneNSAAttention(config)


def _use_package(config: NSAConfig) -> bool:
    """Whether to build the nsa package's layers (``nsa_impl``); says so when the package is missing."""
    if config.nsa_impl == "standalone":
        return False
    if _PKG_ERROR is None:
        return True
    if config.nsa_impl == "package":
        raise ImportError(f"nsa_impl='package' but the nsa package is not importable ({_PKG_ERROR})")
    logger.warning("the nsa package is not importable (%s): using the standalone torch implementation of "
                   "NSA, which is correct but slow (install nsa for its kernels and decode caches)",
                   _PKG_ERROR)
    return False


class NSADecoderLayer(nn.Module):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``x +
    mlp(post_attention_layernorm(x))``."""

    def __init__(self, config: NSAConfig, package: bool, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = NSARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _package_attention(config, layer) if package else _standalone_attention(config,
            layer)
        self.post_attention_layernorm = NSARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = NSAMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _real_span(mask_row: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` of the one run of ones in an attention-mask row (left or right padding)."""
    idx = torch.nonzero(mask_row, as_tuple=False).flatten().tolist()
    if not idx or idx[-1] - idx[0] + 1 != len(idx):
        raise ValueError("attention_mask rows must hold one contiguous run of ones (left or right padding)")
    return idx[0], idx[-1] + 1


class NSAPreTrainedModel(PreTrainedModel):
    config_class = NSAConfig
    base_model_prefix = "model"
    _no_split_modules = ["NSADecoderLayer"]  # noqa: RUF012 (transformers' attribute)
    supports_gradient_checkpointing = False
    _supports_cache_class = True  # transformers 4.x: a Cache instance is accepted by generate

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """transformers' own caches do not fit NSA: ``generate`` gets ours (:class:`NSACache`)."""
        return False

    def _init_weights(self, module: Any) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, BlockMLP) or type(module).__name__ == "BlockMLP":
            nn.init.normal_(module.pos, mean=0.0, std=std)
        elif isinstance(module, NSARMSNorm):
            nn.init.ones_(module.weight)
        _reset_buffers(module)


def _reset_buffers(module: Any) -> None:
    """The nsa package layer's constant buffers (``gate_offset``, ``kv_gain``), on its weights' device and in
    their dtype (as ``.to()`` leaves them in the nsa model). They are not in the weights: a model built on the
    meta device, as transformers 5 does, gets them uninitialised."""
    gain = getattr(module, "kv_gain", None)
    if isinstance(gain, torch.Tensor) and hasattr(module, "kv_row_gain"):
        w = module.kv_proj.weight
        module.kv_gain = module.kv_row_gain(module.kv_speed).to(device=w.device, dtype=w.dtype)
    offset = getattr(module, "gate_offset", None)
    if not isinstance(offset, torch.Tensor) or not hasattr(module, "gate_bias"):
        return
    p = next(module.parameters())
    module.gate_offset = torch.tensor(module.gate_bias, dtype=p.dtype, device=p.device).repeat(module.n_heads)
    diag = getattr(module, "diag", None)
    if diag is not None:  # the layer's diagnostics (running sums, scorer weight) follow it
        diag.follow(p.device, p.dtype)


class NSAModel(NSAPreTrainedModel):
    """Embedding, decoder layers, final norm: ``last_hidden_state [B, S, dim]``."""

    def __init__(self, config: NSAConfig) -> None:
        super().__init__(config)
        self.uses_nsa_package = _use_package(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NSADecoderLayer(config, self.uses_nsa_package, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = NSARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: Any) -> None:
        self.embed_tokens = value

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states of unpadded sequences ``[B, S]`` (positions ``0 .. S-1``)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> BaseModelOutputWithPast:
        """Each row's real tokens (the ones of ``attention_mask``, one contiguous run) start at position 0;
        padded positions get zeros."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("NSA models take input_ids (inputs_embeds is not supported)")
        if attention_mask is None or bool(attention_mask.bool().all()):
            return BaseModelOutputWithPast(last_hidden_state=self.hidden(input_ids))
        out = torch.zeros(*input_ids.shape, self.config.hidden_size, device=input_ids.device,
                          dtype=self.embed_tokens.weight.dtype)
        for b in range(input_ids.shape[0]):
            lo, hi = _real_span(attention_mask[b])
            out[b, lo:hi] = self.hidden(input_ids[b:b + 1, lo:hi])[0]
        return BaseModelOutputWithPast(last_hidden_state=out)


class NSAForCausalLM(NSAPreTrainedModel, GenerationMixin):
    """The NSA language model: ``forward(input_ids, attention_mask, labels, cache) -> logits (, loss)``;
    ``generate`` decodes with :class:`NSACache` (the nsa package's decode caches when it is used)."""

    _tied_weights_keys = ({"lm_head.weight": "model.embed_tokens.weight"} if _TRANSFORMERS_MAJOR
                          >= 5  # type: ignore[assignment]
                          else ["lm_head.weight"])

    def __init__(self, config: NSAConfig) -> None:
        super().__init__(config)
        self.model = NSAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def uses_nsa_package(self) -> bool:
        """True when the layers and decode caches are the nsa package's, False for the standalone torch
        path."""
        return bool(self.model.uses_nsa_package)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        for module in model.modules():
            _reset_buffers(module)
        return loaded

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: Any) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Any = None, cache: Any = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, inputs_embeds: torch.Tensor | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> Any:
        """Logits ``[B, S, V]``; ``loss`` (mean cross-entropy of ``labels`` shifted by one, ``-100`` ignored)
        when ``labels`` are given. With a cache (``generate`` passes one; ``use_cache=True`` makes one)
        the first call fills it from the prompt and later calls append their tokens."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("NSA models take input_ids (inputs_embeds is not supported)")
        state = cache if cache is not None else past_key_values
        if not isinstance(state, NSACache):
            state = NSACache(self) if use_cache is True else None
        if state is None:
            logits = self.lm_head(self.model(input_ids, attention_mask).last_hidden_state)
        else:
            logits = state.step(input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: state})
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: Any = None,
                                      attention_mask: torch.Tensor | None = None, cache: Any = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """The columns the cache has not seen yet (all of them without a cache)."""
        state = cache if cache is not None else past_key_values
        if isinstance(state, NSACache) and state.seen:
            input_ids = input_ids[:, state.seen:]
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                                  "use_cache": kwargs.get("use_cache")}
        if isinstance(state, NSACache):
            inputs["cache"] = state
        return inputs

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None,
                 **kwargs: Any) -> Any:
        """transformers' ``generate`` with an :class:`NSACache` sized for the prompt and ``max_new_tokens``
        (beam search: no cache, every step recomputed)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        gc = generation_config if generation_config is not None else self.generation_config

        def setting(name: str, default: Any) -> Any:
            value = kwargs.get(name, getattr(gc, name, default))
            return default if value is None else value

        given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if not given and setting("use_cache", True) and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            if setting("num_beams", 1) > 1:
                logger.warning("beam search with an NSA model decodes without a cache (every step "
                               "recomputed)")
                kwargs["use_cache"] = False
            else:
                new = setting("max_new_tokens", None)
                length = ids.shape[1] + new if new is not None else setting("max_length", ids.shape[1] + 20)
                kwargs[_GENERATE_CACHE_KWARG] = NSACache(self, max_len=int(length))
        return super().generate(inputs, generation_config, **kwargs)


class NSACache(Cache):
    """Decode state of an :class:`NSAForCausalLM` for ``generate``.

    With the nsa package: its ``ModelCache`` (raw selection K/V, window ring, compression ring and the
    compressed stream per layer), filled by one prefill and extended by one decode step per token, exactly as
    ``nsa sample`` does. Without it: each sequence's raw keys and values per layer, the new token attending
    over them (the compressed stream recomputed each step). Left-padded prompts: each sequence keeps its own
    positions; padding is neither stored nor attended. ``seen``: columns of ``input_ids`` consumed so far.
    """

    is_compileable = False

    def __init__(self, model: NSAForCausalLM, max_len: int | None = None) -> None:
        # no Cache.__init__: its arguments changed across transformers versions and its layer list is not used
        if isinstance(self, nn.Module):  # transformers 4.4x: Cache is an nn.Module
            nn.Module.__init__(self)
        self.layers: list[Any] = []
        self.layer_class_to_replicate = None
        self.offloading = False
        object.__setattr__(self, "model", model)  # a reference, never a submodule
        self.model: NSAForCausalLM
        self.max_len = max_len
        self.seen = 0
        self.lengths: torch.Tensor | None = None  # real tokens per sequence
        self.pkg: Any = None  # nsa ModelCache
        # [B, max_len] real tokens, left-aligned (package path, to grow)
        self.history: torch.Tensor | None = None
        self.raw: list[list[dict[str, torch.Tensor]]] = []  # standalone: [layer][row] name -> [T, H, D]

    # what transformers asks of a cache
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_croppable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("NSACache does not support beam search (generate decodes it without a "
                                  "cache)")

    # decoding
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[B, n, V]`` of the ``n`` new columns: the prompt on the first call, then new tokens."""
        n = input_ids.shape[1]
        if self.seen == 0:
            logits = self._prefill(input_ids, attention_mask)
        else:
            logits = torch.stack([self._decode(input_ids[:, i]) for i in range(n)], dim=1)
        self.seen += n
        return logits

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, P = ids.shape
        if mask is None:
            lengths = torch.full((B,), P, dtype=torch.int64, device=ids.device)
        else:
            m = mask.to(ids.device).bool()
            lengths = m.sum(dim=1).to(torch.int64)
            pad = P - lengths
            if not bool(torch.equal(m, torch.arange(P, device=ids.device)[None, :] >= pad[:, None])):
                raise ValueError("attention_mask must mark left padding when generating "
                                 "(padding_side='left')")
            if int(lengths.min()) < 1:
                raise ValueError("every prompt needs at least one token")
            idx = (torch.arange(P, device=ids.device)[None, :] + pad[:, None]).clamp(max=P - 1)
            ids = torch.gather(ids, 1, idx)  # real tokens first
        self.lengths = lengths
        aligned = self._prefill_pkg(ids, lengths) if self.model.uses_nsa_package else self._prefill_raw(ids,
            lengths)
        if mask is None:
            return aligned
        # back to the caller's columns: column c of row b is its real token c - pad
        pad = P - lengths
        src = (torch.arange(P, device=ids.device)[None, :] - pad[:, None])
        out = torch.gather(aligned, 1, src.clamp(min=0)[:, :, None].expand(B, P, aligned.shape[-1]))
        return out.masked_fill((src < 0)[:, :, None], 0.0)

    def _new_pkg_cache(self, B: int, max_len: int, device: torch.device) -> Any:
        p = self.model.lm_head.weight
        layers = [layer.self_attn.new_cache(B, max_len, device, p.dtype) for layer in self.model.model.layers]
        return _PkgModelCache.of_layers(layers, max_len, B, device)

    def _prefill_pkg(self, ids: torch.Tensor, lengths: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """``NSALM.prefill`` over the HF module tree (same modules, same order of operations)."""
        B, P = ids.shape
        size = max(P, self.max_len or 0)
        if keep:
            self.max_len = size
            self.history = torch.zeros(B, size, dtype=ids.dtype, device=ids.device)
            self.history[:, :P] = ids
        mc = self.pkg = self._new_pkg_cache(B, size, ids.device)
        mc.start(lengths)
        m = self.model.model
        x = m.embed_tokens(ids)
        for layer, lc in zip(m.layers, mc.layers, strict=True):
            x = x + layer.self_attn.prefill(layer.input_layernorm(x), lc, mc)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x))

    def _grow(self) -> None:
        """A full package cache: a larger one, filled by a prefill of every sequence's tokens so far."""
        assert self.history is not None and self.lengths is not None
        size = 2 * self.pkg.max_len
        logger.warning("NSA cache full at %d positions: refilled at %d (pass max_new_tokens to size it once)",
                       self.pkg.max_len, size)
        B = self.history.shape[0]
        history = torch.zeros(B, size, dtype=self.history.dtype, device=self.history.device)
        history[:, : self.history.shape[1]] = self.history
        self.history, self.max_len = history, size
        lengths = self.pkg.lengths.clone()
        self._prefill_pkg(self.history[:, : int(lengths.max())], lengths, keep=False)

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.model.uses_nsa_package:
            return self._decode_raw(tokens)
        if self.pkg.host_len >= self.pkg.max_len:
            self._grow()
        mc = self.pkg
        assert self.history is not None
        self.history[torch.arange(tokens.shape[0], device=tokens.device), mc.lengths] = tokens
        m = self.model.model
        x = m.embed_tokens(tokens)[:, None, :]
        for layer, lc in zip(m.layers, mc.layers, strict=True):  # NSALM.decode_step's order of operations
            x = x + layer.self_attn.decode(layer.input_layernorm(x), lc, mc)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        mc.advance_device()
        logits = self.model.lm_head(m.norm(x))[:, 0]
        mc.advance_host()
        return logits

    # the standalone path: raw rows per layer and sequence
    def _layer_rows(self, attn: Any, x: torch.Tensor, q_pos: torch.Tensor, layer: int,
                    b: int) -> torch.Tensor:
        p = attn.project(x, q_pos)
        gates = p.pop("gates", None)
        q, q_win = p.pop("q"), p.pop("qw", None)  # queries are not kept: only the keys and values
        store = self.raw[layer][b]
        for k, v in p.items():
            store[k] = v[0] if k not in store else torch.cat([store[k], v[0]])
        return attn.o_proj(attn.attend(q[0], q_pos, None if gates is None else gates[0], store,
                                       None if q_win is None else q_win[0]))[None]

    def _run_raw(self, ids: torch.Tensor, q_pos: torch.Tensor, b: int) -> torch.Tensor:
        m = self.model.model
        x = m.embed_tokens(ids)
        for i, layer in enumerate(m.layers):
            x = x + self._layer_rows(layer.self_attn, layer.input_layernorm(x), q_pos, i, b)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x))[0]

    def _prefill_raw(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        B, P = ids.shape
        self.raw = [[{} for _ in range(B)] for _ in self.model.model.layers]
        out = torch.zeros(B, P, self.model.config.vocab_size, device=ids.device,
                          dtype=self.model.lm_head.weight.dtype)
        for b in range(B):
            n = int(lengths[b])
            out[b, :n] = self._run_raw(ids[b:b + 1, :n], torch.arange(n, device=ids.device), b)
        return out

    def _decode_raw(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.lengths is not None
        rows = [self._run_raw(tokens[b:b + 1, None], self.lengths[b:b + 1], b)[0]
                for b in range(tokens.shape[0])]
        self.lengths = self.lengths + 1
        return torch.stack(rows)
