"""``nsa train``: resolve the run config, then train (one process, or several through torchrun)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_WATCHDOG, fail, user_errors


def _flag(name: str) -> str:
    """A parameter's flag: ``seq_len`` -> ``--seq-len``."""
    return "--" + name.replace("_", "-")


def flags_to_keys(**values: Any) -> dict[str, Any]:
    """The flags that were given (not ``None``), by parameter name (``seq_len`` for ``--seq-len``), as
    ``{dotted key: value}`` for ``load_run_config``. Which key a flag sets is declared once, in the config
    field's metadata (``nsa.config.flag_keys``; ``--set section.key=value`` reaches every other key)."""
    from nsa.config import flag_keys

    keys = flag_keys()
    return {keys[_flag(name)]: (str(v) if isinstance(v, Path) else v) for name, v in values.items() if v is not None}


def flags_as_typed(**values: Any) -> dict[str, str]:
    """``{dotted key: the flag as the user typed it}`` for each value's recorded origin (``data.source`` ->
    ``--dataset``; a ``--x/--no-x`` switch turned off -> ``--no-x``)."""
    from nsa.config import flag_keys

    keys = flag_keys()
    return {keys[_flag(name)]: (_flag(f"no_{name}") if v is False else _flag(name))
            for name, v in values.items() if v is not None}


LAUNCH_OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id")


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without the launcher's own options (``--nproc-per-node N``, ``--nnodes=N``, ...)."""
    from nsa.train.launch import strip_option

    for option in LAUNCH_OPTIONS:
        argv = strip_option(argv, option)
    return argv


def torchrun_argv(nproc: int, argv: list[str], rdzv: Any = None) -> list[str]:
    """The command that runs ``nsa <argv>`` on ``nproc`` ranks of this node through torchrun."""
    from nsa.train.launch import torchrun_argv as launcher_argv

    return launcher_argv(nproc, ["-m", "nsa_cli", *strip_nproc(argv)], rdzv)


def _early_lock(cfg: Any, nproc_per_node: int | None) -> Any:
    """A single-process resume takes its run directory's lock before torch loads (seconds), so a watch
    started right after ``nsa train --resume`` sees a new session coming instead of the last one's end.
    None for a fresh run (nothing is created before validation) and under torchrun (rank 0 takes it)."""
    import os
    from pathlib import Path

    ranks = os.environ.get("TORCHELASTIC_RUN_ID") is not None or os.environ.get("WORLD_SIZE", "1") != "1"
    run_dir = Path(cfg.train.out_dir)
    if cfg.train.resume is None or nproc_per_node is not None or ranks or not run_dir.is_dir():
        return None
    from nsa.train.lock import RunLock

    lock = RunLock(run_dir)
    lock.acquire()  # another writer: one line naming it, exit 2
    return lock


