"""LoRA on the Megatron backend: which of megatron's linears carry an adapter, under which names.

The recipe's ``lora`` section (single form: ``rank``, ``alpha``, ``dropout``, ``target_modules``)
names HF modules. Megatron fuses some of them, so one megatron linear may hold several HF parts:

- ``self_attention.linear_qkv`` (column-parallel): q_proj, k_proj, v_proj, interleaved per query group;
- ``self_attention.linear_proj`` (row-parallel): o_proj;
- ``mlp.linear_fc1`` (column-parallel): gate_proj, then up_proj;
- ``mlp.linear_fc2`` (row-parallel): down_proj.

Each targeted HF part gets its own adapter inside the fused linear (``A [r, in]``, ``B [out_part, r]``,
scaled by ``alpha / r``, exactly as ``peft`` builds one per HF module), and the fused linear adds
the parts' deltas in its own output layout (``lora_layers``). So a slot targeted for only some of
its parts is exact (the others get no delta), and the export is the trainer's tensors as they are,
under the HF module names: ``peft`` loads it onto the HF model and computes the same function.

Nothing here imports megatron-core: :func:`plan` (the recipe's targets against the model, refused
in one sentence each) runs in the backend's pre-flight.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from miles.config.schema import LoraSection, LoraShape
from miles.errors import ConfigError, ModelError
from miles.lora import (
    base_reference,
    check_same_base,
    matches,
    transport_refusal,
)
from miles_megatron.config import MegatronOptions
from miles_megatron.hf_config import HFModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Slot:
    """One megatron linear that can hold adapters: its path in a layer and the HF parts it fuses."""

    megatron: str  # path inside ``decoder.layers.{i}``
    hf_parent: str  # the parts' parent module in ``model.layers.{i}``
    parts: tuple[str, ...]  # HF module names, in the fused output's order
    parallel: Literal["column", "row"]


SLOTS = (
    Slot("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj"), "column"),
    Slot("self_attention.linear_proj", "self_attn", ("o_proj",), "row"),
    Slot("mlp.linear_fc1", "mlp", ("gate_proj", "up_proj"), "column"),
    Slot("mlp.linear_fc2", "mlp", ("down_proj",), "row"),
)
ADAPTABLE = tuple(p for s in SLOTS for p in s.parts)


@dataclass(frozen=True)
class LinearLora:
    """What one fused linear's adapters look like (the layer spec hands it to the linear's constructor).

    ``rows``: each part's full output rows (column-parallel) in ``parts`` order; ``groups``: how many
    blocks the fused output interleaves the parts in (``linear_qkv``: one per query group; else 1).
    """

    parts: tuple[str, ...]
    targeted: tuple[str, ...]
    rows: tuple[int, ...]
    groups: int
    rank: int
    alpha: float
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class LoraPlan:
    """The adapter of a run: its shape and, per slot (``Slot.megatron``), the parts it adapts."""

    name: str
    shape: LoraShape
    slots: dict[str, tuple[str, ...]]

    @property
    def targets(self) -> list[str]:
        """The adapted HF module names (what the exported ``adapter_config.json`` targets)."""
        return [p for s in SLOTS for p in self.slots.get(s.megatron, ())]

    def linear(self, model: HFModel, slot: str) -> LinearLora | None:
        """The adapters of ``slot``'s linear (None: it has none)."""
        targeted = self.slots.get(slot)
        if not targeted:
            return None
        s = next(x for x in SLOTS if x.megatron == slot)
        rows = {
            "q_proj": model.num_heads * model.head_dim,
            "k_proj": model.num_kv_heads * model.head_dim,
            "v_proj": model.num_kv_heads * model.head_dim,
            "o_proj": model.hidden_size,
            "gate_proj": model.ffn_hidden,
            "up_proj": model.ffn_hidden,
            "down_proj": model.hidden_size,
        }
        return LinearLora(
            parts=s.parts,
            targeted=tuple(p for p in s.parts if p in targeted),
            rows=tuple(rows[p] for p in s.parts),
            groups=model.num_kv_heads if slot.endswith("linear_qkv") else 1,
            rank=self.shape.rank,
            alpha=self.shape.alpha,
            dropout=self.shape.dropout,
        )


def option_problems(options: MegatronOptions, lora: LoraSection, layer_spec: str) -> list[str]:
    """What of the ``megatron`` section a LoRA run cannot use, one sentence each (empty: nothing).

    ``layer_spec``: the resolved spec (``auto`` counts as local here; the backend resolves it)."""
    out = []
    if layer_spec == "te":
        out.append(
            "lora needs megatron.layer_spec local (the adapters are built on megatron-core's own parallel "
            "linears, not Transformer Engine's); set megatron.layer_spec: local"
        )
    if options.optimizer_streaming:
        out.append(
            "megatron.optimizer_streaming is not built for lora (an adapter's optimizer state is small); "
            "set it to false"
        )
    if lora.dropout > 0 and options.tensor_parallel > 1:
        out.append(
            f"lora.dropout {lora.dropout} with megatron.tensor_parallel {options.tensor_parallel}: the TP ranks "
            "would drop different inputs of one adapter; allowed: lora.dropout 0 with TP > 1"
        )
    return out


