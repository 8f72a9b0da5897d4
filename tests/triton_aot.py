"""The Triton launches an interpreter process made, compiled for a Hopper GPU by Triton's own compiler (no GPU).

The interpreter runs a kernel as NumPy: it does not type loop-carried variables, ranges or layouts as the
compiler does, so a kernel changed and checked only there can fail to compile on the machine, where the
first-launch guards hand its calls to the former path (counted, not an error). :func:`record` (in the
interpreter process) keeps each distinct launch (the kernel, its argument types, its constexprs and launch
options); :func:`compile_recorded` writes them to a file and compiles every one for ``sm_90`` in a process
without the interpreter (:func:`main`), which names each failure on a line.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

OPTIONS = ("num_warps", "num_stages")


def _constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def _value(v: Any) -> Any:
    """A constexpr value as JSON (Triton dtypes by name)."""
    import triton.language as tl

    if isinstance(v, tl.dtype):
        return {"dtype": v.name}
    if isinstance(v, tuple):
        return {"tuple": [_value(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"constexpr of type {type(v).__name__}")


def _launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    from triton.runtime.jit import mangle_type

    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    sig, const = {}, {}
    for name, p in params.items():
        v = bound.get(name, p.default)
        if _constexpr(p) or v is None:
            sig[name], const[name] = "constexpr", _value(v)
        else:
            sig[name] = mangle_type(v)
    return {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": const,
            "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}


SEEN: dict[str, dict[str, Any]] = {}


def record() -> None:
    """From now on, every distinct kernel launch of this (interpreter) process is kept in :data:`SEEN`."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        spec = _launch(self.fn, args, kwargs)
        SEEN.setdefault(json.dumps(spec, sort_keys=True), spec)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording  # type: ignore[method-assign]


def compile_recorded(path: str | Path) -> None:
    """Write the launches recorded so far to ``path`` and compile them in a process of their own (Triton's
    mode is fixed at import: this one interprets); exit 1 with its lines if any fails."""
    import os

    Path(path).write_text(json.dumps(list(SEEN.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", f"from tests.triton_aot import main; main({str(path)!r})"],
                         env=env, capture_output=True, text=True, check=False)
    print(res.stdout[-4000:], res.stderr[-4000:] if res.returncode else "", flush=True)
    if res.returncode:
        raise SystemExit(f"the interpreter's kernels do not all compile for sm_90 (rc {res.returncode})")
    Path(path).unlink()


def _load(v: Any) -> Any:
    import triton.language as tl

    if isinstance(v, dict):
        return getattr(tl, v["dtype"]) if "dtype" in v else tuple(_load(x) for x in v["tuple"])
    return v


def _types(t: Any) -> Any:
    return tuple(_types(x) for x in t) if isinstance(t, list) else t


def compile_all(path: str | Path, arch: int = 90) -> tuple[int, list[str]]:
    """Compile every launch recorded in ``path`` for ``sm_<arch>``: (how many compiled, the failures)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    done, failures = 0, []
    for spec in json.loads(Path(path).read_text()):
        fn = getattr(importlib.import_module(spec["module"]), spec["name"])
        const = {k: _load(v) for k, v in spec["constexprs"].items()}
        sig = {k: _types(v) for k, v in spec["signature"].items()}  # tuple arguments: tuples of types
        src = ASTSource(fn=fn, signature=sig, constexprs=const)
        try:
            triton.compile(src, target=target, options=spec["options"])
            done += 1
        except Exception as exc:  # every failure is reported, whatever raised it
            first = str(exc).strip().splitlines()
            failures.append(f"{spec['module']}.{spec['name']} {spec['constexprs']}: {type(exc).__name__}: "
                            f"{' | '.join(first[-3:])[:400]}")
    return done, failures


def main(path: str) -> None:
    """Compile the launches in ``path``; print how many, and each failure on a line (exit 1 if any)."""
    import time

    t0 = time.monotonic()
    done, failures = compile_all(path)
    print(f"compiled {done} kernel launches for sm_90 in {time.monotonic() - t0:.0f} s", flush=True)
    for line in failures:
        print(f"does not compile: {line}", flush=True)
    if failures or done == 0:
        raise SystemExit(1)
