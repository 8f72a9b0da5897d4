"""Attention benchmark: NSA (compression + top-n + three branches + gates) against dense causal SDPA.

``bench_attention(...)`` returns one row per (shape, sequence length) with forward and forward+backward
medians (``triton.testing.do_bench`` on CUDA, ``time.perf_counter`` medians on CPU), peak memory, the
FLOPs each side must do, achieved TFLOP/s and the speed-up ratios. With fla-core importable, a peer
column times its ``parallel_nsa`` (compression + top-n + selection, no window) where it accepts the shape
(16 or more query heads per KV head). No printing here: the CLI renders the rows.

Size: one benchmark whose rows, FLOP/byte counts and per-stage kernel breakdown share one input setup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nsa.bench.profile import profile_kernels
from nsa.bench.requests import PEAK_TBPS, PEAK_TFLOPS, AttentionRequest
from nsa.bench.timing import make_timer, noise_note
from nsa.errors import ConfigError
from nsa.ops import (
    NSAParams,
    compress_avg,
    fallback_counts,
    nsa_attention,
    reset_fallback_counts,
    tile_overrides,
    use_backend,
)
from nsa.view import Block, Line, Payload, Table, fig

DEFAULT_SEQ_LENS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)  # 128k: issue 53's row
# fla-core autotunes each kernel on its first call; tuning at 64k took minutes, and its tuning keys do
# not include the sequence length, so the peer is tuned once at this length and then timed
PEER_TUNE_LEN = 16384
TINY_SEQ_LENS = (64, 128)


@dataclass
class AttentionRow:
    """One measured configuration; times in milliseconds, memory in MiB (None: not measured)."""

    shape: str
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    device: str
    backend: str
    cuda_graph: bool = False  # each timed call replays a captured CUDA graph (no Python/launch overhead)
    nsa_fwd_ms: float | None = None
    nsa_fwdbwd_ms: float | None = None
    dense_fwd_ms: float | None = None
    dense_fwdbwd_ms: float | None = None
    peer_fwd_ms: float | None = None
    peer_fwdbwd_ms: float | None = None
    nsa_peak_mib: float | None = None
    dense_peak_mib: float | None = None
    # what the forward keeps for the backward, beyond its inputs (tensors saved by autograd, each storage
    # once)
    nsa_saved_mib: float | None = None
    dense_saved_mib: float | None = None
    nsa_fwd_gflop: float = 0.0
    dense_fwd_gflop: float = 0.0
    notes: list[str] = field(default_factory=list)
    noisy: list[str] = field(default_factory=list)  # timings whose repetitions spread too much to be read
    # NSA calls a fast path sent back to a slower one while this row was measured (``op:from->to:why``)
    fallbacks: dict[str, int] = field(default_factory=dict)
    # ``profile=True``: one NSA forward+backward under the profiler (nsa.bench.profile): kernels by device
    # time
    kernels: list[dict[str, Any]] | None = None
    launches: int | None = None
    parts: dict[str, float] | None = None

    @property
    def speedup_fwd(self) -> float | None:
        return _ratio(self.dense_fwd_ms, self.nsa_fwd_ms)

    @property
    def speedup_fwdbwd(self) -> float | None:
        return _ratio(self.dense_fwdbwd_ms, self.nsa_fwdbwd_ms)

    @property
    def vs_peer_fwdbwd(self) -> float | None:
        return _ratio(self.peer_fwdbwd_ms, self.nsa_fwdbwd_ms)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.kernels is None:  # not profiled: the row as before --profile-step
            for key in ("kernels", "launches", "parts"):
                out.pop(key)
        out.update(speedup_fwd=self.speedup_fwd, speedup_fwdbwd=self.speedup_fwdbwd,
                   vs_peer_fwdbwd=self.vs_peer_fwdbwd,
                   nsa_fwd_tflops=_rate(self.nsa_fwd_gflop, self.nsa_fwd_ms),
                   dense_fwd_tflops=_rate(self.dense_fwd_gflop, self.dense_fwd_ms))
        return out


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


def _rate(gflop: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else gflop / ms  # GFLOP / ms == TFLOP/s


def nsa_fwd_flops(S: int, HQ: int, Dk: int, Dv: int, p: NSAParams, batch: int = 1) -> float:
    """Matrix FLOPs of the NSA forward: compressed attention, the score recompute, selection, window."""
    cmp_keys = sel_keys = win_keys = 0
    for t in range(S):
        n_c = max(0, (t + 1 - p.l) // p.d + 1)
        cmp_keys += n_c
        bt = t // p.l_sel
        # chosen blocks: all earlier ones are full, the current one holds t % l_sel + 1 positions
        n_full = min(p.n_sel, bt + 1) - 1
        sel_keys += n_full * p.l_sel + (t % p.l_sel + 1)
        win_keys += min(p.w, t + 1)
    per_head = 2 * (Dk + Dv) * (cmp_keys + sel_keys + win_keys) + 2 * Dk * cmp_keys
    return float(per_head * HQ * batch)


def dense_fwd_flops(S: int, HQ: int, Dk: int, Dv: int, batch: int = 1) -> float:
    """Matrix FLOPs of causal attention (only the lower triangle)."""
    return float(2 * (Dk + Dv) * S * (S + 1) // 2 * HQ * batch)


def _peak_mib(device: torch.device, fn: Callable[[], Any]) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def saved_mib(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> float:
    """MiB that one forward of ``fn`` keeps for its backward beyond ``inputs``: the storages autograd saves
    (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, views of an input not at all).
    Any device: the op's memory between forward and backward, measured on CPU as on a GPU."""
    known = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in known and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / 2**20


