"""Everything a training run holds while it runs, built in one place and closed in reverse order.

:func:`open_session` does the set-up in the order that matters: process group -> run-directory lock
(before any write) -> log file and heartbeat -> banner and warnings -> model ->
``torch.compile`` / DDP or FSDP wrappers (:mod:`nsa.train.parallel`) -> optimizer, schedule -> loaders ->
restore from a checkpoint (one :class:`~nsa.train.state.Checkpointable` path, random streams last) -> the
first batch -> rank 0's files -> signal handlers.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nsa.config import ResolvedConfig, RunConfig, leaves
from nsa.config.resolve import default_config_note
from nsa.data.loader import build_loader, slowest_position
from nsa.errors import ConfigError, RunDirError
from nsa.model import build_model
from nsa.model.context import ContextParallel
from nsa.model.diagnostics import ScorerParams
from nsa.model.documents import from_separators
from nsa.rundir import RunDir
from nsa.rundir.records import TRAIN_CSV_HEADER, VAL_CSV_HEADER
from nsa.train import checkpoint as ckpt
from nsa.train import distributed as D
from nsa.train import parallel, rundir
from nsa.train.events import Output, Reporter
from nsa.train.hooks import StepHooks, step_hooks
from nsa.train.lock import RunLock
from nsa.train.runtime import (
    Runtime,
    apply_runtime_settings,
    long_run_warnings,
    restore_runtime_settings,
    seed_everything,
)
from nsa.train.schedule import build_scheduler
from nsa.train.signals import SignalFlags
from nsa.train.state import (
    Checkpointable,
    OptimizerLR,
    PerRank,
    RandomStreams,
    Stateful,
    TrainState,
    by_rank_modulo,
)
from nsa.train.step import build_optimizer
from nsa.train.telemetry import CsvLog, Heartbeat, TensorBoard


@dataclass
class Plan:
    """What the trainer validated before any work (``Trainer.__init__``)."""

    resolved: ResolvedConfig
    rt: Runtime
    run_dir: Path
    run_name: str
    resume_from: Path | None
    skipped: list[Any]
    tokenizer: Any
    alloc_conf_note: str | None
    init_state: dict[str, torch.Tensor] | None = None  # train.init_from's weights (fresh starts only)
    init_fresh: list[str] = field(default_factory=list)  # model keys init_state lacks (a dense warm-start)
    init_source: Path | None = None
    lock: Any = None  # the run lock, when the caller took it already (nsa train resuming: before torch loads)
    files: RunDir = field(init=False)  # every path of the run directory

    def __post_init__(self) -> None:
        self.files = RunDir(self.run_dir)

    @property
    def cfg(self) -> RunConfig:
        return self.resolved.config


@dataclass
class Session:
    """The live run: components, files and the state that checkpoints carry."""

    plan: Plan
    dist: D.DistInfo
    out: Output
    hb: Heartbeat
    signals: SignalFlags
    device_name: str
    model: Any
    train_model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    val_loader: Any
    val_start: Any
    state: TrainState
    checkpointable: Checkpointable
    compiled: bool
    first_batch: tuple[torch.Tensor, torch.Tensor] | None
    hooks: StepHooks  # what only some runs do at each step (nsa.train.hooks)
    first_batch_s: float
    layout: D.Layout = field(default_factory=D.Layout)  # data x context ranks
    context: ContextParallel | None = None  # this rank's share of each sequence (runtime.context_parallel)
    csv: CsvLog | None = None
    val_csv: CsvLog | None = None
    tb: TensorBoard | None = None
    ended: bool = False  # metrics.json and the end event are written
    closers: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def cfg(self) -> RunConfig:
        return self.plan.cfg

    @property
    def tokens_per_step(self) -> int:
        tr = self.cfg.train
        return tr.batch_size * tr.seq_len * tr.accum * self.layout.data_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The first batch (read during set-up), then the loader's, as :meth:`rows`."""
        if self.first_batch is not None:
            batch, self.first_batch = self.first_batch, None
        else:
            batch = next(self.loader)
        return self.rows(batch)

    def rows(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                      torch.Tensor | None]:
        """``(inputs, labels, cu_seqlens)``: the inputs and labels at this rank's positions (all of them
        without context parallelism), and the packed documents' boundaries of the whole batch
        (:meth:`documents`)."""
        cu = self.documents(batch[0])
        if self.context is None:
            return batch[0], batch[1], cu
        return self.context.shard(batch[0]), self.context.shard(batch[1]), cu

    def documents(self, x: torch.Tensor) -> torch.Tensor | None:
        """``cu_seqlens`` of a batch with ``data.document_mask`` (a document ends at each separator)."""
        if not self.cfg.data.document_mask:
            return None

        return from_separators(x, self.plan.tokenizer.eot_id)


