"""The ``megatron`` recipe section: the parallel layout and device of the Megatron-core backend."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_DIR_ALLOWED = "allowed: an existing, writable directory on node-local disk"


def directory_problem(directory: str, key: str) -> str | None:
    """Why ``directory`` (the recipe's ``key``) cannot take the files a run writes there, one sentence, or None."""
    if not os.path.exists(directory):
        return f"{key} {directory!r} does not exist; {_DIR_ALLOWED}"
    if not os.path.isdir(directory):
        return f"{key} {directory!r} is not a directory; {_DIR_ALLOWED}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{key} {directory!r} is not writable; {_DIR_ALLOWED}"
    return None


class MegatronOptions(BaseModel):
    """Options of the Megatron-core training backend (recipe key ``megatron``).

    The world is ``num_ranks`` processes, one GPU each (or CPU processes over gloo); data parallelism takes what the
    model-parallel sizes leave (``miles_megatron.layout.plan_layout``).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_ranks: int = Field(1, ge=1, description="trainer rank processes, one GPU each")
    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="cuda: NCCL, one GPU per rank; cpu: gloo, megatron's model and tensor parallelism on CPU "
        "with torch's AdamW (megatron's DDP, optimizer and schedules are CUDA-only), for tests",
    )
    tensor_parallel: int = Field(1, ge=1, description="TP: attention heads and MLP columns split over ranks")
    pipeline_parallel: int = Field(1, ge=1, description="PP: decoder layers split into stages")
    context_parallel: int = Field(1, ge=1, description="CP: each sequence split over ranks")
    expert_parallel: int = Field(1, ge=1, description="EP: MoE experts split over ranks")
    expert_tensor_parallel: int | None = Field(
        None, ge=1, description="ETP: TP inside each expert (None: the same as tensor_parallel)"
    )
    sequence_parallel: bool = Field(
        False, description="shard activations outside attention/MLP over the TP group (needs TP > 1)"
    )
    params_dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="dtype of the model weights")
    layer_spec: Literal["auto", "local", "te"] = Field(
        "auto",
        description="megatron layer spec: local (megatron-core's own modules), te (Transformer Engine), "
        "auto (te when transformer-engine is installed)",
    )
    core_attention: Literal["sdpa", "megatron"] | None = Field(
        None,
        description="the local layer spec's core attention: sdpa (torch's scaled_dot_product_attention, the flash "
        "kernel for bf16 on a GPU; miles_megatron.attention) or megatron (megatron-core's DotProductAttention, "
        "which materialises the score matrix; CUDA only). None: sdpa. The te spec has Transformer Engine's own",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="pack each micro-batch to at most this many tokens (THD, needs the te spec); "
        "None: train.micro_batch_size padded samples",
    )
    offload_to: Literal["host", "disk"] = Field(
        "host",
        description="colocated offload of the paused actor (weights, gradients, optimizer state): host copies "
        "each storage to (pinned) host memory; disk streams each to a file under offload_dir through one "
        "staging buffer of offload_staging_mb, so host memory stays bounded whatever the model's size",
    )
    offload_dir: str | None = Field(
        None,
        description="offload_to disk: an existing, writable directory on node-local disk; each offload creates "
        "a fresh subdirectory there and removes it (and only it) at onload. None: the system temp directory",
    )
    offload_staging_mb: int = Field(
        64, ge=1, description="offload_to disk: size of the one reusable (pinned on CUDA) staging buffer, MiB"
    )

    optimizer_streaming: bool = Field(
        False,
        description="keep AdamW's state (FP32 master weights, moments) on disk, one safetensors file per bucket "
        "of parameters, each brought to the device only for its update (miles_megatron.streaming)",
    )
    optimizer_streaming_dir: str | None = Field(
        None,
        description="optimizer_streaming: an existing, writable directory on node-local disk for the bucket files; "
        "each rank creates a fresh subdirectory there and removes it (and only it) at shutdown. None: the "
        "system temp directory",
    )
    optimizer_streaming_bucket_mb: float = Field(
        256.0, gt=0, description="optimizer_streaming: state bytes per bucket (master + two moments), MiB"
    )
    optimizer_streaming_moments: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="optimizer_streaming: the stored dtype of exp_avg and exp_avg_sq (the math is FP32)",
    )
    optimizer_streaming_prefetch: bool = Field(
        True,
        description="optimizer_streaming: read the next bucket on a thread while one updates (two resident)",
    )

    @model_validator(mode="after")
    def _offload_dir_needs_disk(self) -> MegatronOptions:
        if self.offload_dir is not None and self.offload_to != "disk":
            raise ValueError(
                f"megatron.offload_dir is set but megatron.offload_to is {self.offload_to!r}; "
                "allowed: offload_to: disk with offload_dir, or no offload_dir"
            )
        if self.optimizer_streaming_dir is not None and not self.optimizer_streaming:
            raise ValueError(
                "megatron.optimizer_streaming_dir is set but megatron.optimizer_streaming is false; "
                "allowed: optimizer_streaming: true with optimizer_streaming_dir, or no optimizer_streaming_dir"
            )
        return self

    def storage_problems(self) -> list[str]:
        """The directories the options name that cannot be written, one sentence each (checked before any model work)."""
        out = []
        if self.offload_to == "disk":
            import tempfile

            problem = directory_problem(self.offload_dir or tempfile.gettempdir(), "megatron.offload_dir")
            if problem is not None:
                out.append(problem)
        if self.optimizer_streaming:
            import tempfile

            where = self.optimizer_streaming_dir or tempfile.gettempdir()
            problem = directory_problem(where, "megatron.optimizer_streaming_dir")
            if problem is not None:
                out.append(problem)
        return out
