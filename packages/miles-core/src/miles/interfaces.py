"""The small typed contracts a component implements.

Each subsystem of the loop is one Protocol here; built-in components and
third-party plugins implement the same ones and are selected by name (an entry
point in the matching ``miles.<kind>`` group) or by import path (``pkg.mod:attr``).
Torch appears only in annotations, so importing this module stays cheap.

Data flow (DESIGN.md §4)::

    DataSource -> RolloutFn -> GenerateFn [-> a plugin's RolloutService] -> Router -> EngineClient -> engines
         ^            | groups
         | retry      v
         +------- Buffer (put / take / metrics)
                      | batch
                      v
    AdvantageEstimator -> Loss (+ Correction) -> Backend.train_step -> Transport -> engines
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles.types import GenerateOutput, Group, Prompt, Sample, SamplingParams, TrainBatch

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------- data


@runtime_checkable
class DataSource(Protocol):
    """Hands out prompts in a deterministic, resumable order."""

    def next_prompts(self, n: int) -> list[Prompt]: ...

    def put_back(self, prompts: Iterable[Prompt]) -> None:
        """Return prompts whose groups were dropped for retry; they are handed out again first."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __len__(self) -> int: ...


#: The sample kind of supervised data the core turns into samples itself: chat conversations,
#: tokenized with the policy's tokenizer (loss on the assistant's tokens).
TOKEN_SAMPLES = "tokens"


@runtime_checkable
class SupervisedSampleSource(Protocol):
    """A data source for ``mode: sft`` whose items are not chat conversations.

    It hands out prompts in its resumable order like any :class:`DataSource` and turns each into
    the training sample itself: the sample's ``payload`` is a typed record of the source's
    ``sample_kind`` (e.g. an image with its conditioning), its token fields stay empty, and the
    core loads no tokenizer for it. A backend trains a kind when it lists it in its class
    attribute ``supervised_kinds`` (a backend without one trains :data:`TOKEN_SAMPLES` only); a
    recipe pairing a source and a backend of different kinds is refused before anything starts.
    """

    sample_kind: str

    def supervised_sample(self, prompt: Prompt) -> Sample: ...


# ------------------------------------------------------------------------ rollout


@runtime_checkable
class EngineClient(Protocol):
    """Talks to one rollout engine; an engine kind builds it (``EngineLauncher.client(url)``).

    The built-in kinds' client speaks SGLang's native HTTP API (``miles.engines.client.SGLangClient``);
    another kind brings its own, and every path that talks to engines uses it (rollout,
    evaluation, served teachers, the session server). Beyond the methods below, paths use these
    when the client has them: ``aclose()`` (close what it holds open), ``get_server_info()``
    (``dp_size``: data-parallel ranks; one without it has one), ``tokenize(text)`` (the ids the
    engine tokenizes a text into: a served teacher's tokenizer check needs it) and
    ``update_weights_from_disk(path, weight_version=...)`` (a dedicated eval fleet, a restarted
    engine's catch-up).
    """

    url: str

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_routed_experts: bool = False,
        data_parallel_rank: int | None = None,
    ) -> GenerateOutput: ...

    async def health(self) -> bool: ...

    async def weight_version(self) -> int: ...

    async def pause_generation(self) -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def abort_request(self, rid: str) -> None: ...

    async def score(
        self,
        input_ids: list[int],
        *,
        start: int,
        temperature: float = 1.0,
        top_k: int = 0,
        token_ids: list[int] | list[list[int]] | None = None,
    ) -> Any:
        """Log-probs of ``input_ids[start:]`` without generating (a ``ScoreOutput``; teachers, top-K)."""
        ...


