"""The decode caches' tensors as named tuples (layouts in :mod:`nsa.ops.decode_cache`), shared by the torch
path and the fused Triton kernel."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DecodeCaches(NamedTuple):
    """The cache tensors one NSA layer decodes with (layouts in the module doc)."""

    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor


class NewToken(NamedTuple):
    """One position per sequence, ``[B, H, D]`` each: selection, window and raw compression K/V."""

    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor
