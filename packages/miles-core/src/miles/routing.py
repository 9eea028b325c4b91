"""MoE routing recorded at rollout, and its replay in training (R3): the parts every backend shares.

An MoE engine records, for each token it feeds through the model, the experts every sparse
layer routed that token to. A :class:`~miles.types.Sample` keeps them aligned on what they
produced (see ``Sample.prompt_routed_experts`` and ``Sample.routed_experts``): together they
are the routing of every position ``0 .. total_length - 2`` of ``prompt_ids + response_ids``,
which is exactly the set of positions whose outputs the trainer's forward pass reads (the last
token's output predicts nothing the loss sees). :func:`sequence_routing` puts them in that
order; a backend lays them out like its micro-batch's tokens and, with
``train.use_rollout_routing_replay``, makes its routers choose those experts instead of their
own top-k, so training routes every token as the rollout did.

An expert id of ``-1`` (:data:`NOT_RECORDED`) marks a position whose routing is unknown (a
session turn whose suffix was not recorded). Replay refuses such a sample: it cannot route a
position the way the rollout did without knowing how. Where a backend lays out a micro-batch
it also uses ``-1`` for the positions no sample covers (padding, each sample's last token),
which its routers route freshly; their outputs reach no log-probability.

Torch-free: the driver, the rollout side and the backends' planning code import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.types import Sample

# Experts of one position: [sparse layer][k].
ExpertRow = list[list[int]]

#: The expert id of a position whose routing was not recorded (the router chooses freshly).
NOT_RECORDED = -1

#: The per-step metric: of the recorded (token, sparse layer) pairs of the step, the share whose
#: experts the trainer's router would have chosen (its own top-k) differ from the recorded ones.
ROUTING_MISMATCH = "train/routing_mismatch"


def records_routing(config: Any) -> bool:
    """Whether the run asks its engines for MoE routing: ``rollout.record_routed_experts``, or
    ``train.use_rollout_routing_replay`` (which needs it)."""
    if getattr(config, "mode", "rl") != "rl":
        return False
    return bool(config.rollout.record_routed_experts or config.train.use_rollout_routing_replay)


def sequence_routing(sample: Sample) -> list[ExpertRow] | None:
    """The routing of every position of ``prompt_ids + response_ids`` but the last, in order, or
    None when the sample carries none (the rollout did not record it, or recorded the response only).
    """
    if sample.routed_experts is None or sample.prompt_routed_experts is None:
        return None
    return [*sample.prompt_routed_experts, *sample.routed_experts]


def replay_problem(sample: Sample) -> str | None:
    """Why the trainer cannot replay ``sample``'s routing (one sentence), or None when it can."""
    if sample.routed_experts is None:
        return (
            "carries no routed experts: the rollout did not record MoE routing (the generate function "
            "must ask the engines for it, see docs/training.md, 'Routing replay')"
        )
    if sample.prompt_routed_experts is None:
        return (
            "carries routed experts for its response only, not for its prompt: the trainer's forward "
            "covers both, so its prompt positions could not be routed as the rollout routed them"
        )
    rows = sequence_routing(sample)
    assert rows is not None
    missing = sum(1 for row in rows if any(e < 0 for layer in row for e in layer))
    if missing:
        return (
            f"has {missing} of {len(rows)} positions whose routing was not recorded (expert id -1), e.g. "
            "session turns committed without suffix_routed_experts; record every turn's routing or turn "
            "train.use_rollout_routing_replay off"
        )
    return None


def routing_shape(rows: list[ExpertRow]) -> tuple[int, int] | None:
    """(sparse layers, top-k) of routing rows, or None when there are none."""
    if not rows:
        return None
    return len(rows[0]), len(rows[0][0]) if rows[0] else 0
