"""Greedy generation speed: ``nsa sample``'s path against transformers' ``generate`` on the same export (issue 35).

Builds the m7c-125m model with random weights (seeded), writes it as a run directory's ``export/`` (what
``nsa train`` leaves), exports it with ``nsa export --format hf``, then times, on the same prompt and device,
in the run's precision (bf16 on CUDA, float32 on a CPU):

- ``nsa``: the loop of ``nsa sample --temperature 0 --no-stop-at-eot`` (``nsa.eval.sampler.Sampler.stream``:
  prefill, one cached decode step per token, the token read on the host each step, the text decoded);
- ``hf``: ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True).generate(ids, max_new_tokens=N,
  do_sample=False)`` (the exported modelling code with the nsa package's decode caches).

Each is run once to warm up (CUDA context, Triton compilation), then ``--repeats`` times; the median time
counts. Prints one JSON object: both tokens/s, their ratio (the issue's criterion: hf / nsa >= 0.8 at 256
tokens on a GPU), whether the greedy tokens are identical, device and versions.

    python scripts/hf_generate_bench.py                       # m7c-125m on CUDA, 256 new tokens
    python scripts/hf_generate_bench.py --tiny --device cpu   # the tiny config on a CPU (a check of the script)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPT = ("Native Sparse Attention reads a compressed summary of the whole context, the blocks that matter most, "
          "and a sliding window of recent tokens. ")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: str, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny config instead of m7c-125m")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the run and the export go (default: a temp dir)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)

    import transformers
    from safetensors.torch import save_model

    from nsa.config import load_named
    from nsa.eval.sampler import Sampler
    from nsa.hf import export_hf
    from nsa.model import build_model

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu")
    name = "tiny" if args.tiny else "m7c-125m"
    cfg = load_named(name)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hf-bench-"))
    run = work / "run"
    (run / "export").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    save_model(build_model(cfg), str(run / "export" / "model.safetensors"))
    (run / "export" / "config.yaml").write_text(cfg.to_yaml())
    exported = export_hf(run, work / "hf", overwrite=True)

    # nsa sample's loop (the run's precision on CUDA, float32 on a CPU: Sampler.open)
    sampler = Sampler.open(run, args.device)
    ids = sampler.encode(args.prompt, args.new_tokens)
    nsa_pieces: list[str] = []

    def nsa_run() -> list[str]:
        nsa_pieces[:] = list(sampler.stream(ids, args.new_tokens, temperature=0.0, stop_at_eot=False))
        return nsa_pieces

    nsa_s, _ = _timed(nsa_run, args.device, args.repeats)
    from nsa.model.generate import generate

    prompt = torch.tensor([ids], device=args.device)
    nsa_tokens = generate(sampler.model, prompt, args.new_tokens)[0, len(ids):].tolist()

    # transformers' generate on the export, same dtype and device
    from transformers import AutoModelForCausalLM

    dtype = next(sampler.model.parameters()).dtype
    hf = AutoModelForCausalLM.from_pretrained(str(exported.out), trust_remote_code=True)
    hf = hf.to(device=args.device, dtype=dtype).eval()  # as Sampler.open casts the nsa model

    def hf_run() -> torch.Tensor:
        return hf.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                           attention_mask=torch.ones_like(prompt))

    hf_s, hf_out = _timed(hf_run, args.device, args.repeats)
    hf_tokens = hf_out[0, len(ids):].tolist()
    mismatch = next((i for i, (a, b) in enumerate(zip(nsa_tokens, hf_tokens, strict=False)) if a != b), None)
    result = {
        "config": name,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "nsa_sample_s": nsa_s,
        "hf_generate_s": hf_s,
        "nsa_sample_tokens_per_s": args.new_tokens / nsa_s,
        "hf_generate_tokens_per_s": args.new_tokens / hf_s,
        "ratio_hf_over_nsa": nsa_s / hf_s,
        "greedy_tokens_match": nsa_tokens == hf_tokens,
        "nsa_sample_text_matches": "".join(nsa_pieces) == sampler.tokenizer.decode(hf_tokens),
        "first_mismatch": mismatch,
        "hf_uses_nsa_package": bool(hf.uses_nsa_package),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
