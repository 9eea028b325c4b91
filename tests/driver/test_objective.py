"""Resolving the objective from a recipe: default losses, the scores the trainer computes, refusals."""

from __future__ import annotations

import pytest

from miles.config import load_recipe
from miles.driver.objective import resolve_objective
from miles.errors import ConfigError
from miles.models.registry import resolve_model

MODEL = "builtin:tiny-qwen3"


def _objective(*overrides: str):
    config = load_recipe("default", list(overrides))
    return resolve_objective(config, resolve_model(config.model.path))


@pytest.mark.parametrize(
    ("advantage", "loss"),
    [("grpo", "ppo_clip"), ("gspo", "gspo"), ("reinforce_pp", "ppo_clip"), ("ppo", "ppo_clip")],
)
def test_an_unset_loss_is_the_estimators_own(advantage, loss) -> None:
    obj = _objective(f"algorithm.advantage={advantage}", "algorithm.loss=null")
    assert obj.loss == loss and obj.loss_kind == "policy"


def test_grpo_needs_no_trainer_scores() -> None:
    obj = _objective()
    assert obj.scores == [] and obj.critic is None and obj.ref_model_path is None


def test_ppo_brings_a_critic_with_default_settings() -> None:
    obj = _objective("algorithm.advantage=ppo")
    assert obj.scores == ["values"]
    assert obj.critic is not None and obj.critic.loss == "value_clip"
    assert obj.critic.model_path == resolve_model(MODEL)


def test_a_kl_coefficient_asks_for_reference_logprobs_from_the_initial_policy() -> None:
    in_loss = _objective("algorithm.loss_options={kl_coef: 0.1}")
    in_reward = _objective("algorithm.advantage=reinforce_pp", "algorithm.advantage_options={kl_coef: 0.1}")
    for obj in (in_loss, in_reward):
        assert obj.scores == ["ref_logprobs"] and obj.ref_model_path == resolve_model(MODEL)


def test_in_process_teacher_is_scored_on_the_trainer() -> None:
    obj = _objective(f"distillation={{teacher: trainer, model: {MODEL}}}")
    assert obj.scores == ["teacher_logprobs"] and obj.teacher_model_path == resolve_model(MODEL)


def test_sft_mode_defaults_to_the_sft_loss_and_refuses_policy_losses() -> None:
    config = load_recipe("sft-arith")
    assert resolve_objective(config, resolve_model(MODEL)).loss == "sft"
    config = load_recipe("sft-arith", ["algorithm.loss=ppo_clip"])
    with pytest.raises(ConfigError, match="'ppo_clip' is a policy loss, but mode 'sft'"):
        resolve_objective(config, resolve_model(MODEL))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["algorithm.loss=sft"], "'sft' is a supervised loss, but mode 'rl'"),
        (["algorithm.loss=value_clip"], "'value_clip' is a value loss"),
        (
            ["algorithm.critic={lr: 0.001}"],
            "algorithm.critic is set, but advantage 'grpo' does not use values",
        ),
        ([f"algorithm.ref_model={MODEL}"], "nothing in the objective uses reference log-probs"),
    ],
)
def test_inconsistent_objectives_are_refused(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        _objective(*overrides)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    tokenizer.add_tokens(["<extra_teacher_token>"])
    tokenizer.save_pretrained(tmp_path)
    from shutil import copy

    for name in ("config.json", "model.safetensors"):
        copy(f"{resolve_model(MODEL)}/{name}", tmp_path / name)
    with pytest.raises(ConfigError, match="different vocabulary"):
        _objective(f"distillation={{teacher: trainer, model: {tmp_path}}}")


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ("{teacher: served}", "needs at least one entry in distillation.teachers"),
        ("{teacher: trainer}", "needs distillation.model"),
        (f"{{teacher: trainer, model: {MODEL}, top_k: 4}}", "top_k needs served teachers"),
        ("{teachers: {default: {}}}", "exactly one of url"),
    ],
)
def test_distillation_section_is_checked_when_the_recipe_loads(section, match) -> None:
    with pytest.raises(Exception, match=match):
        load_recipe("default", [f"distillation={section}"])


def test_sft_mode_refuses_rollout_only_settings() -> None:
    with pytest.raises(Exception, match="mode 'sft' has no rollouts"):
        load_recipe("sft-arith", ["algorithm.correction=tis"])
    with pytest.raises(Exception, match="distillation needs rollouts"):
        load_recipe("sft-arith", ["distillation={teachers: {default: {url: 'http://127.0.0.1:1'}}}"])
