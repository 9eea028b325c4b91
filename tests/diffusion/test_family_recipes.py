"""The pipeline families' proxy recipes end to end through the package driver, one case per family
(``<family>_flow_grpo_proxy``: Flow-GRPO on the scaled-down random pipeline ``builtin:tiny-<family>``):
every registered metric matches the committed standard bit for bit, whole (40 iterations, 10-20 s
each: ``-m extended``) and cut to 4 iterations (the default run); the whole run's reward rises by
at least the family's margin. Each is the proxy of a real-model recipe (``<family>_flow_grpo``, not
verified) and is itself proxy gated.

Regenerate one family's standards (after an intended numerical change, or to gate another machine
bit for bit; say so in the commit): ``uv run python -m tests.diffusion.test_family_recipes <recipe>``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from miles_diffusion.recipe import load_recipe

from ._standards import assert_matches_standard, run_recipe, write_standard

CUT_ITERATIONS = 4


@dataclass(frozen=True)
class FamilyRecipe:
    recipe: str  # the proxy recipe; its standards are named after it
    real: str  # the real-model recipe it stands in for
    builtin: str
    rise: float  # how much the whole run's eval and rollout rewards must rise

    @property
    def cut_standard(self) -> str:  # its first 4 iterations (eval after the 4th)
        return f"{self.recipe}_cut{CUT_ITERATIONS}"


RECIPES = {
    r.recipe: r
    for r in (
        # Brightness barely moves on the Wan proxy (its random video VAE decodes to near-uniform grey).
        FamilyRecipe("wan_flow_grpo_proxy", "wan_flow_grpo", "builtin:tiny-wan", 0.002),
        FamilyRecipe("qwen_image_flow_grpo_proxy", "qwen_image_flow_grpo", "builtin:tiny-qwen-image", 0.03),
        FamilyRecipe("ltx_flow_grpo_proxy", "ltx_flow_grpo", "builtin:tiny-ltx", 0.1),  # JPEG compressibility
        FamilyRecipe("cosmos_flow_grpo_proxy", "cosmos_flow_grpo", "builtin:tiny-cosmos", 0.03),
    )
}
CASES = [pytest.param(r, id=r.recipe.removesuffix("_flow_grpo_proxy")) for r in RECIPES.values()]


@pytest.mark.parametrize("case", CASES)
def test_the_recipe_is_the_proxy_of_the_real_one(case: FamilyRecipe) -> None:
    proxy, real = load_recipe(case.recipe), load_recipe(case.real)
    assert proxy.model == case.builtin and isinstance(real.model, str)
    assert proxy.evidence_level == "proxy gated" and real.evidence_level == "not verified"
    assert proxy.objective.name == real.objective.name == "flow_grpo"
    assert proxy.prompts and real.prompts and proxy.num_iterations == 40


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_cut_proxy_matches_its_standard_bit_for_bit(case: FamilyRecipe) -> None:
    assert_matches_standard(case.cut_standard, run_recipe(case.recipe, CUT_ITERATIONS))


@pytest.mark.extended
@pytest.mark.parametrize("case", CASES)
def test_the_whole_proxy_matches_its_standard_bit_for_bit_and_its_reward_rises(case: FamilyRecipe) -> None:
    history = run_recipe(case.recipe)
    assert_matches_standard(case.recipe, history)
    assert history[-1]["eval/reward_after"] > history[0]["eval/reward_before"] + case.rise
    first = sum(m["reward/mean"] for m in history[:5]) / 5
    last = sum(m["reward/mean"] for m in history[-5:]) / 5
    assert last > first + case.rise


if __name__ == "__main__":  # uv run python -m tests.diffusion.test_family_recipes <recipe>
    chosen = RECIPES[sys.argv[1]]
    torch.set_num_threads(1)
    print(f"wrote {write_standard(chosen.cut_standard, run_recipe(chosen.recipe, CUT_ITERATIONS))}")
    print(f"wrote {write_standard(chosen.recipe, run_recipe(chosen.recipe))}")
