"""The recipe schema: one pydantic model per top-level section.

Every section forbids unknown keys, so a typo fails validation (with a "did you
mean" from the loader) before anything heavy starts. Components are referenced by
name (an entry point) or by import path (``pkg.mod:attr``); their own options live
next to them in an ``*_options`` mapping that the component validates.
Plugins add whole sections through the ``miles_config_sections`` hook.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]+$", description="run name; the run directory is output_dir/name"
    )
    output_dir: str = Field("runs", description="parent directory of run directories")
    seed: int = 0
    num_steps: int = Field(20, ge=1, description="training steps (one rollout each)")
    save_every: int | None = Field(
        None, ge=1, description="save a resumable checkpoint every N steps (and at the end)"
    )
    keep_checkpoints: int = Field(2, ge=1, description="resumable checkpoints kept on disk")
    export_hf: bool = Field(True, description="write a Hugging Face checkpoint of the final policy")

    @field_validator("name")
    @classmethod
    def _not_a_relative_path(cls, name: str) -> str:
        # "." and ".." pass the character class but name output_dir itself or its parent.
        if set(name) <= {"."}:
            raise ValueError(f"run.name {name!r} names a directory, not a run; use letters, digits, _ - .")
        return name


class ModelSection(Section):
    path: str = Field(
        ..., description="a Hugging Face model directory, or builtin:NAME (see `miles models list`)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataSection(Section):
    source: str = Field("jsonl", description="data source name or import path")
    path: str = Field(
        ..., description="dataset file (.jsonl, .parquet), builtin:NAME, or a datasets id for source=hf"
    )
    prompt_key: str = "prompt"
    label_key: str | None = "label"
    metadata_keys: list[str] = Field(
        default_factory=list, description="extra fields copied into the prompt metadata"
    )
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True
    system_prompt: str | None = None
    prompt_template: str = Field("{prompt}", description="format string applied to the prompt text")
    options: dict[str, Any] = Field(default_factory=dict)


class RolloutSection(Section):
    fn: str = Field("default", description="rollout function name or import path")
    generate_fn: str = Field("default", description="generate function name or import path")
    prompts_per_step: int = Field(8, ge=1)
    n_samples_per_prompt: int = Field(8, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    reward: str = Field("math", description="reward name or import path")
    reward_options: dict[str, Any] = Field(default_factory=dict)
    filters: list[str] = Field(
        default_factory=lambda: ["nonzero_std"], description="group filters (names or import paths)"
    )
    max_rounds: int = Field(
        1, ge=1, description="rollout rounds per step to refill groups the filters dropped (dynamic sampling)"
    )
    buffer: str = Field("fifo", description="buffer name or import path")
    reward_postprocess: list[str] = Field(
        default_factory=list,
        description="reward post-processors applied in order to each sample's reward (e.g. overlong_penalty)",
    )
    reward_postprocess_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="options per post-processor, keyed by the name used above"
    )
    options: dict[str, Any] = Field(default_factory=dict)
    dump: bool = Field(
        False,
        description="write every step's samples (tokens, text, rewards, log-probs, versions, status) to "
        "rollouts/step_NNNNNN.jsonl in the run directory (docs/observability.md)",
    )
    record_routed_experts: bool = Field(
        False,
        description="MoE: ask the engines for the experts every MoE layer routed each token to (prompt and "
        "response) and keep them on the samples; the trainer then logs train/routing_mismatch, the share "
        "of tokens x layers its own router would route differently (train.use_rollout_routing_replay "
        "turns it on; docs/training.md)",
    )

    @model_validator(mode="after")
    def _options_name_postprocessors(self) -> RolloutSection:
        unknown = sorted(set(self.reward_postprocess_options) - set(self.reward_postprocess))
        if unknown:
            raise ValueError(
                f"rollout.reward_postprocess_options has options for {unknown}, which are not in "
                f"rollout.reward_postprocess {self.reward_postprocess}"
            )
        return self


class EngineSection(Section):
    launcher: str = Field("embedded", description="embedded (built-in HF engine) or sglang")
    num_engines: int = Field(1, ge=1)
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535, description="first engine port; None picks free ports")
    urls: list[str] = Field(
        default_factory=list, description="attach to running engines instead of launching"
    )
    device: str = Field("cpu", description="cpu, cuda, or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="default: model.dtype")
    max_batch_size: int = Field(64, ge=1, description="requests batched into one forward pass")
    startup_timeout_s: float = Field(180.0, gt=0)
    release_memory: bool = Field(
        False,
        description="colocated placement: free the engines' KV cache after each rollout, while the trainer "
        "uses the devices, and allocate it again before the engines generate (the engines' "
        "/release_memory_occupation and /resume_memory_occupation; the embedded engine needs its paged KV "
        "cache)",
    )
    # Fault tolerance (docs/reliability.md): the driver health-checks the engines, quarantines a dead
    # or hung one, retries its requests on the others and restarts it.
    health_check_interval_s: float = Field(
        2.0, ge=0, description="seconds between health checks of every engine; 0 turns supervision off"
    )
    health_timeout_s: float = Field(
        10.0, gt=0, description="an engine whose /health does not answer within this is hung"
    )
    max_restarts: int | None = Field(
        None,
        ge=0,
        description="engine restarts allowed in the whole run; null: 3 where the launcher and transport "
        "can restart an engine (launched locally; transport colocated or disk-delta), else 0",
    )
    options: dict[str, Any] = Field(default_factory=dict)


class CriticSection(Section):
    """The value model of PPO; it trains on the same backend as the policy."""

    model: str | None = Field(
        None, description="initial critic weights (default: model.path), value head new"
    )
    lr: float = Field(1e-5, gt=0)
    loss: str = Field("value_clip", description="value loss name or import path")
    loss_options: dict[str, Any] = Field(default_factory=dict)


class AlgorithmSection(Section):
    advantage: str = "grpo"
    advantage_options: dict[str, Any] = Field(default_factory=dict)
    loss: str | None = Field(
        None,
        description="loss name or import path; default: the advantage estimator's own (ppo_clip, gspo, sft)",
    )
    loss_options: dict[str, Any] = Field(default_factory=dict)
    correction: str | None = Field("tis", description="train/rollout mismatch correction, or null")
    correction_options: dict[str, Any] = Field(default_factory=dict)
    ref_model: str | None = Field(
        None, description="frozen reference policy for KL penalties (default: the initial policy, model.path)"
    )
    critic: CriticSection | None = Field(
        None, description="critic settings (estimators that need values: ppo)"
    )


class TeacherSection(Section):
    """One served teacher: a running engine to attach to, or a model this run serves itself."""

    url: str | None = Field(None, description="base URL of a running SGLang or embedded engine")
    model: str | None = Field(
        None, description="launch an embedded engine for this model (path or builtin:NAME)"
    )

    @model_validator(mode="after")
    def _one_of(self) -> TeacherSection:
        if (self.url is None) == (self.model is None):
            raise ValueError("a teacher needs exactly one of url (attach) or model (launch)")
        return self


class DistillationSection(Section):
    """On-policy distillation: a teacher's per-token reverse-KL estimate is folded into the advantages."""

    teacher: Literal["served", "trainer"] = Field(
        "served", description="served: engines score each finished trajectory; trainer: an in-process model"
    )
    coef: float = Field(1.0, ge=0, description="scale of the reverse-KL term subtracted from advantages")
    task_reward: Literal["keep", "zero"] = Field(
        "keep", description="zero: train on the teacher signal alone (the task reward is still logged)"
    )
    teachers: dict[str, TeacherSection] = Field(
        default_factory=dict,
        description="served teachers by name; a prompt picks one by metadata[route_key], else 'default'",
    )
    route_key: str = Field("teacher", description="prompt metadata key naming the served teacher")
    model: str | None = Field(None, description="the in-process teacher's checkpoint (teacher: trainer)")
    top_k: int = Field(0, ge=0, description="0: sampled-token estimate; K > 0: weighted over a top-K set")
    top_k_candidates: Literal["student", "intersection"] = Field(
        "student",
        description="the candidate set: the student's top K, or its intersection with the teacher's",
    )

    @model_validator(mode="after")
    def _consistent(self) -> DistillationSection:
        if self.teacher == "served":
            if not self.teachers:
                raise ValueError(
                    "distillation.teacher 'served' needs at least one entry in distillation.teachers"
                )
            if self.model is not None:
                raise ValueError(
                    "distillation.model is the in-process teacher; with teacher 'served' use teachers"
                )
        else:
            if self.model is None:
                raise ValueError(
                    "distillation.teacher 'trainer' needs distillation.model (the teacher checkpoint)"
                )
            if self.teachers:
                raise ValueError(
                    "distillation.teachers are served teachers; with teacher 'trainer' use model"
                )
            if self.top_k:
                raise ValueError("distillation.top_k needs served teachers (teacher: served)")
        return self


