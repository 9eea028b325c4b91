"""``backend: megatron`` as the driver selects it (entry point ``miles.backends:megatron``).

``setup`` checks everything it can before touching the GPU, in one sentence each (the machine,
the recipe's sections, the layout against the model, what this backend does not compute yet),
then builds the trainer (``trainer.MegatronTrainer``). One rank lives in the driver's process;
``megatron.num_ranks > 1`` (tensor parallelism) starts one spawned process per rank
(``ranks.TrainerRanks``) and drives them as one trainer.

The driver-side planning (micro-batches, mini-batches for several optimizer steps per batch)
is plain Python here; the trainer turns rows into megatron's tensors on the device.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from typing import Any

import miles.lora
from miles.config.schema import TrainSection
from miles.config.sections import backend_sections
from miles.errors import ComponentError, ConfigError, ModelError
from miles.interfaces import REF_LOGPROBS, TEACHER_LOGPROBS, VALUES, BackendSpec, TransportStats
from miles.train_rows import OLD_LOGPROBS, Row, batch_rows, check_batch, mini_batches, sample_row
from miles.types import Sample, TrainBatch
from miles_megatron import lora as lora_mod
from miles_megatron.batch import plan_micro_batches
from miles_megatron.config import MegatronOptions
from miles_megatron.convert import Spec
from miles_megatron.hf_config import HFModel
from miles_megatron.hooks import launch_problems, runtime_problem
from miles_megatron.layout import ModelShape, ParallelLayout, plan_layout

log = logging.getLogger(__name__)

_ALLOWED_WHILE_OFFLOADED = frozenset({"offload", "onload", "shutdown"})


def validate_options(options: dict[str, Any]) -> tuple[TrainSection, MegatronOptions]:
    """The ``train`` and ``megatron`` sections of a backend spec's options (unknown sections refused)."""
    return backend_sections(options, "megatron", MegatronOptions)


def resolve_layer_spec(options: MegatronOptions) -> Spec:
    """``auto`` is Transformer Engine's spec when it is installed, else megatron-core's local one."""
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if options.layer_spec == "te" and not has_te:
        raise ConfigError("megatron.layer_spec is 'te' but transformer-engine is not installed")
    if options.layer_spec == "auto":
        return "te" if has_te else "local"
    return options.layer_spec


def refusals(spec: BackendSpec, train: TrainSection, options: MegatronOptions, layer_spec: Spec) -> list[str]:
    """What this backend cannot run yet for ``spec``, one sentence each (empty: it can)."""
    out = launch_problems(options) + options.storage_problems()
    unsupported = [s for s in spec.scores if s not in (OLD_LOGPROBS, REF_LOGPROBS, TEACHER_LOGPROBS, VALUES)]
    if unsupported:
        out.append(f"the objective needs {unsupported}, which the megatron backend does not compute yet")
    if TEACHER_LOGPROBS in spec.scores and not spec.teacher_model_path:
        out.append("the objective needs teacher_logprobs but no teacher model is named")
    if VALUES in spec.scores and spec.critic is None:
        out.append("the objective needs values but no critic is set (algorithm.critic)")
    if spec.placement.get("launcher", "local") != "local":
        out.append("placement.launcher 'ray' is not built for the megatron backend yet")
    if options.micro_batch_tokens is not None and layer_spec != "te":
        out.append(
            "megatron.micro_batch_tokens packs sequences (THD), which only Transformer Engine's attention "
            "reads; megatron-core's local attention takes padded rows (unset it)"
        )
    if options.core_attention is not None and layer_spec == "te":
        out.append(
            f"megatron.core_attention {options.core_attention!r} chooses the local layer spec's attention, but "
            "the layer spec is te (Transformer Engine's attention); unset it or set megatron.layer_spec: local"
        )
    if options.core_attention == "megatron" and options.device == "cpu":
        out.append(
            "megatron.core_attention 'megatron' allocates on CUDA and cannot run with megatron.device cpu; "
            "allowed there: sdpa (or unset)"
        )
    if spec.temperature <= 0:
        out.append(f"the rollout temperature must be > 0 to compute log-probs, got {spec.temperature}")
    return out


