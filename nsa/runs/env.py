"""Which environment variables a run records in ``env.json``, and which values are secrets.

Torch-free: the trainer writes with it, the run readers and the report read with it.
"""

from __future__ import annotations

import os

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"
# non-NSA variables worth recording (exact names or prefixes ending in "_")
ENV_RECORDED = (
    "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "HF_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MASTER_ADDR",
    "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "CUBLAS_WORKSPACE_CONFIG",
)


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(m in upper for m in SECRET_MARKERS)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Values of names containing TOKEN, KEY, SECRET, PASSWORD, ... replaced by ``<redacted>``."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def recorded_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The non-``NSA_*`` variables that shape a run (CUDA_*, NCCL_*, HF_*, ...), secrets redacted."""
    env = dict(os.environ) if environ is None else environ
    picked = {
        k: v for k, v in env.items()
        if any(k.startswith(p) if p.endswith("_") else k == p for p in ENV_RECORDED)
    }
    return redact_env(dict(sorted(picked.items())))
