"""One Python under ``TRITON_INTERPRET=1`` that runs the interpreter jobs of the tests (``tests.conftest.Job``) on
a machine without CUDA: it imports torch (one thread), Triton, the Triton path and the tests' shared helpers once, then
runs each job in a fork of itself. A fork is as fresh as a new ``python -c`` for what the jobs see: their
modules imported (nothing else ran), torch's generator as seeded at import (checked before each job), ``__main__``
a module of its own; it only skips the ~8 s of imports that every interpreter process paid before.

Protocol, one JSON line each way: ``{"code", "stdout", "stderr", "timeout"}`` on stdin (the job's output
goes to the two files named), ``{"rc", "timed_out"}`` back on stdout; the server ends at end of input.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import sys
import time
import traceback
import types
from typing import Any, NoReturn


def _exit_code(e: SystemExit) -> int:
    """What ``python -c`` exits with for ``e``: 0 for ``None``, the number, else 1 (the message printed)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(req: dict[str, Any], reply_fd: int, fresh_rng: Any) -> NoReturn:
    rc = 1
    try:
        os.close(reply_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        import torch

        rc = 0
        try:
            if not torch.equal(torch.get_rng_state(), fresh_rng):
                raise RuntimeError("the interpreter server drew from torch's generator before the job")
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            sys.argv = ["-c"]
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        except SystemExit as e:
            rc = _exit_code(e)
        except BaseException:
            traceback.print_exc()
            rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _wait(pid: int, timeout: float, parent: int) -> tuple[int, bool]:
    """The job's exit code as ``subprocess`` gives it (``-signal`` when killed) and whether it timed out;
    a job of a pytest process that is gone is killed."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline or os.getppid() != parent:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), True
        time.sleep(0.02)


def main() -> None:
    parent = os.getppid()
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the imports print goes to the server's stderr, never into the replies
    import torch

    fresh_rng = torch.get_rng_state()  # as torch seeded it at import (from the OS: each process its own)
    torch.set_num_threads(1)
    import triton  # noqa: F401

    import nsa.ops.triton_path  # noqa: F401
    import tests.conftest  # noqa: F401

    assert torch.equal(torch.get_rng_state(), fresh_rng), "an import drew from torch's generator"
    while line := sys.stdin.readline():
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, reply.fileno(), fresh_rng)
        rc, timed_out = _wait(pid, float(req["timeout"]), parent)
        reply.write(json.dumps({"rc": rc, "timed_out": timed_out}) + "\n")


if __name__ == "__main__":
    main()
