"""``nsa export RUN --format hf OUT``: a trained model as a folder that ``transformers`` loads offline.

``OUT`` holds ``config.json`` (``modeling_nsa.NSAConfig``: the model and NSA fields, the format version,
``auto_map``), ``model.safetensors`` (transformers' weight names), ``tokenizer.json`` and
``tokenizer_config.json`` (:mod:`nsa.hf.tokenizer`), ``generation_config.json``, ``modeling_nsa.py`` (the
self-contained modelling code) and a short ``README.md``. It is written beside ``OUT`` and moved into place,
so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nsa.config import RunConfig
from nsa.data.tokenizers import get_tokenizer
from nsa.errors import RunDirError
from nsa.hf.format import (
    CONFIG_JSON,
    FORMAT_VERSION,
    GENERATION_CONFIG,
    MODELING,
    REEXPORT_HINT,
    WEIGHTS,
    from_hf_name,
    hf_config,
    read_config_json,
    run_config,
    to_hf_name,
)
from nsa.hf.tokenizer import tokenizer_files
from nsa.model.lm import NSALM
from nsa.model.load import fit_init_weights, read_state

MODELING_SOURCE = Path(__file__).with_name(MODELING)

README = """# {name}

An NSA (Native Sparse Attention) language model exported by `nsa export --format hf` (format version {version}).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("{name}")
model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
ids = tok("Once upon a time", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=64)[0], skip_special_tokens=True))
```

With the `nsa` package installed the model uses its kernels and decode caches; without it, a standalone
torch implementation (slow). `train.init_from={name}` starts an `nsa train` run from these weights.
"""


@dataclass
class HFExport:
    """What an export wrote."""

    out: Path
    source: Path
    format: str
    format_version: int
    files: list[str]
    tokenizer: str
    parameters: int
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"], d["source"] = str(self.out), str(self.source)
        return d


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{out} is a file", hint="give a folder to export into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise RunDirError(f"{out} exists and is not empty", hint="give a new folder, or --overwrite to replace it")


def export_hf(source: str | Path, out: str | Path, *, overwrite: bool = False) -> HFExport:
    """Write the model at ``source`` (a run directory, its ``export/``, a checkpoint) to ``out`` in Hugging Face
    format. ``overwrite`` replaces a non-empty ``out``."""
    out = Path(out)
    _check_out(out, overwrite)
    state, cfg, weights = read_state(source)
    tokenizer = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    tok_files = tokenizer_files(cfg.data, tokenizer, cfg.model.max_seq_len)
    tensors = {to_hf_name(k): v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    if cfg.model.tie_embeddings:  # stored once; the model ties lm_head to the embedding
        tensors.pop("lm_head.weight", None)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = hf_config(cfg, eot_id=tokenizer.eot_id, tokenizer=cfg.data.tokenizer, source=str(weights))
    config["torch_dtype"] = dtype
    eot = tokenizer.eot_id
    generation = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "nsa_format_version": str(FORMAT_VERSION)})
        (tmp / CONFIG_JSON).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        for name, text in tok_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        shutil.copyfile(MODELING_SOURCE, tmp / MODELING)
        (tmp / "README.md").write_text(README.format(name=out.name, version=FORMAT_VERSION))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return HFExport(out=out, source=weights, format="hf", format_version=FORMAT_VERSION,
                    files=sorted(p.name for p in out.iterdir()), tokenizer=cfg.data.tokenizer,
                    parameters=sum(v.numel() for v in tensors.values()), dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# reading an export back (train.init_from)


def is_hf_folder(path: str | Path) -> bool:
    """A folder that holds an export of this format (a ``config.json`` and no run ``config.yaml``)."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG_JSON).is_file() and not (p / "config.yaml").is_file()


def read_hf(path: str | Path) -> tuple[dict[str, torch.Tensor], RunConfig, Path]:
    """``(state dict with the nsa model's names, run config, weights file)`` of an export."""
    folder = Path(path)
    for name in (CONFIG_JSON, WEIGHTS):
        if not (folder / name).is_file():
            raise RunDirError(f"{folder} is not a complete NSA export: {name} is missing", hint=REEXPORT_HINT)
    cfg = run_config(read_config_json(folder))
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as exc:
        raise RunDirError(f"cannot read {folder / WEIGHTS}: {exc}", hint=REEXPORT_HINT) from None
    state = {from_hf_name(k): v for k, v in tensors.items()}
    if cfg.model.tie_embeddings and "tok_emb.weight" in state:
        state.setdefault("head.weight", state["tok_emb.weight"])
    return state, cfg, folder / WEIGHTS


def read_init_weights(path: str | Path, model: NSALM) -> tuple[dict[str, torch.Tensor], Path, list[str]]:
    """``train.init_from`` of an export: its weights checked against ``model`` (as for a run directory)."""
    state, cfg, source = read_hf(path)
    return fit_init_weights(state, cfg, source, model)
