"""The ``train`` section of the run config."""

from __future__ import annotations

from pydantic import Field

from nsa.config.section import ConfigSection


class TrainConfig(ConfigSection):
    """Optimisation, schedule, checkpoints and logging of a run."""

    steps: int = Field(1000, ge=1, description="optimizer steps")
    seq_len: int = Field(2048, ge=2)
    batch_size: int = Field(8, ge=1, description="sequences per micro-batch per rank")
    accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(100, ge=0, description="linear warmup; clamped to steps")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    seed: int = 1337
    save_every: int = Field(1000, ge=0, description="0: only final/halt checkpoints")
    keep_last: int = Field(3, ge=1)
    eval_every: int = Field(0, ge=0, description="0 disables evaluation")
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(10, ge=1)
    heartbeat_every: int | None = Field(
        None, ge=1, description="progress heartbeat cadence in steps (default: log_every; 1 = every step)"
    )
    out_dir: str = "artifacts/run"
    resume: str | None = Field(None, description="'auto', a checkpoint path, or null")
    init_from: str | None = Field(
        None, description="start from these weights (a run directory, its export/ or a checkpoint): step 0, fresh "
        "optimizer and data; the model config must match. Ignored when the run resumes"
    )
    run_name: str | None = Field(None, description="name in reports; default: the out_dir folder name")
    mfu_peak_tflops: float | None = Field(
        None, gt=0, description="per-device peak for the MFU estimate; default: a table of known GPUs"
    )
    fault_nan_at_step: int | None = Field(
        None,
        ge=1,
        description="FAULT INJECTION for tests: make the loss NaN at this optimizer step (1-based)",
    )
