"""A hybrid stack (``model.dense_layers``): NSA blocks and dense blocks in one model, trained, decoded, exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nsa.config import ModelConfig, NSAConfig, load_named
from nsa.model import NSALM, NSAAttention, build_model
from nsa.model.dense import DenseAttention
from nsa_cli.app import app

runner = CliRunner()
HP = {"l": 4, "d": 2, "l_sel": 2, "n_sel": 5, "w": 5}  # a 40-token sequence crosses many blocks


def _hybrid(dense_layers: list[int], seed: int = 0, n_layers: int = 3) -> NSALM:
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=48, dim=32, n_layers=n_layers, n_heads=4, n_kv_groups=2, d_k=8, d_v=6,
                     mlp_hidden=48, dense_layers=dense_layers)
    model = NSALM(mc, NSAConfig(**HP)).eval()
    with torch.no_grad():  # peaky attention, so a wrong key set shows in the logits
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    return model


@pytest.mark.parametrize(("text", "want"), [("2 0", [0, 2]), ("1,2", [1, 2]), ([2], [2]), (1, [1]), ("[0, 1]", [0, 1])])
def test_dense_layers_read_from_text_lists_and_numbers(text: object, want: list[int]) -> None:
    mc = ModelConfig(n_layers=3, dense_layers=text)
    assert mc.dense_layers == want
    assert [mc.layer_attention(i) for i in range(3)] == ["dense" if i in want else "nsa" for i in range(3)]
    assert mc.nsa_layers == [i for i in range(3) if i not in want]


def test_blocks_follow_the_layer_list() -> None:
    model = _hybrid([1])
    kinds = [type(b.attn) for b in model.blocks]
    assert kinds == [NSAAttention, DenseAttention, NSAAttention]
    report = model.selection_report(torch.randint(0, 48, (2, 40), generator=torch.Generator().manual_seed(1)), 8)
    assert [r["layer"] for r in report] == [0, 2]


def test_flops_count_each_layer_by_its_attention() -> None:
    """A hybrid's attention FLOPs sit between the all-NSA and the dense model's, layer by layer."""
    S = 64
    nsa, hybrid = _hybrid([]), _hybrid([0, 2])
    dense_keys, nsa_keys = hybrid.attended_keys_mean(S, "dense"), hybrid.attended_keys_mean(S, "nsa")
    m = hybrid.model_cfg
    per_key = 6.0 * m.n_heads * (m.d_k + m.d_v)
    assert hybrid.flops_per_token(S) == pytest.approx(
        6.0 * hybrid.num_params(exclude_embedding=True) + per_key * (2 * dense_keys + nsa_keys))
    assert nsa.flops_per_token(S) - 6.0 * nsa.num_params(True) == pytest.approx(3 * per_key * nsa_keys)


def test_hybrid_is_causal_and_trains() -> None:
    """Changing the tokens after t leaves the logits up to t unchanged; one gradient step lowers the loss."""
    model = _hybrid([0], seed=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 48, (2, 40), generator=g)
    t = 23
    other = ids.clone()
    other[:, t + 1:] = torch.randint(0, 48, (2, 40 - t - 1), generator=g)
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    labels = torch.roll(ids, -1, 1)
    losses = []
    for _ in range(5):
        loss = model(ids, labels).loss
        assert loss is not None and torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("dense_layers", [[0], [1, 2]])
def test_prefill_then_decode_equals_full_forward(dense_layers: list[int]) -> None:
    model = _hybrid(dense_layers, seed=11)
    S = 40
    ids = torch.randint(0, 48, (2, S), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        full = model(ids).logits
    cache = model.new_cache(2, S)
    logits = model.prefill(ids[:, :9], torch.full((2,), 9), cache)
    torch.testing.assert_close(logits, full[:, :9], rtol=1e-5, atol=1e-5)
    for t in range(9, S):
        torch.testing.assert_close(model.decode_step(ids[:, t], cache), full[:, t], rtol=1e-5, atol=1e-5,
                                   msg=f"position {t}")


def test_hf_export_of_a_hybrid_round_trips(tmp_path: Path) -> None:
    """config.json carries the layer list; both implementations build dense layers there and give the nsa
    model's logits and greedy tokens; the folder reads back to the same config."""
    from safetensors.torch import save_model

    from nsa.hf import export_hf, read_hf
    from tests.test_hf_export import _greedy, _hf

    cfg = load_named("tiny")
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dense_layers": [1]})})
    torch.manual_seed(7)
    ref = build_model(cfg).eval()
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    save_model(ref, str(run / "export" / "model.safetensors"))
    (run / "export" / "config.yaml").write_text(cfg.to_yaml())
    folder = tmp_path / "hf"
    export_hf(run, folder)
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    for impl in ("package", "standalone"):
        hf = _hf(folder, nsa_impl=impl)
        assert hf.config.dense_layers == [1]
        with torch.no_grad():
            assert float((hf(ids).logits - want).abs().max()) <= 1e-5, impl
        assert torch.equal(_greedy(hf, ids, 12), ref.generate(ids, 12)), impl
    _, back, _ = read_hf(folder)
    assert back.model.dense_layers == [1]


