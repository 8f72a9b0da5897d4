"""Learning-dynamics variants of the NSA layer, for the gate experiments of docs/design.md ("Gates").

Experiment code, not part of the library: each variant patches ``NSAAttention``/``NSALM`` of this process
(the forward at initialisation stays the shipped layer's; what changes is how fast each branch learns).
Variants (``NAME`` or ``NAME:PARAM``):

- ``window-detach``: no gradient flows through the window branch (its q share, K/V and gate).
- ``window-detach-q``: the window branch's share of the query gradient is removed.
- ``window-gradscale:A``: every gradient through the window branch is multiplied by ``A``.
- ``slowwin:A``: the window branch learns ``A`` times slower: gradients through it scaled by ``A`` and its
  K/V projection reparametrised ``W = A * W'`` (so Adam moves ``W`` ``A`` times slower).
- ``fastkv:R``: the compressed and selected branches' K/V projections learn ``R`` times faster
  (``W = R * W'``, ``W'`` starting at ``W / R``).
- ``fastsel:R``: ``fastkv:R`` plus a query projection of the window branch's own (``q_win``); the layer
  does this itself now (``nsa.window_query``, ``nsa.kv_speed``: the default, at R=3), so a variant runs on
  the paper's layer (``--set nsa.window_query=false --set nsa.kv_speed=1``).

The variants that split the window branch out of the op (``window-*``, ``slowwin``, ``fastsel``) call the
NSA op twice per layer, so they are slower; they are measured for their learning, not their speed.

    python scripts/gate_variants.py VARIANT -- train|bench ... # the nsa CLI with VARIANT installed
    (scripts/retrieval_sweep.py installs one per candidate: "patch": "fastkv:7.3")
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from nsa.model import attention as A
from nsa.model import lm as LM
from nsa.ops import nsa_attention

NAMES = ("window-detach", "window-detach-q", "window-gradscale", "slowwin", "fastkv", "fastsel")
_ORIG = {"init": LM.NSALM.__init__, "project": A.NSAAttention.project, "attend": A.NSAAttention.attend,
         "forward": A.NSAAttention.forward}


def _scaled(t: torch.Tensor, a: float) -> torch.Tensor:
    """``t`` in the forward; its gradient times ``a`` in the backward."""
    return t * a + t.detach() * (1 - a)


def _kv_rows(at: A.NSAAttention, branch: int) -> slice:
    n = at.n_kv_groups * (at.d_k + at.d_v)
    return slice(branch * n, (branch + 1) * n)


def _reparam(model: LM.NSALM, branches: tuple[int, ...], factor: float) -> None:
    """Store ``W' = W / factor`` for the K/V rows of ``branches`` (the forward multiplies by ``factor``)."""
    for block in model.block_list():
        at = block.attn
        if isinstance(at, A.NSAAttention) and not at.shared_kv:
            with torch.no_grad():
                for b in branches:
                    at.kv_proj.weight[_kv_rows(at, b)] /= factor


def _window_apart(self: A.NSAAttention, p: A.Projected, collect: bool, q_win: torch.Tensor,
                  k_win: torch.Tensor, v_win: torch.Tensor, g_win: torch.Tensor) -> torch.Tensor:
    """The compressed and selected branches through the layer's own path (statistics, probes), the window
    branch through a second op call with the given inputs (its gates of the other branches zero)."""
    g = p.gates
    m = torch.tensor([0.0, 0.0, 1.0], device=g.device, dtype=g.dtype)
    p1 = A.Projected(q=p.q, k_cmp_raw=p.k_cmp_raw, v_cmp_raw=p.v_cmp_raw, k_sel=p.k_sel, v_sel=p.v_sel,
                     k_win=p.k_win, v_win=p.v_win, gates=g * (1 - m))
    o1 = _ORIG["attend"](self, p1, collect)
    k_cmp, v_cmp = self.compress(p.k_cmp_raw.detach(), p.v_cmp_raw.detach())
    o2 = nsa_attention(q_win, k_cmp, v_cmp, p.k_sel.detach(), p.v_sel.detach(), k_win, v_win, g_win * m, self.hp,
                       scale=self.scale, backend=self.backend)
    return o1 + o2


def reset() -> None:
    """The shipped layer again (a worker process runs one candidate after another)."""
    LM.NSALM.__init__ = _ORIG["init"]  # type: ignore[method-assign]
    A.NSAAttention.project = _ORIG["project"]  # type: ignore[method-assign]
    A.NSAAttention.attend = _ORIG["attend"]  # type: ignore[method-assign]
    A.NSAAttention.forward = _ORIG["forward"]  # type: ignore[method-assign]