def hf_linear_modules(model: HFModel) -> list[str]:
    """The HF model's linear modules by path (the decoder's projections and ``lm_head``)."""
    out = []
    for i in range(model.num_layers):
        for s in SLOTS:
            if s.hf_parent == "self_attn" or not model.layer_is_moe(i):
                out += [f"model.layers.{i}.{s.hf_parent}.{p}" for p in s.parts]
        if model.layer_is_moe(i):
            out.append(f"model.layers.{i}.mlp.gate")
            for e in range(model.num_experts):
                out += [
                    f"model.layers.{i}.mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")
                ]
    return [*out, "lm_head"]


def plan(model: HFModel, lora: LoraSection, field: str = "lora.target_modules") -> LoraPlan:
    """The adapter ``lora`` puts on ``model``; what megatron does not adapt is refused in one sentence."""
    if lora.multi:
        raise ConfigError(
            "lora.adapters (multi-LoRA): the megatron backend trains one adapter; use the single lora form "
            "or backend fsdp"
        )
    if model.is_moe:
        raise ConfigError(
            "lora on the megatron backend adapts dense models only (a MoE model's experts and router are "
            "not built with adapters yet); use backend fsdp for LoRA on a MoE model"
        )
    linears = hf_linear_modules(model)
    unknown = [t for t in lora.target_modules if not any(matches(n, t) for n in linears)]
    if unknown:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(
            f"{field} {unknown} match no linear module of the {model.family} model; its linear modules are "
            f"{kinds} (full paths such as {linears[0]!r})"
        )
    matched = [n for n in linears if any(matches(n, t) for t in lora.target_modules)]
    other = sorted({n.rsplit(".", 1)[-1] for n in matched} - set(ADAPTABLE))
    if other:
        raise ConfigError(
            f"{field}: the megatron backend does not adapt {other} (megatron's output layer and embedding "
            f"carry no adapter); allowed: {list(ADAPTABLE)}"
        )
    slots: dict[str, tuple[str, ...]] = {}
    for s in SLOTS:
        parts = []
        for p in s.parts:
            layers = {i for i in range(model.num_layers) if f"model.layers.{i}.{s.hf_parent}.{p}" in matched}
            if layers and len(layers) != model.num_layers:
                raise ConfigError(
                    f"{field} adapts {p} in layers {sorted(layers)} only; the megatron backend adapts a module "
                    f"kind in every layer (name it by kind, e.g. {p!r})"
                )
            if layers:
                parts.append(p)
        if parts:
            slots[s.megatron] = tuple(parts)
    return LoraPlan(name=lora.name, shape=lora, slots=slots)


# ------------------------------------------------------------------ names


def megatron_names(model: HFModel, lora_plan: LoraPlan) -> Iterator[tuple[str, str, str, str]]:
    """``(megatron parameter, HF module, factor, slot parallelism)`` of every adapter tensor, in a fixed order.

    The megatron parameter is ``decoder.layers.{i}.<slot>.lora_{A,B}.<part>``; the HF module is
    ``model.layers.{i}.<parent>.<part>``.
    """
    for i in range(model.num_layers):
        for s in SLOTS:
            for part in lora_plan.slots.get(s.megatron, ()):
                for factor in ("A", "B"):
                    yield (
                        f"decoder.layers.{i}.{s.megatron}.lora_{factor}.{part}",
                        f"model.layers.{i}.{s.hf_parent}.{part}",
                        factor,
                        s.parallel,
                    )


def tp_dim(factor: str, parallel: str) -> int | None:
    """The dimension an adapter factor is split along under TP (None: replicated).

    Column-parallel linears split their outputs: ``B``'s rows; row-parallel ones their inputs: ``A``'s columns.
    """
    if parallel == "column":
        return 0 if factor == "B" else None
    return 1 if factor == "A" else None


def engine_name(hf_module: str, factor: str, adapter: str) -> str:
    """The engine's name of a factor (``miles.engines.embedded.lora.tensor_name``)."""
    return f"{hf_module}.lora_{factor}.{adapter}.weight"


def peft_name(hf_module: str, factor: str) -> str:
    """A factor's name in a peft ``adapter_model.safetensors``."""
    return f"{PEFT_PREFIX}{hf_module}.lora_{factor}.weight"


def peft_config(lora_plan: LoraPlan, base_path: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of the adapter (what ``peft.LoraConfig`` reads)."""
    shape = lora_plan.shape
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(base_path),
        "r": shape.rank,
        "lora_alpha": shape.alpha,
        "lora_dropout": shape.dropout,
        "target_modules": sorted(lora_plan.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_dir(directory: str, lora_plan: LoraPlan, base_path: str, tensors: dict[str, Any]) -> None:
    """A peft adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors`` (``tensors``
    by peft name)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(peft_config(lora_plan, base_path), f, indent=2)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})


