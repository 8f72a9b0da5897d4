"""Training-step benchmark: tokens/s, MFU and peak memory of the NSA model and the same model with dense
attention (``model.attention = "dense"``), eager and/or under ``torch.compile``, on random tokens, bf16
autocast on CUDA: the trainer's own step (:class:`nsa.train.step.Stepper`: the run's optimizer and schedule,
clipping, step hooks and the one all-reduce with its host sync), so the rate is what ``nsa train`` reaches
without its data loading. MFU follows :data:`nsa.train.telemetry.MFU_FORMULA` (the model's own
``flops_per_token(seq_len)``: 6 x parameters plus the attention products each variant really computes,
over the device's bf16 datasheet peak).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from nsa.bench.profile import profile_kernels
from nsa.bench.requests import TrainBenchRequest
from nsa.config import RunConfig
from nsa.errors import ConfigError
from nsa.model import build_model
from nsa.model.context import ContextParallel
from nsa.model.diagnostics import ScorerParams
from nsa.ops import fallback_counts, reset_fallback_counts, tile_overrides
from nsa.train import distributed as D
from nsa.train import parallel
from nsa.train.hooks import step_hooks
from nsa.train.schedule import build_scheduler
from nsa.train.step import Stepper, build_optimizer
from nsa.train.telemetry import peak_flops
from nsa.view import Block, Line, Payload, Table, fig


@dataclass
class TrainRow:
    """One model at one sequence length; ``step_ms`` is the timed steps' whole time over their number."""

    attention: str
    seq_len: int
    batch_size: int
    params_m: float
    step_ms: float
    tokens_per_s: float
    peak_mib: float | None
    device: str
    backend: str
    compiled: bool = False
    fallbacks: dict[str, int] = field(default_factory=dict)
    mfu: float | None = None
    flops_per_token: float | None = None
    compile_s: float | None = None  # the first warm-up step under torch.compile (tracing + Inductor)
    error: str | None = None  # "out of memory" when the batch does not fit; the figures are then 0
    # one profiled step (``profile=True``): kernels by CUDA time, ``{"name", "ms", "launches"}``
    kernels: list[dict[str, Any]] | None = None
    launches: int | None = None  # GPU kernel launches of the profiled step
    parts: dict[str, float] | None = None  # the profiled step's device ms by part (nsa.bench.step_parts)
    # several ranks (``nsa bench train --nproc-per-node N``): tokens/s count each sequence once over all
    # ranks,
    # ``step_ms`` is the slowest rank's mean step and ``peak_mib`` the largest rank's peak
    world_size: int = 1
    context_parallel: int = 1  # ranks that share each sequence
    parallel: str = "none"  # ddp, fsdp or none (one rank)
    # the torch.compile mode that ran (RunConfig.torch_compile_mode); None: eager
    compile_mode: str | None = None
    dense_layers: list[int] = field(default_factory=list)  # an NSA model's dense blocks (model.dense_layers)

    @property
    def mode(self) -> str:
        """``eager``, ``compiled``, or ``compiled (reduce-overhead)`` and the like for another compile
        mode."""
        if not self.compiled:
            return "eager"
        return "compiled" if self.compile_mode in (None, "default") else f"compiled ({self.compile_mode})"

    @property
    def path(self) -> str:
        """The attention path that ran: the backend, with the calls that fell back to the torch path."""
        if self.attention == "dense":
            return "dense (SDPA)"
        n = sum(self.fallbacks.values())
        path = (f"{self.backend} + torch fallback ({n:,} calls)" if n and self.backend != "torch"
                else self.backend)
        return f"{path}, blocks {','.join(map(str, self.dense_layers))} dense" if self.dense_layers else path

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def ranks(self) -> str:
        """``1``, or ``N (D data x C context)``."""
        if self.world_size == 1:
            return "1"
        return (f"{self.world_size} ({self.world_size // self.context_parallel} data x "
                f"{self.context_parallel} context)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": self.path, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu}


