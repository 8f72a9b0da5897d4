"""The trainer: one loop, one checkpointable state.

``Trainer(resolved).fit()`` trains the model of a resolved run config and writes the run directory
described in ``docs/run-directory.md``. Construction validates everything that can be checked without
doing work (device, precision, combinations, resume target, tokenizer vocabulary) and raises
``ConfigError`` / ``CheckpointError``; ``fit`` does the work and returns a :class:`TrainResult`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from nsa.config import ResolvedConfig, fill_legacy
from nsa.errors import CheckpointError, ConfigError, RunDirError
from nsa.train import checkpoint as ckpt
from nsa.train import distributed as D
from nsa.train import rundir
from nsa.train.events import Output, Reporter
from nsa.train.runtime import (
    Runtime,
    apply_alloc_conf,
    apply_runtime_settings,
    check_training_config,
    long_run_warnings,
    resolve_runtime,
    restore_runtime_settings,
    rng_state,
    seed_everything,
    set_rng_state,
)
from nsa.train.schedule import build_scheduler, schedule_lrs
from nsa.train.signals import SignalFlags
from nsa.train.telemetry import (
    MFU_FORMULA,
    TRAIN_CSV_HEADER,
    VAL_CSV_HEADER,
    CsvLog,
    Heartbeat,
    TensorBoard,
    environment_record,
    peak_flops,
    write_json_atomic,
)

Status = Literal["completed", "halted", "failed"]
MIB = 2**20


@dataclass
class TrainResult:
    """What ``fit`` returns (also summarised in ``metrics.json``)."""

    status: Status
    run_dir: Path
    steps_done: int
    final_loss: float | None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainState:
    """Counters of the run that travel in checkpoints (model/optimizer/loader/RNG are saved beside)."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    last_loss: float | None = None
    last_val_loss: float | None = None
    best_val_loss: float | None = None


# -- the library calls the trainer builds on (one place, so the trainer has a single seam) ----------


def _build_model(cfg: Any) -> Any:
    from nsa.model import build_model

    return build_model(cfg)


def _get_tokenizer(cfg: Any) -> Any:
    from nsa.data.tokenizers import get_tokenizer

    return get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)


def _build_loader(cfg: Any, tokenizer: Any, **kwargs: Any) -> Any:
    from nsa.data.loader import build_loader

    return build_loader(cfg.data, tokenizer, **kwargs)


def _check_data_inputs(cfg: Any) -> None:
    from nsa.data import check_local_inputs

    check_local_inputs(cfg.data)


def _fallback_counts() -> dict[str, int]:
    from nsa.ops import fallback_counts

    return dict(fallback_counts())


# ---------------------------------------------------------------------------------------------------