# ------------------------------------------------------------------ checkpoints


def record(lora_plan: LoraPlan, model_path: str) -> dict[str, Any]:
    """What a checkpoint marker keeps of the adapter (to refuse resuming it as something else)."""
    return {
        "name": lora_plan.name,
        "rank": lora_plan.shape.rank,
        "alpha": lora_plan.shape.alpha,
        "targets": lora_plan.targets,
        "base": base_reference(model_path),
    }


def check_checkpoint(
    saved: dict[str, Any] | None, lora_plan: LoraPlan | None, model_path: str, directory: str
) -> None:
    """Refuse resuming a full checkpoint as LoRA or the reverse, another adapter shape, or another base."""
    if lora_plan is None:
        if saved is not None:
            raise ModelError(
                f"checkpoint {directory} holds a LoRA adapter ({saved.get('name')!r}); resume it with its lora section"
            )
        return
    if saved is None:
        raise ModelError(
            f"checkpoint {directory} holds no LoRA adapter (it was written by a full-parameter run); "
            "resume it without a lora section"
        )
    have = (saved.get("rank"), saved.get("targets"))
    want = (lora_plan.shape.rank, lora_plan.targets)
    if have != want:
        raise ModelError(
            f"checkpoint {directory} holds a rank-{have[0]} adapter of {have[1]}, but this run trains a "
            f"rank-{want[0]} adapter of {want[1]}; resume with the same lora shape"
        )
    check_same_base(saved.get("base") or {}, model_path, directory)


# ------------------------------------------------------------------ the trainer's adapter


def adapter_tensors(trainer: Any) -> Iterator[tuple[str, str, Any]]:
    """``(HF module, factor, full tensor)`` of every factor of a ``MegatronTrainer``'s adapter.

    TP shards are joined through the trainer's TP gather: a collective, every rank drains it in order."""
    import torch

    params = dict(trainer.gpt.named_parameters())
    for name, module, factor, parallel in megatron_names(trainer.hf, trainer.lora):
        tensor = params[name].detach()
        dim = tp_dim(factor, parallel)
        if dim is not None and trainer.layout.tp > 1:
            tensor = torch.cat(trainer._gather(name, tensor, "tp"), dim=dim)
        yield module, factor, tensor


def engine_stream(trainer: Any) -> Iterator[tuple[str, Any]]:
    """The weight update of a LoRA run: only the adapter, under the names the engines hold it by."""
    adapter = trainer.lora.name
    for module, factor, tensor in adapter_tensors(trainer):
        yield engine_name(module, factor, adapter), tensor


def save_adapter(trainer: Any, directory: str) -> None:
    """The trainer's adapter as a peft directory (a collective; rank 0 writes)."""
    import torch

    with torch.no_grad():
        tensors = {
            peft_name(module, factor): t.to("cpu").clone().contiguous()
            for module, factor, t in adapter_tensors(trainer)
        }
    if trainer.rank == 0:
        write_peft_dir(directory, trainer.lora, trainer.spec.model_path, tensors)


def export_adapter(trainer: Any, directory: str, tokenizer_files: tuple[str, ...]) -> None:
    """A LoRA run's export: the peft adapter directory and the base's tokenizer files (a collective)."""
    import shutil

    import torch.distributed as dist

    save_adapter(trainer, directory)
    if trainer.rank == 0:
        for name in tokenizer_files:
            src = os.path.join(trainer.spec.model_path, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(directory, name))
    dist.barrier()


def serve_adapter(trainer: Any, transport: Any) -> None:
    """Point the transport at the adapter and load its initial state on every engine by name.

    The adapter's shape (rank, alpha, targets) reaches the engines once, as a peft directory through
    ``/load_lora_adapter``; every later update carries only its tensors."""
    import torch.distributed as dist

    from miles.errors import ComponentError

    carry = getattr(transport, "carry_adapter", None)
    if not callable(carry) or not getattr(transport, "carries_adapters", False):
        raise ComponentError(transport_refusal(trainer.spec.transport))
    carry(trainer.lora.name)
    directory = os.path.join(run_dir(trainer.spec.config), "lora", f"{trainer.lora.name}-initial")
    save_adapter(trainer, directory)
    if trainer.rank == 0:
        from miles.engines.client import SyncEngineClient

        for url in trainer.spec.engine_urls:
            with SyncEngineClient(url) as client:
                client.load_lora_adapter(trainer.lora.name, directory)
    dist.barrier()


def run_dir(config: dict[str, Any] | None) -> str:
    """The run's directory (``run.output_dir/run.name``), or a fresh temporary one outside a run."""
    run = (config or {}).get("run") or {}
    if run.get("output_dir") and run.get("name"):
        return os.path.join(run["output_dir"], run["name"])
    import tempfile

    return tempfile.mkdtemp(prefix="miles-megatron-lora-")
