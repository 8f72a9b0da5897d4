"""GPU facts through NVML (nvidia-ml-py). Every failure is reported, never raised."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from nsa.envinfo import quietly

MIB = 1024 * 1024


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_total_mib: float
    memory_free_mib: float
    compute_capability: str | None = None
    temperature_c: float | None = None
    utilization_pct: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None
    other_processes: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class GpuProbe:
    """What NVML says; ``error`` says why it could not (no library, no driver, no GPU)."""

    available: bool
    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    # how each pair of GPUs reaches the other ("0-1": "nvlink", "p2p" over PCIe, or "none": through host
    # memory)
    links: dict[str, str] = field(default_factory=dict)

    def link(self, i: int, j: int) -> str | None:
        return self.links.get(f"{min(i, j)}-{max(i, j)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _links(pynvml: Any, count: int) -> dict[str, str]:
    """NVML's peer-to-peer status of every pair: NVLink, PCIe peer reads, or neither (unknown pairs left
    out)."""
    ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    out: dict[str, str] = {}
    for i in range(count):
        for j in range(i + 1, count):
            def status(cap: str, a: Any = handles[i], b: Any = handles[j]) -> Any:
                return quietly(pynvml.nvmlDeviceGetP2PStatus, a, b, getattr(pynvml, cap))
            nvlink, read = status("NVML_P2P_CAPS_INDEX_NVLINK"), status("NVML_P2P_CAPS_INDEX_READ")
            if nvlink is None and read is None:
                continue
            out[f"{i}-{j}"] = "nvlink" if nvlink == ok else "p2p" if read == ok else "none"
    return out


def _basic_info(pynvml: Any, i: int) -> tuple[Any, GpuInfo]:
    """Handle and name, memory, temperature, utilisation and power of GPU ``i``."""
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    info = GpuInfo(i, _text(pynvml.nvmlDeviceGetName(h)), mem.total / MIB, mem.free / MIB)
    info.temperature_c = quietly(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
    util = quietly(pynvml.nvmlDeviceGetUtilizationRates, h)
    info.utilization_pct = float(util.gpu) if util is not None else None
    power = quietly(pynvml.nvmlDeviceGetPowerUsage, h)
    info.power_w = power / 1000.0 if power is not None else None
    return h, info


def query_gpus(own_pids: set[int] | None = None, details: bool = True) -> GpuProbe:
    """Count, names, memory, versions, capability, ECC, temperature, utilisation, power and foreign processes;
    ``details=False`` (a dashboard's refresh) reads only names, memory, utilisation, temperature and power."""
    try:
        import pynvml
    except ImportError:
        return GpuProbe(False, "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return GpuProbe(False, f"NVML unavailable ({_text(exc) or type(exc).__name__})")
    try:
        probe = GpuProbe(True)
        if not details:
            probe.gpus = [_basic_info(pynvml, i)[1] for i in range(pynvml.nvmlDeviceGetCount())]
            return probe
        probe.driver_version = quietly(lambda: _text(pynvml.nvmlSystemGetDriverVersion()))
        cuda = quietly(pynvml.nvmlSystemGetCudaDriverVersion)
        if cuda:
            probe.cuda_driver_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            h, info = _basic_info(pynvml, i)
            cc = quietly(pynvml.nvmlDeviceGetCudaComputeCapability, h)
            if cc:
                info.compute_capability = f"{cc[0]}.{cc[1]}"
            info.ecc_uncorrected = quietly(
                pynvml.nvmlDeviceGetTotalEccErrors,
                h,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC,
            )
            pages = quietly(
                pynvml.nvmlDeviceGetRetiredPages, h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            )
            info.retired_pages = len(pages) if pages is not None else None
            procs = quietly(pynvml.nvmlDeviceGetComputeRunningProcesses, h) or []
            for p in procs:
                if own_pids and p.pid in own_pids:
                    continue
                used = getattr(p, "usedGpuMemory", None)
                info.other_processes.append({"pid": p.pid, "used_mib": (used or 0) / MIB})
            probe.gpus.append(info)
        probe.links = _links(pynvml, count)
        return probe
    except Exception as exc:
        return GpuProbe(False, f"NVML query failed ({_text(exc) or type(exc).__name__})")
    finally:
        quietly(pynvml.nvmlShutdown)