def install(spec: str) -> None:
    """Patch this process's NSA layer with the variant ``spec`` (``NAME`` or ``NAME:PARAM``)."""
    reset()
    name, _, arg = spec.partition(":")
    if name not in NAMES:
        raise SystemExit(f"gate variant {name!r} is not one of {', '.join(NAMES)}")
    x = float(arg) if arg else 1.0

    if name.startswith("window-") or name == "slowwin":
        def attend(self: A.NSAAttention, p: A.Projected, collect: bool) -> torch.Tensor:
            q, k, v, g = p.q, p.k_win, p.v_win, p.gates
            if name == "window-detach":
                q, k, v, g = q.detach(), k.detach(), v.detach(), g.detach()
            elif name == "window-detach-q":
                q = q.detach()
            else:  # window-gradscale, slowwin: every gradient through the window branch times x
                q, k, v, g = _scaled(q, x), _scaled(k, x), _scaled(v, x), _scaled(g, x)
            return _window_apart(self, p, collect, q, k, v, g)

        A.NSAAttention.attend = attend  # type: ignore[method-assign]

    if name == "slowwin":
        def init(self: LM.NSALM, *a: Any, **kw: Any) -> None:
            _ORIG["init"](self, *a, **kw)
            _reparam(self, (2,), 1 / x)

        def project(self: A.NSAAttention, inp: torch.Tensor, positions: torch.Tensor) -> A.Projected:
            p = _ORIG["project"](self, inp, positions)
            if not self.shared_kv:
                p.k_win, p.v_win = p.k_win * x, p.v_win * x
            return p

        LM.NSALM.__init__ = init  # type: ignore[method-assign]
        A.NSAAttention.project = project  # type: ignore[method-assign]

    if name in ("fastkv", "fastsel"):
        def init(self: LM.NSALM, *a: Any, **kw: Any) -> None:
            _ORIG["init"](self, *a, **kw)
            if self.nsa_cfg.window_query or self.nsa_cfg.kv_speed != 1:
                raise SystemExit(f"gate variant {name} patches the paper's layer: add --set nsa.window_query=false "
                                 "--set nsa.kv_speed=1 (the shipped nsa.window_query + nsa.kv_speed are fastsel)")
            _reparam(self, (0, 1), x)
            if name == "fastsel":
                for block in self.block_list():
                    at = block.attn
                    if isinstance(at, A.NSAAttention):
                        w = at.q_proj.weight
                        at.q_win = nn.Linear(w.shape[1], w.shape[0], bias=False).to(w.device, w.dtype)
                        nn.init.normal_(at.q_win.weight, std=self.model_cfg.init_std)

        def project(self: A.NSAAttention, inp: torch.Tensor, positions: torch.Tensor) -> A.Projected:
            p = _ORIG["project"](self, inp, positions)
            if not self.shared_kv:
                p.k_cmp_raw, p.v_cmp_raw, p.k_sel, p.v_sel = (t * x for t in (p.k_cmp_raw, p.v_cmp_raw, p.k_sel,
                                                                              p.v_sel))
            return p

        LM.NSALM.__init__ = init  # type: ignore[method-assign]
        A.NSAAttention.project = project  # type: ignore[method-assign]

    if name == "fastsel":
        def forward(self: A.NSAAttention, inp: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
            if cu_seqlens is not None:
                raise SystemExit("gate variant fastsel: packed documents are not supported")
            B, S, _ = inp.shape
            pos = torch.arange(S, device=inp.device)
            p = self.project(inp, pos)
            collect = self.diag.collects(self.training)
            q_win = self.rope(self.q_win(inp).view(B, S, self.n_heads, self.d_k), pos)
            o = _window_apart(self, p, collect, q_win, p.k_win, p.v_win, p.gates)
            return self.o_proj(o.reshape(B, S, self.n_heads * self.d_v))

        A.NSAAttention.forward = forward  # type: ignore[method-assign]


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: python scripts/gate_variants.py VARIANT -- NSA_CLI_ARGS ...")
    install(sys.argv[1])
    sys.argv = ["nsa", *sys.argv[3:]]
    from nsa_cli.app import main as nsa_main

    nsa_main()


if __name__ == "__main__":
    main()
