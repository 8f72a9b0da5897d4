"""Decode with caches equals one full forward; reads counters; batched generation with left padding."""

from __future__ import annotations

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.errors import NSAError
from nsa.model import NSALM, NSAAttention
from nsa.model.cache import ModelCache
from nsa.model.generate import sample_next
from nsa.ops import NSAParams, select_blocks
from tests.conftest import Job, run_job

# Tiny hyper-parameters so that a 40-token sequence crosses many compression/selection boundaries and
# leaves free (non-forced) block choices: (l, d, l_sel, n_sel, w)
CONFIGS = [
    {"l": 4, "d": 2, "l_sel": 2, "n_sel": 5, "w": 5},
    {"l": 4, "d": 2, "l_sel": 4, "n_sel": 4, "w": 6},
    {"l": 2, "d": 2, "l_sel": 2, "n_sel": 4, "w": 3},
]


def _lm(h: int, phi: str = "avg", gate: str = "sigmoid", attention: str = "nsa", hp: dict | None = None,
        seed: int = 0) -> NSALM:
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=48, dim=32, n_layers=2, n_heads=2 * h, n_kv_groups=2, d_k=8, d_v=6,
                     mlp_hidden=48, attention=attention)
    model = NSALM(mc, NSAConfig(**(hp or CONFIGS[0]), phi=phi, gate=gate)).eval()
    # larger weights than the LM init make attention peaky, so wrong key sets show up in the logits
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    return model


