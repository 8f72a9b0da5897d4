"""``nsa bench retrieval``: does the model learn long-range retrieval, and in how many steps?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli import options
from nsa_cli.compat import command_class
from nsa_cli.errors import fail, user_errors

# --tiny: the CPU setting of the CI regression test (tests/test_retrieval_learning.py)
TINY_SEQ_LEN, TINY_GAP, TINY_STEPS, TINY_EVAL_EVERY = 128, 48, 1200, 50
TINY_SETS = ["model.dim=32", "model.n_heads=4", "model.d_k=8", "model.d_v=8", "model.n_layers=2",
             "model.mlp_hidden=128", "nsa.l=8", "nsa.d=4", "nsa.l_sel=16", "nsa.n_sel=4", "nsa.w=16"]


def retrieval(
    config: Annotated[str, typer.Option("--config", help=options.config_help("Config of the model and nsa sections"))] = "retrieval",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value; repeatable.")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", min=8, help="Model inputs per sequence.")] = 2048,
    gap: Annotated[int, typer.Option("--gap", min=1, help="The needle sits at least this many positions before the query.")] = 600,
    variants: Annotated[str, typer.Option("--variants", help="Comma-separated: nsa, dense, window (NSA's window branch alone).")] = "dense,nsa",
    seeds: Annotated[str, typer.Option("--seeds", help="Comma-separated seeds; each variant trains once per seed.")] = "0",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 6000,
    batch: Annotated[int, typer.Option("--batch", min=1)] = 16,
    lr: Annotated[float, typer.Option("--lr", min=0.0)] = 1e-3,
    eval_every: Annotated[int, typer.Option("--eval-every", min=1)] = 100,
    eval_samples: Annotated[int, typer.Option("--eval-samples", min=1)] = 256,
    target: Annotated[float, typer.Option("--target", min=0.0, max=1.0, help="Accuracy whose first step is reported.")] = 0.5,
    tiny: Annotated[bool, typer.Option("--tiny", help="CPU-sized run (the CI test's setting): 2-layer dim-32 model, S=128, gap 48, 1200 steps; overrides --seq-len, --gap, --steps.")] = False,
    as_json: Annotated[bool, options.json_flag("the curves and environment")] = False,
    json_out: Annotated[Path | None, options.json_out("the curves and environment")] = None,
) -> None:
    """Train each variant from scratch on key/value retrieval beyond the window; report steps to --target."""
    with user_errors():
        from rich.console import Console
        from rich.table import Table

        from nsa.bench.progress import Eta
        from nsa.bench.retrieval import VARIANTS, RetrievalRecipe, learn_retrieval
        from nsa.config import load_run_config
        from nsa.data.retrieval import RetrievalTask
        from nsa.envinfo import environment
        from nsa_cli import render

        names = [v for v in variants.replace(" ", "").split(",") if v]
        if not names or any(v not in VARIANTS for v in names):
            raise fail(f"--variants {variants!r} must list {', '.join(VARIANTS)}", hint="e.g. --variants dense,nsa")
        try:
            seed_list = [int(s) for s in seeds.replace(" ", "").split(",") if s]
        except ValueError:
            raise fail(f"--seeds {seeds!r} must be comma-separated integers", hint="e.g. --seeds 0,1") from None
        sets = list(set_ or [])
        if tiny:
            seq_len, gap, steps, eval_every = TINY_SEQ_LEN, TINY_GAP, TINY_STEPS, TINY_EVAL_EVERY
            sets = [*TINY_SETS, *sets]
        cfg = load_run_config(config=config, sets=sets).config
        task = RetrievalTask(seq_len, gap, vocab_size=cfg.model.vocab_size)
        recipe = RetrievalRecipe(steps=steps, batch_size=batch, lr=lr, eval_every=eval_every,
                                 eval_samples=eval_samples, target=target)
        import torch

        device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
        console = Console(width=200, stderr=as_json)
        curves: list[Any] = []
        eta = Eta(len(seed_list) * len(names) * steps)  # every run's steps: the ETA of the whole benchmark
        for seed in seed_list:
            for v in names:
                def show(p: Any, v: str = v, seed: int = seed, before: int = len(curves) * steps) -> None:
                    console.print(f"{v} seed {seed} step {p.step}: loss {p.loss:.3f} acc {p.accuracy:.3f} "
                                  f"gates {p.gates} | {eta.line(before + p.step)}", highlight=False)

                curves.append(learn_retrieval(cfg.model, cfg.nsa, task, v, recipe=recipe, seed=seed, device=device,
                                              backend="torch" if device == "cpu" else None, on_point=show,
                                              scorer=cfg.scorer))
        table = Table(title=f"retrieval at S={seq_len}, gap >= {gap} ({device}, config {config}, {steps} steps)")
        for col in ("variant", "seed", f"steps to {target:g}", "final acc", "final loss", "gates (cmp, sel, win)"):
            table.add_column(col, justify="right")
        for c in curves:
            last = c.points[-1]
            table.add_row(c.variant, str(c.seed), "-" if c.steps_to_target is None else str(c.steps_to_target),
                          f"{c.final_accuracy:.3f}", f"{last.loss:.3f}", str(last.gates or "-"))
        console.print(table)
        payload = {"command": "bench retrieval", "config": config, "sets": sets, "seq_len": seq_len, "gap": gap,
                   "recipe": recipe.__dict__, "nsa": cfg.nsa.model_dump(mode="json"),
                   "scorer": cfg.scorer.model_dump(mode="json"),
                   "model": cfg.model.model_dump(mode="json"), "environment": environment(),
                   "curves": [c.to_dict() for c in curves]}
        render.json_outputs(payload, as_json=as_json, json_out=json_out, indent=1)


def register(app: typer.Typer) -> None:
    """Attach ``nsa bench retrieval``."""
    app.command("retrieval", cls=command_class(json_path=True))(retrieval)
