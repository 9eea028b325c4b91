"""What a run optimises, resolved from the recipe once, before any process starts.

The recipe names an advantage estimator, a loss, a correction, optionally a critic and
a distillation teacher. Resolving them here fixes three things the rest of the run
relies on: the loss actually used (an unset ``algorithm.loss`` is the estimator's own),
the per-token scores the trainer must compute before advantages (reference log-probs,
values, an in-process teacher's log-probs), and the models behind those scores. Every
inconsistency is refused here with one clear message.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.schema import CriticSection, DistillationSection, MilesConfig
from miles.errors import ConfigError
from miles.interfaces import (
    REF_LOGPROBS,
    SCORE_NAMES,
    TEACHER_LOGPROBS,
    VALUES,
    AdvantageEstimator,
    CriticSpec,
)
from miles.plugins import make_component


@dataclass
class Objective:
    advantage: AdvantageEstimator | None  # None in SFT mode
    loss: str  # the resolved loss name or import path
    loss_kind: str
    scores: list[str]  # computed by the backend's scoring pass before advantages, in SCORE_NAMES order
    critic: CriticSpec | None
    ref_model_path: str | None
    teacher_model_path: str | None
    distillation: DistillationSection | None


def resolve_objective(config: MilesConfig, model_path: str) -> Objective:
    from miles.models.registry import resolve_model

    alg = config.algorithm
    sft = config.mode == "sft"
    advantage = None if sft else make_component("advantage", alg.advantage, alg.advantage_options)
    default_loss: str = "sft" if sft else getattr(advantage, "default_loss", "ppo_clip")
    loss_name = alg.loss or default_loss
    # Built here only to read what it declares; the trainer builds its own copy in each rank.
    loss = make_component("loss", loss_name, alg.loss_options)
    kind = getattr(loss, "kind", "policy")
    want = "supervised" if sft else "policy"
    if kind != want:
        raise ConfigError(
            f"algorithm.loss {loss_name!r} is a {kind} loss, but mode {config.mode!r} trains the policy with a "
            f"{want} loss ({'sft' if sft else 'e.g. ppo_clip, gspo'})"
        )

    needed = set(getattr(advantage, "requires", ())) | (set(getattr(loss, "requires", ())) & set(SCORE_NAMES))
    distill = config.distillation
    if distill is not None and distill.teacher == "trainer":
        needed.add(TEACHER_LOGPROBS)
    unknown = needed - set(SCORE_NAMES)
    if unknown:
        raise ConfigError(
            f"the objective requires unknown per-token scores {sorted(unknown)}; known: {SCORE_NAMES}"
        )

    critic_section = alg.critic
    if VALUES in needed and critic_section is None:
        critic_section = CriticSection()  # PPO implies a critic; its defaults are documented
    if critic_section is not None and VALUES not in needed:
        raise ConfigError(
            f"algorithm.critic is set, but advantage {alg.advantage!r} does not use values; remove it or use "
            "advantage: ppo"
        )
    critic = None
    if critic_section is not None:
        critic = CriticSpec(
            model_path=resolve_model(critic_section.model) if critic_section.model else model_path,
            loss=critic_section.loss,
            loss_options=dict(critic_section.loss_options),
            lr=critic_section.lr,
        )
    if alg.ref_model is not None and REF_LOGPROBS not in needed:
        raise ConfigError(
            "algorithm.ref_model is set, but nothing in the objective uses reference log-probs (set a kl_coef "
            "in algorithm.advantage_options or algorithm.loss_options, or remove ref_model)"
        )
    ref_path = (
        (resolve_model(alg.ref_model) if alg.ref_model else model_path) if REF_LOGPROBS in needed else None
    )
    teacher_path = None
    if distill is not None and distill.teacher == "trainer":
        assert distill.model is not None  # the schema requires it
        teacher_path = resolve_model(distill.model)
        check_same_tokenizer(model_path, teacher_path)
    return Objective(
        advantage=advantage,
        loss=loss_name,
        loss_kind=kind,
        scores=[name for name in SCORE_NAMES if name in needed],
        critic=critic,
        ref_model_path=ref_path,
        teacher_model_path=teacher_path,
        distillation=distill,
    )


def check_same_tokenizer(student_path: str, teacher_path: str) -> None:
    """A teacher scores the student's token ids, so both must map ids to the same strings."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_path)
    teacher = AutoTokenizer.from_pretrained(teacher_path)
    if student.get_vocab() != teacher.get_vocab():
        raise ConfigError(
            f"distillation teacher {teacher_path!r} has a different vocabulary from the student {student_path!r} "
            f"({len(teacher.get_vocab())} vs {len(student.get_vocab())} entries); the teacher must share the "
            "student's tokenizer because it scores the student's token ids"
        )
