"""Validated configuration: the model, NSA and runtime sections, and ``RunConfig`` holding every section.

Precedence, lowest to highest: defaults < config YAML < hardware profile < ``NSA_*`` environment <
command-line flags and ``--set section.key=value``. ``load_run_config`` records where each value came
from so that ``nsa profiles show`` and the run directory can say it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from nsa.config.data import DataConfig
from nsa.config.monitor import MonitorConfig
from nsa.config.section import ConfigSection, exposed
from nsa.config.train import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    OptimizerConfig,
    ScheduleConfig,
    ScorerConfig,
    TrainConfig,
)
from nsa.configs import CONFIG_DIR as CONFIG_DIR  # the shipped configs (nsa/configs/*.yaml)
from nsa.params import NSAParams


class _Section(ConfigSection):
    """A run-config section (see ``ConfigSection``: no booleans for int/float fields)."""


# FSDP2 shards a model up to this size as one unit (runtime.fsdp_unit_blocks auto): per-block units cost host
# time
# that a small model's blocks cannot hide (m7c-125m, 2x H200: 134 ms a step against 103 ms as one unit, DDP 97
# ms)
WHOLE_UNIT_PARAMS = 1_000_000_000

LAYER_WORDS: dict[str, Callable[[int], list[int]]] = {  # model.dense_layers by name, for n_layers blocks
    "even": lambda n: list(range(0, n, 2)),  # every other block dense from block 0: NSA in 1, 3, 5, ...
    "odd": lambda n: list(range(1, n, 2)),  # every other block dense from block 1: NSA in 0, 2, 4, ...
    "thirds": lambda n: [i for i in range(n) if i % 3 != 2],  # two of three dense: NSA in 2, 5, 8, ...
}


class ModelConfig(_Section):
    """LLaMA-style decoder: embedding, ``n_layers`` blocks (RMSNorm, attention, SwiGLU), norm, head."""

    vocab_size: int = Field(256, ge=2)
    dim: int = Field(768, ge=8)
    n_layers: int = Field(12, ge=1)
    n_heads: int = Field(12, ge=1)
    n_kv_groups: int = Field(2, ge=1)
    d_k: int = Field(64, ge=4)
    d_v: int = Field(64, ge=4)
    mlp_hidden: int | None = Field(None, ge=8, description="SwiGLU hidden size; default 4 * dim")
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: int = Field(65536, ge=1)
    attention: Literal["nsa", "dense"] = Field("nsa", description="nsa or dense (SDPA causal)",
                                               json_schema_extra=exposed(flag="--attention"))
    dense_layers: list[int] = Field(
        default_factory=list,
        description="with attention nsa: the layers (0-based) that use dense attention instead (a hybrid "
                    "stack; YAML list, '0 2 4', or even / odd: every other block from the first / second; "
                    "thirds: all but every third block, NSA in 2, 5, 8, ...)")
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _layer_words(cls, data: Any) -> Any:
        """``dense_layers: even`` (blocks 0, 2, 4, ...), ``odd`` (1, 3, 5, ...) or ``thirds``
        (all but 2, 5, 8, ...) as the list for ``n_layers``;
        none for a dense model (``attention: dense``: a config's hybrid list does not stop a dense
        baseline)."""
        if not isinstance(data, dict):
            return data
        if data.get("attention") == "dense" and data.get("dense_layers"):
            # every block of a dense model is dense: the list names nothing
            return {**data, "dense_layers": []}
        if isinstance(word := data.get("dense_layers"), str) and word.strip() in LAYER_WORDS:
            n = int(data.get("n_layers", cls.model_fields["n_layers"].default))
            data = {**data, "dense_layers": LAYER_WORDS[word.strip()](n)}
        return data

    @field_validator("dense_layers", mode="before")
    @classmethod
    def _layer_list(cls, value: Any) -> Any:
        """``'0 2 4'`` or ``'0,2,4'`` (a ``--set`` value or an environment variable) as ``[0, 2, 4]``."""
        if isinstance(value, str):
            parts = value.replace(",", " ").strip("[] ").split()
            try:
                return sorted(int(p) for p in parts)
            except ValueError:
                raise ValueError(f"model.dense_layers={value!r} must be layer numbers ('0 2 4') or "
                                 f"{', '.join(LAYER_WORDS)}") from None
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        return sorted(value) if isinstance(value,
                                           list | tuple) and all(isinstance(v, int) for v in value) else value

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_heads % self.n_kv_groups:
            raise ValueError(
                f"model.n_kv_groups={self.n_kv_groups} must divide model.n_heads={self.n_heads}"
            )
        if self.d_k % 2:
            raise ValueError(f"model.d_k={self.d_k} must be even (RoPE rotates pairs)")
        if self.dense_layers:
            bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(f"model.dense_layers {bad} outside the {self.n_layers} layers (0 .. "
                                 f"{self.n_layers - 1})")
            if len(set(self.dense_layers)) != len(self.dense_layers):
                raise ValueError(f"model.dense_layers {self.dense_layers} names a layer twice")
        return self

    def layer_attention(self, layer: int) -> Literal["nsa", "dense"]:
        """The attention of block ``layer``: ``model.attention``, dense where ``dense_layers`` says so."""
        return "dense" if self.attention == "dense" or layer in self.dense_layers else "nsa"

    @property
    def stack(self) -> str:
        """The attention of the blocks in words: ``nsa``, ``dense``, or ``nsa (blocks 0,2,4 dense)``."""
        if self.attention == "dense" or not self.dense_layers:
            return self.attention
        return f"nsa (blocks {','.join(map(str, self.dense_layers))} dense)"

    @property
    def nsa_layers(self) -> list[int]:
        """The blocks with NSA attention (none for a dense model)."""
        return [i for i in range(self.n_layers) if self.layer_attention(i) == "nsa"]

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.n_kv_groups

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_hidden or 4 * self.dim


# gate logits per preset (cmp, sel, win): sigmoid(-2) = 0.12, sigmoid(0) = 0.5, sigmoid(2) = 0.88,
# sigmoid(-ln 2) = 1/3 (docs/design.md, "Quality")
GATE_PRESETS: dict[str, tuple[float, float, float]] = {
    "slow": (-2.0, -2.0, -2.0),
    "half": (0.0, 0.0, 0.0),
    "window": (-2.0, -2.0, 2.0),
    "uniform": (-0.6931471805599453,) * 3,
}
DEFAULT_GATE_BIAS = GATE_PRESETS["window"]
# gate starts measured not to learn key/value retrieval beyond the window from scratch with the paper's layer
# (one query, every K/V at the same speed), with what was measured (docs/design.md, "Gates against
# retrieval"; docs/benchmarks/gates-h200.md); the window branch's own query with kv_speed >= 3 (the
# default) is what makes the window start learn it
NO_RETRIEVAL_GATES: dict[str, str] = {
    "window": "learned it in none of 4 seeds at S=128-512 where dense attention and the slow gates did",
}
RETRIEVAL_KV_SPEED = 3.0
PAPER = NSAParams()  # the paper's hyper-parameters: the defaults of the nsa section
GRAPHS_MAX_SEQ_LEN = 16384  # runtime.compile_mode=auto: CUDA graphs for NSA up to this train.seq_len


class NSAConfig(_Section):
    """NSA hyper-parameters (the paper's defaults, owned by :class:`nsa.params.NSAParams`) and module options
    (the gate defaults are these fields', which :class:`nsa.model.gates.GateParams` takes)."""

    l: int = Field(PAPER.l, ge=1, description="compression block length")  # noqa: E741
    d: int = Field(PAPER.d, ge=1, description="compression stride")
    l_sel: int = Field(PAPER.l_sel, ge=1, description="selection block length (paper l')")
    n_sel: int = Field(PAPER.n_sel, ge=1, description="selected blocks per query, forced blocks included")
    w: int = Field(PAPER.w, ge=1, description="sliding window")
    phi: Literal["avg", "mlp"] = "avg"
    gate: Literal["sigmoid", "softmax"] = "sigmoid"
    shared_kv: bool = False
    gate_hidden: int | None = Field(None, ge=1, description="gate MLP hidden size; default dim // 4")
    gate_init: Literal["slow", "half", "window", "uniform"] | None = Field(
        None, exclude=True, description="gate start: window (0.12, 0.12, 0.88, lucidrains; the default), "
        "slow (0.12 each: retrieval), half (0.5 each, fla), uniform (1/3 each); sets gate_bias (sigmoid "
        "gates), which is what a run saves")
    gate_bias: tuple[float, float, float] = Field(
        DEFAULT_GATE_BIAS,
                                                  description="constant gate logits (cmp, sel, win): logits "
                                                              "= gate_bias + gate_scale * mlp(x)"
    )
    gate_scale: float = Field(
        0.1, gt=0, le=1, description="multiplier on the learned gate MLP (slows the gates under Adam)"
    )
    fixed_gates: tuple[float, float, float] | None = Field(
        None, description="constant gates (cmp, sel, win) instead of the gate MLP, for ablations"
    )
    collapse_threshold: float = Field(0.9, gt=0, le=1,
                                      description="share above which a gate counts as collapsed")
    window_query: bool = Field(
        True, description="the window branch has a query projection of its own (the compressed and selected "
        "branches and the block choice keep the shared one); with kv_speed, what lets a window-dominant "
        "start learn long-range retrieval (docs/design.md, \"Gates against retrieval\")")
    kv_speed: float = Field(
        3.0, gt=0, le=100, description="the compressed and selected branches' key/value projections learn "
        "this many times faster under Adam (stored as W / kv_speed, multiplied back in the forward: the "
        "model at initialisation is unchanged); 1: as fast as every other weight; not used with shared_kv")

    @model_validator(mode="after")
    def _check(self) -> NSAConfig:
        self.params()  # the ops layer owns the rules (d divides l and l_sel)
        if self.gate_init is not None:
            preset = GATE_PRESETS[self.gate_init]
            if self.gate_bias not in (preset, DEFAULT_GATE_BIAS):
                raise ValueError(f"nsa.gate_init={self.gate_init} and nsa.gate_bias={list(self.gate_bias)} "
                                 "disagree: set one of them")
            if self.gate_bias != preset:
                object.__setattr__(self, "gate_bias", preset)  # no re-validation loop
        return self

    def gate_preset(self) -> str | None:
        """The name of the preset whose bias this config's gates start from (None: a bias of its own)."""
        return next((name for name, bias in GATE_PRESETS.items() if tuple(self.gate_bias) == bias), None)

    def retrieval_concern(self) -> str | None:
        """One line when the gates start from a preset measured not to learn long-range retrieval."""
        name = self.gate_preset()
        if self.fixed_gates is not None or name not in NO_RETRIEVAL_GATES:
            return None
        if self.window_query and self.kv_speed >= RETRIEVAL_KV_SPEED and not self.shared_kv:
            return None  # the measured recipe (the default)
        return (f"nsa.gate_bias={list(self.gate_bias)} (gate start {name}) with nsa.window_query="
                f"{str(self.window_query).lower()}, nsa.kv_speed={self.kv_speed:g} does not learn long-range "
                f"retrieval from scratch: it {NO_RETRIEVAL_GATES[name]} (docs/design.md, \"Gates against "
                "retrieval\"); to train retrieval keep the defaults nsa.window_query=true, nsa.kv_speed=3 "
                "(or set nsa.gate_init=slow: held-out text loss about 7% worse at 2k)")

    def params(self) -> NSAParams:
        """The five hyper-parameters as the ``nsa.ops`` object every layer passes on."""
        return NSAParams(l=self.l, d=self.d, l_sel=self.l_sel, n_sel=self.n_sel, w=self.w)


class RuntimeConfig(_Section):
    """Where and how the math runs."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", json_schema_extra=exposed(env="NSA_DEVICE"))
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto",
                                                               json_schema_extra=exposed(env="NSA_PRECISION"))
    attn_backend: Literal["auto", "reference", "torch", "triton"] = Field(
        "auto", description="nsa.ops backend (the window branch's kernel comes with it)",
        json_schema_extra=exposed(env="NSA_ATTN_BACKEND"))
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model; auto: on CUDA (where it is faster), not on CPU",
        json_schema_extra=exposed(env="NSA_COMPILE", flag="--compile"))
    compile_mode: Literal["auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "auto", description="torch.compile mode; reduce-overhead replays each step as CUDA graphs; auto: "
        "reduce-overhead for an NSA model on one rank or DDP ranks with one micro-batch a step, up to 16k "
        "tokens, no gradient checkpointing and no document mask (its step waits on the host's launches), "
        "else default", json_schema_extra=exposed(env="NSA_COMPILE_MODE"))
    gradient_checkpointing: bool = Field(False, description="gradient checkpointing",
                                         json_schema_extra=exposed(env="NSA_GRAD_CKPT"))
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
                                             description="several ranks: ddp (replicas) or fsdp (FSDP2: "
                                                         "parameters, gradients, optimizer sharded)",
        json_schema_extra=exposed(env="NSA_PARALLEL"))
    context_parallel: int = Field(
        1, ge=1, description="ranks that share one sequence (each holds 1/N of its positions; the other "
        "factor of the world is data parallel)",
                                  json_schema_extra=exposed(env="NSA_CONTEXT_PARALLEL",
                                                            flag="--context-parallel"))
    fsdp_cpu_offload: bool = Field(False,
                                   description="fsdp: keep the sharded parameters and optimizer state in "
                                               "host memory")
    compile_scope: Literal["auto", "model", "blocks"] = Field(
        "auto", description="what torch.compile wraps: the whole model (one graph), or each block (the "
        "embedding, head and loss eager; FSDP2's gathers and reduce-scatters between the blocks' graphs); "
        "auto: blocks under FSDP2, else the model")
    fsdp_reshard_after_forward: bool = Field(
        True,
                                             description="fsdp: free gathered parameters after each block's "
                                                         "forward (less memory, one more gather)")
    fsdp_unit_blocks: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="fsdp: blocks per fully_shard unit (gathered and reduce-scattered together: "
        "fewer units, less host work a step, more memory); 0: the whole model one unit (one gather and one "
        "reduce-scatter a step); auto: 0 up to 1B parameters, else 1")
    fsdp_reduce_dtype: Literal["fp32", "low"] = Field(
        "fp32", description="fsdp with bf16/fp16 parameters: the gradients' reduce-scatter in fp32 (each "
        "rank's gradient summed exactly) or in the parameters' low precision (half the bytes and copies; "
        "each rank's gradient rounded before the sum)")
    deterministic: bool = Field(False, json_schema_extra=exposed(env="NSA_DETERMINISTIC"))
    tf32: bool = Field(True, json_schema_extra=exposed(env="NSA_TF32"))
    alloc_conf: str | None = Field(None, description="PYTORCH_CUDA_ALLOC_CONF for the run",
                                   json_schema_extra=exposed(env="NSA_ALLOC_CONF"))

    def compiles_blocks(self, sharded: bool) -> bool:
        """Whether ``torch.compile`` wraps each block rather than the whole model (``compile_scope``)."""
        return self.compile_scope == "blocks" or (self.compile_scope == "auto" and sharded)

    def fsdp_units(self, n_params: int) -> int:
        """Blocks per FSDP2 unit for a model of ``n_params`` parameters (``fsdp_unit_blocks``; 0: one
        unit)."""
        if self.fsdp_unit_blocks == "auto":
            return 0 if n_params <= WHOLE_UNIT_PARAMS else 1
        return self.fsdp_unit_blocks

    def compiles(self, device_type: str) -> bool:
        """Whether the model runs under ``torch.compile`` on ``device_type`` (``auto``: on CUDA)."""
        return self.compile is True or (self.compile == "auto" and device_type == "cuda")


class RunConfig(_Section):
    """Everything a run needs; saved as ``config.yaml`` in the run directory."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    nsa: NSAConfig = Field(default_factory=NSAConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        cp = self.runtime.context_parallel
        if cp > 1:
            if self.train.seq_len % (2 * cp):
                raise ValueError(f"train.seq_len={self.train.seq_len} must split into {2 * cp} equal chunks "
                                 f"for runtime.context_parallel={cp} (a multiple of {2 * cp})")
            if self.scorer.weight > 0:
                raise ValueError("the scorer loss (scorer.weight) does not run under "
                                 "runtime.context_parallel: set one of them")
        return self

    def torch_compile_mode(self, world_size: int = 1) -> str:
        """The ``torch.compile`` mode of a run on ``world_size`` ranks: ``runtime.compile_mode``, and for
        ``auto`` CUDA graphs (``reduce-overhead``) where they were measured to pay and to run
        (docs/benchmarks/equal-time-h200.md: the NSA step 1.4x faster at the 6-layer quality shape, 1.04x at
        m7c-125m; dense attention gains nothing): an NSA model on one rank or DDP ranks (1.04x at m7c-125m on
        2x H200, docs/benchmarks/multigpu-h200.md; under FSDP2 each step re-recorded: 4x slower), one
        micro-batch a step, without gradient checkpointing or a document mask, up to
        :data:`GRAPHS_MAX_SEQ_LEN` tokens (longer steps are bound by the GPU, and graphs hold their
        memory)."""
        mode = self.runtime.compile_mode
        if mode != "auto":
            return mode
        ranks_ok = world_size == 1 or (self.runtime.parallel == "ddp" and self.runtime.context_parallel == 1)
        graphs = (self.model.attention == "nsa" and ranks_ok and self.train.accum == 1
                  and self.train.seq_len <= GRAPHS_MAX_SEQ_LEN
                  and not self.runtime.gradient_checkpointing and not self.data.document_mask)
        return "reduce-overhead" if graphs else "default"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
