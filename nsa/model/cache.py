"""Decode caches: per-layer NSA state (raw selection K/V, window ring, compression ring, compressed
stream) and the dense baseline's plain KV cache, grouped in a ``ModelCache``.

Every sequence ``b`` of a batch stores its own positions ``0 .. lengths[b]-1`` (left padding of the
prompt is removed before prefill, so padded positions are never stored nor attended). See
``docs/decode.md`` for the layout and what one decode step reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nsa.errors import NSAError
from nsa.ops import NSAParams
from nsa.ops.decode_cache import DecodeCaches, NewToken, append_token, block_in_order, emit
from nsa.ops.indexing import cmp_block_table, num_cmp


def ring_positions(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """For a ring of ``size`` slots after ``lengths[b]`` positions: the position slot ``s`` holds,
    ``(len - 1) - ((len - 1 - s) mod size)`` (negative: empty slot). ``[B, size]`` int64."""
    last = (lengths.to(torch.int64) - 1)[:, None]
    return last - torch.remainder(last - torch.arange(size, device=lengths.device)[None, :], size)


def _gather_positions(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` rows at ``pos [B, n]`` (clamped into range) -> head-major ``[B, H, n, D]``."""
    B, S, H, D = x.shape
    idx = pos.clamp(0, S - 1)[:, :, None, None].expand(B, pos.shape[1], H, D)
    return torch.gather(x, 1, idx).transpose(1, 2)


