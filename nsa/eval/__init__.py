"""Evaluating a trained model: needle retrieval, multi-query associative recall, held-out loss, and an NSA
model's selection diagnostics.

``nsa.eval.tasks`` scores a model (anything whose ``forward(input_ids)`` returns an object with
``.logits [B, S, V]``) on the episodes of ``nsa.data.retrieval`` and on the run's validation split;
``nsa.eval.results`` builds the JSON payload and saves it (plus the needle heat map) under
``RUN/eval/``. Attributes are imported lazily, so ``import nsa.eval`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TASKS": "nsa.eval.tasks",
    "eval_needle": "nsa.eval.tasks",
    "eval_mqar": "nsa.eval.tasks",
    "eval_loss": "nsa.eval.tasks",
    "eval_selection": "nsa.eval.tasks",
    "text_haystack": "nsa.eval.tasks",
    "resolve_device": "nsa.eval.tasks",
    "check_contexts": "nsa.eval.tasks",
    "check_depths": "nsa.eval.tasks",
    "min_context": "nsa.eval.tasks",
    "build_payload": "nsa.eval.results",
    "save_results": "nsa.eval.results",
    "run_dir_of": "nsa.eval.results",
    "needle_heatmap": "nsa.eval.results",
    "write_json": "nsa.eval.results",
    "to_json": "nsa.eval.results",
    "context_label": "nsa.eval.results",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nsa.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
