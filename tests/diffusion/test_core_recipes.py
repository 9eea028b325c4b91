"""How the diffusion slice joins the core before anything runs: its recipes and model are found by
name through the core's generic entry-point groups, and what it cannot run is refused in one line."""

from __future__ import annotations

import re

import pytest

from miles.config import find_recipe, list_recipes, load_recipe
from miles.driver.preflight import close_components, preflight
from miles.errors import ConfigError, MilesError, ModelError
from miles.models.registry import builtin_models, resolve_model


def test_the_diffusion_recipes_and_model_are_found_by_name() -> None:
    shipped = {r.name: r for r in list_recipes()}
    for name in ("tiny_flow_grpo", "tiny_diffusion_nft", "tiny_sft"):
        assert shipped[name].location.startswith("miles-diffusion ")
        assert find_recipe(name).display == f"{name}.yaml"
    assert load_recipe("tiny_flow_grpo").evidence.level == "fully gated"
    assert builtin_models()["tiny-flow-unet"].kind == "diffusion"
    assert resolve_model("builtin:tiny-flow-unet").endswith("tiny-flow-unet")


def test_a_recipe_name_two_distributions_ship_is_refused_naming_both(
    fake_site, tmp_path, monkeypatch
) -> None:
    fake_site.module("other_recipes.__init__", "")
    (fake_site.root / "other_recipes" / "tiny_flow_grpo.yaml").write_text("backend: fsdp\n")
    fake_site.dist("miles-other", "2.0", {"miles.recipes": {"other": "other_recipes"}})
    with pytest.raises(ConfigError, match=r"shipped by miles-diffusion .* and by miles-other 2\.0"):
        find_recipe("tiny_flow_grpo")
    # A directory on MILES_RECIPE_PATH shadows both on purpose (like PATH).
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "tiny_flow_grpo.yaml").write_text("backend: fsdp\n")
    monkeypatch.setenv("MILES_RECIPE_PATH", str(tmp_path / "mine"))
    assert find_recipe("tiny_flow_grpo").text == "backend: fsdp\n"


def test_a_builtin_model_name_two_distributions_declare_is_refused(fake_site) -> None:
    fake_site.module(
        "other_models",
        "from miles.models.registry import BuiltinModel\n"
        "M = BuiltinModel('tiny-qwen3', 'dense', 'X', '1K', 'clash', 'other_models:build')\n",
    )
    fake_site.dist("miles-other", "2.0", {"miles.models": {"tiny-qwen3": "other_models:M"}})
    with pytest.raises(ModelError, match="declared by both miles-core and miles-other"):
        builtin_models()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["backend=fsdp"], "set backend: diffusion"),
        (["algorithm.loss=ppo_clip", "algorithm.loss_options={}"], "'ppo_clip' is not one"),
        (["rollout.temperature=0.5"], "rollout.temperature is a token setting"),
        (["algorithm.correction=tis"], "cannot run algorithm.correction"),
        (["weight_sync.check_equal=true"], "no /weights_checker"),
        (["engine.dtype=bfloat16"], "other than float32"),
        # A per-engine option must not slip past what the run-wide setting is refused for.
        (["engine.options.dtype=bfloat16"], "engine.options.dtype 'bfloat16'"),
        (["engine.options.device=cuda"], "engine.options.device 'cuda'"),
        (["train.warmup_steps=3"], "constant learning rate"),
        (["data.path=prompts.jsonl"], "takes ids:N"),
        (["mode=sft"], "'flow_grpo' is a rollout objective"),
        (["rollout.n_samples_per_prompt=80"], "exceeds engine.max_batch_size 64"),
        (["algorithm.loss_options.beta=1.0"], "beta"),
        # The core's own capability check, on what the diffusion engine kind declares.
        (["transport=broadcast"], "does not have (it has: handoff-files)"),
    ],
)
def test_what_the_diffusion_slice_cannot_run_is_refused_before_anything_starts(overrides, expected) -> None:
    with pytest.raises(MilesError, match=re.escape(expected)):
        config = load_recipe("tiny_flow_grpo", overrides)
        close_components(preflight(config).components)


def test_a_token_recipe_cannot_name_a_trajectory_objective() -> None:
    config = load_recipe("default", ["warm_start=null", "eval=null", "algorithm.loss=flow_grpo"])
    with pytest.raises(ConfigError, match="needs backend: diffusion"):
        close_components(preflight(config).components)
