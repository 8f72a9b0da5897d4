"""Triton backend of the NSA ops: same calls as :mod:`nsa.ops.reference`, kernels in ``nsa/ops/_triton``.

Forward of ``nsa_attention``: compressed branch (o_cmp + lse) -> block importance and top-n (unless
``block_idx`` is given) -> selected branch -> window branch -> gate combine. Backward: the gate gradient
(one pass over ``do`` and the three branch outputs), then per branch dq (accumulated in fp32) and dk/dv.
With ``q_win`` the window branch reads its own queries and its dq is a buffer of its own.
No step reads a device value on the host, so forward and backward never synchronise.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (tiny shapes, for CI).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from nsa.ops import cmp_sdpa
from nsa.ops._triton import cc_major, interpreting, tuned
from nsa.ops._triton.range_attn import range_bwd, range_fwd
from nsa.ops._triton.scores import select_top
from nsa.ops._triton.selection import canonical_blocks, query_chunks, sel_bwd, sel_fwd, sel_mode, work_shape
from nsa.ops.indexing import check_cmp_tokens, check_q_start, check_shapes, num_cmp
from nsa.ops.torch_path import compress_avg as _torch_compress_avg
from nsa.params import NSAParams

_GPU_DTYPES = (torch.bfloat16, torch.float16)
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MAX_BLOCKS = 16384


def supports(*tensors: torch.Tensor) -> str | None:
    """None when these kernels can serve a call on ``tensors``, else a short reason."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton not installed"
    interp = interpreting()
    for i, t in enumerate(tensors):
        if t.device.type != "cuda" and not (interp and t.device.type == "cpu"):
            return f"{t.device.type} tensor"
        # the first tensor (q) sets the compute dtype; float32 k/v/gates (autocast) are cast to it
        allowed = _CPU_DTYPES if t.device.type == "cpu" else (_GPU_DTYPES if i == 0 else _CPU_DTYPES)
        if t.is_floating_point() and t.dtype not in allowed:
            return f"dtype {str(t.dtype).removeprefix('torch.')}"
        if t.dim() == 4 and t.shape[-1] != 3 and t.shape[-1] > MAX_HEAD_DIM:
            return f"head dim {t.shape[-1]}"
    cuda = [t for t in tensors if t.is_cuda]
    if cuda and torch.cuda.get_device_capability(cuda[0].device)[0] < 8:
        return "compute capability < 8.0"
    return None


def compress_avg(x: torch.Tensor, hp: NSAParams) -> torch.Tensor:
    """Mean pooling is bandwidth-bound elementwise work: the vectorised torch op serves it."""
    return _torch_compress_avg(x, hp)


def _cmp_geometry(hp: NSAParams) -> dict[str, Any]:
    """The compressed branch as a key range: token ``j`` is visible at ``t`` iff ``j*d + l - 1 <= t``."""
    return {"stride": hp.d, "off": hp.l - 1, "win": 0}


CMP_PATHS = ("auto", "kernel", *cmp_sdpa.IMPLS)
# from these lengths cuDNN's kernel on the virtual rows beats ours on the compressed branch, whole op
# fwd+bwd (H200, docs/benchmarks/cmp-sdpa-h200.md): 16k with 16+ heads per group, else 32k
CMP_SDPA_MIN_S, CMP_SDPA_MIN_S_BIG_GROUPS = 32768, 16384
_cmp_path = "auto"
_paths: Counter[str] = Counter()


def set_cmp_path(name: str | None) -> None:
    """How the compressed branch runs (process-wide): ``kernel`` (ours), ``cudnn``/``flash``/``math``
    (:mod:`nsa.ops.cmp_sdpa`, where it can serve the call, else ours) or ``auto`` (``None``): by shape."""
    global _cmp_path
    name = name or "auto"
    if name not in CMP_PATHS:
        raise ValueError(f"unknown compressed-branch path '{name}': choose one of {', '.join(CMP_PATHS)}")
    _cmp_path = name


def path_counts() -> dict[str, int]:
    """How often each compressed-branch path ran (host-side counts: what the dispatcher chose)."""
    return dict(_paths)


