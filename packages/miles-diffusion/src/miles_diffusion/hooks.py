"""How miles-diffusion joins a run: the ``diffusion:`` recipe section and the recipe checks.

Its components are entry points (pyproject): the ``diffusion`` engine kind, rollout, data sources
(``diffusion_prompts``; ``coloured_shapes`` for ``mode: sft``) and backend, the ``diffusion_grpo``
advantage, the ``flow_grpo``, ``diffusion_nft`` and ``diffusion_sft`` objectives (as losses), the
image rewards, the ``tiny-flow-unet`` built-in model and the recipes of ``miles_diffusion/run_recipes``.
The checks here refuse, before anything starts and with one line each, what this slice cannot run.
"""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.config.sections import ConfigSection


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
def miles_model_directory(path: str) -> str | None:
    """A diffusers pipeline directory of a family this package loads (SD3: ``model_index.json``, no
    top-level ``config.json``) is a model directory for the core's ``model.path`` check."""
    from pathlib import Path

    if not (Path(path) / "model_index.json").is_file():
        return None
    from miles_diffusion.families import family_for

    try:
        family = family_for(path)
    except ValueError:
        return None
    return f"a {family.name} diffusers pipeline directory (miles-diffusion)"


@hookimpl
def miles_configure(config: Any) -> None:
    if config.backend == "diffusion" or config.engine.launcher == "diffusion":
        # Before the core resolves model.path: a diffusers directory of a family the engine and
        # backend do not serve gets one line naming what is supported.
        from miles.errors import ConfigError
        from miles_diffusion.families import check_core_model_ref

        try:
            check_core_model_ref(str(config.model.path))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # Supervised mode skips the component checks (no engines, no miles_check_config): its checks run here.
    if config.mode == "sft":
        from miles_diffusion.sft_checks import check_supervised_recipe

        check_supervised_recipe(config)


@hookimpl
def miles_check_config(config: Any) -> None:
    from miles_diffusion.checks import check_recipe

    check_recipe(config)
