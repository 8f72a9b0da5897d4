"""Data: tokenizers, sources, packing and the prefetch loader.

Attributes are imported lazily: ``nsa.config`` imports ``nsa.config.data``, and that must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataConfig": "nsa.config.data",
    "Loader": "nsa.data.loader",
    "build_loader": "nsa.data.loader",
    "Tokenizer": "nsa.data.tokenizers",
    "get_tokenizer": "nsa.data.tokenizers",
    "open_source_probe": "nsa.data.sources",
    "check_local_inputs": "nsa.data.sources",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nsa.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
