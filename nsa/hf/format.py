"""The Hugging Face folder format: its files, ``config.json`` from a run config and back, and the weight
names.

One place holds each fact of the format: the file names, the format version (``FORMAT_VERSION``, equal to the
remote code's ``modeling_nsa.FORMAT_VERSION``), the mapping between the run config's ``model``/``nsa``
sections and ``config.json``, and the mapping between the ``nsa`` model's parameter names and transformers'
(``tok_emb`` <-> ``model.embed_tokens``, ``blocks.N.attn`` <-> ``model.layers.N.self_attn``, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from nsa.config import RunConfig, saved_run_config
from nsa.errors import RunDirError

FORMAT_VERSION = 1
CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
MODELING = "modeling_nsa.py"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# config.json's record of model.safetensors' SHA-256 (read_hf checks it)
WEIGHTS_SHA256 = "nsa_weights_sha256"
REQUIRED_FILES = (CONFIG_JSON, WEIGHTS, MODELING, TOKENIZER_JSON, TOKENIZER_CONFIG)
MODEL_TYPE = "nsa"
AUTO_MAP = {
    "AutoConfig": "modeling_nsa.NSAConfig",
    "AutoModel": "modeling_nsa.NSAModel",
    "AutoModelForCausalLM": "modeling_nsa.NSAForCausalLM",
}
REEXPORT_HINT = "export the run again: nsa export RUN --format hf OUT"

# run config `model.*` -> config.json (transformers' names where one exists)
MODEL_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_groups": "num_key_value_heads",
    "d_k": "head_dim",
    "d_v": "v_head_dim",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
    "attention": "attention",
    "dense_layers": "dense_layers",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}
# run config `nsa.*` carried in config.json's "nsa" object (gate_init is input only; collapse_threshold is a
# training statistic). A config.json without `window_query`/`kv_speed` (written before they existed) reads as
# the paper's layer (False, 1.0): `saved_run_config` fills them from `LEGACY_DEFAULTS`,
# `modeling_nsa.NSAConfig`
# from its own defaults. With `kv_speed`, model.safetensors holds `kv_proj.weight` as stored (its compressed
# and
# selected rows divided by kv_speed); the layer multiplies them back.
NSA_KEYS = ("l", "d", "l_sel", "n_sel", "w", "phi", "gate", "shared_kv", "gate_hidden", "gate_bias",
            "gate_scale", "fixed_gates", "window_query", "kv_speed")


def hf_config(cfg: RunConfig, *, eot_id: int, tokenizer: str, source: str | None = None) -> dict[str, Any]:
    """``config.json`` for the model of ``cfg`` (read by ``modeling_nsa.NSAConfig``)."""
    m, n = cfg.model.model_dump(mode="json"), cfg.nsa.model_dump(mode="json")
    out: dict[str, Any] = {
        "architectures": ["NSAForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "model_type": MODEL_TYPE,
        "nsa_format_version": FORMAT_VERSION,
        **{hf: m[key] for key, hf in MODEL_KEYS.items()},
        "intermediate_size": cfg.model.ffn_hidden,
        "nsa": {k: n[k] for k in NSA_KEYS},
        "nsa_impl": "auto",
        "nsa_ops_backend": cfg.runtime.attn_backend,
        "nsa_tokenizer": tokenizer,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": eot_id,
        "torch_dtype": "float32",
    }
    if source is not None:
        out["nsa_source"] = source
    return out


def read_config_json(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` of an NSA export, checked: a JSON object of this format version."""
    path = folder / CONFIG_JSON
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}", hint=REEXPORT_HINT) from None
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        raise RunDirError(f"{path} is not an NSA model's config (model_type {data.get('model_type')!r}, "
                          f"expected {MODEL_TYPE!r})" if isinstance(data, dict)
                          else f"{path} is not a JSON object",
                          hint="give a folder written by nsa export --format hf")
    version = data.get("nsa_format_version")
    if version != FORMAT_VERSION:
        raise RunDirError(f"{path} is NSA format version {version}; this nsa reads version {FORMAT_VERSION}",
                          hint="export the run again with this nsa version (nsa export RUN --format hf OUT)")
    return data


def run_config(data: dict[str, Any]) -> RunConfig:
    """The run config (model, nsa, runtime backend, tokenizer) that ``config.json`` describes."""
    model = {key: data[hf] for key, hf in MODEL_KEYS.items() if hf in data}
    model["mlp_hidden"] = data.get("intermediate_size")
    tree: dict[str, Any] = {"model": model,
                            "nsa": {k: v for k, v in (data.get("nsa") or {}).items() if k in NSA_KEYS}}
    if data.get("nsa_ops_backend"):
        tree["runtime"] = {"attn_backend": data["nsa_ops_backend"]}
    if data.get("nsa_tokenizer") in ("byte", "gpt2"):
        tree["data"] = {"tokenizer": data["nsa_tokenizer"]}
    tree["train"] = {"seq_len": min(2048, int(model.get("max_seq_len") or 2048))}
    return saved_run_config(tree)


# parameter names: nsa model <-> transformers
_TO_HF = (
    (re.compile(r"^tok_emb\.weight$"), "model.embed_tokens.weight"),
    (re.compile(r"^norm\.weight$"), "model.norm.weight"),
    (re.compile(r"^head\.weight$"), "lm_head.weight"),
    (re.compile(r"^blocks\.(\d+)\.attn_norm\.weight$"), r"model.layers.\1.input_layernorm.weight"),
    (re.compile(r"^blocks\.(\d+)\.mlp_norm\.weight$"), r"model.layers.\1.post_attention_layernorm.weight"),
    (re.compile(r"^blocks\.(\d+)\.mlp\.(gate|up|down)\.weight$"), r"model.layers.\1.mlp.\2_proj.weight"),
    (re.compile(r"^blocks\.(\d+)\.attn\.(.+)$"), r"model.layers.\1.self_attn.\2"),
)
_FROM_HF = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "tok_emb.weight"),
    (re.compile(r"^model\.norm\.weight$"), "norm.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.input_layernorm\.weight$"), r"blocks.\1.attn_norm.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$"), r"blocks.\1.mlp_norm.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$"), r"blocks.\1.mlp.\2.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$"), r"blocks.\1.attn.\2"),
)


def _rename(name: str, rules: tuple[tuple[re.Pattern[str], str], ...], what: str) -> str:
    for pattern, repl in rules:
        if pattern.match(name):
            return pattern.sub(repl, name)
    raise RunDirError(f"weight {name!r} has no {what} name", hint=REEXPORT_HINT)


def to_hf_name(name: str) -> str:
    """``blocks.0.attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.weight`` (and so on)."""
    return _rename(name, _TO_HF, "transformers")


def from_hf_name(name: str) -> str:
    """The inverse of :func:`to_hf_name`."""
    return _rename(name, _FROM_HF, "nsa")