def _check_reads(model: NSALM, cache: ModelCache, t: torch.Tensor) -> None:
    hp = model.nsa_cfg
    for layer in cache.layers:
        idx = layer.last_block_idx.long()
        tt = t[:, None, None]
        sel = torch.where(idx >= 0, torch.minimum(torch.full_like(idx, hp.l_sel), tt + 1 - idx * hp.l_sel),
                          torch.zeros_like(idx)).sum(-1)
        n_c = torch.clamp((t + 1 - hp.l) // hp.d + 1, min=0)[:, None]
        expected = n_c + sel + torch.clamp(t + 1, max=hp.w)[:, None]
        assert torch.equal(layer.last_reads, expected)


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("gate", ["sigmoid", "softmax"])
@pytest.mark.parametrize("h", [1, 2, 6])
def test_prefill_then_decode_equals_full_forward(phi: str, gate: str, h: int) -> None:
    model = _lm(h, phi, gate, hp=CONFIGS[(h + len(phi)) % len(CONFIGS)])
    S = 40
    ids = torch.randint(0, 48, (2, S))
    full = model(ids).logits
    for prefix in (1, 11):
        cache = model.new_cache(2, S)
        logits = model.prefill(ids[:, :prefix], torch.full((2,), prefix), cache)
        torch.testing.assert_close(logits, full[:, :prefix], rtol=1e-5, atol=1e-5)
        reads = torch.zeros(2, dtype=torch.int64)
        for t in range(prefix, S):
            out = model.decode_step(ids[:, t], cache)
            torch.testing.assert_close(out, full[:, t], rtol=1e-5, atol=1e-5, msg=f"position {t}")
            _check_reads(model, cache, torch.full((2,), t))
            reads += sum(layer.last_reads.sum(-1) for layer in cache.layers)
        assert torch.equal(cache.reads_total, reads)


@pytest.mark.parametrize("hp", CONFIGS)
def test_layer_decode_uses_spec_blocks(hp: dict) -> None:
    """Layer level: decode output, chosen blocks and reads equal the functional op's at every position."""
    torch.manual_seed(3)
    attn = NSAAttention(16, 6, 2, 8, 8, NSAParams(**hp), phi="mlp").double()
    with torch.no_grad():
        attn.q_proj.weight.mul_(3)
    S = 37
    x = torch.randn(1, S, 16, dtype=torch.float64)
    y = attn(x)
    p = attn.project(x, torch.arange(S))
    k_cmp, _ = attn.compress(p.k_cmp_raw, p.v_cmp_raw)
    idx_full = select_blocks(p.q, k_cmp, NSAParams(**hp))
    cache = ModelCache([attn.new_cache(1, S, torch.device("cpu"), torch.float64)], S,
                       torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    cache.start(torch.tensor([3]))
    attn.prefill(x[:, :3], cache.layers[0], cache)
    free_choices = 0
    for t in range(3, S):
        out = attn.decode(x[:, t : t + 1], cache.layers[0], cache)
        cache.advance()
        torch.testing.assert_close(out[:, 0], y[:, t], rtol=1e-10, atol=1e-12)
        layer = cache.layers[0]
        assert torch.equal(layer.last_block_idx, idx_full[:, t]), t
        bt = t // hp["l_sel"]
        free_choices += sum(1 for b in idx_full[0, t, 0].tolist() if b not in (-1, 0, bt, bt - 1))
        n_c = max(0, (t + 1 - hp["l"]) // hp["d"] + 1)
        for g in range(2):
            blocks = [b for b in idx_full[0, t, g].tolist() if b >= 0]
            sel = sum(min(hp["l_sel"], t + 1 - b * hp["l_sel"]) for b in blocks)
            assert layer.last_reads[0, g].item() == n_c + sel + min(hp["w"], t + 1)
    assert free_choices > 0  # the test exercised score-based choices, not only forced blocks


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_batched_left_padded_equals_one_by_one(attention: str) -> None:
    model = _lm(2, "mlp", "softmax", attention=attention, hp=CONFIGS[1], seed=5)
    lens = [3, 14, 9]
    P = max(lens)
    prompts = [torch.randint(0, 48, (n,)) for n in lens]
    ids = torch.zeros(len(lens), P, dtype=torch.int64)
    mask = torch.zeros(len(lens), P, dtype=torch.int64)
    for i, pr in enumerate(prompts):
        ids[i, P - len(pr) :] = pr
        ids[i, : P - len(pr)] = 7  # padding value that would matter if it were attended
        mask[i, P - len(pr) :] = 1
    out = model.generate(ids, 15, attention_mask=mask)
    assert out.shape == (3, P + 15)
    assert torch.equal(out[:, :P], ids)
    for i, pr in enumerate(prompts):
        single = model.generate(pr[None], 15)
        assert torch.equal(out[i, P:], single[0, len(pr) :]), i
        # and each generated continuation is what the full forward predicts greedily
        seq = single[0]
        full = model(seq[None]).logits[0]
        assert torch.equal(full[len(pr) - 1 : -1].argmax(-1), seq[len(pr) :])


def test_decode_of_different_lengths_matches_full_forward_logits() -> None:
    model = _lm(3, "avg", "sigmoid", hp=CONFIGS[0], seed=2)
    lens = torch.tensor([2, 9])
    S = 30
    seqs = torch.randint(0, 48, (2, S))
    cache = model.new_cache(2, S)
    model.prefill(seqs[:, :9], lens, cache)  # row 0: positions 2.. are padding, never stored as real
    fulls = [model(seqs[i : i + 1]).logits[0] for i in range(2)]
    for step in range(S - 9):
        t = lens + step
        logits = model.decode_step(seqs[torch.arange(2), t], cache)
        _check_reads(model, cache, t)
        for i in range(2):
            torch.testing.assert_close(logits[i], fulls[i][t[i]], rtol=1e-5, atol=1e-5)


def test_sampling_rules() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits), greedy)
    assert torch.equal(sample_next(logits, 1.0, top_k=1), greedy)
    assert torch.equal(sample_next(logits, 1.0, top_p=1e-6), greedy)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = sample_next(logits, 0.8, top_k=5, generator=g1), sample_next(logits, 0.8, top_k=5, generator=g2)
    assert torch.equal(a, b)
    top5 = torch.topk(logits, 5).indices
    assert all(a[i] in top5[i] for i in range(4))
    model = _lm(1)
    prompt = torch.randint(0, 48, (2, 5))
    s1 = model.generate(prompt, 6, temperature=1.0, seed=11)
    s2 = model.generate(prompt, 6, temperature=1.0, seed=11)
    assert torch.equal(s1, s2)


def test_errors() -> None:
    model = _lm(1)
    cache = model.new_cache(1, 4)
    model.prefill(torch.randint(0, 48, (1, 4)), torch.tensor([4]), cache)
    with pytest.raises(NSAError, match="cache"):
        model.decode_step(torch.tensor([1]), cache)
    with pytest.raises(NSAError, match="exceeds the cache"):
        model.prefill(torch.randint(0, 48, (1, 5)), torch.tensor([5]), model.new_cache(1, 4))
    ids = torch.randint(0, 48, (2, 5))
    with pytest.raises(NSAError, match="left padding"):
        model.generate(ids, 2, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))


