"""Small components the FSDP tests select by import path (``fsdp.components:...``), as a user would."""

from __future__ import annotations

import os
import sys

import torch

from miles import hookimpl
from miles.interfaces import CorrectionOutput, LossInputs, LossOutput


class RankHooks:
    """Hook implementations a component registers inside the rank process (as an installed plugin would)."""

    @hookimpl
    def miles_correction_postprocess(self, output: CorrectionOutput, loss_mask: torch.Tensor) -> None:
        output.weights.mul_(2.0)
        output.metrics["doubled"] = 1.0

    @hookimpl
    def miles_loss_postprocess(self, output: LossOutput, inputs: LossInputs) -> LossOutput:
        # An extra term that is zero in value but proves the replacement is the loss that is used.
        return LossOutput(loss=output.loss * 1.0, metrics={**output.metrics, "hooked": 1.0})


class PGLoss:
    """Plain policy gradient with the global token mean; optionally dumps what it receives."""

    def __init__(self, dump_dir: str | None = None, register_hooks: bool = False) -> None:
        self.dump_dir = dump_dir
        self.calls = 0
        if register_hooks:
            from miles.plugins import get_plugin_manager

            get_plugin_manager().register(RankHooks(), name="fsdp-test-rank-hooks")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.loss_mask
        weights = (
            inputs.advantages
            if inputs.correction_weights is None
            else inputs.advantages * inputs.correction_weights
        )
        loss = -(weights * inputs.logprobs * mask).sum() / inputs.num_loss_tokens
        if self.dump_dir:
            torch.save(
                {
                    "logprobs": inputs.logprobs.detach().cpu(),
                    "old_logprobs": inputs.old_logprobs.cpu(),
                    "rollout_logprobs": inputs.rollout_logprobs.cpu(),
                    "loss_mask": mask.cpu(),
                    "num_loss_tokens": inputs.num_loss_tokens,
                    "correction_weights": None
                    if inputs.correction_weights is None
                    else inputs.correction_weights.cpu(),
                },
                os.path.join(self.dump_dir, f"{os.getpid()}-{self.calls}.pt"),
            )
        self.calls += 1
        n = float(mask.sum())
        return LossOutput(
            loss=loss, metrics={"mean_logprob": float((inputs.logprobs.detach() * mask).sum()) / max(n, 1.0)}
        )


class ReportedPGLoss(PGLoss):
    """``PGLoss`` that also logs its own value (``base``) and the correction weights it trained with,
    so a test can check exactly what the rank's hooks added to or changed in them."""

    def __call__(self, inputs: LossInputs) -> LossOutput:
        out = super().__call__(inputs)
        out.metrics["base"] = float(out.loss.detach())
        if inputs.correction_weights is not None:
            mask = inputs.loss_mask
            out.metrics["trained_weight_mean"] = float((inputs.correction_weights * mask).sum() / mask.sum())
        return out


class HalfCorrection:
    """Weights every token by 0.5 and reports a constant metric: enough to see the plumbing."""

    def __call__(
        self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
    ) -> CorrectionOutput:
        return CorrectionOutput(weights=torch.full_like(old_logprobs, 0.5), metrics={"weight_mean": 0.5})


class FailingLoss:
    """Fails on one rank only (so the other rank is left waiting in a collective)."""

    def __init__(self, rank: int = 1, mode: str = "raise") -> None:
        self.rank = rank
        self.mode = mode

    def __call__(self, inputs: LossInputs) -> LossOutput:
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            if self.mode == "exit":
                sys.stderr.flush()
                os._exit(3)
            raise RuntimeError("deliberate failure in the test loss")
        return LossOutput(loss=(inputs.logprobs * inputs.loss_mask).sum() / inputs.num_loss_tokens)
