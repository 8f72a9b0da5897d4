"""A training step's device time by part: every kernel of a profiled step put in one part by its name (first
matching rule of :data:`PARTS`), so the NSA and dense steps can be read side by side, item by item."""

from __future__ import annotations

import re
from collections.abc import Iterable

# (part, pattern on the kernel name), the first match wins: our Triton kernels first (their names are ours),
# then
# the libraries', then what Inductor generated
PARTS: tuple[tuple[str, str], ...] = (
    ("nsa selected", r"_sel_"),
    ("nsa compressed/window (range kernels)", r"_range_"),
    ("nsa block scores + top-n", r"_block_scores|_top_blocks"),
    ("nsa layout copies", r"_to_virtual|_to_rows|regroup"),
    ("nsa decode/other", r"^_(?!_)\w+_kernel$"),
    ("attention library (cuDNN/flash)", r"cudnn|flash|fmha|attn"),
    ("sorts and scans", r"radix|[Ss]ort|[Ss]can|cub::"),
    ("optimizer", r"multi_tensor|[Aa]dam"),
    ("GEMM", r"nvjet|gemm|cutlass|xmma|cublas|sm90_|sm80_|wgmma"),
    ("fused elementwise (Inductor)", r"^triton_"),
    ("elementwise/reduce (ATen)", r"elementwise|reduce_kernel|vectorized|index|gather|scatter|[Cc]at|copy"),
    ("memcpy/memset", r"[Mm]emcpy|[Mm]emset"),
)
OTHER = "other"


def part_of(name: str) -> str:
    """The part a kernel named ``name`` belongs to (:data:`PARTS`, else :data:`OTHER`)."""
    for part, pattern in PARTS:
        if re.search(pattern, name):
            return part
    return OTHER


def parts_of(kernels: Iterable[tuple[str, float, int]]) -> dict[str, float]:
    """``{part: ms}`` of ``(name, ms, launches)`` kernels, largest first, with ``"launches"`` the launch
    total."""
    ms: dict[str, float] = {}
    launches = 0
    for name, t, n in kernels:
        part = part_of(name)
        ms[part] = ms.get(part, 0.0) + t
        launches += n
    ranked = {k: round(v, 4) for k, v in sorted(ms.items(), key=lambda kv: -kv[1])}
    return {**ranked, "launches": float(launches)}


__all__ = ["OTHER", "PARTS", "part_of", "parts_of"]