def test_bench_decode_tiny_cli(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from nsa_cli.app import app

    out = tmp_path / "decode.json"
    res = CliRunner().invoke(app, ["bench", "decode", "--tiny", "--contexts", "64", "--batches", "2", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == {"attention", "model"}
    att = next(r for r in rows if r["mode"] == "attention")
    # tiny NSA params l=8, d=4, l_sel=16, n_sel=4, w=32 at t=64: N_c=15, 3 full blocks + 1 position, window 32
    assert att["nsa_reads"] == 15 + 3 * 16 + 1 + 32 and att["dense_reads"] == 65
    assert att["nsa_ms"] > 0 and att["dense_ms"] > 0
    model = next(r for r in rows if r["mode"] == "model")
    assert model["nsa_reads"] == 15 + 3 * 8 + 1 + 32  # the tiny config: l_sel=8


@pytest.mark.parametrize(
    "hp",
    [
        {"l": 16, "d": 8, "l_sel": 16, "n_sel": 3, "w": 64},  # window > cache, n_sel > blocks, few cmp tokens
        {"l": 32, "d": 16, "l_sel": 32, "n_sel": 1, "w": 4},  # no compressed token ever (l > S), one block
    ],
)
def test_edge_configs_and_shared_kv(hp: dict) -> None:
    torch.manual_seed(4)
    mc = ModelConfig(vocab_size=48, dim=32, n_layers=1, n_heads=4, n_kv_groups=1, d_k=8, d_v=8, mlp_hidden=48)
    model = NSALM(mc, NSAConfig(**hp, phi="mlp", shared_kv=True)).eval()
    S = 30
    ids = torch.randint(0, 48, (2, S))
    full = model(ids).logits
    cache = model.new_cache(2, S)
    model.prefill(ids[:, :4], torch.full((2,), 4), cache)
    for t in range(4, S):
        out = model.decode_step(ids[:, t], cache)
        torch.testing.assert_close(out, full[:, t], rtol=1e-5, atol=1e-5)
        _check_reads(model, cache, torch.full((2,), t))


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_cuda_graph_generation_equals_eager(attention: str) -> None:
    model = _lm(2, "mlp", "sigmoid", attention=attention, hp=CONFIGS[1], seed=6).cuda()
    ids = torch.randint(0, 48, (3, 12), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :9] = 0
    eager = model.generate(ids, 20, attention_mask=mask)
    graphed = model.generate(ids, 20, attention_mask=mask, cuda_graph=True)
    assert torch.equal(graphed, eager)


@pytest.mark.gpu
@pytest.mark.parametrize(("attention", "backend"), [("nsa", None), ("nsa", "triton"), ("dense", None)])
def test_compiled_decode_equals_eager_on_gpu(attention: str, backend: str | None) -> None:
    """``NSALM.compile_decode``: the torch.compile'd block steps give the eager logits (static caches)."""
    torch.manual_seed(3)
    mc = ModelConfig(vocab_size=48, dim=32, n_layers=3, n_heads=4, n_kv_groups=2, d_k=16, d_v=16,
                     mlp_hidden=48, attention=attention)
    model = NSALM(mc, NSAConfig(**CONFIGS[1]), backend=backend).cuda().eval()
    ids = torch.randint(0, 48, (2, 30), device="cuda")
    runs = []
    for compiled in (False, True):
        model.compile_decode(compiled)
        cache = model.new_cache(2, 40)
        cache.static = True
        model.prefill(ids[:, :5], torch.tensor([5, 3], device="cuda"), cache)
        runs.append(torch.stack([model.decode_step(ids[:, t], cache) for t in range(5, 30)]))
    model.compile_decode(False)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hp", CONFIGS)
def test_nsa_decode_op_equals_reference_rows(hp: dict) -> None:
    """The single-query op, fed caches laid out as documented, equals the reference op's row ``t``
    (float64), with a different ``t`` for every sequence of the batch."""
    from nsa.ops import nsa_attention
    from nsa.ops.decode import nsa_decode
    from nsa.ops.reference import compress_avg

    torch.manual_seed(7)
    B, S, H, h, D = 3, 29, 2, 3, 8
    w = hp["w"]
    q = torch.randn(B, S, H * h, D, dtype=torch.float64) * 2
    ks, vs, kw, vw, kr, vr = (torch.randn(B, S, H, D, dtype=torch.float64) for _ in range(6))
    gates = torch.rand(B, S, H * h, 3, dtype=torch.float64)
    params = NSAParams(**hp)
    kc, vc = compress_avg(kr, params), compress_avg(vr, params)
    o_ref, idx_ref = nsa_attention(q, kc, vc, ks, vs, kw, vw, gates, params, return_block_idx=True,
                                   backend="reference")
    R = min(w, S)
    for step in range(S):
        t = torch.tensor([step, (step + 7) % S, S - 1 - step])
        ar = torch.arange(B)
        # caches: raw rows in slot p (rows > t hold other data, which must be ignored), ring p % R
        future = torch.arange(S)[None, None, :, None] > t[:, None, None, None]
        k_sel = ks.transpose(1, 2).masked_fill(future, 99.0)  # must never be read
        v_sel = vs.transpose(1, 2).masked_fill(future, 99.0)
        ring_pos = t[:, None] - torch.remainder(t[:, None] - torch.arange(R)[None, :], R)
        k_win = torch.stack([kw[b, ring_pos[b].clamp(min=0)] for b in range(B)]).transpose(1, 2)
        v_win = torch.stack([vw[b, ring_pos[b].clamp(min=0)] for b in range(B)]).transpose(1, 2)
        k_cmp = torch.cat([kc, torch.full((B, 1, H, D), 50.0, dtype=torch.float64)], 1).transpose(1, 2)
        v_cmp = torch.cat([vc, torch.full((B, 1, H, D), 50.0, dtype=torch.float64)], 1).transpose(1, 2)
        res = nsa_decode(q[ar, t], t, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates[ar, t], params)
        torch.testing.assert_close(res.o, o_ref[ar, t], rtol=1e-10, atol=1e-12)
        assert torch.equal(res.block_idx, idx_ref[ar, t])


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_decode_step_does_not_sync_on_cuda(attention: str) -> None:
    model = _lm(2, "mlp", "sigmoid", attention=attention, hp=CONFIGS[0]).cuda()
    cache = model.new_cache(2, 40)
    logits = model.prefill(torch.randint(0, 48, (2, 9), device="cuda"), torch.tensor([4, 9], device="cuda"), cache)
    tok = logits[:, -1].argmax(-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            tok = model.decode_step(tok, cache).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.host_len == 9 + 12


def _triton_vs_torch_decode(device: str, dtype: torch.dtype, tol: float) -> None:
    """The fused Triton decode step equals its torch reference: same blocks, same reads, same output.

    Cases cover h = 1..16, Dk != Dv, tokens spanning one to three blocks (l > l_sel), one block per
    compressed tile or several, caches longer than the positions (invisible tiles), positions before
    the first compressed token, on an emission and a block boundary, and ``n_sel`` above the candidates.
    """
    from nsa.ops.decode import nsa_decode
    from nsa.ops.indexing import num_cmp

    gen = torch.Generator().manual_seed(0)
    # (l, d, l_sel, n_sel, w), h, Dk, Dv, T (cache length), extra positions
    cases = [((4, 2, 2, 5, 5), 1, 8, 6, 40, [3, 22]), ((4, 2, 4, 4, 6), 2, 16, 16, 37, [11, 0]),
             ((8, 4, 16, 3, 20), 6, 8, 12, 70, [31, 47]), ((8, 2, 2, 4, 7), 3, 16, 8, 45, [9, 30]),
             ((8, 4, 8, 40, 9), 4, 16, 16, 90, [63, 64])]
    if device == "cuda":
        cases += [((32, 16, 64, 16, 512), 16, 128, 128, 3000, [2047, 2048]),
                  ((32, 16, 64, 16, 512), 6, 64, 64, 9000, [100, 4095]),
                  ((32, 16, 64, 16, 512), 1, 128, 128, 70000, [65535, 31])]
    for (l, d, l_sel, n_sel, w), h, Dk, Dv, T, extra in cases:  # noqa: E741
        B, H = 5, 2
        C, R = num_cmp(T, l, d), min(w, T)

        def r(*s: int) -> torch.Tensor:
            return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

        t = torch.tensor([T - 1, 5, T // 2, *extra], device=device)[:B]
        args = (r(B, H * h, Dk) * 2, t, r(B, H, C + 1, Dk), r(B, H, C + 1, Dv), r(B, H, T, Dk), r(B, H, T, Dv),
                r(B, H, R, Dk), r(B, H, R, Dv), torch.rand(B, H * h, 3, generator=gen).to(device=device, dtype=dtype))
        hp = NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
        a = nsa_decode(*args, hp, backend="torch")
        b = nsa_decode(*args, hp, backend="triton")
        assert torch.equal(a.block_idx, b.block_idx), (h, T, a.block_idx, b.block_idx)
        assert torch.equal(a.reads, b.reads)
        err = ((a.o.float() - b.o.float()).norm() / a.o.float().norm()).item()
        assert err < tol, (h, T, err)


def _q_win_case(device: str, dtype: torch.dtype, hp: dict, h: int, Dk: int, Dv: int, T: int, extra: list[int],
                seed: int) -> tuple[tuple, torch.Tensor, NSAParams]:
    """Random decode arguments ``(q, t, caches..., gates)``, a window query ``q_win`` (a non-contiguous
    view, with strides of its own) and the params: ``B = 5`` sequences at different positions."""
    from nsa.ops.indexing import num_cmp

    torch.manual_seed(seed)
    B, H = 5, 2
    C, R = num_cmp(T, hp["l"], hp["d"]), min(hp["w"], T)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s).to(device=device, dtype=dtype)

    t = torch.tensor([T - 1, 5, T // 2, *extra], device=device)[:B]
    args = (r(B, H * h, Dk) * 2, t, r(B, H, C + 1, Dk), r(B, H, C + 1, Dv), r(B, H, T, Dk), r(B, H, T, Dv),
            r(B, H, R, Dk), r(B, H, R, Dv), torch.rand(B, H * h, 3).to(device=device, dtype=dtype))
    q_win = (r(B, Dk, 2 * H * h) * 2).transpose(1, 2)[:, 1::2]  # [B, HQ, Dk], not contiguous
    return args, q_win, NSAParams(**hp)


def _triton_vs_torch_decode_q_win(device: str, dtype: torch.dtype, tol: float) -> None:
    """With a window query ``q_win`` the fused Triton step equals the torch step (same blocks, reads,
    output), its blocks are those without ``q_win``, and ``q_win=None`` equals ``q_win=q`` exactly.
    Cases: one window tile, and window and compressed ranges split over several programs."""
    from nsa.ops.decode import nsa_decode

    # (l, d, l_sel, n_sel, w), h, Dk, Dv, T, extra positions
    cases = [((4, 2, 2, 5, 5), 1, 8, 6, 40, [3, 22]), ((8, 4, 16, 3, 20), 6, 8, 12, 70, [31, 47]),
             ((8, 4, 8, 40, 33), 4, 16, 16, 90, [63, 64])]
    if device == "cuda":
        cases += [((32, 16, 64, 16, 512), 16, 128, 128, 3000, [2047, 2048])]
    for i, ((l, d, l_sel, n_sel, w), h, Dk, Dv, T, extra) in enumerate(cases):  # noqa: E741
        args, qw, hp = _q_win_case(device, dtype, dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w), h, Dk, Dv, T,
                                   extra, seed=20 + i)
        a = nsa_decode(*args, hp, backend="torch", q_win=qw)
        b = nsa_decode(*args, hp, backend="triton", q_win=qw)
        plain = nsa_decode(*args, hp, backend="triton")
        assert torch.equal(a.block_idx, b.block_idx), (h, T, a.block_idx, b.block_idx)
        assert torch.equal(b.block_idx, plain.block_idx)
        assert torch.equal(a.reads, b.reads)
        err = ((a.o.float() - b.o.float()).norm() / a.o.float().norm()).item()
        assert err < tol, (h, T, err)
        assert ((b.o.float() - plain.o.float()).norm() / plain.o.float().norm()).item() > 10 * tol  # q_win used
        same = nsa_decode(*args, hp, backend="triton", q_win=args[0])
        assert torch.equal(same.o, plain.o) and torch.equal(same.block_idx, plain.block_idx)


# default tiles, then several block chunks per group (chunk-local candidates); the window's own queries;
# then a fallback case
DECODE_KERNEL_JOB = Job(
    "from tests.test_decode import _triton_vs_torch_decode, _triton_vs_torch_decode_q_win\n"
    "from nsa.ops import tile_overrides\n"
    "for tune in ({}, {'dec_score_cols': 16}):\n"
    "    with tile_overrides(tune):\n"
    "        _triton_vs_torch_decode('cpu', torch.float32, 1e-5)\n"
    "_triton_vs_torch_decode_q_win('cpu', torch.float32, 1e-5)\n"
    "from nsa.ops import fallback_counts; assert not fallback_counts(), fallback_counts()\n"
    "from nsa.ops import NSAParams\n"
    "from nsa.ops.decode import nsa_decode\n"
    "q, g = torch.randn(1, 2, 8), torch.rand(1, 2, 3)\n"
    "kv = [torch.randn(1, 1, n, 8) for n in (9, 9, 24, 24, 5, 5)]\n"
    "hp = NSAParams(l=4, d=2, l_sel=6, n_sel=2, w=5)\n"
    "out = nsa_decode(q, torch.tensor([20]), *kv, g, hp, backend='triton')\n"
    "ref = nsa_decode(q, torch.tensor([20]), *kv, g, hp, backend='torch')\n"
    "torch.testing.assert_close(out.o, ref.o)\n"
    "assert list(fallback_counts()) == ['nsa_decode:triton->torch:l_sel/d=3 is not a power of two <= 64']\n")


@pytest.mark.beside(DECODE_KERNEL_JOB)
def test_triton_decode_kernel_in_interpreter() -> None:
    """CPU: the kernel under ``TRITON_INTERPRET=1`` (a process of its own: Triton reads it at import), also with
    a window query ``q_win``."""
    pytest.importorskip("triton")
    run_job(DECODE_KERNEL_JOB)


@pytest.mark.gpu
def test_triton_decode_kernel_on_gpu() -> None:
    _triton_vs_torch_decode("cuda", torch.bfloat16, 2e-2)


@pytest.mark.gpu
def test_triton_decode_q_win_on_gpu() -> None:
    _triton_vs_torch_decode_q_win("cuda", torch.bfloat16, 2e-2)


@pytest.mark.parametrize("hp", CONFIGS)
def test_nsa_decode_q_win_feeds_only_the_window_branch(hp: dict) -> None:
    """Torch step with ``q_win``: ``g_cmp * o_cmp(q) + g_sel * o_sel(q) + g_win * o_win(q_win)`` (each
    branch from one-hot gates), with the blocks and reads of ``q`` alone (float64)."""
    from nsa.ops.decode import nsa_decode

    args, qw, params = _q_win_case("cpu", torch.float64, hp, 3, 8, 6, 37, [20, 36], seed=31)
    q, t, *caches, gates = args
    res = nsa_decode(*args, params, q_win=qw)
    plain = nsa_decode(*args, params)
    assert torch.equal(res.block_idx, plain.block_idx)
    assert torch.equal(res.reads, plain.reads)

    def branch(query: torch.Tensor, k: int) -> torch.Tensor:
        onehot = torch.zeros_like(gates)
        onehot[..., k] = 1.0
        return nsa_decode(query, t, *caches, onehot, params).o

    o_cmp, o_sel, o_win = branch(q, 0), branch(q, 1), branch(qw, 2)
    expected = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win
    torch.testing.assert_close(res.o, expected, rtol=1e-12, atol=1e-12)
    # and the window branch really changed (the check above is not that of q_win = q)
    assert (res.o - plain.o).abs().max().item() > 1e-3


@pytest.mark.parametrize("hp", CONFIGS)
def test_nsa_decode_q_win_none_equals_q(hp: dict) -> None:
    """``q_win=None`` is ``q_win=q`` (and a copy of ``q``) bit for bit, on the torch step."""
    from nsa.ops.decode import nsa_decode

    args, _, params = _q_win_case("cpu", torch.float32, hp, 2, 8, 8, 29, [0, 13], seed=32)
    plain = nsa_decode(*args, params)
    for qw in (args[0], args[0].clone()):
        res = nsa_decode(*args, params, q_win=qw)
        assert torch.equal(res.o, plain.o) and torch.equal(res.block_idx, plain.block_idx)
        assert torch.equal(res.reads, plain.reads)


def test_nsa_decode_q_win_must_match_q() -> None:
    from nsa.ops.decode import nsa_decode

    args, qw, params = _q_win_case("cpu", torch.float32, CONFIGS[0], 1, 8, 8, 20, [3, 9], seed=33)
    with pytest.raises(ValueError, match="q_win"):
        nsa_decode(*args, params, q_win=qw[:, :, :4])
    with pytest.raises(ValueError, match="q_win"):
        nsa_decode(*args, params, q_win=qw.double())


def _triton_vs_torch_append(device: str, dtype: torch.dtype) -> None:
    """The fused cache append equals its torch reference over a walk of decode positions: every raw,
    window and ring slot, and (mean pooling) every compressed token emitted, across ring wrap-arounds,
    emission steps, positions before the first compressed token, Dk != Dv, non-contiguous new rows."""
    from nsa.ops.decode_cache import DecodeCaches, NewToken, append_token
    from nsa.ops.indexing import num_cmp

    gen = torch.Generator().manual_seed(1)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    # (l, d, w), H, Dk, Dv, T
    for (l, d, w), H, Dk, Dv, T in [((4, 2, 5), 2, 8, 6, 40), ((8, 4, 9), 1, 16, 16, 50), ((32, 16, 512), 2, 64, 64, 700)]:  # noqa: E741
        B, C, R = 3, num_cmp(T, l, d), min(w, T)
        shapes = [(T, Dk), (T, Dv), (R, Dk), (R, Dv), (l, Dk), (l, Dv), (C + 1, Dk), (C + 1, Dv)]
        ref = DecodeCaches(*(r(B, H, n, D) for n, D in shapes))
        fused = DecodeCaches(*(x.clone() for x in ref))
        t = torch.tensor([0, 3, T // 3], device=device)
        # row 0 walks from before the first compressed token (t < l-1) through its emission (t = l-1) and two
        # more (every d), wrapping the raw ring (every l) on the way; the window ring wraps where w < l+2d
        for _ in range(min(T - T // 3 - 1, l + 2 * d + 1)):
            kv = r(B, 1, 3, H * (Dk + Dv))  # rows as views of one projection, like the model's
            new = NewToken(*(kv[:, 0, i, : H * Dk].reshape(B, H, Dk) if j == 0 else
                             kv[:, 0, i, H * Dk :].reshape(B, H, Dv) for i in range(3) for j in range(2)))
            for caches, backend in ((ref, "torch"), (fused, "triton")):
                append_token(t, new, caches, NSAParams(l=l, d=d, l_sel=d, w=w), emit_mean=True, backend=backend)
            for name, a, b in zip(DecodeCaches._fields, ref, fused, strict=True):
                if name in ("k_cmp", "v_cmp"):  # the torch path also writes the scratch slot C
                    a, b = a[:, :, :C], b[:, :, :C]
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=lambda m, n=name, t=t: f"{n} t={t}: {m}")
            t = t + 1


APPEND_JOB = Job("from tests.test_decode import _triton_vs_torch_append\n"
                 "_triton_vs_torch_append('cpu', torch.float32)\n"
                 "from nsa.ops import fallback_counts; assert not fallback_counts(), fallback_counts()\n"
                 "_triton_vs_torch_append('cpu', torch.float64)  # served by the torch path, counted\n"
                 "assert set(fallback_counts()) == {'append_token:triton->torch:float64'}, fallback_counts()\n")


@pytest.mark.beside(APPEND_JOB)
def test_triton_cache_append_in_interpreter() -> None:
    """CPU: the fused append under ``TRITON_INTERPRET=1`` (a process of its own) equals the torch path."""
    pytest.importorskip("triton")
    run_job(APPEND_JOB)


@pytest.mark.gpu
def test_triton_cache_append_on_gpu() -> None:
    _triton_vs_torch_append("cuda", torch.float32)


def test_triton_decode_falls_back_off_gpu() -> None:
    from nsa.ops import fallback_counts, reset_fallback_counts
    from nsa.ops.decode import nsa_decode, triton_decode_supported

    x = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    served = triton_decode_supported(x, hp=NSAParams()) is None  # only under TRITON_INTERPRET=1 on a CPU
    reset_fallback_counts()
    q = torch.randn(1, 2, 8, dtype=torch.float64)
    kv = [torch.randn(1, 1, n, 8, dtype=torch.float64) for n in (6, 6, 16, 16, 5, 5)]
    gates = torch.rand(1, 2, 3, dtype=torch.float64)
    hp = NSAParams(l=4, d=2, l_sel=4, n_sel=2, w=5)
    out = nsa_decode(q, torch.tensor([15]), *kv, gates, hp, backend="triton")
    ref = nsa_decode(q, torch.tensor([15]), *kv, gates, hp)
    if served:  # the interpreted kernel ran: same result, nothing counted
        torch.testing.assert_close(out.o, ref.o)
        assert sum(fallback_counts().values()) == 0
    else:  # served by the torch path, and counted
        assert torch.equal(out.o, ref.o)
        assert sum(fallback_counts().values()) == 1
    reset_fallback_counts()


def test_fused_decode_refuses_pre_ampere_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 tensor-core dots need compute capability 8.0: older GPUs get the torch path, with the reason."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import nsa.ops._triton.decode as dec

    fake = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.bfloat16,
                           is_floating_point=lambda: True)
    monkeypatch.setattr(dec, "cc_major", lambda device: 7)
    assert dec.decode_unsupported(32, 16, 64, fake) == "compute capability < 8.0"
    monkeypatch.setattr(dec, "cc_major", lambda device: 9)
    assert dec.decode_unsupported(32, 16, 64, fake) is None


def test_decode_bench_notes_out_of_memory_and_raises_the_rest() -> None:
    from nsa.bench.decode import DecodeRow, _noting_oom

    row = DecodeRow("attention", "m7c", 1024, 1, "cpu", "float32", "auto", False)
    with _noting_oom(row, "nsa", torch.device("cpu")):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert row.notes == ["nsa: out of memory"]
    with pytest.raises(ValueError), _noting_oom(row, "dense", torch.device("cpu")):
        raise ValueError("a real bug")
    assert row.notes == ["nsa: out of memory"]


def test_bench_decode_model_rows_take_config_overrides(tmp_path) -> None:
    """``--set`` reaches the model rows (a hybrid stack here: its row says so, and a step reads each block's keys:
    the dense block's 65, the NSA block's 72 at t=64), and a bad override is one line."""
    import json

    from typer.testing import CliRunner

    from nsa_cli.app import app

    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--tiny", "--mode", "model", "--batches", "1", "--json-out", str(out)]
    res = CliRunner().invoke(app, [*args, "--set", "model.dense_layers=0"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["notes"] == ["nsa model: nsa (blocks 0 dense)"] and row["nsa_reads"] == (65 + 72) / 2
    res = CliRunner().invoke(app, [*args, "--set", "model.dense_layer=0"])
    assert res.exit_code == 2 and "model.dense_layer" in res.output and len(res.output.strip().splitlines()) == 1
