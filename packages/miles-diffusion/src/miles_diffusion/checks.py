"""What a diffusion recipe may not ask for in this slice, refused before anything starts.

The three diffusion components go together (engine kind, rollout, backend), and a trajectory
objective needs the diffusion backend. Settings the token path has and this one would silently
ignore (sampling temperature, token budgets, corrections, micro-batches, LR schedules) are refused
when the recipe sets them, and so are the run shapes not wired yet (fully asynchronous schedule,
evaluation, distillation, warm start, Ray placement, a device other than the CPU). A ``lora`` section
is checked against the denoiser (built on the meta device: no weights load) before the engines start.
"""

from __future__ import annotations

import sys
from typing import Any

from miles.errors import ConfigError
from miles.plugins import load_component

ENGINE = "diffusion"
ROLLOUT = "diffusion"
BACKEND = "diffusion"


def _is_trajectory_loss(config: Any) -> bool:
    name = config.algorithm.loss
    if name is None:
        advantage = load_component("advantage", config.algorithm.advantage)
        name = getattr(advantage, "default_loss", None)
    if name is None:
        return False
    loss = load_component("loss", name)
    # A trajectory objective subclasses TrajectoryObjectiveLoss, so loading it imported that module.
    # Not importing it here keeps diffusers (5 s of start-up) out of every language-model run.
    losses = sys.modules.get("miles_diffusion.losses")
    if losses is None:
        return False
    return isinstance(loss, type) and issubclass(loss, losses.TrajectoryObjectiveLoss)


def check_recipe(config: Any) -> None:
    uses = {
        "engine.launcher": config.engine.launcher == ENGINE,
        "rollout.fn": config.rollout.fn == ROLLOUT,
        "backend": config.backend == BACKEND,
    }
    trajectory_loss = _is_trajectory_loss(config)
    if not any(uses.values()):
        if trajectory_loss:
            raise ConfigError(
                f"algorithm.loss {config.algorithm.loss!r} is a diffusion trajectory objective; it needs "
                "backend: diffusion (with engine.launcher: diffusion and rollout.fn: diffusion)"
            )
        return
    missing = [key for key, used in uses.items() if not used]
    if missing:
        raise ConfigError(
            "the diffusion engine kind, rollout and backend go together (trajectories have no tokens for the "
            f"others); set {', '.join(f'{k}: diffusion' for k in missing)}"
        )
    if not trajectory_loss:
        raise ConfigError(
            f"backend 'diffusion' trains trajectory objectives; algorithm.loss {config.algorithm.loss!r} is not "
            "one (use flow_grpo or diffusion_nft, with algorithm.advantage: diffusion_grpo)"
        )
    _refuse_unwired(config)
    _check_fsdp_ranks(config)
    _refuse_token_settings(config)
    _check_prompt_texts(config)
    _check_guidance(config)
    if config.lora is not None:
        _check_lora(config)


def _check_prompt_texts(config: Any) -> bool:
    """A text-prompted family (sd3) needs ``rollout.options.prompts``, one text per prompt id of the
    data source; an id-prompted one (the tiny UNet) takes none. Returns whether the model is text-prompted."""
    import re

    from miles.models.registry import resolve_model
    from miles_diffusion.families import family_for

    try:
        family = family_for(resolve_model(config.model.path))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    texts = (config.rollout.options or {}).get("prompts")
    if not family.text_prompts:
        if texts is not None:
            raise ConfigError(
                f"rollout.options.prompts: the {family.name} model is prompted by id only; remove the texts"
            )
        return False
    if not texts:
        raise ConfigError(
            f"model.path is a {family.name} model, prompted with text: set rollout.options.prompts "
            "(prompt id i is prompts[i])"
        )
    match = re.match(r"^ids:([1-9][0-9]*)$", str(config.data.path).strip())
    if match is not None and int(match.group(1)) != len(texts):
        raise ConfigError(
            f"data.path {config.data.path!r} draws {match.group(1)} prompt ids, but rollout.options.prompts holds "
            f"{len(texts)} texts; draw one id per text (data.path: ids:{len(texts)})"
        )
    return True


def _check_guidance(config: Any) -> None:
    """``rollout.options.guidance_scale`` above 1 needs a family with an unconditional branch (sd3,
    wan; judged from the directory) and an objective that trains on guided samples (flow_grpo)."""
    from miles.models.registry import resolve_model
    from miles_diffusion.families import check_family_guidance, family_for
    from miles_diffusion.guidance import NO_GUIDANCE, GuidanceError
    from miles_diffusion.objectives import check_guidance, objective_config

    scale = (config.rollout.options or {}).get("guidance_scale", NO_GUIDANCE)
    try:
        check_family_guidance(family_for(resolve_model(config.model.path)), scale)
        loss = load_component("loss", config.algorithm.loss) if config.algorithm.loss else None
        name = getattr(loss, "objective", None)
        if isinstance(name, str):
            check_guidance(objective_config(name, {}), scale)
    except GuidanceError as exc:
        raise ConfigError(f"rollout.options.guidance_scale: {exc}") from None


def _check_lora(config: Any) -> None:
    """Target modules the denoiser lacks (or cannot merge), and the multi-adapter form, refused now.

    The targets are names under the adapter's root: the tiny UNet model, or a pipeline family's
    transformer (sd3, wan), built on the meta device from the directory's config (no weights load)."""
    from miles.models.registry import resolve_model
    from miles_diffusion.lora import check_targets, root_on_meta

    check_targets(root_on_meta(resolve_model(config.model.path)), config.lora)