def bench_train_step(
    run_cfg: RunConfig, *, attention: str, seq_len: int, batch_size: int, steps: int = 10,
    warmup: int = 3, device: str | torch.device | None = None, compiled: bool | None = None,
    tune: Mapping[str, int | str] | None = None, profile: bool = False,
    ranks: tuple[D.DistInfo, D.Layout] | None = None,
                     hold: Callable[[], AbstractContextManager[Any]] | None = None,
    trace_dir: Path | None = None,
) -> TrainRow:
    """Median step time of forward + backward + optimizer step for one model variant, with the selection
    losses of ``scorer`` (the alignment loss by default) as the trainer runs them.

    With ``runtime.compile`` the model is wrapped in ``torch.compile`` (the warm-up steps absorb the
    compilation), for NSA and dense alike, so the ratio compares like with like; ``compiled`` overrides
    the config's ``runtime.compile``. A batch that does not fit gives a row with ``error="out of memory"``.
    ``profile``: after the timed steps, one more step under ``torch.profiler`` fills ``kernels``/``launches``;
    ``trace_dir`` (implies ``profile``): that step's Chrome trace is written there, one file per rank
    (``<attention>-S<len>-<mode>-rank<r>.json``: the timeline, where the collectives overlap the kernels or
    not).
    ``hold``: a context entered after the first (compiling) step and held through the other warm-up steps, the
    timed ones and the profile (:func:`nsa.bench.timing.device_turn`: processes that compile side by side on
    one GPU take turns to time); the step is then the lowest of three windows of ``steps`` (the first step of
    a process still compiling outside its turn may reach the GPU during one of them).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = run_cfg.model_copy(deep=True)
    if compiled is not None:
        cfg.runtime.compile = compiled
    use_compile = cfg.runtime.compiles(dev.type)

    try:
        with tile_overrides(tune):
            return _bench_step(cfg, attention, seq_len, batch_size, steps, warmup, dev, use_compile,
                               profile or trace_dir is not None, ranks, hold, trace_dir)
    except torch.OutOfMemoryError:
        if ranks is not None and ranks[0].enabled:
            raise  # the other ranks wait in a collective: the job stops (the launcher says which rank)
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        return TrainRow(attention=attention, seq_len=seq_len, batch_size=batch_size, params_m=0.0,
                        step_ms=0.0, tokens_per_s=0.0, peak_mib=None, device=name,
                        backend=cfg.runtime.attn_backend, compiled=use_compile, error="out of memory")


def _bench_step(cfg: RunConfig, attention: str, seq_len: int, batch_size: int, steps: int, warmup: int,
                dev: torch.device, use_compile: bool, profile: bool = False,
                ranks: tuple[D.DistInfo, D.Layout] | None = None,
                hold: Callable[[], AbstractContextManager[Any]] | None = None,
                trace_dir: Path | None = None) -> TrainRow:

    cfg.model.attention = attention  # type: ignore[assignment]
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq_len)
    # what the step is (RunConfig.torch_compile_mode): one micro-batch of batch_size sequences
    cfg.train.seq_len, cfg.train.batch_size, cfg.train.accum = seq_len, batch_size, 1
    if dev.type == "cuda" and cfg.runtime.attn_backend == "auto":
        cfg.runtime.attn_backend = "triton"  # explicit, so a fallback to torch is counted
    info, grid = ranks or (D.DistInfo(), D.Layout())
    torch.manual_seed(0)
    # the selection losses (scorer.*) as the trainer's, one step being one micro-batch
    model = build_model(cfg, ScorerParams.of_config(cfg.scorer)).to(dev)
    model.train()
    if use_compile:
        torch._dynamo.reset()  # a fresh graph per row: shapes differ, never the recompile limit
    cp = ContextParallel(grid.context_group, grid.context_rank,
                         grid.context_size) if grid.context_size > 1 else None
    model.set_context_parallel(cp)
    # the trainer's own wrapping: DDP or FSDP2 on several ranks, compiled from the outside (one rank:
    # compiled)
    forward = parallel.wrap(model, cfg, info, "bf16" if dev.type == "cuda" else "fp32", dev.type, use_compile)
    gen = torch.Generator(device="cpu").manual_seed(grid.data_rank)  # each data rank its own batch
    ids = torch.randint(0, cfg.model.vocab_size, (batch_size, seq_len + 1), generator=gen).to(dev)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    if cp is not None:  # this rank's head and tail chunks of each sequence
        inputs, labels = cp.shard(inputs), cp.shard(labels)

    def autocast() -> AbstractContextManager[Any]:
        return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()

    # the trainer's own step (nsa.train.step): its optimizer, schedule, clipping, hooks and one all-reduce
    optimizer = build_optimizer(model, cfg, dev.type)
    scheduler = build_scheduler(optimizer, cfg.train.steps, cfg.schedule.warmup_steps,
                                cfg.schedule.min_lr_ratio)
    stepper = Stepper(cfg, model, forward, optimizer, scheduler, autocast, dev, info,
                      step_hooks(cfg, model, None), lambda: (inputs, labels, None))
    step = stepper.step

    reset_fallback_counts()
    compile_s = None
    warm = max(warmup, 1 if use_compile else 0)
    if use_compile:  # the compiling step, outside the turn
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        compile_s = time.perf_counter() - t0
        warm -= 1
    with hold() if hold is not None else nullcontext():
        for _ in range(warm):
            step()
        ms, peak = _timed_steps(step, steps, dev)
        if hold is not None:  # others' compiling steps may still reach the GPU: the quietest of three windows
            for _ in range(2):
                ms = min(ms, _timed_steps(step, steps, dev)[0])
        mode = "compiled" if use_compile else "eager"
        trace = (None if trace_dir is None
                 else trace_dir / f"{attention}-S{seq_len}-{mode}-rank{info.rank}.json")
        kernels = _profile_step(step, dev, trace=trace) if profile else None
    if info.enabled:  # the slowest rank sets the step; the fullest rank the memory
        ms, peak_all = (max(v) for v in zip(*D.gather_objects((ms, peak or 0.0), info), strict=True))
        peak = peak_all if dev.type == "cuda" else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    tps = batch_size * grid.data_size * seq_len / (ms / 1e3)
    fpt = float(model.flops_per_token(seq_len))
    peak_fl = peak_flops(name, None)[0] if dev.type == "cuda" else None
    row = TrainRow(attention=attention, seq_len=seq_len, batch_size=batch_size,
                   params_m=model.num_params() / 1e6, step_ms=ms, tokens_per_s=tps, peak_mib=peak,
                   device=name, backend=cfg.runtime.attn_backend, compiled=use_compile,
                   fallbacks=fallback_counts(),
                   mfu=tps / info.world_size * fpt / peak_fl if peak_fl else None, flops_per_token=fpt,
                   compile_s=compile_s, world_size=info.world_size, context_parallel=grid.context_size,
                   parallel=cfg.runtime.parallel if info.enabled else "none",
                   compile_mode=cfg.torch_compile_mode(info.world_size) if use_compile else None,
                   dense_layers=list(cfg.model.dense_layers))
    if kernels is not None:
        row.kernels, row.launches, row.parts = kernels
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _timed_steps(step: Callable[[], object], steps: int, dev: torch.device) -> tuple[float, float | None]:
    """The milliseconds a step takes over ``steps`` calls in a row (their whole time over their number, as
    ``nsa train`` counts its tokens/s: any pause between steps included; CUDA events on a GPU) and the peak
    MiB allocated during them (None on a CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps, torch.cuda.max_memory_allocated(dev) / 2**20
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) * 1e3 / steps, None


