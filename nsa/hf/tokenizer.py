"""The tokenizer of an export as Hugging Face files (``tokenizer.json`` + ``tokenizer_config.json``), written
without the ``tokenizers`` library and without the network.

- ``byte``: a byte-level BPE with no merges over the 256 byte symbols of GPT-2's byte-to-unicode table, so
  token ``i`` is byte ``i``; NUL characters are removed first (``nsa``'s rule: byte 0 separates documents),
  and id 0 is the special token ``<|endoftext|>`` (so ``skip_special_tokens`` decoding drops it as ``nsa``
  does).
- ``gpt2`` from tiktoken's cached files: GPT-2's own vocabulary and merges (the same files tiktoken reads).
- ``gpt2`` with ``data.tokenizer_path``: that folder's ``tokenizer.json``, copied.

``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` and the end-of-text token as eos, bos and pad
(padding on the left, as generation wants).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from nsa.config import DataConfig
from nsa.data.tokenizers import GPT2_FILES, GPT2_HINT, HFTokenizer, Tokenizer, gpt2_cached, tiktoken_cache_dir
from nsa.errors import DataError

EOT = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE works on)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"),
        ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _added(token_id: int, content: str) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _bpe(vocab: dict[str, int], merges: list[str]) -> dict[str, Any]:
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
            "merges": merges}


def byte_tokenizer_json() -> dict[str, Any]:
    """``tokenizer.json`` of ``nsa``'s byte tokenizer (ids = UTF-8 bytes, NUL removed, id 0 end of text)."""
    table = bytes_to_unicode()
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(0, EOT)],
        "normalizer": {"type": "Replace", "pattern": {"String": "\u0000"}, "content": ""},
        "pre_tokenizer": _byte_level(False),
        "post_processor": None,
        "decoder": _byte_level(False),
        # byte 0 never reaches the model
        "model": _bpe({EOT if b == 0 else table[b]: b for b in range(256)}, []),
    }


def gpt2_tokenizer_json(encoder: dict[str, int], bpe_text: str) -> dict[str, Any]:
    """``tokenizer.json`` of GPT-2 from its ``encoder.json`` (vocabulary) and ``vocab.bpe`` (merges) texts."""
    merges = [line for line in bpe_text.splitlines()[1:] if line.strip()]
    eot = encoder.get(EOT)
    if eot is None:
        raise DataError(f"the gpt2 vocabulary has no {EOT} token", hint=GPT2_HINT)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(eot, EOT)],
        "normalizer": None,
        "pre_tokenizer": _byte_level(True),
        "post_processor": None,
        "decoder": _byte_level(True),
        "model": _bpe({k: v for k, v in encoder.items() if k != EOT}, merges),
    }


def _cached_gpt2() -> dict[str, Any]:
    if not gpt2_cached():
        raise DataError("the gpt2 tokenizer files are not cached in "
                        f"{tiktoken_cache_dir() or '(caching disabled)'}", hint=GPT2_HINT)
    texts = {}
    for url in GPT2_FILES:
        texts[url.rsplit("/", 1)[1]] = (Path(tiktoken_cache_dir())
                                        / hashlib.sha1(url.encode()).hexdigest()).read_text(
            encoding="utf-8")
    return gpt2_tokenizer_json(json.loads(texts["encoder.json"]), texts["vocab.bpe"])


def tokenizer_config(eot: str, max_len: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot,
            "pad_token": eot, "model_max_length": max_len, "padding_side": "left",
            "clean_up_tokenization_spaces": False, "split_special_tokens": True,
            "model_input_names": ["input_ids", "attention_mask"]}


def tokenizer_files(data: DataConfig, tokenizer: Tokenizer, max_len: int) -> dict[str, str]:
    """``{file name: text}`` of the run's tokenizer in Hugging Face form (``tokenizer`` is the run's own)."""
    if data.tokenizer == "byte":
        tok, eot = byte_tokenizer_json(), EOT
    elif data.tokenizer_path is not None:
        folder = Path(data.tokenizer_path).expanduser()
        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
        assert isinstance(tokenizer, HFTokenizer)
        eot = tokenizer.token(tokenizer.eot_id)
        return {"tokenizer.json": text, "tokenizer_config.json": _dump(tokenizer_config(eot, max_len))}
    else:
        tok, eot = _cached_gpt2(), EOT
    return {"tokenizer.json": json.dumps(tok, ensure_ascii=False),
            "tokenizer_config.json": _dump(tokenizer_config(eot, max_len))}


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
