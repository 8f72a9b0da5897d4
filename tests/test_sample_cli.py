"""``nsa sample`` on a tiny run directory built here (export and checkpoint forms)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nsa.config import load_named
from nsa.data.tokenizers import get_tokenizer
from nsa.model import build_model
from nsa_cli.app import app


def _tiny_run(tmp_path: Path, export: bool = True) -> tuple[Path, torch.nn.Module]:
    cfg = load_named("tiny")
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layers": 1, "tie_embeddings": True})})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    run = tmp_path / "run"
    if export:
        from safetensors.torch import save_model

        (run / "export").mkdir(parents=True)
        save_model(model, str(run / "export" / "model.safetensors"))
        (run / "export" / "config.yaml").write_text(cfg.to_yaml())
    else:
        from nsa.train.checkpoint import save_checkpoint

        save_checkpoint(run, 5, {"model": model.state_dict(), "config": cfg.model_dump(mode="json")})
    return run, model


def _expected(model: torch.nn.Module, prompt: str, n: int) -> str:
    tok = get_tokenizer("byte")
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, n)
    return tok.decode(out[0, ids.shape[1] :].tolist())


@pytest.mark.parametrize("export", [True, False])
def test_sample_prints_greedy_continuation(tmp_path: Path, export: bool) -> None:
    run, model = _tiny_run(tmp_path, export)
    res = CliRunner().invoke(app, ["sample", str(run), "--prompt", "Hello", "--max-new-tokens", "24",
                                   "--temperature", "0", "--no-stop-at-eot", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert res.stdout == _expected(model, "Hello", 24) + "\n"
    assert "1 prompt tokens" not in res.stderr and "5 prompt tokens" in res.stderr


def test_sample_seeded_is_reproducible(tmp_path: Path) -> None:
    """The same --seed gives the same text; another seed (4 instead of 3) other text: the seed is what sets it."""
    run, _ = _tiny_run(tmp_path)
    args = ["sample", str(run), "--prompt", "ab", "-n", "16", "--temperature", "1.0", "--seed", "3", "--top-k", "20",
            "--device", "cpu"]
    a, b = CliRunner().invoke(app, args), CliRunner().invoke(app, args)
    assert a.exit_code == 0 and a.stdout == b.stdout
    c = CliRunner().invoke(app, [*args[:-5], "4", *args[-4:]])
    assert c.exit_code == 0 and len(c.stdout) > 1 and c.stdout != a.stdout


def test_sample_bad_path_is_one_line_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["sample", str(tmp_path / "nope"), "--prompt", "x"])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(app, ["sample", str(tmp_path / "empty"), "--prompt", "x"])
    assert res.exit_code == 2 and "no export/model.safetensors" in res.stderr
