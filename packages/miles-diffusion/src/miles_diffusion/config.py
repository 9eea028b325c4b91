"""The ``diffusion:`` recipe section: the diffusion backend's own settings (beside ``train:``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SECTION = "diffusion"


class DiffusionSection(BaseModel):
    """How the diffusion backend trains: on the CPU, one process or ``fsdp_ranks`` FSDP2 ranks (the
    optimizer settings are ``train:``'s)."""

    model_config = ConfigDict(extra="forbid")

    deterministic: bool = Field(
        True,
        description="torch's deterministic algorithms on for the trainer (and seeded RNGs); attention "
        "processors without a deterministic mode are refused",
    )
    train_step_fraction: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="flow_grpo: share of the denoising steps re-scored and trained per step",
    )
    steps_per_update: int = Field(
        2, ge=1, description="denoising steps (flow_grpo) or noise levels (diffusion_nft) per optimizer step"
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch threads of the trainer (None: as started)"
    )
    fsdp_ranks: int = Field(
        1,
        ge=1,
        description="flow_grpo: local FSDP2 data-parallel ranks (gloo, CPU), each re-scoring its share of "
        "the step's trajectories; 1: one process, no sharding",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="flow_grpo with fsdp_ranks: groups of this many ranks re-score the same trajectories, "
        "each on a share of the video tokens (Ulysses attention; the wan family); must divide fsdp_ranks",
    )
