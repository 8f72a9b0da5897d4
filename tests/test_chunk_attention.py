"""``nsa.ops.chunk_attention``: a context-parallel chunk of a dense block, the prefix and the chunk's own square
merged by log-sum-exp, against SDPA with the explicit lower-right mask."""

from __future__ import annotations

import pytest
import torch

from nsa.model.dense import sdpa_gqa
from nsa.ops import chunk_attention


def _inputs(start: int, L: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    B, HQ, H, D = 2, 6, 2, 16
    shapes = [(B, HQ, L, D), (B, H, start + L, D), (B, H, start + L, D)]
    return [torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_(True) for s in shapes]


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    keys = torch.arange(k.shape[2], device=q.device)
    mask = keys[None, :] <= torch.arange(start, start + q.shape[2], device=q.device)[:, None]
    return sdpa_gqa(q, k, v, attn_mask=mask)


def _compare(impl: str, start: int, L: int, dtype: torch.dtype, device: str, tol: float) -> None:
    q, k, v = _inputs(start, L, dtype, device, seed=3 + start)
    o = chunk_attention.causal_at(q, k, v, start, impl)
    want = _masked(q, k, v, start)
    g = torch.randn(o.shape, generator=torch.Generator(device=device).manual_seed(4), device=device, dtype=dtype)
    got_g = torch.autograd.grad(o, (q, k, v), g)
    want_g = torch.autograd.grad(want, (q, k, v), g)
    for name, a, b in (("o", o, want), *zip(("dq", "dk", "dv"), got_g, want_g, strict=True)):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= tol, (impl, start, name, err)


@pytest.mark.parametrize("start", [0, 5, 24])
def test_prefix_and_square_merged_are_the_masked_attention(start: int) -> None:
    """float64, seeds 3 + start (inputs) and 4 (output gradient): forward and every gradient as SDPA with the
    explicit mask, GQA (6 query heads on 2 KV heads), a chunk at position 0, one shorter than its prefix, one
    longer."""
    _compare("math", start, 9 if start != 24 else 16, torch.float64, "cpu", 1e-12)


def test_library_impl_and_bad_keys() -> None:
    q, k, v = _inputs(4, 8, torch.float32, "cpu", seed=1)
    assert chunk_attention.library_impl(q, k, v) is None  # CPU: the caller's masked SDPA
    chunk_attention.set_impl("math")
    try:
        assert chunk_attention.library_impl(q, k, v) == "math"
    finally:
        chunk_attention.set_impl(None)
    with pytest.raises(ValueError, match="12 keys"):
        chunk_attention.causal_at(q, k[:, :, :-1], v[:, :, :-1], 4, "math")


def test_compiled_chunk_equals_eager() -> None:
    """Under ``torch.compile`` (Dynamo traces the autograd function, as in a compiled training step): the eager
    output and gradients, with and without the prefix (seeds 3 + start)."""
    torch._dynamo.reset()
    compiled = torch.compile(chunk_attention.causal_at)
    for start in (0, 16):
        q, k, v = _inputs(start, 16, torch.float32, "cpu", seed=3 + start)
        o = compiled(q, k, v, start, "math")
        want = chunk_attention.causal_at(q, k, v, start, "math")
        torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(o.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v)),
                        strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("start", [0, 1024])
def test_gpu_library_chunk_matches_the_masked_attention(start: int) -> None:
    """bf16 on the GPU's library kernel (cuDNN on compute capability 9+, else FlashAttention): within bf16's
    rounding of SDPA with the explicit mask, forward and every gradient."""
    impl = "cudnn" if torch.cuda.get_device_capability()[0] >= 9 else "flash"
    _compare(impl, start, 512, torch.bfloat16, "cuda", 2e-2)