def _fwdbwd(fn: Callable[[], torch.Tensor], grad: torch.Tensor, leaves: list[torch.Tensor]) -> Callable[[],
    None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        fn().backward(grad)

    return run


def _graphed(fn: Callable[[], Any], *, grad: bool) -> Callable[[], None]:
    """``fn`` captured once as a CUDA graph (after warm-up on a side stream); the result replays it.

    What the GPU does per call is unchanged; the Python and kernel-launch overhead of the op's many
    small launches is gone, as under ``torch.compile(mode="reduce-overhead")``."""

    def call() -> None:
        with torch.set_grad_enabled(grad):
            fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _peer() -> Callable[..., torch.Tensor] | None:
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception:  # fla-core missing or broken: no peer column
        return None
    fn: Callable[..., torch.Tensor] = parallel_nsa
    return fn


def bench_one(
    shape: str, S: int, HQ: int, H: int, D: int, *, batch: int = 1, params: NSAParams | None = None,
    device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
    peer: bool = True, dense: bool = True, warmup_ms: int = 25, rep_ms: int = 100, seed: int = 0,
    cuda_graph: bool = False, progress: Callable[[str], None] | None = None, profile: bool = False,
) -> AttentionRow:
    """Time NSA and dense attention on the same random inputs of one shape (``cuda_graph``: every side,
    NSA, dense and peer alike, timed as replays of a captured CUDA graph; CUDA only; ``progress``:
    called with a line before each side is timed; ``profile``: one more NSA forward+backward under the
    profiler fills ``kernels``, ``launches`` and ``parts``, :func:`nsa.bench.profile.profile_kernels`)."""
    import torch.nn.functional as F

    say = progress or (lambda _msg: None)
    p = params or NSAParams()
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    row = AttentionRow(shape=shape, batch=batch, seq_len=S, heads=HQ, kv_heads=H, head_dim=D,
                       dtype=str(dtype).removeprefix("torch."), device=_device_name(dev), backend=backend,
                       cuda_graph=cuda_graph and dev.type == "cuda")

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev, dtype=dtype).requires_grad_(True)

    q = rnd(batch, S, HQ, D)
    k_raw, v_raw = rnd(batch, S, H, D), rnd(batch, S, H, D)
    k_sel, v_sel, k_win, v_win = (rnd(batch, S, H, D) for _ in range(4))
    gates = torch.rand(batch, S, HQ, 3, generator=gen, device=dev, dtype=dtype).requires_grad_(True)
    grad = torch.randn(batch, S, HQ, D, generator=gen, device=dev, dtype=dtype)
    leaves = [q, k_raw, v_raw, k_sel, v_sel, k_win, v_win, gates]
    base_timer = make_timer(dev, warmup_ms, rep_ms, cpu_reps=3)

    def timer(fn: Callable[[], Any], *, grad: bool = True, what: str = "") -> float:
        ms = base_timer(_graphed(fn, grad=grad) if row.cuda_graph else fn)
        note = noise_note(what, base_timer.spread)
        if note is not None:
            row.noisy.append(note)
        return ms

    def nsa() -> torch.Tensor:
        with use_backend(backend):
            k_cmp, v_cmp = compress_avg(k_raw, p), compress_avg(v_raw, p)
            out = nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, p)
        assert isinstance(out, torch.Tensor)
        return out

    row.nsa_fwd_gflop = nsa_fwd_flops(S, HQ, D, D, p, batch) / 1e9
    row.dense_fwd_gflop = dense_fwd_flops(S, HQ, D, D, batch) / 1e9
    say(f"{shape} S={S}: NSA ({backend})")
    reset_fallback_counts()
    with torch.no_grad():
        row.nsa_fwd_ms = timer(nsa, grad=False, what="NSA forward")
    row.nsa_fwdbwd_ms = timer(_fwdbwd(nsa, grad, leaves), what="NSA forward+backward")
    row.nsa_peak_mib = _peak_mib(dev, _fwdbwd(nsa, grad, leaves))
    row.nsa_saved_mib = saved_mib(nsa, leaves)
    row.fallbacks = fallback_counts()
    if profile:
        say(f"{shape} S={S}: NSA forward+backward under the profiler")
        prof = profile_kernels(_fwdbwd(nsa, grad, leaves), dev, warmup=1)
        row.kernels, row.launches, row.parts = prof.top(25), prof.launches, prof.parts

    if dense:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k_sel, v_sel))
        gt = grad.transpose(1, 2).contiguous()

        def sdpa() -> torch.Tensor:
            out: torch.Tensor = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            return out

        say(f"{shape} S={S}: dense SDPA")
        with torch.no_grad():
            row.dense_fwd_ms = timer(sdpa, grad=False, what="dense forward")
        row.dense_fwdbwd_ms = timer(_fwdbwd(sdpa, gt, [qt, kt, vt]), what="dense forward+backward")
        row.dense_peak_mib = _peak_mib(dev, _fwdbwd(sdpa, gt, [qt, kt, vt]))
        row.dense_saved_mib = saved_mib(sdpa, [qt, kt, vt])

    parallel_nsa = _peer() if peer and dev.type == "cuda" else None
    if parallel_nsa is not None:
        if HQ // H < 16 or (HQ // H) & (HQ // H - 1):
            row.notes.append(f"fla parallel_nsa refuses {HQ // H} heads per group")
        else:
            g_c, g_s = (gates[..., i].detach().clone().requires_grad_(True) for i in (0, 1))

            def fla(n: int = S) -> torch.Tensor:
                x = [q, k_sel, v_sel, g_c, g_s]
                if n < S:  # the tuning call: detached prefixes
                    x = [t[:, :n].detach().requires_grad_(True) for t in x]
                out: torch.Tensor = parallel_nsa(x[0], x[1], x[2], g_cmp=x[3], g_slc=x[4],
                                                 block_counts=p.n_sel, block_size=p.l_sel)
                return out

            try:
                n_tune = min(S, PEER_TUNE_LEN)
                say(f"{shape} S={S}: fla parallel_nsa, autotuning its kernels at S={n_tune} on first use")
                fla(n_tune).backward(grad[:, :n_tune])
                if n_tune < S:
                    row.notes.append(f"fla parallel_nsa autotuned at S={n_tune} (its tuning keys do not "
                                     "include the length)")
                say(f"{shape} S={S}: fla parallel_nsa")
                with torch.no_grad():
                    row.peer_fwd_ms = timer(fla, grad=False, what="fla forward")
                row.peer_fwdbwd_ms = timer(_fwdbwd(fla, grad, [q, k_sel, v_sel, g_c, g_s]),
                                           what="fla forward+backward")
            except Exception as exc:  # a peer failure must not hide our numbers
                row.notes.append(f"fla parallel_nsa failed: {type(exc).__name__}: {exc}"[:200])
    return row


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def bench_attention(
    shapes: list[tuple[str, int, int, int]], seq_lens: list[int], *, tiny: bool = False,
    tune: Mapping[str, int | str] | None = None, **kwargs: Any,
) -> list[AttentionRow]:
    """Rows for every ``(name, HQ, H, D)`` shape and sequence length (``tiny``: CPU-sized settings;
    ``tune``: Triton block-shape overrides, :func:`nsa.ops.tile_overrides`)."""
    if tiny:
        kwargs.setdefault("params", NSAParams.tiny())
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", torch.float32)
    rows = []
    if shapes and seq_lens and torch.device(kwargs.get("device", "cuda")).type == "cuda":
        # the first measurement of a process pays for the CUDA context, cuBLAS/cuDNN handles and the
        # autotuners: run the first row once untimed, so it does not read slow (4.0 ms against 2.7 ms seen)
        name, HQ, H, D = shapes[0]
        warm = {**kwargs, "warmup_ms": 1, "rep_ms": 1, "progress": None, "profile": False}
        with tile_overrides(tune):
            bench_one(name, min(seq_lens), HQ, H, D, **warm)
    for name, HQ, H, D in shapes:
        for S in seq_lens:
            with tile_overrides(tune):
                rows.append(bench_one(name, S, HQ, H, D, **kwargs))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


