"""NSAAttention, the dense baseline and NSALM on tiny CPU shapes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig, load_named
from nsa.model import NSALM, DenseAttention, LMOutput, NSAAttention, RMSNorm, build_model
from nsa.model.diagnostics import ScorerParams
from nsa.model.gates import GateParams
from nsa.ops import NSAParams

HP = NSAParams(l=4, d=2, l_sel=4, n_sel=2, w=6)


def _attn(h: int, phi: str = "avg", gate: str = "sigmoid", shared_kv: bool = False, H: int = 2, **kw) -> NSAAttention:
    torch.manual_seed(0)
    return NSAAttention(24, h * H, H, 8, 6, HP, GateParams(kind=gate, **kw), phi=phi, shared_kv=shared_kv)


def _tiny_lm(attention: str = "nsa", **nsa_kw) -> NSALM:
    mc = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, mlp_hidden=64,
                     attention=attention)
    return NSALM(mc, NSAConfig(**dataclasses.asdict(HP), **nsa_kw))


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("gate", ["sigmoid", "softmax"])
@pytest.mark.parametrize("shared_kv", [False, True])
@pytest.mark.parametrize("h", [1, 2, 6])
def test_forward_backward_finite(phi: str, gate: str, shared_kv: bool, h: int) -> None:
    m = _attn(h, phi, gate, shared_kv)
    x = torch.randn(2, 19, 24, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    (y * torch.randn_like(y)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # every projection (all branches, phi MLP, gates) receives gradient
    assert m.kv_proj.weight.grad.abs().sum() > 0 and m.gate_mlp[0].weight.grad.abs().sum() > 0
    if phi == "mlp":
        assert m.compress.mlp_k.pos.grad.abs().sum() > 0


def test_shared_kv_has_one_projection() -> None:
    assert _attn(2, shared_kv=True).kv_proj.out_features * 3 == _attn(2).kv_proj.out_features


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_module_is_causal(phi: str) -> None:
    m = _attn(3, phi).double()
    x = torch.randn(1, 23, 24, dtype=torch.float64)
    y = m(x)
    for t in (0, 5, 12, 21):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :]) * 3
        y2 = m(x2)
        torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(y2[:, t + 1 :], y[:, t + 1 :])


def test_rope_positions_matter_and_phi_sees_rope() -> None:
    m = _attn(2).double()
    x = torch.randn(1, 12, 24, dtype=torch.float64)
    p = m.project(x, torch.arange(12))
    p_shift = m.project(x, torch.arange(12) + 5)
    torch.testing.assert_close(p.v_sel, p_shift.v_sel)  # values carry no RoPE
    assert not torch.allclose(p.k_cmp_raw, p_shift.k_cmp_raw)  # compression keys are rotated before phi
    assert not torch.allclose(p.q, p_shift.q)
    # rotation preserves norms and relative positions: q_t . k_s depends on t - s only
    torch.testing.assert_close(p.q.norm(dim=-1), p_shift.q.norm(dim=-1))
    s0 = torch.einsum("bshd,bshd->bsh", p.q[:, 1:, :2], p.k_sel[:, :-1, :1].expand(-1, -1, 2, -1))
    s1 = torch.einsum("bshd,bshd->bsh", p_shift.q[:, 1:, :2], p_shift.k_sel[:, :-1, :1].expand(-1, -1, 2, -1))
    torch.testing.assert_close(s0, s1)


@pytest.mark.parametrize("gate", ["sigmoid", "softmax"])
def test_gate_stats_sane_and_no_sync_in_forward(gate: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _attn(2, gate=gate, collapse_threshold=0.5)
    m.train()

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("host sync in forward")

    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "item", boom)
        mp.setattr(torch.Tensor, "tolist", boom)
        for _ in range(3):
            m(torch.randn(2, 17, 24))
    s = m.consume_stats()
    assert math.isclose(sum(s["gate_branch_shares"]), 1.0, rel_tol=1e-9)
    assert 0.0 <= s["gate_entropy_mean"] <= math.log(3) + 1e-9
    assert 0.0 <= s["gate_collapse_fraction"] <= 1.0
    assert all(0 < g < 1 for g in s["gate_mean"])
    assert 1.0 <= s["sel_keys_mean"] <= HP.n_sel * HP.l_sel
    assert m.consume_stats() == {}  # reset
    m.eval()
    m(torch.randn(2, 17, 24))
    assert m.consume_stats() == {}  # eval forwards add nothing


def test_gate_stats_values_match_direct_computation() -> None:
    m = _attn(2, gate="softmax", collapse_threshold=0.4).double()
    m.train()
    x = torch.randn(1, 13, 24, dtype=torch.float64)
    m(x)
    s = m.consume_stats()
    g = m.project(x, torch.arange(13)).gates
    ent = -(g * g.log()).sum(-1)
    assert math.isclose(s["gate_entropy_mean"], ent.mean().item(), rel_tol=1e-9)
    assert math.isclose(s["gate_collapse_fraction"], (g.amax(-1) > 0.4).double().mean().item(), rel_tol=1e-9)
    # selection: first rows attend all their past (block 0 and 1 forced), later n_sel full blocks at most
    from nsa.ops import select_blocks

    p = m.project(x, torch.arange(13))
    idx = select_blocks(p.q, m.compress(p.k_cmp_raw, p.v_cmp_raw)[0], HP).long()
    t = torch.arange(13)[None, :, None, None]
    cnt = ((torch.minimum(idx * 4 + 4, t + 1) - idx * 4).clamp(min=0) * (idx >= 0)).sum(-1)
    assert math.isclose(s["sel_keys_mean"], cnt.double().mean().item(), rel_tol=1e-9)


def _naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 loops: q [B,S,HQ,D], k/v [B,S,H,D]."""
    B, S, HQ, D = q.shape
    h = HQ // k.shape[2]
    out = torch.zeros(B, S, HQ, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            for i in range(HQ):
                s = (k[b, : t + 1, i // h] @ q[b, t, i]) / math.sqrt(D)
                out[b, t, i] = torch.softmax(s, 0) @ v[b, : t + 1, i // h]
    return out


@pytest.mark.parametrize("h", [1, 3])
def test_dense_equals_naive_float64(h: int) -> None:
    torch.manual_seed(1)
    m = DenseAttention(16, 2 * h, 2, 8, 6).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    q, k, v = m.project(x, torch.arange(9))
    ref = m.o_proj(_naive_causal(q, k, v).reshape(2, 9, -1))
    torch.testing.assert_close(m(x), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_overfit_one_batch(attention: str) -> None:
    torch.manual_seed(0)
    model = _tiny_lm(attention)
    ids = torch.randint(0, 32, (2, 25))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        assert isinstance(out, LMOutput) and out.loss is not None and out.loss.dtype == torch.float32
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_loss_ignores_minus_100() -> None:
    model = _tiny_lm()
    ids = torch.randint(0, 32, (1, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    out = model(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(out.logits[0, 5:].float(), ids[0, 5:])
    torch.testing.assert_close(out.loss, ref)


def test_gradient_checkpointing_same_gradients_and_stats() -> None:
    model = _tiny_lm(phi="mlp")
    ids = torch.randint(0, 32, (2, 21))

    def grads(ckpt: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        model.zero_grad()
        model.set_gradient_checkpointing(ckpt)
        model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        sums = model.blocks[0].attn.take_stat_sums()
        assert sums is not None
        return {n: p.grad.clone() for n, p in model.named_parameters()}, sums

    g0, s0 = grads(False)
    g1, s1 = grads(True)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    torch.testing.assert_close(s1, s0)  # the recompute adds no statistics (same counts)


def test_model_stats_aggregate_layers() -> None:
    model = _tiny_lm()
    model.train()
    model(torch.randint(0, 32, (2, 16)))
    s = model.consume_stats()
    assert len(s["gate_entropy_per_layer"]) == 2
    assert s["gate_entropy_mean"] == pytest.approx(sum(s["gate_entropy_per_layer"]) / 2)
    assert model.consume_stats() == {}
    dense = _tiny_lm("dense")
    dense(torch.randint(0, 32, (1, 8)))
    assert dense.consume_stats() == {}


def test_build_model_tiny_and_dense() -> None:
    cfg = load_named("tiny")
    model = build_model(cfg)
    assert isinstance(model, NSALM) and isinstance(model.blocks[0].attn, NSAAttention)
    assert isinstance(model.norm, RMSNorm)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 40))
    assert model(ids).logits.shape == (1, 40, cfg.model.vocab_size)
    dense_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"attention": "dense"})})
    dense = build_model(dense_cfg)
    assert isinstance(dense.blocks[0].attn, DenseAttention)
    assert dense.num_params() < model.num_params()  # NSA has three K/V branches and the gate MLP


def test_tied_embeddings_and_init_std() -> None:
    mc = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_groups=1, d_k=16, d_v=16,
                     tie_embeddings=True, init_std=0.05)
    model = NSALM(mc, NSAConfig(**dataclasses.asdict(HP)))
    assert model.head.weight is model.tok_emb.weight
    assert model.tok_emb.weight.std().item() == pytest.approx(0.05, rel=0.15)
    untied = NSALM(mc.model_copy(update={"tie_embeddings": False}), NSAConfig(**dataclasses.asdict(HP)))
    assert untied.num_params() - model.num_params() == 64 * 32


def test_flops_per_token() -> None:
    dense = _tiny_lm("dense")
    n = dense.num_params(exclude_embedding=True)
    S = 64
    assert dense.flops_per_token(S) == pytest.approx(6 * n + 6 * 2 * 4 * 16 * (S + 1) / 2)
    nsa = _tiny_lm()
    # NSA keys per query: N_c(t) + selected positions + window, averaged over t (checked by brute force)
    keys = []
    for t in range(S):
        n_c = max(0, (t + 1 - 4) // 2 + 1)
        bt = t // 4
        sel = t + 1 if bt < 2 else 4 + t % 4 + 1
        keys.append(n_c + sel + min(6, t + 1))
    assert nsa.attended_keys_mean(S) == pytest.approx(sum(keys) / S)
    assert nsa.flops_per_token(S) > 6 * nsa.num_params(exclude_embedding=True)


def test_lazy_top_level_exports() -> None:
    import nsa

    assert nsa.NSALM is NSALM and nsa.NSAAttention is NSAAttention and nsa.build_model is build_model


@pytest.mark.gpu
def test_stats_accumulation_does_not_sync_on_cuda() -> None:
    from nsa.model.stats import gate_sums, selection_sums

    gates = torch.rand(2, 64, 4, 3, device="cuda")
    idx = torch.randint(-1, 8, (2, 64, 2, 4), device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        acc = torch.cat([gate_sums(gates, 0.9), selection_sums(idx, 8)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert acc.shape == (11,)


def test_gates_start_small_and_the_learned_term_is_scaled() -> None:
    """Gate logits are ``gate_bias + gate_scale * mlp(x)`` (docs/design.md, "Gates"); with the
    defaults (the window preset) the compressed and selected gates start near sigmoid(-2) = 0.12 and the
    window gate near sigmoid(2) = 0.88, for every token and head."""
    torch.manual_seed(0)
    m = _tiny_lm()
    attn = m.blocks[0].attn
    assert isinstance(attn, NSAAttention) and attn.gate_bias == (-2.0, -2.0, 2.0) and attn.gate_scale == 0.1
    assert "gate_offset" not in m.state_dict()  # a constant of the config, not a weight
    x = torch.randn(2, 11, 32)
    fc1, fc2 = attn.gate_mlp[0], attn.gate_mlp[2]
    with torch.no_grad():  # trained-looking weights, so the scale is visible
        fc2.weight.normal_()
        fc2.bias.normal_()
    want = torch.tensor([-2.0, -2.0, 2.0]).repeat(attn.n_heads) + 0.1 * fc2(torch.nn.functional.silu(fc1(x)))
    torch.testing.assert_close(attn.gate_logits(x), want)  # the batched path
    torch.testing.assert_close(attn.gate_logits(x[:1, :3]), want[:1, :3])  # the few-rows (decode) path
    fresh = _tiny_lm(gate_bias=(-1.0, 2.0, -3.0))
    gates = fresh.blocks[1].attn.project(torch.randn(1, 7, 32), torch.arange(7)).gates
    torch.testing.assert_close(gates, torch.sigmoid(torch.tensor([-1.0, 2.0, -3.0])).expand_as(gates),
                               atol=0.02, rtol=0)


def test_fixed_gates_replace_the_gate_mlp() -> None:
    m = _tiny_lm(fixed_gates=(0.0, 0.0, 1.0))
    p = m.blocks[0].attn.project(torch.randn(2, 9, 32), torch.arange(9))
    assert torch.equal(p.gates, torch.tensor([0.0, 0.0, 1.0]).expand(2, 9, 4, 3))
    assert "fixed_gates=(0.0, 0.0, 1.0)" in repr(m.blocks[0].attn)


def test_a_config_saved_before_the_gate_fields_loads_with_the_old_gates(tmp_path) -> None:
    """Runs saved before ``nsa.gate_bias``/``gate_scale`` existed were trained with bias 0, scale 1;
    loading them must rebuild that model, not today's defaults."""
    import yaml

    from nsa.config import RunConfig, saved_run_config
    from nsa.model.load import load_model

    tree = RunConfig().model_dump(mode="json")
    for key in ("gate_bias", "gate_scale"):
        del tree["nsa"][key]
    cfg = saved_run_config(tree)
    assert cfg.nsa.gate_bias == (0.0, 0.0, 0.0) and cfg.nsa.gate_scale == 1.0
    assert RunConfig.model_validate(tree).nsa.gate_scale == 0.1  # a user's config without them: today's default
    small = load_named("tiny").model_dump(mode="json")
    for key in ("gate_bias", "gate_scale"):
        del small["nsa"][key]
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.yaml").write_text(yaml.safe_dump(small))
    from safetensors.torch import save_model

    save_model(build_model(saved_run_config(small)), str(export / "model.safetensors"))
    loaded = load_model(tmp_path)
    attn = loaded.model.blocks[0].attn
    assert isinstance(attn, NSAAttention) and attn.gate_scale == 1.0 and attn.gate_bias == (0.0, 0.0, 0.0)


def test_a_config_saved_before_the_window_query_loads_the_paper_layer() -> None:
    """Runs saved before ``nsa.window_query``/``kv_speed`` have one query and plain K/V weights: loading
    them rebuilds that layer (their checkpoints have no ``q_win_proj`` and unscaled ``kv_proj`` rows)."""
    from nsa.config import RunConfig, saved_run_config

    tree = RunConfig().model_dump(mode="json")
    for key in ("window_query", "kv_speed"):
        del tree["nsa"][key]
    cfg = saved_run_config(tree)
    assert cfg.nsa.window_query is False and cfg.nsa.kv_speed == 1.0
    fresh = RunConfig.model_validate(tree).nsa
    assert fresh.window_query is True and fresh.kv_speed == 3.0  # a user's config without them: the recipe
    attn = build_model(cfg.model_copy(update={"model": load_named("tiny").model})).blocks[0].attn
    assert isinstance(attn, NSAAttention) and attn.q_win_proj is None and attn.kv_gain is None


def test_kv_speed_keeps_the_initial_model_and_moves_the_sparse_kv_faster() -> None:
    """``kv_speed=3``: the same logits at initialisation as ``kv_speed=1`` (the stored rows are W / 3, the
    forward multiplies back), and one AdamW step moves the effective compressed and selected K/V rows 3x as
    far while the window's rows move as far (Adam normalises the 3x gradient of the stored rows away)."""
    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(4))
    moved = {}
    for speed in (1.0, 3.0):
        torch.manual_seed(11)
        lm = _tiny_lm(kv_speed=speed)
        attn = lm.blocks[0].attn
        assert isinstance(attn, NSAAttention)
        before = attn.kv_weight().detach().clone()
        out = lm(ids, labels=ids)
        moved[f"logits{speed}"] = out.logits.detach()
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-3, weight_decay=0.0)
        assert out.loss is not None
        out.loss.backward()
        opt.step()
        moved[speed] = (attn.kv_weight().detach() - before).abs()
    torch.testing.assert_close(moved["logits3.0"], moved["logits1.0"], rtol=1e-5, atol=1e-6)
    rows = 2 * (8 + 8)  # one branch's rows: n_kv_groups * (d_k + d_v)
    sparse = moved[3.0][: 2 * rows].mean() / moved[1.0][: 2 * rows].mean()
    window = moved[3.0][2 * rows:].mean() / moved[1.0][2 * rows:].mean()
    assert abs(sparse - 3.0) < 0.05 and abs(window - 1.0) < 0.05, (sparse, window)


def test_weights_of_the_papers_layer_start_the_default_layer_as_the_same_function() -> None:
    """``train.init_from`` of a run trained with the paper's layer (``window_query=false, kv_speed=1``) into
    today's default: ``q_win_proj`` starts as ``q_proj`` and the K/V rows are stored for ``kv_speed``, so
    the model computes what the source did; between kv speeds the same; a window query the target has no
    place for is one line naming it."""
    from pathlib import Path

    from nsa.config import RunConfig
    from nsa.errors import CheckpointError
    from nsa.model.load import fit_init_weights

    ids = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(9))
    paper = {"window_query": False, "kv_speed": 1.0}
    for src_kw, dst_kw in ((paper, {}), ({}, {"kv_speed": 7.0}), ({}, paper)):
        torch.manual_seed(3)
        src = _tiny_lm(**src_kw)
        cfg = RunConfig(model=src.model_cfg, nsa=src.nsa_cfg)
        dst = _tiny_lm(**dst_kw)
        if dst_kw == paper:
            with pytest.raises(CheckpointError, match="q_win_proj"):
                fit_init_weights(src.state_dict(), cfg, Path("src"), dst)
            continue
        state, _, fresh = fit_init_weights(src.state_dict(), cfg, Path("src"), dst)
        assert not fresh
        dst.load_state_dict(state)
        torch.testing.assert_close(dst(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-6)


def test_window_query_feeds_only_the_window_branch() -> None:
    """With the window gated off (fixed gates) ``q_win_proj`` gets no gradient and the output does not
    depend on it; with only the window on, ``q_proj`` gets none from attention (the block choice is not
    differentiated)."""
    x = torch.randn(2, 19, 24, generator=torch.Generator().manual_seed(5))
    for fixed, silent in (((0.5, 0.5, 0.0), "q_win_proj"), ((0.0, 0.0, 1.0), "q_proj")):
        torch.manual_seed(0)
        m = NSAAttention(24, 4, 2, 8, 6, HP, GateParams(fixed=fixed), window_query=True)
        assert m.q_win_proj is not None
        m(x).square().sum().backward()
        grad = getattr(m, silent).weight.grad
        assert grad is None or grad.abs().max() == 0, silent
        other = m.q_proj if silent == "q_win_proj" else m.q_win_proj
        assert other.weight.grad is not None and other.weight.grad.abs().max() > 0


def test_gate_options_are_one_record_and_the_old_keywords_build_the_same_layer() -> None:
    """``GateParams`` carries the gate options (issue 34); the loose keywords that the ``modeling_nsa.py`` of
    earlier Hugging Face exports passes build the same layer."""
    gates = GateParams(kind="softmax", hidden=5, bias=(0, 1, -1), scale=0.5, collapse_threshold=0.4)
    assert gates.bias == (0.0, 1.0, -1.0) and gates == GateParams.of_config(NSAConfig(
        gate="softmax", gate_hidden=5, gate_bias=(0.0, 1.0, -1.0), gate_scale=0.5, collapse_threshold=0.4))
    torch.manual_seed(0)
    new = NSAAttention(24, 4, 2, 8, 6, HP, gates, phi="mlp")
    torch.manual_seed(0)
    old = NSAAttention(24, 4, 2, 8, 6, HP, phi="mlp", gate="softmax", gate_hidden=5, gate_bias=(0.0, 1.0, -1.0),
                       gate_scale=0.5, fixed_gates=None, collapse_threshold=0.4)
    assert old.gates == gates and old.state_dict().keys() == new.state_dict().keys()
    x = torch.randn(1, 9, 24)
    torch.testing.assert_close(old(x), new(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="not both"):
        NSAAttention(24, 4, 2, 8, 6, HP, gates, gate="sigmoid")
    with pytest.raises(ValueError, match=r"nsa\.gate='relu'"):
        GateParams(kind="relu")


def test_diagnostics_follow_the_layer_and_stay_out_of_its_state() -> None:
    """The layer's diagnostics (running sums, scorer weight) move with ``.double()``/``.to()`` and add nothing
    to ``state_dict`` or the module's buffers."""
    m = _attn(2)
    keys = set(m.state_dict())
    m.diag.set_scorer(ScorerParams(4, 0.25))
    m.double()
    assert set(m.state_dict()) == keys and [n for n, _ in m.named_buffers()] == ["gate_offset"]
    assert m.diag.acc.dtype == torch.float64 and m.diag.scorer_weight.dtype == torch.float64
    assert float(m.diag.scorer_weight) == 0.25
