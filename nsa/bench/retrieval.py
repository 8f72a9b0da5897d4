"""Learning benchmark: does a model learn long-range retrieval, and how many steps does it take?

Trains a fresh ``NSALM`` on ``nsa.data.retrieval.RetrievalTask`` (AdamW, linear warm-up, gradient
clipping; bf16 autocast on CUDA) and scores the argmax at the query on a fixed set of fresh
sequences every ``eval_every`` steps. Variants share everything but the attention: ``dense`` (the
same model with dense attention), ``nsa`` (the config's NSA layer) and ``window`` (NSA with the
compressed and selected branches switched off: sliding-window attention alone, which cannot reach
a needle beyond ``w``). The result is a curve per variant and the first step that reaches a target
accuracy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from nsa.bench.requests import RetrievalRequest
from nsa.config import ModelConfig, NSAConfig, ScorerConfig
from nsa.data.retrieval import RetrievalTask
from nsa.errors import ConfigError
from nsa.model.diagnostics import ScorerParams
from nsa.model.lm import NSALM
from nsa.view import Payload, Table

VARIANTS = ("dense", "nsa", "window")


@dataclass
class RetrievalPoint:
    """One evaluation: mean training loss since the last one, accuracy, mean gates (cmp, sel, win)."""

    step: int
    loss: float
    accuracy: float
    gates: list[float] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RetrievalCurve:
    """A variant's training curve and the first step at which it reached ``target`` accuracy."""

    variant: str
    seed: int
    points: list[RetrievalPoint]
    target: float
    steps_to_target: int | None
    final_accuracy: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RetrievalRecipe:
    """Optimiser and evaluation settings (the issue's recipe by default)."""

    steps: int = 1500
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    clip: float = 1.0
    eval_every: int = 100
    eval_samples: int = 256
    eval_batch: int = 32
    target: float = 0.5
    stop_at_target: bool = False


