"""Native Sparse Attention: library (ops, model, trainer, checks, reports).

Attributes are imported lazily so that ``import nsa`` (and ``nsa --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "RunConfig": "nsa.config",
    "ModelConfig": "nsa.config",
    "NSAConfig": "nsa.config",
    "RuntimeConfig": "nsa.config",
    "load_run_config": "nsa.config",
    "load_named": "nsa.config",
    "NSAError": "nsa.errors",
    "ConfigError": "nsa.errors",
    "NSAAttention": "nsa.model",
    "NSALM": "nsa.model",
    "build_model": "nsa.model",
    "Trainer": "nsa.train.trainer",
    "TrainResult": "nsa.train.trainer",
    "run_preflight": "nsa.checks.preflight",
    "run_smoke": "nsa.checks.smoke",
    "build_report": "nsa.runs.report",
    "halt_run": "nsa.runs.halt",
    "load_profile": "nsa.config.profiles",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nsa' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