def _check_same_config(plan: Plan, dist: D.DistInfo) -> None:
    """Every rank resolved the same config (nodes started with different flags or ``NSA_*`` variables
    would train different things): one line naming the keys that differ, on every rank."""

    mine = leaves(plan.cfg.model_dump(mode="json"))
    theirs = D.gather_objects(mine, dist)
    for rank, other in enumerate(theirs):
        diff = sorted(k for k in set(mine) | set(other) if other.get(k) != theirs[0].get(k))
        if diff:
            shown = ", ".join(f"{k} ({theirs[0].get(k)!r} on rank 0, {other.get(k)!r})" for k in diff[:4])
            raise ConfigError(f"rank {rank} resolved another config than rank 0: {shown}",
                              hint="start every node with the same command line and NSA_* environment")


def _lock_run_dir(plan: Plan, dist: D.DistInfo, closers: contextlib.ExitStack) -> Path | None:
    """Rank 0 takes the run directory (one writer), cleans partial checkpoints and archives a stale
    ``.HALT``; every rank learns whether that worked. Returns the archived ``.HALT``."""
    refused: tuple[str, str | None] | None = None
    if dist.is_main:
        try:
            plan.run_dir.mkdir(parents=True, exist_ok=True)
            lock = plan.lock if plan.lock is not None else RunLock(plan.run_dir)
            if plan.lock is None:
                lock.acquire()
            _on_close(closers, lock.close)
        except RunDirError as exc:
            refused = (exc.message, exc.hint)
        except OSError as exc:
            refused = (f"cannot write run directory {plan.run_dir}: {exc.strerror or exc}",
                       "choose a writable --out-dir")
    refused = D.broadcast_object(refused, dist)
    if refused is not None:
        raise RunDirError(*refused)
    archived = None
    if dist.is_main:
        ckpt.clean_partials(plan.run_dir)
        archived = rundir.archive_stale_halt(plan.files)
    D.barrier(dist)
    return archived


def _announce(plan: Plan, dist: D.DistInfo, out: Output, archived: Path | None) -> None:
    cp = plan.cfg.runtime.context_parallel
    grid = f" ({dist.world_size // cp} data x {cp} context)" if cp > 1 else ""
    out.message(f"nsa train run {plan.run_name} -> {plan.run_dir} | {plan.rt.device} {plan.rt.precision} | "
                f"{dist.world_size} rank(s){grid}", tone="headline")
    if cp > 1:
        out.message(f"context parallelism: each sequence of {plan.cfg.train.seq_len} positions over {cp} "
                    f"ranks, {plan.cfg.train.seq_len // cp} each (a head and a tail chunk); the selection "
                    "diagnostics of evaluation are off")
    out.message("resolved config (saved as config.yaml):")
    for line in rundir.config_summary(plan.resolved):
        out.message(line)
    if archived is not None:
        out.warn(f"a stale .HALT from before this start was archived to {archived} (not obeyed)")
    for verdict in plan.skipped:
        out.warn(f"skipped checkpoint {verdict.path.name}: {verdict.reason}")
    if plan.alloc_conf_note:
        out.warn(plan.alloc_conf_note)
    for concern in long_run_warnings(plan.cfg):
        out.warn(concern)
    if plan.cfg.model.attention == "nsa" and (gates := plan.cfg.nsa.retrieval_concern()) is not None:
        out.warn(gates)
    for note in plan.resolved.notes:  # the older system's CONFIG variable and YAML keys, mapped
        out.warn(note)
    default = default_config_note(plan.resolved)
    if default is not None:
        out.warn(default)
    if plan.resolved.unknown_env:
        names = "; ".join(plan.resolved.unknown_env_described or plan.resolved.unknown_env)
        out.warn(f"unknown NSA_* variables ignored: {names} (see docs/migrating.md)")