def learn_retrieval(
    model_cfg: ModelConfig, nsa_cfg: NSAConfig, task: RetrievalTask, variant: str = "nsa", *,
    recipe: RetrievalRecipe | None = None, seed: int = 0, device: str | torch.device | None = None,
    backend: str | None = None, on_point: Callable[[RetrievalPoint], None] | None = None,
    scorer: ScorerConfig | None = None,
) -> RetrievalCurve:
    """Train one variant from scratch on ``task`` and return its curve (see the module docstring);
    ``scorer``: the NSA scorer loss (``nsa.model.selection``) as the trainer applies it."""

    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {', '.join(VARIANTS)}")
    r = recipe or RetrievalRecipe()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = model_cfg.model_copy(update={
        "attention": "dense" if variant == "dense" else "nsa",
        "max_seq_len": max(model_cfg.max_seq_len, task.seq_len),
    })
    if variant == "window":
        nsa_cfg = nsa_cfg.model_copy(update={"fixed_gates": (0.0, 0.0, 1.0)})
    torch.manual_seed(seed)
    # the window control has no selection to train
    training = scorer is not None and scorer.active and variant == "nsa"
    model = NSALM(cfg, nsa_cfg, backend=backend,
                  scorer=ScorerParams.of_config(scorer) if training and scorer is not None else None).to(dev)
    scorer_until = scorer.until if training and scorer is not None else None
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=0.0)
    train_gen = torch.Generator().manual_seed(1234 + seed)
    eval_gen = torch.Generator().manual_seed(999)
    n_eval = max(1, r.eval_samples // r.eval_batch)
    evals = [task.batch(eval_gen, r.eval_batch) for _ in range(n_eval)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    points: list[RetrievalPoint] = []
    losses: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for step in range(1, r.steps + 1):
        if scorer_until is not None and step > scorer_until:  # the scorer's warm-up is over
            model.set_scorer(ScorerParams())
            scorer_until = None
        for group in opt.param_groups:
            group["lr"] = r.lr * min(1.0, step / max(1, r.warmup))
        inputs, labels = task.batch(train_gen, r.batch_size)
        with autocast:
            out = model(inputs.to(dev), labels.to(dev))
        assert out.loss is not None
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.clip)
        opt.step()
        losses.append(out.loss.detach())
        if step % r.eval_every and step != r.steps:
            continue
        stats = model.consume_stats()
        point = RetrievalPoint(step, float(torch.stack(losses).mean()),
                               _accuracy(model, evals, dev, autocast),
                               [round(g, 4) for g in stats.get("gate_mean", [])],
                               round(time.perf_counter() - t0, 2))
        losses.clear()
        points.append(point)
        if on_point is not None:
            on_point(point)
        if r.stop_at_target and point.accuracy >= r.target:
            break
    hit = next((p.step for p in points if p.accuracy >= r.target), None)
    return RetrievalCurve(variant, seed, points, r.target, hit, points[-1].accuracy if points else 0.0)


@torch.no_grad()
def _accuracy(model: torch.nn.Module, evals: list[tuple[torch.Tensor, torch.Tensor]], dev: torch.device,
              autocast: Any) -> float:
    model.eval()
    hits = total = 0
    try:
        for inputs, labels in evals:
            with autocast:
                logits = model(inputs.to(dev)).logits[:, -1]
            hits += int((logits.argmax(-1).cpu() == labels[:, -1]).sum())
            total += labels.shape[0]
    finally:
        model.train()
    return hits / max(1, total)


# --tiny: the CPU setting of the CI regression test (tests/test_retrieval_learning.py)
TINY_SEQ_LEN, TINY_GAP, TINY_STEPS, TINY_EVAL_EVERY = 128, 48, 1200, 50
TINY_SETS = ["model.dim=32", "model.n_heads=4", "model.d_k=8", "model.d_v=8", "model.n_layers=2",
             "model.mlp_hidden=128", "nsa.l=8", "nsa.d=4", "nsa.l_sel=16", "nsa.n_sel=4", "nsa.w=16"]


def retrieval_command(req: RetrievalRequest, say: Callable[[str], None] | None = None) -> Payload:
    """``nsa bench retrieval``: every variant trained from scratch once per seed on key/value retrieval
    ``gap`` positions back in ``seq_len`` (``tiny``: the CI test's CPU setting); ``say`` hears each
    evaluation's line. The curves, their table and the JSON payload."""
    from nsa.bench.progress import Eta
    from nsa.config import load_run_config
    from nsa.envinfo import environment

    config, sets, variants, seeds, seq_len, gap = (req.config, list(req.sets), req.variants, req.seeds,
                                                   req.seq_len, req.gap)
    recipe = RetrievalRecipe(steps=req.steps, batch_size=req.batch, lr=req.lr, eval_every=req.eval_every,
                             eval_samples=req.eval_samples, target=req.target)

    if not variants or any(v not in VARIANTS for v in variants):
        raise ConfigError(f"--variants {','.join(variants)!r} must list {', '.join(VARIANTS)}",
                          hint="e.g. --variants dense,nsa")
    if req.tiny:
        seq_len, gap, sets = TINY_SEQ_LEN, TINY_GAP, [*TINY_SETS, *sets]
        recipe = replace(recipe, steps=TINY_STEPS, eval_every=TINY_EVAL_EVERY)
    cfg = load_run_config(config=config, sets=sets).config
    task = RetrievalTask(seq_len, gap, vocab_size=cfg.model.vocab_size)
    device = "cpu" if req.tiny or not torch.cuda.is_available() else "cuda"
    curves: list[RetrievalCurve] = []
    eta = Eta(len(seeds) * len(variants) * recipe.steps)  # every run's steps: the ETA of the whole benchmark
    for seed in seeds:
        for v in variants:
            def show(p: RetrievalPoint, v: str = v, seed: int = seed,
                     before: int = len(curves) * recipe.steps) -> None:
                if say is not None:
                    say(f"{v} seed {seed} step {p.step}: loss {p.loss:.3f} acc {p.accuracy:.3f} gates "
                        f"{p.gates} | {eta.line(before + p.step)}")

            curves.append(learn_retrieval(cfg.model, cfg.nsa, task, v, recipe=recipe, seed=seed,
                                          device=device, backend="torch" if device == "cpu" else None,
                                          on_point=show, scorer=cfg.scorer))
    table = Table.of(f"retrieval at S={seq_len}, gap >= {gap} ({device}, config {config}, {recipe.steps} "
                     "steps)", ("variant", "seed", f"steps to {recipe.target:g}", "final acc", "final loss",
                      "gates (cmp, sel, win)"))
    for c in curves:
        last = c.points[-1]
        table.add(c.variant, str(c.seed), "-" if c.steps_to_target is None else str(c.steps_to_target),
                  f"{c.final_accuracy:.3f}", f"{last.loss:.3f}", str(last.gates or "-"))
    payload = {"command": "bench retrieval", "config": config, "sets": sets, "seq_len": seq_len, "gap": gap,
               "recipe": recipe.__dict__, "nsa": cfg.nsa.model_dump(mode="json"),
               "scorer": cfg.scorer.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json"),
               "environment": environment(), "curves": [c.to_dict() for c in curves]}
    return Payload(payload, [table], indent=1)
