"""Parity of an NSA backend against the reference on small random inputs (forward and backward)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import nsa.ops as ops


@dataclass
class ParityResult:
    backend: str
    device: str
    dtype: str
    shape: str
    max_fwd_err: float
    max_grad_err: float
    atol: float
    fallbacks: int

    @property
    def ok(self) -> bool:
        return self.max_fwd_err <= self.atol and self.max_grad_err <= self.atol and self.fallbacks == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# (B, S, HQ, H, D, l, d, l_sel, n_sel, w): tiny shapes that still exercise every branch
SHAPES = {
    "tiny": (1, 32, 4, 2, 8, 8, 4, 8, 2, 8),
    "odd": (2, 45, 4, 1, 16, 8, 4, 8, 3, 16),
}


def default_tolerance(dtype_name: str) -> float:
    return {"float32": 2e-3, "bfloat16": 6e-2, "float16": 1e-2}.get(dtype_name, 2e-3)


def check_backend(
    backend: str,
    device: str = "cpu",
    dtype_name: str = "float32",
    shape: str = "tiny",
    seed: int | None = None,
    atol: float | None = None,
) -> ParityResult:
    """Run ``nsa_attention`` (with ``compress_avg`` in the graph) on ``backend`` and on ``reference``."""
    import torch


    B, S, HQ, H, D, l, d, l_sel, n_sel, w = SHAPES[shape]  # noqa: E741
    hp = ops.NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed if seed is not None
                                        else int(torch.randint(0, 2**31 - 1, ()).item()))

    def rnd(*shape_: int) -> torch.Tensor:
        return torch.randn(*shape_, generator=gen, dtype=torch.float32)

    base = {
        "q": rnd(B, S, HQ, D),
        "k": rnd(B, S, H, D),
        "v": rnd(B, S, H, D),
        "ks": rnd(B, S, H, D),
        "vs": rnd(B, S, H, D),
        "kw": rnd(B, S, H, D),
        "vw": rnd(B, S, H, D),
        "g": torch.sigmoid(rnd(B, S, HQ, 3)),
    }
    upstream = rnd(B, S, HQ, D)

    def run(
        name: str, dev: str, dt: torch.dtype, block_idx: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        leaves = {k: t.to(device=dev, dtype=dt).clone().requires_grad_(True) for k, t in base.items()}
        k_cmp = ops.compress_avg(leaves["k"], hp, backend=name)
        v_cmp = ops.compress_avg(leaves["v"], hp, backend=name)
        out = ops.nsa_attention(
            leaves["q"], k_cmp, v_cmp, leaves["ks"], leaves["vs"], leaves["kw"], leaves["vw"], leaves["g"],
                                hp,
            backend=name, block_idx=None if block_idx is None else block_idx.to(dev), return_block_idx=True,
        )
        assert isinstance(out, tuple)
        o, idx = out
        (o.float() * upstream.to(dev)).sum().backward()
        grads = {k: t.grad.detach().float().cpu().clone() for k, t in leaves.items() if t.grad is not None}
        return o.detach().float().cpu(), grads, idx.detach().cpu()

    # the reference picks the blocks; the backend attends over the same blocks, so that a rounding
    # tie in low precision cannot flip a selection and look like a kernel bug
    ref_out, ref_grads, ref_idx = run("reference", "cpu", torch.float32, None)
    before = sum(ops.fallback_counts().values())
    out, grads, _ = run(backend, device, dtype, ref_idx)
    fallbacks = sum(ops.fallback_counts().values()) - before

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))

    fwd = rel(out, ref_out)
    grad = max((rel(grads[k], ref_grads[k]) for k in ref_grads if k in grads), default=0.0)
    missing = set(ref_grads) - set(grads)
    if missing:
        grad = float("inf")
    return ParityResult(
        backend, device, dtype_name, shape, fwd, grad,
        atol if atol is not None else default_tolerance(dtype_name), fallbacks,
    )