@dataclass
class StageRow:
    """One Triton stage of the NSA op at one shape: its median time, its work, and the machine's bound."""

    shape: str
    seq_len: int
    stage: str
    ms: float
    gflop: float
    mbytes: float
    roofline_ms: float  # max(FLOPs at the peak rate, minimum bytes at the peak bandwidth)
    bound: str  # "compute" or "memory": which of the two sets roofline_ms
    path: str = ""  # the compressed stages: "kernel" (ours) or the library kernel that ran them

    @property
    def tflops(self) -> float:
        return self.gflop / self.ms if self.ms > 0 else 0.0

    @property
    def of_roofline(self) -> float:
        """The fraction of the machine's bound this stage reaches (1.0: at the roofline)."""
        return self.roofline_ms / self.ms if self.ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tflops": self.tflops, "of_roofline": self.of_roofline}


def stage_rows(shape: str, S: int, HQ: int, H: int, D: int, times_ms: Mapping[str, float], *,
               params: NSAParams | None = None, batch: int = 1, peak_tflops: float = PEAK_TFLOPS,
               peak_tbps: float = PEAK_TBPS, cmp_path: str = "kernel") -> list[StageRow]:
    """Each timed stage with its FLOPs and minimum bytes (:func:`stage_costs`) and its roofline time, the
    stages in the op's order and a ``total`` row (pure arithmetic: ``times_ms`` from
    :func:`kernel_breakdown`)."""
    costs = stage_costs(S, HQ, H, D, D, params, batch)
    rows = []
    for name, (flops, nbytes) in costs.items():
        if name not in times_ms:
            continue
        t_c, t_m = flops / (peak_tflops * 1e9), nbytes / (peak_tbps * 1e9)
        rows.append(StageRow(shape, S, name, float(times_ms[name]), flops / 1e9, nbytes / 1e6, max(t_c, t_m),
                             "compute" if t_c >= t_m else "memory",
                             cmp_path if name.startswith("cmp_") else ""))
    if rows:
        rows.append(StageRow(shape, S, "total", sum(r.ms for r in rows), sum(r.gflop for r in rows),
                             sum(r.mbytes for r in rows), sum(r.roofline_ms for r in rows),
                             "compute" if sum(r.roofline_ms for r in rows if r.bound == "compute")
                             >= sum(r.roofline_ms for r in rows if r.bound == "memory") else "memory"))
    return rows


