"""The NSA hyper-parameters as one frozen object: the only form in which they travel through ``nsa.ops``
(which exports it), the model, decode and the benchmarks; unpacked to integers only at the Triton
custom-op boundary. A torch-free leaf module, so the config layer validates with the same rules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NSAParams:
    """``l``/``d``: compression block and stride; ``l_sel``/``n_sel``: selection block length and blocks
    per query (forced blocks included); ``w``: sliding window. Defaults are the paper's."""

    l: int = 32  # noqa: E741
    d: int = 16
    l_sel: int = 64
    n_sel: int = 16
    w: int = 512

    def __post_init__(self) -> None:
        for name in ("l", "d", "l_sel", "n_sel", "w"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"nsa.{name}={value!r} must be an integer")
            if value < 1:
                raise ValueError(f"nsa.{name}={value} must be positive")
        if self.l % self.d:
            raise ValueError(f"nsa.d={self.d} must divide nsa.l={self.l}")
        if self.l_sel % self.d:
            raise ValueError(f"nsa.d={self.d} must divide nsa.l_sel={self.l_sel}")

    @classmethod
    def tiny(cls) -> NSAParams:
        """Small blocks for CPU-sized runs and tests."""
        return cls(l=8, d=4, l_sel=16, n_sel=4, w=32)