def cmp_path(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, q_start: int,
             n_keys: int | None = None) -> str:
    """The compressed branch's path for this call: the set one where it can serve, else by shape (``kernel``
    for short sequences, queries that do not end with the keys (``n_keys``; unknown: only a whole sequence
    from position 0 does), head dims over 128 and pre-Hopper GPUs)."""
    cc = cc_major(q.device) if q.is_cuda else 0
    ends = q_start == 0 if n_keys is None else q_start + q.shape[1] == n_keys
    return cmp_path_for(q.shape[1], q.shape[2] // k_cmp.shape[2], q.shape[-1], v_cmp.shape[-1],
                        k_cmp.shape[1], ends, cc)


def cmp_path_of_shape(S: int, HQ: int, H: int, D: int, hp: NSAParams, device: torch.device) -> str:
    """:func:`cmp_path` of a whole sequence of this shape on ``device`` (the benchmarks' stage tables)."""
    cc = cc_major(device) if device.type == "cuda" else 0
    return cmp_path_for(S, HQ // H, D, D, num_cmp(S, hp.l, hp.d), True, cc)


def o3_slots(cmp_given: bool) -> int:
    """How many branch outputs the op keeps in rows for its backward: 3, or 2 when the compressed branch ran
    on a library kernel and tile key ``o3_slots=2`` asks to keep its output only in the virtual layout that
    kernel saved anyway (one q-sized buffer less; off until measured on a GPU)."""
    return 2 if cmp_given and int(tuned("o3_slots", 3)) == 2 else 3


def fwd_layout(q: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, l_sel: int, n_sel: int,
               q_start: int, cmp_given: bool) -> list[int]:
    """``[o3's slots, the work list's columns (-1: none)]`` that the forward operator returns for these
    inputs under the current tile settings (shapes only). The caller passes them to the operator, so they
    are constants of a traced graph: a compiled graph cached on disk under other settings (or another
    version's defaults) has another key instead of output sizes that no longer hold."""
    B, S, HQ, _ = q.shape
    H, Dv = k_sel.shape[2], v_sel.shape[-1]
    if sel_mode(HQ // H, q.device) == "row":
        cols = -1
    else:
        chunked = len(query_chunks(B, S, HQ, n_sel, Dv)) > 1
        cols = work_shape(B, S, H, n_sel, l_sel, q.device, q_start, chunked=chunked)[1]
    return [o3_slots(cmp_given), cols]


def cmp_path_for(S: int, G: int, Dk: int, Dv: int, n_cmp: int, ends: bool, cc: int) -> str:
    """:func:`cmp_path` from the shape (``S`` query rows; ``ends``: the queries end with the keys, a whole
    sequence or a context-parallel chunk, as the virtual rows' causal mask needs; ``cc``: the GPU's major
    compute capability, 0 off CUDA). Chunks past position 0 take the library too (a rectangle and a causal
    square merged by lse): CP=2 at 262,144 measured 1.23x faster per step that way on 2x H100."""
    ok = ends and n_cmp > 0 and Dv == Dk and Dk % 8 == 0 and Dk <= 128
    if _cmp_path != "auto":
        return _cmp_path if ok and (_cmp_path == "math" or cc > 0) else "kernel"
    shortest = CMP_SDPA_MIN_S_BIG_GROUPS if G >= 16 else CMP_SDPA_MIN_S
    if not ok or cc < 9 or interpreting() or shortest > S:
        return "kernel"
    return "cudnn"


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, hp: NSAParams, *, scale: float | None = None,
                  q_start: int = 0) -> torch.Tensor:
    """Top-``n_sel`` blocks per query and group: int32 ``[B, S_q, H, n_sel]``, ascending, -1 padded (query
    row ``i`` at position ``q_start + i``; absolute block numbers)."""
    check_q_start(q_start, q.shape[1])
    check_cmp_tokens(k_cmp.shape[1], q_start, q.shape[1], hp.l, hp.d)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():
        q, k_cmp = _dense_last(q), _dense_last(k_cmp.to(q.dtype))
        lse = range_fwd(q, k_cmp, k_cmp, None, scale=scale, q_start=q_start, **_cmp_geometry(hp))
        return select_top(q, k_cmp, lse, l=hp.l, d=hp.d, l_sel=hp.l_sel, n_sel=hp.n_sel, scale=scale,
                          q_start=q_start)


class Stages:
    """One call of the Triton NSA op, stage by stage: the custom operators below run exactly these, in
    this order, and ``nsa.bench.attention.kernel_breakdown`` times each one alone.

    Forward, after :meth:`start_forward`: :meth:`cmp_fwd` (compressed branch, its lse) -> :meth:`select`
    (block scores + top-n; skipped when ``block_idx`` is given) -> :meth:`sel_fwd` -> :meth:`win_fwd` (also
    the gated sum of the three branches). Backward, after :meth:`start_backward`: :meth:`cmp_bwd` (also the
    gate gradient of all three branches) -> :meth:`sel_bwd` -> :meth:`win_bwd` (also the final dq in q's
    dtype); dq accumulates in fp32 between them (in q's dtype when the compressed branch was given: two parts,
    and no fp32 buffer of q's size). Every kernel takes ``q_start`` as a runtime integer: query row ``i`` (of
    ``q``, ``gates`` and the row buffers) sits at position ``q_start + i`` of the keys. ``q_win``: the window
    branch's own queries (``None``: ``q``); then :meth:`win_bwd` writes their gradient ``dq_win`` and
    :meth:`sel_bwd` finishes ``q``'s."""

    def __init__(self, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
                 v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                 hp: NSAParams, scale: float, q_start: int = 0, q_win: torch.Tensor | None = None) -> None:
        self.q, self.k_cmp, self.v_cmp, self.k_sel, self.v_sel, self.k_win, self.v_win = (
            _dense_last(t) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win))
        self.q_win = None if q_win is None else _dense_last(q_win)
        self.gates = gates.contiguous()
        self.hp, self.scale, self.q_start = hp, scale, q_start
        self.cmp_given = False  # the compressed branch ran outside (cmp_sdpa): its output is handed in
        # the forward's buffers (the backward is handed the saved ones instead); ``o3`` holds the branch
        # outputs in rows, the compressed one in slot 0 unless it is given and kept only in its virtual
        # layout ``o_v`` (two slots, :func:`o3_slots`); ``o_c``: the compressed output in rows, for the
        # combine
        self.o3 = self.out = self.lse_c = self.lse_s = self.lse_w = self.idx = self.work = torch.empty(0)
        self.o_c = self.o_v = torch.empty(0)

    @property
    def slots(self) -> int:
        return self.o3.shape[3] if self.o3.dim() == 5 else 3

    def start_forward(self, slots: int = 3) -> None:
        q = self.q
        B, S, HQ, _ = q.shape
        Dv = self.v_sel.shape[-1]
        self.o3 = torch.empty(B, S, HQ, slots, Dv, device=q.device, dtype=q.dtype)
        self.out = torch.empty(B, S, HQ, Dv, device=q.device, dtype=q.dtype)

    # forward
    def cmp_fwd(self) -> None:
        self.o_c = self.o3[:, :, :, 0]
        self.lse_c = range_fwd(self.q, self.k_cmp, self.v_cmp, self.o_c, scale=self.scale,
                               q_start=self.q_start, **_cmp_geometry(self.hp))

    def take_cmp(self, o_v: torch.Tensor, lse_v: torch.Tensor) -> None:
        """The compressed branch's output as :func:`nsa.ops.cmp_sdpa.attend` computed it (virtual layout)."""
        self.cmp_given = True
        hp = self.hp
        if self.slots == 2:  # rows for the combine only; the backward reads the virtual output
            self.o_c, self.o_v = torch.empty_like(self.out), o_v
        else:
            self.o_c = self.o3[:, :, :, 0]
        self.lse_c = cmp_sdpa.take(o_v, lse_v, self.o_c, self.k_cmp.shape[2], hp.l, hp.d, self.q_start)

    def select(self) -> None:
        hp = self.hp
        self.idx = select_top(self.q, self.k_cmp, self.lse_c, l=hp.l, d=hp.d, l_sel=hp.l_sel, n_sel=hp.n_sel,
                              scale=self.scale, q_start=self.q_start)

    def given_blocks(self, block_idx: torch.Tensor) -> None:
        self.idx = canonical_blocks(block_idx, self.hp.l_sel, self.q_start)  # same key set, a new tensor

    def sel_fwd(self) -> None:
        self.lse_s, self.work = sel_fwd(self.q, self.k_sel, self.v_sel, self.idx,
                                        self.o3[:, :, :, self.slots - 2], l_sel=self.hp.l_sel,
                                        scale=self.scale, q_start=self.q_start)

    def win_fwd(self) -> None:
        self.lse_w = range_fwd(self.q if self.q_win is None else self.q_win, self.k_win, self.v_win,
                               self.o3[:, :, :, self.slots - 1], scale=self.scale, stride=1, off=0,
                               win=self.hp.w, combine=(self.gates, self.out, self.o_c), q_start=self.q_start)

    def forward(self, block_idx: torch.Tensor | None,
                cmp_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.start_forward(o3_slots(cmp_out is not None))
        if cmp_out is None:
            self.cmp_fwd()
        else:
            self.take_cmp(*cmp_out)
        if block_idx is None:
            self.select()
        else:
            self.given_blocks(block_idx)
        self.sel_fwd()
        self.win_fwd()

    # backward
    def start_backward(self, do: torch.Tensor) -> None:
        self.do = do.contiguous()
        q = self.q
        self.dg = torch.empty(*q.shape[:3], 3, device=q.device, dtype=torch.float32)
        self.dq_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        # with the compressed branch given, q's gradient here has at most two parts (window, selected): they
        # add in q's dtype (each sum formed in fp32 in the kernel), no fp32 buffer (2 GiB at paper 64k)
        self.dq = self.dq_out if self.cmp_given else torch.empty(q.shape, device=q.device,
                                                                 dtype=torch.float32)
        self.dq_win = torch.empty(0, device=q.device, dtype=q.dtype)

    def cmp_bwd(self) -> None:
        self.dk_c, self.dv_c = range_bwd(self.q, self.k_cmp, self.v_cmp, self.do, self.lse_c, self.gates,
                                         self.dg, self.dq, branch=0, accum=False, scale=self.scale,
                                         o3=self.o3, q_start=self.q_start, **_cmp_geometry(self.hp))

    def cmp_grad(self) -> None:
        """With the compressed branch given: its output's gradient ``gate * do`` in the virtual layout (and
        its gate's gradient, when ``o3`` does not hold its output: from the virtual output in the same
        pass)."""
        hp = self.hp
        dg = self.dg if self.slots == 2 else None
        self.d_ocmp = cmp_sdpa.grad_out(self.do, self.gates[..., 0], self.k_cmp.shape[2], hp.l, hp.d,
                                        self.q_start, o_v=self.o_v if dg is not None else None, dg=dg)

    def sel_bwd(self) -> None:
        # with the compressed branch given, the window's backward ran first and wrote q's dq unless it has its
        # own
        accum = not self.cmp_given or self.q_win is None
        self.dk_s, self.dv_s = sel_bwd(self.q, self.k_sel, self.v_sel, self.idx, self.do, self.lse_s,
                                       self.gates, self.dg, self.dq, branch=1, accum=accum,
                                       l_sel=self.hp.l_sel, scale=self.scale, work=self.work,
                                       q_start=self.q_start)
        if (self.q_win is not None or self.cmp_given) and self.dq is not self.dq_out:
            self.dq_out.copy_(self.dq)  # no later stage adds into q's gradient: into the buffer already there

    def win_bwd(self) -> None:
        if self.q_win is None:
            q, dq, accum = self.q, self.dq, not self.cmp_given
            dq_out = None if self.cmp_given else self.dq_out
        else:
            # its own queries' gradient has this one part: the kernel writes it in their dtype
            q, accum, dq_out = self.q_win, False, None
            dq = self.dq_win = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        self.dk_w, self.dv_w = range_bwd(q, self.k_win, self.v_win, self.do, self.lse_w, self.gates, self.dg,
                                         dq, branch=2, accum=accum, scale=self.scale, stride=1, off=0,
                                         win=self.hp.w, dq_out=dq_out, q_start=self.q_start,
                                         o3=self.o3 if self.cmp_given else None)

    def backward(self, do: torch.Tensor) -> None:
        """Compressed (which also writes the gate gradient) -> selected -> window; with the compressed branch
        given: window (writing the gate gradient) -> selected -> the given branch's output gradient."""
        self.start_backward(do)
        if self.cmp_given:
            self.win_bwd()
            self.sel_bwd()
            self.cmp_grad()
        else:
            self.cmp_bwd()
            self.sel_bwd()
            self.win_bwd()


# ---------------------------------------------------------------------------------------------------
# The kernels as PyTorch custom operators (torch.library): opaque to torch.compile, with fake (meta)
# implementations for tracing and a registered autograd formula, so a whole compiled NSA model keeps
# one graph (fullgraph=True) and Inductor fuses the projection / RoPE / gate / combine glue around them.
# The hyper-parameters cross this boundary as plain integers (a schema allows no other type), and so does
# ``q_start`` (last, default 0: the rows' offset into the keys).

_FWD_OUT = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor]


