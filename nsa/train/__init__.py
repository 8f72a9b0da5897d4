"""Training: the trainer, checkpoints, telemetry, signals and distributed set-up.

``from nsa.train import Trainer, TrainResult``; torch is imported only when one of them is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainResult", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from nsa.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'nsa.train' has no attribute {name!r}")
