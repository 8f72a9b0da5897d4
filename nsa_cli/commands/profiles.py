"""``nsa profiles list|show``: the hardware profiles and the settings they resolve to."""

from __future__ import annotations

from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.errors import user_errors

EPILOG = """\
Examples:

  nsa profiles list

  nsa profiles show h100-80g

  nsa profiles show cpu --config tiny --json

  NSA_PREFETCH_DEPTH=16 nsa profiles show a100-80g --config m7c-125m   # the env value wins

Precedence, lowest to highest: defaults < config < profile < NSA_* environment < flags.
"""

profiles_app = typer.Typer(
    help="List hardware profiles and show what one resolves to (and where each value comes from).",
    no_args_is_help=True,
    epilog=EPILOG,
)


@profiles_app.command("list", epilog="Example: nsa profiles list --json")
def list_cmd(as_json: Annotated[bool, options.json_flag("the profiles")] = False) -> None:
    """Every shipped profile with its GPU expectation and training defaults."""
    from nsa_cli import render

    with user_errors():
        from nsa.config.profiles import list_profiles

        profs = list_profiles()
    if as_json:
        render.print_json([p.model_dump(mode="json") for p in profs])
        return
    from rich.table import Table

    t = Table(title="hardware profiles", title_justify="left")
    for col in ("name", "device", "GPU", "min GiB", "sm", "batch x accum @ S", "smoke", "description"):
        t.add_column(col)
    for p in profs:
        e, tr = p.expect, p.train
        t.add_row(
            p.name, e.device, e.gpu_name_pattern or "-", render.fmt_num(e.min_memory_gib, "g") if e.min_memory_gib else "-",
            render.fmt_num(e.min_compute_capability, ".1f") if e.min_compute_capability else "-",
            f"{tr.batch_size or '-'} x {tr.accum or '-'} @ {tr.seq_len or '-'}",
            f"{p.smoke.config}, {p.smoke.steps} steps, >= {p.smoke.min_tokens_per_s:g} tok/s",
            p.description,
        )
    render.console().print(t)


@profiles_app.command("show", epilog=EPILOG)
def show_cmd(
    name: Annotated[str, typer.Argument(help="Profile name or YAML path.")],
    config: Annotated[str | None, typer.Option("--config", "-c", help=options.config_help("Run config to resolve against"))] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Also list keys left at their defaults.")] = False,
    as_json: Annotated[bool, options.json_flag("the profile and the resolved config")] = False,
) -> None:
    """The profile's expectations and the resolved run config with the origin of every value."""
    from nsa_cli import render

    with user_errors():
        from nsa.config import leaves, load_run_config
        from nsa.config.profiles import load_profile
        from nsa.config.settings import settings_table

        prof = load_profile(name)
        resolved = load_run_config(config, profile=name)
        values = leaves(resolved.config.model_dump(mode="json"))
        env_rows = [r for r in settings_table() if r["value"] is not None]
    rows = [
        {"key": k, "value": v, "source": resolved.source_of(k)}
        for k, v in values.items()
        if show_all or resolved.source_of(k) != "default"
    ]
    if as_json:
        render.print_json({
            "profile": prof.model_dump(mode="json"),
            "env": prof.env(),
            "resolved": rows,
            "unknown_env": resolved.unknown_env,
            "notes": resolved.notes,
            "environment_settings": {r["variable"]: r["value"] for r in env_rows},
        })
        return
    from rich.table import Table

    con = render.console()
    con.print(f"[bold]{prof.name}[/]: {prof.description}  ({prof.path})")
    e = prof.expect
    con.print(
        f"expects: {e.device}, {e.gpu_count} GPU(s) matching /{e.gpu_name_pattern or '.*'}/, "
        f">= {e.min_memory_gib or 0:g} GiB, sm >= {e.min_compute_capability or 0:g}, "
        f"bf16 {'required' if e.bf16 else 'optional'}, flash-attn {'required' if e.requires_flash_attn else 'optional'}, "
        f"triton {'required' if e.requires_triton else 'optional'}"
    )
    s = prof.smoke
    con.print(f"smoke: {s.config}, {s.steps} steps, >= {s.min_tokens_per_s:g} tokens/s, fetch p95 <= {s.max_fetch_p95_ms:g} ms")
    con.print("settings (as NSA_* variables): " + " ".join(f"{k}={v}" for k, v in prof.env().items()))
    t = Table(title=f"resolved config ({config or 'defaults'} + profile {prof.name} + environment)", title_justify="left")
    t.add_column("key")
    t.add_column("value")
    t.add_column("source")
    for r in rows:
        style = "cyan" if r["source"].startswith("profile") else "magenta" if r["source"].startswith("env") else ""
        t.add_row(r["key"], str(r["value"]), f"[{style}]{r['source']}[/]" if style else r["source"])
    con.print(t)
    err = render.console(stderr=True)
    for note in resolved.notes:
        err.print(f"[bold yellow]note[/]: {note}", highlight=False)
    if resolved.unknown_env:
        err.print(
            f"[bold yellow]warning[/]: unknown NSA_* variable(s) ignored: "
            f"{'; '.join(resolved.unknown_env_described)} "
            "(hint: docs/migrating.md maps the older system's knobs; known names are in nsa/config/settings.py)",
            highlight=False,
        )


def register(app: typer.Typer) -> None:
    app.add_typer(profiles_app, name="profiles")