@torch.library.custom_op("nsa::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
    k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, block_idx: torch.Tensor | None,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float, q_start: int = 0,  # noqa: E741
    q_win: torch.Tensor | None = None, o_cmp: torch.Tensor | None = None, lse_cmp: torch.Tensor | None = None,
    layout: list[int] | None = None,
) -> _FWD_OUT:
    """Forward kernels: ``(out, block_idx, o3, lse_cmp, lse_sel, lse_win, work)``; everything after
    ``block_idx`` is kept for the backward (``work``: the selected branch's pair list, or empty).
    ``o_cmp, lse_cmp``: the compressed branch computed outside (:func:`nsa.ops.cmp_sdpa.attend`);
    ``layout``: :func:`fwd_layout` as the caller saw it (checked)."""
    st = Stages(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, NSAParams(l, d, l_sel, n_sel, w), scale,
                q_start, q_win)
    cmp_out = None if o_cmp is None or lse_cmp is None else (o_cmp, lse_cmp)
    if layout is not None:
        want = fwd_layout(q, k_sel, v_sel, l_sel, n_sel, q_start, cmp_out is not None)
        if list(layout) != want:
            raise RuntimeError(f"nsa::attention_fwd traced with layout {list(layout)} runs with {want}: the "
                               "tile settings changed between tracing and running (torch._dynamo.reset())")
    st.forward(block_idx, cmp_out)
    return st.out, st.idx, st.o3, st.lse_c, st.lse_s, st.lse_w, st.work


