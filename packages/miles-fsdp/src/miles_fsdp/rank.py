"""One FSDP2 trainer rank: the model shard, the optimizer, and the step.

Runs inside a rank process (see ``worker.py``) with the default process group
already initialised. Everything here is a collective: every rank calls the same
methods in the same order with its own share of the data.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.config.schema import TrainSection
from miles.errors import ComponentError, ModelError
from miles.interfaces import (
    BackendSpec,
    Correction,
    CorrectionOutput,
    Loss,
    LossInputs,
    LossOutput,
    TransportStats,
)
from miles_fsdp import checkpoint
from miles_fsdp.batching import MicroBatchTensors, RankBatch, collate
from miles_fsdp.config import FSDPOptions
from miles_fsdp.logprobs import token_logprobs
from miles_fsdp.weights import iter_full_tensors

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: HF marks them in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        for mod in model.modules():
            if isinstance(mod, nn.ModuleList) and len(mod) > 0:
                layers = list(mod)
                break
    return layers


class RankTrainer:
    def __init__(self, spec: BackendSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.train_opts = TrainSection.model_validate(spec.options.get("train", {}))
        self.opts = FSDPOptions.model_validate(spec.options.get("fsdp", {}))
        if self.opts.device == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # Distinct streams per rank (dropout masks must not repeat across data-parallel shards).
        torch.manual_seed(spec.seed + rank)
        self.model = self._build_model()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.train_opts.lr,
            betas=tuple(self.train_opts.betas),
            eps=self.train_opts.eps,
            weight_decay=self.train_opts.weight_decay,
        )
        warmup = self.train_opts.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
        )
        self.loss_fn, self.correction_fn, self.hooks = self._resolve_components()
        self.transport = self._connect_transport()

    # ------------------------------------------------------------------ build

    def _build_model(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = self.spec.model_path
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ModelError(f"fsdp: cannot load a Hugging Face config from {path!r}: {exc}") from exc
        # The checkpoint's own dtype, remembered before loading in float32 rewrites it.
        self.source_dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(self.source_dtype, str):
            self.source_dtype = _DTYPES.get(self.source_dtype, torch.float32)
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if self.opts.attn_implementation:
            kwargs["attn_implementation"] = self.opts.attn_implementation
        # Master weights stay float32; param_dtype only changes the gathered compute copies.
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        # Training never decodes; the exported config gets the checkpoint's own setting back.
        self.source_use_cache = getattr(model.config, "use_cache", True)
        model.config.use_cache = False
        if self.opts.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = decoder_layers(model)
        if not layers:
            raise ModelError(
                f"fsdp: found no decoder layers to shard in {type(model).__name__} from {path!r}"
            )

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(
            param_dtype=_DTYPES[self.opts.param_dtype] if self.opts.param_dtype else None,
            reduce_dtype=_DTYPES[self.opts.reduce_dtype] if self.opts.reduce_dtype else None,
        )
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=self.opts.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=self.opts.reshard_after_forward)
        # The loss is already divided by the global token count, so ranks' gradients must be
        # summed, not averaged: a plain SUM reduce-scatter with no division.
        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                mod.set_force_sum_reduction_for_comms(True)
                mod.set_gradient_divide_factor(1.0)
        return model

    def _resolve_components(self) -> tuple[Loss, Correction | None, Any]:
        from miles.plugins import get_plugin_manager, make_component

        loss = make_component("loss", self.spec.loss, self.spec.loss_options)
        correction = None
        if self.spec.correction:
            correction = make_component("correction", self.spec.correction, self.spec.correction_options)
        return loss, correction, get_plugin_manager().hook

    def _connect_transport(self) -> Any:
        if not self.spec.engine_urls:
            return None
        from miles.plugins import make_component

        options = dict(self.spec.transport_options)
        transport = make_component("transport", self.spec.transport, options)
        device = str(self.device) if self.device.type == "cuda" else "cpu"
        transport.connect(
            list(self.spec.engine_urls), rank=self.rank, world_size=self.world_size, device=device
        )
        return transport

    # ------------------------------------------------------------------- step

    def train_step(self, batch: RankBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        sums: dict[str, float] = {}  # token-weighted sums of per-micro-batch metrics
        weights: dict[str, float] = {}
        loss_total = 0.0
        entropy_sum = 0.0
        tokens = 0
        for rows in batch.micro_batches:
            if not rows:
                self._idle_pass()
                continue
            mb = collate(rows, self.device)
            loss_value, entropy, metrics = self._micro_step(mb, batch.num_loss_tokens)
            loss_total += loss_value
            entropy_sum += entropy
            tokens += mb.num_tokens
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * mb.num_loss_tokens
                weights[key] = weights.get(key, 0.0) + mb.num_loss_tokens

        grad_norm = self._clip_grads()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (sums, weights, loss_total, entropy_sum, tokens))
        elapsed = time.perf_counter() - t0
        all_sums: dict[str, float] = {}
        all_weights: dict[str, float] = {}
        for s, w, *_ in gathered:
            for key in s:
                all_sums[key] = all_sums.get(key, 0.0) + s[key]
                all_weights[key] = all_weights.get(key, 0.0) + w[key]
        total_tokens = sum(g[4] for g in gathered)
        out = {key: all_sums[key] / all_weights[key] for key in all_sums if all_weights[key] > 0}
        out.update(
            {
                "train/loss": sum(g[2] for g in gathered),
                "train/entropy": sum(g[3] for g in gathered) / batch.num_loss_tokens,
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                "train/num_loss_tokens": float(batch.num_loss_tokens),
                "train/num_tokens": float(total_tokens),
                "train/tokens_per_s": total_tokens / elapsed if elapsed > 0 else 0.0,
            }
        )
        return out

    def _micro_step(
        self, mb: MicroBatchTensors, num_loss_tokens: int
    ) -> tuple[float, float, dict[str, float]]:
        logits = self.model(input_ids=mb.input_ids).logits
        b, seq_len, vocab = logits.shape
        resp_len = mb.loss_mask.shape[1]
        lp_rows, ent_rows = token_logprobs(
            logits.reshape(b * seq_len, vocab),
            mb.rows,
            mb.targets,
            temperature=self.spec.temperature,
            chunk=self.opts.logprob_chunk_tokens,
        )
        logprobs = torch.zeros(b * resp_len, dtype=torch.float32, device=self.device)
        logprobs = logprobs.index_put((mb.slots,), lp_rows).view(b, resp_len)
        entropy = torch.zeros(b * resp_len, dtype=torch.float32, device=self.device)
        entropy = entropy.index_put((mb.slots,), ent_rows).view(b, resp_len)
        # One optimizer step per rollout: at the start of this step the policy that produced
        # the "old" log-probs is the current one, so they are the current values, detached.
        old_logprobs = logprobs.detach()

        metrics: dict[str, float] = {}
        correction_weights = None
        if self.correction_fn is not None:
            corr = self.correction_fn(old_logprobs, mb.rollout_logprobs, mb.loss_mask)
            if not isinstance(corr, CorrectionOutput):
                raise ComponentError(
                    f"correction {self.spec.correction!r} returned {type(corr).__name__}, expected CorrectionOutput"
                )
            self.hooks.miles_correction_postprocess(output=corr, loss_mask=mb.loss_mask)
            correction_weights = corr.weights.detach()
            metrics.update({_prefixed("correction/", k): float(v) for k, v in corr.metrics.items()})

        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            rollout_logprobs=mb.rollout_logprobs,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            correction_weights=correction_weights,
            num_loss_tokens=num_loss_tokens,
        )
        out = self.loss_fn(inputs)
        if not isinstance(out, LossOutput):
            raise ComponentError(
                f"loss {self.spec.loss!r} returned {type(out).__name__}, expected LossOutput"
            )
        for replaced in self.hooks.miles_loss_postprocess(output=out, inputs=inputs):
            if replaced is not None:
                out = replaced
        loss = out.loss
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            raise ComponentError(
                f"loss {self.spec.loss!r} must return a scalar tensor that depends on inputs.logprobs "
                f"(got {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))})"
            )
        loss.backward()
        metrics.update({_prefixed("loss/", k): float(v) for k, v in out.metrics.items()})
        ent = float((entropy * mb.loss_mask).sum())
        return float(loss.detach()), ent, metrics

    def _idle_pass(self) -> None:
        """A zero-weight forward/backward so this rank joins the FSDP collectives of a pass it has no rows for."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids).logits
        (logits.sum() * 0.0).backward()

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.train_opts.grad_clip is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.train_opts.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ---------------------------------------------------------------- weights

    def update_weights(self, version: int) -> TransportStats | None:
        self.model.eval()
        if self.transport is None:
            # No engines to feed, but every rank still drains in step with the others.
            return TransportStats(bytes_sent=0, seconds=0.0, buckets=0, version=version)
        with torch.no_grad():
            stats = self.transport.send(iter_full_tensors(self.model), version)
        return stats if self.rank == 0 else None

    def save_checkpoint(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        checkpoint.save(
            directory, self.model, self.optimizer, self.scheduler, {"step": self.scheduler.last_epoch}
        )

    def load_checkpoint(self, directory: str) -> None:
        checkpoint.load(directory, self.model, self.optimizer, self.scheduler)

    def export_hf(self, directory: str) -> None:
        name = self.opts.export_dtype
        dtype = self.source_dtype if name == "auto" else _DTYPES[name]
        checkpoint.export_hf(
            directory, self.model, self.spec.model_path, dtype, {"use_cache": self.source_use_cache}
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def _prefixed(prefix: str, key: str) -> str:
    """Namespace a component's metric, unless the component already did (``correction/ratio_mean``)."""
    return key if key.startswith(prefix) else prefix + key
