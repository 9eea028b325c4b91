"""The ``fsdp`` recipe section: how the FSDP2 backend lays out and runs its ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DTypeName = Literal["float32", "bfloat16", "float16"]


class FSDPOptions(BaseModel):
    """Options of the FSDP2 training backend (recipe key ``fsdp``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_ranks: int = Field(1, ge=1, description="data-parallel rank processes (one GPU each on cuda)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu trains over gloo, cuda over NCCL")
    param_dtype: DTypeName | None = Field(
        None,
        description="mixed precision: dtype of the gathered parameters in forward/backward (None: float32)",
    )
    reduce_dtype: DTypeName | None = Field(
        None, description="mixed precision: dtype of the gradient reduce-scatter (None: param_dtype)"
    )
    reshard_after_forward: bool = Field(
        True,
        description="free gathered parameters after forward (less memory, one more all-gather in backward)",
    )
    gradient_checkpointing: bool = Field(False, description="recompute decoder-layer activations in backward")
    pin_offload: bool = Field(
        True,
        description="colocated offload: copy the trainer's state into page-locked host memory, without a "
        "host wait per tensor (several times faster; the pinned memory stays reserved between offloads)",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (fuses its norms, rotary embedding and activation "
        "into few kernels; the first steps pay the compilation); FSDP's own hooks stay eager",
    )
    compile_backend: str = Field(
        "inductor",
        description="torch.compile backend for fsdp.compile (inductor; aot_eager traces without codegen)",
    )
    attn_implementation: str | None = Field(
        None,
        description="transformers attention backend (sdpa, eager, flash_attention_2...); None: its default",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per rank (None: $MILES_TORCH_THREADS, else torch's default)",
    )
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of export_hf weights; auto keeps the source checkpoint's dtype"
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="tokens per chunk when turning logits into log-probs (bounds the float32 temporaries)",
    )
    max_tokens_per_gpu: int | None = Field(
        None,
        ge=2,
        description="packed training: micro-batches of at most this many tokens (prompt + response), the "
        "samples concatenated into one unpadded row with per-sample positions, instead of "
        "train.micro_batch_size padded samples (None: padded micro-batches)",
    )
    logprob_projection: Literal["full", "chunked"] = Field(
        "full",
        description="full: the model's logits for every position, then log-probs chunk by chunk; chunked: "
        "the output projection too is done a chunk of response positions at a time, so [positions, vocab] "
        "logits never exist (less memory and no logits for prompt positions; same values up to rounding)",
    )
    start_method: Literal["spawn", "forkserver"] = Field(
        "spawn",
        description="how rank processes start: spawn (a fresh interpreter each) or forkserver (forked from a "
        "server that imported torch and transformers once, much faster to start several times)",
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="rank start-up and model loading limit")
    command_timeout_s: float = Field(
        3600.0, gt=0, description="limit for one train/save/sync command on the ranks"
    )

    @model_validator(mode="after")
    def _known_compile_backend(self) -> FSDPOptions:
        # Another backend than the default without compile is a mistake; the default itself is what
        # every dumped section carries (the driver hands the ranks the section's model_dump()).
        default_backend = type(self).model_fields["compile_backend"].default
        if not self.compile and self.compile_backend != default_backend:
            raise ValueError("fsdp.compile_backend is set but fsdp.compile is false: set fsdp.compile: true")
        if self.compile:
            # Only when asked: importing dynamo costs about a second.
            import torch._dynamo

            known = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in known:
                raise ValueError(
                    f"fsdp.compile_backend {self.compile_backend!r} is not a torch.compile backend; "
                    f"known: {', '.join(sorted(known))}"
                )
        return self
