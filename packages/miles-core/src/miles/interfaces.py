"""The small typed contracts a component implements.

Each subsystem of the loop is one Protocol here; built-in components and
third-party plugins implement the same ones and are selected by name (an entry
point in the matching ``miles.<kind>`` group) or by import path (``pkg.mod:attr``).
Torch appears only in annotations, so importing this module stays cheap.

Data flow (DESIGN.md §4)::

    DataSource -> RolloutFn -> GenerateFn -> EngineClient -> engines
         ^            | groups
         | retry      v
         +------- Buffer (put / take / metrics)
                      | batch
                      v
    AdvantageEstimator -> Loss (+ Correction) -> Backend.train_step -> Transport -> engines
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
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


# ------------------------------------------------------------------------ rollout


@runtime_checkable
class EngineClient(Protocol):
    """Talks to one rollout engine over SGLang's native HTTP API (embedded engine or real SGLang)."""

    url: str

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput: ...

    async def health(self) -> bool: ...

    async def weight_version(self) -> int: ...

    async def pause_generation(self) -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def abort_request(self, rid: str) -> None: ...


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


# A reward scores one finished sample (sync or async); rewards are plain callables.
RewardFn = Callable[[Sample], "float | Awaitable[float]"]

# A group filter keeps (True) or drops (False) a finished group before it enters the buffer.
GroupFilter = Callable[[Group], bool]


# ------------------------------------------------------------------------- buffer


@runtime_checkable
class Buffer(Protocol):
    """Between generation and training. Three operations only."""

    def put(self, group: Group) -> None: ...

    def take(self, n_groups: int) -> list[Group]: ...

    def metrics(self) -> dict[str, float]: ...


# ---------------------------------------------------------------------- objective


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns rewarded groups into per-token advantages (one row per sample, one value per response token)."""

    def __call__(self, groups: list[Group]) -> list[list[float]]: ...


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all shaped [batch, response_len] and right-padded."""

    logprobs: torch.Tensor  # current policy, carries the gradient
    old_logprobs: torch.Tensor  # policy at the start of this step (no grad)
    rollout_logprobs: torch.Tensor  # what the engine reported when sampling
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # float, 1 where the token is trained on
    correction_weights: torch.Tensor | None = None  # from a Correction, per token
    num_loss_tokens: int = 1  # loss-token count of the whole global batch, for token-mean reduction


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, already divided for token-mean over the global batch
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Loss(Protocol):
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
    """Owns the policy model and optimizer; driven from the driver process."""

    def setup(self, spec: BackendSpec) -> None: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...

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


# ------------------------------------------------------------------------ engines


@dataclass
class EngineSpec:
    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: pick a free port
    options: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class EngineLauncher(Protocol):
    """Starts (or attaches to) rollout engines and returns their base URLs."""

    def launch(self, specs: list[EngineSpec], log_dir: str) -> list[str]: ...

    def shutdown(self) -> None: ...
