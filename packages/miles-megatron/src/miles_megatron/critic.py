"""PPO's critic on the megatron backend: a megatron-core GPT model with a scalar value head.

The critic is the backbone of an HF directory (``algorithm.critic.model``, by default the
policy's) built as the policy is (``model_config``), on the policy's layout, with its output
layer replaced by :class:`ValueHead` (``hidden -> 1``). The replacement goes through the
module slot ``GPTModel.output_layer`` that the model's forward calls with the final
hidden states; nothing of megatron-core is patched. The head is a plain linear, the same on
every tensor-parallel rank: the hidden states it reads are whole on each TP rank (sequence
parallelism is not launched), every TP rank computes the same values and the same loss, so its
gradient is whole on each rank too and needs no reduction (the gradient norm counts it once,
as megatron counts any parameter that is not tensor-parallel).

Weights, as the FSDP backend's ``load_value_model`` reads them: the backbone of a causal LM
(``model.*``; ``lm_head`` is not used) or of a bare backbone checkpoint (``layers.*``, ...), and
the head starts at zero, so the first values are 0. A head stored in the directory under FSDP's
``ValueModel`` names (``value_head.weight`` ``[1, hidden]``, ``value_head.bias`` ``[1]``, a
backbone under ``backbone.*``) is read instead; FSDP's own loader starts its head at zero
whatever the directory holds.

Values are read where the policy reads log-probs: at the position that predicts each response
token (``MicroBatch.rows``), the value of the state before that token.

Training: one optimizer step per policy step, after the policy's, on the same micro-batches,
with the run's value loss (``algorithm.critic.loss``, of kind ``value``) and the critic's own
learning rate on the policy's schedule. On ``megatron.device: cpu`` torch's AdamW with megatron's
weight-decay groups (as the policy's CPU trainer); on CUDA megatron's ``DistributedDataParallel``
and optimizer, as the policy's. Data parallelism (CPU) sums the gradients over the DP group.

Checkpoints, next to the policy's: on CPU each rank's ``cpu/rankNNNNN/critic.safetensors`` and
``critic_optimizer.pt`` (torch's AdamW state); on CUDA megatron's dist-checkpointing of the
critic's model and optimizer under ``critic_dist/``; the critic's step count in ``critic.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from miles.config.schema import TrainSection
from miles.errors import ComponentError, ModelError
from miles.interfaces import VALUES, BackendSpec, CriticSpec, LossInputs, LossOutput
from miles_megatron.batch import MicroBatch
from miles_megatron.config import MegatronOptions
from miles_megatron.convert import Spec, hf_to_megatron
from miles_megatron.data_parallel import gather_shares, sum_gradients
from miles_megatron.export import shard_for_rank
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import ParallelLayout
from miles_megatron.schedule import run_micro_batches

RETURNS = "returns"  # the value targets the advantage estimator computed (TrainBatch.returns)
HEAD_WEIGHT, HEAD_BIAS = "value_head.weight", "value_head.bias"  # FSDP's ValueModel names
CPU_WEIGHTS, CPU_OPTIMIZER = "critic.safetensors", "critic_optimizer.pt"
DIST_DIR = "critic_dist"
STEPS_FILE = "critic.json"


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` in ``GPTModel.output_layer``'s slot: called as the output layer is, with the final
    hidden states ``[s, b, h]`` (and the tied embedding weight, which it ignores); returns ``([s, b, 1], None)``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: Any = None,
    ) -> tuple[torch.Tensor, None]:
        return F.linear(hidden_states, self.weight, self.bias), None


def split_value_checkpoint(
    tensors: dict[str, torch.Tensor], hidden_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """An HF critic directory's tensors as (the backbone under a causal LM's ``model.*`` names, the value
    head as ``{"weight", "bias"}`` or None when the directory has none). ``lm_head`` is dropped."""
    backbone: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in (HEAD_WEIGHT, HEAD_BIAS):
            head[name.rsplit(".", 1)[1]] = tensor
        elif name == "lm_head.weight":
            continue
        elif name.startswith("model."):
            backbone[name] = tensor
        elif name.startswith("backbone."):
            backbone["model." + name[len("backbone.") :]] = tensor
        else:
            backbone["model." + name] = tensor
    if not head:
        return backbone, None
    if set(head) != {"weight", "bias"}:
        raise ModelError(f"megatron: a critic's value head needs both {HEAD_WEIGHT} and {HEAD_BIAS}")
    if tuple(head["weight"].shape) != (1, hidden_size) or tuple(head["bias"].shape) != (1,):
        raise ModelError(
            f"megatron: the critic's value head is {tuple(head['weight'].shape)} / {tuple(head['bias'].shape)}; "
            f"expected (1, {hidden_size}) / (1,)"
        )
    return backbone, head


def critic_problems(critic: HFModel, policy: HFModel, options: MegatronOptions) -> list[str]:
    """What this backend cannot train as the critic of ``policy``, one sentence each (empty: it can)."""
    out = []
    if critic.is_moe:
        out.append("a MoE critic is not built for the megatron backend yet (a dense critic model is)")
    if critic.vocab_size < policy.vocab_size:
        out.append(
            f"the critic's vocabulary ({critic.vocab_size}) is smaller than the policy's ({policy.vocab_size}); "
            "it must read the policy's token ids"
        )
    if options.optimizer_streaming:
        out.append(
            "megatron.optimizer_streaming with a critic is not built yet (the critic's optimizer state is not "
            "streamed); unset optimizer_streaming"
        )
    return out


def _model_inputs(mb: MicroBatch, cuda: bool) -> dict[str, Any]:
    from miles_megatron.cpu import causal_mask

    out: dict[str, Any] = {
        "input_ids": mb.tokens,
        "position_ids": mb.position_ids,
        "attention_mask": None if cuda else causal_mask(int(mb.tokens.shape[1])).to(mb.tokens.device),
    }
    if mb.cu_seqlens is not None:
        from megatron.core.packed_seq_params import PackedSeqParams  # type: ignore[import-untyped]

        from miles_megatron.trainer import packed_seq_params

        out["packed_seq_params"] = packed_seq_params(PackedSeqParams, mb)
    return out


def _score(mb: MicroBatch, name: str, loss: str) -> torch.Tensor:
    if name not in mb.scores:
        raise ComponentError(f"critic loss {loss!r} needs {name}; the batch has none")
    return mb.scores[name]


class MegatronCritic:
    """The critic of one trainer rank (every method is a collective over the rank's groups)."""

    def __init__(
        self,
        spec: BackendSpec,
        critic: CriticSpec,
        layout: ParallelLayout,
        options: MegatronOptions,
        train: TrainSection,
        layer_spec: Spec,
        rank: int,
        device: torch.device,
        lr_factor: Callable[[int], float],
    ) -> None:
        from miles.plugins import get_plugin_manager, make_component
        from miles_megatron.model_config import DTYPES, gpt_model, transformer_config

        self.spec, self.critic_spec, self.layout, self.options, self.train_opts = (
            spec,
            critic,
            layout,
            options,
            train,
        )
        self.rank, self.device, self.lr_factor = rank, device, lr_factor
        self.cuda = device.type == "cuda"
        self.dtype = DTYPES[options.params_dtype]
        self.pm = get_plugin_manager()
        self.hf = HFModel.from_dir(critic.model_path)
        # Built untied (no embedding shared with an output layer it does not have); converted as tied,
        # which reads no lm_head.
        build_hf = dataclasses.replace(self.hf, tie_word_embeddings=False)
        self.config = transformer_config(build_hf, layout, options.params_dtype, cpu_init=not self.cuda)
        gpt = gpt_model(
            build_hf,
            self.config,
            layer_spec,
            cpu=not self.cuda,
            core_attention=options.core_attention or "sdpa",
        )
        gpt.output_layer = ValueHead(self.hf.hidden_size, self.dtype)
        self.gpt = gpt.to(device)
        self._load_weights(layer_spec)
        self.loss_fn = make_component("loss", critic.loss, critic.loss_options)
        if getattr(self.loss_fn, "kind", "policy") != "value":
            raise ComponentError(f"algorithm.critic.loss {critic.loss!r} is not a value loss")
        self.steps = 0
        if self.cuda:
            self._megatron_optimizer()
        else:
            from miles_megatron.cpu import weight_decay_groups

            self.model: Any = self.gpt
            self.optimizer: Any = torch.optim.AdamW(
                weight_decay_groups(self.gpt.named_parameters(), train.weight_decay),
                lr=critic.lr,
                betas=train.betas,
                eps=train.eps,
            )

    # ---------------------------------------------------------------- build

    def _load_weights(self, layer_spec: Spec) -> None:
        from miles_megatron.trainer import load_hf_tensors

        path = self.critic_spec.model_path
        backbone, head = split_value_checkpoint(load_hf_tensors(path), self.hf.hidden_size)
        convert_hf = dataclasses.replace(self.hf, tie_word_embeddings=True)
        full = hf_to_megatron(convert_hf, backbone, layer_spec)
        state = {
            k: v.to(self.dtype) for k, v in shard_for_rank(convert_hf, self.layout, self.rank, full).items()
        }
        if head is not None:
            state["output_layer.weight"] = head["weight"].to(self.dtype)
            state["output_layer.bias"] = head["bias"].to(self.dtype)
        result = self.gpt.load_state_dict(state, strict=False)
        missing = [
            k
            for k in result.missing_keys
            if not k.endswith("._extra_state") and not (head is None and k.startswith("output_layer."))
        ]
        if missing or result.unexpected_keys:
            raise ModelError(
                f"megatron: the critic's weights from {path} do not fit its model: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )

    def _megatron_optimizer(self) -> None:
        """megatron's DDP around the critic and its optimizer (CUDA), as the policy's."""
        from miles_megatron.optim import megatron_adam, megatron_ddp

        self.model = megatron_ddp(self.config, self.gpt)
        self.optimizer = megatron_adam(
            self.config, self.model, self.train_opts, self.critic_spec.lr, self.dtype
        )

    # ---------------------------------------------------------------- passes

    def _values(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """The ``[B, R]`` grid of the critic's values at the positions predicting each response token."""
        out = model(**_model_inputs(mb, self.cuda))  # [B, L, 1]
        return mb.grid(out.reshape(-1).index_select(0, mb.rows).float())

    def value_rows(self, mbs: list[MicroBatch]) -> list[list[list[float]]]:
        """Forward-only: per micro-batch, per row, the values of its response tokens."""
        self.gpt.eval()
        out = []
        with torch.no_grad():
            for mb in mbs:
                values = self._values(self.gpt, mb)
                out.append([values[i, :k].tolist() for i, k in enumerate(mb.response_lengths)])
        return out

    def _loss(
        self, mb: MicroBatch, values: torch.Tensor, num_loss_tokens: int, num_samples: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        from miles._plugins.backend_hooks import apply_loss_hooks

        name = self.critic_spec.loss
        inputs = LossInputs(
            loss_mask=mb.loss_mask,
            values=values,
            old_values=_score(mb, VALUES, name),
            returns=_score(mb, RETURNS, name),
            num_loss_tokens=num_loss_tokens,
            num_samples=num_samples,
        )
        out = self.loss_fn(inputs)
        if not isinstance(out, LossOutput):
            raise ComponentError(f"loss {name!r} returned {type(out).__name__}, expected LossOutput")
        out = apply_loss_hooks(self.pm, out, inputs, "value")
        if not (isinstance(out.loss, torch.Tensor) and out.loss.dim() == 0 and out.loss.requires_grad):
            raise ComponentError(f"loss {name!r} must return a scalar tensor that depends on inputs.values")
        metrics = {k if k.startswith("critic/") else f"critic/{k}": float(v) for k, v in out.metrics.items()}
        return out.loss, metrics

    def _forward_backward(
        self, mbs: list[MicroBatch], num_loss_tokens: int, num_samples: int
    ) -> list[tuple[dict[str, float], float]]:
        """Forward and backward of every micro-batch; per micro-batch (its metrics, its loss tokens)."""
        n = len(mbs)

        def loss_func(mb: MicroBatch, n: int, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            values = mb.grid(output.reshape(-1).index_select(0, mb.rows).float())
            loss, metrics = self._loss(mb, values, num_loss_tokens, num_samples)
            return loss * n, {"metrics": metrics, "loss_tokens": float(mb.num_loss_tokens)}

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            return model(**_model_inputs(mb, self.cuda)), functools.partial(loss_func, mb, n)

        outs = run_micro_batches(self.model, mbs, forward_step, cuda=self.cuda, forward_only=False)
        return [(o["metrics"], o["loss_tokens"]) for o in outs]

    def train_step(
        self, mbs: list[MicroBatch], num_loss_tokens: int, num_samples: int, dp_group: Any, dp_size: int
    ) -> dict[str, float]:
        """One optimizer step of the critic on this rank's micro-batches ``mbs`` (its DP share)."""
        t0 = time.perf_counter()
        self.model.train()
        if self.cuda:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.critic_spec.lr * self.lr_factor(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        outs = self._forward_backward(mbs, num_loss_tokens, num_samples) if mbs else []
        if dp_size > 1:
            sum_gradients([p for p in self.gpt.parameters() if p.requires_grad], dp_group)
            outs = [o for share in gather_shares([outs], dp_group) for o in share[0]]
        ok, grad_norm = self._optimizer_step()
        if ok:
            self.steps += 1
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for metrics, tokens in outs:
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * tokens
                weights[k] = weights.get(k, 0.0) + tokens
        out = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out.update(
            {
                "critic/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "critic/lr": lr,
                "critic/update_skipped": 0.0 if ok else 1.0,
                "time/train_step/critic_s": time.perf_counter() - t0,
            }
        )
        return out

    def _optimizer_step(self) -> tuple[bool, float | None]:
        if self.cuda:
            ok, grad_norm, _ = self.optimizer.step()
            return bool(ok), grad_norm
        from miles_megatron.cpu import clip_grad_norm, reduce_tp_shared_grads

        reduce_tp_shared_grads(self.gpt, bool(self.config.qk_layernorm))
        params = [p for p in self.gpt.parameters() if p.requires_grad]
        norm = clip_grad_norm(params, self.train_opts.grad_clip)
        if not math.isfinite(norm):
            return False, norm
        self.optimizer.step()
        return True, norm

    # ---------------------------------------------------------------- checkpoints

    def save(self, directory: str, rank_dir: str) -> None:
        """The critic's part of the run's checkpoint in ``directory`` (``rank_dir``: this rank's CPU directory)."""
        if self.cuda:
            from megatron.core import dist_checkpointing  # type: ignore[import-untyped]

            target = os.path.join(directory, DIST_DIR)
            os.makedirs(target, exist_ok=True)
            dist_checkpointing.save(self._sharded_state(loading=False), target)
        else:
            from safetensors.torch import save_file

            os.makedirs(rank_dir, exist_ok=True)
            tensors = {
                k: v.detach().contiguous()
                for k, v in self.gpt.state_dict().items()
                if isinstance(v, torch.Tensor)
            }
            save_file(tensors, os.path.join(rank_dir, CPU_WEIGHTS))
            torch.save(self.optimizer.state_dict(), os.path.join(rank_dir, CPU_OPTIMIZER))
        if self.rank == 0:
            with open(os.path.join(directory, STEPS_FILE), "w") as f:
                json.dump({"steps": self.steps}, f)

    def load(self, directory: str, rank_dir: str, reshard: Any = None) -> None:
        """The critic's part of the checkpoint in ``directory``; ``reshard`` (a ``reshard.CPUReshard``): the
        CPU checkpoint was written under another TP / DP layout and this rank's shards are rebuilt from it
        (the value head is replicated on every TP rank)."""
        if reshard is not None:

            def head(name: str) -> bool:
                return name.startswith("output_layer.")

            tensors = reshard.tensors(CPU_WEIGHTS, replicated=head)
            self._apply_cpu(directory, tensors)
            self.optimizer.load_state_dict(
                reshard.optimizer_state(CPU_OPTIMIZER, self.gpt, self.optimizer, replicated=head)
            )
        elif self.cuda:
            from megatron.core import dist_checkpointing

            loaded = dist_checkpointing.load(
                self._sharded_state(loading=True), os.path.join(directory, DIST_DIR)
            )
            self.gpt.load_state_dict(loaded["model"])
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            from safetensors.torch import load_file

            self._apply_cpu(directory, load_file(os.path.join(rank_dir, CPU_WEIGHTS)))
            # weights_only: a checkpoint file never runs code when it is read.
            self.optimizer.load_state_dict(
                torch.load(os.path.join(rank_dir, CPU_OPTIMIZER), weights_only=True)
            )
        with open(os.path.join(directory, STEPS_FILE)) as f:
            self.steps = int(json.load(f)["steps"])

    def _apply_cpu(self, directory: str, tensors: dict[str, torch.Tensor]) -> None:
        result = self.gpt.load_state_dict(tensors, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise ComponentError(
                f"checkpoint {directory}: the critic's weights do not fit this critic: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model_sd = self.gpt.sharded_state_dict()
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading),
        }

    # ---------------------------------------------------------------- offload

    def device_tensors(self) -> Iterator[torch.Tensor]:
        """The critic's parameters, gradients, DDP buffers and optimizer state (what an offload moves)."""
        for p in self.gpt.parameters():
            yield p
            for attr in ("main_grad", "grad"):
                grad = getattr(p, attr, None)
                if isinstance(grad, torch.Tensor):
                    yield grad
        ddp_buffers = [getattr(self.model, n, None) for n in ("buffers", "expert_parallel_buffers")]
        for buffer in [b for lst in ddp_buffers if isinstance(lst, list) for b in lst]:
            for attr in ("param_data", "grad_data"):
                t = getattr(buffer, attr, None)
                if isinstance(t, torch.Tensor):
                    yield t
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", opt)
            if not isinstance(inner, torch.optim.Optimizer):
                continue
            for group in inner.param_groups:
                yield from group["params"]
            for st in inner.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))
