"""Causality of a whole model: change every token after position t; the logits up to t must not move.

    python3 scripts/causality_probe.py RUN_DIR [RUN_DIR ...] [--seq-len 2048] [--batch 2] [--cases 8] [--compile]
    python3 scripts/causality_probe.py --config tiny --set model.dense_layers=1 --seq-len 256 --device cpu

Each model (a trained run, or a fresh one of a config) runs in eval and in train mode, eager and (``--compile``)
under ``torch.compile``, on its device's path (Triton on a GPU). For each case t (random, and next to selection
and compression block edges), ``prefix`` is the largest change of a logit at positions <= t, ``suffix`` after t,
``noise`` the largest change between two forwards of the same tokens. A leak: ``prefix > 4 * noise``. One JSON
line per model and mode; exit 1 when any case leaks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch


def _models(args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    from nsa.config import load_run_config
    from nsa.config.resolve import parse_set
    from nsa.model import build_model
    from nsa.model.load import load_model

    out = []
    for run in args.runs:
        loaded = load_model(run, device=args.device, dtype=torch.float32)
        out.append((str(run), loaded.model, loaded.config))
    if args.config:
        cfg = load_run_config(args.config, environ={}, flags=dict(parse_set(s) for s in args.set)).config
        torch.manual_seed(0)
        out.append((f"{args.config} {' '.join(args.set)}".strip(), build_model(cfg).to(args.device), cfg))
    return out


def _positions(seq_len: int, cases: int, block: int, gen: torch.Generator) -> list[int]:
    edges = [t for b in (block, 2 * block, seq_len // 2) for t in (b - 1, b) if 0 < t < seq_len - 1]
    rand = torch.randint(1, seq_len - 1, (max(0, cases - len(edges)),), generator=gen).tolist()
    return sorted(set(edges + rand))


def probe(name: str, model: Any, cfg: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(args.seed)
    vocab, S = cfg.model.vocab_size, args.seq_len
    ids = torch.randint(0, vocab, (args.batch, S), generator=gen).to(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    for compiled in ([False, True] if args.compile else [False]):
        fn = torch.compile(model, dynamic=False) if compiled else model
        for mode in ("eval", "train"):
            model.train(mode == "train")
            grad = mode == "train"

            def logits(x: torch.Tensor, fn: Any = fn, grad: bool = grad) -> torch.Tensor:
                with torch.set_grad_enabled(grad), torch.autocast(args.device, dtype=dtype, enabled=dtype != torch.float32):
                    return fn(x).logits.detach().float()

            base = logits(ids)
            noise = float((logits(ids) - base).abs().max())
            cases = []
            for t in _positions(S, args.cases, cfg.nsa.l_sel, gen):
                other = ids.clone()
                other[:, t + 1:] = torch.randint(0, vocab, (args.batch, S - t - 1), generator=gen).to(args.device)
                out = logits(other)
                prefix = float((out[:, : t + 1] - base[:, : t + 1]).abs().max())
                suffix = float((out[:, t + 1:] - base[:, t + 1:]).abs().max())
                cases.append({"t": t, "prefix": prefix, "suffix": suffix, "leak": prefix > 4 * noise})
            rows.append({"model": name, "compiled": compiled, "mode": mode, "seq_len": S, "noise": noise,
                         "dense_layers": cfg.model.dense_layers, "attention": cfg.model.attention,
                         "leaks": sum(c["leak"] for c in cases), "cases": cases})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="run directories (their exported or last saved weights)")
    ap.add_argument("--config", help="a named config or YAML: a fresh model of it")
    ap.add_argument("--set", action="append", default=[], help="section.key=value for --config (repeatable)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="also under torch.compile")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rows = [r for name, model, cfg in _models(args) for r in probe(name, model, cfg, args)]
    leaks = sum(r["leaks"] for r in rows)
    print(f"{len(rows)} model/mode rows, {sum(len(r['cases']) for r in rows)} cases, {leaks} leaking", file=sys.stderr)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
