"""Shared fixtures: the NSA backends under test and random NSA inputs."""

from __future__ import annotations

import contextlib
import os
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Tests must never reach the network (HF datasets/hub, tiktoken downloads).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # tiny ops: threads cost more than they give on 2 shared cores

HAS_CUDA = torch.cuda.is_available()


def _triton_serves_cpu() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from nsa.ops import triton_path
    except ImportError:
        return False
    probe = torch.empty(1, 8, 1, 8, dtype=torch.float32)
    return triton_path.supports(probe) is None


def backends_under_test() -> list[str]:
    """Reference and torch always; Triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``."""
    names = ["reference", "torch"]
    if HAS_CUDA or _triton_serves_cpu():
        with contextlib.suppress(ImportError):
            import nsa.ops.triton_path  # noqa: F401

            names.append("triton")
    return names


@dataclass
class Inputs:
    q: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    gates: torch.Tensor
    l: int  # noqa: E741
    d: int

    @property
    def k_cmp(self) -> torch.Tensor:
        from nsa.ops.reference import compress_avg

        return compress_avg(self.k_raw, self.l, self.d)

    @property
    def v_cmp(self) -> torch.Tensor:
        from nsa.ops.reference import compress_avg

        return compress_avg(self.v_raw, self.l, self.d)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cmp, self.v_cmp, self.k_sel, self.v_sel, self.k_win, self.v_win, self.gates)


def make_inputs(
    B: int, S: int, HQ: int, H: int, Dk: int, Dv: int, *, l: int, d: int,  # noqa: E741
    dtype: torch.dtype = torch.float64, device: str = "cpu", seed: int | None = None,
) -> Inputs:
    """Random inputs (never zeros); gates are positive like sigmoid outputs. ``seed=None`` draws the seed
    from torch's generator, which the autouse ``_fixed_seed`` seeded from the test's id."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))) if seed is None else seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    gates = torch.rand(B, S, HQ, 3, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype) + 0.05
    return Inputs(
        r(B, S, HQ, Dk), r(B, S, H, Dk), r(B, S, H, Dv), r(B, S, H, Dk), r(B, S, H, Dv),
        r(B, S, H, Dk), r(B, S, H, Dv), gates, l, d,
    )


def seed_of(nodeid: str) -> int:
    """The fixed seed of a test: CRC-32 of its id (``tests/x.py::test_y[param]``), the same on every run."""
    return zlib.crc32(nodeid.encode()) % (2**31 - 1)


@pytest.fixture(autouse=True)
def _fixed_seed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Seed torch and ``random`` from the test's id before it runs (``make_inputs(seed=None)`` and any other
    unseeded draw are then replayable); a failing test's report names its seed."""
    seed = seed_of(request.node.nodeid)
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"torch and random seeded with {seed_of(item.nodeid)} (CRC-32 of the test id)"))


@pytest.fixture(params=backends_under_test())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# --- fault injection into a training run (``Trainer(step_hook=...)``) ---------------------------------


def halt_at(run_dir: Path, step: int, payload: str | bytes) -> Callable[[int], None]:
    """A ``step_hook`` that writes ``payload`` to ``RUN/.HALT`` at the end of ``step``: the trainer reads
    it during ``step + 1`` and halts after that step (no polling thread, no race)."""

    def hook(s: int) -> None:
        if s == step:
            (Path(run_dir) / ".HALT").write_bytes(payload if isinstance(payload, bytes) else payload.encode())

    return hook


def signal_at(step: int, signum: int) -> Callable[[int], None]:
    """A ``step_hook`` that sends ``signum`` to this process at the end of ``step``."""

    def hook(s: int) -> None:
        if s == step:
            os.kill(os.getpid(), signum)

    return hook
