"""Which documents belong to a split and a rank: decided by the document index alone.

The validation split is a hash of the index against ``val_fraction`` (so validation documents never
appear in training, whatever the seed or world size); ranks take indices modulo ``world_size``.
"""

from __future__ import annotations

import hashlib

_SALT = b"nsa-val-split-v1"


def is_val(index: int, val_fraction: float) -> bool:
    """True when document ``index`` is held out for validation."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8, key=_SALT).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


def belongs(index: int, *, split: str, val_fraction: float, rank: int, world_size: int) -> bool:
    """True when document ``index`` is read by ``rank`` for ``split`` ("train" or "val")."""
    if index % world_size != rank:
        return False
    return is_val(index, val_fraction) == (split == "val")
