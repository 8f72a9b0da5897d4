"""The trainer's sections of the run config, one per component: ``train`` (the loop itself), ``optimizer``,
``schedule``, ``checkpoint``, ``logging``, ``eval`` and ``scorer`` (the auxiliary selection loss).

Keys that lived in ``train`` before the split (``train.lr``, ``train.save_every``, ...) are still read, with a
note each, for one release (:data:`nsa.config.legacy.MOVED_KEYS`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from nsa.config.section import ConfigSection, check_path, exposed


class TrainConfig(ConfigSection):
    """The training loop: how long, on what batches, from where, into which run directory."""

    steps: int = Field(1000, ge=1, description="optimizer steps",
                       json_schema_extra=exposed(env="NSA_STEPS", flag="--steps"))
    seq_len: int = Field(2048, ge=2, description="tokens per sequence",
                         json_schema_extra=exposed(env="NSA_SEQ_LEN", flag="--seq-len"))
    batch_size: int = Field(8, ge=1, description="sequences per micro-batch per rank",
                            json_schema_extra=exposed(env="NSA_BATCH_SIZE", flag="--batch-size"))
    accum: int = Field(1, ge=1, description="micro-batches per optimizer step",
                       json_schema_extra=exposed(env="NSA_ACCUM", flag="--accum"))
    seed: int = Field(1337, ge=-(2**63), le=2**64 - 1, description="seed of model init and data order (what "
                      "torch.manual_seed takes)", json_schema_extra=exposed(env="NSA_SEED", flag="--seed"))
    out_dir: str = Field("artifacts/run", description="the run directory",
                         json_schema_extra=exposed(env="NSA_OUT_DIR", flag="--out-dir"))
    resume: str | None = Field(None, description="'auto', a checkpoint path, or null",
                               json_schema_extra=exposed(flag="--resume"))
    init_from: str | None = Field(
        None, description="start from these weights (a run directory, its export/, a checkpoint, or a "
        "Hugging Face folder written by nsa export --format hf): step 0, fresh "
        "optimizer and data; the model config must match. Ignored when the run resumes"
    )
    stop_at: int | None = Field(
        None, ge=1, description="end this invocation after this step with a checkpoint, the learning-rate "
        "schedule still spanning train.steps; resume to go on, e.g. at a longer --seq-len (a length "
        "curriculum)", json_schema_extra=exposed(flag="--stop-at"),
    )
    run_name: str | None = Field(None, description="name in reports; default: the out_dir folder name")

    _paths = field_validator("out_dir", "resume", "init_from")(check_path)


class OptimizerConfig(ConfigSection):
    """AdamW (weight decay on matrices only) and gradient clipping."""

    lr: float = Field(3e-4, gt=0, description="peak learning rate",
                      json_schema_extra=exposed(env="NSA_LR", flag="--lr"))
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="gradient norm clip; 0 disables clipping")


class ScheduleConfig(ConfigSection):
    """The learning-rate schedule: linear warmup, then half a cosine down to a floor."""

    warmup_steps: int = Field(100, ge=0, description="linear warmup; clamped to train.steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of optimizer.lr")


class CheckpointConfig(ConfigSection):
    """Periodic checkpoints, how many are kept, and the Hugging Face export at the end."""

    every: int = Field(1000, ge=0,
                       description="steps between periodic checkpoints; 0: only final/halt checkpoints",
                       json_schema_extra=exposed(env="NSA_SAVE_EVERY"))
    keep_last: int = Field(3, ge=1, description="complete checkpoints kept")
    export_hf: bool = Field(False, description="at the end of the run also write RUN/hf/, the model in "
                            "Hugging Face format (what nsa export RUN --format hf RUN/hf writes)")


class LoggingConfig(ConfigSection):
    """Log steps (CSV, TensorBoard, printed lines), the heartbeat cadence and the MFU estimate."""

    every: int = Field(10, ge=1, description="steps between log steps")
    heartbeat_every: int | None = Field(
        None, ge=1, description="progress heartbeat cadence in steps (default: logging.every; 1 = every step)"
    )
    mfu_peak_tflops: float | None = Field(
        None, gt=0, description="per-device peak for the MFU estimate; default: a table of known GPUs"
    )


class EvalConfig(ConfigSection):
    """Held-out loss during training, and the selection diagnostics of NSA models at the same steps."""

    every: int = Field(0, ge=0, description="steps between evaluations; 0 disables evaluation")
    batches: int = Field(8, ge=1, description="held-out batches per evaluation")
    selection_queries: int = Field(
        64, ge=0, description="query positions per NSA layer for selection recall, compressed entropy and "
        "gates at each evaluation (first held-out batch); 0: off")


class ScorerConfig(ConfigSection):
    """Two auxiliary selection losses on sampled queries of every NSA layer, added to the backward pass (not
    to the reported loss; nsa.model.selection): the alignment loss (``align``, on by default: dense attention
    drawn into the selected blocks, the keys selection leaves out taught to be ignored) and the scorer loss
    (``weight``: ``KL(dense attention mass per block || the compressed branch's block scores)``, the gradient
    top-n selection never gives the block scorer)."""

    weight: float = Field(0.0, ge=0, description="scorer loss weight; 0: off (nothing computed)")
    queries: int = Field(64, ge=1, description="query positions per layer and micro-batch (both losses)")
    until: int | None = Field(
        None, ge=1, description="last step with the losses (a warm-up); null: the whole run")
    into: Literal["query_and_keys", "keys", "weights"] = Field(
        "query_and_keys", description="what the loss trains: query_and_keys (its gradient reaches the whole "
                                      "model through them), keys (the compressed keys only), weights (the "
                                      "layer's query, key and compression weights alone, from its input "
                                      "detached: nothing before the layer, as DeepSeek's DSA trains its "
                                      "indexer)")
    align: float = Field(
        0.1, ge=0, description="alignment loss weight (0: off): -log of the dense attention mass inside the "
                               "selected blocks at the same query positions, its gradient into the layer's "
                               "query and selected keys (the keys selection leaves out learn to be "
                               "suppressed: SSA, arXiv 2511.20102). On by default "
                               "(docs/benchmarks/quality-sweep-h100.md)")

    @property
    def active(self) -> bool:
        """Whether either loss is on (the scorer's query positions are computed)."""
        return self.weight > 0 or self.align > 0
