"""One megatron-core trainer rank: the GPT model, megatron's DDP and optimizer, the step (needs CUDA).

Built from an HF directory with no offline conversion: the config from ``config.json``
(``model_config``), the weights from its safetensors converted by the family's table
(``convert``) and cut to this rank (``export.shard_for_rank``).

The optimizer is megatron-core's own (``get_megatron_optimizer`` over the model wrapped in
megatron's ``DistributedDataParallel``): with bf16 parameters it keeps FP32 master weights and
FP32 gradient buffers (torch's AdamW on bf16 parameters would round every small update away),
it is the optimizer the data-parallel and distributed-optimizer layouts use, and its state has
a ``sharded_state_dict`` for megatron's dist-checkpointing.

Forward and backward go through megatron's schedule (``get_forward_backward_func``), which
calls ``loss_func`` per micro-batch with the logits. The run's ``Loss`` already divides by the
global batch's loss tokens, so ``loss_func`` hands the schedule back its loss multiplied by the
number of micro-batches, which the schedule divides by again.

With ``megatron.device: cpu`` (gloo) the model and its tensor-parallel layers are megatron's,
with the CPU pieces of ``miles_megatron.cpu``; megatron's DDP, optimizer and schedules
allocate on CUDA, so the rank runs the no-pipelining schedule's loop itself (forward,
``loss_func``, backward of the loss over the number of micro-batches) and torch's AdamW with
megatron's weight-decay groups and a tensor-parallel gradient norm.

With ``megatron.optimizer_streaming`` the optimizer is ``streaming.StreamingAdamW`` instead (on
CUDA over megatron's DDP and its ``main_grad`` buffers, on CPU over ``grad``): AdamW's FP32 masters
and moments stay on disk, one file per bucket of parameters, loaded only for that bucket's update.

With PP > 1 the rank builds its pipeline stage only (``pre_process`` / ``post_process``, the stage's
layers) and every pass goes through megatron's pipeline schedule (``miles_megatron.pipeline``, on CPU
too): the loss function runs on the last stage and what it keeps reaches every stage; the weight
stream relays each stage's tensors to rank 0 (``miles_megatron.stage_relay``).

With TP > 1 the output layer's logits are vocab-sharded; ``gather_vocab`` joins them over the
TP group (its backward hands each rank its slice), so the log-probs are those of the full
vocabulary on every TP rank.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import miles.lora
from miles.config.schema import TrainSection
from miles.errors import ComponentError, ModelError
from miles.interfaces import (
    REF_LOGPROBS,
    TEACHER_LOGPROBS,
    VALUES,
    BackendSpec,
    CorrectionOutput,
    LossInputs,
    LossOutput,
    TransportStats,
)
from miles.lr_schedule import decay_steps, lr_multiplier
from miles.routing import ROUTING_MISMATCH
from miles.train_rows import OLD_LOGPROBS, Row
from miles_megatron import lora as lora_mod
from miles_megatron.batch import MicroBatch, collate, token_logprobs
from miles_megatron.config import MegatronOptions
from miles_megatron.convert import Spec, hf_to_megatron
from miles_megatron.data_parallel import dp_share, gather_shares, interleave, sum_gradients
from miles_megatron.export import iter_export, shard_for_rank
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import ParallelLayout
from miles_megatron.offload import DiskSpill, StorageOffloader
from miles_megatron.parallel import megatron_parallel
from miles_megatron.routing import REPLAY_FIELD, RouterHooks, routers_of, supports_replay
from miles_megatron.schedule import run_micro_batches
from miles_megatron.stage_relay import relay_stages
from miles_megatron.streaming import StreamedParam, StreamingAdamW, StreamingConfig

log = logging.getLogger(__name__)

CHECKPOINT_MARKER = "miles_megatron.json"
STREAMED = "streaming"  # the marker's ``optimizer`` of a checkpoint written with optimizer streaming
CPU_ADAMW = "cpu_adamw"  # ... of one written by the CPU trainer (torch's AdamW, per-rank files)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_hf_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in HF directory ``path``."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelError(f"megatron: {path} has no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


class MegatronTrainer:
    """One rank (``rank`` of ``layout.world``) of a megatron-core run; every method is a collective."""

    def __init__(
        self,
        spec: BackendSpec,
        layout: ParallelLayout,
        options: MegatronOptions,
        train: TrainSection,
        layer_spec: Spec,
        rank: int = 0,
        init_method: str | None = None,
    ) -> None:
        from miles.plugins import get_plugin_manager
        from miles_megatron.model_config import DTYPES, gpt_model, transformer_config

        self.spec, self.layout, self.options, self.train_opts = spec, layout, options, train
        self.layer_spec = layer_spec
        self.rank = rank
        # Pipeline parallelism: this rank's stage builds the embedding (first) and the output layer (last).
        stage = layout.coords(rank).pp
        self.pre_process, self.post_process = stage == 0, stage == layout.pp - 1
        # Data parallelism (CPU trainer): this rank's share of each step's micro-batches.
        self.dp_rank, self.dp_size = layout.coords(rank).dp, layout.dp
        if self.dp_size > 1 and options.device == "cuda":  # hooks.launch_problems refuses it first
            raise ComponentError("megatron: data parallelism runs on megatron.device cpu only so far")
        self.pm = get_plugin_manager()
        self.cuda = options.device == "cuda"
        if self.cuda:
            self.device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self._stack = contextlib.ExitStack()
        init = init_method or f"tcp://127.0.0.1:{free_port()}"
        self._stack.enter_context(megatron_parallel(layout, rank, "nccl" if self.cuda else "gloo", init))
        torch.manual_seed(spec.seed)
        if self.cuda:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # type: ignore[import-untyped]

            model_parallel_cuda_manual_seed(spec.seed)
        self.lr_factor = lr_multiplier(train, decay_steps(train, spec.config))

        self.hf = HFModel.from_dir(spec.model_path)
        self.dtype = DTYPES[options.params_dtype]
        # LoRA: adapters in the planned linears, the base frozen; only the adapter trains, is saved and sent.
        # Multi-LoRA (lora.adapters): every adapter in the same linears, one optimizer each, one active per pass.
        lora_section = miles.lora.section(spec.config)
        self.loras: tuple[lora_mod.LoraPlan, ...] = (
            () if lora_section is None else lora_mod.plans(self.hf, lora_section)
        )
        self.lora = self.loras[0] if self.loras else None
        self.multi = lora_section is not None and lora_section.multi
        if self.multi and (self.cuda or options.optimizer_streaming or spec.critic is not None):
            raise ComponentError(
                "lora.adapters (multi-LoRA) on the megatron backend runs on megatron.device cpu, without "
                "optimizer streaming and without a critic, so far"
            )
        replay = train.use_rollout_routing_replay
        if replay and not supports_replay():
            raise ComponentError(
                f"train.use_rollout_routing_replay: this megatron-core has no TransformerConfig.{REPLAY_FIELD} "
                "(0.16 and later have it); upgrade megatron-core"
            )
        self.config = transformer_config(
            self.hf,
            layout,
            options.params_dtype,
            cpu_init=not self.cuda,
            **({REPLAY_FIELD: True} if replay else {}),
        )
        gpt = gpt_model(
            self.hf,
            self.config,
            layer_spec,
            cpu=not self.cuda,
            core_attention=options.core_attention or "sdpa",
            lora=self.loras if self.multi else self.lora,
            pre_process=self.pre_process,
            post_process=self.post_process,
        ).to(self.device)
        # MoE: the routers count where their top-k differs from the routing the rollout recorded and,
        # with replay on, route as it did (R3; miles_megatron.routing).
        self.routing = RouterHooks(routers_of(gpt), replay=replay) if self.hf.is_moe else None
        self._load_weights(gpt, self.hf, spec.model_path)
        if self.lora is not None:
            from miles_megatron.lora_layers import freeze_base, init_adapters

            freeze_base(gpt)
            init_adapters(gpt, spec.seed)
        self.gpt = gpt
        # Frozen scorers (reference policy, teacher), built only when the objective reads them.
        self.scorers: dict[str, Any] = {
            name: self._frozen_model(path, name) for name, path in scorer_paths(spec).items()
        }
        self.critic: Any = None  # PPO's value model (miles_megatron.critic), trained after the policy
        if spec.critic is not None:
            from miles_megatron.critic import MegatronCritic

            self.critic = MegatronCritic(
                spec, spec.critic, layout, options, train, layer_spec, rank, self.device, self.lr_factor
            )
        elif VALUES in spec.scores:
            raise ComponentError("megatron: values requested but the spec has no critic")
        self.optimizer_steps = 0
        # Multi-LoRA: each adapter's AdamW, base learning rate and optimizer steps; the adapters trained
        # since the last weight update (only those are sent).
        self.steppers: dict[str, torch.optim.Optimizer] = {}
        self.adapter_lr: dict[str, float] = {}
        self.adapter_steps: dict[str, int] = {}
        self._unsent: set[str] = set()
        self.streaming: StreamingAdamW | None = None
        self._lr = train.lr
        if options.optimizer_streaming:
            self._streaming_optimizer(gpt, train)
        elif self.cuda:
            self._megatron_optimizer(gpt, train)
        else:
            from miles_megatron.cpu import weight_decay_groups

            self.model: Any = gpt
            if self.multi:
                from miles_megatron.lora_layers import adapter_parameters

                assert lora_section is not None and lora_section.adapters is not None
                for name, adapter in lora_section.adapters.items():
                    self.adapter_lr[name] = train.lr if adapter.lr is None else float(adapter.lr)
                    self.adapter_steps[name] = 0
                    self.steppers[name] = torch.optim.AdamW(
                        weight_decay_groups(adapter_parameters(gpt, name), train.weight_decay),
                        lr=self.adapter_lr[name],
                        betas=train.betas,
                        eps=train.eps,
                    )
            self.optimizer: Any = (
                next(iter(self.steppers.values()))
                if self.steppers
                else torch.optim.AdamW(
                    weight_decay_groups(gpt.named_parameters(), train.weight_decay),
                    lr=train.lr,
                    betas=train.betas,
                    eps=train.eps,
                )
            )
        self.loss_fn, self.correction_fn = self._components()
        self.transport = self._connect_transport()
        self._offloader: StorageOffloader | None = None
        self._spill: DiskSpill | None = None  # its staging buffer is kept for the next offload

    # ---------------------------------------------------------------- build

    def _load_weights(self, gpt: Any, hf: HFModel, path: str) -> None:
        """This rank's shard of the HF checkpoint at ``path``, converted, into ``gpt``."""
        full = hf_to_megatron(hf, load_hf_tensors(path), self.layer_spec)
        state = {k: v.to(self.dtype) for k, v in shard_for_rank(hf, self.layout, self.rank, full).items()}
        result = gpt.load_state_dict(state, strict=False)
        # The adapters are not in the base checkpoint (they start from their own init).
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state") and ".lora_" not in k]
        if missing or result.unexpected_keys:
            raise ModelError(
                f"megatron: the converted weights of {path} do not fit the model: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )

    def _frozen_model(self, path: str, role: str) -> Any:
        """A forward-only megatron model of the HF directory ``path`` on this rank's layout
        (the reference policy or the teacher): no gradients, no optimizer, never saved (a resumed
        run builds it again from ``path``)."""
        from miles_megatron.model_config import gpt_model, transformer_config

        hf = self.hf if path == self.spec.model_path else HFModel.from_dir(path)
        if hf.vocab_size != self.hf.vocab_size:
            raise ModelError(
                f"megatron: the {role} model {path} has a vocabulary of {hf.vocab_size}, the policy "
                f"{self.hf.vocab_size}; it must score the policy's token ids"
            )
        config = transformer_config(hf, self.layout, self.options.params_dtype, cpu_init=not self.cuda)
        model = gpt_model(
            hf,
            config,
            self.layer_spec,
            cpu=not self.cuda,
            core_attention=self.options.core_attention or "sdpa",
            pre_process=self.pre_process,
            post_process=self.post_process,
        ).to(self.device)
        self._load_weights(model, hf, path)
        model.requires_grad_(False)
        return model.eval()

    def _megatron_ddp(self, gpt: Any) -> None:
        """megatron's DDP around ``gpt`` (CUDA): FP32 ``main_grad`` buffers, reduced by ``finalize_model_grads``."""
        from miles_megatron.optim import megatron_ddp

        self.model = megatron_ddp(self.config, gpt)

    def _streaming_optimizer(self, gpt: Any, train: TrainSection) -> None:
        """AdamW with its state streamed from disk per bucket (``miles_megatron.streaming``): on CUDA over
        megatron's DDP (its ``main_grad`` buffers), on CPU over the bare model's ``grad``."""
        from miles_megatron.cpu import decays

        if self.cuda:
            self._megatron_ddp(gpt)
        else:
            self.model = gpt
        params = [
            StreamedParam(name, p, train.weight_decay if decays(name, p) else 0.0)
            for name, p in gpt.named_parameters()
            if p.requires_grad
        ]
        config = StreamingConfig(
            bucket_bytes=max(1, int(self.options.optimizer_streaming_bucket_mb * 2**20)),
            betas=train.betas,
            eps=train.eps,
            moments=self.options.optimizer_streaming_moments,
            prefetch=self.options.optimizer_streaming_prefetch,
            grad_attr="main_grad" if self.cuda else "grad",
        )
        self.streaming = StreamingAdamW(
            params, config, self._streamed_layout(), self.options.optimizer_streaming_dir
        )
        self.optimizer = self.streaming

    def _streamed_layout(self) -> dict[str, int]:
        return {**self.layout.megatron_kwargs(), "world": self.layout.world, "rank": self.rank}

    def _megatron_optimizer(self, gpt: Any, train: TrainSection) -> None:
        """megatron's DDP around ``gpt`` and its optimizer (CUDA)."""
        from miles_megatron.optim import megatron_adam

        self._megatron_ddp(gpt)
        self.optimizer = megatron_adam(self.config, self.model, train, train.lr, self.dtype)

    def _components(self) -> tuple[Any, Any]:
        from miles.plugins import make_component

        loss = make_component("loss", self.spec.loss, self.spec.loss_options)
        kind = getattr(loss, "kind", "policy")
        if kind not in ("policy", "supervised"):
            raise ComponentError(
                f"loss {self.spec.loss!r} has kind {kind!r}; megatron trains policy or supervised losses"
            )
        correction = None
        if self.spec.correction:
            correction = make_component("correction", self.spec.correction, self.spec.correction_options)
        return loss, correction

    def _connect_transport(self) -> Any:
        if not self.spec.engine_urls:
            return None
        from miles.plugins import make_component

        transport = make_component("transport", self.spec.transport, dict(self.spec.transport_options))
        transport.connect(
            list(self.spec.engine_urls), rank=self.rank, world_size=self.layout.world, device=str(self.device)
        )
        if self.lora is not None:
            lora_mod.serve_adapter(self, transport)
        if getattr(transport, "wants_base_weights", False):
            with torch.no_grad():
                transport.seed(self.weight_stream(), 0)  # type: ignore[attr-defined]
        return transport

    def loss_kind(self) -> str:
        return str(getattr(self.loss_fn, "kind", "policy"))

    # ---------------------------------------------------------------- passes

    def _run_schedule(
        self, micro_batches: list[MicroBatch], loss_func: Any, forward_only: bool, model: Any = None
    ) -> list[Any]:
        """``loss_func``'s results per micro-batch through the schedule (``model``: default the policy)."""
        n = len(micro_batches)
        last_stage = self.post_process

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            if self.routing is not None:
                self.routing.begin(mb.routing)
            logits = model(
                input_ids=mb.tokens,
                position_ids=mb.position_ids,
                attention_mask=None if self.cuda else _causal_mask(mb),
                **self._packed_kwargs(mb),
            )
            # A stage before the last outputs hidden states for the next stage, not logits.
            output = gather_vocab(logits) if last_stage else logits
            return output, functools.partial(loss_func, mb, n)

        return run_micro_batches(
            self.model if model is None else model,
            micro_batches,
            forward_step,
            cuda=self.cuda,
            forward_only=forward_only,
            stages=self.layout.pp,
        )

    def _packed_kwargs(self, mb: MicroBatch) -> dict[str, Any]:
        if mb.cu_seqlens is None:
            return {}
        from megatron.core.packed_seq_params import PackedSeqParams  # type: ignore[import-untyped]

        return {"packed_seq_params": packed_seq_params(PackedSeqParams, mb)}

    def _micro_batches(self, groups: list[list[Row]]) -> list[MicroBatch]:
        """This rank's micro-batches: its DP share of ``groups`` (all of them without DP)."""
        packed = self.options.micro_batch_tokens is not None
        mine = dp_share(groups, self.dp_rank, self.dp_size)
        return [collate(rows, packed=packed).to(self.device) for rows in mine]

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state  # type: ignore[import-untyped]

        return parallel_state.get_data_parallel_group()

    def score(
        self, groups: list[list[Row]], names: list[str], adapter: str | None = None
    ) -> list[list[dict[str, list[float]]]]:
        """Forward-only: per micro-batch, per row, the named signals: the policy's own log-probs
        (``old_logprobs``) and those of the frozen scorers this trainer built. Multi-LoRA: the policy
        with only ``adapter`` active (None: the base)."""
        if self.multi:
            from miles_megatron.lora_layers import activate

            activate(self.gpt, adapter)
        scorable = [OLD_LOGPROBS, *self.scorers, *([VALUES] if self.critic is not None else [])]
        unknown = [n for n in names if n not in scorable]
        if unknown:
            raise ComponentError(f"megatron: cannot score {unknown}; this trainer scores {scorable}")
        mbs = self._micro_batches(groups)
        per_name = {
            name: self._scorer_rows(self.scorers[name], mbs) for name in names if name in self.scorers
        }
        if OLD_LOGPROBS in names:
            per_name[OLD_LOGPROBS] = self._policy_rows(mbs)
        if VALUES in names:
            per_name[VALUES] = self.critic.value_rows(mbs)
        rows = [
            [{name: per_name[name][m][i] for name in names} for i in range(len(mb.response_lengths))]
            for m, mb in enumerate(mbs)
        ]
        if self.dp_size > 1:  # every micro-batch's rows, in the order of ``groups``
            rows = interleave(gather_shares(rows, self._dp_group()))
        return rows

    def _scorer_rows(self, model: Any, mbs: list[MicroBatch]) -> list[list[list[float]]]:
        """A frozen model's log-probs of each micro-batch's response tokens (one forward each: a
        frozen model needs neither megatron's DDP nor its schedule, except to pass activations
        between pipeline stages)."""
        if self.layout.pp > 1:
            return self._rows_through_schedule(mbs, model)
        out = []
        with torch.no_grad():
            for mb in mbs:
                logits = model(
                    input_ids=mb.tokens,
                    position_ids=mb.position_ids,
                    attention_mask=None if self.cuda else _causal_mask(mb),
                    **self._packed_kwargs(mb),
                )
                lp, _ = token_logprobs(gather_vocab(logits), mb, self.spec.temperature)
                out.append([lp[i, :k].tolist() for i, k in enumerate(mb.response_lengths)])
        return out

    def _policy_rows(self, mbs: list[MicroBatch]) -> list[list[list[float]]]:
        """The policy's own log-probs of each micro-batch's response tokens, through the schedule."""
        self.model.eval()
        return self._rows_through_schedule(mbs, None)

    def _rows_through_schedule(self, mbs: list[MicroBatch], model: Any) -> list[list[list[float]]]:
        """``model``'s (None: the policy's) log-probs of each micro-batch's response tokens, forward-only
        through the schedule (under PP computed on the last stage and sent to every stage)."""

        def loss_func(mb: MicroBatch, n: int, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            lp, _ = token_logprobs(logits, mb, self.spec.temperature)
            rows = [lp[i, :k].tolist() for i, k in enumerate(mb.response_lengths)]
            return lp.new_zeros(()), {"rows": rows}

        with torch.no_grad():
            outs = self._run_schedule(mbs, loss_func, forward_only=True, model=model)
        return [out["rows"] for out in outs]

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def train_step(
        self, groups: list[list[Row]], num_loss_tokens: int, num_samples: int, adapter: str | None = None
    ) -> dict[str, float]:
        """One optimizer step on ``groups`` (micro-batches of rows). Multi-LoRA: ``adapter``'s step alone
        (only it active, its own optimizer, learning rate, schedule and clipping), as a run of that adapter
        alone on these rows would take it."""
        from miles._plugins.backend_hooks import apply_loss_hooks

        self._sync()
        t0 = time.perf_counter()
        mbs = self._micro_batches(groups)
        self.model.train()
        optimizer = self.optimizer
        trained: list[torch.nn.Parameter] | None = None  # None: every parameter that requires a gradient
        if self.multi and adapter is None:
            raise ComponentError(
                "megatron: a multi-LoRA trainer steps one adapter at a time; name the adapter"
            )
        if adapter is not None:
            from miles_megatron.lora_layers import activate, adapter_parameters

            if adapter not in self.steppers:
                raise ComponentError(
                    f"megatron: no LoRA adapter {adapter!r}; this trainer has {list(self.steppers)}"
                )
            activate(self.gpt, adapter)
            optimizer = self.steppers[adapter]
            trained = [p for _, p in adapter_parameters(self.gpt, adapter)]
            for _, p in adapter_parameters(self.gpt):  # the other adapters' last gradients too
                p.grad = None
            lr = self.adapter_lr[adapter] * self.lr_factor(self.adapter_steps[adapter])
        else:
            lr = self.train_opts.lr * self.lr_factor(self.optimizer_steps)
        if self.cuda:
            self.model.zero_grad_buffer()
        if self.streaming is not None:
            self.streaming.zero_grad()
        elif self.cuda:
            self.optimizer.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)
        self._lr = lr
        if self.streaming is None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        kind = self.loss_kind()
        requires = frozenset(getattr(self.loss_fn, "requires", ()))
        if self.routing is not None:
            self.routing.take_counts()  # a scoring pass's counts are not this step's

        def loss_func(mb: MicroBatch, n: int, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logprobs, entropy = token_logprobs(logits, mb, self.spec.temperature)
            metrics: dict[str, float] = {}
            inputs = LossInputs(
                loss_mask=mb.loss_mask,
                logprobs=logprobs,
                num_loss_tokens=num_loss_tokens,
                num_samples=num_samples,
                entropy=entropy if "entropy" in requires else None,
            )
            if kind == "policy":
                inputs.old_logprobs = mb.scores.get(OLD_LOGPROBS, logprobs.detach())
                inputs.rollout_logprobs = mb.rollout_logprobs
                inputs.advantages = mb.advantages
                if "ref_logprobs" in requires:
                    if "ref_logprobs" not in mb.scores:
                        raise ComponentError(
                            f"loss {self.spec.loss!r} needs ref_logprobs; the batch has none"
                        )
                    inputs.ref_logprobs = mb.scores["ref_logprobs"]
                if self.correction_fn is not None:
                    corr = self.correction_fn(inputs.old_logprobs, mb.rollout_logprobs, mb.loss_mask)
                    if not isinstance(corr, CorrectionOutput):
                        raise ComponentError(
                            f"correction {self.spec.correction!r} did not return a CorrectionOutput"
                        )
                    self.pm.hook.miles_correction_postprocess(output=corr, loss_mask=mb.loss_mask)
                    inputs.correction_weights = corr.weights.detach()
                    metrics.update({_prefixed("correction/", k): float(v) for k, v in corr.metrics.items()})
            out = self.loss_fn(inputs)
            if not isinstance(out, LossOutput):
                raise ComponentError(
                    f"loss {self.spec.loss!r} returned {type(out).__name__}, expected LossOutput"
                )
            out = apply_loss_hooks(self.pm, out, inputs, kind)
            if not (isinstance(out.loss, torch.Tensor) and out.loss.dim() == 0 and out.loss.requires_grad):
                raise ComponentError(
                    f"loss {self.spec.loss!r} must return a scalar tensor that depends on logprobs"
                )
            metrics.update({_prefixed("loss/", k): float(v) for k, v in out.metrics.items()})
            reduced = {
                "loss": float(out.loss.detach()),
                "entropy_sum": float((entropy.detach() * mb.loss_mask).sum()),
                "loss_tokens": float(mb.num_loss_tokens),
                "metrics": metrics,
            }
            return out.loss * n, reduced

        outs = self._run_schedule(mbs, loss_func, forward_only=False)
        tokens = sum(mb.num_tokens for mb in mbs)
        if self.dp_size > 1:
            # The losses are normalised by the whole step's counts: the DP ranks' gradients sum to
            # the batch's (megatron's DDP does this on CUDA, which is not launched with DP yet).
            sum_gradients(
                trained if trained is not None else [p for p in self.gpt.parameters() if p.requires_grad],
                self._dp_group(),
            )
            shares = gather_shares([(outs, tokens)], self._dp_group())
            outs = [o for share in shares for o in share[0][0]]
            tokens = sum(share[0][1] for share in shares)
        self._sync()
        t_fb = time.perf_counter()
        ok, grad_norm = self._optimizer_step(optimizer, trained)
        self._sync()
        t_opt = time.perf_counter()
        if ok:
            self.optimizer_steps += 1
            if adapter is not None:
                self.adapter_steps[adapter] += 1
                self._unsent.add(adapter)
        critic_metrics = {}
        if self.critic is not None:
            critic_metrics = self.critic.train_step(
                mbs, num_loss_tokens, num_samples, self._dp_group(), self.dp_size
            )
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for o in outs:
            for k, v in o["metrics"].items():
                sums[k] = sums.get(k, 0.0) + v * o["loss_tokens"]
                weights[k] = weights.get(k, 0.0) + o["loss_tokens"]
        elapsed = t_opt - t0
        metrics = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
        metrics.update(
            {
                "train/loss": sum(o["loss"] for o in outs),
                "train/entropy": sum(o["entropy_sum"] for o in outs) / max(num_loss_tokens, 1),
                "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "train/lr": lr,
                "train/update_skipped": 0.0 if ok else 1.0,
                "train/num_loss_tokens": float(num_loss_tokens),
                "train/num_tokens": float(tokens),
                "train/tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "time/train_step/forward_backward_s": t_fb - t0,
                "time/train_step/optimizer_s": t_opt - t_fb,
            }
        )
        metrics.update(critic_metrics)
        if self.routing is not None:
            mismatched, recorded = self.routing.take_counts()
            if recorded:
                metrics[ROUTING_MISMATCH] = mismatched / recorded
        if self.cuda:
            metrics["train/cuda_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.streaming is not None:
            metrics["optimizer/streamed_peak_resident_bytes"] = float(self.streaming.peak_resident_bytes)
            metrics["optimizer/streamed_buckets"] = float(len(self.streaming.buckets))
        return metrics

    def _optimizer_step(
        self, optimizer: Any = None, params: list[torch.nn.Parameter] | None = None
    ) -> tuple[bool, float | None]:
        """One optimizer step: (whether it was taken, the gradient norm before clipping).

        ``optimizer`` and ``params`` (multi-LoRA: one adapter's): default the trainer's and every
        parameter that requires a gradient."""
        optimizer = self.optimizer if optimizer is None else optimizer
        if self.cuda and self.streaming is None:
            ok, grad_norm, _ = self.optimizer.step()
            return bool(ok), grad_norm
        from miles_megatron.cpu import clip_grad_norm, reduce_tied_embedding_grads, reduce_tp_shared_grads

        if not self.cuda:  # on CUDA megatron's finalize_model_grads has reduced them
            reduce_tp_shared_grads(self.gpt, bool(self.config.qk_layernorm))
            reduce_tied_embedding_grads(self.gpt)
        if params is None:
            params = [p for p in self.gpt.parameters() if p.requires_grad]
        grad_attr = "main_grad" if self.cuda else "grad"
        norm = clip_grad_norm(params, self.train_opts.grad_clip, grad_attr)
        if not math.isfinite(norm):
            return False, norm
        if self.streaming is not None:
            self.streaming.step(self._lr)
        else:
            optimizer.step()
        return True, norm

    # ---------------------------------------------------------------- weights

    def _gather(self, name: str, tensor: torch.Tensor, group: str) -> list[torch.Tensor]:
        from megatron.core import parallel_state

        pg = (
            parallel_state.get_expert_tensor_parallel_group()
            if group == "etp"
            else parallel_state.get_tensor_model_parallel_group()
        )
        shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(shards, tensor.contiguous(), group=pg)
        return shards

    def weight_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's stage in HF names and layouts (TP shards gathered through the layout's groups), and on
        rank 0 every later pipeline stage's after it (``stage_relay``);
        under LoRA only the adapter, under the names the engines hold it by (``lora.engine_stream``)."""
        if self.multi:  # only the adapters trained since the last update
            sent = tuple(p for p in self.loras if p.name in self._unsent)
            self._unsent.clear()
            return lora_mod.engine_stream(self, sent)
        if self.lora is not None:
            return lora_mod.engine_stream(self)
        state = self.gpt.state_dict(keep_vars=False)
        own = iter_export(self.hf, self.layout, self.rank, state, self._gather, self.layer_spec)
        return relay_stages(self.layout, self.rank, own, self.device)

    def unsent_adapters(self) -> list[str]:
        """Multi-LoRA: the adapters the next weight update sends (those trained since the last)."""
        return [p.name for p in self.loras if p.name in self._unsent]

    def update_weights(self, version: int) -> TransportStats:
        if self.transport is None:
            self._unsent.clear()
            return TransportStats(bytes_sent=0, seconds=0.0, buckets=0, version=version)
        self.model.eval()
        with torch.no_grad():
            return self.transport.send(self.weight_stream(), version)

    def export_hf(self, directory: str) -> None:
        """An HF directory: the weights in the model's dtype, its config and tokenizer files copied."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        if self.lora is not None:  # a peft adapter directory (and the base's tokenizer files)
            lora_mod.export_adapter(self, directory, TOKENIZER_FILES)
            return
        with torch.no_grad():
            tensors = {name: t.detach().to("cpu").clone() for name, t in self.weight_stream()}
        if self.rank != 0:
            return
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(self.spec.model_path, "config.json")) as f:
            config = json.load(f)
        config["torch_dtype"] = config["dtype"] = self.options.params_dtype
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for name in TOKENIZER_FILES:
            src = os.path.join(self.spec.model_path, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(directory, name))

    # ---------------------------------------------------------------- checkpoints

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model_sd = self.gpt.sharded_state_dict()
        if self.lora is not None:  # only the adapter (the base is the HF directory, loaded again)
            model_sd = {k: v for k, v in model_sd.items() if ".lora_" in k}
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading),
        }

    def _needs_cuda(self, what: str) -> None:
        if not self.cuda:
            raise ComponentError(
                f"megatron.device cpu: {what} is not built on CPU (it goes through megatron's CUDA-only "
                "optimizer or device memory); use megatron.device cuda"
            )

    def _streamed_dir(self, directory: str) -> str:
        return os.path.join(directory, "streaming", f"rank{self.rank:05d}")

    def _cpu_dir(self, directory: str) -> str:
        return os.path.join(directory, "cpu", f"rank{self.rank:05d}")

    def _save_cpu(self, directory: str) -> None:
        """The CPU trainer's rank state: its model shards (safetensors) and torch's AdamW state."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = {
            k: v.detach().contiguous()
            for k, v in self.gpt.state_dict().items()
            if isinstance(v, torch.Tensor) and (self.lora is None or ".lora_" in k)
        }
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        if self.multi:  # each adapter's AdamW state in its own file
            for name, optimizer in self.steppers.items():
                torch.save(optimizer.state_dict(), os.path.join(directory, f"optimizer-{name}.pt"))
            return
        torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
        # The optimizer's parameter names by index: a resume under another PP reads its state by name.
        from miles_megatron.reshard import param_names
        from miles_megatron.reshard_stages import NAMES_FILE

        with open(os.path.join(directory, NAMES_FILE), "w") as f:
            json.dump(param_names(self.gpt, self.optimizer), f)

    def _load_cpu(self, directory: str) -> None:
        from safetensors.torch import load_file

        tensors = load_file(os.path.join(directory, "model.safetensors"))
        # weights_only: a checkpoint file never runs code when it is read.
        if self.multi:
            states = {
                name: torch.load(os.path.join(directory, f"optimizer-{name}.pt"), weights_only=True)
                for name in self.steppers
            }
            self._apply_cpu(directory, tensors, {}, states)
            return
        optimizer_state = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True)
        self._apply_cpu(directory, tensors, optimizer_state)

    def _load_cpu_resharded(self, directory: str, saved: ParallelLayout) -> None:
        """This rank's shards rebuilt from a CPU checkpoint written under another TP / DP layout
        (``miles_megatron.reshard``), the critic's with it (a LoRA checkpoint: the adapter's)."""
        from miles_megatron.reshard import CPUReshard
        from miles_megatron.reshard_stages import StageReshard, crosses_stages

        if crosses_stages(saved, self.layout):  # tensors renamed per stage: read by name
            stages = StageReshard(directory, saved, self.layout, self.rank, self.hf)
            names = [k for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)]
            tensors = stages.tensors("model.safetensors", names)
            self._apply_cpu(
                directory, tensors, stages.optimizer_state("optimizer.pt", self.gpt, self.optimizer)
            )
            return
        reshard = CPUReshard(directory, saved, self.layout, self.rank)
        tensors = reshard.tensors("model.safetensors")
        if self.multi:
            states = {
                name: reshard.optimizer_state(f"optimizer-{name}.pt", self.gpt, optimizer)
                for name, optimizer in self.steppers.items()
            }
            self._apply_cpu(directory, tensors, {}, states)
        else:
            self._apply_cpu(
                directory, tensors, reshard.optimizer_state("optimizer.pt", self.gpt, self.optimizer)
            )
        if self.critic is not None:
            self.critic.load(directory, self._cpu_dir(directory), reshard)

    def _apply_cpu(
        self,
        directory: str,
        tensors: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
        adapter_states: dict[str, Any] | None = None,
    ) -> None:
        result = self.gpt.load_state_dict(tensors, strict=False)
        missing = [  # a LoRA checkpoint holds only the adapter
            k
            for k in result.missing_keys
            if not k.endswith("._extra_state") and (self.lora is None or ".lora_" in k)
        ]
        if missing or result.unexpected_keys:
            raise ComponentError(
                f"checkpoint {directory} does not fit this model: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )
        if adapter_states is not None:  # multi-LoRA: each adapter's optimizer
            for name, state in adapter_states.items():
                self.steppers[name].load_state_dict(state)
            return
        self.optimizer.load_state_dict(optimizer_state)

    def _write_marker(self, directory: str, optimizer: str) -> None:
        if self.rank == 0:
            with open(os.path.join(directory, CHECKPOINT_MARKER), "w") as f:
                json.dump(
                    {
                        "layout": self.layout.megatron_kwargs(),
                        "world": self.layout.world,
                        "optimizer": optimizer,
                        "optimizer_steps": self.optimizer_steps,
                        "lora": None
                        if self.lora is None
                        else lora_mod.record_multi(self.loras, self.spec.model_path, self.adapter_steps)
                        if self.multi
                        else lora_mod.record(self.lora, self.spec.model_path),
                        "critic": self.critic is not None,
                    },
                    f,
                )
        dist.barrier()

    def save_checkpoint(self, directory: str) -> None:
        """megatron's dist-checkpointing of the model and optimizer, or, with optimizer streaming, each
        rank's bucket files and manifest (the FP32 masters are the model: its parameters are them cast)."""
        if self.streaming is not None:
            self.streaming.save(self._streamed_dir(directory))
            self._write_marker(directory, STREAMED)
            return
        if self.critic is not None:
            self.critic.save(directory, self._cpu_dir(directory))
        if not self.cuda:
            self._save_cpu(self._cpu_dir(directory))
            self._write_marker(directory, CPU_ADAMW)
            return
        from megatron.core import dist_checkpointing

        target = os.path.join(directory, "dist")
        os.makedirs(target, exist_ok=True)
        state = self._sharded_state(loading=False)
        state["miles"] = {"optimizer_steps": self.optimizer_steps}
        dist_checkpointing.save(state, target)
        self._write_marker(directory, "megatron")

    def load_checkpoint(self, directory: str) -> None:
        with open(os.path.join(directory, CHECKPOINT_MARKER)) as f:
            marker = json.load(f)
        written = marker.get("optimizer", "megatron")  # checkpoints from before streaming say nothing
        if self.streaming is not None:
            if written != STREAMED:
                raise ComponentError(
                    f"megatron.optimizer_streaming is on but checkpoint {directory} was written without it "
                    f"(optimizer {written!r}); a streamed run resumes only from a streamed checkpoint"
                )
            from miles_megatron.reshard import CPUReshard, same_layout, saved_layout

            saved = saved_layout(marker)
            if same_layout(saved, self.layout):
                self.streaming.load(self._streamed_dir(directory))
            else:  # another TP / DP layout: this rank's buckets rebuilt from the saved ranks'
                CPUReshard(directory, saved, self.layout, self.rank).streamed(self.streaming)
            self.optimizer_steps = int(marker["optimizer_steps"])
            return
        if written == STREAMED:
            raise ComponentError(
                f"checkpoint {directory} was written with megatron.optimizer_streaming (its optimizer state is "
                "bucket files, not megatron's); resume it with optimizer_streaming: true on the same layout"
            )
        if (written == CPU_ADAMW) != (not self.cuda):
            raise ComponentError(
                f"checkpoint {directory} was written by the megatron trainer on "
                f"{'CPU' if written == CPU_ADAMW else 'CUDA'} (optimizer {written!r}); this run is on "
                f"{'CUDA' if self.cuda else 'CPU'}: resume it with the megatron.device it was written on"
            )
        if bool(marker.get("critic", False)) != (self.critic is not None):
            raise ComponentError(
                f"checkpoint {directory} was written {'with' if marker.get('critic') else 'without'} a critic and "
                f"this run has {'one' if self.critic is not None else 'none'}; resume with the same algorithm"
            )
        if not self.cuda:
            from miles_megatron.reshard import same_layout, saved_layout

            saved = saved_layout(marker)
            if same_layout(saved, self.layout):  # each rank reads its own files back
                self._load_cpu(self._cpu_dir(directory))
                if self.critic is not None:
                    self.critic.load(directory, self._cpu_dir(directory))
            else:  # another TP / DP layout: each rank rebuilds its shards from the saved ranks'
                self._load_cpu_resharded(directory, saved)
            self.optimizer_steps = int(marker["optimizer_steps"])
            if self.multi:
                steps = (marker.get("lora") or {}).get("steps") or {}
                self.adapter_steps = {name: int(steps.get(name, 0)) for name in self.steppers}
                self._unsent = set(self.steppers)  # the engines hold the initial adapters: send them all
            return
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state(loading=True), os.path.join(directory, "dist"))
        self.gpt.load_state_dict(loaded["model"], strict=self.lora is None)
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.optimizer_steps = int(marker["optimizer_steps"])
        if self.critic is not None:
            self.critic.load(directory, self._cpu_dir(directory))

    # ---------------------------------------------------------------- offload

    def _device_tensors(self) -> Iterator[torch.Tensor]:
        for p in self.gpt.parameters():
            yield p
            for attr in ("main_grad", "grad"):
                grad = getattr(p, attr, None)
                if isinstance(grad, torch.Tensor):
                    yield grad
        for scorer in self.scorers.values():
            yield from scorer.parameters()
        if self.critic is not None:
            yield from self.critic.device_tensors()
        # megatron's DDP keeps its flat buffers in lists by these names (on CPU the model is the bare
        # GPTModel, whose ``buffers`` is nn.Module's method).
        ddp_buffers = [getattr(self.model, n, None) for n in ("buffers", "expert_parallel_buffers")]
        for buffer in [b for lst in ddp_buffers if isinstance(lst, list) for b in lst]:
            for attr in ("param_data", "grad_data"):
                t = getattr(buffer, attr, None)
                if isinstance(t, torch.Tensor):
                    yield t
        optimizers = list(self.steppers.values()) or getattr(
            self.optimizer, "chained_optimizers", [self.optimizer]
        )
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)  # megatron's wrapper, or torch's AdamW itself (CPU)
            if not isinstance(inner, torch.optim.Optimizer):
                continue
            for group in inner.param_groups:
                yield from group["params"]
            for st in inner.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))

    def offload(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state out of device memory (``megatron.offload_to``).

        On CPU (``megatron.device: cpu``) the same mechanics move the rank's CPU storages, which
        is what the CPU tests exercise; only ``disk`` frees anything there."""
        if self._offloader is not None:
            raise RuntimeError("already offloaded")
        self._sync()
        before = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        if self.options.offload_to == "disk" and self._spill is None:
            self._spill = DiskSpill(self.options.offload_dir, self.options.offload_staging_mb * 2**20)
        spill = self._spill if self.options.offload_to == "disk" else None
        offloader = StorageOffloader(self._device_tensors(), self.device, disk=spill)
        out = offloader.offload()
        self._offloader = offloader
        if self.cuda:
            out.update(
                cuda_allocated_before=float(before),
                cuda_allocated_after=float(torch.cuda.memory_allocated(self.device)),
            )
        return out

    def onload(self) -> dict[str, float]:
        if self._offloader is None:
            return {"bytes": 0.0, "seconds": 0.0}
        out = self._offloader.onload()
        self._offloader = None
        return out

    def close(self) -> None:
        if self.streaming is not None:
            self.streaming.close()
            self.streaming = None
        if self._spill is not None:
            self._spill.remove()  # an offload never brought back: its files, nothing else
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._stack.close()


class _GatherVocab(torch.autograd.Function):
    """Vocab-sharded logits joined over the TP group; the backward hands this rank its slice back.

    Every TP rank computes the same loss from the joined logits, so the gradient of its own
    shard is its slice of the joined logits' gradient (megatron's convention for a gather).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), logits.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous()


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary logits of a rank's vocab-parallel output layer (unchanged with TP = 1)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    out: torch.Tensor = _GatherVocab.apply(logits)
    return out


def _causal_mask(mb: MicroBatch) -> torch.Tensor:
    from miles_megatron.cpu import causal_mask

    return causal_mask(int(mb.tokens.shape[1])).to(mb.tokens.device)


def packed_seq_params(cls: Any, mb: MicroBatch) -> Any:
    """megatron's ``PackedSeqParams`` (THD) of a packed micro-batch (``cls``: the class, so CPU tests can pass it)."""
    assert mb.cu_seqlens is not None and mb.max_seqlen is not None
    return cls(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def _prefixed(prefix: str, key: str) -> str:
    return key if key.startswith(prefix) else prefix + key


def scorer_paths(spec: BackendSpec) -> dict[str, str]:
    """The frozen models ``spec``'s objective reads, by score name: the reference policy (its own
    path, else the policy's initial weights) and the teacher."""
    out = {}
    if REF_LOGPROBS in spec.scores:
        out[REF_LOGPROBS] = spec.ref_model_path or spec.model_path
    if TEACHER_LOGPROBS in spec.scores:
        if not spec.teacher_model_path:
            raise ComponentError(
                "megatron: teacher_logprobs requested but the spec names no teacher_model_path"
            )
        out[TEACHER_LOGPROBS] = spec.teacher_model_path
    return out
