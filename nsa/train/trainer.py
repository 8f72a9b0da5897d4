"""The trainer: validation, then one loop you can read top to bottom.

``Trainer(resolved).fit()`` trains the model of a resolved run config and writes the run directory
described in ``docs/run-directory.md``. Construction validates everything that can be checked without
doing work (device, precision, combinations, resume target, tokenizer vocabulary) and raises
``ConfigError`` / ``CheckpointError``; ``fit`` does the work and returns a :class:`TrainResult`.

The pieces: :mod:`nsa.train.session` (set-up and the live components), :mod:`nsa.train.state`
(checkpointable ``Stateful`` state, one save/load path), :mod:`nsa.train.hooks` (what only some runs do
at each step: the scorer's warm-up, a synthetic task's answer metrics), :mod:`nsa.train.metrics` (timing, log
steps, ``metrics.json``), :mod:`nsa.train.events` (what people see; the CLI renders it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from nsa.config import ResolvedConfig, RunConfig, fill_legacy
from nsa.data import check_local_inputs
from nsa.data.tokenizers import get_tokenizer
from nsa.errors import CheckpointError, ConfigError, NSAError
from nsa.fileio import os_error_in, write_failure
from nsa.hf import export_hf, is_hf_folder
from nsa.hf import read_init_weights as read_hf_init_weights
from nsa.model import build_model
from nsa.model.load import read_init_weights
from nsa.rundir.checkpoints import STATE_FORMAT, newest_verified, read_manifest
from nsa.rundir.layout import WATCHDOG_PREFIX
from nsa.rundir.records import Anomaly, Metrics
from nsa.train import checkpoint as ckpt
from nsa.train import distributed as D
from nsa.train import parallel, rundir
from nsa.train.events import Reporter
from nsa.train.metrics import Clock, Recorder, measure_selection
from nsa.train.runtime import apply_alloc_conf, check_training_config, resolve_runtime
from nsa.train.session import Plan, Session, open_session
from nsa.train.state import TrainState
from nsa.train.step import StepOutcome, Stepper
from nsa.train.telemetry import write_json_atomic

Status = Literal["completed", "halted", "failed"]


@dataclass
class TrainResult:
    """What ``fit`` returns (also summarised in ``metrics.json``)."""

    status: Status
    run_dir: Path
    steps_done: int
    final_loss: float | None
    metrics: Metrics = field(default_factory=lambda: Metrics())
    # a halt's origin: "watchdog" (nsa watch --halt-on), "operator", "signal", "stop_at" (train.stop_at)
    halted_by: str | None = None


def _read_init_weights(cfg: RunConfig, path: str) -> tuple[dict[str, torch.Tensor], Path, list[str]]:
    """``train.init_from``'s weights, checked against this config's model (built on the meta device), their
    file, and the keys the model keeps fresh (a dense run's weights into an NSA model: gates, compression)."""

    try:
        with torch.device("meta"):
            model = build_model(cfg)
        if is_hf_folder(path):  # an export in Hugging Face format (nsa export --format hf)
            return read_hf_init_weights(path, model)
        return read_init_weights(path, model)
    except NSAError as exc:
        raise type(exc)(f"train.init_from: {exc.message}", hint=exc.hint) from None


class Trainer:
    """Train the model of ``resolved`` into ``train.out_dir`` (see module docstring)."""

    def __init__(
        self, resolved: ResolvedConfig, *, reporter: Reporter | None = None, world_size: int | None = None,
        step_hook: Callable[[int], None] | None = None, local_ranks: int | None = None, run_lock: Any = None,
    ) -> None:
        """``reporter`` receives the run's events (:mod:`nsa.train.events`; default: plain lines on stdout).
        ``world_size``: ranks the run will have, for validation before launching torchrun (default: this
        process's torchrun environment, 1 without one); ``local_ranks``: those on this node (default: as many,
or torchrun's ``LOCAL_WORLD_SIZE``). ``step_hook(step)`` runs at the end of every step,
        after its logging and before its halt decision: the fault-injection point of the tests (write
        ``.HALT``, send a signal, or make the next step's loss NaN at an exact step; the trainer acts on it at
        the next step); an anomaly record of a run with a hook says ``fault_injected``. ``run_lock``:
        the run directory's lock (:class:`nsa.train.lock.RunLock`) when the caller took it already."""
        self.reporter, self.step_hook, self.resolved = reporter, step_hook, resolved
        self.cfg = cfg = resolved.config
        tr = cfg.train
        check_training_config(cfg)

        check_local_inputs(cfg.data)  # missing or empty local data: one line, before any directory is made
        alloc_conf_note = apply_alloc_conf(cfg)  # before anything below initialises CUDA
        dist = D.env_info()
        self._expected_world = world_size or dist.world_size
        cp = cfg.runtime.context_parallel
        if self._expected_world % cp:
            raise ConfigError(f"runtime.context_parallel={cp} must divide the {self._expected_world} rank(s) "
                              "of the run",
                              hint=f"launch a multiple of {cp} ranks (--nproc-per-node) or lower "
                                   "--context-parallel")
        rt = resolve_runtime(cfg, dist.local_rank)
        if rt.device_type == "cuda":
            local = local_ranks or world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if local > torch.cuda.device_count():
                raise ConfigError(
                    f"{local} ranks per node but only {torch.cuda.device_count()} CUDA device(s) are visible",
                    hint="lower --nproc-per-node (one GPU per rank) or check CUDA_VISIBLE_DEVICES",
                )
        run_dir = Path(tr.out_dir)
        rundir.check_writable(run_dir)
        resume_from, skipped = ckpt.find_resume(run_dir, tr.resume)
        if tr.resume is None:
            rundir.check_fresh(run_dir)
        if resume_from is not None:
            self._check_resume_manifest(resume_from)
        init_state = init_source = None
        init_fresh: list[str] = []
        if tr.init_from and resume_from is None:
            init_state, init_source, init_fresh = _read_init_weights(cfg, tr.init_from)

        tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than tokenizer "
                f"'{cfg.data.tokenizer}' vocabulary ({tokenizer.vocab_size})",
                hint=f"set model.vocab_size >= {tokenizer.vocab_size}",
            )
        self.plan = Plan(resolved=resolved, rt=rt, run_dir=run_dir,
                         run_name=tr.run_name or run_dir.resolve().name, resume_from=resume_from,
                         skipped=skipped, tokenizer=tokenizer, alloc_conf_note=alloc_conf_note,
                         init_state=init_state, init_source=init_source, init_fresh=init_fresh,
                         lock=run_lock)
        self.state = TrainState()  # replaced by the session's (restored) state in fit

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint this run resumes from (``None``: a fresh start)."""
        return self.plan.resume_from

    @property
    def alloc_conf_note(self) -> str | None:
        """Why ``runtime.alloc_conf`` was not applied (the user's own PYTORCH_CUDA_ALLOC_CONF wins)."""
        return self.plan.alloc_conf_note

    def _check_resume_manifest(self, path: Path) -> None:
        manifest = fill_legacy(read_manifest(path) or {})
        check_same_model(self.cfg.model_dump(mode="json"), manifest, path)
        done = int(manifest.get("step", 0))
        if self.cfg.train.steps < done:
            raise ConfigError(
                f"train.steps={self.cfg.train.steps} is below the step of checkpoint {path} ({done})",
                hint=f"pass --steps above {done} to train on (the schedule stretches to the new total)",
            )
        stop_at = self.cfg.train.stop_at
        if stop_at is not None and stop_at <= done:
            raise ConfigError(f"train.stop_at={stop_at} is not after the step of checkpoint {path} ({done})",
                              hint=f"stop at a later step (up to train.steps={self.cfg.train.steps}) or "
                                   "unset it")

    # ================================================================================================
    def fit(self) -> TrainResult:
        """Train until ``train.steps``, a halt request or an anomaly; never leaves a broken checkpoint."""
        clock = Clock()
        with contextlib.ExitStack() as closers:
            s = open_session(self.plan, self.reporter, closers)
            self.state = s.state
            rec = Recorder(s, clock)
            try:
                return self._train(s, rec, clock)
            except BaseException as exc:
                _record_failure(s, rec, exc)
                raise

    def _train(self, s: Session, rec: Recorder, clock: Clock) -> TrainResult:
        """The loop: one optimizer step per iteration, then logging, evaluation, hooks, halts and saves."""
        tr, log, every = s.cfg.train, s.cfg.logging, s.cfg.checkpoint.every
        clock.start_step, clock.elapsed0 = s.state.step, s.state.elapsed_s
        rec.started()
        s.out.start(s.state.step)
        s.train_model.train()
        end = tr.stop_at or tr.steps
        stepper = Stepper(s.cfg, s.model, s.train_model, s.optimizer, s.scheduler, s.plan.rt.autocast,
                          s.plan.rt.device, s.dist, s.hooks, s.next_batch,
                          halt_request=lambda: _local_halt_request(s),
                          save_requested=lambda: s.signals.save_now)
        while s.state.step < end:
            step = s.state.step + 1
            s.hooks.on_step_start(step)
            t0 = time.perf_counter()
            lr = s.optimizer.param_groups[0]["lr"]
            r = stepper.forward_backward()
            if r.bad is not None:
                stepper.discard()  # the step is not applied
                return self._anomaly(s, rec, step, r.bad,
                                     r.loss if r.bad == "nonfinite_loss" else r.grad_norm, r)
            stepper.apply()
            s.state.step, s.state.last_loss = step, r.loss
            s.state.tokens_seen += s.tokens_per_step
            dt = time.perf_counter() - t0
            if clock.step_done(dt, r.fetch_s, s.tokens_per_step) and s.compiled:
                clock.compile_s = dt
                s.out.message(f"torch.compile: first step (compilation included) took {dt:.1f} s")

            if step == 1 or step % log.every == 0 or step == end:
                rec.log_step(step, r.loss, lr, r.grad_norm, r.fields)
            elif log.heartbeat_every is not None and step % log.heartbeat_every == 0:
                rec.log_step(step, r.loss, lr, r.grad_norm, r.fields, heartbeat_only=True)
            else:
                s.out.step(step)
            if s.val_loader is not None and (step % s.cfg.eval.every == 0 or step == end):
                self._evaluate(s, rec, step)
            if self.step_hook is not None:
                self.step_hook(step)
            if r.halt_any:
                return self._halt(s, rec, clock, step, r.halt)
            if r.save_now:
                s.signals.save_now = False
                self._save(s, clock, "signal")
            elif every > 0 and step % every == 0 and step < end:  # the end saves its own
                self._save(s, clock, "periodic")

        if s.state.step < tr.steps:  # train.stop_at: a planned pause, resumed later
            return self._stop_at(s, rec, clock)
        self._save(s, clock, "final")
        # a collective
        full = parallel.full_model_state(s.model, s.dist) if s.checkpointable.is_sharded else None
        if s.dist.is_main:
            path = rundir.export_model(s.plan.files, s.model, s.plan.resolved, s.plan.tokenizer,
                                       full_state=full, step=s.state.step)
            s.out.stop()
            s.out.message(f"exported {path}")
            if s.cfg.checkpoint.export_hf:
                hf_path = s.plan.files.hf_export
                export_hf(path, hf_path, overwrite=True)
                s.out.message(f"exported {hf_path} (Hugging Face format)")
        return self._finish(s, rec, "completed", None)

    def _evaluate(self, s: Session, rec: Recorder, step: int) -> None:
        """Mean loss over the same ``eval.batches`` held-out batches every time, and the selection diagnostics
        of the NSA layers on the first of them (:func:`nsa.train.metrics.measure_selection`)."""
        assert s.val_loader is not None
        batches = s.cfg.eval.batches
        t0 = time.perf_counter()
        s.model.eval()
        s.val_loader.load_state_dict(s.val_start)
        total = torch.zeros((), device=s.plan.rt.device)
        first: torch.Tensor | None = None
        with torch.no_grad():
            for _ in range(batches):
                x, y, cu = s.rows(next(s.val_loader))
                first = x if first is None else first
                with s.plan.rt.autocast():
                    total += s.model(x, labels=y, cu_seqlens=cu).loss.float()
        D.all_reduce_sum(total, s.dist)
        val_loss = total.item() / (batches * s.dist.world_size)
        assert first is not None
        selection = measure_selection(s, first)  # per NSA layer, on the first held-out batch (every rank)
        s.model.consume_stats()  # gate statistics of evaluation do not belong to training
        s.model.train()
        s.state.last_val_loss = val_loss
        if s.state.best_val_loss is None or val_loss < s.state.best_val_loss:
            s.state.best_val_loss = val_loss
        rec.eval_row(step, val_loss, math.exp(val_loss) if val_loss < 700 else float("inf"),
                     time.perf_counter() - t0, selection)

    # -- checkpoints and endings ---------------------------------------------------------------------
    def _save(self, s: Session, clock: Clock, reason: str) -> Path:
        """All ranks take part (loader and RNG states are per rank); rank 0 writes. A second Ctrl-C during
        the write stops the run right after it (``SignalFlags.critical``)."""
        t0 = time.perf_counter()
        with s.signals.critical():
            path = self._write_checkpoint(s, clock, reason)
            seconds = time.perf_counter() - t0
            s.hb.emit("checkpoint", s.state.step, path=str(path), seconds=seconds, reason=reason)
        if reason in ("periodic", "signal"):
            s.out.message(f"checkpoint {path.name} ({reason}, {seconds:.2f}s)")
        return path

    def _write_checkpoint(self, s: Session, clock: Clock, reason: str) -> Path:
        s.state.elapsed_s = clock.elapsed()
        state = s.checkpointable.state_dict()
        config = s.cfg.model_dump(mode="json")
        state.update(format=STATE_FORMAT, config=config)
        extra = {
            "run_name": s.plan.run_name, "world_size": s.dist.world_size, "reason": reason,
            "tokens_seen": s.state.tokens_seen, "loss": s.state.last_loss, "model": config["model"],
            "nsa": config["nsa"], "sharded": s.checkpointable.is_sharded,
        }
        path: Path | None = None
        if s.checkpointable.is_sharded:  # every rank writes its shards
            path = ckpt.save_sharded_checkpoint(s.plan.run_dir, s.state.step,
                                                state if s.dist.is_main else None,
                                                s.checkpointable.sharded_state_dict(), extra, s.dist)
        elif s.dist.is_main:
            path = ckpt.save_checkpoint(s.plan.run_dir, s.state.step, state, extra)
        if s.dist.is_main:
            ckpt.prune(s.plan.run_dir, s.cfg.checkpoint.keep_last)
        return Path(D.broadcast_object(str(path) if path else None, s.dist))

    def _halt(self, s: Session, rec: Recorder, clock: Clock, step: int,
              local: tuple[str, str, str | None] | None) -> TrainResult:
        requests = [r for r in D.gather_objects(local, s.dist) if r is not None]
        source, reason, rule = requests[0] if requests else ("file", "halt requested", None)
        path = self._save(s, clock, "halt")
        s.hb.emit("halt", step, reason=reason, source=source, checkpoint=str(path), rule=rule)
        if source == "file" and s.dist.is_main:  # acted on: retired, so no later start warns about it
            with contextlib.suppress(OSError):
                rundir.retire_halt(s.plan.files)
        s.out.stop()
        s.out.message(f"halted at step {step} ({source}: {reason}); checkpoint {path}", tone="caution")
        result = self._finish(s, rec, "halted", None)
        result.halted_by = ("signal" if source in ("SIGTERM", "SIGINT")
                            else "watchdog" if rule or reason.startswith(WATCHDOG_PREFIX) else "operator")
        return result

    def _stop_at(self, s: Session, rec: Recorder, clock: Clock) -> TrainResult:
        """``train.stop_at`` reached: a checkpoint, and the run ends halted so a resume goes on from it."""
        step = s.state.step
        path = self._save(s, clock, "stop_at")
        s.hb.emit("halt", step, reason=f"train.stop_at={step}", source="stop_at", checkpoint=str(path),
                  rule=None)
        s.out.stop()
        s.out.message(f"stopped at step {step} of {s.cfg.train.steps} (train.stop_at); checkpoint {path}; "
                      f"resume to go on")
        result = self._finish(s, rec, "halted", None)
        result.halted_by = "stop_at"
        return result

    def _anomaly(self, s: Session, rec: Recorder, step: int, kind: str, value: float,
                 r: StepOutcome) -> TrainResult:
        last_good, _ = newest_verified(s.plan.run_dir)
        record_path = s.plan.files.anomaly(step)
        if s.dist.is_main:
            record: Anomaly = {
                "step": step, "kind": kind, "value": repr(value), "loss": repr(r.loss),
                               "grad_norm": repr(r.grad_norm),
                "lr": s.optimizer.param_groups[0]["lr"], "time": time.time(), "applied": False,
                "last_good_checkpoint": str(last_good) if last_good else None,
                "fault_injected": self.step_hook is not None,  # a test's hook ran (real runs have none)
            }
            record_path = rundir.write_anomaly(s.plan.files, step, record)
        # the value as text: JSON has no NaN (it would read as null); the record relative to the run directory
        s.hb.emit("anomaly", step, kind=kind, value=repr(value), record=f"anomalies/{record_path.name}")
        s.hb.emit("halt", step - 1, reason=f"{kind} at step {step}", source="anomaly",
                  checkpoint=str(last_good) if last_good else None, rule=None)
        s.out.stop()
        s.out.message(f"anomaly {kind} at step {step} (value {value}); step not applied; record "
                      f"{record_path}; last good checkpoint {last_good}", tone="bad")
        return self._finish(s, rec, "failed", f"{kind} at step {step}")

    def _finish(self, s: Session, rec: Recorder, status: Status, error: str | None) -> TrainResult:
        _log_said(s)
        metrics = rec.summary(status, error)
        if s.dist.is_main:
            write_json_atomic(s.plan.files.metrics, metrics)
        s.hb.emit("end", s.state.step, status=status, error=error)
        s.out.stop()
        s.out.message(rec.data_read())
        if status == "completed":
            s.out.message(f"done {s.state.step} steps | final loss {s.state.last_loss:.4f} | "
                          f"{metrics['tokens_per_s'] or 0:.0f} tok/s | run dir {s.plan.run_dir}", tone="good")
        s.ended = True
        return TrainResult(status, s.plan.run_dir, s.state.step, s.state.last_loss, metrics)


def check_same_model(mine: dict[str, Any], saved: dict[str, Any], path: Path) -> None:
    """Refuse to resume a checkpoint whose ``model``/``nsa`` sections differ from this run's, naming each
    differing key and the ``--set`` that restores the saved value."""
    for section in ("model", "nsa"):
        theirs = saved.get(section)
        if theirs is None or theirs == mine[section]:
            continue
        diff = sorted(k for k in mine[section] if theirs.get(k) != mine[section][k])
        sets = " ".join("--set "
                        f"{section}.{k}={json.dumps(theirs.get(k), separators=(',', ':'))}" for k in diff)
        raise CheckpointError(
            f"checkpoint {path} has a different '{section}' section "
            f"({', '.join(f'{section}.{k}' for k in diff)})",
                              hint="resume with the config the run was started with (see its config.yaml): "
                                   f"{sets}",
        )


def _local_halt_request(s: Session) -> tuple[str, str, str | None] | None:
    """(source, reason, watch rule) when this rank was asked to halt: a signal, or ``.HALT`` (rank 0 reads it;
    a watchdog's names its rule)."""
    if s.signals.halt_source is not None:
        return s.signals.halt_source, f"{s.signals.halt_source} received", None
    if s.dist.is_main:
        request = rundir.halt_request(s.plan.files.root)
        if request is not None:
            return "file", *request
    return None


def failure_text(exc: BaseException) -> str:
    """What a run that ended on ``exc`` records as its error: a write that failed names its file and the free
    space (``OSError: cannot write RUN/checkpoints/step_00000010: No space left on device (2.9 MiB free)``),
    even behind ``torch.save``'s ``RuntimeError``; an operator's Ctrl-C twice says so."""
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted: {exc or 'KeyboardInterrupt'}"
    disk = os_error_in(exc)
    if disk is not None:
        return f"{type(disk).__name__}: {write_failure(disk)}"[:1000]
    return f"{type(exc).__name__}: {exc}"[:1000]


def _log_said(s: Session) -> None:
    """What the signal handlers said on stderr, into the run's log."""
    while s.signals.said:
        s.out.record(s.signals.said.pop(0))


def _record_failure(s: Session, rec: Recorder, exc: BaseException) -> None:
    """An exception escaped the loop: say so in the heartbeat and ``metrics.json`` (best effort); Ctrl-C
    twice is ``interrupted``, anything else ``failed``."""
    _log_said(s)
    if s.ended:
        return
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    error = failure_text(exc)
    s.out.record(f"run {status} at step {s.state.step}: {error}")
    with contextlib.suppress(Exception):
        if s.dist.is_main:
            write_json_atomic(s.plan.files.metrics, rec.summary(status, error))
    with contextlib.suppress(Exception):
        s.hb.emit("end", s.state.step, status=status, error=error)


__all__ = ["TrainResult", "TrainState", "Trainer"]
