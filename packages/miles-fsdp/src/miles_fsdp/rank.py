"""One FSDP2 trainer rank: the model shard, the optimizer, and the step.

Runs inside a rank process (see ``worker.py``) with the default process group
already initialised. Everything here is a collective: every rank calls the same
methods in the same order with its own share of the data.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import miles.lora
from miles.config.schema import TrainSection
from miles.errors import ComponentError
from miles.interfaces import (
    REF_LOGPROBS,
    TEACHER_LOGPROBS,
    VALUES,
    BackendSpec,
    Correction,
    CorrectionOutput,
    Loss,
    LossInputs,
    LossOutput,
    TransportStats,
)
from miles.lr_schedule import decay_steps, lr_multiplier
from miles.routing import ROUTING_MISMATCH
from miles.train_rows import OLD_LOGPROBS
from miles_fsdp import checkpoint
from miles_fsdp import lora as lora_mod
from miles_fsdp.batching import MicroBatchTensors, RankBatch, collate
from miles_fsdp.config import FSDPOptions
from miles_fsdp.logprobs import projected_token_logprobs, token_logprobs
from miles_fsdp.models import (
    DTYPES,
    check_projectable,
    freeze,
    load_causal_lm,
    load_config,
    load_value_model,
    shard,
    source_dtype,
)
from miles_fsdp.routing import RouterReplay, replayable_routers
from miles_fsdp.weights import iter_full_tensors

log = logging.getLogger(__name__)

LOSS_KINDS = ("policy", "supervised")


class RankTrainer:
    def __init__(
        self, spec: BackendSpec, rank: int, world_size: int, device_index: int | None = None
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.train_opts = TrainSection.model_validate(spec.options.get("train", {}))
        self.opts = FSDPOptions.model_validate(spec.options.get("fsdp", {}))
        # This process's plugin manager is fresh: the driver's miles_configure never reached it.
        # Plugins configure themselves from the run's config first, so that everything built
        # below (loss, correction, transport) and every rank hook sees the recipe's values.
        from miles._plugins.backend_hooks import configure_process
        from miles.plugins import get_plugin_manager

        self.pm = get_plugin_manager()
        configure_process(spec.config, self.pm)
        self.hooks = self.pm.hook
        if self.opts.device == "cuda":
            # Its rank on one machine; a Ray actor sees only the GPU Ray gave it (index 0).
            self.device = torch.device("cuda", rank if device_index is None else device_index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # Distinct streams per rank (dropout masks must not repeat across data-parallel shards).
        torch.manual_seed(spec.seed + rank)
        self.mesh = init_device_mesh(self.device.type, (world_size,))

        config = load_config(spec.model_path, "policy")
        self.source_dtype = source_dtype(config)
        self.source_use_cache = getattr(config, "use_cache", True)
        policy = load_causal_lm(spec.model_path, self.opts, "policy")
        if self.opts.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # LoRA: the base is frozen and only the adapter trains, is checkpointed and is sent to engines.
        self.lora = miles.lora.section(spec.config)
        trained: nn.Module = policy if self.lora is None else lora_mod.wrap(policy, self.lora)
        if self.opts.logprob_projection == "chunked":
            check_projectable(trained, "policy")
        self.model = shard(trained, self.mesh, self.opts, "policy")
        # MoE: the policy's routers are hooked to count how often their top-k differs from the routing
        # the rollout recorded and, with train.use_rollout_routing_replay, to route as it did (R3). Not
        # under fsdp.compile (replay is refused with it): the hooks would live in the compiled layers.
        self.routing: RouterReplay | None = None
        replay = self.train_opts.use_rollout_routing_replay
        if replay or (not self.opts.compile and replayable_routers(self.model)):
            self.routing = RouterReplay(self.model, replay=replay)
        # Each adapter's name on the engines -> its name in the peft model (empty: full training).
        self.adapters = lora_mod.peft_names(self.lora) if self.lora is not None else {}
        # Multi-LoRA: one optimizer (and schedule) per adapter, over that adapter's parameters only.
        self.steppers: dict[str, tuple[torch.optim.Optimizer, Any]] = {}
        if self.lora is not None and self.lora.multi:
            for name, shape in self.lora.named().items():
                params = [p for _, p in lora_mod.adapter_parameters(self.model, self.adapters[name])]
                self.steppers[name] = self._optimizer(self.model, self._adapter_lr(shape), params)
            (self.optimizer, self.scheduler), *_ = self.steppers.values()
        else:
            self.optimizer, self.scheduler = self._optimizer(self.model, self.train_opts.lr)
        # Adapters whose tensors changed since the engines last received them (multi-LoRA sends only those).
        self._unsent: set[str] = set()
        more = [(name, opt, sch) for name, (opt, sch) in list(self.steppers.items())[1:]]
        self.parts = [
            checkpoint.Trainable(
                "model",
                self.model,
                self.optimizer,
                self.scheduler,
                trainable_only=self.lora is not None,
                more=more,
            )
        ]

        # Frozen scorers, built only when the objective reads what they compute.
        self.scorers: dict[str, nn.Module] = {}
        if REF_LOGPROBS in spec.scores:
            path = spec.ref_model_path or spec.model_path
            reference = load_causal_lm(path, self.opts, "reference")
            if self.opts.logprob_projection == "chunked":
                check_projectable(reference, "reference")
            self.scorers[REF_LOGPROBS] = freeze(shard(reference, self.mesh, self.opts, "reference"))
        if TEACHER_LOGPROBS in spec.scores:
            if not spec.teacher_model_path:
                raise ComponentError(
                    "fsdp: teacher_logprobs requested but the spec names no teacher_model_path"
                )
            teacher = load_causal_lm(spec.teacher_model_path, self.opts, "teacher")
            if self.opts.logprob_projection == "chunked":
                check_projectable(teacher, "teacher")
            self.scorers[TEACHER_LOGPROBS] = freeze(shard(teacher, self.mesh, self.opts, "teacher"))

        self.critic = None
        if spec.critic is not None:
            self.critic = shard(
                load_value_model(spec.critic.model_path, self.opts), self.mesh, self.opts, "critic"
            )
            self.critic_optimizer, self.critic_scheduler = self._optimizer(self.critic, spec.critic.lr)
            self.parts.append(
                checkpoint.Trainable("critic", self.critic, self.critic_optimizer, self.critic_scheduler)
            )
        elif VALUES in spec.scores:
            raise ComponentError("fsdp: values requested but the spec has no critic")

        self.loss_fn, self.correction_fn, self.value_loss_fn = self._resolve_components()
        self.transport = self._connect_transport()

    # ------------------------------------------------------------------ build

    def _optimizer(
        self, model: nn.Module, lr: float, params: list[nn.Parameter] | None = None
    ) -> tuple[torch.optim.Optimizer, Any]:
        opts = self.train_opts
        # Frozen parameters (a LoRA run's base) get no optimizer state.
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=lr, betas=opts.betas, eps=opts.eps, weight_decay=opts.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_lambda())
        return optimizer, scheduler

    def _adapter_lr(self, shape: Any) -> float:
        lr = getattr(shape, "lr", None)
        return self.train_opts.lr if lr is None else float(lr)

    def _lr_lambda(self) -> Callable[[int], float]:
        # The schedule counts optimizer steps (steps_per_rollout of them per driver step).
        return lr_multiplier(self.train_opts, decay_steps(self.train_opts, self.spec.config))

    def _resolve_components(self) -> tuple[Loss, Correction | None, Loss | None]:
        from miles.plugins import make_component

        loss = make_component("loss", self.spec.loss, self.spec.loss_options)
        kind = getattr(loss, "kind", "policy")
        if kind not in LOSS_KINDS:
            raise ComponentError(
                f"loss {self.spec.loss!r} has kind {kind!r}; the policy trains with a loss of kind "
                f"{' or '.join(LOSS_KINDS)} (value losses belong to algorithm.critic.loss)"
            )
        correction = None
        if self.spec.correction:
            correction = make_component("correction", self.spec.correction, self.spec.correction_options)
        value_loss = None
        if self.spec.critic is not None:
            value_loss = make_component("loss", self.spec.critic.loss, self.spec.critic.loss_options)
            if getattr(value_loss, "kind", "policy") != "value":
                raise ComponentError(f"algorithm.critic.loss {self.spec.critic.loss!r} is not a value loss")
        return loss, correction, value_loss

    def _connect_transport(self) -> Any:
        if not self.spec.engine_urls:
            return None
        from miles.plugins import make_component

        options = dict(self.spec.transport_options)
        transport = make_component("transport", self.spec.transport, options)
        device = str(self.device) if self.device.type == "cuda" else "cpu"
        if self.lora is not None:
            self._serve_adapter(transport)
        transport.connect(
            list(self.spec.engine_urls), rank=self.rank, world_size=self.world_size, device=device
        )
        if getattr(transport, "wants_base_weights", False):
            # Before any step the policy is exactly the checkpoint the engines loaded: their base.
            with torch.no_grad():
                # seed() comes with wants_base_weights (an optional part of the Transport protocol).
                transport.seed(iter_full_tensors(self.model), 0)  # type: ignore[attr-defined]
        return transport

    def _serve_adapter(self, transport: Any) -> None:
        """LoRA: load the initial adapter on every engine by name, and point the transport at it.

        The adapter's configuration (rank, alpha, targets) reaches the engines once, through a peft
        directory and ``/load_lora_adapter``; every later update carries only its tensors."""
        assert self.lora is not None
        carry = getattr(transport, "carry_adapter", None)
        if not callable(carry):
            raise ComponentError(
                f"transport {self.spec.transport!r} cannot carry a LoRA adapter; use broadcast or colocated"
            )
        carry(next(iter(self.adapters)))  # multi-LoRA refuses the weight check, which this scopes
        root = _run_dir(self.spec.config)
        for name, peft_adapter in self.adapters.items():
            directory = os.path.join(root, "lora", f"{name}-initial")
            lora_mod.save_adapter(
                directory, self.model, self.spec.model_path, write=self.rank == 0, peft_adapter=peft_adapter
            )
            if self.rank == 0:
                from miles.engines.client import SyncEngineClient

                for url in self.spec.engine_urls:
                    with SyncEngineClient(url) as client:
                        client.load_lora_adapter(name, directory)
        dist.barrier()

    def optimizer_state_bytes(self, _: None = None) -> int:
        """Bytes of this rank's policy optimizer state (AdamW moments: only the adapter's under LoRA)."""
        optimizers = [o for o, _ in self.steppers.values()] or [self.optimizer]
        return sum(
            t.numel() * t.element_size()
            for optimizer in optimizers
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )

    def _weight_stream(self) -> Any:
        if self.steppers:  # multi-LoRA: only the adapters that changed since the last update
            sent = {name: peft for name, peft in self.adapters.items() if name in self._unsent}
            self._unsent.clear()
            return lora_mod.iter_adapter_tensors(self.model, sent)
        if self.lora is not None:
            return lora_mod.iter_adapter_tensors(self.model, self.adapters)
        return iter_full_tensors(self.model)

    def unsent_adapters(self, _: None = None) -> list[str]:
        """Multi-LoRA: the adapters the next weight update will send (those trained since the last)."""
        return [name for name in self.adapters if name in self._unsent]

    # ---------------------------------------------------------------- scoring

    def score(self, args: tuple[Any, ...]) -> list[list[dict[str, list[float]]]]:
        """Forward-only passes: per micro-batch, per row, the named per-token signals."""
        batch, names, *adapter = args
        if adapter and adapter[0] is not None:  # multi-LoRA: these rows are this adapter's
            lora_mod.activate(self.model, self.adapters[adapter[0]])
        unknown = [
            n
            for n in names
            if n not in self.scorers and n != OLD_LOGPROBS and not (n == VALUES and self.critic is not None)
        ]
        if unknown:
            raise ComponentError(
                f"fsdp: cannot score {unknown}; this trainer was built for {self.spec.scores}"
            )
        out: list[list[dict[str, list[float]]]] = []
        if OLD_LOGPROBS in names:
            self.model.eval()  # the "old" policy is scored as the engines sample: no dropout
        with torch.no_grad():
            for rows in batch.micro_batches:
                if not rows:
                    for name in names:
                        self._idle_forward(self._scoring_model(name))
                    out.append([])
                    continue
                mb = collate(rows, self.device, packed=batch.packed)
                with self._routed(mb):
                    per_name = {name: self._score_tensor(name, mb) for name in names}
                lengths = [len(r.response_ids) for r in rows]
                out.append(
                    [{name: t[i, :n].tolist() for name, t in per_name.items()} for i, n in enumerate(lengths)]
                )
        return out

    def loss_kind(self, _: None = None) -> str:
        """The policy loss's kind (policy or supervised): whether a step reads old log-probs."""
        return str(getattr(self.loss_fn, "kind", "policy"))

    def _scoring_model(self, name: str) -> nn.Module:
        if name == OLD_LOGPROBS:
            return self.model
        if name == VALUES:
            assert self.critic is not None  # values are scored only with a critic
            return self.critic
        return self.scorers[name]

    def _score_tensor(self, name: str, mb: MicroBatchTensors) -> torch.Tensor:
        if name == VALUES:
            return self._values(mb)
        model = self._scoring_model(name)
        logprobs, _ = self._response_logprobs(model, mb)
        return logprobs

    # ------------------------------------------------------------------- step

    def train_step(self, batch: RankBatch) -> dict[str, float]:
        return self._train(batch, self.optimizer, self.scheduler, with_critic=True)

    def train_adapters(self, parts: list[tuple[str, RankBatch]]) -> dict[str, float]:
        """Multi-LoRA: one optimizer step of each adapter on its rows of the step's batch.

        Each adapter's rows run with only that adapter active, so its gradient is what training it
        alone on those rows gives; adapters with no rows in the batch take no step and are not sent.
        Every rank gets the same adapters in the same order (the backend splits the batch so).
        """
        out: dict[str, float] = {}
        for name, batch in parts:
            lora_mod.activate(self.model, self.adapters[name])
            optimizer, scheduler = self.steppers[name]
            metrics = self._train(batch, optimizer, scheduler, with_critic=False)
            self._unsent.add(name)
            out |= {f"lora/{name}/{k}": v for k, v in metrics.items()}
        return out

    def _train(
        self, batch: RankBatch, optimizer: torch.optim.Optimizer, scheduler: Any, *, with_critic: bool
    ) -> dict[str, float]:
        self._sync()
        t0 = time.perf_counter()
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        acc = _MetricSums()
        loss_total = 0.0
        entropy_sum = 0.0
        tokens = 0
        if self.routing is not None:
            self.routing.take_counts()  # a scoring pass's counts are not this step's
        for rows in batch.micro_batches:
            if not rows:
                self._idle_pass(self.model)
                continue
            mb = collate(rows, self.device, packed=batch.packed)
            with self._routed(mb):
                loss_value, entropy, metrics = self._micro_step(mb, batch)
            loss_total += loss_value
            entropy_sum += entropy
            tokens += mb.num_tokens
            acc.add(metrics, mb.num_loss_tokens)
        if self.routing is not None:
            mismatched, recorded = self.routing.take_counts()
            if recorded:  # weighted by recorded (token, layer) pairs: the ranks' shares combine exactly
                acc.add({ROUTING_MISMATCH: mismatched / recorded}, recorded)
        self._sync()
        t_fb = time.perf_counter()
        grad_norm = self._clip_grads(self.model)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self._sync()
        t_opt = time.perf_counter()

        critic_metrics: dict[str, float] = {}
        if self.critic is not None and with_critic:
            critic_metrics = self._critic_step(batch, acc)
            self._sync()
            critic_metrics["time/train_step/critic_s"] = time.perf_counter() - t_opt

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (acc.sums, acc.weights, loss_total, entropy_sum, tokens))
        elapsed = time.perf_counter() - t0
        out = _MetricSums.combine([(g[0], g[1]) for g in gathered])
        total_tokens = sum(g[4] for g in gathered)
        out.update(critic_metrics)
        out.update(
            {
                "train/loss": sum(g[2] for g in gathered),
                "train/entropy": sum(g[3] for g in gathered) / max(batch.num_loss_tokens, 1),
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                "train/num_loss_tokens": float(batch.num_loss_tokens),
                "train/num_tokens": float(total_tokens),
                "train/tokens_per_s": total_tokens / elapsed if elapsed > 0 else 0.0,
                # This rank's clock; every rank waits for the slowest in the collectives anyway.
                "time/train_step/forward_backward_s": t_fb - t0,
                "time/train_step/optimizer_s": t_opt - t_fb,
            }
        )
        if self.device.type == "cuda":
            # The high-water mark of this rank's GPU memory since it started (what a bigger batch must fit).
            out["train/cuda_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _sync(self) -> None:
        """Wait for the GPU's queued work, so that a phase's clock reads its kernels, not their launch."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _micro_step(self, mb: MicroBatchTensors, batch: RankBatch) -> tuple[float, float, dict[str, float]]:
        kind = getattr(self.loss_fn, "kind", "policy")
        requires = frozenset(getattr(self.loss_fn, "requires", ()))
        logprobs, entropy = self._response_logprobs(self.model, mb)
        metrics: dict[str, float] = {}
        inputs = LossInputs(
            loss_mask=mb.loss_mask,
            logprobs=logprobs,
            num_loss_tokens=batch.num_loss_tokens,
            num_samples=batch.num_samples,
            entropy=entropy if "entropy" in requires else None,
        )
        if kind == "policy":
            if OLD_LOGPROBS in mb.scores:
                # Several optimizer steps per batch: the policy before the first one, scored once.
                inputs.old_logprobs = mb.scores[OLD_LOGPROBS]
            else:
                # One optimizer step per batch: the policy that the "old" log-probs stand for is
                # the current one, so they are the current values, detached.
                inputs.old_logprobs = logprobs.detach()
            inputs.rollout_logprobs = mb.rollout_logprobs
            inputs.advantages = mb.advantages
            if REF_LOGPROBS in requires:
                inputs.ref_logprobs = _score(mb, REF_LOGPROBS, self.spec.loss)
            if self.correction_fn is not None:
                corr = self.correction_fn(inputs.old_logprobs, mb.rollout_logprobs, mb.loss_mask)
                if not isinstance(corr, CorrectionOutput):
                    raise ComponentError(
                        f"correction {self.spec.correction!r} returned {type(corr).__name__}, expected CorrectionOutput"
                    )
                self.hooks.miles_correction_postprocess(output=corr, loss_mask=mb.loss_mask)
                inputs.correction_weights = corr.weights.detach()
                metrics.update({_prefixed("correction/", k): float(v) for k, v in corr.metrics.items()})

        out = self._call_loss(self.loss_fn, self.spec.loss, inputs, kind=kind)
        out.loss.backward()
        metrics.update({_prefixed("loss/", k): float(v) for k, v in out.metrics.items()})
        ent = float((entropy.detach() * mb.loss_mask).sum())
        return float(out.loss.detach()), ent, metrics

    def _critic_step(self, batch: RankBatch, acc: _MetricSums) -> dict[str, float]:
        assert self.critic is not None and self.value_loss_fn is not None and self.spec.critic is not None
        self.critic.train()
        self.critic_optimizer.zero_grad(set_to_none=True)
        lr = self.critic_scheduler.get_last_lr()[0]
        for rows in batch.micro_batches:
            if not rows:
                self._idle_pass(self.critic)
                continue
            mb = collate(rows, self.device, packed=batch.packed)
            inputs = LossInputs(
                loss_mask=mb.loss_mask,
                values=self._values(mb),
                old_values=_score(mb, VALUES, self.spec.critic.loss),
                returns=_score(mb, "returns", self.spec.critic.loss),
                num_loss_tokens=batch.num_loss_tokens,
                num_samples=batch.num_samples,
            )
            out = self._call_loss(
                self.value_loss_fn, self.spec.critic.loss, inputs, kind="value", grad_of="values"
            )
            out.loss.backward()
            acc.add({_prefixed("critic/", k): float(v) for k, v in out.metrics.items()}, mb.num_loss_tokens)
        grad_norm = self._clip_grads(self.critic)
        self.critic_optimizer.step()
        self.critic_scheduler.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return {"critic/grad_norm": grad_norm, "critic/lr": lr}

    def _call_loss(
        self, fn: Loss, name: str, inputs: LossInputs, *, kind: str, grad_of: str = "logprobs"
    ) -> LossOutput:
        from miles._plugins.backend_hooks import apply_loss_hooks

        out = fn(inputs)
        if not isinstance(out, LossOutput):
            raise ComponentError(f"loss {name!r} returned {type(out).__name__}, expected LossOutput")
        # Plugins' terms are added, then the postprocess chain runs (see miles.hookspecs).
        out = apply_loss_hooks(self.pm, out, inputs, kind)
        loss = out.loss
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            raise ComponentError(
                f"loss {name!r} must return a scalar tensor that depends on inputs.{grad_of} "
                f"(got {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))})"
            )
        return out

    def _routed(self, mb: MicroBatchTensors) -> contextlib.AbstractContextManager[None]:
        """The policy's forward passes inside route ``mb``'s positions as the rollout did (replay on) and
        count where their own top-k differs; a micro-batch without recorded routing routes freely."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.micro_batch(mb.routing)

    def _response_logprobs(
        self, model: nn.Module, mb: MicroBatchTensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens and the entropy at their positions, as [B, R] grids."""
        if self.opts.logprob_projection == "chunked":
            lp_rows, ent_rows = self._projected_logprobs(model, mb)
            return self._to_grid(lp_rows, mb), self._to_grid(ent_rows, mb)
        logits = model(**mb.model_inputs()).logits
        b, seq_len, vocab = logits.shape
        lp_rows, ent_rows = token_logprobs(
            logits.reshape(b * seq_len, vocab),
            mb.rows,
            mb.targets,
            temperature=self.spec.temperature,
            chunk=self.opts.logprob_chunk_tokens,
        )
        return self._to_grid(lp_rows, mb), self._to_grid(ent_rows, mb)

    def _projected_logprobs(
        self, model: nn.Module, mb: MicroBatchTensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward with its output head replaced, for this call, by the chunked projection
        of the response rows only. It runs inside the model's own forward, so under FSDP the head's
        weight is the gathered one there, and the result leaves as the model's output, so FSDP's
        backward hooks see it as they would the logits."""
        head = model.get_output_embeddings()  # type: ignore[operator]

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.rows)
            lp, ent = projected_token_logprobs(
                rows,
                head.weight,
                mb.targets,
                bias=head.bias,
                temperature=self.spec.temperature,
                chunk=self.opts.logprob_chunk_tokens,
            )
            return torch.stack((lp, ent), dim=-1)

        # head.weight is read inside forward on purpose: FSDP swaps in the gathered parameter there.
        head.forward = forward
        try:
            out = model(**mb.model_inputs()).logits
        finally:
            del head.forward
        return out[:, 0], out[:, 1]

    def _values(self, mb: MicroBatchTensors) -> torch.Tensor:
        """The critic's value of the state before each response token (read where its logits would be)."""
        assert self.critic is not None
        values = self.critic(**mb.model_inputs())
        return self._to_grid(values.reshape(-1).index_select(0, mb.rows), mb)

    def _to_grid(self, flat: torch.Tensor, mb: MicroBatchTensors) -> torch.Tensor:
        b, resp_len = mb.loss_mask.shape
        grid = torch.zeros(b * resp_len, dtype=torch.float32, device=self.device)
        return grid.index_put((mb.slots,), flat.float()).view(b, resp_len)

    def _idle_pass(self, model: nn.Module) -> None:
        """A zero-weight forward/backward so this rank joins the FSDP collectives of a pass it has no rows for."""
        out = self._idle_forward(model)
        (out.sum() * 0.0).backward()

    def _idle_forward(self, model: nn.Module) -> torch.Tensor:
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        out = model(input_ids=ids)
        return out if isinstance(out, torch.Tensor) else out.logits

    def _clip_grads(self, model: nn.Module) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if self.train_opts.grad_clip is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
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
            self._unsent.clear()
            return TransportStats(bytes_sent=0, seconds=0.0, buckets=0, version=version)
        with torch.no_grad():
            stats = self.transport.send(self._weight_stream(), version)
        return stats if self.rank == 0 else None

    def reconnect_transport(self, _: None = None) -> None:
        """Re-form the transport's connections to the engines (some were restarted since ``connect``)."""
        if self.transport is None:
            return  # no engines to feed
        reconnect = getattr(self.transport, "reconnect", None)
        if not callable(reconnect):
            raise RuntimeError(
                f"transport {self.spec.transport!r} cannot re-form its connections to restarted engines "
                f"({type(self.transport).__name__} has no reconnect())"
            )
        reconnect(list(self.spec.engine_urls))

    def save_checkpoint(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        extra: dict[str, Any] = {"step": self.scheduler.last_epoch}
        if self.lora is not None:
            extra["lora"] = {
                "name": self.lora.name,
                "adapters": list(self.adapters),
                "base": miles.lora.base_reference(self.spec.model_path) if self.rank == 0 else None,
            }
        checkpoint.save(directory, self.parts, extra)

    def load_checkpoint(self, directory: str) -> None:
        checkpoint.load(directory, self.parts)
        # The optimizer and scheduler states carry the hyperparameters of the run that saved them;
        # a resumed run trains with the ones its recipe says now.
        opts = self.train_opts
        if self.lora is not None and self.lora.multi:
            shapes = self.lora.named()
            for name, (optimizer, scheduler) in self.steppers.items():
                checkpoint.set_hyperparameters(
                    optimizer,
                    scheduler,
                    lr=self._adapter_lr(shapes[name]),
                    lr_lambda=self._lr_lambda(),
                    betas=opts.betas,
                    eps=opts.eps,
                    weight_decay=opts.weight_decay,
                )
            self._unsent = set(self.adapters)  # the engines hold the initial adapters: send them all
            return
        for part in self.parts:
            lr = opts.lr if part.name == "model" else self.spec.critic.lr  # type: ignore[union-attr]
            checkpoint.apply_hyperparameters(
                part,
                lr=lr,
                lr_lambda=self._lr_lambda(),
                betas=opts.betas,
                eps=opts.eps,
                weight_decay=opts.weight_decay,
            )

    def export_hf(self, directory: str) -> None:
        if self.lora is not None:
            # A peft adapter directory (plus the base's tokenizer), not a merged model; multi-LoRA:
            # one per adapter, in <directory>/<name>/.
            for name, peft_adapter in self.adapters.items():
                lora_mod.save_adapter(
                    lora_mod.adapter_dir(directory, self.lora, name),
                    self.model,
                    self.spec.model_path,
                    write=self.rank == 0,
                    peft_adapter=peft_adapter,
                )
            if self.rank == 0:
                checkpoint.copy_tokenizer_files(self.spec.model_path, directory)
            dist.barrier()
            return
        name = self.opts.export_dtype
        dtype = self.source_dtype if name == "auto" else DTYPES[name]
        checkpoint.export_hf(
            directory, self.model, self.spec.model_path, dtype, {"use_cache": self.source_use_cache}
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class _MetricSums:
    """Loss-token-weighted sums of per-micro-batch metrics (means are combined across micro-batches and ranks)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight

    @staticmethod
    def combine(parts: list[tuple[dict[str, float], dict[str, float]]]) -> dict[str, float]:
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for s, w in parts:
            for key in s:
                sums[key] = sums.get(key, 0.0) + s[key]
                weights[key] = weights.get(key, 0.0) + w[key]
        return {key: sums[key] / weights[key] for key in sums if weights[key] > 0}


def _run_dir(config: dict[str, Any] | None) -> str:
    run = (config or {}).get("run") or {}
    if run.get("output_dir") and run.get("name"):
        return os.path.join(run["output_dir"], run["name"])
    import tempfile

    return tempfile.mkdtemp(prefix="miles-lora-")


def _score(mb: MicroBatchTensors, name: str, who: str) -> torch.Tensor:
    if name not in mb.scores:
        raise ComponentError(
            f"{who!r} needs the per-token {name!r}, but the train batch does not carry it "
            "(the driver computes it in the scoring pass before advantages)"
        )
    return mb.scores[name]


def _prefixed(prefix: str, key: str) -> str:
    """Namespace a component's metric, unless the component already did (``correction/ratio_mean``)."""
    return key if key.startswith(prefix) else prefix + key
