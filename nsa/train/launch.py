"""Launching a run on several ranks (of one node, or of several through torchrun's c10d rendezvous):
torchrun as a child process, with graceful signal forwarding."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nsa.errors import ConfigError


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


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of a multi-node run meet: torchrun's c10d rendezvous at ``endpoint`` (host:port of
    one node, reachable from all), ``nnodes`` nodes, this one ``node_rank``; ``run_id`` names the job."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    run_id: str = "nsa"

    def check(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.endpoint:
            raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the same on every node)",
                              hint="e.g. --rdzv-endpoint node0.example:29500")
        if self.endpoint and ":" not in self.endpoint:
            raise ConfigError(f"--rdzv-endpoint {self.endpoint!r} must be HOST:PORT")


def torchrun_argv(nproc: int, program: Sequence[str], rdzv: Rendezvous | None = None) -> list[str]:
    """The command that runs ``python <program>`` (e.g. ``["-m", "pkg", "train", ...]``) on ``nproc``
    ranks of this node through torchrun: ``--standalone`` (a local rendezvous) for one node, else the c10d
    rendezvous of ``rdzv``."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    if rdzv is None or (rdzv.nnodes == 1 and rdzv.endpoint is None):
        return [*head, "--standalone", f"--nproc-per-node={nproc}", *program]
    rdzv.check()
    return [*head, f"--nnodes={rdzv.nnodes}", f"--node-rank={rdzv.node_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", f"--nproc-per-node={nproc}", *program]


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