def train(
    config: Annotated[str | None, typer.Option("--config", "-c", help=options.config_help())] = None,
    profile: Annotated[str | None, typer.Option("--profile", "-p", help="Hardware profile name or YAML path.")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps (train.steps).")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Tokens per sequence (train.seq_len).")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Sequences per micro-batch per rank.")] = None,
    accum: Annotated[int | None, typer.Option("--accum", help="Micro-batches per optimizer step.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Peak learning rate (optimizer.lr).")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out-dir", "-o", help="Run directory (train.out_dir).")] = None,
    dataset: Annotated[str | None, typer.Option("--dataset", help="embedded, local, synthetic or fineweb_edu.")] = None,
    data_path: Annotated[str | None, typer.Option("--data-path", help="File or folder for --dataset local.")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="byte or gpt2.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of model init and data order.")] = None,
    resume: Annotated[str | None, typer.Option("--resume", help="'auto' (newest complete checkpoint) or a checkpoint path.")] = None,
    stop_at: Annotated[int | None, typer.Option("--stop-at", min=1, help="End after this step with a checkpoint, the schedule still spanning --steps; resume to go on, e.g. at a longer --seq-len (train.stop_at).")] = None,
    attention: Annotated[str | None, typer.Option("--attention", help="nsa or dense.")] = None,
    compile_: Annotated[bool | None, typer.Option("--compile/--no-compile", help="torch.compile the model.")] = None,
    context_parallel: Annotated[int | None, typer.Option("--context-parallel", min=1, help="Ranks that share each sequence (runtime.context_parallel; docs/training.md, 'Training longer than one GPU holds').")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="section.key=value for any config key; repeatable.")] = None,
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", min=1, help="Launch torchrun with N ranks on this node (runtime.parallel: ddp or fsdp).")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes of a multi-node run (with --nproc-per-node and --rdzv-endpoint).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This node's index, 0..nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0, which hosts the rendezvous store (static rendezvous); the same on every node.")] = None,
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="Job id shared by the nodes of one run.")] = "nsa",
) -> None:
    """Train a model; writes the run directory (checkpoints, heartbeats, CSV, TensorBoard, export).

    Halt with a .HALT file in the run directory (nsa halt), SIGTERM or Ctrl-C: checkpoint, then exit 0.

    Precedence, lowest to highest: defaults < --config (or the older CONFIG=path) < --profile < NSA_*
    environment < flags < --set.
    Exit codes: 0 completed or halted on request (nsa halt, SIGTERM/SIGINT), 1 failed (non-finite
    loss/gradients or a crash), 2 bad input, 3 halted by the watchdog (nsa watch --halt-on).
    Example: nsa train --config tiny --steps 60
    """
    code = EXIT_OK
    with user_errors():
        from nsa.config import load_run_config

        given = dict(
            steps=steps, seq_len=seq_len, batch_size=batch_size, accum=accum, lr=lr, out_dir=out_dir,
            dataset=dataset, data_path=data_path, tokenizer=tokenizer, seed=seed, resume=resume, stop_at=stop_at,
            attention=attention, compile=compile_, context_parallel=context_parallel,
        )
        resolved = load_run_config(config=config, profile=profile, flags=flags_to_keys(**given), sets=set_,
                                   flag_names=flags_as_typed(**given))
        lock = _early_lock(resolved.config, nproc_per_node)
        try:
            from rich.console import Console

            from nsa.train.distributed import launched_by_torchrun
            from nsa.train.launch import Rendezvous
            from nsa.train.trainer import Trainer
            from nsa_cli.train_view import RichReporter

            rdzv = Rendezvous(nnodes, node_rank, rdzv_endpoint, rdzv_id)
            if nnodes > 1 and nproc_per_node is None:
                raise fail("--nnodes needs --nproc-per-node (ranks on each node)")
            rdzv.check()
            launching = nproc_per_node is not None and not launched_by_torchrun()
            # validates everything before any work (and before torchrun starts)
            world = nproc_per_node * nnodes if launching and nproc_per_node else None
            trainer = Trainer(resolved, reporter=RichReporter(Console()), world_size=world,
                              local_ranks=nproc_per_node if launching else None, run_lock=lock)
        except BaseException:
            if lock is not None:  # a refused resume: .lock names the last trainer again
                lock.abandon()
            raise
        if launching:
            assert nproc_per_node is not None
            argv = torchrun_argv(nproc_per_node, sys.argv[1:], rdzv)
            typer.echo(f"launching: {' '.join(argv[1:])}", err=True)
            from nsa.train.launch import launch

            code = launch(argv, run_dir=trainer.run_dir)
            if code:
                raise typer.Exit(code)
            from nsa.runs.halt import halted_by_watchdog

            if halted_by_watchdog(trainer.run_dir):
                raise typer.Exit(EXIT_WATCHDOG)
            return
        try:
            result = trainer.fit()
        except KeyboardInterrupt:
            raise _interrupted(trainer) from None
        except Exception as exc:
            raise _failed(trainer, exc) from None
        code = EXIT_OK if result.status in ("completed", "halted") else EXIT_FAILED
        if result.status == "halted" and result.halted_by == "watchdog":
            code = EXIT_WATCHDOG
    if code:
        raise typer.Exit(code)


def _interrupted(trainer: Any) -> typer.Exit:
    """Ctrl-C twice: one line saying what is on disk, exit 130."""
    from nsa.rundir.checkpoints import newest_verified

    last, _ = newest_verified(trainer.run_dir)
    where = f"resume from {last.name} with --resume auto" if last else "no checkpoint to resume from"
    typer.echo(f"interrupted at step {trainer.state.step} (Ctrl-C twice): recorded as interrupted; {where}", err=True)
    return typer.Exit(EXIT_INTERRUPTED)


def _failed(trainer: Any, exc: Exception) -> BaseException:
    """The one line of a run that failed on out-of-memory or a write (a full disk names the file and the
    free space); anything else goes on as a traceback (a bug)."""
    import torch

    from nsa.fileio import os_error_in, write_failure

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return fail(
            f"CUDA out of memory at step {trainer.state.step + 1}",
            hint="lower --batch-size or --seq-len, raise --accum, or --set runtime.gradient_checkpointing=true",
            code=EXIT_FAILED,
        )
    disk = os_error_in(exc)
    if disk is None or isinstance(disk, FileNotFoundError):
        return exc
    from nsa.rundir.checkpoints import newest_verified

    last, _ = newest_verified(trainer.run_dir)
    return fail(
        f"run failed at step {trainer.state.step + 1}: {write_failure(disk)}",
        hint=(f"fix the cause (free disk space?), then resume from {last.name}: --resume auto" if last
              else "fix the cause (free disk space?) and start again"),
        code=EXIT_FAILED,
    )


def register(app: typer.Typer) -> None:
    app.command("train")(train)
