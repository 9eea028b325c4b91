"""LoRA on the Megatron backend: which of megatron's linears carry an adapter, under which names.

The recipe's ``lora`` section (single form: ``rank``, ``alpha``, ``dropout``, ``target_modules``; or
several adapters under ``adapters``) names HF modules. Megatron fuses some of them, so one megatron
linear may hold several HF parts:

- ``self_attention.linear_qkv`` (column-parallel): q_proj, k_proj, v_proj, interleaved per query group;
- ``self_attention.linear_proj`` (row-parallel): o_proj;
- ``mlp.linear_fc1`` (column-parallel): gate_proj, then up_proj;
- ``mlp.linear_fc2`` (row-parallel): down_proj.

Each targeted HF part gets its own adapter inside the fused linear (``A [r, in]``, ``B [out_part, r]``,
scaled by ``alpha / r``, exactly as ``peft`` builds one per HF module), and the fused linear adds
the parts' deltas in its own output layout (``lora_layers``). So a slot targeted for only some of
its parts is exact (the others get no delta), and the export is the trainer's tensors as they are,
under the HF module names: ``peft`` loads it onto the HF model and computes the same function.

Multi-LoRA (``lora.adapters``): each adapter is planned on its own (:func:`plans`: its shape and targets),
and a linear holds every adapter that targets it side by side, its factors keyed ``<adapter>-<part>``
(:func:`factor_key`); only the active adapter adds its delta (``lora_layers.activate``), so each adapter's
rows train it alone. Exports go to ``final/<name>/``, weight updates carry the adapters by their names.

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
    adapter: str | None = None  # multi-LoRA: the adapter's name (None: the single form)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def key(self, part: str) -> str:
        """The part's key in the linear's ``lora_A`` / ``lora_B`` (:func:`factor_key`)."""
        return factor_key(self.adapter, part)


def factor_key(adapter: str | None, part: str) -> str:
    """A factor's key inside a linear's ``lora_A`` / ``lora_B``: the HF part (single form), or
    ``<adapter>-<part>`` (multi-LoRA: every adapter's factors side by side in one linear)."""
    return part if adapter is None else f"{adapter}-{part}"


def adapter_of(param: str) -> str | None:
    """The multi-LoRA adapter a parameter ``...lora_{A,B}.<adapter>-<part>`` belongs to (None: not one).

    Adapter names may hold ``-``; the HF parts never do, so the last ``-`` splits them."""
    head, sep, key = param.rpartition(".")
    if not sep or not (head.endswith(".lora_A") or head.endswith(".lora_B")) or "-" not in key:
        return None
    return key.rsplit("-", 1)[0]


@dataclass(frozen=True)
class LoraPlan:
    """The adapter of a run: its shape and, per slot (``Slot.megatron``), the parts it adapts."""

    name: str
    shape: LoraShape
    slots: dict[str, tuple[str, ...]]
    multi: bool = False  # one of several adapters (lora.adapters): its factors are keyed by its name

    def key(self, part: str) -> str:
        return factor_key(self.name if self.multi else None, part)

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
            adapter=self.name if self.multi else None,
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
    for name, shape in lora.named().items():
        field = f"lora.adapters.{name}.dropout" if lora.multi else "lora.dropout"
        if shape.dropout > 0 and options.tensor_parallel > 1:
            out.append(
                f"{field} {shape.dropout} with megatron.tensor_parallel {options.tensor_parallel}: the TP ranks "
                f"would drop different inputs of one adapter; allowed: {field} 0 with TP > 1"
            )
    if lora.multi and options.device != "cpu":
        out.append(
            "lora.adapters (multi-LoRA) on the megatron backend runs on megatron.device cpu only so far (one "
            "optimizer per adapter is built on torch's AdamW, not megatron's CUDA optimizer); set "
            "megatron.device: cpu or use backend fsdp"
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


def plans(model: HFModel, lora: LoraSection) -> tuple[LoraPlan, ...]:
    """Every adapter ``lora`` puts on ``model``, in the recipe's order (the single form: one)."""
    if not lora.multi:
        return (plan(model, lora),)
    return tuple(
        plan(model, shape, f"lora.adapters.{name}.target_modules", name=name, multi=True)
        for name, shape in lora.named().items()
    )


def plan(
    model: HFModel,
    lora: LoraShape,
    field: str = "lora.target_modules",
    *,
    name: str | None = None,
    multi: bool = False,
) -> LoraPlan:
    """The adapter ``lora`` (the single form, or one adapter's shape with its ``name``) puts on ``model``;
    what megatron does not adapt is refused in one sentence."""
    if isinstance(lora, LoraSection) and lora.multi:
        raise ConfigError("lora.adapters (multi-LoRA): plan each adapter (miles_megatron.lora.plans)")
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
    adapter = name if name is not None else str(getattr(lora, "name", "default"))
    return LoraPlan(name=adapter, shape=lora, slots=slots, multi=multi)


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
                        f"decoder.layers.{i}.{s.megatron}.lora_{factor}.{lora_plan.key(part)}",
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


def record_multi(lora_plans: tuple[LoraPlan, ...], model_path: str, steps: dict[str, int]) -> dict[str, Any]:
    """Multi-LoRA: each adapter's shape and optimizer steps, and the base."""
    return {
        "adapters": {
            p.name: {"rank": p.shape.rank, "alpha": p.shape.alpha, "targets": p.targets} for p in lora_plans
        },
        "steps": dict(steps),
        "base": base_reference(model_path),
    }


def check_checkpoint(
    saved: dict[str, Any] | None,
    lora_plan: LoraPlan | tuple[LoraPlan, ...] | None,
    model_path: str,
    directory: str,
) -> None:
    """Refuse resuming a full checkpoint as LoRA or the reverse, another adapter shape (or set of adapters),
    or another base."""
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
    if isinstance(lora_plan, tuple) or "adapters" in saved:
        have_multi = saved.get("adapters") or {}
        want_multi = (
            {p.name: {"rank": p.shape.rank, "targets": p.targets} for p in lora_plan}
            if isinstance(lora_plan, tuple)
            else {}
        )
        have_shapes = {n: {"rank": a.get("rank"), "targets": a.get("targets")} for n, a in have_multi.items()}
        if have_shapes != want_multi:
            raise ModelError(
                f"checkpoint {directory} holds LoRA adapters {have_shapes or saved.get('name')}, but this run "
                f"trains {want_multi or lora_plan}; resume with the same lora adapters"
            )
        check_same_base(saved.get("base") or {}, model_path, directory)
        return
    have = (saved.get("rank"), saved.get("targets"))
    want = (lora_plan.shape.rank, lora_plan.targets)
    if have != want:
        raise ModelError(
            f"checkpoint {directory} holds a rank-{have[0]} adapter of {have[1]}, but this run trains a "
            f"rank-{want[0]} adapter of {want[1]}; resume with the same lora shape"
        )
    check_same_base(saved.get("base") or {}, model_path, directory)


# ------------------------------------------------------------------ the trainer's adapter


def adapter_tensors(trainer: Any, lora_plan: LoraPlan | None = None) -> Iterator[tuple[str, str, Any]]:
    """``(HF module, factor, full tensor)`` of every factor of a ``MegatronTrainer``'s adapter
    (``lora_plan``: that one of a multi-LoRA trainer's; default: its only one).

    TP shards are joined through the trainer's TP gather: a collective, every rank drains it in order."""
    import torch

    params = dict(trainer.gpt.named_parameters())
    for name, module, factor, parallel in megatron_names(trainer.hf, lora_plan or trainer.lora):
        tensor = params[name].detach()
        dim = tp_dim(factor, parallel)
        if dim is not None and trainer.layout.tp > 1:
            tensor = torch.cat(trainer._gather(name, tensor, "tp"), dim=dim)
        yield module, factor, tensor


def engine_stream(trainer: Any, lora_plans: tuple[LoraPlan, ...] | None = None) -> Iterator[tuple[str, Any]]:
    """The weight update of a LoRA run: only the adapters (``lora_plans``; default: the run's one), under
    the names the engines hold them by."""
    for lora_plan in lora_plans if lora_plans is not None else (trainer.lora,):
        for module, factor, tensor in adapter_tensors(trainer, lora_plan):
            yield engine_name(module, factor, lora_plan.name), tensor


def save_adapter(trainer: Any, directory: str, lora_plan: LoraPlan | None = None) -> None:
    """The trainer's adapter (``lora_plan``; default: its only one) as a peft directory (a collective;
    rank 0 writes)."""
    import torch

    lora_plan = lora_plan or trainer.lora
    with torch.no_grad():
        tensors = {
            peft_name(module, factor): t.to("cpu").clone().contiguous()
            for module, factor, t in adapter_tensors(trainer, lora_plan)
        }
    if trainer.rank == 0:
        write_peft_dir(directory, lora_plan, trainer.spec.model_path, tensors)


def export_adapter(trainer: Any, directory: str, tokenizer_files: tuple[str, ...]) -> None:
    """A LoRA run's export: the peft adapter directory and the base's tokenizer files (a collective).

    Multi-LoRA: one peft directory per adapter, ``<directory>/<name>/``, the tokenizer files in ``directory``."""
    import shutil

    import torch.distributed as dist

    if trainer.multi:
        for lora_plan in trainer.loras:
            save_adapter(trainer, os.path.join(directory, lora_plan.name), lora_plan)
    else:
        save_adapter(trainer, directory)
    if trainer.rank == 0:
        for name in tokenizer_files:
            src = os.path.join(trainer.spec.model_path, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(directory, name))
    dist.barrier()


def serve_adapter(trainer: Any, transport: Any) -> None:
    """Point the transport at the adapter and load its initial state on every engine by name (multi-LoRA:
    every adapter's, each under its own name).

    The adapter's shape (rank, alpha, targets) reaches the engines once, as a peft directory through
    ``/load_lora_adapter``; every later update carries only its tensors."""
    import torch.distributed as dist

    from miles.errors import ComponentError

    carry = getattr(transport, "carry_adapter", None)
    if not callable(carry) or not getattr(transport, "carries_adapters", False):
        raise ComponentError(transport_refusal(trainer.spec.transport))
    carry(trainer.lora.name)  # multi-LoRA refuses the weight check, which this scopes
    for lora_plan in trainer.loras:
        directory = os.path.join(run_dir(trainer.spec.config), "lora", f"{lora_plan.name}-initial")
        save_adapter(trainer, directory, lora_plan)
        if trainer.rank == 0:
            from miles.engines.client import SyncEngineClient

            for url in trainer.spec.engine_urls:
                with SyncEngineClient(url) as client:
                    client.load_lora_adapter(lora_plan.name, directory)
    dist.barrier()


def run_dir(config: dict[str, Any] | None) -> str:
    """The run's directory (``run.output_dir/run.name``), or a fresh temporary one outside a run."""
    run = (config or {}).get("run") or {}
    if run.get("output_dir") and run.get("name"):
        return os.path.join(run["output_dir"], run["name"])
    import tempfile

    return tempfile.mkdtemp(prefix="miles-megatron-lora-")
