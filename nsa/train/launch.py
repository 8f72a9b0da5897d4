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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from nsa.errors import ConfigError
from nsa.rundir.layout import EXIT_INTERRUPTED


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
            f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", f"--nproc-per-node={nproc}",
            *program]


_FAILED = re.compile(r"torch/distributed/elastic/multiprocessing/api\.py.*\bfailed \(exitcode: (-?\d+)\)")


@dataclass
class _Relay:
    """What the relay of torchrun's standard error saw: the failed rank's exit codes, and torchrun's own
    traceback once the ranks were asked to halt (held back: the launcher prints it only when the ranks did
    not halt cleanly)."""

    codes: list[int] = field(default_factory=list)
    halting: bool = False
    held: list[str] = field(default_factory=list)


def _relay(stream: IO[str], say: Callable[[str], None], seen: _Relay) -> None:
    """Copy torchrun's standard error (its own and the ranks') line by line, except torchrun's failure
    report (a traceback and a summary block after a rank failed): the rank has said what went wrong in
    one line already. The failed rank's exit code goes to ``seen.codes``; after a halt request, a traceback
    of torchrun's (its ``SignalException`` when stopped) to ``seen.held``."""
    quiet = False
    for line in stream:
        m = _FAILED.search(line)
        if m:
            quiet = True
            seen.codes.append(int(m.group(1)))
        if seen.halting and (seen.held or line.startswith("Traceback (most recent call last):")):
            seen.held.append(line)
        elif not quiet:
            sys.stderr.write(line)
            sys.stderr.flush()
    if seen.codes:
        say(f"error: a rank exited with code {seen.codes[0]}; its own message is above (torchrun's report "
            "omitted)")


def launch(argv: Sequence[str], notice: Callable[[str], None] | None = None,
           run_dir: str | Path | None = None) -> int:
    """Run torchrun (``argv``) as a child; SIGTERM/SIGINT here halt the ranks gracefully; its exit code.

    The first signal is passed as SIGTERM to the rank processes only (each checkpoints and exits 0, so
    torchrun exits 0); a second one terminates torchrun itself. The same signal again within
    ``SAME_REQUEST_S`` is a copy of the first (a signal to the process group reaches this launcher and ``uv
    run``, which forwards it once more), not a second request. torchrun runs in its own session so that
    Ctrl-C on the terminal reaches this launcher only. ``notice`` receives one line per forwarded signal
    (default: standard error). When a rank fails, its exit code is returned (2 for a user error, which it
    reported in one line) and torchrun's own traceback is left out. When every rank of ``run_dir`` halted
    cleanly after a signal, the exit code is 0 whatever torchrun exited with, and its traceback is left out.
    """
    import signal
    import subprocess
    import threading

    import psutil

    from nsa.train.signals import SAME_REQUEST_S, is_copy

    say = notice or (lambda line: print(line, file=sys.stderr, flush=True))
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.time()
    proc = subprocess.Popen(list(argv), start_new_session=True, stderr=subprocess.PIPE, text=True, bufsize=1,
                            errors="replace")
    assert proc.stderr is not None
    seen = _Relay()
    relay = threading.Thread(target=_relay, args=(proc.stderr, say, seen), daemon=True)
    relay.start()
    received: list[str] = []
    last: list[tuple[int, float]] = []

    def forward(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if is_copy(signum, last[-1] if last else None, now):
            return  # one request, delivered twice
        last.append((signum, now))
        received.append(signal.Signals(signum).name)
        seen.halting = True
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
        while relay.is_alive() and not (code and seen.codes) and time.monotonic() < deadline:
            relay.join(timeout=0.2)
        if code and received and run_dir is not None and _halted(run_dir, started):
            say(f"torchrun exited {code} after every rank halted cleanly: exit 0")
            return 0
        # the operator's second request: torchrun stopped, its traceback omitted
        if code and len(received) > 1:
            say(f"stopped at once: {received[1]} again terminated torchrun before every rank had halted")
            return EXIT_INTERRUPTED
        sys.stderr.writelines(seen.held)
        return seen.codes[0] if code and seen.codes and seen.codes[0] > 0 else code
    finally:
        if last:  # a copy of the last signal still on its way is absorbed here, not by the default handler
            time.sleep(max(0.0, last[-1][1] + SAME_REQUEST_S - time.monotonic()))
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _halted(run_dir: str | Path, since: float) -> bool:
    """Every rank of the session booted after ``since`` ended ``halted`` (their heartbeats' last sessions)."""
    import json

    from nsa.rundir import RunDir

    ends: dict[int, str | None] = {}
    world = None
    for path in RunDir(run_dir).heartbeats():
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                    ev = json.loads(line)
                    rank, ts = int(ev["rank"]), float(ev["ts"])
                    if ev.get("event") == "boot" and ts >= since:
                        ends[rank], world = None, ev.get("world_size")
                    elif ev.get("event") == "end" and rank in ends:
                        ends[rank] = ev.get("status")
    return bool(ends) and len(ends) == world and all(status == "halted" for status in ends.values())
# the launcher's own options: what a rank's command line leaves out
LAUNCH_OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id")


def strip_launch_options(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launcher's own options (``--nproc-per-node N``, ``--nnodes=N``, ...)."""
    out = list(argv)
    for option in LAUNCH_OPTIONS:
        out = strip_option(out, option)
    return out


def relaunch(nproc: int, program: Sequence[str], argv: Sequence[str], rdzv: Rendezvous | None = None,
             say: Callable[[str], None] | None = None, run_dir: str | Path | None = None) -> int:
    """Run a command again on ``nproc`` ranks of this node through torchrun: ``python <program> <argv>``
    (``program``: e.g. ``["-m", "nsa_cli"]``, ``argv`` this process's arguments, the launcher's own options
    left out); ``say`` hears the launch line; ``run_dir``: the run the ranks write (a clean halt of all of
    them is exit 0, :func:`launch`). torchrun's exit code."""
    cmd = torchrun_argv(nproc, [*program, *strip_launch_options(argv)], rdzv)
    (say or (lambda line: print(line, file=sys.stderr, flush=True)))(f"launching: {' '.join(cmd[1:])}")
    return launch(cmd, run_dir=run_dir)