class Trainer:
    """Train the model of ``resolved`` into ``train.out_dir`` (see module docstring)."""

    def __init__(
        self, resolved: ResolvedConfig, *, reporter: Reporter | None = None, world_size: int | None = None,
        step_hook: Callable[[int], None] | None = None,
    ) -> None:
        """``reporter`` receives the run's events (:mod:`nsa.train.events`; default: plain lines on stdout).
        ``world_size``: ranks the run will have, for validation before launching torchrun
        (default: this process's torchrun environment, 1 without one). ``step_hook(step)`` runs at the end
        of every step, after its logging and before its halt decision: the fault-injection point of the
        tests (write ``.HALT`` or send a signal at an exact step; the trainer acts on it at the next step)."""
        self.step_hook = step_hook
        self.resolved = resolved
        self.cfg = resolved.config
        self.reporter = reporter
        tr = self.cfg.train
        check_training_config(self.cfg)
        _check_data_inputs(self.cfg)  # missing or empty local data: one line, before any directory is made
        self.alloc_conf_note = apply_alloc_conf(self.cfg)  # before anything below initialises CUDA
        self.dist = D.env_info()
        self._expected_world = world_size or self.dist.world_size
        self.rt: Runtime = resolve_runtime(self.cfg, self.dist.local_rank)
        if self.rt.device_type == "cuda":
            local = world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if local > torch.cuda.device_count():
                raise ConfigError(
                    f"{local} ranks per node but only {torch.cuda.device_count()} CUDA device(s) are visible",
                    hint="lower --nproc-per-node (one GPU per rank) or check CUDA_VISIBLE_DEVICES",
                )
        self.run_dir = Path(tr.out_dir)
        self.run_name = tr.run_name or self.run_dir.resolve().name
        rundir.check_writable(self.run_dir)
        self.resume_from, self.skipped_checkpoints = ckpt.find_resume(self.run_dir, tr.resume)
        if tr.resume is None:
            rundir.check_fresh(self.run_dir)
        if self.resume_from is not None:
            self._check_resume_manifest(self.resume_from)
        self.tokenizer = _get_tokenizer(self.cfg)
        if self.tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={self.cfg.model.vocab_size} is smaller than tokenizer "
                f"'{self.cfg.data.tokenizer}' vocabulary ({self.tokenizer.vocab_size})",
                hint=f"set model.vocab_size >= {self.tokenizer.vocab_size}",
            )
        self.state = TrainState()
        self.tokens_per_step = tr.batch_size * tr.seq_len * tr.accum * self.dist.world_size

    def _check_same_model(self, saved: dict[str, Any], path: Path) -> None:
        """Refuse to resume a checkpoint whose ``model``/``nsa`` sections differ from this run's,
        naming each differing key and the ``--set`` that restores the saved value."""
        mine = self.cfg.model_dump(mode="json")
        for section in ("model", "nsa"):
            theirs = saved.get(section)
            if theirs is None or theirs == mine[section]:
                continue
            diff = sorted(k for k in mine[section] if theirs.get(k) != mine[section][k])
            sets = " ".join(f"--set {section}.{k}={json.dumps(theirs.get(k), separators=(',', ':'))}" for k in diff)
            raise CheckpointError(
                f"checkpoint {path} has a different '{section}' section ({', '.join(f'{section}.{k}' for k in diff)})",
                hint=f"resume with the config the run was started with (see its config.yaml): {sets}",
            )

    def _check_resume_manifest(self, path: Path) -> None:
        manifest = fill_legacy(ckpt.read_manifest(path) or {})
        self._check_same_model(manifest, path)
        done = int(manifest.get("step", 0))
        if self.cfg.train.steps < done:
            raise ConfigError(
                f"train.steps={self.cfg.train.steps} is below the step of checkpoint {path} ({done})",
                hint=f"pass --steps above {done} to train on (the schedule stretches to the new total)",
            )
        ws = manifest.get("world_size")
        if ws is not None and ws != self._expected_world:
            raise CheckpointError(
                f"checkpoint {path} was written by {ws} ranks, this run has {self._expected_world}",
                hint="resume with the same number of ranks (the data position is kept per rank)",
            )

    # ================================================================================================
    def fit(self) -> TrainResult:
        """Train until ``train.steps``, a halt request or an anomaly; never leaves a broken checkpoint."""
        self._t_boot = time.perf_counter()
        self._opened: list[Any] = []
        self._owns_pg = False
        self.signals = SignalFlags()
        self.hb: Heartbeat | None = None
        try:
            self._setup()
            return self._loop()
        except BaseException as exc:
            self._record_failure(exc)
            raise
        finally:
            self._teardown()

    # -- set-up ---------------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg, tr = self.cfg, self.cfg.train
        from torch import distributed as tdist

        already = tdist.is_available() and tdist.is_initialized()
        self.dist = D.init(self.rt.device_type)
        self._owns_pg = self.dist.enabled and not already
        self._torch_settings = apply_runtime_settings(cfg, self.rt)
        cuda = self.rt.device_type == "cuda"
        self.device_name = torch.cuda.get_device_name(self.rt.device) if cuda else "cpu"
        seed_everything(tr.seed)
        self.out = Output(self.reporter, tr.steps, enabled=self.dist.is_main)

        archived = None
        refused: tuple[str, str | None] | None = None
        if self.dist.is_main:  # one writer per run directory: the lock comes before any write
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                lock = rundir.RunLock(self.run_dir)
                lock.acquire()
                self._opened.append(lock)
            except RunDirError as exc:
                refused = (exc.message, exc.hint)
            except OSError as exc:
                refused = (f"cannot write run directory {self.run_dir}: {exc.strerror or exc}",
                           "choose a writable --out-dir")
        refused = D.broadcast_object(refused, self.dist)
        if refused is not None:
            raise RunDirError(*refused)
        if self.dist.is_main:
            ckpt.clean_partials(self.run_dir)
            archived = rundir.archive_stale_halt(self.run_dir)
        D.barrier(self.dist)
        log_name = "train.log" if self.dist.rank == 0 else f"train_rank{self.dist.rank}.log"
        self.out.attach_log(self.run_dir / log_name)
        self._opened.append(self.out)
        self.hb = Heartbeat(self.run_dir, self.dist.rank)
        self._opened.append(self.hb)
        self.hb.emit(
            "boot", 0, run_name=self.run_name, world_size=self.dist.world_size,
            local_rank=self.dist.local_rank, host=socket.gethostname(), device=str(self.rt.device),
            resumed_from=str(self.resume_from) if self.resume_from else None, steps_total=tr.steps,
        )
        self.out.message(
            f"nsa train run {self.run_name} -> {self.run_dir} | "
            f"{self.rt.device} {self.rt.precision} | {self.dist.world_size} rank(s)", tone="headline"
        )
        self.out.message("resolved config (saved as config.yaml):")
        for line in rundir.config_summary(self.resolved):
            self.out.message(line)
        if archived is not None:
            self.out.warn(f"a stale .HALT from before this start was archived to {archived} (not obeyed)")
        for verdict in self.skipped_checkpoints:
            self.out.warn(f"skipped checkpoint {verdict.path.name}: {verdict.reason}")
        if self.alloc_conf_note:
            self.out.warn(self.alloc_conf_note)
        for concern in long_run_warnings(cfg):
            self.out.warn(concern)
        if self.resolved.unknown_env:
            from nsa.config.settings import describe_unknown

            names = "; ".join(describe_unknown(n) for n in self.resolved.unknown_env)
            self.out.warn(f"unknown NSA_* variables ignored: {names} (see docs/migrating.md)")

        # model, optimizer, schedule
        self.model: Any = _build_model(cfg).to(self.rt.device)
        self.model.set_gradient_checkpointing(cfg.runtime.gradient_checkpointing)
        self.num_params = int(self.model.num_params())
        self.flops_per_token = float(self.model.flops_per_token(tr.seq_len))
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, tr.steps, tr.warmup_steps, tr.min_lr_ratio)
        loaded = self._load_checkpoint() if self.resume_from is not None else None

        self.train_model: Any = self.model
        self.compiled = cfg.runtime.compile is True or (cfg.runtime.compile == "auto" and self.rt.device_type == "cuda")
        self.compile_s: float | None = None  # the first step's time when compiled: tracing + Inductor + autotuning
        if self.compiled:
            self.train_model = torch.compile(self.model, mode=cfg.runtime.compile_mode)
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.dist.local_rank] if self.rt.device_type == "cuda" else None
            self.train_model = DDP(self.train_model, device_ids=ids)

        # data
        t_loader = time.perf_counter()
        common = dict(
            seq_len=tr.seq_len, batch_size=tr.batch_size, seed=tr.seed, rank=self.dist.rank,
            world_size=self.dist.world_size, device=self.rt.device,
        )
        self.loader = _build_loader(cfg, self.tokenizer, split="train", **common)
        self._opened.append(self.loader)
        if loaded is not None:
            self.loader.load_state_dict(loaded["loader"][self.dist.rank])
        self.val_loader = None
        if tr.eval_every > 0:
            self.val_loader = _build_loader(cfg, self.tokenizer, split="val", **common)
            self._opened.append(self.val_loader)
            self._val_start = self.val_loader.state_dict()
        self._pending = next(self.loader)  # the first batch is used by the first step, not discarded
        mask = getattr(self.loader, "answer_mask", None)
        self._answer_mask = mask.to(self.rt.device) if mask is not None else None
        first_batch_s = time.perf_counter() - t_loader
        self._seen_warnings: list[str] = []
        warnings = self._new_data_warnings()
        tok_name = getattr(self.tokenizer, "name", cfg.data.tokenizer)
        self.hb.emit(
            "loader-ready", self.state.step, source=cfg.data.source, tokenizer=tok_name,
            first_batch_s=first_batch_s, warnings=warnings,
        )
        if loaded is not None:
            set_rng_state(loaded["rng"][self.dist.rank])  # last, so nothing after it draws numbers

        # files of rank 0
        keep = self.state.step if self.resume_from is not None else None
        self.csv = self.val_csv = self.tb = None
        if self.dist.is_main:
            rundir.write_config(self.run_dir, self.resolved)
            self._write_env()
            self.csv = CsvLog(self.run_dir / "training.csv", TRAIN_CSV_HEADER, keep)
            self.val_csv = CsvLog(self.run_dir / "val.csv", VAL_CSV_HEADER, keep)
            self.tb = TensorBoard(self.run_dir, purge_step=self.state.step + 1 if keep is not None else None)
            self._opened += [self.csv, self.val_csv, self.tb]
        self.signals.install(self.run_dir / f"stackdump_rank{self.dist.rank}.txt")
        if self.resume_from is not None:
            self.out.message(f"resumed from {self.resume_from} at step {self.state.step}")
        self.out.message(
            f"model {self.num_params / 1e6:.2f}M params | {self.tokens_per_step} tokens/step | "
            f"{tr.steps} steps | first batch in {first_batch_s:.2f}s"
        )

    def _build_optimizer(self) -> torch.optim.Optimizer:
        tr = self.cfg.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": tr.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        extra = {"fused": True} if self.rt.device_type == "cuda" else {}
        return torch.optim.AdamW(groups, lr=tr.lr, betas=(tr.beta1, tr.beta2), **extra)

    def _load_checkpoint(self) -> dict[str, Any]:
        assert self.resume_from is not None
        state = ckpt.load_state(self.resume_from)
        self._check_same_model(fill_legacy(state.get("config", {})), self.resume_from)
        if len(state["loader"]) != self.dist.world_size:
            raise CheckpointError(
                f"checkpoint {self.resume_from} was written by {len(state['loader'])} ranks, "
                f"this run has {self.dist.world_size}",
                hint="resume with the same number of ranks",
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the optimizer's saved lr belongs to the old schedule: take the new one's for the next update
        # (they differ when --steps changed on resume)
        for group, lr in zip(self.optimizer.param_groups, schedule_lrs(self.scheduler), strict=True):
            group["lr"] = lr
        self.state = TrainState(**state["train_state"])
        return state

    def _write_env(self) -> None:
        from nsa.config.settings import read_settings

        name = self.device_name
        settings = {f"NSA_{k.upper()}": v for k, v in read_settings().model_dump(exclude_none=True).items()}
        record = environment_record(
            device=str(self.rt.device), device_name=name, precision=self.rt.precision,
            world_size=self.dist.world_size, backend=self.dist.backend, profile=self.resolved.profile,
            config_path=self.resolved.config_path, nsa_settings=settings, unknown_nsa=self.resolved.unknown_env,
        )
        record["run_name"] = self.run_name
        record["resumed_from"] = str(self.resume_from) if self.resume_from else None
        record["data_warnings"] = list(self._seen_warnings)
        write_json_atomic(self.run_dir / "env.json", record)

    # -- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> TrainResult:
        tr = self.cfg.train
        assert self.hb is not None
        self._session_start_step = self.state.step
        self._session_elapsed0 = self.state.elapsed_s
        self._t_first_step_end: float | None = None
        self._t_last_step_end = 0.0
        self._tokens_after_first = 0
        self._train_time_s = 0.0
        win_steps, win_time, win_fetch = 0, 0.0, 0.0
        self.out.start(self.state.step)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = tr.grad_clip if tr.grad_clip > 0 else float("inf")
        self.train_model.train()

        while self.state.step < tr.steps:
            step = self.state.step + 1
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=self.rt.device)
            answer_sums = torch.zeros(2, device=self.rt.device)  # answer loss, answer accuracy
            fetch_s = 0.0
            for micro in range(tr.accum):
                tf = time.perf_counter()
                x, y = self._next_batch()
                fetch_s += time.perf_counter() - tf
                last = micro == tr.accum - 1
                sync = self.train_model.no_sync() if (self.dist.enabled and not last) else nullcontext()
                with sync:
                    with self.rt.autocast():
                        out = self.train_model(x, labels=y, cu_seqlens=self._documents(x))
                    loss = out.loss.float() / tr.accum
                    if tr.fault_nan_at_step == step:
                        loss = loss * float("nan")  # fault injection (tests only)
                    loss.backward()
                loss_sum += loss.detach()
                if self._answer_mask is not None:
                    answer_sums += _answer_scores(out.logits.detach(), y, self._answer_mask) / tr.accum
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            halt_local = self._local_halt_request()
            flags = torch.stack([
                loss_sum,
                (~torch.isfinite(loss_sum)).float(),
                (~torch.isfinite(grad_norm)).float(),
                torch.tensor(float(halt_local is not None), device=self.rt.device),
                torch.tensor(float(self.signals.save_now), device=self.rt.device),
                grad_norm.float(),  # identical on all ranks after DDP's gradient all-reduce
                *answer_sums,
            ])
            D.all_reduce_sum(flags, self.dist)
            loss_total, bad_loss, bad_grad, halt_any, save_any, norm_total, ans_loss, ans_acc = flags.tolist()  # the one sync
            loss_value = loss_total / self.dist.world_size
            norm_value = norm_total / self.dist.world_size
            if bad_loss or bad_grad:
                self.optimizer.zero_grad(set_to_none=True)  # the step is not applied
                return self._anomaly(step, "nonfinite_loss" if bad_loss else "nonfinite_grad",
                                     loss_value if bad_loss else norm_value, loss_value, norm_value)
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step = step
            self.state.tokens_seen += self.tokens_per_step
            self.state.last_loss = loss_value
            answers = None
            if self._answer_mask is not None:
                answers = (ans_loss / self.dist.world_size, ans_acc / self.dist.world_size)
            dt = time.perf_counter() - t0
            self._train_time_s += dt
            self._t_last_step_end = time.perf_counter()
            if self._t_first_step_end is None:
                self._t_first_step_end = self._t_last_step_end
                if self.compiled:
                    self.compile_s = dt
                    self.out.message(f"torch.compile: first step (compilation included) took {dt:.1f} s")
            else:
                self._tokens_after_first += self.tokens_per_step
            win_steps, win_time, win_fetch = win_steps + 1, win_time + dt, win_fetch + fetch_s

            if step == 1 or step % tr.log_every == 0 or step == tr.steps:
                self._log(step, loss_value, lr, norm_value, win_steps, win_time, win_fetch, answers)
                win_steps, win_time, win_fetch = 0, 0.0, 0.0
            elif tr.heartbeat_every is not None and step % tr.heartbeat_every == 0:
                self._log(step, loss_value, lr, norm_value, win_steps, win_time, win_fetch, answers,
                          heartbeat_only=True)
            else:
                self.out.step(step)
            if self.val_loader is not None and (step % tr.eval_every == 0 or step == tr.steps):
                self._evaluate(step)
            if self.step_hook is not None:
                self.step_hook(step)
            if halt_any:
                source, reason = self._agree_halt(halt_local)
                path = self._save("halt")
                self.hb.emit("halt", step, reason=reason, source=source, checkpoint=str(path))
                self.out.stop()
                self.out.message(f"halted at step {step} ({source}: {reason}); checkpoint {path}", tone="caution")
                return self._finish("halted", None)
            if save_any:
                self.signals.save_now = False
                self._save("signal")
            elif tr.save_every > 0 and step % tr.save_every == 0 and step < tr.steps:
                self._save("periodic")

        self._save("final")
        if self.dist.is_main:
            path = rundir.export_model(self.run_dir, self.model, self.resolved, self.tokenizer)
            self.out.stop()
            self.out.message(f"exported {path}")
        return self._finish("completed", None)

    def _documents(self, x: torch.Tensor) -> torch.Tensor | None:
        """``cu_seqlens`` of a batch with ``data.document_mask`` (a document ends at each separator)."""
        if not self.cfg.data.document_mask:
            return None
        from nsa.model.documents import from_separators

        return from_separators(x, self.tokenizer.eot_id)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        return next(self.loader)

    def _local_halt_request(self) -> tuple[str, str] | None:
        """(source, reason) when this rank was asked to halt: a signal, or ``.HALT`` (rank 0 reads it)."""
        if self.signals.halt_source is not None:
            return self.signals.halt_source, f"{self.signals.halt_source} received"
        if self.dist.is_main:
            reason = rundir.read_halt(self.run_dir)
            if reason is not None:
                return "file", reason
        return None

    def _agree_halt(self, local: tuple[str, str] | None) -> tuple[str, str]:
        requests = [r for r in D.gather_objects(local, self.dist) if r is not None]
        return requests[0] if requests else ("file", "halt requested")

    # -- logging and evaluation ----------------------------------------------------------------------
    def _log(self, step: int, loss: float, lr: float, grad_norm: float, n: int, win_time: float, fetch_s: float,
             answers: tuple[float, float] | None = None, heartbeat_only: bool = False) -> None:
        """A log step: the heartbeat's ``progress`` event, a CSV row, TensorBoard and the console line
        (``heartbeat_only``: the event alone, for ``train.heartbeat_every`` between log steps)."""
        tr = self.cfg.train
        assert self.hb is not None
        step_time = win_time / max(n, 1)
        tps = n * self.tokens_per_step / win_time if win_time > 0 else None
        eta = (tr.steps - step) * step_time
        stats = self.model.consume_stats() or {}
        loader_stats = self.loader.stats()
        mem = self._memory()
        mfu = self._mfu(tps)
        elapsed = self._elapsed()
        self._new_data_warnings()  # printed and recorded once each
        row = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
            "step_time_s": step_time, "fetch_ms": 1000 * fetch_s / max(n, 1), "tokens_seen": self.state.tokens_seen,
            "elapsed_s": elapsed, "eta_s": eta,
            "answer_loss": answers[0] if answers else None, "answer_acc": answers[1] if answers else None,
            "fetch_p50_ms": loader_stats.get("fetch_p50_ms"), "fetch_p95_ms": loader_stats.get("fetch_p95_ms"),
        }
        shares = stats.get("gate_branch_shares")
        self.hb.emit(
            "progress", step, steps_total=tr.steps, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tps,
            step_time_s=step_time, fetch_p50_ms=loader_stats.get("fetch_p50_ms"),
            fetch_p95_ms=loader_stats.get("fetch_p95_ms"), tokens_seen=self.state.tokens_seen, elapsed_s=elapsed,
            eta_s=eta, **mem, gate_entropy_mean=_float(stats.get("gate_entropy_mean")),
            gate_branch_shares=[float(s) for s in shares] if shares is not None else None,
            gate_collapse_fraction=_float(stats.get("gate_collapse_fraction")),
            sel_keys_mean=_float(stats.get("sel_keys_mean")), fallback=_fallback_counts(), mfu=mfu,
            data_skipped=_skipped(loader_stats), data_warnings=list(self._seen_warnings),
            answer_loss=row["answer_loss"], answer_acc=row["answer_acc"],
        )
        if heartbeat_only:
            self.out.step(step)
            return
        if not self.dist.is_main:
            self.out.log(row)  # into this rank's log file
            return
        assert self.csv is not None and self.tb is not None
        self.csv.row(row)
        scalars = {
            "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "perf/tokens_per_s": tps,
            "perf/step_time_s": step_time, "perf/fetch_ms": row["fetch_ms"], "perf/mfu": mfu,
            "mem/allocated_mib": mem["mem_allocated_mib"], "mem/reserved_mib": mem["mem_reserved_mib"],
            "gate/entropy_mean": _float(stats.get("gate_entropy_mean")),
            "gate/collapse_fraction": _float(stats.get("gate_collapse_fraction")),
            "sel/keys_mean": _float(stats.get("sel_keys_mean")),
        }
        if answers is not None:
            scalars.update({"train/answer_loss": answers[0], "train/answer_acc": answers[1]})
        if shares is not None:
            scalars.update({f"gate/share_{b}": float(s) for b, s in zip(("cmp", "sel", "win"), shares, strict=False)})
        self.tb.scalars(scalars, step)
        self.out.step(step, row)
        self.out.log(row)

    def _new_data_warnings(self) -> list[str]:
        """Loader warnings (e.g. a failed source replaced by synthetic tokens), shown loudly once each."""
        current = [str(w) for w in (self.loader.stats().get("warnings") or [])]
        new = [w for w in current if w not in self._seen_warnings]
        for w in new:
            self._seen_warnings.append(w)
            if self.dist.is_main:
                self.out.warn(f"data: {w}")
                if (self.run_dir / "env.json").exists():
                    self._write_env()
        return new

    def _memory(self) -> dict[str, float | None]:
        import psutil

        rss = psutil.Process().memory_info().rss / MIB
        if self.rt.device_type != "cuda":
            return {"mem_allocated_mib": None, "mem_reserved_mib": None, "mem_peak_mib": None, "rss_mib": rss}
        dev = self.rt.device
        return {
            "mem_allocated_mib": torch.cuda.memory_allocated(dev) / MIB,
            "mem_reserved_mib": torch.cuda.memory_reserved(dev) / MIB,
            "mem_peak_mib": torch.cuda.max_memory_allocated(dev) / MIB,
            "rss_mib": rss,
        }

    def _mfu(self, tps: float | None) -> float | None:
        if tps is None or self.rt.device_type != "cuda":
            return None
        peak, _ = peak_flops(self.device_name, self.cfg.train.mfu_peak_tflops)
        if peak is None:
            return None
        return tps * self.flops_per_token / (self.dist.world_size * peak)

    def _elapsed(self) -> float:
        return self._session_elapsed0 + (time.perf_counter() - self._t_boot)

    def _evaluate(self, step: int) -> None:
        assert self.val_loader is not None and self.hb is not None
        tr = self.cfg.train
        t0 = time.perf_counter()
        self.model.eval()
        self.val_loader.load_state_dict(self._val_start)  # the same held-out batches every time
        total = torch.zeros((), device=self.rt.device)
        with torch.no_grad():
            for _ in range(tr.eval_batches):
                x, y = next(self.val_loader)
                with self.rt.autocast():
                    total += self.model(x, labels=y, cu_seqlens=self._documents(x)).loss.float()
        D.all_reduce_sum(total, self.dist)
        val_loss = total.item() / (tr.eval_batches * self.dist.world_size)
        self.model.consume_stats()  # gate statistics of evaluation do not belong to training
        self.model.train()
        ppl = math.exp(val_loss) if val_loss < 700 else float("inf")
        self.state.last_val_loss = val_loss
        if self.state.best_val_loss is None or val_loss < self.state.best_val_loss:
            self.state.best_val_loss = val_loss
        seconds = time.perf_counter() - t0
        self.hb.emit("eval", step, val_loss=val_loss, val_ppl=ppl, seconds=seconds)
        if self.dist.is_main:
            assert self.val_csv is not None and self.tb is not None
            self.val_csv.row({"step": step, "val_loss": val_loss, "val_ppl": ppl})
            self.tb.scalars({"val/loss": val_loss, "val/ppl": ppl}, step)
            self.out.message(f"eval step {step}: val_loss {val_loss:.4f} | ppl {ppl:.2f}")

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save(self, reason: str) -> Path:
        """All ranks take part (loader and RNG states are per rank); rank 0 writes."""
        assert self.hb is not None
        t0 = time.perf_counter()
        self.state.elapsed_s = self._elapsed()
        loaders = D.gather_objects(self.loader.state_dict(), self.dist)
        rngs = D.gather_objects(rng_state(), self.dist)
        path: Path | None = None
        if self.dist.is_main:
            state: dict[str, Any] = {
                "format": 1,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "train_state": asdict(self.state),
                "loader": loaders,
                "rng": rngs,
                "config": self.cfg.model_dump(mode="json"),
            }
            extra = {
                "run_name": self.run_name, "world_size": self.dist.world_size, "reason": reason,
                "tokens_seen": self.state.tokens_seen, "loss": self.state.last_loss,
                "model": state["config"]["model"], "nsa": state["config"]["nsa"],
            }
            path = ckpt.save_checkpoint(self.run_dir, self.state.step, state, extra)
            ckpt.prune(self.run_dir, self.cfg.train.keep_last)
        path = Path(D.broadcast_object(str(path) if path else None, self.dist))
        seconds = time.perf_counter() - t0
        self.hb.emit("checkpoint", self.state.step, path=str(path), seconds=seconds, reason=reason)
        if reason in ("periodic", "signal"):
            self.out.message(f"checkpoint {path.name} ({reason}, {seconds:.2f}s)")
        return path

    # -- endings ---------------------------------------------------------------------------------------
    def _anomaly(self, step: int, kind: str, value: float, loss: float, grad_norm: float) -> TrainResult:
        assert self.hb is not None
        last_good, _ = ckpt.newest_verified(self.run_dir)
        record_path = self.run_dir / "anomalies" / f"step_{step}.json"
        if self.dist.is_main:
            record = {
                "step": step, "kind": kind, "value": repr(value), "loss": repr(loss), "grad_norm": repr(grad_norm),
                "lr": self.optimizer.param_groups[0]["lr"], "time": time.time(), "applied": False,
                "last_good_checkpoint": str(last_good) if last_good else None,
                "fault_injected": self.cfg.train.fault_nan_at_step == step,
            }
            record_path = rundir.write_anomaly(self.run_dir, step, record)
        self.hb.emit("anomaly", step, kind=kind, value=value, record=str(record_path))
        self.hb.emit("halt", step - 1, reason=f"{kind} at step {step}", source="anomaly",
                     checkpoint=str(last_good) if last_good else None)
        self.out.stop()
        self.out.message(
            f"anomaly {kind} at step {step} (value {value}); step not applied; "
            f"record {record_path}; last good checkpoint {last_good}", tone="bad"
        )
        return self._finish("failed", f"{kind} at step {step}")

    def _finish(self, status: Status, error: str | None) -> TrainResult:
        assert self.hb is not None
        metrics = self._metrics(status, error)
        if self.dist.is_main:
            write_json_atomic(self.run_dir / "metrics.json", metrics)
        self.hb.emit("end", self.state.step, status=status, error=error)
        self.out.stop()
        if status == "completed":
            self.out.message(
                f"done {self.state.step} steps | final loss {self.state.last_loss:.4f} | "
                f"{metrics['tokens_per_s'] or 0:.0f} tok/s | run dir {self.run_dir}", tone="good"
            )
        self._ended = True
        return TrainResult(status, self.run_dir, self.state.step, self.state.last_loss, metrics)

    def _metrics(self, status: str, error: str | None) -> dict[str, Any]:
        now = time.perf_counter()
        tps = None
        if self._t_first_step_end is not None and self._tokens_after_first > 0:
            tps = self._tokens_after_first / (self._t_last_step_end - self._t_first_step_end)
        name = self.device_name
        peak, peak_source = peak_flops(name, self.cfg.train.mfu_peak_tflops)
        mfu = self._mfu(tps)
        loader_stats = self.loader.stats() if getattr(self, "loader", None) is not None else {}
        done_here = self.state.step - self._session_start_step
        return {
            "schema": 1,
            "status": status,
            "error": error,
            "run_name": self.run_name,
            "steps_done": self.state.step,
            "steps_total": self.cfg.train.steps,
            "steps_this_session": done_here,
            "final_loss": self.state.last_loss,
            "last_val_loss": self.state.last_val_loss,
            "best_val_loss": self.state.best_val_loss,
            "tokens_seen": self.state.tokens_seen,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": tps,
            "tokens_per_s_note": (
                "tokens of this session's steps after its first, over the wall time from the end of the first "
                "step to the end of the last (evaluations and periodic checkpoints in between included)"
            ),
            "train_time_s": self._train_time_s,
            "mean_step_time_s": self._train_time_s / done_here if done_here else None,
            "elapsed_s": self._elapsed(),
            "startup_s": (self._t_first_step_end or now) - self._t_boot,
            "compiled": self.compiled,
            "compile_s": self.compile_s,
            "num_params": self.num_params,
            "flops_per_token": self.flops_per_token,
            "mfu": mfu,
            "mfu_formula": MFU_FORMULA,
            "mfu_peak_flops_per_device": peak,
            "mfu_peak_source": peak_source,
            "device": str(self.rt.device),
            "device_name": name,
            "precision": self.rt.precision,
            "world_size": self.dist.world_size,
            "resumed_from": str(self.resume_from) if self.resume_from else None,
            "last_checkpoint": str(p) if (p := ckpt.latest_checkpoint(self.run_dir)) else None,
            "memory": self._memory(),
            "fallback": _fallback_counts(),
            "data": {k: v for k, v in loader_stats.items() if k != "warnings"},
            "data_warnings": list(getattr(self, "_seen_warnings", [])),
        }

    def _record_failure(self, exc: BaseException) -> None:
        """An exception escaped the loop: say so in the heartbeat and ``metrics.json`` (best effort)."""
        if self.hb is None or getattr(self, "_ended", False):
            return
        error = f"{type(exc).__name__}: {exc}"[:1000]
        with suppress(Exception):
            if self.dist.is_main and hasattr(self, "_t_first_step_end"):
                write_json_atomic(self.run_dir / "metrics.json", self._metrics("failed", error))
        with suppress(Exception):
            self.hb.emit("end", self.state.step, status="failed", error=error)

    def _teardown(self) -> None:
        self.signals.uninstall()
        if hasattr(self, "out"):
            self.out.stop()
        for obj in reversed(self._opened):
            with suppress(Exception):
                obj.close()
        if self._owns_pg:
            D.shutdown()
        if getattr(self, "_torch_settings", None) is not None:
            restore_runtime_settings(self._torch_settings)


def _answer_scores(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[cross-entropy, accuracy]`` of the predictions at a synthetic task's answer positions."""
    picked, want = logits[:, mask].float(), y[:, mask]
    loss = torch.nn.functional.cross_entropy(picked.reshape(-1, picked.shape[-1]), want.reshape(-1))
    return torch.stack([loss, (picked.argmax(-1) == want).float().mean()])


def _float(v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _skipped(stats: dict[str, Any]) -> dict[str, int]:
    """Counts of records the loader skipped, by reason (``skipped`` dict or ``skipped_*`` keys)."""
    out: dict[str, int] = {}
    raw = stats.get("skipped")
    if isinstance(raw, dict):
        out.update({str(k): int(v) for k, v in raw.items()})
    elif isinstance(raw, int | float):
        out["total"] = int(raw)
    for k, v in stats.items():
        if k.startswith("skipped_") and isinstance(v, int | float):
            out[k.removeprefix("skipped_")] = int(v)
    return out


__all__ = ["TrainResult", "TrainState", "Trainer"]
