"""One dispatch point for every NSA op: a registry of ``op -> backend -> implementation``, a backend
chosen per call, fallbacks counted.

Ops: ``compress_avg``, ``select_blocks``, ``nsa_attention`` (training; implemented by the modules
``reference``, ``torch_path`` and ``triton_path`` under the same names) and ``nsa_decode``,
``append_token`` (decoding; the torch path is their reference, the fused Triton step their fast path),
registered by :mod:`nsa.ops.decode` and :mod:`nsa.ops.decode_cache`.

Order of choice: the call's ``backend=`` argument, then an active ``use_backend(...)`` block, then the
process default (``set_default_backend``; ``auto`` unless set). The ops read no settings: the model is built
with the run's ``runtime.attn_backend`` (which ``NSA_ATTN_BACKEND`` sets) and passes it on every call.
``auto`` means Triton for CUDA tensors when it can serve the call, else the vectorised torch path. A backend
that cannot serve a call falls back to the torch path and increments ``fallback_counts()[reason]`` (host-side
counters, no device sync).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from nsa.ops import reference, torch_path
from nsa.ops.fallbacks import record_fallback

try:  # the Triton backend is optional: without triton, every call runs the torch path
    from nsa.ops import triton_path as _triton_path
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    _triton_path = None  # type: ignore[assignment]

BACKENDS = ("reference", "torch", "triton")

# the ``use_backend`` blocks open now, innermost last: a plain module global (not a ContextVar, which
# ``torch.compile(fullgraph=True)`` cannot trace), so a compiled caller guards on it and recompiles if it
# changes
_override: list[str] = []
_default = "auto"


def set_default_backend(name: str | None) -> None:
    """The backend of calls that name none, outside ``use_backend`` blocks (``None``: back to ``auto``)."""
    global _default
    name = name or "auto"
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown NSA backend '{name}': choose one of auto, {', '.join(BACKENDS)}")
    _default = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the ops in this block on ``name`` (unless a call passes ``backend=`` itself); process-wide, for
    the block's duration (threads share it)."""
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown NSA backend '{name}': choose one of auto, {', '.join(BACKENDS)}")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


# imported once with this module, so ``pick`` is a dict lookup that torch.compile traces without a break
_LOADED: dict[str, ModuleType | None] = {"reference": reference, "torch": torch_path, "triton": _triton_path}


def _triton_reason(tensors: tuple[torch.Tensor, ...]) -> str | None:
    mod = _LOADED["triton"]
    if mod is None:
        return "triton unavailable"
    reason: str | None = mod.supports(*tensors)
    return reason


def requested_backend(backend: str | None = None) -> str:
    if backend is not None:
        name = backend
    elif _override:
        name = _override[-1]
    else:
        name = _default
    if name not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown NSA backend '{name}': choose one of auto, {', '.join(BACKENDS)}")
    return name


Impl = Callable[..., Any]
Unsupported = Callable[..., "str | None"]
_REGISTRY: dict[str, dict[str, tuple[Impl, Unsupported | None]]] = {}


def register(op: str, backend: str, fn: Impl, unsupported: Unsupported | None = None) -> None:
    """``fn`` implements ``op`` on ``backend``; ``unsupported(*tensors, **hparams)`` says why it cannot
    serve a call (``None``: it can)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown NSA backend '{backend}'")
    _REGISTRY.setdefault(op, {})[backend] = (fn, unsupported)


def pick(op: str, backend: str | None, tensors: tuple[torch.Tensor, ...], **hparams: Any) -> tuple[str, Impl]:
    """``(backend name, implementation)`` of ``op`` for ``tensors``: the requested backend, ``auto`` =
    Triton for CUDA tensors and the torch path otherwise; a Triton request it cannot serve falls back to
    the torch path, counted as ``"<op>:triton->torch:<reason>"``."""
    impls = _REGISTRY[op]
    name = requested_backend(backend)
    if name == "auto":
        name = "triton" if any(t.is_cuda for t in tensors) else "torch"
    if name == "triton":
        entry = impls.get("triton")
        if entry is None:
            reason: str | None = "triton unavailable"
        else:  # the op's own check where it has one, else the training kernels' (dtype, head dim, device)
            reason = entry[1](*tensors, **hparams) if entry[1] is not None else _triton_reason(tensors)
        if reason is not None:
            record_fallback(f"{op}:triton->torch:{reason}")
            name = "torch"
    return name, impls[name][0]


for _op in ("compress_avg", "select_blocks", "nsa_attention"):
    for _name in BACKENDS:
        _mod = _LOADED[_name]
        if _mod is not None:
            register(_op, _name, getattr(_mod, _op))


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can serve a call on ``device`` (bf16 on CUDA, float32 elsewhere)."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    probe = torch.empty(1, 64, 2, 64, device=dev, dtype=dtype)
    out = ["reference", "torch"]
    if _triton_reason((probe,)) is None:
        out.append("triton")
    return out
