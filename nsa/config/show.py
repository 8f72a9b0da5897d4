"""``nsa profiles list|show``: the hardware profiles, and what one resolves to with the origin of every
value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nsa.config.profiles import Profile, list_profiles, load_profile
from nsa.config.resolve import ResolvedConfig, leaves, load_run_config
from nsa.config.settings import settings_table
from nsa.view import Block, Line, Result, Table


def _fig(v: float | None, spec: str) -> str:
    return format(v, spec) if v else "-"


@dataclass
class Profiles(Result):
    """Every shipped profile."""

    profiles: list[Profile]

    def to_dict(self) -> Any:
        return [p.model_dump(mode="json") for p in self.profiles]

    def view(self) -> list[Block]:
        t = Table.of("hardware profiles",
                     ("name", "device", "GPU", "min GiB", "sm", "batch x accum @ S", "smoke",
                                           "description"), "left", title_left=True)
        for p in self.profiles:
            e, tr, s = p.expect, p.train, p.smoke
            t.add(p.name, e.device, e.gpu_name_pattern or "-", _fig(e.min_memory_gib, "g"),
                  _fig(e.min_compute_capability, ".1f"),
                  f"{tr.batch_size or '-'} x {tr.accum or '-'} @ {tr.seq_len or '-'}",
                  f"{s.config}, {s.steps} steps, >= {s.min_tokens_per_s:g} tok/s", p.description)
        return [t]


def profile_list() -> Profiles:
    return Profiles(list_profiles())


@dataclass
class ProfileShow(Result):
    """A profile's expectations and the run config it resolves to (``rows``: key, value, source)."""

    profile: Profile
    config: str | None
    resolved: ResolvedConfig
    rows: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.model_dump(mode="json"), "env": self.profile.env(),
                "resolved": self.rows, "unknown_env": self.resolved.unknown_env, "notes": self.resolved.notes,
                "environment_settings": self.environment}

    def view(self) -> list[Block]:
        p, e, s, r = self.profile, self.profile.expect, self.profile.smoke, self.resolved
        t = Table.of(f"resolved config ({self.config or 'defaults'} + profile {p.name} + environment)",
                     ("key", "value", "source"), "left", title_left=True)
        for row in self.rows:
            src = row["source"]
            t.add(row["key"], str(row["value"]), (src, "cyan" if src.startswith("profile") else
                                                   "magenta" if src.startswith("env") else ""))
        out: list[Block] = [
            Line(f"{p.name}: {p.description}  ({p.path})", "strong", lead=len(p.name)),
            Line(f"expects: {e.device}, {e.gpu_count} GPU(s) matching /{e.gpu_name_pattern or '.*'}/, "
                 f">= {e.min_memory_gib or 0:g} GiB, sm >= {e.min_compute_capability or 0:g}, "
                 f"bf16 {'required' if e.bf16 else 'optional'}, flash-attn "
                 f"{'required' if e.requires_flash_attn else 'optional'}, "
                 f"triton {'required' if e.requires_triton else 'optional'}"),
            Line(f"smoke: {s.config}, {s.steps} steps, >= {s.min_tokens_per_s:g} tokens/s, fetch p95 <= "
                 f"{s.max_fetch_p95_ms:g} ms"),
            Line("settings (as NSA_* variables): " + " ".join(f"{k}={v}" for k, v in p.env().items())), t]
        out += [Line(f"note: {note}", "caution", err=True, lead=4) for note in r.notes]
        if r.unknown_env:
            out.append(Line("warning: unknown NSA_* variable(s) ignored: "
                            f"{'; '.join(r.unknown_env_described)} " "(hint: docs/migrating.md maps the "
                            "older system's knobs; known names are in nsa/config/settings.py)", "caution",
                            err=True, lead=7))
        return out


def show_profile(name: str, config: str | None = None, show_all: bool = False) -> ProfileShow:
    """``name``'s profile and the config ``config`` resolves to under it (every key with ``show_all``, else
    those not at their defaults), with the origin of each value."""
    prof = load_profile(name)
    resolved = load_run_config(config, profile=name)
    values = leaves(resolved.config.model_dump(mode="json"))
    rows = [{"key": k, "value": v, "source": resolved.source_of(k)} for k, v in values.items()
            if show_all or resolved.source_of(k) != "default"]
    env = {r["variable"]: r["value"] for r in settings_table() if r["value"] is not None}
    return ProfileShow(prof, config, resolved, rows, env)
