"""Facts about the environment a run, check or benchmark ran in, gathered in one place: package versions,
the git checkout of the code (GitPython), NVIDIA driver and GPUs (NVML). Never raises; torch is imported
only by :func:`library_versions`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import platform
from pathlib import Path
from typing import Any


def package_version(dist: str) -> str | None:
    """Installed version of a distribution (``flash-attn``), else of an importable module's
    ``__version__`` (``fla``), else None."""
    # no metadata: the module's own version
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    try:
        mod = importlib.import_module(dist.replace("-", "_"))
    except Exception:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def library_versions() -> dict[str, Any]:
    """Python, torch, CUDA, cuDNN, triton, flash-attn, numpy and datasets versions (imports torch)."""
    out: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        cuda = torch.version.cuda if torch.cuda.is_available() else None
        out.update(torch=torch.__version__, cuda=cuda, cudnn=torch.backends.cudnn.version() if cuda else None)
    except Exception:
        out.update(torch=None, cuda=None, cudnn=None)
    out.update(nsa=package_version("nsa"), triton=package_version("triton"),
               flash_attn=package_version("flash-attn"), numpy=package_version("numpy"),
               datasets=package_version("datasets"))
    return out


def git_snapshot(path: str | Path | None = None, max_files: int = 50) -> dict[str, Any]:
    """``{available, branch, commit, dirty, dirty_files, error}``; never raises."""
    start = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        import git
    except ImportError:
        return {"available": False, "error": "GitPython is not installed"}
    try:
        repo = git.Repo(start, search_parent_directories=True)
    except Exception as exc:
        return {"available": False, "error": f"not a git repository ({type(exc).__name__})"}
    try:
        try:
            commit = repo.head.commit.hexsha
        except ValueError:
            commit = None
        try:
            branch: str | None = repo.active_branch.name
        except TypeError:
            branch = None  # detached HEAD
        changed: list[str] = [d.a_path for d in repo.index.diff(None) if d.a_path]
        if commit is not None:
            changed += [d.a_path for d in repo.index.diff("HEAD") if d.a_path]
        untracked = repo.untracked_files
        files = sorted(set(changed)) + [f"?? {f}" for f in sorted(untracked)]
        return {
            "available": True,
            "root": str(repo.working_tree_dir),
            "branch": branch,
            "commit": commit,
            "short": commit[:12] if commit else None,
            "dirty": bool(files),
            "dirty_count": len(files),
            "dirty_files": files[:max_files],
        }
    except Exception as exc:
        return {"available": False, "error": f"git query failed ({type(exc).__name__}: {exc})"}
    finally:
        repo.close()


def git_info(start: Path | None = None) -> dict[str, Any]:
    """Commit, branch and dirty flag of the checkout that holds the code (nulls outside a checkout)."""
    try:
        import git

        repo = git.Repo(start or Path(__file__).resolve().parent, search_parent_directories=True)
        try:
            branch = repo.active_branch.name
        except TypeError:
            branch = "DETACHED"
        return {
            "commit": repo.head.commit.hexsha,
            "branch": branch,
            "dirty": repo.is_dirty(untracked_files=False),
        }
    except Exception as exc:  # not a checkout, no git binary, empty repo
        return {"commit": None, "branch": None, "dirty": None, "error": type(exc).__name__}


def gpu_info() -> dict[str, Any]:
    """Driver version and GPU names via NVML (nulls where there is no NVIDIA driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            names = [
                pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(pynvml.nvmlDeviceGetCount())
            ]
        finally:
            pynvml.nvmlShutdown()
        as_str = [n.decode() if isinstance(n, bytes) else n for n in names]
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver, "gpus": as_str}
    except Exception:
        return {"driver": None, "gpus": []}


def environment() -> dict[str, Any]:
    """Date, device and library versions recorded with every benchmark and evaluation result."""
    import datetime

    out: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
                         or "cpu")
    except Exception:
        out.update(torch=None, device=platform.processor() or "cpu")
    out["triton"] = package_version("triton")
    out["fla_core"] = package_version("fla-core") or package_version("fla")
    return out


def quietly(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None if it raises (NVML calls a device may not support)."""
    try:
        return fn(*args)
    except Exception:
        return None


class GpuProbe:
    """One device through NVML, for the heartbeat. ``read()``: its memory errors ``{"ecc_uncorrected",
    "retired_pages"}`` (volatile uncorrected ECC errors since the driver loaded; pages retired for double-bit
    errors); ``usage()``: ``{"gpu_util_pct", "gpu_mem_used_mib"}`` (utilisation over the driver's last sample
    period and memory used by every process: what ``nvidia-smi dmon`` shows). Each is None when NVML cannot
    say (no library, no ECC support, the device not found) and never raises. Xid events are not counters NVML
    keeps; they are in the kernel log."""

    def __init__(self, uuid: str | None) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        if not uuid:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:
            self.close()

    def read(self) -> dict[str, int] | None:
        nv, h = self._nvml, self._handle
        if nv is None or h is None:
            return None
        ecc = quietly(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                      nv.NVML_VOLATILE_ECC)
        pages = quietly(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        out = {k: int(v) for k,
               v in (("ecc_uncorrected", ecc), ("retired_pages", len(pages) if pages is not None else None))
               if v is not None}
        return out or None

    def usage(self) -> dict[str, float | None]:
        nv, h = self._nvml, self._handle
        if nv is None or h is None:
            return {"gpu_util_pct": None, "gpu_mem_used_mib": None}
        util = quietly(nv.nvmlDeviceGetUtilizationRates, h)
        mem = quietly(nv.nvmlDeviceGetMemoryInfo, h)
        return {"gpu_util_pct": float(util.gpu) if util is not None else None,
                "gpu_mem_used_mib": mem.used / 2**20 if mem is not None else None}

    def close(self) -> None:
        if self._nvml is not None:
            quietly(self._nvml.nvmlShutdown)
        self._nvml = self._handle = None
