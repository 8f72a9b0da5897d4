"""Appending one decoded token to the NSA caches (the write half of a decode step).

``append_token`` stores the new position ``t[b]`` of every sequence in the head-major caches that
``nsa.ops.decode.nsa_decode`` reads, and with ``emit_mean=True`` (phi = mean pooling) also emits the
compressed token whose last raw position is ``t`` (spec: token ``j`` covers raw ``j*d .. j*d+l-1``).
Cache layouts:

- ``k_sel, v_sel [B, H, T, D]``: raw position ``p`` in slot ``p``.
- ``k_win, v_win [B, H, R, D]``: window ring, position ``p`` in slot ``p % R``.
- ``ring_k, ring_v [B, H, l, D]``: the last ``l`` raw compression rows, position ``p`` in slot ``p % l``
  (after the write they are exactly the block ``t-l+1 .. t``).
- ``k_cmp, v_cmp [B, H, C + 1, D]``: compressed token ``j`` in slot ``j``; slot ``C`` is scratch.

The torch path below is the reference of the fused Triton kernel (``nsa.ops._triton.decode_cache``),
which does all of it in one launch with no host sync.
"""

from __future__ import annotations

import torch

from nsa.ops.cache_layout import DecodeCaches, NewToken
from nsa.ops.dispatch import pick, register
from nsa.params import NSAParams

try:  # the fused Triton append is optional: without triton every call runs the indexed writes
    from nsa.ops._triton import decode_cache as _triton_cache
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    _triton_cache = None  # type: ignore[assignment]


def emit_slot(t: torch.Tensor, l: int, d: int, n_cmp: int) -> torch.Tensor:  # noqa: E741
    """Slot of the compressed token that position ``t`` completes (``j`` with ``t = j*d + l - 1``), or the
    scratch slot ``n_cmp`` where ``t`` completes none (or ``j`` is past the cache)."""
    done = (t >= l - 1) & (torch.remainder(t - (l - 1), d) == 0)
    j = torch.div(t - (l - 1), d, rounding_mode="floor")
    return torch.where(done & (j < n_cmp), j, torch.full_like(j, n_cmp))


def block_in_order(ring: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The ring's raw rows ``t-l+1 .. t`` in position order: ``[B, H, l, D]``."""
    B, H, l, D = ring.shape  # noqa: E741
    slots = torch.remainder(t[:, None] - l + 1 + torch.arange(l, device=t.device)[None, :], l)
    return torch.gather(ring, 2, slots[:, None, :, None].expand(B, H, l, D))


def emit(caches: DecodeCaches, t: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
         hp: NSAParams) -> None:
    """Write compressed token ``[B, H, D]`` where ``t`` completes one (the others write the scratch slot)."""
    slot = emit_slot(t, hp.l, hp.d, caches.k_cmp.shape[2] - 1)
    ar = torch.arange(t.shape[0], device=t.device)
    caches.k_cmp[ar, :, slot] = k_new
    caches.v_cmp[ar, :, slot] = v_new


def _append_torch(t: torch.Tensor, new: NewToken, caches: DecodeCaches, hp: NSAParams,
                  emit_mean: bool) -> None:
    l = hp.l  # noqa: E741
    ar = torch.arange(t.shape[0], device=t.device)
    caches.k_sel[ar, :, t] = new.k_sel
    caches.v_sel[ar, :, t] = new.v_sel
    R = caches.k_win.shape[2]
    caches.k_win[ar, :, t % R] = new.k_win
    caches.v_win[ar, :, t % R] = new.v_win
    caches.ring_k[ar, :, t % l] = new.k_raw
    caches.ring_v[ar, :, t % l] = new.v_raw
    if emit_mean:
        emit(caches, t, block_in_order(caches.ring_k, t).mean(dim=-2),
             block_in_order(caches.ring_v, t).mean(dim=-2), hp)


def append_token(
    t: torch.Tensor,
    new: NewToken,
    caches: DecodeCaches,
    hp: NSAParams,
    *,
    emit_mean: bool,
    backend: str | None = None,
) -> None:
    """Store position ``t [B]`` (int64, ``< T``) of each sequence in ``caches`` (in place); with
    ``emit_mean`` also write the mean-pooled compressed token that ``t`` completes.

    ``backend`` as for ``nsa_decode``: ``triton`` (or ``auto`` on CUDA) runs one fused kernel, ``torch``
    / ``reference`` the indexed writes above; a ``triton`` request the kernel cannot serve falls back,
    counted in ``nsa.ops.fallback_counts()``.
    """
    _, impl = pick("append_token", backend, (t, *new, *caches))
    impl(t, new, caches, hp, emit_mean=emit_mean)


def _append_reference(t: torch.Tensor, new: NewToken, caches: DecodeCaches, hp: NSAParams, *,
                      emit_mean: bool) -> None:
    _append_torch(t.to(torch.int64), new, caches, hp, emit_mean)


def _append_triton(t: torch.Tensor, new: NewToken, caches: DecodeCaches, hp: NSAParams, *,
                   emit_mean: bool) -> None:
    assert _triton_cache is not None  # dispatch sends here only when _append_unsupported says so
    _triton_cache.append_token_triton(t, new, caches, l=hp.l, d=hp.d, emit_mean=emit_mean)


def _append_unsupported(t: torch.Tensor, *tensors: torch.Tensor) -> str | None:
    """Why the fused kernel cannot serve ``(t, *new, *caches)`` (``None``: it can)."""
    if _triton_cache is None:  # pragma: no cover - triton ships with CUDA builds of torch
        return "triton not installed"
    return _triton_cache.append_unsupported(t, NewToken(*tensors[:6]), DecodeCaches(*tensors[6:]))


def _register() -> None:
    for name in ("reference", "torch"):  # the indexed writes are the fused kernel's reference
        register("append_token", name, _append_reference)
    register("append_token", "triton", _append_triton, unsupported=_append_unsupported)


_register()
