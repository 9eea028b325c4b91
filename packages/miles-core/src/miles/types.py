"""The vocabulary of the loop: prompts, samples, groups and batches.

Plain dataclasses with no torch in them, so the driver, the rollout side and the
buffer can pass them around (and log them) without importing a tensor library.
Token-level fields are aligned on the *response* tokens: ``response_ids[i]`` was
sampled with log-probability ``rollout_logprobs[i]`` under weight version
``weight_versions[i]`` and is trained on iff ``loss_mask[i] == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

ChatMessage = dict[str, Any]


class Status(StrEnum):
    """How a trajectory ended."""

    PENDING = "pending"
    COMPLETED = "completed"  # the model stopped by itself (EOS / stop token)
    TRUNCATED = "truncated"  # hit the generation length limit
    ABORTED = "aborted"  # the engine gave up on it (abort, engine restart)
    FAILED = "failed"  # the environment or reward raised


class ExitReason(StrEnum):
    """Why an episode ended, finer than its :class:`Status` (``metadata["exit_reason"]``).

    Counted per step as ``rollout/exit/<reason>``. The infrastructure reasons
    (:data:`INFRA_EXIT_REASONS`) say nothing about the policy: such an episode is marked
    ABORTED, so its group is dropped (and retried) instead of being scored as reward 0.
    """

    COMPLETED = "completed"  # the agent finished by itself (the model stopped calling tools)
    TOKEN_LIMIT = "token_limit"  # a reply or the episode ran out of tokens
    TURN_LIMIT = "turn_limit"  # the episode used its model calls
    WALL_CLOCK = "wall_clock_timeout"  # the episode ran past its wall-clock limit
    FORMAT_ERROR = "format_error"  # the model's reply could not be read as the agent expects
    NO_RESPONSE = "no_response"  # the model answered nothing (no text, no tool call)
    TOOL_ERROR = "tool_error"  # tools failed past their budget (e.g. too many tool timeouts)
    AGENT_ERROR = "agent_error"  # the agent function raised (a bug in it; scored as failed)
    SANDBOX_DIED = "sandbox_died"  # infrastructure: the sandbox could not start or stopped working
    ENVIRONMENT_ERROR = "environment_error"  # infrastructure: the environment itself failed


#: Exit reasons that are the infrastructure's fault: retried or excluded, never scored.
INFRA_EXIT_REASONS: frozenset[ExitReason] = frozenset({ExitReason.SANDBOX_DIED, ExitReason.ENVIRONMENT_ERROR})


@dataclass
class Prompt:
    """One task drawn from a data source. ``index`` is stable across epochs and resumes."""

    index: int
    prompt: str | list[ChatMessage]
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One trajectory: an attempt at a prompt, with everything the trainer needs."""

    prompt: Prompt
    group_index: int = 0  # position inside its group
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_text: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    # For MoE models: per response token, per sparse layer, the expert ids of the forward pass that
    # produced it (row j: the routing at position len(prompt_ids) - 1 + j).
    routed_experts: list[list[list[int]]] | None = None
    # The same for the prompt: row i is the routing at prompt position i, for every prompt position but
    # the last (whose routing is routed_experts[0]). With routed_experts it covers every position the
    # trainer's forward reads, which routing replay needs (miles.routing).
    prompt_routed_experts: list[list[list[int]]] | None = None
    reward: float | None = None
    # Extra per-response-token signals, by name: a served teacher's ``teacher_logprobs`` or
    # ``opd_reverse_kl`` (recorded at rollout time), and what the trainer's scoring pass adds
    # before advantages (``ref_logprobs``, ``values``, in-process ``teacher_logprobs``).
    token_scores: dict[str, list[float]] = field(default_factory=dict)
    status: Status = Status.PENDING
    finish_reason: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # What a rollout whose engines produce something other than tokens attaches for the backend that
    # trains on it (e.g. a plugin's typed record of a generated trajectory). The core carries it from
    # the rollout through the buffer into ``TrainBatch.samples`` and never reads it; it is not dumped.
    payload: Any = None

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def oldest_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    def check_aligned(self) -> None:
        """Raise if the per-token fields disagree in length (a bug in a rollout function)."""
        n = len(self.response_ids)
        for name in ("rollout_logprobs", "loss_mask", "weight_versions"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(
                    f"sample of prompt {self.prompt.index}: {name} has {got} entries, response has {n}"
                )
        for name, values in self.token_scores.items():
            if len(values) != n:
                raise ValueError(
                    f"sample of prompt {self.prompt.index}: token_scores[{name!r}] has {len(values)} entries, "
                    f"response has {n}"
                )
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(
                f"sample of prompt {self.prompt.index}: routed_experts not aligned with response"
            )
        if self.prompt_routed_experts is not None:
            want = max(len(self.prompt_ids) - 1, 0)
            if len(self.prompt_routed_experts) != want:
                raise ValueError(
                    f"sample of prompt {self.prompt.index}: prompt_routed_experts has "
                    f"{len(self.prompt_routed_experts)} rows; a prompt of {len(self.prompt_ids)} tokens "
                    f"has {want} (every position but the last)"
                )


@dataclass
class Group:
    """The trajectories generated from one prompt (``n_samples_per_prompt`` of them)."""

    prompt: Prompt
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward if s.reward is not None else 0.0 for s in self.samples]

    @property
    def oldest_weight_version(self) -> int | None:
        versions = [v for s in self.samples if (v := s.oldest_weight_version) is not None]
        return min(versions) if versions else None


@dataclass
class TrainBatch:
    """What the backend trains on in one step: flattened samples plus per-token advantages."""

    samples: list[Sample]
    # Per sample, per response token (a sample that carries a ``payload`` instead of tokens: the row
    # its estimator and backend agree on, e.g. one advantage for a whole generated trajectory).
    advantages: list[list[float]]
    step: int
    # Value targets per sample, per response token: set when the estimator trains a critic (PPO).
    returns: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if len(self.samples) != len(self.advantages):
            raise ValueError("TrainBatch: one advantage row per sample is required")
        if self.returns is not None and len(self.returns) != len(self.samples):
            raise ValueError("TrainBatch: one returns row per sample is required")

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.samples)


@dataclass
class GenerateOutput:
    """What an engine returns for one ``/generate`` call (token in, token out)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # the engine's version when it answered
    text: str = ""
    routed_experts: list[list[list[int]]] | None = None  # per output token (see Sample.routed_experts)
    # Per prompt position but the last (see Sample.prompt_routed_experts); set with routed_experts.
    prompt_routed_experts: list[list[list[int]]] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache
    # The version each output token was sampled under (differs across a mid-request weight update).
    output_weight_versions: list[int] | None = None

    def token_versions(self, served_at_start: int | None = None) -> list[int]:
        """Per-token versions; without the engine's per-token field (SGLang), every token gets the
        older of the version served when the request started and the one it finished under, so a
        request that spans an update is never counted fresher than it may be."""
        if self.output_weight_versions is not None:
            return list(self.output_weight_versions)
        version = (
            self.weight_version if served_at_start is None else min(self.weight_version, served_at_start)
        )
        return [version] * len(self.output_ids)


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params
