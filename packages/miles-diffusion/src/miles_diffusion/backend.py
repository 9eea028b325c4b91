"""The diffusion backend (``backend: diffusion``): the package's objectives behind the core's Backend.

One process on the CPU, plain torch, inside the ``miles run`` process: it loads the model directory, builds the
recipe's trajectory objective (``algorithm.loss``: ``flow_grpo`` or ``diffusion_nft``) with the
``train:`` section's optimizer settings, and trains on the core's batches: each sample's
:class:`~miles_diffusion.payload.TrajectoryPayload` (stacked into one batch of trajectories) and its
one advantage from the core's estimator (``advantage: diffusion_grpo``). New weights go to the engines
through the recipe's transport as the model's full state dict (the colocated hand-off on one machine).
Checkpoints hold the weights (a model directory), the optimizer and the RNG states.

An SD3 / SD3.5 model (a diffusers pipeline directory, :mod:`miles_diffusion.sd3`) trains its
transformer only: the prompt texts are ``rollout.options.prompts`` (prompt id ``i`` is ``prompts[i]``,
the same table the rollout sends the engine), weight updates and checkpoints carry the transformer
alone (``<checkpoint>/transformer``), and the export is a whole pipeline directory (the base's frozen
components beside the trained transformer) that diffusers' ``StableDiffusion3Pipeline`` loads. A
Wan 2.x text-to-video model (:mod:`miles_diffusion.wan`, ``[C, F, h, w]`` video latents) trains the
same way: its transformer alone, and its export is a whole directory ``WanPipeline`` loads.

With a ``lora`` section (the core's: rank, alpha, dropout, target_modules) the backend trains a peft
LoRA adapter on the denoiser instead (:mod:`miles_diffusion.lora`): the base is frozen, AdamW holds
the adapter's parameters only, every weight update sends the adapter's tensors only, and the engine
merges them into its base weights on arrival. The engine gets the adapter's configuration once,
before the first rollout, from the initial adapter (B = 0) written under ``<run dir>/lora/``.
Checkpoints then hold the adapter (a peft directory) and a digest of the base it belongs to; the
export is a peft adapter directory that ``PeftModel.from_pretrained`` loads onto the base. On a pipeline
family's model (SD3, Wan) the adapter wraps the transformer (the only part that trains): its factors travel as
``transformer.<module>.lora_A.<name>.weight``, and the export loads onto the base's bare transformer.

In ``mode: sft`` (``algorithm.loss: diffusion_sft``) it trains flow matching on the image samples the
core's supervised stage hands it instead (:mod:`miles_diffusion.supervised`): no engines, no transport.

With ``diffusion.fsdp_ranks: N`` above 1 (Flow-GRPO or DiffusionNFT, full weights) the backend trains data-parallel
with FSDP2: it starts N local rank processes through miles-fsdp's own rank group
(:class:`miles_fsdp.ranks.ProcessRanks`, gloo on the CPU, 127.0.0.1 and a free port), each building
this backend on its rank (:func:`rank_trainer`) with its denoiser sharded by
:func:`miles_diffusion.fsdp.data_parallel`; every command goes to every rank and rank 0 answers. Each
rank gets the whole batch and the same seeded denoising steps and re-scores its share of the
trajectories; FSDP2 sums the share-weighted gradients, so the step equals the one-process step within
float rounding. The weights the engines get, the checkpoints' weights and the export are the full
(unsharded) model, gathered from the shards and written by rank 0 exactly as one process writes them;
a checkpoint's optimizer state is the full (unsharded) AdamW state, keyed by parameter name.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch

import miles.lora
from miles.config.schema import LoraSection, TrainSection
from miles.errors import ConfigError
from miles.interfaces import BackendSpec, Transport, TransportStats
from miles.plugins import make_component
from miles.types import Sample, TrainBatch
from miles_diffusion import lora as lora_mod
from miles_diffusion.config import SECTION, DiffusionSection
from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.deterministic import check_attention_backends, deterministic_mode
from miles_diffusion.families import check_core_path, check_family_guidance, load_model
from miles_diffusion.guidance import GuidanceError
from miles_diffusion.image_data import IMAGE_SAMPLES
from miles_diffusion.losses import ObjectiveLoss
from miles_diffusion.model import WEIGHTS_FILE, FlowModel, load_pretrained, save_pretrained
from miles_diffusion.objectives import (
    ObjectiveContext,
    Rollout,
    RolloutObjective,
    SupervisedObjective,
    TrainerConfig,
    build_objective,
)
from miles_diffusion.payload import payload_of, stack
from miles_diffusion.pipeline_model import PipelineFlowModel
from miles_diffusion.rollout import DiffusionRolloutOptions
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_diffusion.sd3 import (
    TRANSFORMER_DIR,
    export_pipeline,
    load_transformer,
    save_transformer,
)
from miles_diffusion.supervised import SupervisedTraining, held_out_images

if TYPE_CHECKING:
    from miles_diffusion.fsdp import DataParallel
    from miles_fsdp.ranks import RankGroup

STATE_FILE = "trainer_state.pt"
FULL_OPTIMIZER = "optimizer_full"  # fsdp_ranks > 1: the full AdamW state, keyed by parameter name
RANK_TIMEOUT_S = 600.0
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
WHO = "backend 'diffusion'"


class DiffusionBackend:
    """``miles.interfaces.Backend`` for trajectory objectives (see the module docstring)."""

    # mode: sft trains given images (miles_diffusion.supervised)
    supervised_kinds = frozenset({IMAGE_SAMPLES})

    def __init__(self, place: DataParallel | None = None) -> None:
        self._place = place  # this rank's place when it is one of fsdp_ranks rank processes
        self._ranks: RankGroup | None = None  # the rank processes this backend drives (fsdp_ranks > 1)
        self._whole: DiffusionModel | None = None  # rank 0's unsharded copy the full weights are written from
        self._prompts: tuple[str, ...] = ()
        self._model: DiffusionModel | None = None
        self._model_path = ""
        self._objective: RolloutObjective | None = None
        self._supervised: SupervisedTraining | None = None  # mode: sft
        self._optimizer: torch.optim.Optimizer | None = None
        self._transport: Transport | None = None
        self._generator = torch.Generator()
        self._sampler = SamplerConfig()
        self._group_size = 1
        self._engine_urls: list[str] = []
        self._stack = contextlib.ExitStack()
        self._lora: LoraSection | None = None
        self._peft: Any = None  # the peft model around the policy (LoRA only)
        self._base_digest = ""
        self._lora_prefix = ""  # the adapter root's path in the model (``transformer.`` for a pipeline)
        self._run_dir = ""
        self._sequence_parallel = 1  # diffusion.sequence_parallel: ranks per group sharing trajectories

    # ------------------------------------------------------------------ setup

    def setup(self, spec: BackendSpec) -> None:
        section = DiffusionSection(**spec.options.get(SECTION, {}))
        if section.fsdp_ranks > 1 and self._place is None:
            self._start_ranks(spec, section.fsdp_ranks)
            return
        self._sequence_parallel = section.sequence_parallel
        train = TrainSection(**spec.options["train"])
        if spec.correction is not None:
            raise ConfigError(f"{WHO} applies no token correction; set algorithm.correction: null")
        if spec.scores or spec.critic is not None:
            raise ConfigError(f"{WHO} computes no per-token scores and trains no critic ({spec.scores})")
        loss = make_component("loss", spec.loss, spec.loss_options)
        if not isinstance(loss, ObjectiveLoss):
            raise ConfigError(
                f"{WHO} trains diffusion objectives (algorithm.loss: flow_grpo, diffusion_nft, or diffusion_sft "
                f"with mode: sft); {spec.loss!r} is a token loss"
            )
        run = spec.config or {}
        rollout = run.get("rollout", {})
        rollout_options = DiffusionRolloutOptions(**rollout.get("options", {}))
        self._sampler = rollout_options.sampler
        self._group_size = int(rollout.get("n_samples_per_prompt", 1))
        if section.torch_threads is not None:
            torch.set_num_threads(section.torch_threads)
        if section.deterministic:
            self._stack.enter_context(deterministic_mode(spec.seed))
        try:
            # the families the engine and backend serve (tiny UNet, sd3, wan); guidance needs an
            # unconditional branch: both judged from the directory, before loading
            family = check_core_path(spec.model_path)
            check_family_guidance(family, self._sampler.guidance_scale)
        except ValueError as exc:
            raise ConfigError(f"{WHO}: {exc}") from None
        try:
            model = load_model(spec.model_path, prompts=tuple(rollout_options.prompts or ()))
        except ValueError as exc:
            raise ConfigError(f"{WHO}: {exc} (rollout.options.prompts)") from None
        self._model_path = spec.model_path
        if section.deterministic:
            check_attention_backends(model)
        self._lora = miles.lora.section(run)
        if self._lora is not None:
            # peft injects the adapter into ``model`` (or a pipeline's transformer) itself: the objectives
            # train it as before, and only the adapter's parameters require gradients (the optimizer
            # takes only those).
            self._peft = lora_mod.wrap(model, self._lora, spec.model_path)
            self._lora_prefix = lora_mod.adapter_prefix(model)
            self._base_digest = _digest(spec.model_path, bool(self._lora_prefix))
            self._run_dir = _run_dir(run)
        trainer = TrainerConfig(
            lr=train.lr,
            weight_decay=train.weight_decay,
            max_grad_norm=train.grad_clip if train.grad_clip is not None else math.inf,
            train_step_fraction=section.train_step_fraction,
            steps_per_update=section.steps_per_update,
            betas=train.betas,
            eps=train.eps,
        )
        try:
            objective = build_objective(loss.config, ObjectiveContext(model, trainer, self._sampler))
        except GuidanceError as exc:  # an objective that does not train on guided samples
            raise ConfigError(f"{WHO}: {exc} (rollout.options.guidance_scale)") from None
        if isinstance(objective, SupervisedObjective):  # mode: sft, on the batches of an image source
            if not isinstance(model, FlowModel):
                raise ConfigError(
                    f"{WHO}: mode: sft trains the tiny UNet only so far (a {type(model).__name__} would need "
                    "its VAE encoder for the given images)"
                )
            self._supervised = SupervisedTraining(objective, model, held_out_images(run, WHO), WHO)
        elif not isinstance(objective, RolloutObjective):
            raise ConfigError(f"{WHO}: objective {loss.objective!r} trains neither on rollouts nor on images")
        self._prompts = tuple(rollout_options.prompts or ())
        if self._place is not None:
            self._shard(objective)
        optimizer = getattr(objective, "optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"{WHO}: objective {loss.objective!r} keeps no optimizer the backend can checkpoint"
            )
        self._model, self._optimizer = model, optimizer
        self._objective = objective if isinstance(objective, RolloutObjective) else None
        self._generator = torch.Generator().manual_seed(spec.seed)
        self._engine_urls = list(spec.engine_urls)
        if self._supervised is not None:  # mode: sft: no engines, no weights to send
            return
        if self._place is not None and self._place.rank != 0:
            return  # rank 0 alone sends the gathered weights
        transport: Transport = make_component("transport", spec.transport, spec.transport_options)
        transport.connect(self._engine_urls, rank=0, world_size=1, device="cpu")
        self._transport = transport
        if self._lora is not None:
            self._serve_adapter(transport)

    def _start_ranks(self, spec: BackendSpec, size: int) -> None:
        """fsdp_ranks > 1: N local rank processes (miles-fsdp's rank group), each building this backend
        on its rank; the recipe's checks refused what they cannot train before anything started."""
        from miles_fsdp.ranks import ProcessRanks

        ranks = ProcessRanks(
            spec,
            size,
            start_method="spawn",
            command_timeout_s=RANK_TIMEOUT_S,
            trainer_factory="miles_diffusion.backend:rank_trainer",
        )
        try:
            ranks.wait_ready(RANK_TIMEOUT_S)
        except BaseException:
            ranks.close()
            raise
        self._ranks = ranks

    def _send(self, command: str, arg: Any) -> Any:
        """Run ``command`` on every rank; rank 0's answer."""
        assert self._ranks is not None
        return self._ranks.send(command, [arg] * self._ranks.size)[0]

    def _shard(self, objective: object) -> None:
        """This rank's share: the objective's model sharded with FSDP2, its optimizer rebuilt over the
        shards (:func:`miles_diffusion.fsdp.data_parallel`)."""
        from miles_diffusion.fsdp import DataParallelTrainer, data_parallel

        if (
            not isinstance(objective, DataParallelTrainer)
            or self._lora is not None
            or self._supervised is not None
        ):
            raise ConfigError(
                f"{WHO}: diffusion.fsdp_ranks > 1 trains flow_grpo and diffusion_nft on full weights only "
                "(not LoRA or mode: sft)"
            )
        try:
            data_parallel(objective, sequence_parallel=self._sequence_parallel)
        except ValueError as exc:
            raise ConfigError(f"{WHO}: {exc}") from None

    def _serve_adapter(self, transport: Transport) -> None:
        """LoRA: the engines merge the initial adapter (B = 0: the base, unchanged) and learn its shape.

        Its configuration (rank, alpha, modules) reaches each engine once, as a peft directory through
        ``/load_lora_adapter``; every later update carries only the factors."""
        from miles.engines.client import SyncEngineClient

        assert self._lora is not None
        carry = getattr(transport, "carry_adapter", None)
        if callable(carry):
            carry(self._lora.name)
        directory = os.path.join(self._run_dir, "lora", f"{self._lora.name}-initial")
        lora_mod.save_adapter(self._peft, directory)
        for url in self._engine_urls:
            with SyncEngineClient(url) as client:
                client.load_lora_adapter(self._lora.name, directory)

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        if self._ranks is not None:
            stats: dict[str, float] = self._send("train_step", batch)
            return stats
        if self._supervised is not None:
            return self._supervised.train_step(batch.samples, self._generator)
        model, objective = self._ready()
        samples = batch.samples
        payloads = [payload_of(s, WHO) for s in samples]
        trajectory = stack(payloads, WHO)
        if payloads[0].sampler != self._sampler:
            raise ConfigError(
                f"{WHO}: the batch was sampled with {payloads[0].sampler}, but the trainer re-scores with "
                f"{self._sampler} (rollout.options); they must agree"
            )
        # The engine-trainer gap before any update: the engine sampled each group as its own batch,
        # the trainer scores the whole step's batch at once, and the two forward passes may round apart.
        with torch.no_grad():
            first = step_log_prob(
                model, trajectory, 0, self._sampler.noise_level, self._sampler.guidance_scale
            )[0]
        mismatch = float((first - trajectory.log_probs[:, 0]).abs().max())
        advantages = torch.tensor([_one(row, s) for row, s in zip(batch.advantages, samples, strict=True)])
        rewards = torch.tensor(
            [s.reward if s.reward is not None else 0.0 for s in samples], dtype=torch.float32
        )
        rollout = Rollout(trajectory, rewards, self._group_size, advantages=advantages.to(torch.float32))
        stats = objective.train_on_rollout(rollout, self._generator)
        versions = [p.weight_version for p in payloads]
        return {
            **{f"train/{key}": float(value) for key, value in stats.items()},
            "train/rollout_log_prob_mean": float(trajectory.log_probs.mean()),
            "train/trajectories": float(len(samples)),
            "train/logprob_mismatch_max": mismatch,
            "train/oldest_weight_version": float(min(versions)),
        }

    def score(self, samples: list[Sample], names: list[str]) -> dict[str, list[list[float]]]:
        if names:
            raise ConfigError(f"{WHO} computes no per-token scores ({names})")
        return {}

    # ------------------------------------------------------------------ weights

    def update_weights(self, version: int) -> TransportStats:
        if self._ranks is not None:
            sent: TransportStats = self._send("update_weights", version)
            return sent
        model, _ = self._ready()
        if self._place is not None:  # every rank gathers the full weights; rank 0 sends them
            with torch.no_grad():
                full = self._full_state(model)
            if self._transport is None:
                return TransportStats(bytes_sent=0, seconds=0.0, buckets=0, version=version)
            return self._transport.send(iter(full.items()), version)
        assert self._transport is not None
        with torch.no_grad():
            if self._lora is not None:  # the adapter alone; the engine merges it into its base
                tensors = lora_mod.adapter_tensors(self._peft, self._lora.name, self._lora_prefix)
                return self._transport.send(tensors, version)
            return self._transport.send(iter(model.state_dict().items()), version)

    def reconnect_transport(self, _: None = None) -> None:
        """A restarted engine rejoins: the transport talks to the engines over fresh connections."""
        if self._ranks is not None:
            self._send("reconnect_transport", None)
            return
        reconnect = getattr(self._transport, "reconnect", None)
        if callable(reconnect):
            reconnect(self._engine_urls)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> None:
        if self._ranks is not None:
            self._send("save_checkpoint", directory)
            return
        if self._place is not None:
            self._save_sharded(directory)
            return
        model = self._policy()
        assert self._optimizer is not None
        os.makedirs(directory, exist_ok=True)
        state: dict[str, Any] = {
            "optimizer": self._optimizer.state_dict(),
            "generator": self._generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        if self._lora is not None:
            lora_mod.save_adapter(self._peft, os.path.join(directory, ADAPTER_DIR))
            state["lora_base_digest"] = self._base_digest
        elif isinstance(model, PipelineFlowModel):  # the transformer alone: the frozen parts are the base's
            save_transformer(model, directory)
        else:
            assert isinstance(model, FlowModel)
            save_pretrained(model, os.path.join(directory, MODEL_DIR))
        torch.save(state, os.path.join(directory, STATE_FILE))

    def load_checkpoint(self, directory: str) -> None:
        if self._ranks is not None:
            self._send("load_checkpoint", directory)
            return
        model = self._policy()
        assert self._optimizer is not None
        state_path = os.path.join(directory, STATE_FILE)
        if not os.path.isfile(state_path):
            raise ConfigError(
                f"{WHO}: {directory} holds no {STATE_FILE}; it is not this backend's checkpoint"
            )
        state = torch.load(state_path, weights_only=True)  # tensors and plain data only, never objects
        sharded = FULL_OPTIMIZER in state
        if sharded != (self._place is not None):
            raise ConfigError(
                f"{WHO}: {directory} was written by "
                f"{'fsdp_ranks > 1' if sharded else 'one process'}; resume it with "
                f"diffusion.fsdp_ranks {'above 1' if sharded else '1'}"
            )
        if self._place is not None:
            self._load_sharded(model, directory, state)
        else:
            self._load_weights(model, directory, state)
            self._optimizer.load_state_dict(state["optimizer"])
        self._generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])

    def _load_weights(self, model: DiffusionModel, directory: str, state: dict[str, Any]) -> None:
        """The checkpoint's weights, refused whole if it is of the other kind (LoRA / full) or, for an
        adapter, of another base (the adapter's delta means nothing on other weights)."""
        has_adapter = os.path.isdir(os.path.join(directory, ADAPTER_DIR))
        if self._lora is not None or has_adapter:
            self._load_adapter(directory, state, has_adapter)
            return
        if isinstance(model, PipelineFlowModel):
            if not os.path.isdir(os.path.join(directory, TRANSFORMER_DIR)):
                raise ConfigError(
                    f"{WHO}: {directory} holds no {TRANSFORMER_DIR}/; it is not a pipeline model's checkpoint"
                )
            try:
                load_transformer(model, directory)
            except (ValueError, RuntimeError) as exc:
                raise ConfigError(
                    f"{WHO}: the checkpoint's transformer does not fit this model: {exc}"
                ) from None
            return
        assert isinstance(model, FlowModel)
        restored = load_pretrained(os.path.join(directory, MODEL_DIR))
        if restored.config != model.config:
            raise ConfigError(f"{WHO}: the checkpoint holds a model of another shape ({restored.config})")
        model.load_state_dict(restored.state_dict())

    def _load_adapter(self, directory: str, state: dict[str, Any], has_adapter: bool) -> None:
        if self._lora is None:
            raise ConfigError(
                f"{WHO}: {directory} holds a LoRA adapter checkpoint; resume it with its lora section"
            )
        if not has_adapter:
            raise ConfigError(
                f"{WHO}: {directory} holds full weights, not a LoRA adapter; resume it without a lora section"
            )
        saved = str(state.get("lora_base_digest", ""))
        if saved != self._base_digest:
            raise ConfigError(
                f"{WHO}: the checkpoint's adapter was trained on a base with digest {saved[:16]}, this run's "
                f"base (model.path) has {self._base_digest[:16]}; resume on the same base"
            )
        lora_mod.load_adapter(self._peft, os.path.join(directory, ADAPTER_DIR))

    def export_hf(self, directory: str) -> None:
        """The policy as a model directory (what the engine and ``model.path`` load); under LoRA a peft
        adapter directory (``PeftModel.from_pretrained(base, directory)``; the engine's
        ``/load_lora_adapter`` merges it), and for a pipeline family's transformer also the same factors
        as diffusers' ``pytorch_lora_weights.safetensors`` (``pipeline.load_lora_weights(directory)``)."""
        if self._ranks is not None:
            self._send("export_hf", directory)
            return
        if self._place is not None:  # the gathered full weights, written by rank 0
            whole = self._gather_whole()
            if whole is not None:
                self._write_weights(whole, directory, export=True)
            return
        model = self._policy()
        if self._lora is not None:
            lora_mod.save_adapter(self._peft, directory)
            if self._lora_prefix:  # a pipeline's transformer: diffusers' load_lora_weights reads it too
                lora_mod.save_for_diffusers(self._peft, directory, self._lora_prefix)
            return
        if isinstance(model, PipelineFlowModel):
            # a whole pipeline: the base's frozen parts, this transformer
            export_pipeline(model, self._model_path, directory)
            return
        assert isinstance(model, FlowModel)
        save_pretrained(model, directory)

    # ------------------------------------------------------------------ placement

    def offload(self) -> dict[str, float]:
        """Colocated placement hands the devices to the engines while they sample; this backend trains
        on the CPU, so there is nothing to move."""
        return {}

    def onload(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.close()
        transport, self._transport = self._transport, None
        try:
            if transport is not None:
                transport.close()
        finally:
            self._stack.close()

    def close(self) -> None:
        """A rank process's end (miles-fsdp's rank group calls it)."""
        self.shutdown()

    # ------------------------------------------------------------------ fsdp_ranks > 1: full weights

    def _full_state(self, model: DiffusionModel) -> dict[str, torch.Tensor]:
        """The model's full state dict from the shards (a collective: every rank runs it, in key order)."""
        from torch.distributed.tensor import DTensor

        return {
            name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous()
            for name, t in model.state_dict().items()
        }

    def _unsharded(self) -> DiffusionModel:
        """An unsharded copy of the model (loaded from ``model.path`` once), for full weights."""
        if self._whole is None:
            self._whole = load_model(self._model_path, prompts=self._prompts).requires_grad_(False)
        return self._whole

    def _gather_whole(self) -> DiffusionModel | None:
        """Every rank gathers the full weights; rank 0 gets them in its unsharded copy, the others None."""
        assert self._place is not None
        with torch.no_grad():
            full = self._full_state(self._policy())
        if self._place.rank != 0:
            return None
        whole = self._unsharded()
        whole.load_state_dict(full, strict=True)
        return whole

    def _write_weights(self, model: DiffusionModel, directory: str, *, export: bool) -> None:
        """Full weights as one process writes them: a checkpoint's, or the export."""
        if isinstance(model, PipelineFlowModel):
            if export:
                export_pipeline(model, self._model_path, directory)
            else:
                save_transformer(model, directory)
            return
        assert isinstance(model, FlowModel)
        save_pretrained(model, directory if export else os.path.join(directory, MODEL_DIR))

    def _save_sharded(self, directory: str) -> None:
        """A rank's part of a checkpoint: the full weights and the full AdamW state, written by rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        assert self._place is not None and self._optimizer is not None
        whole = self._gather_whole()
        optimizer = get_optimizer_state_dict(
            self._policy(),
            self._optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        if whole is None:
            return
        os.makedirs(directory, exist_ok=True)
        self._write_weights(whole, directory, export=False)
        state: dict[str, Any] = {
            FULL_OPTIMIZER: optimizer,
            "generator": self._generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, os.path.join(directory, STATE_FILE))

    def _load_sharded(self, model: DiffusionModel, directory: str, state: dict[str, Any]) -> None:
        """Every rank reads the full weights and optimizer state and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self._optimizer is not None
        whole = self._unsharded()
        self._load_weights(whole, directory, state)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, whole.state_dict(), options=options)
        set_optimizer_state_dict(model, self._optimizer, state[FULL_OPTIMIZER], options=options)
        if self._place is not None and self._place.rank != 0:
            self._whole = None  # only rank 0 writes full weights

    # ------------------------------------------------------------------ helpers

    def _ready(self) -> tuple[DiffusionModel, RolloutObjective]:
        model = self._policy()
        if self._objective is None:
            raise RuntimeError(f"{WHO}: this run trains given images (mode: sft), not rollouts")
        return model, self._objective

    def _policy(self) -> DiffusionModel:
        if self._model is None:
            raise RuntimeError(f"{WHO}: setup() has not run")
        return self._model


