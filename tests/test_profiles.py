"""Hardware profiles: shipped set, validation, NSA_* mapping and precedence."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from nsa.config import load_run_config
from nsa.config.profiles import list_profiles, load_profile, profile_names
from nsa.config.settings import ENV_TO_CONFIG
from nsa.errors import ConfigError

REQUIRED = {"cpu", "a100-40g", "a100-80g", "h100-80g", "h200-141g", "rtx4090-24g", "rtx3090-24g"}


def test_shipped_profiles_load_and_resolve() -> None:
    assert set(profile_names()) >= REQUIRED
    for prof in list_profiles():
        assert prof.description and prof.path
        overlay = prof.config_overlay()
        for field in prof.settings:
            section, key = ENV_TO_CONFIG[field].split(".")
            assert overlay[section][key] == prof.settings[field]
        resolved = load_run_config(prof.smoke.config, profile=prof.name, environ={}, sets=prof.smoke.sets)
        assert resolved.profile == prof.name
        assert any(src == f"profile {prof.name}" for src in resolved.sources.values())
        if prof.expect.device == "cuda":
            assert prof.expect.gpu_name_pattern and prof.expect.min_memory_gib and prof.expect.gpu_count >= 1
            assert resolved.config.runtime.device == "cuda"


def write_profile(tmp_path: Path, **body: object) -> Path:
    p = tmp_path / f"p{random.randrange(10**6)}.yaml"
    p.write_text(yaml.safe_dump({"name": "custom", **body}))
    return p


def test_settings_accept_env_names_and_field_names(tmp_path: Path) -> None:
    depth = random.randint(1, 64)
    p = write_profile(tmp_path, settings={"NSA_PREFETCH_DEPTH": depth, "grad_ckpt": True, "NSA_ALLOC_CONF": "expandable_segments:True"})
    prof = load_profile(p)
    assert prof.settings == {"prefetch_depth": depth, "grad_ckpt": True, "alloc_conf": "expandable_segments:True"}
    assert prof.env()["NSA_PREFETCH_DEPTH"] == str(depth) and prof.env()["NSA_GRAD_CKPT"] == "true"
    assert prof.config_overlay() == {"data": {"prefetch_depth": depth},
                                     "runtime": {"gradient_checkpointing": True, "alloc_conf": "expandable_segments:True"}}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"settings": {"NSA_PREFETCH_DEPTHH": 3}}, "unknown setting"),
        ({"settings": {"NSA_ATTN_BACKEND": "cuda-magic"}}, "NSA_ATTN_BACKEND"),
        ({"settings": {"NSA_BATCH_SIZE": 2}, "train": {"batch_size": 4}}, "both set"),
        ({"expect": {"gpu_name_pattern": "A100("}}, "regular expression"),
        ({"expect": {"gpu_count": -1}}, "gpu_count"),
        ({"smokes": {}}, "smokes"),
    ],
)
def test_invalid_profiles_name_the_problem(tmp_path: Path, body: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_profile(write_profile(tmp_path, **body))


def test_unknown_profile_lists_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_profile("no-such-gpu")
    assert "cpu" in (info.value.hint or "")


def test_precedence_flags_env_profile_config_defaults(tmp_path: Path) -> None:
    a, b, c = random.sample(range(2, 60), 3)
    p = write_profile(tmp_path, settings={"NSA_PREFETCH_DEPTH": a, "NSA_PRECISION": "bf16"}, train={"seq_len": 64, "accum": 3})
    # profile beats config (tiny sets seq_len 128), defaults fill the rest
    r = load_run_config("tiny", profile=str(p), environ={})
    assert r.config.data.prefetch_depth == a and r.source_of("data.prefetch_depth") == "profile custom"
    assert r.config.train.seq_len == 64 and r.source_of("train.seq_len") == "profile custom"
    assert r.config.optimizer.lr == 3e-3 and r.source_of("optimizer.lr") == "config tiny.yaml"
    assert r.source_of("optimizer.beta1") == "default"
    # the environment beats the profile
    r = load_run_config("tiny", profile=str(p), environ={"NSA_PREFETCH_DEPTH": str(b)})
    assert r.config.data.prefetch_depth == b and r.source_of("data.prefetch_depth") == "env NSA_PREFETCH_DEPTH"
    assert r.config.runtime.precision == "bf16"
    # flags beat the environment
    r = load_run_config("tiny", profile=str(p), environ={"NSA_PREFETCH_DEPTH": str(b)}, flags={"data.prefetch_depth": c})
    assert r.config.data.prefetch_depth == c and r.source_of("data.prefetch_depth").startswith("flag")


def test_profile_from_environment_and_unknown_variables() -> None:
    r = load_run_config("tiny", environ={"NSA_PROFILE": "cpu", "NSA_PREFTECH_DEPTH": "3"})
    assert r.profile == "cpu" and r.config.runtime.attn_backend == "torch"
    assert r.unknown_env == ["NSA_PREFTECH_DEPTH"]
