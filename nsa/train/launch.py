"""Launching a run on several ranks (of one node, or of several through torchrun's static rendezvous):
torchrun as a child process, with graceful signal forwarding.

Several nodes meet at a *static* rendezvous: node 0 hosts the TCP store at ``--rdzv-endpoint`` and the
other nodes connect to it. The dynamic ``c10d`` rendezvous raced in two ways (issue 26): at start-up every
agent whose host name matches the endpoint tries to host the store, and after a rank failed the agent that
hosted the store could exit first, so another node's agent, still watching a healthy rank, lost the store
(``RendezvousConnectionError``) and exited 1 with a traceback instead of its rank's one-line error and
code. A static rendezvous has one host by construction and its agents do not touch the store while they
watch their ranks (``num_nodes_waiting`` is 0)."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

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
    """Where the nodes of a multi-node run meet: torchrun's static rendezvous at ``endpoint`` (host:port of
    node 0, which hosts the store; reachable from all), ``nnodes`` nodes, this one ``node_rank``; ``run_id``
    names the job."""

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
    ranks of this node through torchrun: ``--standalone`` (a local rendezvous) for one node, else the static
    rendezvous of ``rdzv`` (node 0 hosts the store at its endpoint)."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    if rdzv is None or (rdzv.nnodes == 1 and rdzv.endpoint is None):
        return [*head, "--standalone", f"--nproc-per-node={nproc}", *program]
    rdzv.check()
    return [*head, f"--nnodes={rdzv.nnodes}", f"--node-rank={rdzv.node_rank}", "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", f"--nproc-per-node={nproc}", *program]


_FAILED = re.compile(r"torch/distributed/elastic/multiprocessing/api\.py.*\bfailed \(exitcode: (-?\d+)\)")


def _relay(stream: IO[str], say: Callable[[str], None], codes: list[int]) -> None:
    """Copy torchrun's standard error (its own and the ranks') line by line, except torchrun's failure
    report (a traceback and a summary block after a rank failed): the rank has said what went wrong in
    one line already. The failed rank's exit code goes to ``codes``."""
    quiet = False
    for line in stream:
        m = _FAILED.search(line)
        if m:
            quiet = True
            codes.append(int(m.group(1)))
        if not quiet:
            sys.stderr.write(line)
            sys.stderr.flush()
    if codes:
        say(f"error: a rank exited with code {codes[0]}; its own message is above (torchrun's report omitted)")


def launch(argv: Sequence[str], notice: Callable[[str], None] | None = None) -> int:
    """Run torchrun (``argv``) as a child; SIGTERM/SIGINT here halt the ranks gracefully; its exit code.

    The first signal is passed as SIGTERM to the rank processes only (each checkpoints and exits 0, so
    torchrun exits 0); a second one terminates torchrun itself. torchrun runs in its own session so
    that Ctrl-C on the terminal reaches this launcher only. ``notice`` receives one line per forwarded
    signal (default: standard error). When a rank fails, its exit code is returned (2 for a user error,
    which it reported in one line) and torchrun's own traceback is left out.
    """
    import signal
    import subprocess
    import threading

    import psutil

    say = notice or (lambda line: print(line, file=sys.stderr, flush=True))
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(list(argv), start_new_session=True, stderr=subprocess.PIPE, text=True, bufsize=1,
                            errors="replace")
    assert proc.stderr is not None
    codes: list[int] = []
    relay = threading.Thread(target=_relay, args=(proc.stderr, say, codes), daemon=True)
    relay.start()
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
        code = proc.wait()
        # the relay may still be reading torchrun's last lines (a loaded machine, or a rank that still holds
        # the pipe): after a failure, wait for the rank's exit code a while longer than for the output
        deadline = time.monotonic() + (60.0 if code else 10.0)
        while relay.is_alive() and not (code and codes) and time.monotonic() < deadline:
            relay.join(timeout=0.2)
        return codes[0] if code and codes and codes[0] > 0 else code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