@attention_fwd.register_fake
def _attention_fwd_fake(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
    k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, block_idx: torch.Tensor | None,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float, q_start: int = 0,  # noqa: E741
    q_win: torch.Tensor | None = None, o_cmp: torch.Tensor | None = None, lse_cmp: torch.Tensor | None = None,
    layout: list[int] | None = None,
) -> _FWD_OUT:
    B, S, HQ, _ = q.shape
    H, Dv = k_sel.shape[2], v_sel.shape[-1]
    f32, i32 = torch.float32, torch.int32
    slots, cols = layout if layout is not None else fwd_layout(q, k_sel, v_sel, l_sel, n_sel, q_start,
                                                               o_cmp is not None and lse_cmp is not None)
    work = q.new_empty(0, dtype=i32) if cols < 0 else q.new_empty(B * H, cols, dtype=i32)
    return (q.new_empty(B, S, HQ, Dv), q.new_empty(B, S, H, n_sel, dtype=i32),
            q.new_empty(B, S, HQ, slots, Dv), q.new_empty(B, S, HQ, dtype=f32),
            q.new_empty(B, S, HQ, dtype=f32), q.new_empty(B, S, HQ, dtype=f32), work)


_BWD_OUT = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("nsa::attention_bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
    v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, idx: torch.Tensor,
    o3: torch.Tensor, lse_c: torch.Tensor, lse_s: torch.Tensor, lse_w: torch.Tensor, work: torch.Tensor,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float, q_start: int = 0,  # noqa: E741
    q_win: torch.Tensor | None = None, cmp_given: bool = False, o_cmp: torch.Tensor | None = None,
) -> _BWD_OUT:
    """Backward kernels: ``(dq, dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates, dq_win, d_ocmp)``
    (``dq_win`` empty without ``q_win``); every key/value gradient has all the keys' rows (zeros where no
    query row of this call reads a key). ``cmp_given``: the forward was handed the compressed branch; then
    ``d_ocmp`` is its output's gradient (virtual layout) and ``dk_cmp, dv_cmp`` are empty; ``o_cmp``: that
    output (virtual), needed when ``o3`` has two slots."""
    st = Stages(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, NSAParams(l, d, l_sel, n_sel, w), scale,
                q_start, q_win)
    st.o3, st.idx, st.lse_c, st.lse_s, st.lse_w, st.work = o3, idx, lse_c, lse_s, lse_w, work
    st.cmp_given = cmp_given
    if o_cmp is not None:
        st.o_v = o_cmp
    st.backward(do)
    if cmp_given:  # outputs may not alias each other: a fresh empty tensor for each
        st.dk_c, st.dv_c = q.new_empty(0), q.new_empty(0)
    return (st.dq_out, st.dk_c, st.dv_c, st.dk_s.to(k_sel.dtype), st.dv_s.to(v_sel.dtype), st.dk_w, st.dv_w,
            st.dg.to(gates.dtype), st.dq_win, st.d_ocmp if cmp_given else q.new_empty(0))