@dataclass
class NSALayerCache:
    """One NSA layer's decode state for ``B`` sequences of up to ``max_len`` positions (head-major).

    - ``k_sel, v_sel [B, H, max_len, D]``: raw selection K/V, position ``p`` in slot ``p``.
    - ``k_win, v_win [B, H, R, D]``: window ring, ``R = min(w, max_len)``, position ``p`` in ``p % R``.
    - ``ring_k, ring_v [B, H, l, D]``: the last ``l`` raw compression keys (RoPE'd) and values, the
      partial block still filling; position ``p`` in slot ``p % l``.
    - ``k_cmp, v_cmp [B, H, C + 1, D]``: compressed token ``j`` in slot ``j`` (``C = num_cmp(max_len)``),
      slot ``C`` is scratch for sequences that emit nothing in a step.
    - ``last_block_idx [B, H, n_sel]`` and ``last_reads [B, H]``: what the latest decode step used.
    """

    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    table: tuple[torch.Tensor, torch.Tensor]
    last_block_idx: torch.Tensor | None = None
    last_reads: torch.Tensor | None = None

    @classmethod
    def empty(cls, B: int, H: int, d_k: int, d_v: int, max_len: int, *, hp: NSAParams, device: torch.device,
              dtype: torch.dtype) -> NSALayerCache:
        l, d, l_sel = hp.l, hp.d, hp.l_sel  # noqa: E741
        R, C = min(hp.w, max_len), num_cmp(max_len, l, d)

        def z(n: int, D: int) -> torch.Tensor:
            return torch.zeros(B, H, n, D, device=device, dtype=dtype)

        table = cmp_block_table(C + 1, -(-max_len // l_sel), l, d, l_sel, device=device)
        return cls(z(max_len, d_k), z(max_len, d_v), z(R, d_k), z(R, d_v), z(l, d_k), z(l, d_v),
                   z(C + 1, d_k), z(C + 1, d_v), table)

    @property
    def max_len(self) -> int:
        return self.k_sel.shape[2]

    def fill(self, k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
             k_raw: torch.Tensor, v_raw: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
             lengths: torch.Tensor) -> None:
        """Prefill from ``[B, P, H, D]`` tensors (sequence ``b`` real up to ``lengths[b]``) and the
        compressed stream ``[B, num_cmp(P), H, D]``. Tokens whose block is not complete yet (in the
        padding) are overwritten at emission before any query can see them."""
        P = k_sel.shape[1]
        self.k_sel[:, :, :P] = k_sel.transpose(1, 2)
        self.v_sel[:, :, :P] = v_sel.transpose(1, 2)
        pos = ring_positions(lengths, self.k_win.shape[2])
        self.k_win.copy_(_gather_positions(k_win, pos))
        self.v_win.copy_(_gather_positions(v_win, pos))
        l = self.ring_k.shape[2]  # noqa: E741
        pos = ring_positions(lengths, l)
        self.ring_k.copy_(_gather_positions(k_raw, pos))
        self.ring_v.copy_(_gather_positions(v_raw, pos))
        n = k_cmp.shape[1]
        self.k_cmp[:, :, :n] = k_cmp.transpose(1, 2)
        self.v_cmp[:, :, :n] = v_cmp.transpose(1, 2)

    def tensors(self) -> DecodeCaches:
        return DecodeCaches(self.k_sel, self.v_sel, self.k_win, self.v_win, self.ring_k, self.ring_v,
                            self.k_cmp, self.v_cmp)

    def append(self, t: torch.Tensor, new: NewToken, hp: NSAParams, *, emit_mean: bool,
               backend: str | None = None) -> None:
        """Store one new position ``t [B]`` per sequence (rows ``[B, H, D]``); with ``emit_mean``
        (phi = mean pooling) also the compressed token it completes (``nsa.ops.decode_cache``)."""
        append_token(t, new, self.tensors(), hp, emit_mean=emit_mean, backend=backend)

    def block_in_order(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw compression rows ``t-l+1 .. t`` in position order: ``[B, H, l, D]`` each."""
        return block_in_order(self.ring_k, t), block_in_order(self.ring_v, t)

    def emit(self, t: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, hp: NSAParams) -> None:
        """Write compressed token ``j`` (``[B, H, D]``) for sequences whose position ``t = j*d + l - 1``
        completes it; the others write into the scratch slot (no host sync to decide)."""
        emit(self.tensors(), t, k_new, v_new, hp)


@dataclass
class DenseLayerCache:
    """The dense baseline's KV cache: ``k, v [B, H, max_len, D]``, position ``p`` in slot ``p``."""

    k: torch.Tensor
    v: torch.Tensor
    last_reads: torch.Tensor | None = None

    @classmethod
    def empty(cls, B: int, H: int, d_k: int, d_v: int, max_len: int, *, device: torch.device,
              dtype: torch.dtype) -> DenseLayerCache:
        return cls(torch.zeros(B, H, max_len, d_k, device=device, dtype=dtype),
                   torch.zeros(B, H, max_len, d_v, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


@dataclass
class ModelCache:
    """All layers' caches plus the per-sequence lengths (= position of the next token).

    ``reads_total [B]`` sums, over decode steps, layers and KV groups, the key positions each step
    read (``N_c + selected + window`` for NSA, ``t + 1`` for dense). ``host_len`` is the longest
    sequence, known on the host without a sync after ``start``. ``static`` makes every decode step use
    the same tensor shapes (needed to replay a step as a CUDA graph).
    """

    layers: list[NSALayerCache | DenseLayerCache]
    max_len: int
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    reads_total: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    host_len: int = 0
    steps: int = 0
    static: bool = False  # True: every step has the same tensor shapes (dense reads a masked max_len)

    @classmethod
    def of_layers(cls, layers: list[NSALayerCache | DenseLayerCache], max_len: int, batch_size: int,
                  device: torch.device) -> ModelCache:
        """The model's cache over its layers' empty caches (lengths and reads at zero)."""
        return cls(layers, max_len, torch.zeros(batch_size, dtype=torch.int64, device=device),
                   torch.zeros(batch_size, dtype=torch.int64, device=device))

    def start(self, lengths: torch.Tensor) -> None:
        """Begin with ``lengths[b]`` prefilled positions (one host read of the longest)."""
        dev = self.lengths.device
        self.lengths = lengths.to(device=dev, dtype=torch.int64).clone()
        self.host_len = int(self.lengths.max())
        if self.host_len > self.max_len:
            raise NSAError(f"prompt of {self.host_len} tokens exceeds the cache of {self.max_len} positions")
        if int(self.lengths.min()) < 1:
            raise NSAError("every sequence needs at least one prompt token")
        self.reads_total = torch.zeros_like(self.lengths)
        self.steps = 0

    def check_room(self) -> None:
        if self.host_len >= self.max_len:
            raise NSAError(f"decode past the cache size of {self.max_len} positions",
                           hint="create the cache with a larger max_len")

    def advance(self) -> None:
        """After a decode step: every sequence is one position longer (device and host counters)."""
        self.advance_device()
        self.advance_host()

    def advance_device(self) -> None:
        self.lengths += 1

    def advance_host(self) -> None:
        self.host_len += 1
        self.steps += 1
