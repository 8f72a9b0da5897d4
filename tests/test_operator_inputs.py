"""Issue 26, the older system's inputs and the text an operator reads at start: ``CONFIG=path``, the older
YAML keys (mapped with a note each, or refused all at once), hints for old ``NSA_*`` knobs that depend on the
value, the flag named as typed, secrets redaction that spares ``NSA_TOKENIZER``, the default config said
aloud, and the data source described (files read, files ignored, characters read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nsa.config import load_run_config
from nsa.config.resolve import default_config_note
from nsa.config.settings import describe_unknown
from nsa.errors import ConfigError
from nsa_cli.app import app
from tests.conftest import clean_env

runner = CliRunner()

# the older system's A100 50k config (seed runbook 004), as it was written
OLD_A100 = {
    "model": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_groups": 2, "d_k": 64, "d_v": 64},
    "nsa": {"l": 32, "d": 16, "l_sel": 64, "n_sel": 16, "w": 512, "phi": "avg"},
    "runtime": {"device": "cuda", "precision": "bf16", "gradient_checkpointing": True, "use_flash": True,
                "use_triton_sel": False, "sel_triton_min_L": 4096},
    "train": {"steps": 50000, "seq_len": 2048, "batch_size": 2, "accumulate_grad_batches": 2, "lr": 2.0e-4,
              "lr_schedule": "cosine", "warmup_steps": 2000, "weight_decay": 0.01, "grad_clip": 1.0, "save_every": 5000},
}


def _yaml(tmp_path: Path, tree: dict, name: str = "old.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


def test_older_yaml_keys_are_mapped_with_one_note_each(tmp_path: Path) -> None:
    r = load_run_config(_yaml(tmp_path, OLD_A100), environ={})
    assert r.config.train.accum == 2 and r.config.runtime.attn_backend == "torch"
    older = [n for n in r.notes if n.endswith("(older system's key)")]
    assert len(older) == 5, r.notes
    # its keys that this toolkit split out of `train` since: one deprecation note each (train.lr -> optimizer.lr)
    moved = [n for n in r.notes if "is deprecated, use" in n]
    assert len(moved) == 5 and len(r.notes) == 10, r.notes
    assert r.config.optimizer.lr == 2.0e-4 and r.config.checkpoint.every == 5000
    joined = "\n".join(r.notes)
    for text in ("train.accumulate_grad_batches=2 -> train.accum=2", "runtime.use_triton_sel=false -> runtime.attn_backend=torch",
                 "runtime.use_flash=true dropped", "runtime.sel_triton_min_L=4096 dropped", "train.lr_schedule=cosine dropped"):
        assert text in joined, joined
    const = load_run_config(_yaml(tmp_path, {"train": {"lr_schedule": "constant"}}, "c.yaml"), environ={})
    assert const.config.schedule.min_lr_ratio == 1.0


def test_keys_without_an_equivalent_are_refused_all_at_once(tmp_path: Path) -> None:
    tree = {"train": {"lr_schedule": "linear", "accumulate_grad_batches": 2}, "runtime": {"use_triton_sel": "maybe"}}
    with pytest.raises(ConfigError) as err:
        load_run_config(_yaml(tmp_path, tree), environ={})
    assert "train.lr_schedule=linear" in err.value.message and "runtime.use_triton_sel=maybe" in err.value.message
    typo = {"train": {"stpes": 3, "bach_size": 2}, "model": {"dimm": 64}}
    with pytest.raises(ConfigError) as err:
        load_run_config(_yaml(tmp_path, typo, "typo.yaml"), environ={})
    for key in ("train.stpes", "train.bach_size", "model.dimm"):  # every unknown key in one message
        assert key in err.value.message


def test_config_variable_is_read_in_place_of_the_flag(tmp_path: Path) -> None:
    r = load_run_config(None, environ={"CONFIG": "tiny"})
    assert r.config_path is not None and r.config_path.endswith("tiny.yaml") and r.config.model.dim == 64
    assert r.notes == ["config from CONFIG=tiny (the older system's variable; --config is the flag)"]
    with pytest.raises(ConfigError) as err:
        load_run_config(None, environ={"CONFIG": "configs/m7c_125m_2xa100_production.yaml"})
    assert err.value.message.startswith("CONFIG=configs/m7c_125m_2xa100_production.yaml") and "unset CONFIG" in (err.value.hint or "")
    both = load_run_config("tiny", environ={"CONFIG": "m7c-125m"})
    assert both.config.model.dim == 64 and both.notes == ["CONFIG=m7c-125m ignored: --config tiny given"]
    res = runner.invoke(app, ["profiles", "show", "cpu"], env=clean_env(CONFIG="tiny", COLUMNS="200"))
    assert res.exit_code == 0 and "config from CONFIG=tiny" in res.output and "config tiny.yaml" in res.output


def test_hints_for_older_knobs_depend_on_the_value() -> None:
    off = describe_unknown("NSA_USE_FA2", "0")
    assert off.startswith("NSA_USE_FA2=0 (older system: nothing to set") and "=flash" not in off
    assert "NSA_ATTN_BACKEND" in describe_unknown("NSA_USE_FA2", "1")  # the window kernel comes with the backend
    assert "NSA_ATTN_BACKEND=torch" in describe_unknown("NSA_USE_TRITON_SEL", "0")
    assert "NSA_ATTN_BACKEND=triton" in describe_unknown("NSA_USE_TRITON_SEL", "1")
    assert "NSA_ATTN_BACKEND=reference" in describe_unknown("NSA_FORCE_PARITY", "1")
    assert "reference" not in describe_unknown("NSA_FORCE_PARITY", "0")
    assert "NSA_PREFETCH_DEPTH=0" in describe_unknown("NSA_FWE_PREFETCH", "0")
    assert "NSA_PREFETCH_DEPTH=8" in describe_unknown("NSA_FWE_Q", "8")
    r = load_run_config("tiny", environ={"NSA_USE_FA2": "0"})
    assert r.unknown_env_described[0].startswith("NSA_USE_FA2=0 (older system: nothing to set")


def test_origin_names_the_flag_as_typed() -> None:
    from nsa.config.fields import flags_as_typed

    r = load_run_config("tiny", environ={}, flags={"data.source": "embedded", "runtime.compile": False,
                                                   "data.path": "x"})  # the flags of the config's metadata
    assert r.sources["data.source"] == "flag --dataset"
    assert r.sources["runtime.compile"] == "flag --compile" and r.sources["data.path"] == "flag --data-path"
    typed = flags_as_typed(dataset="embedded", compile=False, lr=0.1, out_dir="o")  # as the CLI records them
    assert typed == {"data.source": "--dataset", "runtime.compile": "--no-compile", "optimizer.lr": "--lr",
                     "train.out_dir": "--out-dir"}
    r = load_run_config("tiny", environ={}, flags={"runtime.compile": False}, flag_names=typed)
    assert r.sources["runtime.compile"] == "flag --no-compile"


def test_tokenizer_setting_is_not_a_secret(tmp_path: Path) -> None:
    from nsa.rundir.env import is_secret, redact_env

    assert not is_secret("NSA_TOKENIZER") and not is_secret("TOKENIZERS_PARALLELISM")
    assert all(is_secret(n) for n in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "APIKEY", "DB_PASSWD"))
    assert redact_env({"NSA_TOKENIZER": "gpt2", "HF_TOKEN": "x"}) == {"NSA_TOKENIZER": "gpt2", "HF_TOKEN": "<redacted>"}


def test_the_default_config_is_said_aloud() -> None:
    from nsa.checks.preflight import run_preflight

    note = default_config_note(load_run_config(None, environ={}))
    assert note is not None and note.startswith("no --config given: the default model (dim 768 x 12 layers")
    assert "1.3M characters" in note
    assert default_config_note(load_run_config("tiny", environ={})) is None
    report = run_preflight(config=None, environ={})
    check = next(c for c in report.checks if c.name == "config")
    assert check.status.value == "WARN" and "no --config given" in check.reason


def test_the_data_source_says_which_files_it_reads_and_ignores(tmp_path: Path) -> None:
    from nsa.config import DataConfig
    from nsa.data.loader import build_loader
    from nsa.data.tokenizers import get_tokenizer

    folder = tmp_path / "src"
    folder.mkdir()
    for i in range(3):
        (folder / f"mod{i}.py").write_text("def f():\n    return 1\n" * 50)
    (folder / "notes.md").write_text("# notes\n")
    (folder / "a.txt").write_text("First paragraph of text.\n\nSecond one, a little longer.\n")
    loader = build_loader(DataConfig(source="local", path=str(folder), prefetch_depth=0), get_tokenizer("byte"),
                          split="train", seq_len=16, batch_size=2, seed=0, rank=0, world_size=1, device="cpu")
    text = loader.description
    assert text.startswith(f"local: text at {folder}") and "a.txt (1 file(s)" in text
    assert "ignored 4 file(s) of other types (.py 3, .md 1)" in text
    next(loader)
    stats = loader.stats()
    assert stats["chars_seen"] > 0 and stats["docs_seen"] >= 1


def test_migrating_page_covers_the_older_runbooks_inputs() -> None:
    import re

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "migrating.md").read_text()
    for item in ("CONFIG=", "accumulate_grad_batches", "use_flash", "use_triton_sel", "sel_triton_min_L",
                 "lr_schedule", "DDP_SAFE", "TORCH_LOGS", "model.pt", "launch_production_50k_single_gpu.sh",
                 "setup_pod.sh", "bench_prefill.py", "bench_decode.py", "`--ddp 0`", "--synthetic-on-fail",
                 "--loader-timeout", "--fwe-report-docs", "--resume-from", "--local-path", "nsa dump RUN"):
        assert item in text, item
    for target in re.findall(r"\]\(([^)#]+)\)", text) + re.findall(r"`(\.\./[^`]+)`", text):
        assert (root / "docs" / target).exists(), f"docs/migrating.md links to {target}, which is not in the repo"