@attention_bwd.register_fake
def _attention_bwd_fake(
    do: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
    v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, idx: torch.Tensor,
    o3: torch.Tensor, lse_c: torch.Tensor, lse_s: torch.Tensor, lse_w: torch.Tensor, work: torch.Tensor,
    l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float, q_start: int = 0,  # noqa: E741
    q_win: torch.Tensor | None = None, cmp_given: bool = False, o_cmp: torch.Tensor | None = None,
) -> _BWD_OUT:
    dq_win = q.new_empty(0) if q_win is None else q_win.new_empty(q_win.shape)
    dk_c, dv_c = (q.new_empty(0), q.new_empty(0)) if cmp_given else (k_cmp.new_empty(k_cmp.shape),
                                                                      v_cmp.new_empty(v_cmp.shape))
    d_ocmp = (q.new_empty(q.shape[0], q.shape[2] * d, cmp_sdpa.geometry(q.shape[1], l, d, q_start)[2],
                          v_sel.shape[-1]) if cmp_given else q.new_empty(0))
    return (q.new_empty(q.shape), dk_c, dv_c,
            *(t.new_empty(t.shape) for t in (k_sel, v_sel, k_win, v_win, gates)), dq_win,
            d_ocmp)  # type: ignore[return-value]


_HP = ("l", "d", "l_sel", "n_sel", "w", "scale", "q_start")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: _FWD_OUT) -> None:
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, _block_idx, *rest = inputs
    hp, (q_win, o_cmp, *_) = rest[:len(_HP)], (*rest[len(_HP):], None, None)
    _, idx, o3, lse_c, lse_s, lse_w, work = output
    ctx.has_q_win = q_win is not None
    ctx.cmp_given = o_cmp is not None
    ctx.keeps_o_cmp = o3.shape[3] == 2  # the compressed output only in its virtual layout (no extra memory:
    # the library kernel's own backward holds the same tensor)
    ctx.save_for_backward(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, idx, o3, lse_c, lse_s, lse_w,
                          work, *([q_win] if q_win is not None else []),
                          *([o_cmp] if ctx.keeps_o_cmp else []))
    ctx.hp = dict(zip(_HP, hp, strict=False))  # q_start may be left at its default
    ctx.mark_non_differentiable(idx, o3, lse_c, lse_s, lse_w, work)