def test_training_a_hybrid_from_the_cli(tmp_path: Path) -> None:
    """``nsa train --set model.dense_layers=...`` trains, and the config the run saved rebuilds the stack."""
    from nsa.model.load import load_model

    out = tmp_path / "run"
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "3", "--out-dir", str(out),
                              "--set", "model.dense_layers=0", "--set", "eval.every=0", "--set", "checkpoint.every=0"])
    assert res.exit_code == 0, res.output + res.stderr
    loaded = load_model(out)
    assert loaded.config.model.dense_layers == [0]
    assert isinstance(loaded.model.blocks[0].attn, DenseAttention)
    assert all(isinstance(b.attn, NSAAttention) for b in loaded.model.blocks[1:])


@pytest.mark.parametrize(("value", "needle"), [
    ("9", "outside the"), ("0 0", "twice"), ("first", "must be layer numbers")])
def test_bad_layer_lists_are_one_line(tmp_path: Path, value: str, needle: str) -> None:
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "2", "--out-dir", str(out),
                              "--set", f"model.dense_layers={value}"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 2 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
    assert not out.exists()


def test_a_dense_model_has_no_layer_list(tmp_path: Path) -> None:
    """``--attention dense`` on a config with a hybrid list (m7c-125m's ``even``) trains the dense baseline, and its
    saved config names no dense layers; so does switching an NSA config's attention afterwards."""
    from nsa.model.load import load_model

    out = tmp_path / "r"
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "2", "--out-dir", str(out), "--attention",
                              "dense", "--set", "model.dense_layers=1", "--set", "eval.every=0"])
    assert res.exit_code == 0, res.stderr
    loaded = load_model(out)
    assert loaded.config.model.dense_layers == [] and loaded.config.model.attention == "dense"
    mc = ModelConfig(n_layers=4, dense_layers="odd")
    mc.attention = "dense"
    assert mc.dense_layers == [] and mc.nsa_layers == []


@pytest.mark.parametrize(("word", "n_layers", "want"), [("even", 6, [0, 2, 4]), ("odd", 5, [1, 3]), ("even", 1, [0]),
                                                        ("thirds", 6, [0, 1, 3, 4]), ("thirds", 12, [0, 1, 3, 4, 6, 7, 9, 10])])
def test_even_and_odd_name_every_other_block(word: str, n_layers: int, want: list[int]) -> None:
    assert ModelConfig(n_layers=n_layers, dense_layers=word).dense_layers == want


def test_m7c_trains_the_hybrid_stack_by_default() -> None:
    """The pretraining config's recipe (issue 52): every other block dense, from block 0, at any depth."""
    from nsa.config import load_run_config

    assert load_named("m7c-125m").model.dense_layers == list(range(0, 12, 2))
    six = load_run_config("m7c-125m", environ={}, flags={"model.n_layers": 6}).config
    assert six.model.dense_layers == [0, 2, 4]
    assert load_run_config("m7c-125m", environ={}, flags={"model.dense_layers": []}).config.model.nsa_layers == list(range(12))


def test_the_stack_is_named_where_runs_are_described() -> None:
    """Preflight's config line and the training bench's path column say which blocks are dense."""
    from nsa.bench.train import TrainRow

    assert ModelConfig(n_layers=4, dense_layers="even").stack == "nsa (blocks 0,2 dense)"
    assert ModelConfig(n_layers=4).stack == "nsa" and ModelConfig(attention="dense").stack == "dense"
    row = TrainRow(attention="nsa", seq_len=64, batch_size=1, params_m=1.0, step_ms=1.0, tokens_per_s=1.0,
                   peak_mib=None, device="cpu", backend="torch", dense_layers=[0, 2])
    assert row.path == "torch, blocks 0,2 dense"
    assert TrainRow(**{**row.__dict__, "dense_layers": []}).path == "torch"
