"""The ``data`` section of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from nsa.config.section import ConfigSection, check_path, exposed


class DataConfig(ConfigSection):
    """Where tokens come from and how they are loaded."""

    source: Literal["embedded", "local", "synthetic", "fineweb_edu"] = Field(
        "embedded", description="data source: embedded, local, synthetic, fineweb_edu",
        json_schema_extra=exposed(env="NSA_DATASET", flag="--dataset"))
    path: str | None = Field(None, description="file or folder for source=local",
                             json_schema_extra=exposed(env="NSA_DATA_PATH", flag="--data-path"))
    text_field: str = "text"
    text_unit: Literal["paragraph", "file"] = Field(
        "paragraph", description="what one document of a local .txt file is: a paragraph, or the whole file "
                                 "(long context: the held-out split then holds whole files, not paragraphs "
                                 "torn from them)")
    tokenizer: Literal["byte", "gpt2"] = Field("byte", description="byte or gpt2",
                                               json_schema_extra=exposed(env="NSA_TOKENIZER",
                                                                         flag="--tokenizer"))
    tokenizer_path: str | None = Field(None, description="folder of a local HF tokenizer (gpt2)")
    synthetic_task: Literal["random", "assoc_recall", "needle", "mqar"] = "assoc_recall"
    synthetic_pairs: int = Field(8, ge=1, le=32,
                                 description="key/value pairs (and queries) of synthetic_task=mqar")
    needle_edges: float = Field(
        0.25, ge=0.0, le=1.0,
        description="share of synthetic_task=needle episodes with the needle at depth 0 or 1 (half each; a "
                    "uniform depth almost never puts it first or right before the question); the rest "
                    "uniform",
    )
    loss_on: Literal["all", "answers"] = Field(
        "all",
                                               description="answers: train only on the answer tokens of a "
                                                           "synthetic task (labels -100 elsewhere)"
    )
    hf_dataset: str = "HuggingFaceFW/fineweb-edu"
    hf_config: str = "sample-10BT"
    hf_split: str = "train"
    timeout_s: float = Field(60.0, gt=0, description="connect/first-batch timeout for streaming, seconds",
                             json_schema_extra=exposed(env="NSA_LOADER_TIMEOUT"))
    synthetic_on_fail: bool = False
    prefetch_depth: int = Field(4, ge=0, description="batches prepared ahead; 0 loads inline",
                                json_schema_extra=exposed(env="NSA_PREFETCH_DEPTH"))
    val_fraction: float = Field(0.02, ge=0, lt=1, description="share of documents held out")
    max_doc_chars: int = Field(1_000_000, ge=1, description="longer documents are skipped and counted")
    document_mask: bool = Field(
        False, description="attention stays inside each packed document (boundaries after every separator)")

    _paths = field_validator("path", "tokenizer_path")(check_path)

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "local" and not self.path:
            raise ValueError("data.path is required when data.source=local")
        return self