def routing_replay_problem(model_path: str, options: MegatronOptions) -> str | None:
    """Why this backend cannot replay ``model_path``'s MoE routing under ``options`` (one sentence), or None."""
    try:
        hf = HFModel.from_dir(model_path)
    except ModelError as exc:
        return str(exc)
    if not hf.is_moe:
        return f"model {model_path} is dense (no routed experts): there is no MoE routing to replay"
    if options.device == "cpu":
        return (
            "megatron.device cpu: routing replay is not run on the CPU (megatron's replay path there is "
            "untested; its end-to-end test needs CUDA); use cuda"
        )
    return None


def pipeline_problems(spec: BackendSpec, lora: bool) -> list[str]:
    """What pipeline stages (PP > 1) do not run with yet, one sentence each (empty: they do)."""
    out = []
    if spec.critic is not None:
        out.append(
            "megatron.pipeline_parallel > 1 with a critic (PPO's value model) is not built yet; "
            "allowed: pipeline_parallel 1, or an objective without values"
        )
    if lora:
        out.append("megatron.pipeline_parallel > 1 with LoRA is not built yet; allowed: pipeline_parallel 1")
    return out


class MegatronBackend:
    """``miles.interfaces.Backend`` on megatron-core; options come from the ``train`` and ``megatron`` sections."""

    # Multi-LoRA (lora.adapters, CPU trainer): every adapter in the same linears, an optimizer per adapter,
    # each step's batch split by Sample.metadata[ADAPTER_KEY] (see miles.driver.adapters).
    trains_adapters = True

    @staticmethod
    def routing_replay_problem(model_path: str, config: Any) -> str | None:
        """Why this backend cannot replay ``model_path``'s MoE routing under ``config``, or None: it replays
        through megatron-core's own ``moe_enable_routing_replay`` machinery (``miles_megatron.routing``)."""
        return routing_replay_problem(model_path, getattr(config, "megatron", None) or MegatronOptions())

    def __init__(self) -> None:
        self.layout: ParallelLayout | None = None
        self.trainer: Any = None
        self.spec: BackendSpec | None = None
        self.train_opts: TrainSection | None = None
        self.options: MegatronOptions | None = None
        self._offloaded = False
        self.lora_plan: lora_mod.LoraPlan | None = None
        # Multi-LoRA (lora.adapters): every adapter's plan, in the recipe's order (empty: the single form or none).
        self.adapter_plans: tuple[lora_mod.LoraPlan, ...] = ()

    def setup(self, spec: BackendSpec) -> None:
        if self.trainer is not None:
            raise RuntimeError("MegatronBackend.setup called twice; shut it down first")
        train, options = validate_options(spec.options)
        problem = runtime_problem(options)
        if problem is not None:
            raise ConfigError(problem)
        if not os.path.isfile(os.path.join(spec.model_path, "config.json")):
            raise ModelError(
                f"megatron: model path {spec.model_path!r} is not a Hugging Face model directory"
            )
        layout = plan_layout(options)
        hf = HFModel.from_dir(spec.model_path)
        layout.check_model(ModelShape.of(hf))
        # The frozen scorers are split over the same layout as the policy.
        scorers = (
            ("reference", REF_LOGPROBS, spec.ref_model_path),
            ("teacher", TEACHER_LOGPROBS, spec.teacher_model_path),
        )
        for role, name, path in scorers:
            if name not in spec.scores or not path or path == spec.model_path:
                continue
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ModelError(
                    f"megatron: the {role} model path {path!r} is not a Hugging Face model directory"
                )
            layout.check_model(ModelShape.of(HFModel.from_dir(path)))
        layer_spec = resolve_layer_spec(options)
        problems = refusals(spec, train, options, layer_spec)
        lora_section = miles.lora.section(spec.config)
        if lora_section is not None:
            problems += lora_mod.option_problems(options, lora_section, layer_spec)
        if spec.critic is not None:  # PPO's value model, on the policy's layout (miles_megatron.critic)
            from miles_megatron.critic import critic_problems

            if not os.path.isfile(os.path.join(spec.critic.model_path, "config.json")):
                raise ModelError(
                    f"megatron: the critic model path {spec.critic.model_path!r} is not a Hugging Face "
                    "model directory"
                )
            critic_hf = HFModel.from_dir(spec.critic.model_path)
            layout.check_model(ModelShape.of(critic_hf))
            problems += critic_problems(critic_hf, hf, options)
        if hf.is_moe and layout.world > 1:
            problems.append("a MoE model on more than one rank is not run yet (megatron.num_ranks: 1)")
        if layout.pp > 1:
            problems += pipeline_problems(spec, lora_section is not None)
        if train.use_rollout_routing_replay:
            replay_problem = routing_replay_problem(spec.model_path, options)
            if replay_problem is not None and replay_problem not in problems:
                problems.append(f"train.use_rollout_routing_replay: {replay_problem}")
        if lora_section is not None and lora_section.multi and spec.critic is not None:
            problems.append(
                "lora.adapters (multi-LoRA) with a critic (PPO's value model) is not built on the megatron "
                "backend; use an objective without values"
            )
        if problems:
            raise ConfigError("backend 'megatron': " + "; ".join(problems))
        # LoRA: the recipe's targets against the model and the transport, refused in one sentence each.
        plans = () if lora_section is None else lora_mod.plans(hf, lora_section)
        self.lora_plan = plans[0] if plans else None
        self.adapter_plans = plans if lora_section is not None and lora_section.multi else ()
        if self.lora_plan is not None and spec.engine_urls:
            from miles.plugins import make_component

            transport = make_component("transport", spec.transport, dict(spec.transport_options))
            if not getattr(transport, "carries_adapters", False):
                raise ConfigError(lora_mod.transport_refusal(spec.transport))
        from miles.plugins import validate_component_ref

        validate_component_ref("loss", spec.loss)
        if spec.correction:
            validate_component_ref("correction", spec.correction)
        from miles.lr_schedule import decay_steps

        decay_steps(train, spec.config)  # a decaying schedule with nothing to span fails here, once
        self.spec, self.train_opts, self.options, self.layout = spec, train, options, layout
        if layout.world == 1:
            from miles_megatron.trainer import MegatronTrainer

            self.trainer = MegatronTrainer(spec, layout, options, train, layer_spec)
        else:
            from miles_megatron.ranks import TrainerRanks

            self.trainer = TrainerRanks(spec, layout, options, train, layer_spec)
        log.info(
            "megatron: %d rank(s) ready on %s (%s spec, %s, TP %d)",
            layout.world,
            options.device,
            layer_spec,
            options.params_dtype,
            layout.tp,
        )

    # ------------------------------------------------------------------ steps

    def _plan(self, rows: list[Row]) -> list[list[Row]]:
        assert self.train_opts is not None and self.options is not None
        plan = plan_micro_batches(
            [r.num_tokens for r in rows], self.train_opts.micro_batch_size, self.options.micro_batch_tokens
        )
        return [[rows[i] for i in mb] for mb in plan]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        trainer = self._use("train_step")
        assert self.train_opts is not None
        check_batch(batch, replay=self.train_opts.use_rollout_routing_replay)
        if self.adapter_plans:
            return self._train_adapters(trainer, batch)
        parts = mini_batches(len(batch.samples), self.train_opts.steps_per_rollout)
        t0 = time.perf_counter()
        extra: dict[str, list[list[float]]] = {}
        if len(parts) > 1 and trainer.loss_kind() == "policy":
            # Several optimizer steps on one batch: every step's ratio is against the policy before the first.
            extra[OLD_LOGPROBS] = self.score(batch.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
        rows = batch_rows(batch, extra)
        results = []
        for indices in parts:
            part = [rows[i] for i in indices]
            tokens = int(sum(sum(r.loss_mask) for r in part))
            if tokens == 0:
                log.warning("megatron: step %d: a mini-batch has no loss token; skipped", batch.step)
                continue
            results.append((trainer.train_step(self._plan(part), tokens, len(part)), tokens))
        out = _combine(results)
        out["train/tokens_per_s"] = out.get("train/num_tokens", 0.0) / max(time.perf_counter() - t0, 1e-9)
        return out

    def _train_adapters(self, trainer: Any, batch: TrainBatch) -> dict[str, float]:
        """Multi-LoRA: each adapter's rows of the batch are one optimizer step of that adapter alone (only it
        active, its loss normalised over its own tokens and samples, its own clipping, optimizer and rate)."""
        t0 = time.perf_counter()
        rows = batch_rows(batch, {})
        out: dict[str, float] = {}
        stepped = []
        for name, indices in adapter_rows(batch.samples, [p.name for p in self.adapter_plans]).items():
            part = [rows[i] for i in indices]
            tokens = int(sum(sum(r.loss_mask) for r in part))
            if tokens == 0:
                log.warning(
                    "megatron: step %d: adapter %r has no loss token; it takes no step", batch.step, name
                )
                continue
            metrics = trainer.train_step(self._plan(part), tokens, len(part), name)
            stepped.append(name)
            out |= {f"lora/{name}/{k}": v for k, v in metrics.items()}
        for plan in self.adapter_plans:
            out[f"lora/{plan.name}/stepped"] = float(plan.name in stepped)
        out["train/optimizer_steps"] = float(len(stepped))
        for key in ("train/loss", "train/num_loss_tokens", "train/num_tokens"):
            out[key] = sum(out.get(f"lora/{name}/{key}", 0.0) for name in stepped)
        out["train/tokens_per_s"] = out["train/num_tokens"] / max(time.perf_counter() - t0, 1e-9)
        return out

    def unsent_adapters(self) -> list[str]:
        """Multi-LoRA: the adapters the next weight update sends (trained since the last)."""
        return list(self._use("unsent_adapters").unsent_adapters())

    def score(self, samples: list[Sample], names: list[str]) -> dict[str, list[list[float]]]:
        trainer = self._use("score")
        if not names or not samples:
            return {name: [] for name in names}
        if self.adapter_plans:  # multi-LoRA: each adapter scores its own rows
            out: dict[str, list[list[float]]] = {name: [[] for _ in samples] for name in names}
            for adapter, indices in adapter_rows(samples, [p.name for p in self.adapter_plans]).items():
                part = self._score(trainer, [samples[i] for i in indices], names, adapter)
                for name in names:
                    for i, row in zip(indices, part[name], strict=True):
                        out[name][i] = row
            return out
        return self._score(trainer, samples, names, None)

    def _score(
        self, trainer: Any, samples: list[Sample], names: list[str], adapter: str | None
    ) -> dict[str, list[list[float]]]:
        rows = [sample_row(s) for s in samples]
        assert self.train_opts is not None and self.options is not None
        plan = plan_micro_batches(
            [r.num_tokens for r in rows], self.train_opts.micro_batch_size, self.options.micro_batch_tokens
        )
        groups = [[rows[i] for i in mb] for mb in plan]
        results = (
            trainer.score(groups, list(names))
            if adapter is None
            else trainer.score(groups, list(names), adapter)
        )
        out: dict[str, list[list[float]]] = {name: [[] for _ in samples] for name in names}
        for mb, mb_rows in zip(plan, results, strict=True):
            for index, row in zip(mb, mb_rows, strict=True):
                for name in names:
                    out[name][index] = row[name]
        return out

    def update_weights(self, version: int) -> TransportStats:
        return self._use("update_weights").update_weights(version)

    def save_checkpoint(self, directory: str) -> None:
        self._use("save_checkpoint").save_checkpoint(os.path.abspath(directory))

    def load_checkpoint(self, directory: str) -> None:
        from miles_megatron.trainer import CHECKPOINT_MARKER

        directory = os.path.abspath(directory)
        if not os.path.isfile(os.path.join(directory, CHECKPOINT_MARKER)):
            raise FileNotFoundError(
                f"{directory} is not a megatron checkpoint ({CHECKPOINT_MARKER} is missing)"
            )
        trainer = self._use("load_checkpoint")
        assert self.spec is not None
        with open(os.path.join(directory, CHECKPOINT_MARKER)) as f:
            marker = json.load(f)
        saved_lora = marker.get("lora")
        if self.options is not None and self.options.device == "cpu" and self.layout is not None:
            from miles_megatron.reshard import reshard_problem, same_layout, saved_layout
            from miles_megatron.reshard_stages import crosses_stages, names_problem

            saved = saved_layout(marker)
            problem = reshard_problem(saved, self.layout)  # before any rank reads a file
            if problem is not None:
                raise ComponentError(f"checkpoint {directory} cannot be resharded: {problem}")
            if not same_layout(saved, self.layout) and crosses_stages(saved, self.layout):
                problem = names_problem(directory, saved)
                if problem is not None:
                    raise ComponentError(problem)
        # A LoRA checkpoint resumes only as the same adapter on the same base (checked before any rank reads it).
        lora_mod.check_checkpoint(
            saved_lora, self.adapter_plans or self.lora_plan, self.spec.model_path, directory
        )
        trainer.load_checkpoint(directory)

    def export_hf(self, directory: str) -> None:
        self._use("export_hf").export_hf(os.path.abspath(directory))

    def offload(self) -> dict[str, float]:
        """Colocated placement: parameters, gradient buffers and optimizer state to pinned host memory, or to
        node-local disk through a fixed-size staging buffer (``megatron.offload_to``)."""
        out = self._use("offload").offload()
        self._offloaded = True
        return {f"offload/{k}": v for k, v in out.items()}

    def onload(self) -> dict[str, float]:
        out = self._use("onload").onload()
        self._offloaded = False
        return {f"onload/{k}": v for k, v in out.items()}

    def shutdown(self) -> None:
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            trainer.close()
        self.layout = None

    def _use(self, command: str) -> Any:
        if self.trainer is None:
            raise RuntimeError(f"the megatron backend cannot run {command}: it is not set up (or shut down)")
        if self._offloaded and command not in _ALLOWED_WHILE_OFFLOADED:
            raise RuntimeError(
                f"the megatron backend cannot run {command}: its state is offloaded; call onload() first"
            )
        return self.trainer


_SUMMED = ("train/num_loss_tokens", "train/num_tokens")


def adapter_rows(samples: list[Sample], adapters: list[str]) -> dict[str, list[int]]:
    """Multi-LoRA: the batch's sample indices of each adapter (``Sample.metadata[ADAPTER_KEY]``), in
    ``adapters`` order, only adapters with rows; a sample naming no adapter of the run is refused."""
    from miles.config.schema import ADAPTER_KEY
    from miles.errors import ComponentError

    rows: dict[str, list[int]] = {name: [] for name in adapters}
    for i, sample in enumerate(samples):
        name = sample.metadata.get(ADAPTER_KEY)
        if name not in rows:
            raise ComponentError(
                f"sample {i} (prompt {sample.prompt.index}) names LoRA adapter {name!r} "
                f"(metadata[{ADAPTER_KEY!r}]); this run trains {adapters}"
            )
        rows[name].append(i)
    return {name: indices for name, indices in rows.items() if indices}


def _combine(results: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One set of metrics for several optimizer steps: counts and times add up, the rest is token-weighted."""
    out: dict[str, float] = {"train/optimizer_steps": float(len(results))}
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, tokens in results:
        for key, value in metrics.items():
            if key in _SUMMED or key.startswith("time/"):
                out[key] = out.get(key, 0.0) + value
            elif key in ("train/lr", "train/cuda_peak_gib", "critic/lr"):
                out.setdefault(key, value)
            else:
                sums[key] = sums.get(key, 0.0) + value * tokens
                weights[key] = weights.get(key, 0.0) + tokens
    out.update({k: sums[k] / weights[k] for k in sums if weights[k] > 0})
    return out
