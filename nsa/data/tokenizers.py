"""Tokenizers: UTF-8 bytes, GPT-2 BPE (tiktoken, cached files only) or a local HF ``tokenizer.json``.

Nothing here downloads: a tokenizer whose files are not on disk raises :class:`DataError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Protocol

import numpy as np

from nsa.errors import DataError

# the files tiktoken's "gpt2" encoding reads (tiktoken_ext/openai_public.py)
GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe": (
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
    ),
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json": (
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
    ),
}
GPT2_HINT = (
    "on a machine with network run `python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` and copy "
    "its cache folder here (set TIKTOKEN_CACHE_DIR), or set data.tokenizer_path to a local tokenizer folder, "
    "or use data.tokenizer=byte"
)


class Tokenizer(Protocol):
    """What the loader needs from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes; id 0 (NUL) is the document separator, so NUL characters are removed from text."""

    name = "byte"
    vocab_size = 256
    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.replace("\x00", "").encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 array without the list (the loader's thread held the GIL ~1.5 ms a batch of
        16 x 2k on that list, time a host-bound step on several ranks waits for)."""
        return np.frombuffer(text.replace("\x00", "").encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eot_id).decode("utf-8", errors="replace")


class TiktokenGPT2:
    """tiktoken's ``gpt2`` encoding; ``<|endoftext|>`` (50256) separates documents."""

    name = "gpt2"

    def __init__(self) -> None:
        import tiktoken

        self._enc = tiktoken.get_encoding("gpt2")
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (needs the ``tokenizers`` library)."""

    def __init__(self, folder: Path, name: str) -> None:
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError:
            raise DataError(
                f"data.tokenizer_path={folder} needs the `tokenizers` library, which is not installed",
                hint="install `tokenizers`, or leave data.tokenizer_path unset",
            ) from None
        try:
            self._tok = _HFTok.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:
            raise DataError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from None
        self.name = name
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = self._find_eot(folder)

    def _find_eot(self, folder: Path) -> int:
        names = ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
        cfg = folder / "tokenizer_config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.insert(0, eos)
        for token in names:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return int(tid)
        raise DataError(
            f"{folder}/tokenizer.json has no end-of-text token (looked for {', '.join(names)})",
            hint="set eos_token in tokenizer_config.json",
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        """The text of token ``token_id`` (its vocabulary entry)."""
        return str(self._tok.id_to_token(token_id))


def tiktoken_cache_dir() -> str:
    """The folder tiktoken reads cached BPE files from (its own rule, see ``tiktoken.load``)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def gpt2_cached() -> bool:
    """True when both GPT-2 BPE files are in tiktoken's cache, intact (so tiktoken downloads nothing)."""
    cache = tiktoken_cache_dir()
    if not cache:
        return False
    for url, sha256 in GPT2_FILES.items():
        file = Path(cache) / hashlib.sha1(url.encode()).hexdigest()
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != sha256:
            return False
    return True


def get_tokenizer(name: str, path: str | None = None) -> Tokenizer:
    """``byte`` or ``gpt2`` (``path``: a local HF tokenizer folder instead of tiktoken's files)."""
    if name == "byte":
        return ByteTokenizer()
    if name != "gpt2":
        raise DataError(f"unknown tokenizer {name!r}", hint="use data.tokenizer=byte or gpt2")
    if path is not None:
        folder = Path(path).expanduser()
        if not (folder / "tokenizer.json").is_file():
            raise DataError(
                f"data.tokenizer_path={path}: no tokenizer.json there",
                hint="point data.tokenizer_path at a folder holding tokenizer.json",
            )
        return HFTokenizer(folder, name)
    if not gpt2_cached():
        raise DataError(
            f"gpt2 tokenizer files are not cached in {tiktoken_cache_dir() or '(caching disabled)'} "
            "and nothing is downloaded at run time",
            hint=GPT2_HINT,
        )
    try:
        return TiktokenGPT2()
    except Exception as exc:
        raise DataError(
            f"cannot load the gpt2 tokenizer from the tiktoken cache: {exc}", hint=GPT2_HINT
        ) from None