def _profile_step(step: Callable[[], object], dev: torch.device, top: int = 25,
                  trace: Path | None = None) -> tuple[list[dict[str, Any]], int, dict[str, float]]:
    """One step's kernels by device time (the ``top`` largest), its kernel launches and its device time by
    part (:func:`nsa.bench.profile.profile_kernels`); on a CPU, the operators by self CPU time and their calls
    (no parts). ``trace``: the step's Chrome trace (host and device) written to that file."""
    prof = profile_kernels(step, dev, trace=trace)
    return prof.top(top), prof.launches, prof.parts


def join_ranks(context: int, device_type: str) -> tuple[D.DistInfo, D.Layout]:
    """This process's rank in a torchrun job (NCCL on CUDA, gloo on CPU) and its place in the data x
    context grid; one process alone: rank 0 of 1."""
    info = D.init(device_type)
    if info.world_size % context:
        raise ConfigError(f"--context-parallel {context} must divide the {info.world_size} rank(s)",
                          hint="pass --nproc-per-node a multiple of it")
    return info, D.layout(info, context, device_type)


def bench_train(
    run_cfg: RunConfig, seq_lens: list[int], batch_sizes: list[int], *,
                attentions: tuple[str, ...] = ("nsa", "dense"),
    steps: int = 10, warmup: int = 3, device: str | None = None, modes: tuple[bool | None, ...] = (None,),
    on_row: Callable[[TrainRow], None] | None = None, tune: Mapping[str, int | str] | None = None,
    profile: bool = False, ranks: tuple[D.DistInfo, D.Layout] | None = None, trace_dir: Path | None = None,
) -> list[TrainRow]:
    """Rows for each sequence length (with its batch size), each mode (``False`` eager, ``True`` compiled,
    ``None`` the config's ``runtime.compile``) and each attention variant; ``on_row`` sees each as it ends.
    ``ranks`` (:func:`join_ranks`, in a process of a torchrun job): every rank runs the same rows together."""
    rows = []
    for S, bs in zip(seq_lens, batch_sizes, strict=True):
        for mode in modes:
            for att in attentions:
                rows.append(bench_train_step(run_cfg, attention=att, seq_len=S, batch_size=bs, steps=steps,
                                             warmup=warmup, device=device, compiled=mode, tune=tune,
                                             profile=profile, ranks=ranks, trace_dir=trace_dir))
                if on_row is not None:
                    on_row(rows[-1])
    return rows