@dataclass
class RolloutContext:
    """What a rollout/generate function may use. Built by the driver once per run."""

    engines: list[EngineClient]
    tokenizer: Any  # a transformers tokenizer (owns the chat template)
    sampling: SamplingParams
    n_samples_per_prompt: int
    reward: RewardFn
    step: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # the recipe's rollout.options
    # Called once per finished trajectory (drives the per-rollout progress bar).
    on_sample_done: Callable[[Sample], None] | None = None
    # Called as soon as a trajectory's generation ends, before scoring (frees its slot in the
    # fully asynchronous worker). Rollout functions that cannot tell may not call it.
    on_generation_done: Callable[[Sample], None] | None = None
    # The weight version the engines serve, as the driver last set it (a floor for per-token versions
    # when the engine reports only one version per request).
    served_version: int | None = None
    # Run on every finished, non-aborted trajectory before its reward (a served teacher's scoring).
    scorers: list[SampleScorer] = field(default_factory=list)
    # Applied in order to each reward once it is known (e.g. an overlong penalty).
    reward_postprocess: list[RewardPostprocessor] = field(default_factory=list)
    # What the run's rollout services (``miles_rollout_services``) provide, by service name: a
    # plugin's generate functions find there what its service started for the run (a server an
    # agent talks to, resolved settings, ...). Empty when no plugin contributes a service.
    services: dict[str, Any] = field(default_factory=dict)

    # Ask the engines for MoE routing (``return_routed_experts``) and keep it on the samples, prompt and
    # response (``Sample.prompt_routed_experts`` / ``routed_experts``): set when the run records routing
    # (miles.routing.records_routing). A generate function that does so declares ``records_routing``.
    return_routed_experts: bool = False

    # Routes requests over ``engines`` (miles.engines.router.Router): by session key for multi-turn
    # work, by load otherwise. Built from ``engines`` (and ``dp_sizes``) when not given.
    router: Any = None
    dp_sizes: list[int] | None = None  # data-parallel ranks per engine (None: one each)

    def __post_init__(self) -> None:
        if self.router is None and self.engines:
            from miles.engines.router import Router

            self.router = Router(self.engines, dp_sizes=self.dp_sizes)

    def engine_for(self, key: int) -> EngineClient:
        return self.engines[key % len(self.engines)]


@runtime_checkable
class GenerateFn(Protocol):
    """Runs one trajectory for one sample (fills response tokens, logprobs, mask, versions, status)."""

    def __call__(self, ctx: RolloutContext, sample: Sample) -> Awaitable[Sample]: ...


@runtime_checkable
class RolloutFn(Protocol):
    """Produces the trajectory groups of one rollout from a batch of prompts."""

    def __call__(self, ctx: RolloutContext, prompts: list[Prompt]) -> Awaitable[list[Group]]: ...


@dataclass
class ServiceSetup:
    """What a rollout service gets when the driver starts it: the engines are up, nothing has run."""

    config: Any  # the run's MilesConfig (plugin sections included)
    engine_urls: list[str]
    tokenizer: Any  # the policy's tokenizer
    sampling: SamplingParams  # the recipe's sampling defaults
    dp_sizes: list[int] | None = None  # data-parallel ranks per engine (None: one each)


@runtime_checkable
class RolloutService(Protocol):
    """Something generate functions use that lives as long as the run (a plugin contributes it
    through ``miles_rollout_services``; the core starts it without knowing what it is).

    It is built while the run's components are resolved, before any engine starts, so a bad
    setting fails early. ``start`` is entered once the engines are up and left when the run
    ends; what it yields is ``RolloutContext.services[name]`` for the training rollout and for
    a shared-engine evaluation.
    """

    name: str

    def start(self, setup: ServiceSetup) -> AbstractContextManager[Any]: ...


# A reward scores one finished sample (sync or async); rewards are plain callables.
RewardFn = Callable[[Sample], "float | Awaitable[float]"]

# A group reward sees every finished sample of a group at once (judges that compare, diversity
# bonuses). It is marked by a true ``group_reward`` attribute and returns one reward per sample.
GroupRewardFn = Callable[[list[Sample]], "list[float] | Awaitable[list[float]]"]

# A reward post-processor reshapes one finished sample's reward (e.g. an overlong penalty).
RewardPostprocessor = Callable[[Sample, float], float]

# A sample scorer adds per-token signals to a finished trajectory (``sample.token_scores``).
SampleScorer = Callable[["RolloutContext", Sample], Awaitable[None]]

# A group filter keeps (True) or drops (False) a finished group before it enters the buffer.
GroupFilter = Callable[[Group], bool]


# ------------------------------------------------------------------------- buffer


# Why a group leaves the buffer untrained (the report's three reasons; filters add their name).
DROP_ABORTED = "aborted"  # generation gave up on it: checked on arrival, retried or discarded
DROP_STALE = "stale"  # its oldest token is too many versions old: checked on the way out
DROP_FILTER_PREFIX = "filter:"  # a group filter rejected it: checked on arrival, always discarded


@dataclass
class BufferPolicy:
    """What the driver tells a buffer when it builds it: capacity and the drop rules.

    ``recycle`` returns a dropped group's prompt to the data source (a retried prompt
    is generated again later, never lost); ``on_drop`` reports every drop (the
    ``miles_on_group_dropped`` hook). Both may be called from any thread.
    """

    capacity: int | None = None  # groups; put blocks while the buffer holds this many (None: unbounded)
    filters: list[tuple[str, GroupFilter]] = field(default_factory=list)
    # After the filters: a plugin's verdict (``miles_buffer_reject``), a reason or None to keep.
    reject: Callable[[Group], str | None] | None = None
    max_staleness: int | None = None  # None: never drop for staleness
    retry_aborted: bool = True
    retry_stale: bool = True
    recycle: Callable[[Prompt], None] | None = None
    on_drop: Callable[[Group, str], None] | None = None


