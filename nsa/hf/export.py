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
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nsa.config import RunConfig
from nsa.data.tokenizers import get_tokenizer
from nsa.errors import NSAError, RunDirError
from nsa.fileio import free_space, named, nearest_existing, os_error_in, write_failure
from nsa.hf.format import (
    CONFIG_JSON,
    FORMAT_VERSION,
    GENERATION_CONFIG,
    MODELING,
    REEXPORT_HINT,
    WEIGHTS,
    WEIGHTS_SHA256,
    from_hf_name,
    hf_config,
    read_config_json,
    run_config,
    to_hf_name,
)
from nsa.hf.tokenizer import tokenizer_files
from nsa.model.lm import NSALM
from nsa.model.load import fit_init_weights, read_state
from nsa.rundir.checkpoints import check_sha256, sha256_file
from nsa.rundir.layout import RUN_PARTS, is_run_dir
from nsa.view import Block, Line, Result

MODELING_SOURCE = Path(__file__).with_name(MODELING)

README = """# {name}

An NSA (Native Sparse Attention) language model exported by `nsa export --format hf` \
(format version {version}).

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
class HFExport(Result):
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

    def view(self) -> list[Block]:
        return [Line(f"exported {self.out} (Hugging Face format, version {self.format_version}): "
                     f"{self.parameters:,} parameters ({self.dtype}), tokenizer {self.tokenizer}, from "
                     f"{self.source}", "good", lead=8),
                Line(f"  load it: AutoModelForCausalLM.from_pretrained({str(self.out)!r}, "
                     "trust_remote_code=True)")]


def _inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies under it (both resolved)."""
    return path == folder or folder in path.parents


def _run_dirs_under(folder: Path) -> Path | None:
    """The first run directory at or under ``folder`` (None when it holds none)."""
    for root, _dirs, _files in os.walk(folder):
        if is_run_dir(root):
            return Path(root)
    return None


def check_out(out: Path, overwrite: bool, reads: list[Path]) -> None:
    """``RunDirError`` when ``out`` cannot take an export: a file, a path under a file, a folder that holds
    what the export reads (``reads``), a run directory or a part of one (``checkpoints/``, ``export/``, ...),
    or a non-empty folder that is not an earlier export (``overwrite`` replaces only those)."""
    hint = "give a new folder outside the run, e.g. artifacts/NAME-hf"
    p = nearest_existing(out)
    if p.exists() and not p.is_dir():
        raise RunDirError(f"cannot write {out}: {p} is a file, not a folder",
                          hint="give a folder path for OUT")
    target = out.resolve()
    for src in reads:
        if _inside(src.resolve(), target):
            raise RunDirError(f"{out} holds what the export reads ({src}); an export never replaces its "
                              "source", hint=hint)
    # RUN/hf (checkpoint.export_hf) or a new folder in a run, never its own parts
    for parent in target.parents:
        part = target.relative_to(parent).parts[0]
        if part in RUN_PARTS and is_run_dir(parent):
            raise RunDirError(f"{out} is part of the run directory {parent} ({part}/)", hint=hint)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if is_run_dir(out):
        raise RunDirError(f"{out} is a run directory; an export never replaces one", hint=hint)
    if not overwrite:
        raise RunDirError(f"{out} exists and is not empty", hint="give a new folder, or --overwrite to "
                          "replace an earlier export")
    run = _run_dirs_under(out)
    if run is not None:
        raise RunDirError(f"{out} holds the run directory {run}; --overwrite replaces only an earlier export",
                          hint=hint)
    if not is_hf_folder(out):
        raise RunDirError(f"{out} is not an earlier export (no {CONFIG_JSON}); --overwrite replaces only one",
                          hint="give a new folder, or empty this one yourself")


def _write_failure(exc: BaseException, out: Path) -> RunDirError:
    """One line for a write that failed (a read-only filesystem, missing permissions, a full disk)."""
    disk = exc if isinstance(exc, OSError) else os_error_in(exc)
    if disk is not None:
        return RunDirError(write_failure(named(disk, out)), hint="free disk space or choose a writable OUT")
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__  # safetensors' SafetensorError:
    # IoError(Os { ..., message: ".." })
    why = m.group(1) if (m := re.search(r'message: "([^"]+)"', text)) else text
    space = " (" + free + ")" if (free := free_space(out)) else ""
    return RunDirError(f"cannot write {out}: {why}{space}", hint="free disk space or choose a writable OUT")


def export_hf(source: str | Path, out: str | Path, *, overwrite: bool = False) -> HFExport:
    """Write the model at ``source`` (a run directory, its ``export/``, a checkpoint) to ``out`` in Hugging
    Face format. ``overwrite`` replaces an earlier export at ``out`` (never a run, nor what the export
    reads)."""
    out = Path(out)
    check_out(out, overwrite, [Path(source)])
    state, cfg, weights = read_state(source)
    check_out(out, overwrite, [Path(source), weights])
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

    tag = f"{os.getpid()}-{time.time_ns()}"
    tmp, old = out.parent / f".{out.name}.export-tmp-{tag}", out.parent / f".{out.name}.export-old-{tag}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        save_file(tensors, str(tmp / WEIGHTS),
                  metadata={"format": "pt", "nsa_format_version": str(FORMAT_VERSION)})
        config[WEIGHTS_SHA256] = sha256_file(tmp / WEIGHTS)
        (tmp / CONFIG_JSON).write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp / WEIGHTS, (tmp / CONFIG_JSON).stat().st_mode & 0o777)  # safetensors writes 0600
        (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        for name, text in tok_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        shutil.copyfile(MODELING_SOURCE, tmp / MODELING)
        (tmp / "README.md").write_text(README.format(name=out.name, version=FORMAT_VERSION))
        if out.exists():
            os.replace(out, old)  # the earlier export, back in place if the last step fails
        try:
            os.replace(tmp, out)
        except BaseException:
            if old.exists():
                os.replace(old, out)
            raise
    except NSAError:
        raise
    except Exception as exc:  # OSError, SafetensorError: one line naming OUT; nothing half-written
        raise _write_failure(exc, out) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
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
    data = read_config_json(folder)
    cfg = run_config(data)
    want = data.get(WEIGHTS_SHA256)  # exports written before it was recorded have none
    check_sha256(folder / WEIGHTS, want if isinstance(want, str) else None, folder / CONFIG_JSON,
                 hint=REEXPORT_HINT)
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
