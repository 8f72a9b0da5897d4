"""Compile and run one tiny Triton kernel (preflight's proof that the Triton toolchain works)."""

from __future__ import annotations

import time

import triton
import triton.language as tl


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)


def compile_and_run(n: int = 1000) -> tuple[bool, str]:
    """``(ok, one-line message)``; compiles on the current CUDA device and checks the result."""
    import torch

    t0 = time.perf_counter()
    try:
        x = torch.randn(n, device="cuda")
        y = torch.randn(n, device="cuda")
        out = torch.empty_like(x)
        _axpy_kernel[(triton.cdiv(n, 256),)](x, y, out, n, 2.0, BLOCK=256)
        torch.cuda.synchronize()
    except Exception as exc:
        return (False,
                f"Triton kernel failed to compile/run: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}")
    err = float((out - (2.0 * x + y)).abs().max())
    if err > 1e-5:
        return False, f"Triton kernel ran but computed wrong values (max error {err:.1e})"
    return True, f"Triton {triton.__version__} compiled and ran a kernel in {time.perf_counter() - t0:.2f} s"
