"""Launching a run on several local ranks: torchrun as a child process, with graceful signal forwarding."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any


def strip_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option N`` / ``option=N`` (e.g. ``--nproc-per-node``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == option:
            skip = True
            continue
        if arg.startswith(option + "="):
            continue
        out.append(arg)
    return out


def torchrun_argv(nproc: int, program: Sequence[str]) -> list[str]:
    """The command that runs ``python <program>`` (e.g. ``["-m", "pkg", "train", ...]``) on ``nproc``
    local ranks through torchrun (``--standalone``: a local rendezvous)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *program]


def launch(argv: Sequence[str], notice: Callable[[str], None] | None = None) -> int:
    """Run torchrun (``argv``) as a child; SIGTERM/SIGINT here halt the ranks gracefully; its exit code.

    The first signal is passed as SIGTERM to the rank processes only (each checkpoints and exits 0, so
    torchrun exits 0); a second one terminates torchrun itself. torchrun runs in its own session so
    that Ctrl-C on the terminal reaches this launcher only. ``notice`` receives one line per forwarded
    signal (default: standard error).
    """
    import signal
    import subprocess

    import psutil

    say = notice or (lambda line: print(line, file=sys.stderr, flush=True))
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(list(argv), start_new_session=True)
    received: list[str] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        if len(received) > 1:
            proc.terminate()
            return
        try:
            ranks = psutil.Process(proc.pid).children()  # the rank processes torchrun started
        except psutil.NoSuchProcess:
            return
        for child in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGTERM)
        say(f"{received[0]}: asked {len(ranks)} rank(s) to halt; send it again to stop at once")

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