def kernel_breakdown(
    S: int, HQ: int, H: int, D: int, *, params: NSAParams | None = None, batch: int = 1,
    dtype: torch.dtype = torch.bfloat16, warmup_ms: int = 10, rep_ms: int = 50, seed: int = 0,
    only: tuple[str, ...] | None = None, tune: Mapping[str, int | str] | None = None,
                     cmp_path: str | None = None,
) -> dict[str, float]:
    """Median milliseconds of each Triton stage of the NSA forward and backward, as the op runs them
    (:class:`nsa.ops.triton_path.Stages`; CUDA only; ``tune``: block-shape overrides,
    :func:`nsa.ops.tile_overrides`; ``cmp_path``: how the compressed stages run, default as the op would
    choose, :func:`stage_cmp_path`; a library kernel's stages include the layout copies around it)."""
    with tile_overrides(tune):
        return _kernel_breakdown(S, HQ, H, D, params or NSAParams(), batch, dtype, warmup_ms, rep_ms, seed,
                                 only, cmp_path or stage_cmp_path(S, HQ, H, D, params))


def stage_cmp_path(S: int, HQ: int, H: int, D: int, params: NSAParams | None = None) -> str:
    """How the op runs the compressed branch for this shape on this process's GPU."""
    from nsa.ops.triton_path import cmp_path_of_shape

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return cmp_path_of_shape(S, HQ, H, D, params or NSAParams(), device)


