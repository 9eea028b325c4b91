"""The ``miles run`` recipes for a real local diffusers directory (``run_recipes/<family>_flow_grpo``:
SD3 / SD3.5, Wan 2.1, Qwen-Image, LTX-Video, Cosmos-Predict2), each "not verified": no real weights
are available offline, so none has run on its real model.

What this checks instead: each recipe as shipped but for ``model.path``, pointed at its family's
scaled-down random proxy directory (``builtin:tiny-<family>``: the real layout, the same loader),
passes every check that runs before anything starts: the core's recipe checks, the component checks
(the engine launcher's, the rollout's, the backend's: the family's directory refusals, the guidance
and sequence-parallel checks, ``data.path`` ``ids:N`` against the prompt texts) and the prompt-text
checks. Nothing starts (no engine process, no training step): about a second a recipe.

What the proxy cannot show, and this test therefore does not: the real directory's sizes (the
pipelines' defaults: 81x480x832 Wan videos, 161x512x704 LTX videos, 1024x1024 Qwen-Image, 768x1360
Cosmos and 1024x1024 SD3.5 images; the proxies set tiny ones in their ``miles_video.json`` /
``miles_image.json``), the real tokenizers (the proxies' are character- or byte-level but for
Qwen-Image's, the real Qwen2.5 one), the real widths and head counts, and the run's speed in float32
on the CPU. The recipes' settings are not the proxy recipes' (groups of 8, 10 steps, JPEG
compressibility, clip range 1e-4, lr 1e-5, or 1e-4 for SD3), and none of them fails on the tiny
proxy: nothing here is overridden but ``model.path``.
"""

from __future__ import annotations

import pytest

from miles.config import load_recipe
from miles.driver.preflight import close_components, preflight
from miles_diffusion.train import resolve_model_dir

# recipe -> (its family's proxy, how many prompt texts it ships, its guidance scale or None)
REAL_RECIPES = {
    "sd3_flow_grpo": ("builtin:tiny-sd3", 8, 4.5),
    "wan_flow_grpo": ("builtin:tiny-wan", 4, None),
    "qwen_image_flow_grpo": ("builtin:tiny-qwen-image", 4, None),
    "ltx_flow_grpo": ("builtin:tiny-ltx", 4, None),
    "cosmos_flow_grpo": ("builtin:tiny-cosmos", 4, None),
}


@pytest.mark.parametrize("name", sorted(REAL_RECIPES))
def test_the_real_model_recipe_passes_the_checks_on_the_proxy_directory(name: str) -> None:
    proxy_name, num_texts, guidance_scale = REAL_RECIPES[name]
    shipped = load_recipe(name)
    assert not str(shipped.model.path).startswith("builtin:")  # a real directory by default
    assert shipped.evidence is not None and shipped.evidence.level == "not verified"
    assert shipped.evidence.detail

    proxy = resolve_model_dir(proxy_name)
    config = load_recipe(name, [f"model.path={proxy}"])
    assert config.evidence is not None and config.evidence.level == "not verified"
    checked = preflight(config)
    close_components(checked.components)
    assert checked.model_path == str(proxy.resolve())
    options = config.rollout.options
    assert len(options["prompts"]) == num_texts
    assert config.data.path == f"ids:{num_texts}"
    assert options.get("guidance_scale") == guidance_scale
    assert config.run.name == name
