"""NSA model: attention layers, LLaMA-style language model, dense baseline, decode caches, generation."""

from nsa.model.attention import NSAAttention
from nsa.model.dense import DenseAttention
from nsa.model.lm import NSALM, LMOutput, build_model
from nsa.model.norm import RMSNorm

__all__ = ["NSALM", "DenseAttention", "LMOutput", "NSAAttention", "RMSNorm", "build_model"]