@runtime_checkable
class Buffer(Protocol):
    """Between generation and training; built as ``Buffer(policy, **options)``. Three operations only.

    - ``put`` drops aborted and filter-rejected groups on arrival, else stores the group,
      blocking while the buffer is full.
    - ``take`` hands out up to ``n_groups`` groups whose staleness (``weight_version`` minus
      the oldest version of any of their tokens) is within the limit, dropping the stale
      ones it meets; it waits up to ``timeout_s`` for enough groups (``None``: no wait).
    - ``metrics`` reports the buffer's state (names without a prefix; the driver adds it).
    """

    def put(self, group: Group) -> None: ...

    def take(self, n_groups: int, weight_version: int, timeout_s: float | None = None) -> list[Group]: ...

    def metrics(self) -> dict[str, float]: ...


# ---------------------------------------------------------------------- objective


# Names of the per-token signals the trainer's scoring pass computes before advantages
# (``Backend.score``); estimators and losses list the ones they read in ``requires``.
REF_LOGPROBS = "ref_logprobs"  # the frozen reference policy (KL penalties)
VALUES = "values"  # the critic's value predictions (PPO)
TEACHER_LOGPROBS = "teacher_logprobs"  # an in-process teacher (on-policy distillation)
SCORE_NAMES = (REF_LOGPROBS, VALUES, TEACHER_LOGPROBS)
# Recorded at rollout time by a served teacher's top-K estimate; not a trainer score.
OPD_REVERSE_KL = "opd_reverse_kl"