class SFTSection(Section):
    """Supervised fine-tuning (``mode: sft``): chat data, loss on assistant tokens only."""

    batch_size: int = Field(32, ge=1, description="conversations per training step")
    max_length: int = Field(2048, ge=2, description="conversations longer than this (tokens) are truncated")


class TrainSection(Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup to lr")
    steps_per_rollout: int = Field(
        1,
        ge=1,
        description="optimizer steps per step's batch: the batch is split into this many mini-batches, "
        "after one scoring pass for the PPO old log-probs (1: one step, old = current, no extra pass)",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning-rate decay after warmup (transformers' schedules)"
    )
    lr_decay_steps: int | None = Field(
        None,
        ge=1,
        description="optimizer steps the decay spans (None: the whole run, num_steps x steps_per_rollout)",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, lt=1.0, description="cosine only: the floor the decay ends at, as a fraction of lr"
    )
    use_rollout_routing_replay: bool = Field(
        False,
        description="MoE (R3): the trainer's MoE layers route every token to the experts the engine routed "
        "it to at rollout (prompt and response, recorded per sample) instead of recomputing their top-k, "
        "so training routes as the rollout did; gradients still reach the router through the routing "
        "weights. Records routing (rollout.record_routed_experts); refused for a dense model or a backend "
        "that cannot replay (docs/training.md)",
    )

    @model_validator(mode="after")
    def _schedule_options(self) -> TrainSection:
        if self.min_lr_ratio and self.lr_schedule != "cosine":
            raise ValueError(
                f"train.min_lr_ratio sets the floor of the cosine schedule; lr_schedule is {self.lr_schedule!r}"
            )
        if self.lr_decay_steps is not None and self.lr_schedule == "constant":
            raise ValueError("train.lr_decay_steps needs a decaying lr_schedule (linear or cosine)")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(
                f"train.lr_decay_steps ({self.lr_decay_steps}) counts the warmup too; it must exceed "
                f"train.warmup_steps ({self.warmup_steps})"
            )
        return self


_ADAPTER_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
# Multi-LoRA: the key of ``Sample.metadata`` that names the adapter a sample was generated with and
# trains (set by the driver's adapter rollout; read by backends that train several adapters).
ADAPTER_KEY = "lora_adapter"


class LoraShape(Section):
    """An adapter's shape: rank, scale, dropout and the modules it adapts."""

    rank: int = Field(16, description="LoRA rank r (> 0)")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="linear modules to adapt: names or name suffixes (e.g. q_proj, mlp.down_proj)",
    )

    @field_validator("rank")
    @classmethod
    def _positive_rank(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"lora.rank must be > 0, got {v}")
        return v


class LoraAdapter(LoraShape):
    """One adapter of a multi-LoRA run: its shape and what it trains on (defaults: the run's own)."""

    lr: float | None = Field(None, gt=0, description="its learning rate (default: train.lr)")
    data: DataSection | None = Field(None, description="its prompts (default: the run's data section)")
    reward: str | None = Field(None, description="its reward name or import path (default: rollout.reward)")
    reward_options: dict[str, Any] | None = Field(
        None, description="its reward's options (default: rollout.reward_options)"
    )
    prompts_per_step: int | None = Field(
        None, ge=1, description="its prompts in each step's batch (default: rollout.prompts_per_step)"
    )
    num_steps: int | None = Field(
        None,
        ge=0,
        description="it trains on steps 0..num_steps-1, then stays as it is (default: run.num_steps)",
    )


class LoraSection(LoraShape):
    """Train a LoRA adapter instead of every parameter (``peft``); the base stays frozen and resident.

    ``adapters`` trains several at once against the one base (multi-LoRA): each names its own
    shape, data, reward, learning rate and step count, and the top-level shape fields are unused.
    """

    name: str = Field(
        "default",
        pattern=_ADAPTER_NAME,
        description="the adapter's name: engines serve it under this name (SGLang's lora_path)",
    )
    adapters: dict[str, LoraAdapter] | None = Field(
        None,
        description="multi-LoRA: several adapters by name, each with its own data, reward, lr and steps",
    )

    @model_validator(mode="after")
    def _one_form(self) -> LoraSection:
        if self.adapters is None:
            return self
        if not self.adapters:
            raise ValueError("lora.adapters is empty; name at least one adapter (or use the single form)")
        # A dumped config carries every field: only values other than the defaults are a mistake.
        defaults = LoraSection()
        shared = sorted(
            k for k in ("name", *LoraShape.model_fields) if getattr(self, k) != getattr(defaults, k)
        )
        if shared:
            raise ValueError(
                f"lora.adapters is set, so lora.{shared[0]} has no effect; give each adapter its own "
                f"{', '.join(shared)} under lora.adapters.<name>"
            )
        import re

        bad = [n for n in self.adapters if not re.fullmatch(r"[A-Za-z0-9_-]+", n)]
        if bad:
            raise ValueError(f"lora.adapters: names {bad} must be letters, digits, _ or - (no dots)")
        # peft finds an adapter's tensors by name; one inside "lora_" would be mistaken for others.
        clash = [n for n in self.adapters if n in "lora_"]
        if clash:
            raise ValueError(
                f"lora.adapters: names {clash} are part of 'lora_' (peft's prefix); choose others"
            )
        return self

    @property
    def multi(self) -> bool:
        """Several adapters (``adapters``), rather than the single-adapter form."""
        return self.adapters is not None

    def named(self) -> dict[str, LoraShape]:
        """Every adapter the run trains, by its name on the engines (the single form: one)."""
        if self.adapters is not None:
            return dict(self.adapters)
        return {self.name: LoraShape.model_validate(self.model_dump(include=set(LoraShape.model_fields)))}


class WeightSyncSection(Section):
    bucket_mb: int = Field(512, ge=1, description="weights are sent in buckets of at most this size")
    check_equal: bool = Field(
        False,
        description="after the first update, compare every engine tensor with the trainer's (engines are "
        "randomised first, so a missed tensor is caught)",
    )
    check_mode: Literal["exact", "rounded"] = Field(
        "exact", description="exact: bit-exact; rounded: the trainer tensor cast to the engine's dtype first"
    )
    check_skip: list[str] = Field(default_factory=list, description="tensor names the check leaves out")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the transport's own options (e.g. disk-delta: delta_dir, encoding, keep; broadcast: backend)",
    )


