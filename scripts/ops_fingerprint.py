"""Bit-for-bit fingerprint of the NSA ops (issue 32: ``q_start=0`` must leave every output unchanged).

Runs ``select_blocks`` and ``nsa_attention`` (forward and all eight gradients) on fixed seeded inputs and
saves every tensor; run it once with the code before a change and once after, then compare. Uses only
the API both sides have (no ``q_start``). Each case runs twice in the process: a tensor that differs
between the two runs (fp32 atomics: compressed dk/dv chunks, block 0 of the selected dk/dv) is marked
unstable and compared with a tolerance instead of bitwise.

    git archive <base> nsa | tar -x -C /tmp/base                                  # the code before
    PYTHONPATH=/tmp/base python3 scripts/ops_fingerprint.py --out /tmp/base.pt
    python3 scripts/ops_fingerprint.py --out /tmp/new.pt
    python3 scripts/ops_fingerprint.py --compare /tmp/base.pt /tmp/new.pt        # exit 1 on a difference

``--device cpu`` runs the torch path in float64 (and Triton under ``TRITON_INTERPRET=1`` on tiny shapes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import nsa.ops as ops
from nsa.ops import NSAParams

NAMES = ("out", "block_idx", "select_blocks", "dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win",
         "dgates")
# id: (B, S, HQ, H, D, hyper-parameters, tile overrides)
CUDA_CASES = {
    "m7c-h6-fsa-2k": (2, 2048, 12, 2, 64, NSAParams(), {}),
    "paper-h16-row-4k": (1, 4096, 32, 2, 128, NSAParams(), {}),
    "h4-ragged-1500": (1, 1500, 8, 2, 128, NSAParams(), {"sel_mode": "row"}),
}
CPU_CASES = {
    "tiny-h2": (2, 40, 4, 2, 16, NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=10), {}),
    "tiny-h6-row": (1, 36, 6, 1, 16, NSAParams(l=8, d=4, l_sel=16, n_sel=3, w=16), {"sel_mode": "row"}),
}


def run_case(B: int, S: int, HQ: int, H: int, D: int, hp: NSAParams, backend: str, device: str,
             dtype: torch.dtype) -> list[torch.Tensor]:
    """Outputs and gradients of one call on inputs drawn from seed 0."""
    gen = torch.Generator().manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_(True)

    n_c = max(0, (S - hp.l) // hp.d + 1)
    args = [rnd(B, S, HQ, D), rnd(B, n_c, H, D), rnd(B, n_c, H, D), *(rnd(B, S, H, D) for _ in range(4))]
    gates = (torch.rand(B, S, HQ, 3, generator=gen, dtype=torch.float64) + 0.05).to(device, dtype)
    args.append(gates.requires_grad_(True))
    q, kc, vc, ks, vs, kw, vw, g = args
    out, idx = ops.nsa_attention(q, kc, vc, ks, vs, kw, vw, g, hp, backend=backend, return_block_idx=True)
    sel = ops.select_blocks(q.detach(), kc.detach(), hp, backend=backend)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device, dtype)
    out.backward(w)
    grads = [torch.zeros_like(a) if a.grad is None else a.grad for a in args]
    return [t.detach().cpu() for t in (out, idx, sel, *grads)]


def fingerprint(device: str) -> dict[str, dict[str, tuple[torch.Tensor, bool]]]:
    """``{case: {tensor name: (tensor, stable across two runs)}}``."""
    cuda = device == "cuda"
    backends = ["triton"] if cuda else ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    res: dict[str, dict[str, tuple[torch.Tensor, bool]]] = {}
    for backend in backends:
        for case, (B, S, HQ, H, D, hp, tune) in (CUDA_CASES if cuda else CPU_CASES).items():
            dtype = torch.bfloat16 if cuda else (torch.float64 if backend == "torch" else torch.float32)
            with ops.tile_overrides(tune if backend == "triton" else {}):
                a = run_case(B, S, HQ, H, D, hp, backend, device, dtype)
                b = run_case(B, S, HQ, H, D, hp, backend, device, dtype)
            res[f"{backend}:{case}"] = {n: (x, torch.equal(x, y)) for n, x, y in zip(NAMES, a, b, strict=True)}
            print(f"{backend}:{case}", "unstable:", [n for n, (_, ok) in res[f"{backend}:{case}"].items() if not ok])
    return res


def compare(base_path: str, new_path: str) -> int:
    """0 when every stable tensor is bitwise equal (and unstable ones within 1e-2 relative), else 1."""
    base, new = torch.load(base_path), torch.load(new_path)
    bad = 0
    for case in sorted(set(base) | set(new)):
        if case not in base or case not in new:
            print(f"{case}: only in {'new' if case in new else 'base'}")
            bad += 1
            continue
        for name, (x, stable) in base[case].items():
            y, stable_new = new[case][name]
            if stable and stable_new:
                ok = torch.equal(x, y)
                note = "bitwise" if ok else f"DIFFERS (max abs {float((x.double() - y.double()).abs().max()):.3g})"
            else:
                rel = float((x.double() - y.double()).norm() / x.double().norm().clamp_min(1e-30))
                ok = rel < 1e-2
                note = f"unstable across runs (atomics), relative difference {rel:.2e}"
            bad += not ok
            print(f"{case:28s} {name:14s} {'ok ' if ok else 'BAD'} {note}")
    print("identical" if bad == 0 else f"{bad} difference(s)")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprint here (.pt)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="compare two fingerprints")
    ns = ap.parse_args()
    if ns.compare:
        return compare(*ns.compare)
    if not ns.out:
        ap.error("give --out PATH or --compare BASE NEW")
    torch.save(fingerprint(ns.device), ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