def _on_close(closers: contextlib.ExitStack, fn: Any, *args: Any) -> None:
    """Close ``fn(*args)`` with the session; a failure to close never hides the run's own outcome."""

    def quietly() -> None:
        with contextlib.suppress(Exception):
            fn(*args)

    closers.callback(quietly)


def open_session(plan: Plan, reporter: Reporter | None, closers: contextlib.ExitStack) -> Session:
    """Set the run up (module docstring); everything opened is registered on ``closers``."""
    from torch import distributed as tdist

    cfg, tr, rt = plan.cfg, plan.cfg.train, plan.rt
    already = tdist.is_available() and tdist.is_initialized()
    dist = D.init(rt.device_type)
    if dist.enabled and not already:
        _on_close(closers, D.shutdown)
    previous = apply_runtime_settings(cfg, rt)
    _on_close(closers, restore_runtime_settings, previous)
    device_name = torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else "cpu"
    seed_everything(tr.seed)
    out = Output(reporter, tr.steps, enabled=dist.is_main)
    _on_close(closers, out.stop)

    _check_same_config(plan, dist)
    archived = _lock_run_dir(plan, dist, closers)
    out.attach_log(plan.files.log(dist.rank))
    _on_close(closers, out.close)
    hb = Heartbeat(plan.files.heartbeat(dist.rank), dist.rank)
    _on_close(closers, hb.close)
    hb.emit("boot", 0, run_name=plan.run_name, world_size=dist.world_size, local_rank=dist.local_rank,
            host=socket.gethostname(), device=str(rt.device),
            resumed_from=str(plan.resume_from) if plan.resume_from else None, steps_total=tr.steps)
    try:
        _announce(plan, dist, out, archived)
        return _build(plan, dist, out, hb, device_name, closers)
    except BaseException as exc:  # set-up failed after the heartbeat opened: say so there
        with contextlib.suppress(Exception):
            hb.emit("end", 0, status="failed", error=f"{type(exc).__name__}: {exc}"[:1000])
        raise