def _refuse_unwired(config: Any) -> None:
    refusals = [
        (
            config.schedule != "sync",
            "schedule 'fully_async' (trajectories carry no per-token versions to age)",
        ),
        (
            config.eval is not None,
            "eval (the evaluator generates tokens; the rollout logs rollout/reward_mean)",
        ),
        (config.distillation is not None, "distillation"),
        (config.warm_start is not None, "warm_start"),
        (
            config.placement.launcher != "local",
            "placement.launcher 'ray' (the backend runs local processes: one, or diffusion.fsdp_ranks)",
        ),
        (
            config.engine.device != "cpu",
            f"engine.device {config.engine.device!r} (engine and trainer run on the CPU)",
        ),
        (
            (config.engine.dtype or config.model.dtype) != "float32",
            "an engine dtype other than float32 (engine and trainer log-probabilities must agree)",
        ),
        (
            config.engine.options.get("device") not in (None, "cpu"),
            f"engine.options.device {config.engine.options.get('device')!r} (engine and trainer run on the CPU)",
        ),
        (
            config.engine.options.get("dtype") not in (None, "float32"),
            f"engine.options.dtype {config.engine.options.get('dtype')!r} (engine and trainer log-probabilities "
            "must agree)",
        ),
        (
            config.weight_sync.check_equal,
            "weight_sync.check_equal (the diffusion engine has no /weights_checker)",
        ),
        (
            config.algorithm.correction is not None,
            "algorithm.correction (set it to null: there are no token log-probs)",
        ),
        (
            config.algorithm.ref_model is not None,
            "algorithm.ref_model (flow_grpo's kl_coef keeps its own reference)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"the diffusion slice cannot run {what}")
    n, most = config.rollout.n_samples_per_prompt, config.engine.max_batch_size
    if n > most:
        raise ConfigError(
            f"rollout.n_samples_per_prompt {n} exceeds engine.max_batch_size {most}: a group is one engine "
            "request; raise engine.max_batch_size or draw fewer samples per prompt"
        )


def _check_fsdp_ranks(config: Any) -> None:
    """``diffusion.fsdp_ranks`` above 1 trains Flow-GRPO's or DiffusionNFT's full weights data-parallel
    (sequence parallelism: Flow-GRPO's only); the rest (LoRA, ``mode: sft``) is refused."""
    section = getattr(config, "diffusion", None)
    ranks = int(getattr(section, "fsdp_ranks", 1))
    degree = int(getattr(section, "sequence_parallel", 1))
    if ranks % degree:
        raise ConfigError(
            f"diffusion.sequence_parallel {degree} does not divide diffusion.fsdp_ranks {ranks}: the ranks "
            "form groups of sequence_parallel that share trajectories"
        )
    if ranks == 1:
        return
    loss = load_component("loss", config.algorithm.loss) if config.algorithm.loss else None
    name = getattr(loss, "objective", None)
    if config.mode != "rl" or name not in ("flow_grpo", "diffusion_nft"):
        raise ConfigError(
            f"diffusion.fsdp_ranks {ranks}: data-parallel training runs flow_grpo and diffusion_nft "
            f"(mode: rl) only (not {name or config.mode}); set diffusion.fsdp_ranks: 1"
        )
    if degree > 1 and name != "flow_grpo":
        raise ConfigError(
            f"diffusion.sequence_parallel {degree}: sequence parallelism is tested with flow_grpo only "
            f"(not {name}); set diffusion.sequence_parallel: 1"
        )
    if config.lora is not None:
        raise ConfigError(
            f"diffusion.fsdp_ranks {ranks}: LoRA trains in one process; set diffusion.fsdp_ranks: 1"
        )
    batch = config.rollout.prompts_per_step * config.rollout.n_samples_per_prompt
    groups = ranks // degree
    if batch % groups:
        per = f" / sequence_parallel {degree} = {groups} data-parallel groups" if degree > 1 else ""
        raise ConfigError(
            f"diffusion.fsdp_ranks {ranks}{per} does not divide the step's {batch} trajectories "
            "(rollout.prompts_per_step x n_samples_per_prompt); pick a divisor"
        )
    if degree > 1:
        from miles.models.registry import resolve_model
        from miles_diffusion.sequence_parallel import check_sequence_parallel

        try:
            check_sequence_parallel(resolve_model(config.model.path), degree)
        except ValueError as exc:
            raise ConfigError(f"diffusion.{exc}") from None


def _refuse_token_settings(config: Any) -> None:
    token_keys = {"max_new_tokens", "temperature", "top_p", "top_k", "generate_fn"}
    set_here = sorted(token_keys & config.rollout.model_fields_set)
    if set_here:
        raise ConfigError(
            f"rollout.{set_here[0]} is a token setting the diffusion rollout does not read; remove it (sampling is "
            "rollout.options: num_steps, noise_level, seed, guidance_scale)"
        )
    train = config.train
    if "micro_batch_size" in train.model_fields_set:
        raise ConfigError(
            "train.micro_batch_size is not read by backend 'diffusion' (a step trains the whole batch)"
        )
    if train.steps_per_rollout != 1:
        raise ConfigError(
            "train.steps_per_rollout splits a batch into mini-batches; backend 'diffusion' steps the optimizer "
            "every diffusion.steps_per_update denoising steps instead: leave it at 1"
        )
    if train.warmup_steps or train.lr_schedule != "constant":
        raise ConfigError(
            "backend 'diffusion' trains at a constant learning rate: remove warmup_steps / lr_schedule"
        )
