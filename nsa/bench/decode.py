"""Decode benchmark: one cached decode step of NSA against dense attention over a KV cache.

Two modes, one row each per (shape, context, batch):
- ``attention``: the single-query attention math alone (``nsa.ops.decode.nsa_decode`` against SDPA over
  the whole cache) for the paper shape (HQ=64, H=4, D=128) and the m7c shape (HQ=12, H=2, D=64);
- ``model``: a whole-model decode step (``NSALM.decode_step``) of a config (default ``m7c-125m``) and of
  the same model with dense attention.
Caches are filled with random values at the given context (no prefill: the step's cost does not
depend on how the cache was filled). On CUDA each step is also timed as a CUDA-graph replay, which
removes the Python and launch overhead that dominates small batches. With ``compile`` the NSA op
(attention rows) or every block's decode step of both models (model rows) runs through
``torch.compile``, which fuses the step's many small kernels. ``reads`` are key positions
read per step per sequence and KV group (per layer), measured from the index sets the step used.
No printing here: the CLI renders the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nsa.bench.requests import SHAPES, DecodeRequest
from nsa.bench.timing import Timer, make_timer
from nsa.config import load_run_config
from nsa.errors import ConfigError
from nsa.model import build_model
from nsa.model.dense import sdpa_gqa
from nsa.ops.decode import compiled_nsa_decode, nsa_decode
from nsa.ops.indexing import cmp_block_table, num_cmp
from nsa.params import NSAParams
from nsa.view import Line, Payload, Table, fig

TINY_SHAPES: dict[str, tuple[int, int, int]] = {"tiny": (4, 2, 16)}
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_BATCHES = (1, 32)
MODEL_CONTEXTS = (2048, 65536)
TINY_CONTEXTS = (64, 128)
TINY_BATCHES = (1, 2)


@dataclass
class DecodeRow:
    """One measured configuration; times are medians in milliseconds per decode step."""

    mode: str
    shape: str
    context: int
    batch: int
    device: str
    dtype: str
    backend: str = "auto"
    compiled: bool = False
    nsa_ms: float | None = None
    dense_ms: float | None = None
    nsa_graph_ms: float | None = None
    dense_graph_ms: float | None = None
    nsa_reads: float | None = None
    dense_reads: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        """dense / NSA time of a step (CUDA-graph times where both were captured)."""
        if self.nsa_graph_ms and self.dense_graph_ms:
            return self.dense_graph_ms / self.nsa_graph_ms
        if self.nsa_ms and self.dense_ms:
            return self.dense_ms / self.nsa_ms
        return None

    @property
    def reads_ratio(self) -> float | None:
        if self.nsa_reads and self.dense_reads:
            return self.dense_reads / self.nsa_reads
        return None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(speedup=self.speedup, reads_ratio=self.reads_ratio)
        return out


def _graph(fn: Callable[[], Any], device: torch.device) -> Callable[[], None] | None:
    """``fn`` captured as a CUDA graph (replay callable), or ``None`` off CUDA or if capture fails."""
    if device.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize(device)
    except Exception:
        torch.cuda.synchronize(device)
        return None
    return graph.replay


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


@contextmanager
def _noting_oom(row: DecodeRow, side: str, device: torch.device) -> Iterator[None]:
    """Out of memory inside becomes a note on ``row`` (``"nsa: out of memory"``); the cache is emptied
    after."""
    try:
        yield
    except Exception as exc:
        if not _oom(exc):
            raise
        row.notes.append(f"{side}: out of memory")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _timed(fn: Callable[[], Any], device: torch.device, timer: Timer, graphs: bool) -> tuple[float,
    float | None]:
    """Median ms of ``fn`` eager, and of its CUDA-graph replay (``None`` off CUDA or if capture fails)."""
    ms = timer(fn)
    g = _graph(fn, device) if graphs else None
    return ms, (timer(g) if g is not None else None)


def bench_attention_step(
    shape: str, HQ: int, H: int, D: int, context: int, batch: int, *, params: NSAParams,
    device: torch.device, dtype: torch.dtype, timer: Timer, graphs: bool = True, seed: int = 0,
    backend: str = "auto", compile: bool = False,
) -> DecodeRow:
    """One query per sequence at position ``context`` (so ``context + 1`` keys in the dense cache);
    ``backend`` is ``nsa_decode``'s (``torch`` or ``triton``); ``compile``: through ``torch.compile``."""

    row = DecodeRow("attention", shape, context, batch, str(device), str(dtype).removeprefix("torch."),
                    backend, compile)
    op = nsa_decode
    if compile:
        torch._dynamo.reset()  # one compiled graph per row's shapes, never the recompile limit
        op = compiled_nsa_decode()
    p = params
    T = context + 1
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=device, dtype=dtype)

    with _noting_oom(row, "nsa", device):
        q = rnd(batch, HQ, D)
        gates = torch.rand(batch, HQ, 3, generator=gen, device=device, dtype=dtype)
        t = torch.full((batch,), context, dtype=torch.int64, device=device)
        C, R = num_cmp(T, p.l, p.d), min(p.w, T)
        k_sel, v_sel = rnd(batch, H, T, D), rnd(batch, H, T, D)
        k_cmp, v_cmp = rnd(batch, H, C + 1, D), rnd(batch, H, C + 1, D)
        k_win, v_win = rnd(batch, H, R, D), rnd(batch, H, R, D)
        table = cmp_block_table(C + 1, -(-T // p.l_sel), p.l, p.d, p.l_sel, device=device)

        def run() -> Any:
            return op(q, t, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, p, table=table, backend=backend)

        def nsa() -> torch.Tensor:
            return run().o

        row.nsa_reads = float(run().reads.float().mean())
        row.nsa_ms, row.nsa_graph_ms = _timed(nsa, device, timer, graphs)
    with _noting_oom(row, "dense", device):
        qd = rnd(batch, HQ, 1, D)

        def dense() -> torch.Tensor:
            return sdpa_gqa(qd, k_sel, v_sel)  # every cached position <= t: no mask needed

        row.dense_reads = float(T)
        row.dense_ms, row.dense_graph_ms = _timed(dense, device, timer, graphs)
    return row


def bench_model_step(
    run_cfg: Any, context: int, batch: int, *, name: str, device: torch.device, dtype: torch.dtype,
    timer: Timer, graphs: bool = True, seed: int = 0, backend: str = "auto", compile: bool = False,
) -> DecodeRow:
    """``NSALM.decode_step`` at position ``context`` for the NSA model and its dense twin
    (``backend``: the NSA layers' ops backend, which picks ``nsa_decode``'s path; ``compile``: both
    models' block decode steps through ``torch.compile``)."""

    row = DecodeRow("model", name, context, batch, str(device), str(dtype).removeprefix("torch."), backend,
                    compile)
    for attention in ("nsa", "dense"):
        cfg = run_cfg.model_copy(deep=True)
        cfg.model.attention = attention
        cfg.runtime.attn_backend = backend
        cfg.model.max_seq_len = max(cfg.model.max_seq_len, context + 1)
        if cfg.model.dense_layers:  # the config's hybrid stack (m7c-125m's): its NSA model has dense blocks
            row.notes.append(f"nsa model: {cfg.model.stack}")
        torch.manual_seed(seed)
        model = None
        with _noting_oom(row, attention, device):
            model = build_model(cfg).to(device=device, dtype=dtype).eval()
            if compile:
                torch._dynamo.reset()
                model.compile_decode()
            cache = model.new_cache(batch, context + 1)
            base = torch.full((batch,), context, dtype=torch.int64, device=device)
            cache.start(base)
            gen = torch.Generator(device=device).manual_seed(seed)
            for layer in cache.layers:
                for v in vars(layer).values():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 4:
                        v.normal_(generator=gen)
            tok = torch.randint(0, cfg.model.vocab_size, (batch,), device=device, generator=gen)

            def step(model: Any = model, cache: Any = cache, base: torch.Tensor = base,
                     tok: torch.Tensor = tok) -> torch.Tensor:
                cache.lengths.copy_(base)  # the same position each call: steady-state cost
                cache.host_len = context
                return model.decode_step(tok, cache)

            with torch.no_grad():
                cache.reads_total.zero_()
                step()
                H, L = cfg.model.n_kv_groups, cfg.model.n_layers
                reads = float(cache.reads_total.float().mean()) / (H * L)
                ms, gms = _timed(step, device, timer, graphs)
            if attention == "nsa":
                row.nsa_ms, row.nsa_graph_ms, row.nsa_reads = ms, gms, reads
            else:
                row.dense_ms, row.dense_graph_ms, row.dense_reads = ms, gms, reads
        del model
    return row


def bench_decode(
    *, tiny: bool = False, contexts: list[int] | None = None, batches: list[int] | None = None,
    shapes: list[str] | None = None, model_config: str | None = None, model_contexts: list[int] | None = None,
    modes: tuple[str, ...] = ("attention", "model"), graphs: bool = True, warmup_ms: int = 25,
                 rep_ms: int = 100,
    device: str | torch.device | None = None, backend: str = "auto", compile: bool = False,
    sets: list[str] | None = None,
) -> list[DecodeRow]:
    """All rows: attention-only steps over shapes x contexts x batches, then whole-model steps (the model of
    ``model_config`` with ``sets``, ``section.key=value``, e.g. ``model.dense_layers=[]``).

    ``tiny``: CPU-sized (shape HQ=4,H=2,D=16, small NSA blocks, contexts 64/128, batches 1/2, the
    ``tiny`` config for the model rows). ``backend``: ``nsa_decode``'s (``auto``: fused Triton on CUDA).
    ``compile``: the NSA op / the blocks' decode steps through ``torch.compile``.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"decode backend '{backend}' must be auto, torch or triton")

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timer = make_timer(dev, warmup_ms, rep_ms)
    table = TINY_SHAPES if tiny else SHAPES
    shapes = shapes or list(table)
    unknown = [s for s in shapes if s not in table]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}: choose from {', '.join(table)}")
    params = NSAParams.tiny() if tiny else NSAParams()
    ctxs = contexts or list(TINY_CONTEXTS if tiny else DEFAULT_CONTEXTS)
    bs = batches or list(TINY_BATCHES if tiny else DEFAULT_BATCHES)
    rows: list[DecodeRow] = []
    if "attention" in modes:
        for s in shapes:
            HQ, H, D = table[s]
            for b in bs:
                for c in ctxs:
                    rows.append(bench_attention_step(s, HQ, H, D, c, b, params=params, device=dev,
                                                     dtype=dtype, timer=timer, graphs=graphs, backend=backend,
                                                     compile=compile))
    if "model" in modes:
        name = model_config or ("tiny" if tiny else "m7c-125m")
        cfg = load_run_config(config=name, sets=sets or [], environ={}).config
        for b in bs:
            for c in model_contexts or ([64] if tiny else list(MODEL_CONTEXTS)):
                rows.append(bench_model_step(cfg, c, b, name=name, device=dev, dtype=dtype, timer=timer,
                                             graphs=graphs, backend=backend, compile=compile))
    return rows


def decode_command(req: DecodeRequest) -> Payload:
    """``nsa bench decode``: the request checked, :func:`bench_decode`'s rows, their table and notes, and the
    JSON payload."""
    from nsa.envinfo import environment

    tiny, shapes, modes, backend, compile = req.tiny, req.shapes, tuple(req.modes), req.backend, req.compile

    if any(m not in ("attention", "model") for m in modes):
        raise ConfigError(f"--mode {list(modes)} must be attention and/or model")
    known = TINY_SHAPES if tiny else SHAPES
    if shapes and any(s not in known for s in shapes):
        raise ConfigError(f"--shape {shapes} must be among: {', '.join(known)}")
    if backend not in ("auto", "torch", "triton"):
        raise ConfigError(f"--backend {backend!r} must be auto, torch or triton")
    if not tiny and not torch.cuda.is_available():
        raise ConfigError("no CUDA device for bench decode", hint="use --tiny on a CPU machine")
    rows = bench_decode(tiny=tiny, contexts=req.contexts, batches=req.batches, shapes=shapes,
                        model_config=req.model_config, model_contexts=req.model_contexts, modes=modes,
                        graphs=req.graphs, backend=backend, compile=compile, sets=req.sets)
    if not rows:
        raise ConfigError("nothing to measure")
    how = backend + (", compiled" if compile else "")
    table = Table.of(f"decode step: NSA ({how}) vs dense ({rows[0].device}, {rows[0].dtype})",
                     ("mode", "shape", "context", "batch", "nsa ms", "dense ms", "nsa graph ms",
                      "dense graph ms", "speed-up", "reads nsa", "reads dense", "reads x"))
    for r in rows:
        table.add(r.mode, r.shape, str(r.context), str(r.batch), fig(r.nsa_ms), fig(r.dense_ms),
                  fig(r.nsa_graph_ms), fig(r.dense_graph_ms), fig(r.speedup, ".2f"), fig(r.nsa_reads, ".0f"),
                  fig(r.dense_reads, ".0f"), fig(r.reads_ratio, ".1f"))
    notes = [Line(f"note ({r.mode} {r.shape}, context {r.context}, batch {r.batch}): {n}", wrap=False)
             for r in rows for n in r.notes]
    payload = {"command": "bench decode", "environment": environment(), "rows": [r.to_dict() for r in rows]}
    return Payload(payload, [table, *notes])