class PlacementSection(Section):
    """Where the trainer and the engines run, and who starts their processes."""

    mode: Literal["colocated", "disaggregated"] | None = Field(
        None,
        description="colocated: trainer and engines share devices (the trainer is offloaded while engines "
        "generate); disaggregated: separate pools. None: colocated iff transport is 'colocated'",
    )
    offload_trainer: bool = Field(
        True,
        description="colocated: move the trainer's weights, gradients and optimizer state to host memory while "
        "the engines generate; false keeps them on the devices (when they fit beside the engines' KV cache, "
        "e.g. a small model on one large GPU), saving the two copies a step",
    )
    launcher: Literal["local", "ray"] = Field(
        "local", description="local: processes on this machine; ray: actors in Ray placement groups"
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to attach to ('auto', 'HOST:PORT'); None with launcher ray starts a private "
        "local cluster on 127.0.0.1 for this run",
    )
    trainer_bundle: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources per trainer rank (default: {GPU: 1} on cuda, else {CPU: 1})",
    )
    engine_bundle: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources per engine (default: {GPU: 1} on cuda, else {CPU: 1})",
    )

    # Unset: the transport's own placement (miles.capabilities.resolved_placement).


class FullyAsyncSection(Section):
    """The fully asynchronous schedule (``schedule: fully_async``): engines never wait for the trainer."""

    max_inflight: int | None = Field(
        None,
        ge=1,
        description="trajectories generating at once (default: 2 x prompts_per_step x n_samples_per_prompt)",
    )
    replacement: Literal["sample", "group"] = Field(
        "sample",
        description="sample: each finished trajectory frees its slot, a new group starts once a group's worth "
        "is free; group: a group's slots free only when all of it finished",
    )
    buffer_capacity: float = Field(
        2.0, gt=0, description="buffer capacity as a multiple of the training batch (prompts_per_step groups)"
    )
    max_staleness: int | None = Field(
        2,
        ge=0,
        description="drop a group on its way to the trainer when current version - its oldest token's "
        "version exceeds this (None: never)",
    )
    aborted: Literal["retry", "discard"] = Field(
        "retry", description="a group generation gave up on: its prompt goes back to the data source, or not"
    )
    stale: Literal["retry", "discard"] = Field(
        "retry", description="a group dropped for staleness: its prompt goes back to the data source, or not"
    )
    update_every: int = Field(1, ge=1, description="push new weights to the engines every N training steps")
    update_mode: Literal["retract", "in_place", "abort"] = Field(
        "retract",
        description="in-flight requests during a weight update: retract (re-prefilled under the new weights, "
        "then continue), in_place (paused with their cache, continue), abort (answered as aborted)",
    )
    take_timeout_s: float = Field(
        600.0, gt=0, description="fail the step if the buffer yields no group for this long"
    )


