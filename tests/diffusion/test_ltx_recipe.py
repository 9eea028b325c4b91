"""The LTX-Video proxy recipe end to end (``ltx_flow_grpo_proxy``: Flow-GRPO on the
scaled-down random LTX-Video pipeline ``builtin:tiny-ltx``): every registered metric matches
the committed standard bit for bit, whole (40 iterations, about 20 s: ``-m extended``) and
cut to 4 iterations (the default run); the whole run's reward (JPEG
compressibility) rises. Its evidence level: proxy
gated.

Regenerate this machine's standards (after an intended numerical change, or to gate another machine
bit for bit; say so in the commit): ``uv run python -m tests.diffusion.test_ltx_recipe``.
"""

from __future__ import annotations

import pytest
import torch

from miles_diffusion.recipe import load_recipe

from ._standards import assert_matches_standard, run_recipe, write_standard

RECIPE = "ltx_flow_grpo_proxy"
STANDARD = "ltx_flow_grpo_proxy"  # the whole recipe
CUT_ITERATIONS = 4
CUT_STANDARD = "ltx_flow_grpo_proxy_cut4"  # its first 4 iterations (eval after the 4th)


def test_the_recipe_is_the_proxy_of_the_real_one() -> None:
    proxy, real = load_recipe(RECIPE), load_recipe("ltx_flow_grpo")
    assert proxy.model == "builtin:tiny-ltx" and isinstance(real.model, str)
    assert proxy.evidence_level == "proxy gated" and real.evidence_level == "not verified"
    assert proxy.objective.name == real.objective.name == "flow_grpo"
    assert proxy.prompts and real.prompts and proxy.num_iterations == 40


@pytest.mark.slow
def test_the_cut_proxy_matches_its_standard_bit_for_bit() -> None:
    assert_matches_standard(CUT_STANDARD, run_recipe(RECIPE, CUT_ITERATIONS))


@pytest.mark.extended
def test_the_whole_proxy_matches_its_standard_bit_for_bit_and_its_reward_rises() -> None:
    history = run_recipe(RECIPE)
    assert_matches_standard(STANDARD, history)
    assert history[-1]["eval/reward_after"] > history[0]["eval/reward_before"] + 0.1
    first = sum(m["reward/mean"] for m in history[:5]) / 5
    last = sum(m["reward/mean"] for m in history[-5:]) / 5
    assert last > first + 0.1


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"wrote {write_standard(CUT_STANDARD, run_recipe(RECIPE, CUT_ITERATIONS))}")
    print(f"wrote {write_standard(STANDARD, run_recipe(RECIPE))}")
