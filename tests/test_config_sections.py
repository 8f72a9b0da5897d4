"""Config sections per component (issue 25): the ``train`` split into ``optimizer``, ``schedule``, ``checkpoint``,
``logging`` and ``eval``; the old keys read with one deprecation line each; the ``NSA_*`` map and the ``nsa
train`` flags derived from the fields' metadata; ``runtime.window_backend`` and ``train.fault_nan_at_step`` gone."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import typer
import yaml

from nsa.config import (
    RunConfig,
    config_fields,
    env_keys,
    flag_keys,
    key_flags,
    load_run_config,
    saved_run_config,
)
from nsa.config.legacy import MOVED_KEYS, REMOVED_KEYS
from nsa.config.settings import ENV_TO_CONFIG, KNOWN, NSASettings, describe_unknown, env_overlay
from nsa.errors import ConfigError

# every NSA_* variable of the release before the split but NSA_WINDOW_BACKEND (removed): each still a field;
# and those added since (NSA_CONTEXT_PARALLEL, issue 32)
VARIABLES = {
    "NSA_PROFILE", "NSA_DEVICE", "NSA_PRECISION", "NSA_ATTN_BACKEND", "NSA_COMPILE", "NSA_COMPILE_MODE",
    "NSA_GRAD_CKPT", "NSA_PARALLEL", "NSA_DETERMINISTIC", "NSA_TF32", "NSA_ALLOC_CONF", "NSA_STEPS", "NSA_SEQ_LEN",
    "NSA_BATCH_SIZE", "NSA_ACCUM", "NSA_LR", "NSA_SEED", "NSA_OUT_DIR", "NSA_SAVE_EVERY", "NSA_DATASET",
    "NSA_DATA_PATH", "NSA_TOKENIZER", "NSA_PREFETCH_DEPTH", "NSA_LOADER_TIMEOUT",
    "NSA_CONTEXT_PARALLEL",
}


def test_the_sections() -> None:
    assert list(RunConfig.model_fields) == ["model", "nsa", "runtime", "train", "optimizer", "schedule", "checkpoint",
                                            "logging", "eval", "scorer", "data", "monitor"]
    train = set(RunConfig.model_fields["train"].annotation.model_fields)  # type: ignore[union-attr]
    assert train == {"steps", "seq_len", "batch_size", "accum", "seed", "out_dir", "resume", "init_from", "stop_at", "run_name"}
    assert "window_backend" not in RunConfig.model_fields["runtime"].annotation.model_fields  # type: ignore[union-attr]
    # every moved key lands on a field of today's config, and no old key is one
    for old, new in MOVED_KEYS.items():
        assert new in config_fields() and old not in config_fields(), old


def test_every_variable_is_a_field_derived_from_the_config_metadata() -> None:
    assert KNOWN == VARIABLES
    assert set(NSASettings.model_fields) == {v[len("NSA_"):].lower() for v in VARIABLES}
    assert set(env_keys()) == VARIABLES - {"NSA_PROFILE"}
    for var, dotted in env_keys().items():
        field = var[len("NSA_"):].lower()
        assert ENV_TO_CONFIG[field] == dotted and dotted in config_fields()
        # typed like the key it sets: a value the key refuses is refused as the variable
        assert NSASettings.model_fields[field].annotation == Optional[config_fields()[dotted].annotation]  # noqa: UP045
    assert env_keys()["NSA_LR"] == "optimizer.lr" and env_keys()["NSA_SAVE_EVERY"] == "checkpoint.every"
    assert env_keys()["NSA_GRAD_CKPT"] == "runtime.gradient_checkpointing"
    layer, unknown = env_overlay({"NSA_LR": "0.01", "NSA_SAVE_EVERY": "7", "NSA_WINDOW_BACKEND": "flash"})
    assert layer == {"optimizer": {"lr": (0.01, "NSA_LR")}, "checkpoint": {"every": (7, "NSA_SAVE_EVERY")}}
    assert unknown == ["NSA_WINDOW_BACKEND"]


def test_every_config_flag_of_nsa_train_comes_from_the_metadata() -> None:
    from nsa.config.fields import flag_values as flags_to_keys
    from nsa_cli.app import app

    train = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    options = {o.opts[0]: o for o in train.params if o.param_type_name == "option"}
    not_config = {"--config", "--profile", "--set", "--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint",
                  "--rdzv-id", "--help"}
    assert set(flag_keys()) == set(options) - not_config
    for flag, dotted in flag_keys().items():
        name = options[flag].name
        assert flags_to_keys(**{name.rstrip("_"): 1}) == {dotted: 1}
        assert key_flags()[dotted] == flag
        # the help starts with the key that --set would name, then the field's own description
        assert (options[flag].help or "").startswith(f"{dotted}: "), (flag, options[flag].help)
        assert len((options[flag].help or "").split(": ", 1)[1]) > 3, (flag, options[flag].help)


def test_moved_keys_are_read_with_one_note_each(tmp_path: Path) -> None:
    r = load_run_config("tiny", environ={}, sets=["train.lr=0.01", "train.save_every=5", "eval.every=0"])
    assert r.config.optimizer.lr == 0.01 and r.config.checkpoint.every == 5
    assert r.sources["optimizer.lr"] == "--set train.lr" and r.sources["checkpoint.every"] == "--set train.save_every"
    assert r.notes == [
        "--set train.lr: train.lr is deprecated, use optimizer.lr (the old key is read until 2027-03-01)",
        "--set train.save_every: train.save_every is deprecated, use checkpoint.every (the old key is read until "
        "2027-03-01)"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"train": {"steps": 9, "log_every": 3, "eval_every": 0, "warmup_steps": 1}}))
    r = load_run_config(old, environ={})
    assert (r.config.logging.every, r.config.eval.every, r.config.schedule.warmup_steps) == (3, 0, 1)
    assert len(r.notes) == 3 and all(n.startswith("config old.yaml: train.") for n in r.notes)
    both = load_run_config("tiny", environ={}, sets=["train.lr=0.5", "optimizer.lr=0.25"])
    assert both.config.optimizer.lr == 0.25  # the later --set wins, as for any key
    old.write_text(yaml.safe_dump({"train": {"lr": 0.5}, "optimizer": {"lr": 0.25}}))
    same_file = load_run_config(old, environ={})  # in one file today's key wins, and a line says so
    assert same_file.config.optimizer.lr == 0.25 and "train.lr=0.5 ignored: optimizer.lr=0.25 is also set" in same_file.notes[0]
    with pytest.raises(ConfigError, match=r"optimizer\.lr=True: .*not a boolean"):
        load_run_config("tiny", environ={}, sets=["train.lr=true"])


def test_a_saved_config_of_the_previous_release_loads(tmp_path: Path) -> None:
    """A run's config.yaml written before the split (every field dumped, window_backend and the fault field
    included) still loads, silently: nsa sample, eval and report read old runs."""
    old = RunConfig().model_dump(mode="json")
    for section in ("optimizer", "schedule", "checkpoint", "logging", "eval"):
        del old[section]
    old["train"].update(lr=0.002, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, warmup_steps=10,
                        min_lr_ratio=0.1, save_every=50, keep_last=3, eval_every=50, eval_batches=4, log_every=5,
                        heartbeat_every=None, mfu_peak_tflops=None, fault_nan_at_step=None)
    old["runtime"]["window_backend"] = "flash"
    cfg = saved_run_config(old)
    assert cfg.optimizer.lr == 0.002 and cfg.checkpoint.every == 50 and cfg.eval.batches == 4
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**old, "runtime": {**old["runtime"], "window_backend": "auto"}}))
    r = load_run_config(path, environ={})  # the saved config given as --config: mapped, one note per key
    assert r.config.logging.every == 5 and len(r.notes) == 16
    assert any("runtime.window_backend=auto dropped" in n for n in r.notes)
    assert any("train.fault_nan_at_step=null dropped" in n for n in r.notes)


@pytest.mark.parametrize(("item", "needle"), [
    ("runtime.window_backend=flash", "runtime.attn_backend"),
    ("train.fault_nan_at_step=3", "step_hook"),
])
def test_removed_keys_asking_for_something_are_refused(item: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_run_config("tiny", environ={}, sets=[item])
    message = err.value.one_line()
    assert item.split("=")[0] in message and needle in message and "\n" not in message
    assert set(REMOVED_KEYS) == {"runtime.window_backend", "train.fault_nan_at_step"}


def test_the_removed_variable_is_named_with_its_replacement() -> None:
    text = describe_unknown("NSA_WINDOW_BACKEND", "flash")
    assert text.startswith("NSA_WINDOW_BACKEND=flash (removed: ") and "NSA_ATTN_BACKEND" in text
    r = load_run_config("tiny", environ={"NSA_WINDOW_BACKEND": "triton"})
    assert r.unknown_env == ["NSA_WINDOW_BACKEND"] and "removed" in r.unknown_env_described[0]


def test_the_cli_records_each_origin_as_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import nsa.train.trainer
    from nsa_cli.app import app

    seen = {}

    class Stop(nsa.train.trainer.Trainer):  # type: ignore[misc, name-defined]
        def __init__(self, resolved, **_: object) -> None:
            seen["sources"] = resolved.sources
            raise ConfigError("stopped before any work")

    monkeypatch.setattr(nsa.train.trainer, "Trainer", Stop)
    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--no-compile", "--lr", "0.01", "--dataset", "embedded",
                                   "--set", "train.log_every=2", "-o", str(tmp_path / "r")], env={"NSA_SEED": "3"})
    assert res.exit_code == 2 and "stopped before any work" in res.stderr
    assert {k: seen["sources"][k] for k in ("runtime.compile", "optimizer.lr", "data.source", "logging.every",
                                             "train.out_dir", "train.seed")} == {
        "runtime.compile": "flag --no-compile", "optimizer.lr": "flag --lr", "data.source": "flag --dataset",
        "logging.every": "--set train.log_every", "train.out_dir": "flag --out-dir", "train.seed": "env NSA_SEED"}
