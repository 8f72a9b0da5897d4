"""``nsa sample``: continue a prompt with a trained model, streaming the text as it is generated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nsa_cli.errors import fail, user_errors


def sample(
    path: Annotated[Path, typer.Argument(help="Run directory, its export/ folder, a checkpoint folder or file.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue (empty: start a new document).")] = "",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 = greedy.")] = 0.8,
    top_k: Annotated[int | None, typer.Option("--top-k", min=1, help="Sample among the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the sampler (reproducible output).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    stop_at_eot: Annotated[bool, typer.Option("--stop-at-eot/--no-stop-at-eot",
                                              help="Stop at the end-of-document token.")] = True,
    cuda_graph: Annotated[bool, typer.Option("--cuda-graph/--no-cuda-graph",
                                             help="Replay each decode step as a CUDA graph (CUDA only).")] = False,
) -> None:
    """Generate a continuation of --prompt with the run's exported model (or newest checkpoint).

    Example: nsa sample artifacts/tiny --prompt "Once upon a time" --max-new-tokens 100 --seed 1
    """
    with user_errors():
        import torch

        from nsa.data.tokenizers import get_tokenizer
        from nsa.model.generate import generate_stream
        from nsa.model.load import load_model

        if device not in ("auto", "cpu", "cuda"):
            raise fail(f"--device {device!r} must be auto, cpu or cuda")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise fail("--device cuda but no CUDA device is visible", hint="use --device cpu")
        loaded = load_model(path, device="cpu")
        cfg = loaded.config
        if device == "cuda":  # the run's precision on GPU; float32 on CPU
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.runtime.precision, torch.float32)
            loaded.model.to(device=device, dtype=dtype)
        tok = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
        ids = tok.encode(prompt) or [tok.eot_id]
        limit = cfg.model.max_seq_len
        if len(ids) + max_new_tokens > limit:
            raise fail(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                       f"model.max_seq_len={limit}")
        if any(i >= cfg.model.vocab_size for i in ids):
            raise fail(f"the tokenizer '{cfg.data.tokenizer}' produced ids beyond model.vocab_size="
                       f"{cfg.model.vocab_size}")
        typer.echo(f"[{loaded.source}, {device}, {len(ids)} prompt tokens]", err=True)
        prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)
        new: list[int] = []
        printed = ""
        for t in generate_stream(loaded.model, prompt_ids, max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, cuda_graph=cuda_graph):
            token = int(t[0])
            if stop_at_eot and token == tok.eot_id:
                break
            new.append(token)
            text = tok.decode(new)
            if text.endswith("\ufffd") or not text.startswith(printed):
                continue  # an incomplete multi-byte character: wait for the rest
            typer.echo(text[len(printed) :], nl=False)
            printed = text
        text = tok.decode(new)
        typer.echo(text[len(printed) :] if text.startswith(printed) else "\n" + text)


def register(app: typer.Typer) -> None:
    app.command("sample")(sample)