def _build(plan: Plan, dist: D.DistInfo, out: Output, hb: Heartbeat, device_name: str,
           closers: contextlib.ExitStack) -> Session:
    """Model, wrappers, optimizer, schedule, loaders, restored state, first batch, files, signals."""

    cfg, tr, rt = plan.cfg, plan.cfg.train, plan.rt
    model: Any = build_model(cfg, ScorerParams.of_config(cfg.scorer, cfg.train.accum))
    if plan.init_state is not None:
        model.load_state_dict(plan.init_state, strict=not plan.init_fresh)
        plan.init_state = None  # the weights now live in the model
        out.message(f"starting from the weights of {plan.init_source} (step 0, fresh optimizer)")
        if plan.init_fresh:
            out.message(f"dense warm-start: key/value projections copied into every NSA branch; "
                        f"{len(plan.init_fresh)} NSA-only tensors (gates, compression) freshly initialised")
    model = model.to(rt.device)
    grid = D.layout(dist, cfg.runtime.context_parallel, rt.device_type)
    context = (ContextParallel(grid.context_group, grid.context_rank, grid.context_size)
               if grid.context_size > 1 else None)
    model.set_context_parallel(context)
    model.set_gradient_checkpointing(cfg.runtime.gradient_checkpointing)
    compiled = cfg.runtime.compiles(rt.device_type)
    # wrapped before the optimizer is built: FSDP replaces the parameters by their shards
    train_model = parallel.wrap(model, cfg, dist, rt.precision, rt.device_type, compiled)
    optimizer = build_optimizer(model, cfg, rt.device_type)
    scheduler = build_scheduler(optimizer, tr.steps, cfg.schedule.warmup_steps, cfg.schedule.min_lr_ratio)

    t_loader = time.perf_counter()
    # the ranks of one sequence read the same batches: the loaders are per data rank
    common: dict[str, Any] = dict(seq_len=tr.seq_len, batch_size=tr.batch_size, seed=tr.seed,
                                  rank=grid.data_rank,
                  world_size=grid.data_size, device=rt.device)
    loader = build_loader(cfg.data, plan.tokenizer, split="train", **common)
    _on_close(closers, loader.close)
    val_loader = val_start = None
    if cfg.eval.every > 0:
        val_loader = build_loader(cfg.data, plan.tokenizer, split="val", **common)
        _on_close(closers, val_loader.close)
        val_start = val_loader.state_dict()

    state = TrainState()
    run_sharded = parallel.sharded(cfg, dist)

    per_rank_loader = PerRank(loader, dist, reshard=slowest_position, every=grid.context_size)
    per_rank_rng = PerRank(RandomStreams(), dist, reshard=by_rank_modulo)

    def components(weights: dict[str, Stateful]) -> Checkpointable:
        return Checkpointable(**weights, scheduler=OptimizerLR(optimizer, scheduler), train_state=state,
                              loader=per_rank_loader, rng=per_rank_rng)

    # saved as this run shards: each rank's shards (FSDP) or the whole model and optimizer
    checkpointable = components({"sharded": parallel.ShardedState(model, optimizer)} if run_sharded
                                else {"model": model, "optimizer": optimizer})
    if plan.resume_from is not None:  # loaded as the checkpoint was written, on any number of ranks
        path = plan.resume_from
        loading = components(parallel.load_views(model, optimizer, run_sharded=run_sharded,
                                                 ckpt_sharded=ckpt.is_sharded(path)))
        loading.load_state_dict(ckpt.load_state(path), lambda template: ckpt.load_sharded(path, template))
        if per_rank_loader.saved_by != grid.data_size:
            out.warn(f"resumed a checkpoint of {per_rank_loader.saved_by} data rank(s) on {grid.data_size}: "
                     "model, optimizer, schedule "
                     "and counters exactly; each rank's data continues from the slowest saved rank's "
                     "document")

    first_batch = next(loader)  # used by the first step, not discarded
    mask = getattr(loader, "answer_mask", None)
    if mask is not None and context is not None:
        mask = context.shard(mask, dim=0)
    s = Session(plan=plan, dist=dist, out=out, hb=hb, signals=SignalFlags(), device_name=device_name,
                model=model, train_model=train_model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                val_loader=val_loader, val_start=val_start, state=state, checkpointable=checkpointable,
                compiled=compiled, first_batch=first_batch,
                hooks=step_hooks(cfg, model, mask.to(rt.device) if mask is not None else None),
                first_batch_s=time.perf_counter() - t_loader, closers=closers, layout=grid, context=context)

    if dist.is_main:
        keep = state.step if plan.resume_from is not None else None
        rundir.write_config(plan.files, plan.resolved)
        s.csv = CsvLog(plan.files.train_csv, TRAIN_CSV_HEADER, keep)
        s.val_csv = CsvLog(plan.files.val_csv, VAL_CSV_HEADER, keep)
        s.tb = TensorBoard(plan.files.tensorboard, purge_step=state.step + 1 if keep is not None else None)
        for f in (s.csv, s.val_csv, s.tb):
            _on_close(closers, f.close)
    s.signals.install(plan.files.stackdump(dist.rank))
    _on_close(closers, s.signals.uninstall)
    return s