def _kernel_breakdown(S: int, HQ: int, H: int, D: int, p: NSAParams, batch: int, dtype: torch.dtype,
                      warmup_ms: int, rep_ms: int, seed: int, only: tuple[str, ...] | None,
                      cmp_path: str) -> dict[str, float]:
    import triton.testing

    from nsa.ops import cmp_sdpa
    from nsa.ops.triton_path import Stages

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev, dtype=dtype)

    q = rnd(batch, S, HQ, D)
    k_raw, v_raw, k_sel, v_sel, k_win, v_win = (rnd(batch, S, H, D) for _ in range(6))
    gates = torch.rand(batch, S, HQ, 3, generator=gen, device=dev, dtype=dtype)
    do = rnd(batch, S, HQ, D)
    k_cmp, v_cmp = compress_avg(k_raw, p).contiguous(), compress_avg(v_raw, p).contiguous()
    st = Stages(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, p, D**-0.5)
    cmp_fwd, cmp_bwd = st.cmp_fwd, st.cmp_bwd
    if cmp_path == "kernel":
        st.forward(None)
        st.start_backward(do)
        st.cmp_bwd()  # the gate gradient the later stages read
    else:  # a library kernel on the virtual rows (nsa.ops.cmp_sdpa); the window's backward writes dg
        q_g, k_g, v_g = leaves = [t.detach().requires_grad_(True) for t in (q, k_cmp, v_cmp)]
        o_v, lse_v = cmp_sdpa.attend(q_g, k_g, v_g, p.l, p.d, D**-0.5, cmp_path)
        st.forward(None, (o_v.detach(), lse_v))
        st.start_backward(do)
        st.win_bwd()

        def cmp_fwd() -> None:
            with torch.no_grad():
                st.take_cmp(*cmp_sdpa.attend(q, k_cmp, v_cmp, p.l, p.d, D**-0.5, cmp_path))

        def cmp_bwd() -> None:
            st.cmp_grad()
            torch.autograd.grad(o_v, leaves, st.d_ocmp, retain_graph=True)

    stages: dict[str, Callable[[], Any]] = {
        "compress_avg": lambda: (compress_avg(k_raw, p).contiguous(), compress_avg(v_raw, p).contiguous()),
        "cmp_fwd": cmp_fwd, "select": st.select, "sel_fwd": st.sel_fwd, "win_fwd": st.win_fwd,
        "cmp_bwd": cmp_bwd, "sel_bwd": st.sel_bwd, "win_bwd": st.win_bwd,
    }
    return {name: float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
            for name, fn in stages.items() if only is None or name in only}


