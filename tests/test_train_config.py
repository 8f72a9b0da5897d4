"""``nsa train`` configuration: source precedence and every bad-config error (exit 2, one line)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nsa.config import load_run_config
from nsa.config.fields import flag_values as flags_to_keys
from nsa.train.launch import strip_launch_options, torchrun_argv
from nsa_cli.app import app

runner = CliRunner()


def _yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_defaults_yaml_profile_env_flags_set(tmp_path: Path) -> None:
    """defaults < config YAML < profile < NSA_* environment < flags < --set, with sources recorded."""
    cfg = _yaml(
        tmp_path / "c.yaml",
        "train: {steps: 11, seq_len: 40, batch_size: 5, accum: 3, seed: 7}\noptimizer: {lr: 0.01}\n"
        "runtime: {device: cpu}\n",
    )
    prof = _yaml(
        tmp_path / "p.yaml",
        "name: p\nexpect: {device: cpu}\nsettings: {NSA_PREFETCH_DEPTH: 3}\n"
        "train: {seq_len: 48, batch_size: 6, accum: 4}\n",
    )
    env = {"NSA_BATCH_SIZE": "7", "NSA_ACCUM": "5", "NSA_PREFETCH_DEPTH": "1"}
    flags = flags_to_keys(accum=6, steps=None, lr=None)
    r = load_run_config(config=cfg, profile=str(prof), environ=env, flags=flags, sets=["train.accum=9"])
    t = r.config.train
    assert r.config.optimizer.weight_decay == 0.1 and r.source_of("optimizer.weight_decay") == "default"
    assert (t.steps, r.config.optimizer.lr, t.seed) == (11, 0.01, 7) and r.source_of("train.steps") == "config c.yaml"
    assert t.seq_len == 48 and r.source_of("train.seq_len") == "profile p"
    assert t.batch_size == 7 and r.source_of("train.batch_size") == "env NSA_BATCH_SIZE"
    assert r.config.data.prefetch_depth == 1 and r.source_of("data.prefetch_depth") == "env NSA_PREFETCH_DEPTH"
    assert t.accum == 9 and r.source_of("train.accum") == "--set train.accum"
    r2 = load_run_config(config=cfg, profile=str(prof), environ=env, flags=flags)
    assert r2.config.train.accum == 6 and r2.source_of("train.accum") == "flag --accum"


def test_flag_mapping_covers_every_documented_flag() -> None:
    keys = flags_to_keys(
        steps=1, seq_len=2, batch_size=3, accum=4, lr=0.5, out_dir="o", dataset="local", data_path="p",
        tokenizer="byte", seed=5, resume="auto", attention="dense", compile=False,
    )
    assert keys == {
        "train.steps": 1, "train.seq_len": 2, "train.batch_size": 3, "train.accum": 4, "optimizer.lr": 0.5,
        "train.out_dir": "o", "data.source": "local", "data.path": "p", "data.tokenizer": "byte",
        "train.seed": 5, "train.resume": "auto", "model.attention": "dense", "runtime.compile": False,
    }


def test_torchrun_argv_drops_nproc() -> None:
    argv = ["train", "--config", "tiny", "--nproc-per-node", "2", "--steps", "3", "--nproc-per-node=4"]
    assert strip_launch_options(argv) == ["train", "--config", "tiny", "--steps", "3"]
    cmd = torchrun_argv(2, ["-m", "nsa_cli", *strip_launch_options(argv)])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[-7:] == ["-m", "nsa_cli", "train", "--config", "tiny", "--steps", "3"]


BAD = [
    # (extra args, environment, text the single error line must contain)
    (["--set", "train.stepz=5"], {}, "train.stepz"),
    (["--set", "bogus.key=1"], {}, "bogus"),
    (["--set", "train.steps=abc"], {}, "train.steps"),
    ([], {"NSA_STEPS": "abc"}, "NSA_STEPS"),
    (["--accum", "0"], {}, "train.accum"),
    (["--steps", "0"], {}, "train.steps"),
    (["--seq-len", "128", "--set", "model.max_seq_len=64"], {}, "train.seq_len"),
    (["--set", "runtime.device=cpu", "--set", "runtime.precision=bf16"], {}, "runtime.precision"),
    (["--set", "runtime.precision=fp16"], {}, "runtime.precision"),
    (["--set", "eval.every=5", "--set", "data.val_fraction=0"], {}, "eval.every"),
    (["--dataset", "local"], {}, "data.path"),
    (["--dataset", "nowhere"], {}, "data.source"),
    (["--attention", "sparse"], {}, "model.attention"),
    (["--set", "nsa.d=3"], {}, "nsa.d"),
    (["--set", "model.n_kv_groups=3"], {}, "model.n_kv_groups"),
    (["--resume", "/nonexistent/ckpt"], {}, "train.resume"),
    (["--profile", "no-such-profile"], {}, "profile"),
    (["--set", "train.fault_nan_at_step=99"], {}, "train.fault_nan_at_step"),
    (["--set", "optimizer.lr=-1"], {}, "optimizer.lr"),
    ([], {"NSA_COMPILE_MODE": "fastest"}, "NSA_COMPILE_MODE"),
]


@pytest.mark.parametrize(("args", "env", "needle"), BAD, ids=[b[2] + "-" + "_".join(b[0])[:30] for b in BAD])
def test_bad_config_fails_fast_with_one_line(tmp_path: Path, args: list[str], env: dict[str, str], needle: str) -> None:
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "4", "--out-dir", str(out), *args], env=env)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert needle in lines[0]
    assert not out.exists(), "a bad config must fail before any work"


def test_unknown_key_in_yaml(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path / "bad.yaml", "train:\n  steps: 3\n  warmpu_steps: 1\n")
    res = runner.invoke(app, ["train", "--config", str(cfg), "--out-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "train.warmpu_steps" in res.stderr and "bad.yaml" in res.stderr


def test_invalid_yaml_and_missing_config(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path / "broken.yaml", "train: [steps: 3\n")
    res = runner.invoke(app, ["train", "--config", str(cfg)])
    assert res.exit_code == 2 and "not valid YAML" in res.stderr
    res = runner.invoke(app, ["train", "--config", "no-such-config"])
    assert res.exit_code == 2 and "no-such-config" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda(tmp_path: Path) -> None:
    res = runner.invoke(app, ["train", "--config", "tiny", "--set", "runtime.device=cuda", "--out-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and "runtime.device=cuda" in res.stderr


def test_gpt2_tokenizer_fails_before_any_work(tmp_path: Path) -> None:
    """Offline: the uncached gpt2 files are a one-line error; cached: tiny's vocab (256) is too small."""
    from nsa.data.tokenizers import gpt2_cached

    res = runner.invoke(app, ["train", "--config", "tiny", "--tokenizer", "gpt2", "--out-dir", str(tmp_path / "r")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    if gpt2_cached():
        assert "model.vocab_size" in res.stderr
    else:
        assert "gpt2 tokenizer files are not cached" in res.stderr and "hint:" in res.stderr
    assert not (tmp_path / "r").exists()


def test_existing_run_needs_resume(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "training.csv").write_text("step,loss\n1,2.0\n")
    res = runner.invoke(app, ["train", "--config", "tiny", "--out-dir", str(run)])
    assert res.exit_code == 2 and "train.out_dir" in res.stderr and "--resume auto" in res.stderr


def test_nproc_must_be_positive() -> None:
    res = runner.invoke(app, ["train", "--config", "tiny", "--nproc-per-node", "0"])
    assert res.exit_code == 2 and "--nproc-per-node" in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize("sets, world, mode", [
    ([], 1, "reduce-overhead"),  # an NSA model on one rank: CUDA graphs (its step waits on the host)
    (["model.attention=dense"], 1, "default"),  # dense gains nothing from them
    ([], 2, "reduce-overhead"),  # DDP ranks: graphs too (the all-reduce buckets split them)
    (["runtime.parallel=fsdp"], 2, "default"),  # FSDP2's hooks re-record the graphs every step
    (["runtime.context_parallel=2"], 2, "default"),
    (["train.accum=2"], 1, "default"),
    (["runtime.gradient_checkpointing=true"], 1, "default"),
    (["data.document_mask=true"], 1, "default"),
    (["train.seq_len=32768", "model.max_seq_len=32768"], 1, "default"),  # long steps are the GPU's
    (["runtime.compile_mode=default"], 1, "default"),  # an explicit mode is kept
    (["runtime.compile_mode=reduce-overhead", "model.attention=dense"], 2, "reduce-overhead"),
])
def test_compile_mode_auto_uses_cuda_graphs_where_they_pay(sets: list[str], world: int, mode: str) -> None:
    cfg = load_run_config(config="tiny", sets=sets).config
    assert cfg.torch_compile_mode(world) == mode


@pytest.mark.parametrize("scope, fsdp, blocks", [("auto", True, True), ("auto", False, False),
                                                 ("model", True, False), ("blocks", False, True)])
def test_compile_scope_wraps_the_blocks_or_the_model(scope: str, fsdp: bool, blocks: bool) -> None:
    """``runtime.compile_scope``: each block compiled in place (auto under FSDP2), else one compiled model. A single
    process here (nothing sharded), so only the choice and the wrapping are checked; compiling is lazy."""
    from nsa.model import build_model
    from nsa.train import distributed as D
    from nsa.train import parallel

    cfg = load_run_config(config="tiny", sets=[f"runtime.compile_scope={scope}"]).config
    assert cfg.runtime.compiles_blocks(sharded=fsdp) is blocks
    model = build_model(cfg)
    out = parallel.wrap(model, cfg, D.DistInfo(), "fp32", "cpu", compiled=True)
    if cfg.runtime.compiles_blocks(sharded=False):  # one process: nothing sharded
        assert out is model and all(b._compiled_call_impl is not None for b in model.block_list())
    else:
        assert out is not model and all(b._compiled_call_impl is None for b in model.block_list())


@pytest.mark.parametrize("value, params, per_unit", [("auto", 108_000_000, 0), ("auto", 3_000_000_000, 1),
                                                     ("0", 3_000_000_000, 0), ("2", 108_000_000, 2)])
def test_fsdp_units_whole_model_up_to_a_billion_parameters(value: str, params: int, per_unit: int) -> None:
    """``runtime.fsdp_unit_blocks``: auto shards a model of up to 1B parameters as one FSDP2 unit (per-block units'
    host work is not hidden by small blocks), larger ones a block a unit; a number is taken as given."""
    cfg = load_run_config(config="tiny", sets=[f"runtime.fsdp_unit_blocks={value}"]).config
    assert cfg.runtime.fsdp_units(params) == per_unit
