"""How miles-diffusion joins a run: the ``diffusion:`` recipe section and the recipe checks.

Its components are entry points (pyproject): the ``diffusion`` engine kind, rollout, data source
(``diffusion_prompts``) and backend, the ``diffusion_grpo`` advantage, the ``flow_grpo`` and
``diffusion_nft`` objectives (as losses), the image rewards, the ``tiny-flow-unet`` built-in model
and the recipes of ``miles_diffusion/run_recipes``. The checks here refuse, before anything starts
and with one line each, what this slice cannot run.
"""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.config.sections import ConfigSection
from miles.errors import ConfigError


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    from miles_diffusion.config import SECTION, DiffusionSection

    return [
        ConfigSection(
            name=SECTION,
            model=DiffusionSection,
            description="the diffusion backend: deterministic mode, which denoising steps it trains, threads",
            # The checkpoint holds whole weights and optimizer state: any of these may change on resume.
            resume_mutable=frozenset(DiffusionSection.model_fields),
        )
    ]


@hookimpl
def miles_configure(config: Any) -> None:
    # Supervised mode skips the component checks (no engines), so this one is made here.
    if config.backend == "diffusion" and config.mode != "rl":
        raise ConfigError(
            "backend 'diffusion' trains on rollouts (mode: rl) in this slice; diffusion SFT runs through the "
            "package's own driver: python -m miles_diffusion.train tiny_sft"
        )


@hookimpl
def miles_check_config(config: Any) -> None:
    from miles_diffusion.checks import check_recipe

    check_recipe(config)
