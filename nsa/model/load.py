"""Loading a trained model for inference: from a run directory's ``export/`` or its newest checkpoint."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from nsa.config import RunConfig, saved_run_config
from nsa.errors import CheckpointError, RunDirError
from nsa.model.attention import NSAAttention
from nsa.model.lm import NSALM, build_model
from nsa.rundir.checkpoints import (
    STATE_FILE,
    check_state_format,
    check_weights,
    newest_verified,
    step_of,
    strip_prefixes,
    verify,
)
from nsa.rundir.layout import CONFIG_FILE, EXPORT_WEIGHTS, RunDir


@dataclass
class LoadedModel:
    """A model ready for ``generate``, its run config and the file it came from."""

    model: NSALM
    config: RunConfig
    source: Path


def _read_config(path: Path) -> RunConfig:
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from None
    if not isinstance(tree, dict):
        raise RunDirError(f"{path} is not a run config (a mapping of sections)")
    return saved_run_config(tree)


def find_weights(path: str | Path) -> tuple[Path, Path | None]:
    """``(weights, config.yaml or None)`` for a run directory, an ``export/`` folder, a checkpoint
    folder, a ``model.safetensors`` or a ``state.pt``. Exports win over checkpoints; of a run's
    checkpoints the newest that verifies (complete, checksums equal) is taken. The file is checked against
    the SHA-256 its checkpoint manifest or ``export.json`` records, each file hashed once
    (``CheckpointError``)."""
    p = Path(path)
    if not p.exists():
        raise RunDirError(f"{p} does not exist",
                          hint="give a run directory (e.g. artifacts/tiny) or a checkpoint")
    if p.is_file():
        if p.suffix == ".safetensors":
            cfg = p.parent / CONFIG_FILE
            if not cfg.is_file():
                raise RunDirError(f"{p} has no {CONFIG_FILE} next to it")
            check_weights(p)
            return p, cfg
        if p.suffix == ".pt":
            check_weights(p)
            return p, None
        raise RunDirError(f"{p} is neither a {EXPORT_WEIGHTS} nor a {STATE_FILE}")
    for folder in (RunDir(p).export, p):
        if (folder / EXPORT_WEIGHTS).is_file() and (folder / CONFIG_FILE).is_file():
            check_weights(folder / EXPORT_WEIGHTS)
            return folder / EXPORT_WEIGHTS, folder / CONFIG_FILE
    if (p / STATE_FILE).is_file():
        verdict = verify(p)  # hashes every file of the folder against its manifest
        if step_of(p) >= 0 and not verdict.ok:
            raise CheckpointError(f"checkpoint {p} is not usable: {verdict.reason}",
                                  hint="give the run directory to take its newest checkpoint that verifies")
        if not verdict.ok:  # a folder of another name: its manifest's digest, where it records one
            check_weights(p / STATE_FILE)
        return p / STATE_FILE, None
    newest, skipped = newest_verified(p)
    if newest is not None:
        return newest / STATE_FILE, None
    if skipped:
        raise CheckpointError(f"{p} has no checkpoint that verifies (newest: {skipped[0].path.name}, "
                              f"{skipped[0].reason})")
    raise RunDirError(
        f"{p} has no export/{EXPORT_WEIGHTS} and no checkpoints/step_*/{STATE_FILE}",
        hint="train first (nsa train ...) or give the path of a checkpoint",
    )


def _with_tied(state: dict[str, torch.Tensor], cfg: RunConfig) -> dict[str, torch.Tensor]:
    """``state`` with every name of a shared parameter (tied embedding and head): safetensors stores a
    shared tensor once, under one of its names."""
    with torch.device("meta"):
        model = build_model(cfg)
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    out = dict(state)
    for names in shared.values():
        have = [n for n in names if n in out]
        for n in names if have else []:
            out.setdefault(n, out[have[0]])
    return out


def _read(path: str | Path) -> tuple[dict[str, torch.Tensor], RunConfig, Path]:
    """``(state dict on the CPU, its run config, its file)`` for anything :func:`find_weights` takes; the file
    matches the SHA-256 its checkpoint manifest or ``export.json`` records (:func:`find_weights`)."""
    weights, cfg_path = find_weights(path)
    if weights.suffix == ".safetensors":
        assert cfg_path is not None
        cfg = _read_config(cfg_path)
        try:
            tensors = load_file(str(weights))
        except Exception as exc:
            raise CheckpointError(f"cannot read {weights}: {exc}") from None
        return _with_tied(tensors, cfg), cfg, weights
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {weights}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "config" not in state:
        raise CheckpointError(f"{weights} has no 'model' and 'config' entries (a sharded checkpoint keeps "
                              "its weights beside them)", hint="give the run directory or its export/ folder")
    check_state_format(state, weights)
    return strip_prefixes(state["model"]), saved_run_config(state["config"]), weights


def read_state(path: str | Path) -> tuple[dict[str, torch.Tensor], RunConfig, Path]:
    """``(state dict on the CPU, its run config, its file)`` for anything :func:`find_weights` takes (every
    name of a tied tensor present)."""
    return _read(path)


def check_fits(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path,
               fresh: Collection[str] = ()) -> None:
    """A ``CheckpointError`` naming the first difference when ``state`` does not fit ``model`` exactly
    (``fresh``: the model's keys that may be missing from ``state``)."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in fresh}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    missing, extra = sorted(own.keys() - theirs.keys()), sorted(theirs.keys() - own.keys())
    hint = "train with the same model section as the run the weights come from"
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which this model does not"
        raise CheckpointError(f"the weights of {source} do not fit this model: it {what}", hint=hint)
    for k, shape in own.items():
        if theirs[k] != shape:
            raise CheckpointError(f"the weights of {source} do not fit this model: {k} is {list(theirs[k])} "
                                  f"there, {list(shape)} here", hint=hint)


def dense_to_nsa(state: dict[str, torch.Tensor], model: NSALM) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A dense model's weights for the NSA ``model`` of the same model section (the dense warm-start):
    every shared weight copied, each layer's key/value projection copied into every NSA branch (cmp, sel,
    win; :func:`adapt_layer_options` then stores the rows for ``kv_speed`` and starts the window's own query
    from the dense one), and the NSA-only parameters (gate MLP, compression MLP) left to the model's own
    initialisation.
    Returns ``(state, the fresh keys)``."""
    out: dict[str, torch.Tensor] = {}
    fresh: list[str] = []
    for key, mine in model.state_dict().items():
        theirs = state.get(key)
        if theirs is not None and theirs.shape == mine.shape:
            out[key] = theirs
        elif (theirs is not None and key.endswith("attn.kv_proj.weight")
              and mine.shape[0] % theirs.shape[0] == 0):
            out[key] = torch.cat([theirs] * (mine.shape[0] // theirs.shape[0]))  # NSA rows: [cmp | sel | win]
        elif theirs is None and (".gate_mlp." in key or ".compress." in key):
            fresh.append(key)
        elif theirs is None and key.endswith("attn.q_win_proj.weight"):
            continue  # the dense query (adapt_layer_options)
        else:
            out[key] = theirs if theirs is not None else mine  # check_fits names the mismatch
    out.update({k: v for k, v in state.items() if k not in out and k not in fresh})
    return out, fresh


def adapt_layer_options(state: dict[str, torch.Tensor], cfg: RunConfig, model: NSALM) -> dict[str,
    torch.Tensor]:
    """``state`` (trained with ``cfg``) for ``model``'s NSA layer options, the function kept: a missing
    ``q_win_proj`` starts as the layer's ``q_proj`` (what the window branch read before), and the
    compressed and selected rows of ``kv_proj`` are rescaled from the source's ``kv_speed`` to the model's
    (stored rows are W / kv_speed; a dense source's rows are W)."""
    src = 1.0 if cfg.model.attention == "dense" or cfg.nsa.shared_kv else cfg.nsa.kv_speed
    out = dict(state)
    for i, block in enumerate(model.block_list()):
        attn = block.attn
        if not isinstance(attn, NSAAttention):
            continue
        pre = f"blocks.{i}.attn."
        if (attn.q_win_proj is not None and pre + "q_win_proj.weight" not in out
                and pre + "q_proj.weight" in out):
            out[pre + "q_win_proj.weight"] = out[pre + "q_proj.weight"].clone()
        kv = out.get(pre + "kv_proj.weight")
        if kv is not None and attn.kv_speed != src and kv.shape[0] == attn.kv_proj.weight.shape[0]:
            out[pre + "kv_proj.weight"] = kv * (attn.kv_row_gain(src)
                                                / attn.kv_row_gain(attn.kv_speed)).to(kv.dtype)
    return out


def read_init_weights(path: str | Path, model: NSALM) -> tuple[dict[str, torch.Tensor], Path, list[str]]:
    """``train.init_from``: the weights at ``path`` checked against ``model`` (may be on the meta device), the
    file, and the keys ``model`` keeps from its own initialisation. The same architecture must fit exactly;
    a dense run's weights into an NSA model go through :func:`dense_to_nsa`."""
    state, cfg, source = _read(path)
    return fit_init_weights(state, cfg, source, model)


def fit_init_weights(state: dict[str, torch.Tensor], cfg: RunConfig, source: Path,
                     model: NSALM) -> tuple[dict[str, torch.Tensor], Path, list[str]]:
    """:func:`read_init_weights` for weights already read (``cfg``: the run config they were trained with)."""
    fresh: list[str] = []
    if cfg.model.attention == "dense" and model.model_cfg.attention == "nsa":
        state, fresh = dense_to_nsa(state, model)
    if model.model_cfg.attention == "nsa":
        state = adapt_layer_options(state, cfg, model)
    check_fits(model, state, source, fresh)
    return state, source, fresh


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Build the run's model and load its weights (eval mode, on ``device`` in ``dtype``)."""
    state, cfg, weights = _read(path)
    model = build_model(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{weights} does not match its config: {exc}") from None
    model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model, cfg, weights)
