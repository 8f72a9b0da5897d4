"""Which environment variables a run records in ``env.json``, and which values are secrets.

Torch-free: the trainer writes with it, the run readers and the report read with it.
"""

from __future__ import annotations

import os
import re

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"
# non-NSA variables worth recording (exact names or prefixes ending in "_")
ENV_RECORDED = (
    "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "HF_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MASTER_ADDR",
    "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "CUBLAS_WORKSPACE_CONFIG",
)


def is_secret(name: str) -> bool:
    """Whether a variable's value is a secret: a word of its name (split at ``_``, ``-`` and ``.``) is one of
    :data:`SECRET_MARKERS`, its plural, or ends in one (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``APIKEY``,
    ``OAUTH``); ``NSA_TOKENIZER`` or ``TOKENIZERS_PARALLELISM`` name a tokenizer, not a token."""
    for word in re.split(r"[_.\-]+", name.upper()):
        for m in SECRET_MARKERS:
            if word in (m, m + "S") or word.endswith(m):
                return True
    return False


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Values of secret names (:func:`is_secret`: TOKEN, KEY, SECRET, PASSWORD, ...) replaced by
    ``<redacted>``."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def recorded_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The non-``NSA_*`` variables that shape a run (CUDA_*, NCCL_*, HF_*, ...), secrets redacted."""
    env = dict(os.environ) if environ is None else environ
    picked = {
        k: v for k, v in env.items()
        if any(k.startswith(p) if p.endswith("_") else k == p for p in ENV_RECORDED)
    }
    return redact_env(dict(sorted(picked.items())))