def speedups(rows: list[TrainRow]) -> dict[str, float]:
    """NSA tokens/s over dense tokens/s per ``"S=<len> b=<batch> <mode>"`` (where both were measured)."""
    by: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.error is None:
            # each variant in the compile mode it runs best in
            compiled = "compiled" if r.compiled else "eager"
            by.setdefault(f"S={r.seq_len} b={r.batch_size} {compiled}", {})[r.attention] = r.tokens_per_s
    return {k: v["nsa"] / v["dense"] for k, v in by.items() if "nsa" in v and "dense" in v}


def train_command(req: TrainBenchRequest, *, argv: list[str], program: list[str],
                  say: Callable[[str], None] | None = None) -> Payload:
    """``nsa bench train``: the request checked, then either launched on ``nproc_per_node`` ranks through
    torchrun (``python <program> <argv>`` on each; the launcher's result is its exit code alone) or run here
    (a rank of such a launch: only rank 0 reports). ``say`` hears each row as it is measured. The rows, their
    table and lines, and the JSON payload."""
    from nsa.bench.timing import parse_tune
    from nsa.config import load_run_config
    from nsa.envinfo import environment
    from nsa.train.launch import relaunch
    from nsa.train.telemetry import MFU_FORMULA

    cp, nproc, under_torchrun = req.context_parallel, req.nproc_per_node, D.launched_by_torchrun()
    if cp > 1 and nproc is None and not under_torchrun:
        raise ConfigError(f"--context-parallel {cp} needs ranks to share the sequence",
                          hint=f"add --nproc-per-node {cp}")
    if nproc is not None and nproc % cp:
        raise ConfigError(f"--context-parallel {cp} must divide --nproc-per-node {nproc}")
    tuned = parse_tune(req.tune)
    if any(a not in ("nsa", "dense") for a in req.attentions):
        raise ConfigError(f"--attention {list(req.attentions)} must be nsa and/or dense")
    config, lens, bss, steps, warmup = req.config, req.seq_lens, req.batch_sizes, req.steps, req.warmup
    if req.tiny:
        config, lens, bss, steps, warmup = "tiny", [64], [2], 2, 1
    elif len(lens) != len(bss):
        raise ConfigError("--batch-sizes needs one value per --seq-lens value")
    resolved = load_run_config(config=config, sets=req.sets)
    device = "cpu" if req.tiny or not torch.cuda.is_available() else "cuda"
    names = [m.strip() for m in (req.modes or ("eager,compiled" if device == "cuda" else "eager")).split(",")
             if m.strip()]
    if not names or any(m not in ("eager", "compiled") for m in names):
        raise ConfigError(f"--modes {req.modes!r} must be eager and/or compiled")
    if cp > 1 and (bad := [n for n in lens if n % (2 * cp)]):
        raise ConfigError(f"--seq-lens {','.join(map(str, bad))}: each must split into {2 * cp} equal chunks "
                          f"for --context-parallel {cp}")
    if nproc is not None and not under_torchrun:
        return Payload(None, code=relaunch(nproc, program, argv, say=say))
    ranks = join_ranks(cp, device) if under_torchrun else None
    main = ranks is None or ranks[0].is_main

    def progress(r: TrainRow) -> None:
        what = (r.error or f"{r.tokens_per_s:,.0f} tokens/s, {r.step_ms:.1f} ms/step, peak "
                           f"{fig(r.peak_mib, '.0f')} MiB")
        if main and say is not None:
            say(f"{r.attention} {r.mode} S={r.seq_len} b={r.batch_size}"
                f"{f' ranks {r.ranks}' if r.world_size > 1 else ''}: {what}")

    rows = bench_train(resolved.config, lens, bss, attentions=tuple(req.attentions), steps=steps,
                       warmup=warmup, device=device,
                       modes=tuple(m == "compiled" for m in dict.fromkeys(names)), on_row=progress,
                       tune=tuned, profile=req.profile, ranks=ranks, trace_dir=req.trace_dir)
    if ranks is not None:
        D.shutdown()
    if not main:
        return Payload(None)
    ratio = speedups(rows)
    blocks: list[Block] = [_train_table(rows, config),
                           Line(f"MFU: {MFU_FORMULA} (world_size {rows[0].world_size})",
                                                              wrap=False)]
    blocks += [Line(f"{key}: NSA/dense tokens/s = {x:.2f}", wrap=False) for key, x in ratio.items()]
    for r in rows:
        if r.fallbacks:
            blocks.append(Line(f"fallbacks ({r.attention}, S={r.seq_len}): {r.fallbacks}", wrap=False))
        if r.kernels:
            top = ", ".join(f"{k['name'][:40]} {k['ms']:.1f} ms" for k in r.kernels[:5])
            blocks.append(Line(f"profile ({r.attention} {r.mode}, S={r.seq_len}): {r.launches} launches; "
                               f"{top}", wrap=False))
    return Payload({"command": "bench train", "config": config, "environment": environment(), "tune": tuned,
                    "rows": [r.to_dict() for r in rows], "nsa_over_dense": ratio}, blocks)


def _train_table(rows: list[TrainRow], config: str) -> Table:
    t = Table.of(f"training step ({rows[0].device}, config {config}, ranks {rows[0].ranks}; path: the "
                 "attention path that ran; batch: per data rank)",
                 ("attention", "path", "mode", "S", "batch", "params M", "step ms",
                                                     "tokens/s", "tok/s/GPU", "MFU", "peak MiB", "compile s"))
    for r in rows:
        if r.error:
            t.add(r.attention, r.path, r.mode, str(r.seq_len), str(r.batch_size), "", r.error, "", "", "", "",
                  "")
            continue
        t.add(r.attention, r.path, r.mode, str(r.seq_len), str(r.batch_size), f"{r.params_m:.1f}",
              f"{r.step_ms:.1f}", f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s_per_gpu:,.0f}",
              fig(r.mfu, ".1%") if r.mfu else "-", fig(r.peak_mib, ".0f"),
              fig(r.compile_s, ".0f") if r.compile_s else "-")
    return t