class EvalSection(Section):
    """Evaluation of the policy every ``every`` steps, on a held-out prompt set."""

    data: DataSection
    every: int = Field(5, ge=1, description="evaluate the weights of every Nth step (and the last)")
    mode: Literal["shared", "dedicated", "external"] = Field(
        "shared",
        description="shared: the rollout engines (production pauses); dedicated: an eval fleet loaded from a "
        "snapshot; external: a backend plugin handed a checkpoint directory",
    )
    max_prompts: int | None = Field(None, ge=1, description="evaluate on the first N prompts only")
    n_samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int | None = Field(None, ge=1, description="default: rollout.max_new_tokens")
    temperature: float = Field(1.0, gt=0.0)
    reward: str | None = Field(None, description="reward name or import path (default: rollout.reward)")
    reward_options: dict[str, Any] = Field(default_factory=dict)
    max_outstanding: int = Field(
        2, ge=1, description="snapshot evaluations running at once; more are skipped, never queued"
    )
    num_engines: int = Field(1, ge=1, description="dedicated fleet size (mode dedicated)")
    engine_options: dict[str, Any] = Field(
        default_factory=dict,
        description="options for the dedicated fleet's engines (device, max_batch_size...)",
    )
    backend: str | None = Field(None, description="eval backend name or import path (mode external)")
    backend_options: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float = Field(1800.0, gt=0, description="an evaluation running longer is skipped")

    @model_validator(mode="after")
    def _backend_for_external(self) -> EvalSection:
        if self.mode == "external" and self.backend is None:
            raise ValueError("eval.mode 'external' needs eval.backend (an eval backend name or import path)")
        if self.mode != "external" and self.backend is not None:
            raise ValueError(f"eval.backend is used by mode 'external' only; eval.mode is {self.mode!r}")
        return self