def _backward(ctx: Any, do: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    saved = ctx.saved_tensors
    q_win = saved[14] if ctx.has_q_win else None
    o_cmp = saved[-1] if ctx.keeps_o_cmp else None
    dq, dk_c, dv_c, *grads, dq_win, d_ocmp = attention_bwd(do, *saved[:14], **ctx.hp, q_win=q_win,
                                                           cmp_given=ctx.cmp_given, o_cmp=o_cmp)
    if ctx.cmp_given:  # k_cmp/v_cmp fed only the block scores here: their gradient comes through o_cmp
        dk_c = dv_c = None
    return (dq, dk_c, dv_c, *grads, None, None, None, None, None, None, None, None,
            dq_win if q_win is not None else None, d_ocmp if ctx.cmp_given else None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same forward and backward operators outside a traced graph, through a plain autograd function.

    The custom operator's own autograd wrapper rebuilds its argument list from the schema on every call
    (``torch._library.utils.fill_defaults``: quadratic in the 19 arguments, ~0.2 ms of host time per call,
    measured on the development CPU), which an eager step pays per layer; inside this function grad mode is
    off, so the operator takes its plain path. ``torch.compile`` traces the registered formula instead."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> _FWD_OUT:
        output = attention_fwd(*inputs)
        _setup_context(ctx, inputs, output)
        # only ``out`` has a gradient: no zero-filled ones for the saved outputs (``o3`` alone is 3 GiB at
        # the paper shape, 64k: a 0.95 ms fill per backward)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        return _backward(ctx, *grads)


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    hp: NSAParams,
    *,
    scale: float | None = None,
    block_idx: torch.Tensor | None = None,
    return_block_idx: bool = False,
    q_start: int = 0,
    q_win: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated NSA attention ``[B, S_q, HQ, Dv]`` of the query rows at positions ``q_start ..`` against the
    keys of positions ``0 .. S_k - 1`` (and the blocks used, with ``return_block_idx``); the
    hyper-parameters become plain integers only here, at the custom operators' boundary. ``q_win``: the
    window branch's own queries (``None``: ``q``)."""
    S = check_shapes(q, k_sel, name="k_sel", q_start=q_start)[2]
    n_c = num_cmp(S, hp.l, hp.d)
    if k_cmp.shape[1] != n_c or v_cmp.shape[1] != n_c:
        raise ValueError(f"k_cmp/v_cmp must hold S_cmp={n_c} tokens for S={S}, l={hp.l}, d={hp.d}; "
                         f"got {k_cmp.shape[1]} and {v_cmp.shape[1]}")
    if -(-S // hp.l_sel) > MAX_BLOCKS:
        raise ValueError(f"S={S} gives more than {MAX_BLOCKS} selection blocks of l_sel={hp.l_sel}")
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if block_idx is not None:
        block_idx = block_idx.to(device=q.device, dtype=torch.int32).contiguous()
    # kernels take strides for [B, S, heads]; only the feature dim must be contiguous (views of a fused
    # projection pass as they are); gates are read as contiguous rows of 3
    args = [_dense_last(t.to(q.dtype)) for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)]
    gates = gates.to(q.dtype).contiguous()
    qw = None if q_win is None else _dense_last(q_win.to(q.dtype))
    path = cmp_path(args[0], args[1], args[2], q_start, S)
    if not torch.compiler.is_compiling():  # a counter in a traced graph would be a guard: recompiles
        _paths[path] += 1
    o_cmp = lse_cmp = None
    if path != "kernel":  # the compressed branch by a library kernel, differentiable on its own
        o_cmp, lse_cmp = cmp_sdpa.attend(args[0], args[1], args[2], hp.l, hp.d, sc, path, q_start)
    layout = fwd_layout(args[0], args[3], args[4], hp.l_sel, hp.n_sel, q_start, o_cmp is not None)
    fwd_args = (*args, gates, block_idx, hp.l, hp.d, hp.l_sel, hp.n_sel, hp.w, sc, q_start, qw, o_cmp,
                lse_cmp, layout)
    out, idx, *_ = attention_fwd(*fwd_args) if torch.compiler.is_compiling() else _Eager.apply(*fwd_args)
    return (out, idx) if return_block_idx else out
