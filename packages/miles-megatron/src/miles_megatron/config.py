"""The ``megatron`` recipe section: the parallel layout and device of the Megatron-core backend."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="pack each micro-batch to at most this many tokens (THD, needs the te spec); "
        "None: train.micro_batch_size padded samples",
    )
