"""Data: tokenizers, sources, packing and the prefetch loader."""
