"""``NSAAttention``: the NSA layer of the paper (Sec. 3) around the ``nsa.ops`` functional op."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nsa.model import documents
from nsa.model.cache import DenseLayerCache, ModelCache, NSALayerCache
from nsa.model.compress import Compressor
from nsa.model.context import ContextParallel
from nsa.model.diagnostics import LayerDiagnostics, ScorerParams
from nsa.model.gates import GateParams
from nsa.model.rope import RotaryEmbedding
from nsa.model.selection import first_choice, probe_range
from nsa.ops import NSAParams, nsa_attention
from nsa.ops.decode import nsa_decode
from nsa.ops.decode_cache import NewToken
from nsa.ops.indexing import num_cmp
from nsa.ops.rotary import split_rotate

# project() splits and rotates the fused projection with one operator (nsa.ops.rotary) where it can; False:
# the
# unfused arithmetic everywhere (what the operator replaced; scripts/step_budget.py measures one against the
# other)
FUSED_PROJECTION = True


def fused_projection(on: bool) -> None:
    """Whether the layers project their input in one fused product split and rotated by ``nsa::split_rotate``
    (the default), or part by part (the path before it: what ``scripts/step_budget.py`` measures against)."""
    global FUSED_PROJECTION
    FUSED_PROJECTION = on


class Projected:
    """Everything a layer computes from its input before attention (one forward or one decode step)."""

    __slots__ = ("gates", "k_cmp_raw", "k_sel", "k_win", "q", "q_win", "scorer", "v_cmp_raw", "v_sel",
                 "v_win")

    def __init__(self, **kw: torch.Tensor | None) -> None:
        self.q_win = None
        # the scorer loss's q and raw compressed K/V (scorer.into=weights)
        self.scorer: list[torch.Tensor] | None = None
        for k, v in kw.items():
            setattr(self, k, v)

    q: torch.Tensor
    k_cmp_raw: torch.Tensor
    v_cmp_raw: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    gates: torch.Tensor
    q_win: torch.Tensor | None  # the window branch's own queries (``window_query``), else None


class NSAAttention(nn.Module):
    """Native Sparse Attention layer: ``forward(x [B, S, dim]) -> [B, S, dim]``.

    - ``q_proj``; key/value projections per branch (cmp, sel, win), or one shared (``shared_kv``).
    - RoPE on ``q``, ``k_sel``, ``k_win`` and on the raw compression keys before ``phi`` (values: none).
    - ``phi``: ``avg`` (``nsa.ops.compress_avg``) or ``mlp`` (learnable block MLP with intra-block
      position embedding, separate for keys and values).
    - Gates (``gates``: :class:`nsa.model.gates.GateParams`): logits ``bias + scale * mlp(x)`` with
      ``mlp = Linear(dim, hidden) -> SiLU -> Linear(hidden, n_heads * 3)`` (``bias`` a constant per branch),
      then ``sigmoid`` per branch or ``softmax`` over the three branches; order (cmp, sel, win). Small, slow
      gates at init are what lets the model learn long-range retrieval (docs/design.md, "Gates").
    - ``o_proj``: ``Linear(n_heads * d_v, dim)``.
    - ``window_query``: the window branch's own query projection ``q_win_proj`` (the other branches and the
      block choice keep ``q_proj``); ``kv_speed``: the compressed and selected branches' K/V rows of
      ``kv_proj`` are stored divided by it and multiplied back in the forward, so Adam moves them
      ``kv_speed`` times faster (docs/design.md, "Gates against retrieval"). The defaults here are the
      paper's layer; the config's (``nsa.window_query``, ``nsa.kv_speed``) are the measured recipe.

    What the layer measures besides its output (gate and selection statistics, the selection probe, the
    scorer and alignment losses, whose options ``scorer`` are a frozen
    :class:`nsa.model.diagnostics.ScorerParams`) lives in ``diag``
    (:class:`nsa.model.diagnostics.LayerDiagnostics`); the forward hands it the tensors it needs. ``legacy``:
    the loose gate keywords of before issue 34 (``gate``, ``gate_hidden``,
    ``gate_bias``, ``gate_scale``, ``fixed_gates``, ``collapse_threshold``) instead of ``gates``, as the
    ``modeling_nsa.py`` of earlier Hugging Face exports passes them.
    """

    kv_gain: torch.Tensor | None  # a non-persistent buffer: kv_row_gain(kv_speed), None at speed 1

    def __init__(
        self, dim: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int, hp: NSAParams,
        gates: GateParams | None = None, *, phi: str = "avg", shared_kv: bool = False,
                 rope_theta: float = 10000.0,
        backend: str | None = None, window_query: bool = False, kv_speed: float = 1.0,
        scorer: ScorerParams | None = None, **legacy: Any,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_groups:
            raise ValueError(f"model.n_kv_groups={n_kv_groups} must divide model.n_heads={n_heads}")
        if legacy and gates is not None:
            raise TypeError(f"NSAAttention: pass gates or the loose gate keywords ({', '.join(legacy)}), not "
                            "both")
        gates = GateParams.of_keywords(**legacy) if legacy else gates or GateParams()
        self.dim, self.n_heads, self.n_kv_groups = dim, n_heads, n_kv_groups
        self.d_k, self.d_v = d_k, d_v
        self.hp, self.gates = hp, gates
        self.phi, self.shared_kv = phi, shared_kv
        self.backend = backend
        self.scale = d_k**-0.5

        self.q_proj = nn.Linear(dim, n_heads * d_k, bias=False)
        self.n_kv_branches = 1 if shared_kv else 3
        self.kv_proj = nn.Linear(dim, self.n_kv_branches * n_kv_groups * (d_k + d_v), bias=False)
        self.compress = Compressor(phi, hp, d_k, d_v, backend=backend)
        gh = gates.hidden or max(1, dim // 4)
        self.gate_mlp = nn.Sequential(nn.Linear(dim, gh), nn.SiLU(), nn.Linear(gh, n_heads * 3))
        # a constant (config, not state): the learned part of the logits starts at 0 around it
        self.register_buffer("gate_offset", torch.tensor(gates.bias).repeat(n_heads), persistent=False)
        self.o_proj = nn.Linear(n_heads * d_v, dim, bias=False)
        self.q_win_proj = nn.Linear(dim, n_heads * d_k, bias=False) if window_query else None
        self.kv_speed = 1.0 if shared_kv else float(kv_speed)
        gain = self.kv_row_gain(self.kv_speed) if self.kv_speed != 1.0 else None
        self.register_buffer("kv_gain", gain, persistent=False)
        self.rope = RotaryEmbedding(d_k, rope_theta)
        self.context: ContextParallel | None = None  # set by NSALM.set_context_parallel
        self.diag = LayerDiagnostics(hp, self.scale, gates.collapse_threshold, scorer)

    @property
    def gate_bias(self) -> tuple[float, float, float]:
        """``gates.bias`` (read under this name by the ``modeling_nsa.py`` of Hugging Face exports)."""
        return self.gates.bias

    @property
    def gate_scale(self) -> float:
        return self.gates.scale

    # ------------------------------------------------------------------------------------------
    # shared pieces

    def gate_logits(self, x: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
        """``gate_bias + gate_scale * gate_mlp(x)``: a constant offset per branch plus the learned MLP,
        scaled (docs/design.md, "Gates"). ``pre``: ``x @ fc1.weight.T`` already computed (the fused
        input projection of :meth:`project`).

        For a few rows (a decode step) as products and sums, which a compiled step fuses into two
        small kernels instead of two GEMM launches and their epilogues.
        """
        fc1, fc2 = self.gate_mlp[0], self.gate_mlp[2]
        assert isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)
        offset = self.gate_offset
        assert isinstance(offset, torch.Tensor)
        if pre is not None or x.shape[0] * x.shape[1] > 8:
            hid = F.silu(fc1(x) if pre is None else pre + fc1.bias.to(pre.dtype))
            const = offset.to(hid.dtype) + self.gates.scale * fc2.bias.to(hid.dtype)
            return torch.addmm(const, hid.reshape(-1, hid.shape[-1]), fc2.weight.to(hid.dtype).t(),
                               alpha=self.gates.scale).view(*hid.shape[:-1], -1)
        hid = F.silu((x[..., None, :] * fc1.weight).sum(-1) + fc1.bias)
        return offset + self.gates.scale * ((hid[..., None, :] * fc2.weight).sum(-1) + fc2.bias)

    def kv_row_gain(self, speed: float) -> torch.Tensor:
        """``[rows, 1]``: ``speed`` for ``kv_proj``'s compressed and selected rows, 1 for the window's (the
        stored rows are the forward's divided by this; with ``shared_kv`` every row is 1)."""
        rows = self.n_kv_groups * (self.d_k + self.d_v)
        fast = 1.0 if self.shared_kv else float(speed)
        return torch.tensor([fast] * (2 * rows) + [1.0] * rows)[: self.kv_proj.out_features, None]

    def kv_weight(self) -> torch.Tensor:
        """``kv_proj``'s weight as the forward uses it: the compressed and selected rows times
        ``kv_speed``."""
        w = self.kv_proj.weight
        return w if self.kv_gain is None else w * self.kv_gain.to(w.dtype)

    def scale_fast_kv_init(self) -> None:
        """Store the compressed and selected K/V rows divided by ``kv_speed`` (call after initialising the
        weights: the forward multiplies them back, so the model at initialisation is the plain one)."""
        if self.kv_gain is not None:
            with torch.no_grad():
                self.kv_proj.weight.div_(self.kv_gain.to(self.kv_proj.weight.dtype))

    def fused_weights(self) -> list[torch.Tensor]:
        """The weights of the one input GEMM, in its column order: ``q_proj``, ``kv_proj``
        (:meth:`kv_weight`),
        ``q_win_proj`` (with ``window_query``) and the gate MLP's first layer (unless the gates are fixed)."""
        fc1 = self.gate_mlp[0]
        assert isinstance(fc1, nn.Linear)
        qw = self.q_win_proj
        return [self.q_proj.weight, self.kv_weight(), *([] if qw is None else [qw.weight]),
                *([fc1.weight] if self.gates.fixed is None else [])]

    def in_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                torch.Tensor | None]:
        """``(q, kv, gate pre-activation, window queries)`` of ``x``: one GEMM over the concatenated weights
        of
        ``q_proj``, ``kv_proj`` (:meth:`kv_weight`), ``q_win_proj`` and the gate MLP's first layer when ``x``
        has more than a few rows (one launch and one read of ``x`` instead of several), else the separate
        layers (a decode step)."""
        gate = self.gates.fixed is None
        qw = self.q_win_proj
        if x.shape[0] * x.shape[1] <= 8:  # a decode step: scale the few output rows, not the weight
            kv = self.kv_proj(x) if self.kv_gain is None else self.kv_proj(x) * self.kv_gain[:, 0].to(x.dtype)
            return self.q_proj(x), kv, None, None if qw is None else qw(x)
        ws = self.fused_weights()
        y = F.linear(x, torch.cat(ws))
        parts = list(torch.split(y, [w.shape[0] for w in ws], dim=-1))
        q, kv = parts[0], parts[1]
        q_win = None if qw is None else parts[2]
        return q, kv, parts[-1] if gate else None, q_win

    def project(self, x: torch.Tensor, positions: torch.Tensor, cp: ContextParallel | None = None,
                kv_positions: torch.Tensor | None = None) -> Projected:
        """Queries, raw K/V of the three branches (keys RoPE'd) and activated gates at ``positions``. Under
        context parallelism (``cp``) the queries and gates are this rank's rows and the K/V the whole
        sequence: the K/V projection of every rank gathered in one collective, then RoPE'd at ``kv_positions``
        (the whole sequence's: ``0 .. S - 1`` by default)."""
        B, S, _ = x.shape
        if FUSED_PROJECTION and cp is None and kv_positions is None and B * S > 8:
            q, ks, vs, gate_pre, q_win = self.project_rotated(x, positions)
        else:
            q_lin, kv_lin, gate_pre, q_win_lin = self.in_proj(x)
            ang = self.rope.angles(positions, q_lin)  # once for every tensor rotated at these positions
            q = self.rope(q_lin.view(B, S, self.n_heads, self.d_k), positions, ang)
            q_win = (None if q_win_lin is None
                     else self.rope(q_win_lin.view(B, S, self.n_heads, self.d_k), positions, ang))
            if cp is not None:
                kv_lin = cp.gather(kv_lin)
                if kv_positions is None:
                    kv_positions = torch.arange(kv_lin.shape[1], device=x.device)
            ks, vs = self.keys_values(kv_lin, positions if kv_positions is None else kv_positions,
                                      ang if kv_positions is None else None)
        if self.gates.fixed is not None:  # ablation: constant gates, the gate MLP unused
            gates = torch.tensor(self.gates.fixed, device=x.device, dtype=q.dtype).expand(B, S, self.n_heads,
                                                                                          3)
        else:
            g = self.gate_logits(x, gate_pre).view(B, S, self.n_heads, 3)
            gates = torch.sigmoid(g) if self.gates.kind == "sigmoid" else torch.softmax(g, dim=-1)
        return Projected(
            q=q, k_cmp_raw=ks[0], v_cmp_raw=vs[0], k_sel=ks[1], v_sel=vs[1], k_win=ks[2], v_win=vs[2],
            gates=gates, q_win=q_win,
        )

    def project_rotated(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[
            torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """:meth:`in_proj`'s one GEMM split into its parts and the queries and keys RoPE'd by one operator
        (:func:`nsa.ops.rotary.split_rotate`, whose backward writes the GEMM's output gradient part by part):
        ``(q, keys, values, gate pre-activation, window queries)``, the same values as the unfused path."""
        B, S, _ = x.shape
        H, Dk, Dv, HQ = self.n_kv_groups, self.d_k, self.d_v, self.n_heads
        gate = self.gates.fixed is None
        qw = self.q_win_proj
        ws = self.fused_weights()
        y = F.linear(x, torch.cat(ws))
        # the parts in the GEMM's column order: q, each branch's K then V, the window's q, the gate input
        rot = [True] + [True,
                        False] * self.n_kv_branches + ([True] if qw is not None else []) + ([False] if gate
                            else [])
        widths = [HQ * Dk] + [H * Dk, H * Dv] * self.n_kv_branches + [w.shape[0] for w in ws[2:]]
        cos, sin = self.rope.table(positions, y)
        parts = split_rotate(y, cos, sin, widths, rot, Dk)
        q = parts[0].view(B, S, HQ, Dk)
        kv = parts[1 : 1 + 2 * self.n_kv_branches]
        ks = [k.view(B, S, H, Dk) for k in kv[0::2]]
        vs = [v.view(B, S, H, Dv) for v in kv[1::2]]
        if self.shared_kv:
            ks, vs = ks * 3, vs * 3
        q_win = None if qw is None else parts[1 + 2 * self.n_kv_branches].view(B, S, HQ, Dk)
        return q, ks, vs, parts[-1] if gate else None, q_win

    def scorer_inputs(self, x: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """``[q, k_cmp_raw, v_cmp_raw]`` of ``x`` as :meth:`project` gives them (same values), from one GEMM
        over
        ``q_proj``'s rows and the compressed branch's K/V rows only (``scorer.into=weights``: ``x``
        detached)."""
        B, S, _ = x.shape
        H, Dk, Dv = self.n_kv_groups, self.d_k, self.d_v
        nq, ncmp = self.q_proj.out_features, H * (Dk + Dv)  # kv_proj's first rows: the compressed branch
        q_lin, kv_lin = F.linear(x,
                                 torch.cat([self.q_proj.weight, self.kv_weight()[:ncmp]])).split([nq, ncmp],
                                     -1)
        ang = self.rope.angles(positions, q_lin)
        q = self.rope(q_lin.view(B, S, self.n_heads, Dk), positions, ang)
        k = self.rope(kv_lin[..., : H * Dk].reshape(B, S, H, Dk), positions, ang)
        return [q, k, kv_lin[..., H * Dk :].reshape(B, S, H, Dv)]

    def keys_values(self, kv_lin: torch.Tensor, positions: torch.Tensor,
                    angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[torch.Tensor],
                                                                                      list[torch.Tensor]]:
        """The (cmp, sel, win) keys, RoPE'd at ``positions`` (``angles``: their rotation, already computed),
        and values of the K/V projection ``[B, S, ...]``."""
        B, S, _ = kv_lin.shape
        H, Dk, Dv = self.n_kv_groups, self.d_k, self.d_v
        kv = kv_lin.view(B, S, self.n_kv_branches, H * (Dk + Dv))
        ang = self.rope.angles(positions, kv_lin) if angles is None else angles
        ks, vs = [], []
        for i in range(self.n_kv_branches):
            k = kv[:, :, i, : H * Dk].reshape(B, S, H, Dk)
            ks.append(self.rope(k, positions, ang))
            vs.append(kv[:, :, i, H * Dk :].reshape(B, S, H, Dv))
        if self.shared_kv:
            ks, vs = ks * 3, vs * 3
        return ks, vs

    def attend(self, p: Projected, collect: bool) -> torch.Tensor:
        """Compress and run the NSA op: ``[B, S, HQ, Dv]``; ``diag`` observes the forward when it collects
        statistics (``collect``) or a probe is armed."""
        k_cmp, v_cmp = self.compress(p.k_cmp_raw, p.v_cmp_raw)
        want_idx = collect or self.diag.probe_queries > 0
        res = nsa_attention(
            p.q, k_cmp, v_cmp, p.k_sel, p.v_sel, p.k_win, p.v_win, p.gates, self.hp, scale=self.scale,
            return_block_idx=want_idx, backend=self.backend, q_win=p.q_win,
        )
        if not want_idx:
            assert isinstance(res, torch.Tensor)
            return res
        o, idx = res
        scorer = None if p.scorer is None else (p.scorer[0], self.compress(p.scorer[1], p.scorer[2])[0])
        return self.diag.observe(p.q, p.k_sel, k_cmp, p.gates, idx, o, collect, scorer)

    def attend_documents(self, p: Projected, cu_seqlens: torch.Tensor, collect: bool) -> torch.Tensor:
        """:meth:`attend` for packed documents (``cu_seqlens`` over the flattened batch)."""

        def one_batch(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                      kw: torch.Tensor, vw: torch.Tensor, g: torch.Tensor,
                      *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_cmp, v_cmp = self.compress(kc, vc)
            q_win = rest[0] if p.q_win is not None else None
            res = nsa_attention(q, k_cmp, v_cmp, ks, vs, kw, vw, g, self.hp, scale=self.scale,
                                return_block_idx=True, backend=self.backend, q_win=q_win)
            assert isinstance(res, tuple)
            if probing:  # one document, unpadded: its own probe
                self.diag.probe_document(q, ks, k_cmp, res[1], g)
            # one such document: its own scorer loss, by its share of tokens
            if scoring and q.shape[1] > choosing:
                sq, skc = (q, k_cmp) if p.scorer is None else (rest[-3], self.compress(rest[-2], rest[-1])[0])
                return self.diag.scorer_loss(sq, ks, skc, res[0], q, res[1], q.shape[1] / total), res[1]
            return res

        probing = self.diag.probe_queries > 0
        scoring = collect and self.diag.scores()
        # a longer document no longer selects every block: the scorer has work
        choosing = first_choice(self.hp)
        total = p.q.shape[0] * p.q.shape[1]
        # alone (unpadded): every document for the probe, the ones the scorer loss reaches for it; the rest by
        # length
        alone_from = 0 if probing else choosing + 1 if scoring else None
        o, idx = documents.attend(one_batch,
                                  [p.q, p.k_cmp_raw, p.v_cmp_raw, p.k_sel, p.v_sel, p.k_win, p.v_win,
                                              p.gates, *([] if p.q_win is None else [p.q_win]),
                                   *(p.scorer or [])],
                                  cu_seqlens, alone_from=alone_from)
        if probing:
            self.diag.end_documents()
        if collect:
            self.diag.accumulate(p.gates, idx)
        return o

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, S, dim]`` -> ``[B, S, dim]``; ``cu_seqlens``: packed documents (:mod:`nsa.model.documents`).
        Under context parallelism (``self.context``) ``x`` holds this rank's rows of the sequence."""
        if self.context is not None:
            return self._forward_context(x, self.context, cu_seqlens)
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device) if cu_seqlens is None else documents.positions(cu_seqlens, B,
            S)
        p = self.project(x, pos)
        # a training forward collects statistics and the scorer loss; a checkpoint's recompute runs the same
        # computation (it must save the same tensors) and adds no statistics (LayerDiagnostics.suppress)
        collect = self.training
        if collect and self.diag.scores() and self.diag.scorer_into == "weights":
            # the scorer's inputs from the detached input: its loss trains the projection and compression
            # weights it reads, and nothing before this layer (DeepSeek DSA's indexer)
            p.scorer = self.scorer_inputs(x.detach(), pos)
        o = self.attend(p, collect) if cu_seqlens is None else self.attend_documents(p, cu_seqlens, collect)
        return self.o_proj(o.reshape(B, S, self.n_heads * self.d_v))

    def _forward_context(self, x: torch.Tensor, cp: ContextParallel,
                         cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows (:mod:`nsa.model.context`): the keys and values of the whole sequence gathered,
        each of the rank's chunks attending to the prefix that ends with it; with packed documents
        (``cu_seqlens`` of the whole batch) to its documents' (:func:`nsa.model.documents.chunk_attend`)."""
        if self.diag.whole_sequence_only():
            raise ValueError("the scorer loss and selection probes do not run under context parallelism")
        B, S_local, _ = x.shape
        S = S_local * cp.size
        mine = cp.positions(S, x.device)
        whole = None if cu_seqlens is None else documents.positions(cu_seqlens, B, S)
        p = self.project(x, mine if whole is None else whole[:, mine], cp, whole)
        kv = [p.k_cmp_raw, p.v_cmp_raw, p.k_sel, p.v_sel, p.k_win, p.v_win]
        k_cmp, v_cmp = self.compress(p.k_cmp_raw, p.v_cmp_raw) if cu_seqlens is None else (None, None)
        collect = self.training
        aligning = collect and self.diag.aligns()
        # the alignment loss's probe positions of the whole sequence (None: off, none to choose at this
        # length, or
        # packed documents: each its own)
        probes = probe_range(S, self.hp,
                             self.diag.scorer_queries) if aligning and cu_seqlens is None else None
        align: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        idxs: list[torch.Tensor | None] = []
        for i, (start, stop) in enumerate(cp.chunks(S)):
            rows = slice(i * (S_local // 2), (i + 1) * (S_local // 2))
            mine_q = [p.q[:, rows], p.gates[:, rows], *([] if p.q_win is None else [p.q_win[:, rows]])]
            o: torch.Tensor
            idx: torch.Tensor | None
            if cu_seqlens is not None:  # packed documents: each compressed from its own start
                o, idx = documents.chunk_attend(self._attend_documents_piece, mine_q, kv, cu_seqlens, start,
                                                stop)
                if aligning:  # the probe positions of each document among this chunk's rows
                    part = documents.outside_graph(_align_documents)(self.diag, mine_q[0], kv[2], idx,
                                                                     cu_seqlens,
                                                                      start, stop)
                    if part is not None:
                        align.append(part)
            else:
                assert k_cmp is not None and v_cmp is not None
                n = num_cmp(stop, self.hp.l, self.hp.d)
                res = self._attend_prefix(mine_q,
                                          [k_cmp[:, :n], v_cmp[:, :n], *(t[:, :stop] for t in kv[2:])], start,
                                          collect)
                o, idx = res if isinstance(res, tuple) else (res, None)
                if probes is not None and idx is not None:  # the probe positions among this chunk's rows
                    part = self.diag.align_part(mine_q[0], kv[2][:, :stop], idx, start, probes)
                    if part is not None:
                        align.append(part)
            outs.append(o)
            idxs.append(idx)
        if collect:
            self.diag.accumulate(p.gates, torch.cat([t for t in idxs if t is not None], dim=1))
        o = torch.cat(outs, dim=1)
        if align:  # this rank's parts of the whole forward's loss
            o = self.diag.attach_align(o, torch.stack(align).sum() * cp.size)
        return self.o_proj(o.reshape(B, S_local, self.n_heads * self.d_v))

    def _attend_prefix(self, mine_q: list[torch.Tensor], kv: list[torch.Tensor], q_start: int,
                       want_idx: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The NSA op for query rows ``(q, gates[, q_win])`` at positions ``q_start ..`` of the keys and
        values
        ``kv`` (compressed K/V, then the raw selected and window K/V)."""
        q, gates, *q_win = mine_q
        k_cmp, v_cmp, ks, vs, kw, vw = kv
        res = nsa_attention(q, k_cmp, v_cmp, ks, vs, kw, vw, gates, self.hp, scale=self.scale,
                            q_start=q_start, return_block_idx=want_idx, backend=self.backend,
                            q_win=q_win[0] if q_win else None)
        return res if isinstance(res, torch.Tensor) else (res[0], res[1])

    def _attend_documents_piece(self, mine_q: list[torch.Tensor], kv: list[torch.Tensor],
                                q_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_attend_prefix` of one piece of a chunk of packed documents (raw K/V from the document's
        start, compressed here): ``(out, block_idx)``."""
        k_cmp, v_cmp = self.compress(kv[0], kv[1])
        res = self._attend_prefix(mine_q, [k_cmp, v_cmp, *kv[2:]], q_start, True)
        assert isinstance(res, tuple)
        return res

    # ------------------------------------------------------------------------------------------
    # decode with caches (nsa.model.cache)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype) -> NSALayerCache:
        return NSALayerCache.empty(batch_size, self.n_kv_groups, self.d_k, self.d_v, max_len, hp=self.hp,
                                   device=device, dtype=dtype)

    def prefill(self, x: torch.Tensor, layer: NSALayerCache | DenseLayerCache,
                cache: ModelCache) -> torch.Tensor:
        """Full forward over ``x [B, P, dim]`` (positions ``0 .. P-1``) that also fills ``layer``."""
        assert isinstance(layer, NSALayerCache)
        B, S, _ = x.shape
        p = self.project(x, torch.arange(S, device=x.device))
        k_cmp, v_cmp = self.compress(p.k_cmp_raw, p.v_cmp_raw)
        o = nsa_attention(
            p.q, k_cmp, v_cmp, p.k_sel, p.v_sel, p.k_win, p.v_win, p.gates, self.hp, scale=self.scale,
            backend=self.backend, q_win=p.q_win,
        )
        assert isinstance(o, torch.Tensor)
        layer.fill(p.k_sel, p.v_sel, p.k_win, p.v_win, p.k_cmp_raw, p.v_cmp_raw, k_cmp, v_cmp, cache.lengths)
        return self.o_proj(o.reshape(B, S, self.n_heads * self.d_v))

    def decode(self, x: torch.Tensor, layer: NSALayerCache | DenseLayerCache,
               cache: ModelCache) -> torch.Tensor:
        """One new token per sequence, ``x [B, 1, dim]`` at positions ``cache.lengths``: ``[B, 1, dim]``.

        Stores the token's K/V, emits a compressed token where its block completes, then attends
        with ``nsa.ops.decode.nsa_decode`` (reads only visible compressed tokens, chosen blocks, window;
        the fused Triton step on CUDA unless this layer's backend is ``torch``/``reference``).
        """
        assert isinstance(layer, NSALayerCache)
        if not torch.compiler.is_compiling():  # a host check; decode_step makes it too
            cache.check_room()
        B = x.shape[0]
        t = cache.lengths
        p = self.project(x, t[:, None])
        backend = self.backend or "auto"  # resolved here: no settings lookup inside a compiled step
        new = NewToken(p.k_sel[:, 0], p.v_sel[:, 0], p.k_win[:, 0], p.v_win[:, 0], p.k_cmp_raw[:, 0],
                       p.v_cmp_raw[:, 0])
        mean = self.phi == "avg"  # mean pooling is emitted by the append itself (one kernel on CUDA)
        layer.append(t, new, self.hp, emit_mean=mean, backend=backend)
        if not mean:
            k_new, v_new = self.compress.one_block(*layer.block_in_order(t))
            layer.emit(t, k_new, v_new, self.hp)
        res = nsa_decode(
            p.q[:, 0], t, layer.k_cmp, layer.v_cmp, layer.k_sel, layer.v_sel, layer.k_win, layer.v_win,
            p.gates[:, 0], self.hp, scale=self.scale, table=layer.table, backend=backend,
            q_win=None if p.q_win is None else p.q_win[:, 0],
        )
        layer.last_block_idx, layer.last_reads = res.block_idx, res.reads
        cache.reads_total += res.reads.sum(dim=-1)
        return self.o_proj(res.o.reshape(B, 1, self.n_heads * self.d_v))

    # ------------------------------------------------------------------------------------------
    # what the layer measures (self.diag)

    def _apply(self, fn: Any, recurse: bool = True) -> NSAAttention:
        """``.to()``/``.cuda()``/``.double()``: the diagnostics follow the module (device, floating dtype)."""
        super()._apply(fn, recurse)
        offset = self.gate_offset
        if isinstance(offset, torch.Tensor):
            self.diag.follow(offset.device, offset.dtype)
        return self

    def take_stat_sums(self) -> torch.Tensor | None:
        """The running sums since the last call (``nsa.model.stats.FIELDS``), zeroed; no host sync."""
        return self.diag.take_sums()

    def consume_stats(self) -> dict[str, float | list[float]]:
        """Gate entropy, branch shares, collapse fraction, mean gates, ``sel_keys_mean``; one transfer."""
        return self.diag.consume()

    def extra_repr(self) -> str:
        return (
            f"heads={self.n_heads}, kv_groups={self.n_kv_groups}, d_k={self.d_k}, d_v={self.d_v}, "
            f"l={self.hp.l}, d={self.hp.d}, l_sel={self.hp.l_sel}, n_sel={self.hp.n_sel}, w={self.hp.w}, "
            f"phi={self.phi}, gate={self.gates.kind}, shared_kv={self.shared_kv}, "
            f"window_query={self.q_win_proj is not None}, kv_speed={self.kv_speed}"
            + (f", fixed_gates={self.gates.fixed}" if self.gates.fixed is not None else "")
        )


def _align_documents(diag: LayerDiagnostics, q: torch.Tensor, k_sel: torch.Tensor, block_idx: torch.Tensor,
                     cu_seqlens: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
    """The alignment loss of the query rows ``q`` at ``start .. stop - 1`` over packed documents
    (:meth:`LayerDiagnostics.align_documents`; run eagerly: the documents' host offsets)."""
    B, S = k_sel.shape[:2]
    return diag.align_documents(q, k_sel, block_idx, start,
                                documents.chunk_spans(cu_seqlens, B, S, start, stop), B * S)
