"""``nsa train`` as one library call: :func:`train_run` resolves the run config from the command line's flags,
takes a resumed run's lock early, validates everything, then trains in this process or launches the ranks
through torchrun (:func:`nsa.train.launch.relaunch`); its :class:`TrainOutcome` is the command's exit code and
what it says. It reads the run directory after a launch (whether the watchdog halted it), so it sits above the
trainer (``nsa.train``) and the run readers (``nsa.runs``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa.errors import ConfigError
from nsa.rundir.layout import EXIT_INTERRUPTED, EXIT_WATCHDOG
from nsa.train.launch import Rendezvous
from nsa.view import Block, Line, Result, option

EXIT_OK, EXIT_FAILED = 0, 1


@dataclass
class TrainRequest:
    """What ``nsa train`` was asked: a config (``config``, ``profile``, the given config ``flags`` by
    parameter name, ``--set`` items), and the ranks (``nproc_per_node`` on each of ``nnodes`` nodes, this one
    ``node_rank``, meeting at ``rdzv_endpoint`` as job ``rdzv_id``) with this process's command line ``argv``
    and ``program`` (``python <program> <argv>`` is what each rank runs)."""

    config: str | None = option(None, "--config", "Run config", kind="config")
    profile: str | None = option(None, "--profile", "Hardware profile name or YAML path.", kind="profile")
    sets: list[str] | None = option(None, "--set", "section.key=value for any config key", kind="sets")
    nproc_per_node: int | None = option(None, "--nproc-per-node", "Launch torchrun with N ranks on this node "
                                        "(runtime.parallel: ddp or fsdp).", min=1)
    nnodes: int = option(1, "--nnodes",
                         "Nodes of a multi-node run (with --nproc-per-node and --rdzv-endpoint).", min=1)
    node_rank: int = option(0, "--node-rank", "This node's index, 0..nnodes-1.", min=0)
    rdzv_endpoint: str | None = option(None, "--rdzv-endpoint", "HOST:PORT of node 0, which hosts the "
                                       "rendezvous store (static rendezvous); the same on every node.")
    rdzv_id: str = option("nsa", "--rdzv-id", "Job id shared by the nodes of one run.")
    flags: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    program: list[str] = field(default_factory=list)


@dataclass
class TrainOutcome(Result):
    """How ``nsa train`` ends: 0 completed or halted on request, 1 failed, 3 halted by the watchdog, 130 after
    Ctrl-C twice (torchrun's code after a launch); ``line``: what it says on stderr, if anything."""

    code: int = EXIT_OK
    line: str | None = None

    @property
    def exit_code(self) -> int:
        return self.code

    def to_dict(self) -> dict[str, Any]:
        return {"exit_code": self.code, "line": self.line}

    def view(self) -> list[Block]:
        return [Line(self.line, err=True, wrap=False)] if self.line else []


def _early_lock(cfg: Any, nproc_per_node: int | None) -> Any:
    """A single-process resume takes its run directory's lock before torch loads (seconds), so a watch
    started right after ``nsa train --resume`` sees a new session coming instead of the last one's end.
    None for a fresh run (nothing is created before validation) and under torchrun (rank 0 takes it)."""
    ranks = os.environ.get("TORCHELASTIC_RUN_ID") is not None or os.environ.get("WORLD_SIZE", "1") != "1"
    run_dir = Path(cfg.train.out_dir)
    if cfg.train.resume is None or nproc_per_node is not None or ranks or not run_dir.is_dir():
        return None
    from nsa.train.lock import RunLock

    lock = RunLock(run_dir)
    lock.acquire()  # another writer: one line naming it, exit 2
    return lock


def train_run(req: TrainRequest, reporter: Callable[[Any], None] | None = None,
              say: Callable[[str], None] | None = None) -> TrainOutcome:
    """Train as ``req`` asks; ``reporter`` hears the trainer's events (:mod:`nsa.train.events`), ``say`` the
    launch line. Bad input raises ``NSAError`` before any work (and before torchrun starts)."""
    from nsa.config import load_run_config
    from nsa.config.fields import flag_values, flags_as_typed

    resolved = load_run_config(config=req.config, profile=req.profile, flags=flag_values(**req.flags),
                               sets=req.sets, flag_names=flags_as_typed(**req.flags))
    lock = _early_lock(resolved.config, req.nproc_per_node)
    try:
        from nsa.train.distributed import launched_by_torchrun
        from nsa.train.trainer import Trainer

        nproc, rdzv = req.nproc_per_node, Rendezvous(req.nnodes, req.node_rank, req.rdzv_endpoint,
                                                     req.rdzv_id)
        if rdzv.nnodes > 1 and nproc is None:
            raise ConfigError("--nnodes needs --nproc-per-node (ranks on each node)")
        rdzv.check()
        launching = nproc is not None and not launched_by_torchrun()
        trainer = Trainer(resolved, reporter=reporter,
                          world_size=nproc * rdzv.nnodes if launching and nproc else None,
                          local_ranks=nproc if launching else None, run_lock=lock)
    except BaseException:
        if lock is not None:  # a refused resume: .lock names the last trainer again
            lock.abandon()
        raise
    if launching and nproc is not None:
        from nsa.runs.halt import halted_by_watchdog
        from nsa.train.launch import relaunch

        code = relaunch(nproc, req.program, req.argv, rdzv, say, run_dir=trainer.run_dir)
        return TrainOutcome(code or (EXIT_WATCHDOG if halted_by_watchdog(trainer.run_dir) else EXIT_OK))
    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        return _interrupted(trainer)
    except Exception as exc:
        return _failed(trainer, exc)
    if result.status == "halted" and result.halted_by == "watchdog":
        return TrainOutcome(EXIT_WATCHDOG)
    return TrainOutcome(EXIT_OK if result.status in ("completed", "halted") else EXIT_FAILED)


def _interrupted(trainer: Any) -> TrainOutcome:
    """Ctrl-C twice: one line saying what is on disk, exit 130."""
    from nsa.rundir.checkpoints import newest_verified

    last, _ = newest_verified(trainer.run_dir)
    where = f"resume from {last.name} with --resume auto" if last else "no checkpoint to resume from"
    return TrainOutcome(EXIT_INTERRUPTED, f"interrupted at step {trainer.state.step} (Ctrl-C twice): "
                                          f"recorded as interrupted; {where}")


def _failed(trainer: Any, exc: Exception) -> TrainOutcome:
    """The one line of a run that failed on out-of-memory or a write (a full disk names the file and the
    free space); anything else goes on as a traceback (a bug)."""
    import torch

    from nsa.fileio import os_error_in, write_failure
    from nsa.rundir.checkpoints import newest_verified

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return TrainOutcome(EXIT_FAILED, f"error: CUDA out of memory at step {trainer.state.step + 1} (hint: "
                                         "lower --batch-size or --seq-len, raise --accum, or --set "
                                         "runtime.gradient_checkpointing=true)")
    disk = os_error_in(exc)
    if disk is None or isinstance(disk, FileNotFoundError):
        raise exc
    last, _ = newest_verified(trainer.run_dir)
    hint = (f"fix the cause (free disk space?), then resume from {last.name}: --resume auto" if last
            else "fix the cause (free disk space?) and start again")
    return TrainOutcome(EXIT_FAILED, f"error: run failed at step {trainer.state.step + 1}: "
                                     f"{write_failure(disk)} (hint: {hint})")