class TrackingSection(Section):
    jsonl: bool = True
    tensorboard: bool = True
    console: bool = True
    log_samples: int = Field(1, ge=0, description="example completions printed per step")
    backends: list[str] = Field(
        default_factory=list,
        description="more trackers, by name (a miles.trackers entry point: wandb, mlflow, prometheus) "
        "or import path; they receive the same metrics at the same steps as the switches above",
    )
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="each tracker's options, by tracker name (checked against its model)",
    )
    plot: bool | None = Field(
        None,
        description="draw reward_curve.png in the run directory when the run ends: true (matplotlib "
        "required, checked before the run starts), false (off), null (when matplotlib is installed)",
    )


class WarmStartSection(Section):
    """A supervised stage before RL, inside the same run (a cold start): RL starts from its final policy.

    The stage is a recipe of its own (``mode: sft``) run to completion in ``RUN/warm_start/``
    from this recipe's ``model.path``; a resumed run skips it once it has completed.
    """

    recipe: str = Field(..., description="the SFT recipe to run first (a recipe name or a YAML file)")
    overrides: list[str] = Field(
        default_factory=list,
        description="--set overrides for that recipe (KEY=VALUE), e.g. run.num_steps=150",
    )


class EvidenceSection(Section):
    """How much evidence stands behind this exact recipe (the report's levels); ``miles run`` prints it.

    ``fully gated``: a complete training curve, plus a deterministic end-to-end test comparing every
    registered metric bit for bit against a committed standard; ``proxy gated``: the same on a
    documented scaled-down proxy of the recipe; ``verified``: a complete curve, no such test;
    ``not verified``: none of these. The level applies to the recipe as shipped: overrides void it.
    """

    level: Literal["fully gated", "proxy gated", "verified", "not verified"]
    detail: str = Field("", description="what the evidence is (the test, the curve) and where it is recorded")


