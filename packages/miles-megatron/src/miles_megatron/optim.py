"""megatron-core's data-parallel wrapper and Adam on CUDA, as the policy and the critic both use them.

``megatron_ddp`` wraps a model in megatron's ``DistributedDataParallel`` (FP32 ``main_grad`` buffers,
reduced by ``finalize_model_grads``) and points the model's ``TransformerConfig`` at its hooks;
``megatron_adam`` builds megatron's optimizer over it from the recipe's ``train`` section (with bf16
parameters it keeps FP32 master weights) and sets the config's loss-scale hook.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.config.schema import TrainSection


def megatron_ddp(config: Any, model: torch.nn.Module) -> Any:
    """``model`` in megatron's DDP; ``config`` (its ``TransformerConfig``) gets DDP's no-sync and finalize hooks."""
    from megatron.core.distributed import (  # type: ignore[import-untyped]
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = None
    return wrapped


def megatron_adam(config: Any, ddp_model: Any, train: TrainSection, lr: float, dtype: torch.dtype) -> Any:
    """megatron's Adam over ``ddp_model`` at ``lr`` with ``train``'s decay, betas, eps and clipping."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # type: ignore[import-untyped]

    bf16 = dtype == torch.bfloat16
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=train.weight_decay,
            adam_beta1=train.betas[0],
            adam_beta2=train.betas[1],
            adam_eps=train.eps,
            clip_grad=train.grad_clip or 0.0,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=False,
        ),
        [ddp_model],
    )
    config.grad_scale_func = optimizer.scale_loss if bf16 else None
    return optimizer
