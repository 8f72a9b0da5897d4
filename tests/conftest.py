"""Shared fixtures: the NSA backends under test and random NSA inputs."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nsa.config import ResolvedConfig, load_run_config
from nsa.train.events import PlainReporter

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

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of raw rows ``[j*d, j*d+l)`` per compressed token (written here, independent of ``nsa.ops``)."""
        B, S, H, D = x.shape
        if self.l > S:
            return x.new_zeros(B, 0, H, D)
        return x.unfold(1, self.l, self.d).mean(dim=-1)

    @property
    def k_cmp(self) -> torch.Tensor:
        return self._pool(self.k_raw)

    @property
    def v_cmp(self) -> torch.Tensor:
        return self._pool(self.v_raw)

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu``: the test needs a CUDA device and is skipped cleanly without one
    (``pytest -m gpu`` runs only those on a GPU machine); ``multigpu`` ones need two devices
    (``pytest -m multigpu`` on a machine with two). Tests marked ``beside(job)`` go last (see ``Beside``)."""
    gpus = torch.cuda.device_count() if HAS_CUDA else 0
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        elif "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices (this machine has {gpus})"))
    # tests marked beside(job) last, in their order: their jobs run meanwhile, in the same order
    last = [item for item in items if _goes_last(item)]
    if last:
        items[:] = [item for item in items if not _goes_last(item)] + last


@pytest.fixture(params=backends_under_test())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[b for b in backends_under_test() if b != "reference"])
def fast_backend(request: pytest.FixtureRequest) -> str:
    """The backends a parity test holds against the reference (the reference itself would be a tautology)."""
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


_ARMED: list[Any] = []  # torch hook handles of nan_loss_at, removed after each test whatever happened


def nan_loss_at(step: int) -> Callable[[int], None]:
    """A ``step_hook`` that makes the loss of optimizer step ``step`` (>= 2) NaN, to exercise the anomaly path
    (the step is not applied; the record names the last checkpoint that verifies). At the end of ``step - 1``
    it arms a one-shot forward hook on every module (torch's global hook): the next language-model output,
    the first micro-batch of ``step``, gets its loss multiplied by NaN, and the hook removes itself. The
    trainer's own code has no fault-injection switch; checkpoints saved at ``step - 1`` are untouched."""
    assert step >= 2, "the hook runs at the end of a step: the first step it can reach is 2"

    def poison(module: torch.nn.Module, args: Any, output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            return None
        for handle in _ARMED:
            handle.remove()
        _ARMED.clear()
        return output._replace(loss=loss * float("nan"))

    def hook(s: int) -> None:
        if s == step - 1:
            _ARMED.append(torch.nn.modules.module.register_module_forward_hook(poison))

    return hook


@pytest.fixture(autouse=True)
def _disarm_fault_hooks() -> Iterator[None]:
    yield
    for handle in _ARMED:
        handle.remove()
    _ARMED.clear()


def cli_trainer_hook(monkeypatch: pytest.MonkeyPatch, hook: Callable[[int], None]) -> None:
    """Make ``nsa train`` run in this process (``CliRunner``) build its ``Trainer`` with ``step_hook=hook``."""
    import nsa.train.trainer

    base = nsa.train.trainer.Trainer

    class Hooked(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, step_hook=hook, **kwargs)

    monkeypatch.setattr(nsa.train.trainer, "Trainer", Hooked)


# --- run directories, trainer and CLI helpers shared by the test modules ------------------------------


CSV_HEADER = "step,loss,lr,grad_norm,tokens_per_s,step_time_s,fetch_ms,tokens_seen,elapsed_s"


def free_port() -> int:
    """A TCP port to start a server on a moment later (a rendezvous store): free on every address, and
    outside the kernel's ephemeral range, so no outgoing connection or ``bind(0)`` of another process can
    take it in between (a port picked by ``bind(0)`` and released can be; issue 26)."""
    lo, _ = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()  # not the test's seeded stream: two runs in a row need not share a port
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo) if lo > 2048 else 0
        with socket.socket() as s, contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's own bind does
            s.bind(("", port))
            return int(s.getsockname()[1])
    raise RuntimeError("no free TCP port below the ephemeral range")


def dead_pid() -> int:
    """The pid of a process that has exited (so a run 'owned' by it looks crashed)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_run(
    run_dir: Path,
    *,
    steps: int = 40,
    steps_total: int = 100,
    log_every: int = 5,
    ranks: int = 1,
    end: str | None = "completed",
    pid: int | None = None,
    ts0: float | None = None,
    dt_s: float = 1.0,
    seed: int | None = None,
    nonfinite_at: int | None = None,
    collapse: float = 0.0,
    tokens_per_s: float = 1000.0,
    tps_drop_after: int | None = None,
    fetch_p95_ms: float = 12.0,
    corrupt: bool = False,
    truncated: bool = False,
    fallback: dict[str, int] | None = None,
    halt_reason: str | None = None,
    run_name: str | None = None,
    seq_len: int = 128,
    backend: str = "torch",
) -> Path:
    """A run directory as ``nsa train`` writes it; numbers come from a seeded random walk."""
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getpid() if pid is None else pid
    ts0 = time.time() - steps * dt_s - 5 if ts0 is None else ts0
    name = run_name or run_dir.name
    cfg = {"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_groups": 2},
           "nsa": {"l": 8, "d": 4, "l_sel": 8, "n_sel": 4, "w": 32},
           "runtime": {"device": "cpu", "attn_backend": backend},
           "train": {"steps": steps_total, "seq_len": seq_len, "batch_size": 8, "accum": 1, "run_name": name}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg) + "# _sources\n#   train.steps: flag --steps\n")
    (run_dir / "env.json").write_text(json.dumps({
        "schema": 1, "device": "cpu", "device_name": "cpu", "precision": "fp32", "world_size": ranks,
        "versions": {"python": "3.11.7", "torch": "2.x", "cuda": None, "triton": None, "flash_attn": None},
        "driver": None, "gpus": [], "git": {"commit": "ab" * 20, "branch": "main", "dirty": True},
        "profile": "cpu", "config_path": "nsa/configs/tiny.yaml", "nsa_settings": {"NSA_ATTN_BACKEND": backend},
        "nsa_unknown_variables": [],
    }))
    csv_lines = [CSV_HEADER]
    loss = 5.5 + rng.random() * 0.2
    for r in range(ranks):
        lines: list[str] = []

        def ev(event: str, step: int, ts: float, _lines: list[str] = lines, _r: int = r, **f: Any) -> None:
            _lines.append(json.dumps({"schema": 1, "event": event, "ts": ts, "rank": _r, "pid": pid, "step": step, **f}))

        ev("boot", 0, ts0, run_name=name, world_size=ranks, local_rank=r, host=socket.gethostname(),
           device="cpu", resumed_from=None, steps_total=steps_total)
        ev("loader-ready", 0, ts0 + 0.5, source="embedded", tokenizer="byte", first_batch_s=0.05, warnings=[])
        l_r = loss
        for step in range(log_every, steps + 1, log_every):
            l_r = l_r * (0.97 + 0.01 * rng.random())
            value: float | None = l_r
            if nonfinite_at is not None and step >= nonfinite_at:
                value = None  # the heartbeat writes non-finite values as null
            tps = tokens_per_s * (0.9 + 0.2 * rng.random())
            if tps_drop_after is not None and step > tps_drop_after:
                tps *= 0.2
            ts = ts0 + 1 + step * dt_s
            ev("progress", step, ts, steps_total=steps_total, loss=value, lr=1e-3, grad_norm=1.0 + rng.random(),
               tokens_per_s=tps, step_time_s=1024 / tps, fetch_p50_ms=fetch_p95_ms / 4, fetch_p95_ms=fetch_p95_ms,
               tokens_seen=step * 1024, elapsed_s=step * dt_s, eta_s=(steps_total - step) * dt_s,
               mem_allocated_mib=None, mem_reserved_mib=None, mem_peak_mib=None, rss_mib=700 + rng.random() * 50,
               gate_entropy_mean=1.09 - collapse, gate_branch_shares=[0.33, 0.33, 0.34],
               gate_collapse_fraction=collapse, sel_keys_mean=25.5, fallback=dict(fallback or {}), mfu=None,
               data_skipped={"total": 0}, data_warnings=[])
            if r == 0:
                csv_lines.append(",".join(str(x) for x in (step, "" if value is None else repr(value), 1e-3, 1.0,
                                                           tps, 1024 / tps, 3.0, step * 1024, step * dt_s)))
            if r == 0 and corrupt and step == log_every * 2:
                lines.append('{"schema": 1, "event": "progress", "ts": garbage')
                lines.append("[1, 2, 3]")
                csv_lines.append("1,2")
        t_end = ts0 + 2 + steps * dt_s
        if nonfinite_at is not None and r == 0:
            ev("anomaly", nonfinite_at, t_end - 0.5, kind="nonfinite_loss", value="nan", record=f"anomalies/step_{nonfinite_at}.json")
        if halt_reason is not None:
            ev("checkpoint", steps, t_end - 0.2, path=str(run_dir / "checkpoints" / f"step_{steps:08d}"), seconds=0.1, reason="halt")
            ev("halt", steps, t_end - 0.1, reason=halt_reason, source="file", checkpoint=str(run_dir / "checkpoints" / f"step_{steps:08d}"))
        if end is not None:
            if end == "completed":
                ev("checkpoint", steps, t_end - 0.1, path=str(run_dir / "checkpoints" / f"step_{steps:08d}"), seconds=0.1, reason="final")
            ev("end", steps, t_end, status=end, error="RuntimeError: boom" if end == "failed" else None)
        text = "\n".join(lines) + "\n"
        if truncated and r == 0:
            text += '{"schema": 1, "event": "progress", "ts": 1'  # a line still being written
        (run_dir / f"heartbeat_rank{r}.jsonl").write_text(text)
    (run_dir / "training.csv").write_text("\n".join(csv_lines) + "\n")
    if end is not None:
        (run_dir / "metrics.json").write_text(json.dumps({"status": end, "steps_done": steps}))
        (run_dir / "checkpoints" / f"step_{steps:08d}").mkdir(parents=True, exist_ok=True)
    return run_dir


SMALL = {
    "train.seq_len": 32, "train.batch_size": 2, "logging.every": 1, "schedule.warmup_steps": 2,
    "eval.batches": 2, "runtime.deterministic": True,
}


def resolve(out: Path, steps: int, **extra: Any) -> ResolvedConfig:
    flags = {**SMALL, "train.steps": steps, "train.out_dir": str(out)}
    flags.update({k.replace("__", "."): v for k, v in extra.items()})
    return load_run_config("tiny", environ={}, flags=flags)


def quiet() -> PlainReporter:
    """A reporter that keeps the trainer's lines (``.text()``) instead of printing them."""
    return PlainReporter(io.StringIO())


def events(run: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Heartbeat events; a last line still being written (no newline yet) is left out, any other is parsed."""
    text = (run / f"heartbeat_rank{rank}.jsonl").read_text()
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line]


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NSA_")}
    env.update(extra)
    return env


def nsa(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsa_cli", *args], capture_output=True, text=True,
                          env=env or clean_env(), timeout=timeout)


# ---- work beside the tests: jobs in processes of their own, started when the session begins --------------

ROOT = Path(__file__).resolve().parents[1]
PRELUDE = "import torch; torch.set_num_threads(1)\n"


@dataclass(frozen=True)
class Job:
    """A test's work in a process of its own, in the repository root: ``PRELUDE + code`` in a fresh Python,
    under the Triton interpreter (``TRITON_INTERPRET=1``: Triton fixes the mode at import time, so it cannot
    be switched on inside the test process) or not; it must exit 0 within ``timeout`` seconds."""

    code: str
    interpret: bool = True
    timeout: float = 300


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    started: float  # time.monotonic() at the start and at the end of the job
    ended: float


class Beside:
    """Runs jobs one at a time in a thread of the test process, each in a process of its own, beside the
    test in progress: on a small machine the tests mostly keep one core busy, the jobs take the other.

    A test marked ``@pytest.mark.beside(job)`` has its job started when the session's tests are known
    (``pytest_collection_finish``) and runs at the end of the session (``pytest_collection_modifyitems``),
    in the order of the jobs, so it rarely waits; its body calls ``run_job(job)``, which waits for that
    result (or runs the job then, when it was not started early). With ``keep_place=True`` the test keeps
    its place and its job goes first (a fixture's work that tests in the middle of the session read, the
    fixture calling ``run_job``). Interpreter jobs on a machine without
    CUDA run in forks of one interpreter process (``tests/interpreter_server.py``) that paid the imports
    once; elsewhere each job is a fresh ``python -c``."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tests-beside")
        self._started: dict[Job, Any] = {}
        self._procs: set[subprocess.Popen[str]] = set()
        self._server: subprocess.Popen[str] | None = None
        self._server_err: Any = None
        self._tmp: Path | None = None
        self.t0 = time.monotonic()
        self.log: list[tuple[str, JobResult, float]] = []  # (test, its job's result, seconds the test waited)

    def start(self, job: Job) -> None:
        if job not in self._started:
            self._started[job] = self._pool.submit(self._run, job)

    def result(self, job: Job) -> JobResult:
        future = self._started.pop(job, None) or self._pool.submit(self._run, job)
        return future.result()

    def _scratch(self) -> Path:
        if self._tmp is None:
            import tempfile

            self._tmp = Path(tempfile.mkdtemp(prefix="nsa-tests-beside-"))
        return self._tmp

    def _run(self, job: Job) -> JobResult:
        t0 = time.monotonic()
        if job.interpret and not HAS_CUDA:
            rc, out, err, timed_out = self._in_server(job)
        else:
            env = dict(os.environ, TRITON_INTERPRET="1") if job.interpret else dict(os.environ)
            proc = subprocess.Popen([sys.executable, "-c", PRELUDE + job.code], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            self._procs.add(proc)
            try:
                out, err = proc.communicate(timeout=job.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                out, err = proc.communicate()
                timed_out = True
            finally:
                self._procs.discard(proc)
            rc = proc.returncode
        return JobResult(rc, out, err, timed_out, t0, time.monotonic())

    def _in_server(self, job: Job) -> tuple[int, str, str, bool]:
        if self._server is None or self._server.poll() is not None:
            self._server_err = open(self._scratch() / "server.err", "w+")  # noqa: SIM115 (closed in close())
            self._server = subprocess.Popen([sys.executable, "-m", "tests.interpreter_server"], cwd=ROOT,
                                            env=dict(os.environ, TRITON_INTERPRET="1"), text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._server_err,
                                            start_new_session=True)
        out, err = self._scratch() / "job.out", self._scratch() / "job.err"
        assert self._server.stdin is not None and self._server.stdout is not None
        try:
            self._server.stdin.write(json.dumps({"code": PRELUDE + job.code, "stdout": str(out), "stderr": str(err),
                                                 "timeout": job.timeout}) + "\n")
            self._server.stdin.flush()
            reply = self._server.stdout.readline()
        except (BrokenPipeError, OSError):
            reply = ""
        if not reply:
            self._server.wait()
            self._server_err.seek(0)
            return 1, "", f"the interpreter server stopped (rc {self._server.returncode}):\n{self._server_err.read()}", False
        answer = json.loads(reply)
        read = (out.read_text(errors="replace") if out.exists() else "", err.read_text(errors="replace") if err.exists() else "")
        return int(answer["rc"]), read[0], read[1], bool(answer["timed_out"])

    def close(self) -> None:
        import shutil

        for future in self._started.values():
            future.cancel()
        self._started.clear()
        for proc in list(self._procs):
            _kill_group(proc)
        if self._server is not None:
            with contextlib.suppress(OSError):
                assert self._server.stdin is not None
                self._server.stdin.close()
            try:
                self._server.wait(timeout=2)
            except subprocess.TimeoutExpired:  # a job still running in a fork of it
                _kill_group(self._server)
                self._server.wait()
        self._pool.shutdown(wait=True)
        if self._server_err is not None:
            self._server_err.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` and the processes it started (its own session: ``start_new_session=True``)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


BESIDE = Beside()


def run_job(job: Job) -> JobResult:
    """The result of ``job`` (started early when the test is marked ``beside(job)``); it must have exited 0
    in time, else the test fails with the tail of its output (the cases print their names as they go)."""
    t0 = time.monotonic()
    res = BESIDE.result(job)
    BESIDE.log.append((os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0], res, time.monotonic() - t0))
    tail = res.stdout[-2000:] + res.stderr[-4000:]
    assert not res.timed_out, f"timed out after {job.timeout:.0f} s\n{tail}"
    assert res.returncode == 0, tail
    return res


def _skipped(item: pytest.Item) -> bool:
    if any(True for _ in item.iter_markers("skip")):
        return True
    for mark in item.iter_markers("skipif"):
        cond = mark.args[0] if mark.args else mark.kwargs.get("condition")
        if isinstance(cond, bool) and cond:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "beside(job, keep_place=False): the test's tests.conftest.Job starts in a "
                                       "process beside the tests when the session begins; the test runs at the end "
                                       "(or keeps its place) and checks it")


def _goes_last(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("beside")
    return mark is not None and not mark.kwargs.get("keep_place", False)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    marks = [(mark, _goes_last(item)) for item in session.items
             if (mark := item.get_closest_marker("beside")) is not None and not _skipped(item)]
    for mark, _ in sorted(marks, key=lambda m: m[1]):  # the jobs of tests that keep their place first
        BESIDE.start(mark.args[0])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    BESIDE.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if BESIDE.log:
        terminalreporter.section("jobs beside the tests")
        for test, res, waited in BESIDE.log:
            a, b = res.started - BESIDE.t0, res.ended - BESIDE.t0
            terminalreporter.write_line(f"{b - a:7.2f}s ran (+{a:.0f} s to +{b:.0f} s), {waited:.2f}s waited  {test}")


# ---- parsing nsa command lines (runbooks, docs, --help examples) ----------------------------------------

SHELL_OPS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1"}
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def split_command(text: str) -> tuple[dict[str, str], list[str]]:
    """``VAR=x nsa a b > f | tee`` -> ``({"VAR": "x"}, ["nsa", "a", "b"])``: env prefix and first command."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    tokens = []
    for tok in lex:
        if tok in SHELL_OPS or set(tok) <= set("|&;<>"):
            break
        tokens.append(tok)
    env = {}
    while tokens and ASSIGN.match(tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    return env, tokens


def parse_cli(argv: list[str]) -> list[str]:
    """Parse ``argv`` with the real click command tree without running anything; the command path."""
    group = _cli_group()
    ctx = group.make_context("nsa", list(argv), resilient_parsing=False)
    path = []
    cmd: Any = group
    args = _rest(ctx)
    while hasattr(cmd, "resolve_command"):  # a group (typer vendors its own click)
        name, sub, rest = cmd.resolve_command(ctx, args)
        assert sub is not None, f"unknown command {name}"
        path.append(name)
        ctx = sub.make_context(name, rest, parent=ctx, resilient_parsing=False)
        cmd = sub
        args = _rest(ctx)
    return path


@functools.cache
def _cli_group() -> Any:
    """The real click command tree of ``nsa`` (built once: ~0.1 s a build, and parsing leaves it as it was)."""
    import typer

    from nsa_cli.app import app

    return typer.main.get_command(app)


def _rest(ctx: Any) -> list[str]:
    """Arguments a group left for its subcommand (click keeps the command name apart)."""
    protected = getattr(ctx, "_protected_args", None)
    if protected is None:
        protected = getattr(ctx, "protected_args", [])
    return [*protected, *ctx.args]
