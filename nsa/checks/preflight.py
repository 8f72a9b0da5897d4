"""``nsa preflight``: is this machine, environment and config ready for a run?

Every check returns PASS / WARN / FAIL with a one-line reason and a fix hint. Nothing here raises for a
missing GPU, NVML library, git repository or network: those are reported. Runs in seconds (tiny shapes,
short dataset timeout).

Size: one small function per preflight check (about twenty), each independent and listed in one place.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from nsa.checks.result import Check, CheckReport, failed, passed, warned
from nsa.config import find_config, load_run_config
from nsa.config.profiles import find_profile, load_profile, profile_names
from nsa.config.resolve import default_config_note
from nsa.config.settings import describe_unknown_env, settings_table, unknown_variables
from nsa.envinfo import git_snapshot, library_versions, package_version
from nsa.errors import NSAError
from nsa.gpuinfo import query_gpus

GIB = 1024**3


class _Context:
    """What the checks share: the resolved config (if valid), the profile, torch facts."""

    def __init__(self, profile: Any, resolved: Any, environ: dict[str, str] | None, out_dir: Path) -> None:
        self.profile = profile
        self.resolved = resolved
        self.environ = environ
        self.out_dir = out_dir
        self.torch: Any = None
        self.gpu_probe: Any = None
        self.device = "cpu"

    @property
    def cfg(self) -> Any:
        return self.resolved.config if self.resolved is not None else None

    @property
    def expect(self) -> Any:
        return self.profile.expect if self.profile is not None else None


def _check_python() -> Check:
    v = sys.version_info
    text = f"Python {platform.python_version()} ({sys.executable})"
    if v < (3, 11):
        return failed("python", text + ": 3.11 or newer is required",
                      "use the project's uv environment (uv sync)")
    return passed("python", text, version=platform.python_version())


def _check_profile(ctx: _Context, name: str | None, error: NSAError | None) -> Check:
    if error is not None:
        return failed("profile", error.message, error.hint or "")
    if ctx.profile is None:
        return warned(
            "profile",
            "no profile given: hardware expectations are not checked",
            f"add --profile (one of: {', '.join(profile_names())})",
        )
    return passed("profile", f"{ctx.profile.name}: {ctx.profile.description}", profile=ctx.profile.name)


def _check_config(ctx: _Context, config: str | None, error: NSAError | None) -> Check:
    if error is not None:
        return failed("config", error.message, error.hint or "fix the config or the NSA_* variable named")
    from nsa.train.runtime import long_run_warnings

    cfg = ctx.cfg
    t = cfg.train
    what = ctx.resolved.config_path or "defaults"
    summary = (f"{Path(what).name}: {cfg.model.stack} dim {cfg.model.dim} x {cfg.model.n_layers} layers, "
               f"seq_len {t.seq_len}, batch {t.batch_size} x accum {t.accum}, {t.steps} steps")

    concerns = [*ctx.resolved.notes, *filter(None, [default_config_note(ctx.resolved)]),
                *long_run_warnings(cfg)]
    if concerns:
        return warned("config", f"{summary}; " + "; ".join(concerns),
                      "fine for a short test; for a real run set the keys named",
                      path=ctx.resolved.config_path, concerns=concerns)
    return passed("config", summary, path=ctx.resolved.config_path)


def _check_env(ctx: _Context) -> Check:
    unknown = unknown_variables(ctx.environ)
    try:
        rows = [r for r in settings_table(ctx.environ) if r["value"] is not None]
    except NSAError as exc:
        return failed("env", exc.message, exc.hint or "")
    if unknown:
        return warned(
            "env",
            f"unknown NSA_* variable(s) ignored: {'; '.join(describe_unknown_env(ctx.environ))}",
            "unset or rename them (docs/migrating.md maps the older system's knobs); `nsa profiles show` "
            "lists the known settings", unknown=unknown,
        )
    return passed("env", f"{len(rows)} NSA_* setting(s) set, no unknown names",
                  set={r["variable"]: r["value"] for r in rows})


def _check_torch(ctx: _Context) -> Check:
    t0 = time.perf_counter()
    try:
        import torch
    except Exception as exc:
        return failed("torch", f"cannot import torch: {exc}", "reinstall the environment (uv sync)")
    ctx.torch = torch
    cuda_build = torch.version.cuda
    avail = torch.cuda.is_available()
    want = ctx.cfg.runtime.device if ctx.cfg is not None else "auto"
    ctx.device = "cuda" if avail and want in ("cuda", "auto") else "cpu"
    facts = {"version": torch.__version__, "cuda_build": cuda_build, "cuda_available": avail,
             "device_count": torch.cuda.device_count() if avail else 0,
             "import_s": round(time.perf_counter() - t0, 2)}
    text = f"torch {torch.__version__}, " + (f"CUDA {cuda_build} build" if cuda_build else "CPU build")
    text += f", {facts['device_count']} CUDA device(s) visible" if avail else ", no CUDA device"
    needs_cuda = want == "cuda" or (ctx.expect is not None and ctx.expect.device == "cuda")
    if needs_cuda and not avail:
        hint = ("install a CUDA build of torch" if not cuda_build else "check the driver (nvidia-smi) and "
                                                                       "CUDA_VISIBLE_DEVICES")
        return failed("torch", text + ": the run needs CUDA", hint, **facts)
    return passed("torch", text, **facts)


def _check_triton(ctx: _Context) -> Check:
    version = package_version("triton")
    required = ctx.expect is not None and ctx.expect.requires_triton
    if version is None:
        if required:
            return failed("triton", "triton is not installed but the profile requires it", "install triton")
        return warned("triton", "triton is not installed: the torch path serves the NSA ops",
                      "install triton for GPU kernels")
    return passed("triton", f"triton {version}", version=version)


def _check_flash_attn(ctx: _Context) -> Check:
    version = package_version("flash_attn")
    required = ctx.expect is not None and ctx.expect.requires_flash_attn
    if version is None:
        if required:
            return failed("flash-attn", "flash-attn is not installed but the profile requires it",
                          "pip install flash-attn --no-build-isolation")
        return warned("flash-attn", "flash-attn not installed (optional): window branch uses SDPA/Triton",
                      "optional: pip install flash-attn --no-build-isolation")
    supported = None
    torch = ctx.torch
    if torch is not None and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(0)
        supported = major >= 8
    if supported is False:
        msg = f"flash-attn {version} installed, but this GPU is older than sm80 (unsupported)"
        return (failed if required else warned)("flash-attn", msg, "use the SDPA/Triton window backend",
                                                version=version, supports_gpu=False)
    where = "supports this GPU" if supported else "no GPU to check support on"
    return passed("flash-attn", f"flash-attn {version} ({where})", version=version, supports_gpu=supported)


def _check_gpu(ctx: _Context) -> list[Check]:
    import os


    probe = query_gpus(own_pids={os.getpid()})
    ctx.gpu_probe = probe
    exp = ctx.expect
    wants_gpu = exp is not None and exp.device == "cuda"
    if not probe.available or not probe.gpus:
        why = probe.error or "NVML sees no GPU"
        if wants_gpu:
            return [failed("gpu", f"no GPU: {why}; profile {ctx.profile.name} expects {exp.gpu_count}",
                           "run on the intended machine or pick --profile cpu")]
        if exp is not None and exp.device == "cpu":
            return [passed("gpu", f"no GPU ({why}); profile {ctx.profile.name} expects none")]
        return [warned("gpu", f"no GPU ({why})", "fine for CPU runs; GPU runs need the NVIDIA driver")]
    gpus = probe.gpus
    names = sorted({g.name for g in gpus})
    g0 = gpus[0]
    desc = (f"{len(gpus)} x {', '.join(names)}, {g0.memory_total_mib / 1024:.1f} GiB "
            f"(free {min(g.memory_free_mib for g in gpus) / 1024:.1f}), sm {g0.compute_capability}, "
            f"driver {probe.driver_version}, CUDA driver {probe.cuda_driver_version}")
    problems = []
    if exp is not None and exp.device == "cuda":
        if len(gpus) < exp.gpu_count:
            problems.append(f"{len(gpus)} GPU(s) < expected {exp.gpu_count}")
        if exp.gpu_name_pattern and not all(re.search(exp.gpu_name_pattern, g.name, re.I) for g in gpus):
            problems.append(f"name does not match /{exp.gpu_name_pattern}/")
        if exp.min_memory_gib and min(g.memory_total_mib for g in gpus) / 1024 < exp.min_memory_gib:
            problems.append(f"memory < {exp.min_memory_gib} GiB")
        cc = g0.compute_capability
        if exp.min_compute_capability and cc and float(cc) < exp.min_compute_capability:
            problems.append(f"compute capability < {exp.min_compute_capability}")
    elif exp is not None and exp.device == "cpu":
        problems = []  # a GPU on a CPU profile is fine
    facts = probe.to_dict()
    out = []
    if problems:
        out.append(failed("gpu", desc + ": " + "; ".join(problems),
                          f"use the profile of this GPU (nsa profiles list) instead of {ctx.profile.name}",
                          **facts))
    else:
        out.append(passed("gpu", desc, **facts))
    health = []
    for g in gpus:
        if g.ecc_uncorrected:
            health.append(f"GPU{g.index}: {g.ecc_uncorrected} uncorrected ECC errors")
        if g.retired_pages:
            health.append(f"GPU{g.index}: {g.retired_pages} retired pages")
        if g.temperature_c is not None and g.temperature_c >= 85:
            health.append(f"GPU{g.index}: {g.temperature_c} C")
    temps = ", ".join(f"{g.temperature_c:.0f} C" for g in gpus if g.temperature_c is not None) or "n/a"
    out.append(warned("gpu-health", "; ".join(health), "drain the node or reset the GPU before a long run")
               if health else passed("gpu-health", f"no ECC errors or retired pages; temperature {temps}"))
    busy = [f"GPU{g.index}: pid {p['pid']} holds {p['used_mib']:.0f} "
            "MiB" for g in gpus for p in g.other_processes]
    out.append(warned("gpu-busy", "; ".join(busy[:4]),
                      "stop the other processes or pick a free GPU (CUDA_VISIBLE_DEVICES)")
               if busy else passed("gpu-busy", "no other processes hold GPU memory"))
    return out


def _check_layout(ctx: _Context) -> Check:
    """The run's data x context layout against this node's GPUs: enough of them, and the GPUs that share a
    sequence (``runtime.context_parallel``, adjacent ranks) connected peer to peer (NVLink best)."""
    cfg, probe = ctx.cfg, ctx.gpu_probe
    cp = cfg.runtime.context_parallel if cfg is not None else 1
    gpus = list(probe.gpus) if probe is not None and probe.available else []
    if not gpus:
        if cp > 1 and cfg is not None and cfg.runtime.device == "cuda":
            return failed("layout", f"runtime.context_parallel={cp} needs {cp} GPUs; none visible",
                          "run on the GPU machine, or lower --context-parallel")
        return passed("layout", f"no GPU: ranks on CPUs (gloo){f', {cp} per sequence' if cp > 1 else ''}")
    n = len(gpus)
    if cp > n:
        return failed("layout", f"runtime.context_parallel={cp} needs {cp} GPUs of one node; {n} visible",
                      f"lower --context-parallel to {n} or less, or run on a node with {cp} GPUs")
    groups = [list(range(g, g + cp)) for g in range(0, n - n % cp, cp)] if cp > 1 else [list(range(n))]
    kinds = {probe.link(i, j) for grp in groups for i in grp for j in grp if i < j}
    grid = f"{n // cp} data x {cp} context" if cp > 1 else f"{n} data"
    if n == 1:
        return passed("layout", "one GPU: one rank (--nproc-per-node 1)")
    if "none" in kinds:
        pairs = [f"{i}-{j}" for grp in groups for i in grp for j in grp if i < j and probe.link(i, j)
                 == "none"]
        return warned("layout", f"{n} GPUs ({grid} with --nproc-per-node {n}): no peer-to-peer path between "
                      f"GPUs {', '.join(pairs[:4])}: {'the ranks of a sequence' if cp > 1 else 'gradient'} "
                      "traffic goes through host memory",
                      "check nvidia-smi topo -m; keep the ranks of a sequence on linked GPUs")
    how = "NVLink" if kinds == {"nvlink"} else "PCIe peer-to-peer" if kinds == {"p2p"} else (
        "NVLink and PCIe" if kinds <= {"nvlink", "p2p"} and kinds else "links not reported by NVML")
    extra = f"; {n % cp} GPU(s) left over" if cp > 1 and n % cp else ""
    return passed("layout", f"{n} GPUs ({grid} with --nproc-per-node {n - n % cp}), {how}{extra}")


def _check_bf16(ctx: _Context) -> Check:
    """Whether ``nsa train`` runs bf16 here: the trainer's own answer (``nsa.train.runtime.bf16_support``), so
    preflight never calls bf16 supported where training refuses it (the CPU)."""
    if ctx.torch is None:
        return failed("bf16", "torch unavailable", "see the torch check")
    from nsa.train.runtime import BF16_HINT, bf16_support

    need = (ctx.expect is not None and ctx.expect.bf16) or (ctx.cfg is not None and ctx.cfg.runtime.precision
                                                            == "bf16")
    ok, where = bf16_support(ctx.device, 0 if ctx.device == "cuda" else None)
    if ok:
        return passed("bf16", f"bf16 supported on {where}")
    if need:
        return failed("bf16", f"runtime.precision=bf16 is not supported on {where} (nsa train refuses it)",
                      BF16_HINT)
    if ctx.device != "cuda":
        return passed("bf16", "not used on the CPU: nsa train runs fp32 there (bf16 autocast is for GPUs)")
    return warned("bf16", f"bf16 not supported on {where}: nsa train runs fp32",
                  "use a GPU with bf16 for speed")


def _check_parity(ctx: _Context) -> Check:
    from nsa.checks.parity import check_backend
    from nsa.ops import available_backends, requested_backend

    wanted = ctx.cfg.runtime.attn_backend if ctx.cfg is not None else requested_backend()
    avail = available_backends(ctx.device)
    if wanted == "auto":
        wanted = "triton" if ctx.device == "cuda" and "triton" in avail else "torch"
    if wanted not in avail:
        return failed("nsa-parity",
                      f"backend '{wanted}' cannot run on {ctx.device} (available: {', '.join(avail)})",
                      "set NSA_ATTN_BACKEND=auto or install triton")
    dtype = "bfloat16" if ctx.device == "cuda" else "float32"
    res = check_backend(wanted, ctx.device, dtype)
    text = (f"{wanted} on {ctx.device} ({dtype}) vs reference: fwd {res.max_fwd_err:.1e}, "
            f"grad {res.max_grad_err:.1e} (tol {res.atol:.0e})")
    if res.fallbacks:
        return failed("nsa-parity", text + f"; {res.fallbacks} fallback(s)",
                      "run nsa smoke to see which backend fell back", **res.to_dict())
    if not res.ok:
        return failed("nsa-parity", text + ": mismatch",
                      "do not train on this backend; report it with nsa smoke output", **res.to_dict())
    return passed("nsa-parity", text, **res.to_dict())


def _check_triton_compile(ctx: _Context) -> Check:
    if ctx.device != "cuda":
        return warned("triton-compile", "skipped: no CUDA device to compile for", "runs on GPU machines")
    from nsa.checks.triton_probe import compile_and_run

    ok, msg = compile_and_run()
    if ok:
        return passed("triton-compile", msg)
    hint = "check TRITON_CACHE_DIR is writable and the CUDA toolkit/ptxas matches the driver"
    required = ctx.expect is not None and ctx.expect.requires_triton
    return (failed if required else warned)("triton-compile", msg, hint)


def _check_sdpa(ctx: _Context) -> Check:
    torch = ctx.torch
    if torch is None:
        return failed("sdpa-backends", "torch unavailable")
    if ctx.device != "cuda":
        return passed("sdpa-backends", "CPU: torch SDPA (math / flash-cpu kernels)")
    b = torch.backends.cuda
    enabled = {
        "flash": b.flash_sdp_enabled(),
        "mem_efficient": b.mem_efficient_sdp_enabled(),
        "cudnn": getattr(b, "cudnn_sdp_enabled", lambda: False)(),
        "math": b.math_sdp_enabled(),
    }
    major, minor = torch.cuda.get_device_capability(0)
    flash_ok = enabled["flash"] and major >= 8
    text = "enabled: " + ", ".join(k for k, v in enabled.items() if v) + f"; sm{major}{minor}"
    if not flash_ok:
        return warned("sdpa-backends", text + ": no flash SDPA on this GPU",
                      "expect slower dense/window attention", **enabled)
    return passed("sdpa-backends", text + ", flash SDPA usable", **enabled)


NCCL_OFF = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "IB_DISABLE")  # IB_DISABLE: the older checklist's spelling


def _check_nccl(ctx: _Context) -> Check:
    """NCCL's peer-to-peer and InfiniBand transports must stay on (the older checklist required
    ``NCCL_P2P_DISABLE=0`` and ``NCCL_IB_DISABLE=0``): disabled, a multi-GPU run is slower and imbalanced."""
    env = os.environ if ctx.environ is None else ctx.environ
    off = [f"{k}={env[k]}" for k in NCCL_OFF
           if env.get(k, "").strip().lower() not in ("", "0", "false", "no", "off")]
    if off:
        return warned("nccl", f"{', '.join(off)}: NCCL transports switched off (multi-GPU traffic goes "
                      "through host memory or plain sockets)",
                      f"unset {', '.join(o.split('=')[0] for o in off)} unless " "the fabric really lacks "
                                                                                 "them", disabled=off)
    return passed("nccl",
                  "NCCL P2P and InfiniBand not disabled (NCCL_P2P_DISABLE / NCCL_IB_DISABLE unset or 0)")


def _check_disk(ctx: _Context) -> Check:
    import psutil

    p = ctx.out_dir.resolve()
    while not p.exists():
        p = p.parent
    free = psutil.disk_usage(str(p)).free / GIB
    need = ctx.expect.min_disk_gib if ctx.expect is not None else 1.0
    text = f"{free:.1f} GiB free at {p}"
    if free < need:
        return failed("disk", text + f" (< {need} GiB)",
                      "free space or set --out-dir / train.out_dir elsewhere", free_gib=free)
    if free < 2 * need:
        return warned("disk", text + f" (tight: profile wants {need} GiB)", "free space for checkpoints",
                      free_gib=free)
    return passed("disk", text, free_gib=free)


def _check_ram() -> Check:
    import psutil

    vm = psutil.virtual_memory()
    text = f"{vm.available / GIB:.1f} GiB available of {vm.total / GIB:.1f} GiB"
    return passed("ram", text, total_gib=vm.total / GIB, available_gib=vm.available / GIB)


def _check_ram_expect(ctx: _Context) -> Check:
    c = _check_ram()
    need = ctx.expect.min_ram_gib if ctx.expect is not None else 1.0
    if c.details["available_gib"] < need:
        return failed("ram", c.reason + f" (< {need} GiB)", "stop other jobs or lower data.prefetch_depth",
                      **c.details)
    return c


def _check_dataset(ctx: _Context, timeout_s: float) -> Check:
    if ctx.cfg is None:
        return failed("dataset", "skipped: the config is invalid", "fix the config first")
    try:
        from nsa.data.sources import open_source_probe
    except ImportError as exc:
        return warned("dataset", f"dataset probe unavailable ({exc.name} not importable)",
                      "update the checkout")
    data = ctx.cfg.data.model_copy(update={"timeout_s": min(ctx.cfg.data.timeout_s, timeout_s)})
    try:
        msg = open_source_probe(data, timeout_s)
    except NSAError as exc:
        if ctx.cfg.data.synthetic_on_fail:
            return warned("dataset", exc.message + " (synthetic_on_fail: the run would use synthetic data)",
                          exc.hint or "")
        return failed("dataset", exc.message, exc.hint or "use data.source=embedded or a local path")
    return passed("dataset", msg, source=ctx.cfg.data.source)


def _check_tokenizer(ctx: _Context) -> Check:
    if ctx.cfg is None:
        return failed("tokenizer", "skipped: the config is invalid", "fix the config first")
    from nsa.data.tokenizers import get_tokenizer

    data = ctx.cfg.data
    try:
        tok = get_tokenizer(data.tokenizer, data.tokenizer_path)
    except NSAError as exc:
        return failed("tokenizer", exc.message, exc.hint or "")
    vocab = ctx.cfg.model.vocab_size
    text = f"{tok.name}: vocab {tok.vocab_size}"
    if tok.vocab_size > vocab:
        return failed("tokenizer", text + f" > model.vocab_size {vocab}",
                      f"set model.vocab_size >= {tok.vocab_size}")
    return passed("tokenizer", text, vocab_size=tok.vocab_size)


def _check_git(facts: dict[str, Any]) -> Check:
    snap = git_snapshot()
    facts["git"] = snap
    if not snap.get("available"):
        return warned("git", f"no git snapshot: {snap.get('error')}",
                      "run from a git checkout so reports can pin the code")
    text = f"branch {snap['branch'] or '(detached)'} @ {snap['short'] or '(no commit)'}"
    if snap["dirty"]:
        return warned("git", text + f", {snap['dirty_count']} uncommitted change(s)",
                      "commit first, or note the dirty files in the report", **snap)
    return passed("git", text + ", clean", **snap)


def versions() -> dict[str, Any]:
    """Python/torch/CUDA/triton/flash-attn versions (imports torch)."""
    v = library_versions()
    return {"python": v["python"], "platform": platform.platform(), "torch": v["torch"], "cuda": v["cuda"],
            "triton": v["triton"], "flash_attn": v["flash_attn"]}


def run_preflight(
    profile: str | None = None,
    config: str | None = None,
    *,
    environ: dict[str, str] | None = None,
    out_dir: str | Path | None = None,
    data_timeout_s: float = 10.0,
    sets: list[str] | None = None,
) -> CheckReport:
    """Run every check; a problem becomes a FAIL or WARN in the report, never an exception."""

    report = CheckReport("preflight")
    # a profile or config that does not exist is a usage error (ConfigError, exit 2); an invalid one is a FAIL
    if profile is not None:
        find_profile(profile)
    if config is not None:
        find_config(config)
    prof = None
    prof_err = cfg_err = None
    resolved = None
    if profile is not None:
        try:
            prof = load_profile(profile)
        except NSAError as exc:
            prof_err = exc
    try:
        resolved = load_run_config(config, profile=profile if prof is not None else None, environ=environ,
                                   sets=sets)
        if prof is None and resolved.profile:  # NSA_PROFILE
            prof = load_profile(resolved.profile)
    except NSAError as exc:
        cfg_err = exc
    if out_dir is None:
        out_dir = resolved.config.train.out_dir if resolved is not None else "artifacts"
    ctx = _Context(prof, resolved, environ, Path(out_dir))

    report.run("python", _check_python)
    report.run("profile", lambda: _check_profile(ctx, profile, prof_err))
    report.run("config", lambda: _check_config(ctx, config, cfg_err))
    report.run("env", lambda: _check_env(ctx))
    report.run("torch", lambda: _check_torch(ctx))
    report.run("triton", lambda: _check_triton(ctx))
    report.run("flash-attn", lambda: _check_flash_attn(ctx))
    report.run("gpu", lambda: _check_gpu(ctx))
    report.run("layout", lambda: _check_layout(ctx))
    report.run("bf16", lambda: _check_bf16(ctx))
    report.run("nsa-parity", lambda: _check_parity(ctx))
    report.run("triton-compile", lambda: _check_triton_compile(ctx))
    report.run("sdpa-backends", lambda: _check_sdpa(ctx))
    report.run("nccl", lambda: _check_nccl(ctx))
    report.run("disk", lambda: _check_disk(ctx))
    report.run("ram", lambda: _check_ram_expect(ctx))
    report.run("dataset", lambda: _check_dataset(ctx, data_timeout_s))
    report.run("tokenizer", lambda: _check_tokenizer(ctx))
    report.run("git", lambda: _check_git(report.facts))

    report.facts.update(
        {
            "profile": prof.name if prof else None,
            "config_path": resolved.config_path if resolved else None,
            "device": ctx.device,
            "versions": versions(),
            "gpu": ctx.gpu_probe.to_dict() if ctx.gpu_probe is not None else None,
        }
    )
    return report