class MilesConfig(Section):
    """A whole recipe. Plugin sections are added to a subclass built at start-up."""

    recipe: str = Field("", description="set by the loader: where this config came from")
    mode: Literal["rl", "sft"] = Field("rl", description="rl: rollouts and rewards; sft: no engines")
    backend: str = Field("fsdp", description="training backend name or import path")
    transport: str = Field("broadcast", description="weight transport name or import path")
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection
    data: DataSection
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    train: TrainSection = Field(default_factory=TrainSection)
    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    lora: LoraSection | None = Field(
        None, description="train a LoRA adapter (peft) instead of every parameter"
    )
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    distillation: DistillationSection | None = None
    sft: SFTSection = Field(default_factory=SFTSection)
    schedule: Literal["sync", "fully_async"] = Field(
        "sync",
        description="sync: generate, then train, in turns; fully_async: engines keep generating while the "
        "trainer trains (needs a disaggregated placement)",
    )
    fully_async: FullyAsyncSection = Field(default_factory=FullyAsyncSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    eval: EvalSection | None = None
    warm_start: WarmStartSection | None = Field(
        None, description="a supervised stage (an SFT recipe) run before RL in the same run directory"
    )
    evidence: EvidenceSection | None = Field(
        None, description="the recipe's evidence level (fully gated, proxy gated, verified, not verified)"
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> MilesConfig:
        r = self.rollout
        per_step = self.sft.batch_size if self.mode == "sft" else r.prompts_per_step * r.n_samples_per_prompt
        if self.train.steps_per_rollout > per_step:
            raise ValueError(
                f"train.steps_per_rollout ({self.train.steps_per_rollout}) splits a step's batch into "
                f"mini-batches, but a step has only {per_step} samples"
            )
        if self.mode == "sft":
            if self.algorithm.correction is not None and "correction" in self.algorithm.model_fields_set:
                raise ValueError(
                    "algorithm.correction corrects rollout/trainer mismatch; mode 'sft' has no rollouts, "
                    "set algorithm.correction: null"
                )
            if self.distillation is not None:
                raise ValueError("distillation needs rollouts (the student's own samples); use mode: rl")
            if self.schedule != "sync":
                raise ValueError("schedule 'fully_async' needs rollouts; mode 'sft' trains synchronously")
            if self.eval is not None:
                raise ValueError("eval scores rollouts on engines; mode 'sft' starts none (remove eval)")
            if self.warm_start is not None:
                raise ValueError(
                    "warm_start runs an SFT stage before RL; an SFT recipe needs none (remove it)"
                )
            if self.train.use_rollout_routing_replay or self.rollout.record_routed_experts:
                which = (
                    "train.use_rollout_routing_replay"
                    if self.train.use_rollout_routing_replay
                    else "rollout.record_routed_experts"
                )
                raise ValueError(
                    f"{which} works on MoE routing the engines record at rollout; mode 'sft' has no "
                    "rollouts (turn it off)"
                )
            return self
        if self.schedule == "fully_async":
            # A fully asynchronous schedule on shared devices is refused with the transport's placement
            # in view (miles.capabilities.check_needs).
            fa = self.fully_async
            if fa.max_inflight is not None and fa.max_inflight < self.rollout.n_samples_per_prompt:
                raise ValueError(
                    f"fully_async.max_inflight ({fa.max_inflight}) must be at least rollout.n_samples_per_prompt "
                    f"({self.rollout.n_samples_per_prompt}): a group is started whole"
                )
            if self.rollout.max_rounds != 1 and "max_rounds" in self.rollout.model_fields_set:
                raise ValueError(
                    "rollout.max_rounds refills a synchronous step; under schedule 'fully_async' the worker "
                    "replaces dropped groups continuously, so leave max_rounds unset"
                )
        # What the named components need from each other (transport, engine kind, generate function,
        # filters) is checked once they are loaded: miles.capabilities.check_needs.
        if self.engine.urls and len(self.engine.urls) != self.engine.num_engines:
            raise ValueError(
                f"engine.urls lists {len(self.engine.urls)} engines but engine.num_engines is "
                f"{self.engine.num_engines}; make them agree"
            )
        self._check_engine_restarts()
        return self

    def _check_engine_restarts(self) -> None:
        eng = self.engine
        if not eng.max_restarts:
            return
        if eng.health_check_interval_s == 0:
            raise ValueError(
                "engine.max_restarts needs health checks to find a dead engine; set "
                "engine.health_check_interval_s > 0 or engine.max_restarts: 0"
            )
        # Whether these engines can be restarted at all (attached ones, Ray-placed ones, a backend or
        # transport that cannot rejoin them) is decided with the components loaded, in the run's
        # pre-flight: miles.driver.fleet.settings_from.

    @property
    def run_dir(self) -> str:
        import os

        return os.path.join(self.run.output_dir, self.run.name)