def stage_costs(S: int, HQ: int, H: int, Dk: int, Dv: int, params: NSAParams | None = None,
                batch: int = 1) -> dict[str, tuple[float, float]]:
    """``(FLOPs, minimum bytes)`` of each stage named as in :func:`kernel_breakdown` (bf16 tensors).

    FLOPs are the matrix products the kernels execute for the useful key set (no masked waste, no
    union waste); backward counts the recomputation (dq: 3 products, dk/dv: 4). Bytes: each input
    read once and each output written once.
    """
    p = params or NSAParams()
    cmp_keys = sel_keys = win_keys = 0
    for t in range(S):
        cmp_keys += max(0, (t + 1 - p.l) // p.d + 1)
        bt = t // p.l_sel
        sel_keys += (min(p.n_sel, bt + 1) - 1) * p.l_sel + t % p.l_sel + 1
        win_keys += min(p.w, t + 1)
    rows = batch * HQ
    n_c = max(0, (S - p.l) // p.d + 1)
    q_b, o_b = batch * S * HQ * Dk * 2, batch * S * HQ * Dv * 2
    kv_raw = batch * S * H * (Dk + Dv) * 2
    kv_cmp = batch * n_c * H * (Dk + Dv) * 2
    lse_b = batch * S * HQ * 4
    idx_b = batch * S * H * p.n_sel * 4

    def fwd(keys: int) -> float:
        return float(2 * (Dk + Dv) * keys * rows)

    def bwd(keys: int) -> float:
        return float((3 * 2 * Dk + 4 * 2 * Dv) * keys * rows)  # dq: QK, dP, dS.K; dkdv: QK, dP, P.dO, dS.Q

    grads = 2 * q_b + o_b  # q, dq, do (rough)
    return {
        "compress_avg": (0.0, float(kv_raw + kv_cmp)),
        "cmp_fwd": (fwd(cmp_keys), float(q_b + kv_cmp + o_b + lse_b)),
        # block scoring with the top-n fused: the score matrix never reaches memory
        "select": (float(2 * Dk * cmp_keys * rows), float(q_b + kv_cmp // 2 + lse_b + idx_b)),
        "sel_fwd": (fwd(sel_keys), float(q_b + kv_raw + o_b + lse_b + idx_b)),
        # the window forward also reads the other two branch outputs and writes the gated output
        "win_fwd": (fwd(win_keys), float(q_b + kv_raw + 4 * o_b + lse_b + batch * S * HQ * 3 * 2)),
        # the compressed backward also reads the three branch outputs for the gate gradient
        "cmp_bwd": (bwd(cmp_keys), float(grads + 3 * o_b + 2 * kv_cmp + 2 * lse_b)),
        "sel_bwd": (bwd(sel_keys), float(grads + 2 * kv_raw + 2 * lse_b + idx_b)),
        "win_bwd": (bwd(win_keys), float(grads + 2 * kv_raw + 2 * lse_b)),
    }


def attention_command(req: AttentionRequest, say: Callable[[str], None] | None = None) -> Payload:
    """``nsa bench attention``: the request checked, its rows (and stages), their tables and notes, and the
    JSON payload; ``say`` hears each measurement before it starts (with the seconds since the start)."""
    import time

    from nsa.bench.timing import parse_tune
    from nsa.envinfo import environment

    tuned = parse_tune(req.tune)
    if req.backend not in ("auto", "triton", "torch", "reference"):
        raise ConfigError(f"--backend {req.backend!r} is not one of auto, triton, torch, reference")
    shapes = req.shape_list()
    lens = req.seq_lens or list(TINY_SEQ_LENS if req.tiny else DEFAULT_SEQ_LENS)
    if not req.tiny and not torch.cuda.is_available():
        raise ConfigError("no CUDA device for bench attention", hint="use --tiny on a CPU machine")
    if req.stages and (req.tiny or req.backend in ("torch", "reference")):
        raise ConfigError("--stages times the Triton kernels on a CUDA device",
                          hint="leave out --tiny and --backend torch/reference, or --stages")
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        if say is not None:
            say(f"[{time.monotonic() - t0:6.1f}s] {msg}")

    rows = bench_attention(shapes, lens, tiny=req.tiny, batch=req.batch, backend=req.backend, peer=req.peer,
                           dense=req.dense, warmup_ms=req.warmup_ms, rep_ms=req.rep_ms,
                           cuda_graph=req.cuda_graph, tune=tuned, progress=progress, profile=req.profile)
    blocks: list[Block] = [_rows_table(rows, req.batch)]
    for r in rows:
        blocks += [Line(f"note ({r.shape}, S={r.seq_len}): {n}", wrap=False) for n in r.notes]
        blocks += [Line(f"warning ({r.shape}, S={r.seq_len}): {n}", err=True, wrap=False) for n in r.noisy]
        if r.fallbacks:
            blocks.append(Line(f"warning ({r.shape}, S={r.seq_len}): NSA calls sent to a slower path: "
                               f"{r.fallbacks}", err=True, wrap=False))
        if r.kernels:
            top = ", ".join(f"{k['name'][:40]} {k['ms']:.1f} ms" for k in r.kernels[:5])
            blocks.append(Line(f"profile ({r.shape}, S={r.seq_len}): {r.launches} launches; {top}",
                               wrap=False))
    payload: dict[str, Any] = {"command": "bench attention", "environment": environment(), "tune": tuned,
                               "rows": [r.to_dict() for r in rows]}
    if req.stages:
        stages = _stages(shapes, lens, req, tuned, progress)
        blocks.append(_stage_table(stages, req.peak_tflops, req.peak_tbps))
        payload.update(stages=[r.to_dict() for r in stages],
                       roofline={"peak_tflops": req.peak_tflops, "peak_tbps": req.peak_tbps})
    return Payload(payload, blocks)


def _rows_table(rows: list[AttentionRow], batch: int) -> Table:
    graphed = ", CUDA graphs" if rows[0].cuda_graph else ""
    t = Table.of(f"NSA vs dense attention ({rows[0].device}, {rows[0].dtype}, batch {batch}{graphed})",
                 ("shape", "S", "nsa fwd ms", "dense fwd ms", "fwd x", "nsa f+b ms", "dense f+b ms", "f+b x",
                  "peer f+b ms", "vs peer", "nsa TFLOP/s", "nsa MiB", "dense MiB", "nsa saved MiB",
                  "dense saved MiB"))
    for r in rows:
        t.add(r.shape, str(r.seq_len), fig(r.nsa_fwd_ms), fig(r.dense_fwd_ms), fig(r.speedup_fwd, ".2f"),
              fig(r.nsa_fwdbwd_ms), fig(r.dense_fwdbwd_ms), fig(r.speedup_fwdbwd, ".2f"),
              fig(r.peer_fwdbwd_ms), fig(r.vs_peer_fwdbwd, ".2f"), fig(r.to_dict()["nsa_fwd_tflops"]),
              fig(r.nsa_peak_mib, ".0f"), fig(r.dense_peak_mib, ".0f"), fig(r.nsa_saved_mib, ".1f"),
              fig(r.dense_saved_mib, ".1f"))
    return t


def _stages(shapes: list[tuple[str, int, int, int]], lens: list[int], req: AttentionRequest,
            tuned: Mapping[str, int | str], progress: Callable[[str], None]) -> list[StageRow]:
    """Each Triton stage timed alone per shape and length."""
    out = []
    for name, HQ, H, D in shapes:
        for S in lens:
            progress(f"{name} S={S}: each Triton stage alone")
            path = stage_cmp_path(S, HQ, H, D)
            times = kernel_breakdown(S, HQ, H, D, batch=req.batch, warmup_ms=req.warmup_ms, rep_ms=req.rep_ms,
                                     tune=tuned, cmp_path=path)
            out.extend(stage_rows(name, S, HQ, H, D, times, batch=req.batch, peak_tflops=req.peak_tflops,
                                  peak_tbps=req.peak_tbps, cmp_path=path))
    return out


def _stage_table(rows: list[StageRow], peak_tflops: float, peak_tbps: float) -> Table:
    t = Table.of(f"NSA stages against the roofline ({peak_tflops:g} TFLOP/s, {peak_tbps:g} TB/s)",
                 ("shape", "S", "stage", "ms", "TFLOP/s", "GB/s", "roofline ms", "bound", "of roofline"))
    for r in rows:
        t.add(r.shape, str(r.seq_len), r.stage + (f" ({r.path})" if r.path not in ("", "kernel") else ""),
              f"{r.ms:.3f}", f"{r.tflops:.0f}", f"{r.mbytes / r.ms:.0f}" if r.ms > 0 else "-",
              f"{r.roofline_ms:.3f}", r.bound, f"{r.of_roofline:.0%}")
    return t
