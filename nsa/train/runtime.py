"""Device and precision resolution, determinism, seeds and RNG state capture.

``auto`` device is CUDA when available, else CPU. ``auto`` precision is bf16 autocast (fp32 master
weights) on a GPU that supports it, else fp32. Impossible requests raise ``ConfigError`` before any work.
"""

from __future__ import annotations

import os
import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nsa.config import RunConfig
from nsa.errors import ConfigError


@dataclass(frozen=True)
class Runtime:
    """Resolved device and precision of this process."""

    device: torch.device
    precision: str  # "fp32" or "bf16"

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 autocast on GPU; nothing (plain fp32) otherwise."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


BF16_HINT = "use runtime.precision=fp32 (or auto)"


def bf16_support(device_type: str, device: Any = None) -> tuple[bool, str]:
    """``(whether nsa train runs bf16 there, where)``: a CUDA device that supports it; never the CPU, where
    training runs fp32. The one answer of ``resolve_runtime`` and preflight's bf16 check."""
    if device_type != "cuda":
        return False, "the CPU"
    return bool(torch.cuda.is_bf16_supported()), torch.cuda.get_device_name(device)


def resolve_runtime(cfg: RunConfig, local_rank: int = 0) -> Runtime:
    """Pick the device and precision, or raise ``ConfigError`` naming the key."""
    rt = cfg.runtime
    has_cuda = torch.cuda.is_available()
    if rt.device == "cuda" and not has_cuda:
        raise ConfigError(
            "runtime.device=cuda but no CUDA device is available",
            hint="use runtime.device=cpu or auto (NSA_DEVICE / --set runtime.device=auto)",
        )
    device_type = "cuda" if (rt.device == "cuda" or (rt.device == "auto" and has_cuda)) else "cpu"
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    bf16_ok, where = bf16_support(device_type, device)
    precision = rt.precision
    if precision == "auto":
        precision = "bf16" if bf16_ok else "fp32"
    elif precision == "bf16" and not bf16_ok:
        raise ConfigError(f"runtime.precision=bf16 is not supported on {where}", hint=BF16_HINT)
    elif precision == "fp16":
        raise ConfigError(
            "runtime.precision=fp16 is not supported by nsa train",
            hint="use bf16 on a GPU that has it, else fp32 (or auto)",
        )
    return Runtime(device=device, precision=precision)


def check_training_config(cfg: RunConfig) -> None:
    """Combinations the schema alone cannot reject; raises ``ConfigError`` naming the key."""
    tr = cfg.train
    if cfg.eval.every > 0 and cfg.data.val_fraction <= 0:
        raise ConfigError(
            f"eval.every={cfg.eval.every} needs data.val_fraction > 0 (it is {cfg.data.val_fraction})",
            hint="set data.val_fraction (e.g. 0.02) or eval.every=0",
        )
    if tr.stop_at is not None and tr.stop_at > tr.steps:
        raise ConfigError(f"train.stop_at={tr.stop_at} is beyond train.steps={tr.steps}",
                          hint="stop at a step up to train.steps, or leave train.stop_at unset")
    data = cfg.data
    if data.loss_on == "answers" and (data.source != "synthetic" or data.synthetic_task == "random"):
        raise ConfigError(
            f"data.loss_on=answers needs a task with answers (data.source={data.source}, "
            f"data.synthetic_task={data.synthetic_task})",
            hint="use data.source=synthetic with data.synthetic_task=needle, mqar or assoc_recall, or "
                 "data.loss_on=all",
        )


LONG_RUN_STEPS = 1000


def long_run_warnings(cfg: RunConfig) -> list[str]:
    """Settings a long run (``train.steps >= 1000``) should not have; each a line naming the key."""
    tr, ck, out = cfg.train, cfg.checkpoint, []
    long = tr.steps >= LONG_RUN_STEPS
    if long and (ck.every == 0 or ck.every >= tr.steps):
        out.append(f"checkpoint.every={ck.every}: no periodic checkpoint in a {tr.steps}-step run, so a "
                   "crash loses everything since the start (set e.g. "
                   f"checkpoint.every={max(100, tr.steps // 20)})")
    if long and cfg.eval.every == 0:
        out.append(f"eval.every=0: no held-out loss over {tr.steps} steps (set e.g. eval.every="
                   f"{max(100, tr.steps // 20)})")
    if long and cfg.logging.every > tr.steps // 20:
        out.append(f"logging.every={cfg.logging.every}: fewer than 20 progress points over {tr.steps} steps")
    if ck.keep_last < 2 and ck.every > 0:
        out.append("checkpoint.keep_last=1: a corrupted newest checkpoint leaves none to fall back to (keep "
                   "2 or more)")
    if cfg.data.synthetic_on_fail and cfg.data.source != "synthetic":
        out.append(f"data.synthetic_on_fail=true: an outage of data.source={cfg.data.source} would train on "
                   "synthetic tokens (loudly recorded, but the run goes on)")
    if long and cfg.runtime.deterministic and cfg.runtime.device != "cpu":
        out.append("runtime.deterministic=true: deterministic GPU kernels are slower; meant for debugging")
    return out


def apply_alloc_conf(cfg: RunConfig) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` from ``runtime.alloc_conf`` (``NSA_ALLOC_CONF``). The CUDA
    caching allocator reads it once, when CUDA is first initialised, so this must run before anything
    touches CUDA; returns a warning when it cannot take effect any more (``None`` otherwise)."""
    want = cfg.runtime.alloc_conf
    if not want:
        return None
    have = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if torch.cuda.is_initialized():
        if have == want:
            return None
        return (f"runtime.alloc_conf={want!r} not applied: CUDA was initialised before the trainer "
                "(set PYTORCH_CUDA_ALLOC_CONF before starting Python)")
    if have is not None and have != want:
        return (f"runtime.alloc_conf={want!r} not applied: PYTORCH_CUDA_ALLOC_CONF={have!r} is set in the "
                "environment")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = want
    return None


def apply_runtime_settings(cfg: RunConfig, rt: Runtime) -> dict[str, Any]:
    """Global torch switches: TF32, determinism (``apply_alloc_conf`` runs earlier, before CUDA starts).

    Returns the previous values for :func:`restore_runtime_settings`.
    """
    previous = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }
    if rt.device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.runtime.tf32
        torch.backends.cudnn.allow_tf32 = cfg.runtime.tf32
    if cfg.runtime.deterministic:
        if rt.device_type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return previous


def restore_runtime_settings(previous: dict[str, Any]) -> None:
    """Undo :func:`apply_runtime_settings` (a trainer used in-process leaves torch as it found it)."""
    torch.use_deterministic_algorithms(previous["deterministic"])
    torch.backends.cudnn.benchmark = previous["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = previous["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = previous["cudnn_tf32"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's own device only
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def _numpy_state() -> dict[str, Any]:
    """NumPy's legacy generator state as plain values (loadable with ``weights_only=True``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {"name": name, "keys": np.asarray(keys).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached": float(cached)}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif state.get("cuda"):  # checkpoints before 2026-11-26: every device the saving process could see
        saved = state["cuda"]
        torch.cuda.set_rng_state(saved[device] if device < len(saved) else saved[0], device)
