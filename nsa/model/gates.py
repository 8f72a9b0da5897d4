"""The gate options of an NSA layer as one frozen object (like ``NSAParams`` for the op's hyper-parameters):
built from the config in one place (:meth:`GateParams.of_config`), passed whole to every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nsa.config import NSAConfig

Triple = tuple[float, float, float]
_DEFAULT = NSAConfig()  # the gate defaults are the config's (one owner: nsa.config.run.NSAConfig)


def _triple(values: Any) -> Triple:
    a, b, c = (float(v) for v in values)
    return a, b, c


@dataclass(frozen=True)
class GateParams:
    """``kind``: ``sigmoid`` per branch or ``softmax`` over the three; logits ``bias + scale * mlp(x)`` with
    ``mlp = Linear(dim, hidden) -> SiLU -> Linear(hidden, n_heads * 3)`` (``hidden`` ``None``: ``dim // 4``);
    ``fixed``: constant gates instead (ablations, the MLP unused); ``collapse_threshold``: the share above
    which a gate counts as collapsed in the statistics. Order (cmp, sel, win); docs/design.md, "Gates"."""

    kind: str = _DEFAULT.gate
    hidden: int | None = _DEFAULT.gate_hidden
    bias: Triple = _DEFAULT.gate_bias
    scale: float = _DEFAULT.gate_scale
    fixed: Triple | None = _DEFAULT.fixed_gates
    collapse_threshold: float = _DEFAULT.collapse_threshold

    def __post_init__(self) -> None:
        if self.kind not in ("sigmoid", "softmax"):
            raise ValueError(f"nsa.gate='{self.kind}' must be 'sigmoid' or 'softmax'")
        object.__setattr__(self, "bias", _triple(self.bias))
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "fixed", None if self.fixed is None else _triple(self.fixed))

    @classmethod
    def of_config(cls, n: NSAConfig) -> GateParams:
        """The gate options of an ``nsa`` config section."""
        return cls(kind=n.gate, hidden=n.gate_hidden, bias=n.gate_bias, scale=n.gate_scale,
                   fixed=n.fixed_gates, collapse_threshold=n.collapse_threshold)

    @classmethod
    def of_keywords(cls, gate: str = _DEFAULT.gate, gate_hidden: int | None = _DEFAULT.gate_hidden,
                    gate_bias: Triple = _DEFAULT.gate_bias, gate_scale: float = _DEFAULT.gate_scale,
                    fixed_gates: Triple | None = _DEFAULT.fixed_gates,
                    collapse_threshold: float = _DEFAULT.collapse_threshold) -> GateParams:
        """The layer's loose keywords of before issue 34, which the ``modeling_nsa.py`` of earlier Hugging
        Face exports still passes (:class:`nsa.model.attention.NSAAttention`)."""
        return cls(kind=gate, hidden=gate_hidden, bias=gate_bias, scale=gate_scale, fixed=fixed_gates,
                   collapse_threshold=collapse_threshold)
