"""``nsa profiles list|show``: sources of every value, precedence, unknown NSA_* warning."""

from __future__ import annotations

import json
import random

from typer.testing import CliRunner

from nsa_cli.app import app
from tests.conftest import clean_env, nsa

runner = CliRunner()


def test_list_json_and_table() -> None:
    res = runner.invoke(app, ["profiles", "list", "--json"])
    assert res.exit_code == 0
    names = {p["name"] for p in json.loads(res.stdout)}
    assert {"cpu", "a100-40g", "a100-80g", "h100-80g", "h200-141g", "rtx4090-24g", "rtx3090-24g"} <= names
    res = nsa("profiles", "list")
    assert res.returncode == 0 and "h200-141g" in res.stdout


def test_show_reports_sources_with_precedence() -> None:
    depth = random.randint(20, 99)
    res = runner.invoke(app, ["profiles", "show", "h100-80g", "--config", "m7c-125m", "--json"],
                        env={"NSA_PREFETCH_DEPTH": str(depth), "NSA_ATTN_BACKEND": None})
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["key"]: r for r in data["resolved"]}
    assert rows["data.prefetch_depth"] == {"key": "data.prefetch_depth", "value": depth, "source": "env NSA_PREFETCH_DEPTH"}
    assert rows["runtime.attn_backend"]["source"] == "profile h100-80g"
    assert rows["train.steps"]["source"] == "config m7c-125m.yaml"
    assert data["env"]["NSA_ATTN_BACKEND"] == "triton"


def test_show_warns_on_unknown_variable_and_rejects_unknown_profile() -> None:
    res = nsa("profiles", "show", "cpu", env=clean_env(NSA_PREFETH_DEPTH="4"))
    assert res.returncode == 0
    assert "NSA_PREFETH_DEPTH" in res.stderr and "warning" in res.stderr
    assert "profile cpu" in res.stdout
    res = runner.invoke(app, ["profiles", "show", "tpu-v9"])
    assert res.exit_code == 2 and "profile 'tpu-v9' not found" in res.output