def rank_trainer(
    spec: BackendSpec, rank: int, world_size: int, device_index: int | None = None
) -> DiffusionBackend:
    """One of ``diffusion.fsdp_ranks`` rank processes (miles-fsdp's rank group builds it after joining
    the gloo process group): this backend on its rank, its denoiser sharded."""
    from miles_diffusion.fsdp import DataParallel

    backend = DiffusionBackend(DataParallel(rank, world_size))
    backend.setup(spec)
    return backend


def _digest(model_path: str, pipeline: bool = False) -> str:
    """sha256 of the base's weights: a LoRA checkpoint belongs to these exact weights (the tiny UNet's
    weights file; a pipeline's transformer weights files, in name order: the adapter's root)."""
    if pipeline:
        root = os.path.join(model_path, TRANSFORMER_DIR)
        files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".safetensors"))
    else:
        files = [os.path.join(model_path, WEIGHTS_FILE)]
    h = hashlib.sha256()
    for path in files:
        if pipeline:
            h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _run_dir(config: dict[str, Any]) -> str:
    """Where the initial adapter goes: the run's directory (a temporary one without a run)."""
    run = config.get("run") or {}
    if run.get("output_dir") and run.get("name"):
        return os.path.join(str(run["output_dir"]), str(run["name"]))
    return tempfile.mkdtemp(prefix="miles-diffusion-lora-")


def _one(row: list[float], sample: Sample) -> float:
    if len(row) != 1:
        raise ConfigError(
            f"{WHO}: sample {sample.group_index} of prompt {sample.prompt.index} has {len(row)} advantage entries; "
            "a trajectory takes exactly one (algorithm.advantage: diffusion_grpo)"
        )
    return float(row[0])
