"""Training-step benchmark: tokens/s and peak memory of the NSA model and the same model with dense
attention (``model.attention = "dense"``), on random tokens, bf16 autocast on CUDA, fused AdamW.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nsa.config import RunConfig


@dataclass
class TrainRow:
    """One model at one sequence length; ``step_ms`` is the median over the timed steps."""

    attention: str
    seq_len: int
    batch_size: int
    params_m: float
    step_ms: float
    tokens_per_s: float
    peak_mib: float | None
    device: str
    backend: str
    compiled: bool = False
    fallbacks: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bench_train_step(
    run_cfg: RunConfig, *, attention: str, seq_len: int, batch_size: int, steps: int = 10,
    warmup: int = 3, device: str | torch.device | None = None,
) -> TrainRow:
    """Median step time of forward + backward + optimizer step for one model variant.

    With ``runtime.compile`` the model is wrapped in ``torch.compile`` (the warm-up steps absorb the
    compilation), for NSA and dense alike, so the ratio compares like with like.
    """
    from nsa.model import build_model
    from nsa.ops import fallback_counts, reset_fallback_counts

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = run_cfg.model_copy(deep=True)
    cfg.model.attention = attention  # type: ignore[assignment]
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq_len)
    if dev.type == "cuda" and cfg.runtime.attn_backend == "auto":
        cfg.runtime.attn_backend = "triton"  # explicit, so a fallback to torch is counted
    torch.manual_seed(0)
    model = build_model(cfg).to(dev)
    model.train()
    forward = torch.compile(model) if cfg.runtime.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (batch_size, seq_len + 1), generator=gen).to(dev)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step() -> None:
        with amp:
            loss = forward(inputs, labels).loss
        assert loss is not None
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_fallback_counts()
    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(steps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    row = TrainRow(attention=attention, seq_len=seq_len, batch_size=batch_size,
                   params_m=model.num_params() / 1e6, step_ms=ms,
                   tokens_per_s=batch_size * seq_len / (ms / 1e3), peak_mib=peak, device=name,
                   backend=cfg.runtime.attn_backend, compiled=cfg.runtime.compile,
                   fallbacks=fallback_counts())
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_train(
    run_cfg: RunConfig, seq_lens: list[int], batch_sizes: list[int], *, attentions: tuple[str, ...] = ("nsa", "dense"),
    steps: int = 10, warmup: int = 3, device: str | None = None,
) -> list[TrainRow]:
    """Rows for each sequence length (with its batch size) and each attention variant."""
    rows = []
    for S, bs in zip(seq_lens, batch_sizes, strict=True):
        for att in attentions:
            rows.append(bench_train_step(run_cfg, attention=att, seq_len=S, batch_size=bs, steps=steps,
                                         warmup=warmup, device=device))
    return rows


def speedups(rows: list[TrainRow]) -> dict[int, float]:
    """NSA tokens/s over dense tokens/s per sequence length (where both were measured)."""
    by: dict[int, dict[str, float]] = {}
    for r in rows:
        by.setdefault(r.seq_len, {})[r.attention] = r.tokens_per_s
    return {S: v["nsa"] / v["dense"] for S, v in by.items() if "nsa" in v and "dense" in v}