@dataclass
class AdvantageOutput:
    """Per sample (in group order), per response token. ``returns`` are the critic's targets.

    A sample without tokens (a plugin's ``Sample.payload``) gets the row its estimator and backend
    agree on (e.g. one entry: the advantage of a whole generated trajectory)."""

    advantages: list[list[float]]
    returns: list[list[float]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns rewarded groups into per-token advantages (one row per sample, one value per response token).

    Optional class attributes: ``requires`` (a set of ``SCORE_NAMES`` read from
    ``sample.token_scores``; the driver has the backend compute them first) and
    ``default_loss`` (the loss used when the recipe leaves ``algorithm.loss`` unset).
    Observation tokens (``loss_mask == 0``) must get advantage 0.
    """

    def __call__(self, groups: list[Group]) -> AdvantageOutput: ...


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all shaped [batch, response_len] and right-padded.

    Which fields are set depends on the loss's ``kind``: ``policy`` losses get the
    log-prob family and advantages (plus ``entropy`` / ``ref_logprobs`` when they list
    them in ``requires``), ``supervised`` losses get ``logprobs``, and ``value`` losses
    get the critic's ``values``, ``old_values`` and ``returns``. A loss checks what it reads.

    Reduction: ``num_loss_tokens`` and ``num_samples`` count the whole global batch (all
    ranks, all micro-batches), so a loss that divides its masked sum by one of them adds up
    across micro-batches to the token mean (or the per-sample mean) of the global batch.
    Each row of a micro-batch is one whole sample.
    """

    loss_mask: torch.Tensor  # float, 1 where the token is trained on
    logprobs: torch.Tensor | None = None  # current policy, carries the gradient
    old_logprobs: torch.Tensor | None = None  # policy at the start of this step (no grad)
    rollout_logprobs: torch.Tensor | None = None  # what the engine reported when sampling
    advantages: torch.Tensor | None = None
    correction_weights: torch.Tensor | None = None  # from a Correction, per token
    entropy: torch.Tensor | None = None  # policy entropy per position, carries the gradient
    ref_logprobs: torch.Tensor | None = None  # frozen reference policy (no grad)
    values: torch.Tensor | None = None  # critic predictions, carry the gradient
    old_values: torch.Tensor | None = None  # critic predictions from the scoring pass (no grad)
    returns: torch.Tensor | None = None  # value targets
    num_loss_tokens: int = 1
    num_samples: int = 1

    def need(self, *names: str, who: str) -> None:
        """Raise a clear error when a field this loss reads was not provided."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{who}: LossInputs is missing {', '.join(missing)}")


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, already divided for token-mean over the global batch
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Loss(Protocol):
    """One protocol for every objective term; ``kind`` says which inputs it gets.

    Class attributes: ``kind`` (``"policy"`` by default, ``"value"`` for a critic's loss,
    ``"supervised"`` for SFT) and ``requires`` (extra inputs: ``"entropy"``,
    ``"ref_logprobs"``). A user loss plugs in by name or import path; the
    ``miles_loss_postprocess`` hook may still replace its output.
    """

    def __call__(self, inputs: LossInputs) -> LossOutput: ...


@dataclass
class CorrectionOutput:
    weights: torch.Tensor  # per-token multiplier on the policy-gradient loss
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Correction(Protocol):
    """Corrects train/rollout mismatch from the ratio r = exp(old_logprobs - rollout_logprobs)."""

    def __call__(
        self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
    ) -> CorrectionOutput: ...


# ------------------------------------------------------------- backend, transport


@dataclass
class TransportStats:
    bytes_sent: int
    seconds: float
    buckets: int
    version: int
    # Transport-specific figures, logged under weight_sync/ (e.g. disk-delta's changed-byte density).
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Transport(Protocol):
    """Moves trainer weights (Hugging Face names and layout) into the engines.

    Lives in the trainer's rank processes: every rank calls ``send`` with the same
    ordered stream of full tensors; rank 0 is the one that talks to engines.
    """

    def connect(self, engine_urls: list[str], *, rank: int, world_size: int, device: str) -> None: ...

    def send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> TransportStats: ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Owns the policy model and optimizer; driven from the driver process.

    In ``mode: sft`` it trains the sample kinds its class attribute ``supervised_kinds`` lists
    (a ``frozenset[str]``; absent: :data:`TOKEN_SAMPLES` only; see :class:`SupervisedSampleSource`).
    """

    def setup(self, spec: BackendSpec) -> None: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...

    def score(self, samples: list[Sample], names: list[str]) -> dict[str, list[list[float]]]:
        """Per-token signals for ``samples`` before advantages (``SCORE_NAMES``), one row per sample."""
        ...

    def update_weights(self, version: int) -> TransportStats: ...

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> None: ...

    def export_hf(self, directory: str) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class BackendSpec:
    """Everything a backend needs to build its ranks; plain data so it crosses process boundaries."""

    model_path: str
    loss: str  # name or import path, resolved inside the rank processes
    correction: str | None
    transport: str
    engine_urls: list[str]
    temperature: float
    options: dict[str, Any]  # the recipe's backend section, validated by the backend's own config model
    loss_options: dict[str, Any] = field(default_factory=dict)
    correction_options: dict[str, Any] = field(default_factory=dict)
    transport_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # What the scoring pass must be able to compute (``SCORE_NAMES``), and the models behind it.
    scores: list[str] = field(default_factory=list)
    ref_model_path: str | None = None
    teacher_model_path: str | None = None
    critic: CriticSpec | None = None
    # Where the ranks run: {"launcher": "local" | "ray", "ray_address": ..., "bundle": {...}} (placement section).
    placement: dict[str, Any] = field(default_factory=lambda: {"launcher": "local"})
    # The run's validated config as JSON data (``model_dump(mode="json")``): each rank process
    # rebuilds it and fires ``miles_configure`` with it, so plugins there see the recipe's
    # values. None when a backend is driven without a run config (nothing is configured).
    config: dict[str, Any] | None = None


@dataclass
class CriticSpec:
    """The value model PPO trains next to the policy, on the same backend."""

    model_path: str
    loss: str = "value_clip"
    loss_options: dict[str, Any] = field(default_factory=dict)
    lr: float = 1e-5


# ------------------------------------------------------------------------ engines


@dataclass
class EngineSpec:
    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free port
    options: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EngineLauncher(Protocol):
    """An engine kind: starts (or attaches to) rollout engines, and talks to them.

    ``client(url)`` builds the kind's ``EngineClient`` (the built-in kinds speak SGLang's
    native API; another kind brings its own client). The class may declare what the kind
    can do as ``capabilities = miles.capabilities.EngineCapabilities(...)``.
    """

    def launch(self, specs: list[EngineSpec], log_dir: str) -> list[str]: ...

    def client(self, url: str) -> EngineClient: ...

    def shutdown(self) -> None: ...


# ------------------------------------------------------------------------ evaluation


@dataclass
class EvalRequest:
    """One evaluation handed to an external backend: a Hugging Face checkpoint of one weight version."""

    checkpoint_dir: str  # read-only for the backend; Miles deletes it once the evaluation ends
    step: int  # the training step whose weights these are
    weight_version: int
    options: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EvalBackend(Protocol):
    """Scores a checkpoint directory (mode ``external``); runs off the training thread.

    Returns metrics by name (e.g. ``{"score": 0.41}``). Raising marks the evaluation
    skipped with reason ``backend_error``; training goes on.
    """

    def evaluate(self, request: EvalRequest) -> dict[str, float]: ...
