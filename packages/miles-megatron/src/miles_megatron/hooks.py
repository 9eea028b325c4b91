"""Hooks the Megatron backend contributes to every run: its ``megatron`` section and its refusals.

``miles_configure`` is the first thing a run's pre-flight (and ``miles config validate --check``)
calls, so a recipe with ``backend: megatron`` that cannot run here is refused in one line before
anything starts. Nothing here imports megatron-core: the check looks it up without importing it,
and a run with another backend pays for none of this.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from miles import hookimpl
from miles.config.sections import ConfigSection
from miles.errors import ConfigError
from miles_megatron.config import MegatronOptions

RESUME_MUTABLE = frozenset({"num_ranks", "tensor_parallel", "pipeline_parallel"})


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    return [
        ConfigSection(
            name="megatron",
            model=MegatronOptions,
            description="Megatron-core training backend: parallel layout (TP, PP, CP, EP, ETP), device",
            # A resume may change the TP / PP / DP layout: the trainer reshards its checkpoint (or refuses
            # what it cannot reshard in one line: CP / EP layouts).
            resume_mutable=RESUME_MUTABLE,
        )
    ]


@hookimpl
def miles_configure(config: Any) -> None:
    if config.backend != "megatron":
        return
    options = getattr(config, "megatron", None) or MegatronOptions()
    from miles_megatron.layout import plan_layout

    # The recipe's own mistakes first (on any machine), then what this machine lacks. Sizes that
    # cannot divide the world are refused here, the model's shape when the backend is set up.
    plan_layout(options)
    problems = launch_problems(options) + options.storage_problems()
    lora = getattr(config, "lora", None)
    if lora is not None:
        from miles_megatron.lora import option_problems

        problems += option_problems(options, lora, options.layer_spec)
        if config.mode == "rl":  # the weight updates carry only the adapter
            from miles._plugins.components import load_component
            from miles_megatron.lora import transport_refusal

            if not getattr(load_component("transport", config.transport), "carries_adapters", False):
                problems.append(transport_refusal(config.transport))
    if problems:
        raise ConfigError("backend 'megatron': " + "; ".join(problems))
    problem = runtime_problem(options)
    if problem is not None:
        raise ConfigError(problem)


def launch_problems(options: MegatronOptions) -> list[str]:
    """Layouts the multi-rank launch does not run yet, one sentence each naming the setting."""
    out = []
    if options.pipeline_parallel != 1 and options.device == "cuda":
        out.append(
            f"megatron.pipeline_parallel is {options.pipeline_parallel}: pipeline stages run on megatron.device "
            "cpu only so far (on GPUs they have not been run); allowed with cuda: 1"
        )
    if options.pipeline_parallel != 1 and options.optimizer_streaming:
        out.append(
            f"megatron.pipeline_parallel is {options.pipeline_parallel} with megatron.optimizer_streaming: "
            "streamed optimizer state is not run over pipeline stages yet; allowed: pipeline_parallel 1, "
            "or optimizer_streaming false"
        )
    if options.context_parallel != 1:
        out.append(f"megatron.context_parallel is {options.context_parallel}: not launched yet; allowed: 1")
    if options.expert_parallel != 1:
        out.append(f"megatron.expert_parallel is {options.expert_parallel}: not launched yet; allowed: 1")
    if options.expert_tensor_parallel not in (None, options.tensor_parallel):
        out.append(
            f"megatron.expert_tensor_parallel is {options.expert_tensor_parallel}: not launched yet; "
            "allowed: unset (the same as tensor_parallel)"
        )
    if options.sequence_parallel:
        out.append("megatron.sequence_parallel is true: not launched yet; allowed: false")
    model_parallel = options.tensor_parallel * options.pipeline_parallel * options.context_parallel
    data_parallel = (
        options.num_ranks != model_parallel and model_parallel and options.num_ranks % model_parallel == 0
    )
    if data_parallel and options.device == "cuda":
        out.append(
            f"megatron.num_ranks is {options.num_ranks}: data parallelism (DP = "
            f"{options.num_ranks // model_parallel}) runs on megatron.device cpu only so far (on GPUs "
            f"it has not been run); allowed with cuda: num_ranks = tensor_parallel = {options.tensor_parallel}"
        )
    return out


def runtime_problem(options: MegatronOptions | None = None) -> str | None:
    """Why megatron-core cannot train ``options``' ranks on this machine (one sentence), or None when it can."""
    options = options or MegatronOptions()
    try:  # the distribution's metadata, so that checking imports nothing of megatron
        importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "backend 'megatron' needs megatron-core: pip install miles-megatron"
    if options.device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            "backend 'megatron' needs a CUDA GPU and none is visible on this machine "
            "(megatron-core trains on CUDA only); use backend: fsdp to train on CPU "
            "(megatron.device: cpu runs megatron's tensor parallelism over gloo, for tests)"
        )
    if options.num_ranks > torch.cuda.device_count():
        return (
            f"megatron.num_ranks is {options.num_ranks} (one GPU each) but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return None
