"""What each ``nsa bench`` command asks, as typed requests: every field an option of the command (its flag,
help and bounds in its metadata, :func:`nsa.view.option`), so the CLI derives the commands' options from here
and the defaults have one owner. Light (no torch): the CLI reads them to build its help. The benchmarks take
them:
:func:`nsa.bench.attention.attention_command`, :func:`nsa.bench.train.train_command`,
:func:`nsa.bench.decode.decode_command`, :func:`nsa.bench.retrieval.retrieval_command`,
:func:`nsa.bench.quality_view.quality_command`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nsa.errors import ConfigError
from nsa.view import option

PEAK_TFLOPS = 750.0  # the stage table's roofline: bf16 dense matrix products and HBM bandwidth that an
PEAK_TBPS = 3.0  # H100/H200 reaches in practice (not the datasheet), as docs/kernels.md counts
SHAPES: dict[str, tuple[int, int, int]] = {"paper": (64, 4, 128), "m7c": (12, 2, 64)}  # (HQ, H, D)
TUNE = "Triton tile override key=value (sweeps), e.g. sel_bm=16."
TINY = "CPU-sized run (seq 64,128; tiny shape; small NSA blocks)."
PROFILE = "kernels by time and launches (CPU: operators), in the JSON."


@dataclass
class AttentionRequest:
    """``nsa bench attention``: NSA against dense attention (and fla-core), per shape and length."""

    seq_lens: list[int] | None = option(None, "--seq-lens", "Comma-separated sequence lengths [default: "
                                        "2048..131072, --tiny: 64,128].", kind="ints")
    shapes: list[str] | None = option(None, "--shape", "paper (HQ=64,H=4,D=128), m7c (HQ=12,H=2,D=64) or "
                                      "HQ,H,D; repeatable.", kind="repeat")
    batch: int = option(1, "--batch", min=1)
    backend: str = option("auto", "--backend", "nsa.ops backend: auto, triton, torch, reference.")
    peer: bool = option(True, "--peer", "Time fla-core's parallel_nsa when importable.", switch=True)
    dense: bool = option(True, "--dense", "Time dense causal SDPA.", switch=True)
    warmup_ms: int = option(25, "--warmup-ms", min=1)
    rep_ms: int = option(100, "--rep-ms", min=1)
    tiny: bool = option(False, "--tiny", TINY)
    tune: list[str] | None = option(None, "--tune", TUNE, kind="repeat")
    cuda_graph: bool = option(False, "--cuda-graph",
                              "Time every side as CUDA-graph replays (no launch overhead).")
    stages: bool = option(False, "--stages", "Also time each Triton stage alone, against its roofline (FLOPs "
                          "at --peak-tflops, bytes at --peak-tbps).")
    peak_tflops: float = option(PEAK_TFLOPS, "--peak-tflops",
                                "Matrix-product rate of the stage table's roofline.", min=1.0)
    peak_tbps: float = option(PEAK_TBPS, "--peak-tbps",
                              "Memory bandwidth (TB/s) of the stage table's roofline.", min=0.1)
    profile: bool = option(False, "--profile-step",
                           f"Profile one more NSA forward+backward per row: {PROFILE}")

    def shape_list(self) -> list[tuple[str, int, int, int]]:
        """``(name, HQ, H, D)`` of each shape asked (a named one, ``tiny``, or ``HQ,H,D``)."""
        out: list[tuple[str, int, int, int]] = []
        for s in self.shapes or (["tiny"] if self.tiny else ["paper", "m7c"]):
            if s in SHAPES:
                out.append((s, *SHAPES[s]))
            elif s == "tiny":
                out.append(("tiny", 4, 2, 16))
            else:
                try:
                    hq, h, d = (int(x) for x in s.replace(" ", "").split(","))
                except ValueError:
                    hq = h = d = 0
                if min(hq, h, d) < 1 or hq % h:
                    raise ConfigError(f"--shape {s!r} must be paper, m7c or HQ,H,D with H dividing HQ")
                out.append((f"{hq}x{h}x{d}", hq, h, d))
        return out


@dataclass
class TrainBenchRequest:
    """``nsa bench train``: the training step of ``config`` (with ``sets``) at each length with its batch
    size."""

    config: str = option("m7c-125m", "--config", "Run config", kind="config")
    seq_lens: list[int] = option([2048, 16384], "--seq-lens", "Comma-separated sequence lengths.",
                                 kind="ints")
    batch_sizes: list[int] = option([16, 2], "--batch-sizes", "Batch size per sequence length.", kind="ints")
    attentions: list[str] = option(["nsa", "dense"], "--attention", "nsa and/or dense; repeatable.",
                                   kind="repeat")
    steps: int = option(10, "--steps", min=1)
    warmup: int = option(3, "--warmup", min=0)
    sets: list[str] | None = option(None, "--set", "Config override key=value", kind="sets")
    tiny: bool = option(False, "--tiny", "CPU-sized run: tiny config, seq 64, batch 2, 2 steps.")
    tune: list[str] | None = option(None, "--tune", TUNE, kind="repeat")
    modes: str | None = option(None, "--modes", "eager and/or compiled, comma-separated (default: both on "
                               "CUDA, eager on CPU).")
    profile: bool = option(False, "--profile-step", f"Profile one more step per row: {PROFILE}")
    trace_dir: Path | None = option(None, "--trace-dir", "Also write that step's Chrome trace here, one file "
                                    "per row and rank (implies --profile-step).")
    nproc_per_node: int | None = option(None, "--nproc-per-node", "Run on N ranks of this node through "
                                        "torchrun (DDP, or FSDP with --set runtime.parallel=fsdp).", min=1)
    context_parallel: int = option(1, "--context-parallel", "Ranks that share each sequence "
                                   "(docs/training.md, 'Training longer than one GPU holds').", min=1)


@dataclass
class DecodeRequest:
    """``nsa bench decode``: NSA decode steps against a dense KV cache, attention alone and the whole
    model."""

    contexts: list[int] | None = option(None, "--contexts", "Comma-separated context lengths [default: "
                                        "1024..65536; --tiny: 64,128].", kind="ints")
    batches: list[int] | None = option(None, "--batches", "Comma-separated batch sizes [default: 1,32; "
                                       "--tiny: 1,2].", kind="ints")
    shapes: list[str] | None = option(None, "--shape", "paper (HQ=64,H=4,D=128) and/or m7c (HQ=12,H=2,D=64); "
                                      "repeatable.", kind="repeat")
    modes: list[str] = option(["attention", "model"], "--mode", "attention and/or model; repeatable "
                              "[default: both].", kind="repeat")
    model_config: str | None = option(None, "--config", "Config of the model rows [default: m7c-125m; "
                                      "--tiny: tiny]", kind="config")
    model_contexts: list[int] | None = option(None, "--model-contexts", "Contexts of the model rows "
                                              "[default: 2048,65536].", kind="ints")
    sets: list[str] | None = option(None, "--set", "Override of the model rows' config, key=value (e.g. "
                                    "model.dense_layers=[] for every block NSA)", kind="sets")
    backend: str = option("auto", "--backend",
                          "NSA decode path: auto (fused Triton step on CUDA), triton, or torch.")
    compile: bool = option(False, "--compile", "NSA op / each block's decode step through torch.compile.")
    graphs: bool = option(True, "--graphs", "Also time CUDA-graph replays of each step.", switch=True)
    tiny: bool = option(False, "--tiny", "CPU-sized run (tiny shape and config, contexts 64/128).")


@dataclass
class RetrievalRequest:
    """``nsa bench retrieval``: each variant trained from scratch on key/value retrieval beyond the window."""

    config: str = option("retrieval", "--config", "Config of the model and nsa sections", kind="config")
    sets: list[str] = option([], "--set", "Config override key=value", kind="sets")
    seq_len: int = option(2048, "--seq-len", "Model inputs per sequence.", min=8)
    gap: int = option(600, "--gap", "The needle sits at least this many positions before the query.", min=1)
    variants: list[str] = option(["dense", "nsa"], "--variants", "Comma-separated: nsa, dense, window (NSA's "
                                 "window branch alone).", kind="csv")
    seeds: list[int] = option([0], "--seeds", "Comma-separated seeds; each variant trains once per seed.",
                              kind="seeds")
    steps: int = option(6000, "--steps", min=1)
    batch: int = option(16, "--batch", min=1)
    lr: float = option(1e-3, "--lr", min=0.0)
    eval_every: int = option(100, "--eval-every", min=1)
    eval_samples: int = option(256, "--eval-samples", min=1)
    target: float = option(0.5, "--target", "Accuracy whose first step is reported.", min=0.0, max=1.0)
    tiny: bool = option(False, "--tiny", "CPU-sized run (the CI test's setting): 2-layer dim-32 model, "
                        "S=128, gap 48, 1200 steps; overrides --seq-len, --gap, --steps.")


@dataclass
class QualityRequest:
    """``nsa bench quality``: NSA recipes against dense attention on the same data, tokens, model and
    seeds."""

    config: str | None = option(None, "--config", "Base run config of every arm", kind="config")
    sets: list[str] = option([], "--set", "Config override key=value for every arm", kind="sets")
    arms: str = option("dense,nsa", "--arms", "Comma-separated arms: dense, nsa, nsa-half, nsa-window, "
                       "nsa-uniform, nsa-scorer, dense-warm, dense-curriculum, nsa-curriculum (a quarter of "
                       "the steps on 4x shorter windows first), dense-ladder, nsa-ladder (a quarter at 16x "
                       "shorter, a quarter at 4x shorter), dense-ladder-half, nsa-ladder-half (half at 16x "
                       "shorter, a quarter at 4x shorter), or label=key=value;key=value (NSA plus "
                       "overrides), label=<arm>;key=value (that arm plus overrides).")
    seeds: str = option("0", "--seeds", "Comma-separated seeds; every arm trains once per seed.")
    lrs: str | None = option(None, "--lrs", "Comma-separated learning rates: every arm trains at each, and "
                             "is compared with dense at its best (e.g. 5e-4,1e-3,2e-3).")
    steps: int | None = option(None, "--steps", "Training steps per arm [default: the config's].", min=1)
    task: str = option("text", "--task", "text (held-out loss, selection recall), needle (single-needle "
                       "retrieval) or both.")
    needle_seq_len: int = option(2048, "--needle-seq-len", min=8)
    needle_gap: int = option(600, "--needle-gap", min=1)
    needle_steps: int = option(5000, "--needle-steps", min=1)
    needle_batch: int = option(16, "--needle-batch", min=1)
    queries: int = option(64, "--queries", "Query positions per layer for selection recall.", min=1)
    parallel: int = option(1, "--parallel", "Runs at once, each in a process of its own, dealt over the "
                           "visible GPUs (more runs than GPUs share them) or, on CPU, over the cores; the "
                           "same runs and rows.", min=1)
    out_dir: Path = option(Path("artifacts/quality"), "--out-dir", "Run directories go to "
                           "OUT_DIR/<arm>/seed<N> (replaced).")
    tiny: bool = option(False, "--tiny", "CPU-sized run (the CI test): config tiny, 40 steps, needle S=128 "
                        "gap 48, 60 steps.")
    saved: list[Path] = option([], "--from", "Train nothing: read these saved --json-out files of one sweep "
                               "(repeatable: runs of several calls merged; a sweep cut short: its "
                               "<json-out>.rows.jsonl) and print, save and chart them as one; the training "
                               "options are not used.", kind="repeat")
    against: list[str] = option([], "--against", "Also read every other arm against this one, paired by seed "
                                "(mean +- sd of the per-seed differences, and whether they are within "
                                "noise): any arm, NSA ones included; repeatable; works with --from.",
                                kind="repeat")
    chart: Path | None = option(None, "--chart", "Also draw each arm's training loss and held-out loss by "
                                "position (mean over seeds; a sweep's arms at their best rate) to this PNG "
                                "(the equal-time runs' against GPU seconds to <name>-time.png).")
    budget: str = option("tokens", "--budget", "tokens (every arm --steps), time (every arm the GPU time the "
                         "reference arm spends on --steps: each arm's step probed alone on its GPU first, "
                         "its steps scaled by the reference's step time over its own) or both (the two sets "
                         "of runs, read side by side).")
    time_reference: str | None = option(None, "--time-reference", "The arm whose GPU time every arm gets "
                                        "under --budget time/both [default: the slowest].")
    probe_steps: int = option(10, "--probe-steps",
                              "Timed steps of each arm's step probe (--budget time/both).", min=1)
    json_out: Path | None = field(default=None)  # the CLI's --json-out: the sweep kept there as it goes
