"""Issue 53's CP row, one dense block's attention on one GPU: what a context-parallel rank's chunks cost.

Context parallelism over ``R`` ranks at ``R * L`` tokens gives each rank two chunks of ``L / 2`` queries (the
``r``-th and the ``(2R-1-r)``-th: balanced), each over the keys up to its end (``nsa.model.dense``). Timed here,
fwd+bwd on random bf16 inputs (seed 0), against dense causal SDPA over ``L`` tokens (the one-GPU row's block):
the chunks by the library pair (``nsa.ops.chunk_attention.causal_at``, cuDNN: the default since eec1056) and by
the explicit lower-right mask (the former path); then the NSA op the same way (``_nsa_rows``).

Usage (repo root, GPU): python3 scripts/cp_chunk_bench.py [L=65536] [HQ=12] [H=2] [D=64] [R=2]   JSON lines to
$OUT/cp_chunks.jsonl (or ./cp_chunks.jsonl).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nsa.bench.timing import make_timer
from nsa.ops import chunk_attention

_ms = make_timer(torch.device("cuda"))  # medians of triton.testing.do_bench, 25 ms warm-up, 100 ms of runs


def _fwdbwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for t in leaves:
            t.grad = None
        fn().sum().backward()
    return run


def main(argv: list[str]) -> None:
    L, HQ, H, D, R = (int(a) for a in (argv + ["65536", "12", "2", "64", "2"][len(argv):]))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=dev, dtype=torch.bfloat16).requires_grad_(True)

    def one_gpu() -> float:
        q1, k1, v1 = rnd(1, HQ, L, D), rnd(1, H, L, D), rnd(1, H, L, D)
        return _ms(_fwdbwd(lambda: F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True),
                           [q1, k1, v1]))

    rec: dict[str, object] = {"L": L, "HQ": HQ, "H": H, "D": D, "R": R, "device": torch.cuda.get_device_name()}
    rec["one_gpu_sdpa_ms"] = one_gpu()
    S, c = R * L, L // 2
    k, v = rnd(1, H, S, D), rnd(1, H, S, D)
    for r in (0, R - 1):
        starts = (r * c, (2 * R - 1 - r) * c)
        qs = [rnd(1, HQ, c, D) for _ in starts]
        for impl in ("cudnn", "mask"):
            def run(impl: str = impl, qs: list[torch.Tensor] = qs, starts: tuple[int, int] = starts) -> torch.Tensor:
                total = torch.zeros((), device=dev)
                for qc, a in zip(qs, starts, strict=True):
                    kc, vc = k[:, :, :a + c], v[:, :, :a + c]
                    if impl == "mask":
                        keys = torch.arange(a + c, device=dev)
                        mask = keys[None, :] <= torch.arange(a, a + c, device=dev)[:, None]
                        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
                    else:
                        o = chunk_attention.causal_at(qc, kc, vc, a, impl)
                    total = total + o.float().sum()
                return total
            try:
                torch.cuda.reset_peak_memory_stats()
                rec[f"rank{r}_{impl}_ms"] = _ms(_fwdbwd(run, [*qs, k, v]))
                rec[f"rank{r}_{impl}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except torch.OutOfMemoryError:
                rec[f"rank{r}_{impl}_ms"] = None
            torch.cuda.empty_cache()
    rec.update(_nsa_rows(L, HQ, H, D, R, rnd))
    print(json.dumps(rec), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "cp_chunks.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def _nsa_rows(L: int, HQ: int, H: int, D: int, R: int,
              rnd: Callable[..., torch.Tensor]) -> dict[str, float]:
    """The NSA op (paper hyper-parameters, the window's own query) the same way: the whole ``L`` on one GPU,
    then a rank's two chunks at their offsets over the keys up to each chunk's end, compressed K/V from
    them (what ``nsa.model.attention`` runs per rank; the gathers are not timed)."""
    from nsa.ops import NSAParams, compress_avg, nsa_attention

    p = NSAParams()

    def op(S: int, starts: tuple[int, ...], c: int) -> float:
        kv = [rnd(1, S, H, D) for _ in range(6)]  # k_raw, v_raw, k_sel, v_sel, k_win, v_win
        qs = [(rnd(1, c, HQ, D), rnd(1, c, HQ, D), rnd(1, c, HQ, 3)) for _ in starts]

        def run() -> torch.Tensor:
            total = torch.zeros((), device=kv[0].device)
            for (q, q_win, gates), a in zip(qs, starts, strict=True):
                n = a + c
                k_cmp, v_cmp = compress_avg(kv[0][:, :n], p), compress_avg(kv[1][:, :n], p)
                ks, vs, kw, vw = (t[:, :n] for t in kv[2:])
                o = nsa_attention(q, k_cmp, v_cmp, ks, vs, kw, vw, gates.sigmoid(), p, q_start=a, q_win=q_win)
                assert isinstance(o, torch.Tensor)
                total = total + o.float().sum()
            return total
        return _ms(_fwdbwd(run, [*kv, *(t for trio in qs for t in trio)]))

    c = L // 2
    return {"one_gpu_nsa_ms": op(L, (0,), L),
            **{f"rank{r}_nsa_ms": op(R * L, (r * c, (2 * R - 1 - r) * c), c) for r in (0, R - 1)}}


if __name__ == "__main__":
    main(sys.argv[1:])
