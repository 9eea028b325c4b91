"""Trajectory assembly: a path of checkpoints becomes one contiguous training ``Sample``.

Layout of the sample built from checkpoints ``c1 .. cn`` (root first):

* ``prompt_ids``: ``c1``'s prompt (the first render of the conversation).
* ``response_ids``: ``c1.output``, then for each later turn its prompt suffix (tool results,
  user messages, template glue) followed by its output. Every token is exactly the one the
  engine consumed or produced, in order, so the trainer's forward pass sees what the
  policy saw.
* ``loss_mask``: 1 on generated tokens, 0 on suffix tokens (nothing the model did not
  sample is trained on). In a branching session a checkpoint shared by several selected
  leaves is trained in the first (oldest) of them only, so shared turns are not counted
  twice; its tokens are masked in the others (``exclusive=True``, the default).
* ``rollout_logprobs``: the engine's log-probabilities on generated tokens, ``0.0`` on
  suffix tokens (masked, so the value is never used; zero keeps sums and ratios finite).
* ``weight_versions``: per generated token, the version it was sampled under; a suffix
  token carries the version it was prefilled under (the first token of the generation that
  follows it), so staleness (current version - oldest version) counts the turn correctly.
* ``routed_experts`` (MoE, when recorded): per response token, the experts of the forward
  pass that produced it; suffix tokens get the rows the caller recorded for them, or rows of
  ``-1`` (not recorded) when it did not.
* ``prompt_routed_experts``: the first turn's suffix rows (its rendered prompt's) but the first,
  when recorded: the routing of every prompt position but the last. With ``routed_experts`` it
  covers every position of the trajectory the trainer reads, as routing replay needs
  (``miles.routing``); ``-1`` rows anywhere make replay refuse the sample.
* ``status``: from the last turn: length limit -> truncated, engine abort -> aborted,
  otherwise completed; a failure reported by the caller (environment or agent error) makes
  it failed.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from itertools import pairwise
from typing import Any

from miles.routing import NOT_RECORDED
from miles.types import Prompt, Sample, Status
from miles_envs.sessions.checkpoints import Checkpoint, ExpertRow, expert_shape
from miles_envs.sessions.store import LeafSelection, Session

NO_EXPERT = NOT_RECORDED  # a routed-expert id meaning "not recorded"


def trajectory_status(last: Checkpoint, failure: str | None = None) -> Status:
    """The status of a sequence ending at ``last``."""
    if failure is not None:
        return Status.FAILED
    if last.truncated:
        return Status.TRUNCATED
    if last.aborted:
        return Status.ABORTED
    return Status.COMPLETED


def assemble(
    path: Sequence[Checkpoint],
    prompt: Prompt,
    *,
    group_index: int = 0,
    trainable: Container[int] | None = None,
    failure: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Sample:
    """One training sample from a root-first checkpoint path.

    ``trainable``: ids of the checkpoints whose outputs get loss mask 1 (default: all).
    ``failure``: why the episode failed, if it did (the sample's status becomes failed).
    """
    if not path:
        raise ValueError("cannot assemble a trajectory from an empty checkpoint path")
    for parent, child in pairwise(path):
        if child.parent is not parent:
            raise ValueError(f"checkpoint {child.id} does not extend checkpoint {parent.id}: not a path")
    if path[0].parent is not None:
        raise ValueError(f"the path must start at a root checkpoint; {path[0].id} has a parent")
    pad = _pad_row(path)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    experts: list[ExpertRow] | None = [] if pad is not None else None
    for k, node in enumerate(path):
        if k > 0:
            n = len(node.prompt_suffix_ids)
            response += node.prompt_suffix_ids
            mask += [0] * n
            logprobs += [0.0] * n
            versions += [node.prefill_version] * n
            if experts is not None:
                experts += node.suffix_routed_experts or [[list(layer) for layer in pad] for _ in range(n)]  # type: ignore[union-attr]
        n = len(node.output_ids)
        train = 1 if trainable is None or node.id in trainable else 0
        response += node.output_ids
        mask += [train] * n
        logprobs += node.output_logprobs
        versions += node.weight_versions
        if experts is not None:
            experts += node.routed_experts or [[list(layer) for layer in pad] for _ in range(n)]  # type: ignore[union-attr]
    root_rows = path[0].suffix_routed_experts
    # The root's first row is the prompt's first token, which no forward pass produced.
    prompt_experts = [[list(layer) for layer in row] for row in root_rows[1:]] if root_rows else None
    last = path[-1]
    meta: dict[str, Any] = {
        "checkpoint_ids": [c.id for c in path],
        "turns": len(path),
        "finish_reason": last.finish_reason,
        **(metadata or {}),
    }
    if failure is not None:
        meta["failure"] = failure
    sample = Sample(
        prompt=prompt,
        group_index=group_index,
        prompt_ids=list(path[0].prompt_suffix_ids),
        response_ids=response,
        # The final reply's visible text: what an answer-checking reward reads.
        response_text=last.assistant.text,
        rollout_logprobs=logprobs,
        loss_mask=mask,
        weight_versions=versions,
        routed_experts=experts,
        prompt_routed_experts=prompt_experts if experts is not None else None,
        status=trajectory_status(last, failure),
        finish_reason=last.finish_reason,
        metadata=meta,
    )
    sample.check_aligned()
    return sample


def session_samples(
    session: Session,
    prompt: Prompt,
    *,
    group_index: int = 0,
    selection: LeafSelection = "drop_retries",
    exclusive: bool = True,
    failure: str | None = None,
) -> list[Sample]:
    """The training samples of a session: one for a linear session, one per selected leaf otherwise.

    Empty when the session recorded nothing (the caller decides what an empty episode is).
    With ``exclusive``, a checkpoint shared by several paths is trained in the first only.
    """
    paths = session.trajectories(selection)
    seen: set[int] = set()
    samples = []
    for i, path in enumerate(paths):
        trainable = {c.id for c in path if c.id not in seen} if exclusive else None
        seen.update(c.id for c in path)
        meta = {"session_id": session.id, "session_mode": session.mode, "leaf": path[-1].id, "leaf_index": i}
        samples.append(
            assemble(
                path, prompt, group_index=group_index, trainable=trainable, failure=failure, metadata=meta
            )
        )
    return samples


def _pad_row(path: Sequence[Checkpoint]) -> ExpertRow | None:
    """A row of ``-1`` shaped like the recorded ones, or None when no turn recorded experts."""
    shape = None
    for node in path:
        shape = expert_shape(node.routed_experts) or expert_shape(node.suffix_routed_experts)
        if shape is not None:
            break
    if shape is None:
        if any(node.routed_experts is not None for node in path):
            return []  # recorded, but every generation was empty: nothing to pad
        return None
    layers, topk = shape
    return [[NO_EXPERT] * topk for _ in range(layers)]
