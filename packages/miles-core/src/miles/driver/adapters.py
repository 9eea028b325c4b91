"""Multi-LoRA on the driver side: each adapter's prompts, reward and generation; one mixed batch.

With ``lora.adapters`` every adapter is a rollout of its own: its data source, reward, buffer,
``prompts_per_step`` and step count come from the run's config with the adapter's fields in place
(:func:`adapter_config`), and its engine clients ask for that adapter on every ``/generate``
(``lora_path``). A step's groups are those of every adapter still training, each sample tagged
with its adapter (``Sample.metadata[ADAPTER_KEY]``), so one training batch mixes them; a backend
that trains several adapters (``trains_adapters = True`` on its class) steps each on its own rows
and sends the engines only the adapters that stepped. Metrics of an adapter are ``lora/<name>/...``.

What is not built yet is refused before anything starts (:func:`check_adapters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from miles.config.schema import ADAPTER_KEY, MilesConfig
from miles.errors import ConfigError
from miles.types import Group, Prompt

if TYPE_CHECKING:
    from miles.driver.components import Components
    from miles.driver.generation import RolloutStage
    from miles.interfaces import RolloutContext


def adapters_of(config: MilesConfig) -> list[str]:
    """The adapters of a multi-LoRA run, in the recipe's order (empty: not one)."""
    lora = config.lora
    return list(lora.adapters) if lora is not None and lora.adapters is not None else []


def adapter_config(config: MilesConfig, name: str) -> MilesConfig:
    """The run's config as adapter ``name``'s rollout sees it: its data, reward and prompts per step."""
    assert config.lora is not None and config.lora.adapters is not None
    a = config.lora.adapters[name]
    rollout = config.rollout.model_copy(
        update={
            "reward": a.reward if a.reward is not None else config.rollout.reward,
            "reward_options": a.reward_options
            if a.reward_options is not None
            else config.rollout.reward_options,
            "prompts_per_step": a.prompts_per_step or config.rollout.prompts_per_step,
        }
    )
    data = a.data if a.data is not None else config.data
    return config.model_copy(update={"data": data, "rollout": rollout, "lora": None})


def adapter_steps(config: MilesConfig) -> dict[str, int]:
    """How many steps each adapter trains (from step 0); after that it stays as it is."""
    assert config.lora is not None and config.lora.adapters is not None
    return {
        name: config.run.num_steps if a.num_steps is None else a.num_steps
        for name, a in config.lora.adapters.items()
    }


def check_adapters(config: MilesConfig) -> None:
    """Refuse, in one line, a multi-LoRA recipe this slice does not run (before anything starts)."""
    if not adapters_of(config):
        return
    from miles.capabilities import shares_devices
    from miles.plugins import load_component

    def refuse(why: str) -> None:
        raise ConfigError(f"lora.adapters (multi-LoRA): {why}")

    if config.mode != "rl":
        refuse("trains adapters from rollouts (mode: rl); for supervised training use the single form")
    if shares_devices(config):
        refuse(
            "runs on a disaggregated placement only (trainer and engines on separate devices); "
            "set placement.mode: disaggregated and a transport that carries adapters (e.g. broadcast)"
        )
    if config.schedule != "sync":
        refuse("runs under schedule: sync only (each adapter's rollout is a synchronous stage)")
    if config.train.steps_per_rollout != 1:
        refuse("takes one optimizer step per adapter per batch; set train.steps_per_rollout: 1")
    if config.weight_sync.check_equal:
        refuse("weight_sync.check_equal compares one adapter's tensors; turn it off")
    if config.warm_start is not None:
        refuse("has no warm start (its SFT stage trains one policy); remove warm_start")
    if config.eval is not None:
        refuse("has no per-adapter evaluation yet; remove eval")
    if config.distillation is not None:
        refuse("has no per-adapter teacher yet; remove distillation")
    backend = load_component("backend", config.backend)
    if not getattr(backend, "trains_adapters", False):
        refuse(
            f"backend {config.backend!r} cannot train several adapters at once (its class does not set "
            "trains_adapters = True); use the single-adapter lora form or a backend that can"
        )
    if not any(adapter_steps(config).values()):
        refuse("every adapter has num_steps: 0, so nothing would train")


class AdapterDataSources:
    """The run's data source under multi-LoRA: every adapter's, saved and restored together.

    Prompts are drawn from each adapter's own source by its stage; this object holds their
    positions for the run's checkpoints (``{adapter: state}``).
    """

    def __init__(self, sources: dict[str, Any]) -> None:
        self.sources = sources

    def next_prompts(self, n: int) -> list[Prompt]:
        raise RuntimeError("multi-LoRA: prompts come from each adapter's own data source")

    def put_back(self, prompts: Iterable[Prompt]) -> None:
        raise RuntimeError("multi-LoRA: prompts go back to each adapter's own data source")

    def state_dict(self) -> dict[str, Any]:
        return {"adapters": {name: source.state_dict() for name, source in self.sources.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("adapters", {})
        for name, source in self.sources.items():
            if name in saved:
                source.load_state_dict(saved[name])

    def __len__(self) -> int:
        return sum(len(source) for source in self.sources.values())


def adapter_components(config: MilesConfig, model_path: str, hooks: Any) -> dict[str, Components]:
    """Each adapter's own driver components (data source, reward, buffer, objective)."""
    from miles.driver.components import build_components

    return {
        name: build_components(adapter_config(config, name), model_path, hooks)
        for name in adapters_of(config)
    }


class AdapterGeneration:
    """The synchronous schedule for several adapters: each adapter's stage generates its groups with
    its own clients, prompts and reward; the step's batch is all of them, tagged by adapter."""

    def __init__(
        self,
        stages: dict[str, RolloutStage],
        steps: dict[str, int],
        loop: asyncio.AbstractEventLoop,
        console: Any = None,
    ) -> None:
        self.stages = stages
        self.steps = steps
        self.loop = loop
        self.console = console

    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        from miles.driver.generation import rollout_metrics

        t0 = time.perf_counter()
        groups: list[Group] = []
        metrics: dict[str, float] = {}
        for name, stage in self.stages.items():
            if step >= self.steps[name]:
                continue  # done training: no prompts drawn, no step taken, nothing sent
            got, own = stage.run(step)
            for group in got:
                for sample in group.samples:
                    sample.metadata[ADAPTER_KEY] = name
            groups.extend(got)
            own |= {f"buffer/{k}": v for k, v in stage.c.buffer.metrics().items()}
            metrics |= {f"lora/{name}/{k}": v for k, v in own.items()}
        metrics |= rollout_metrics(groups, groups, {}, time.perf_counter() - t0)
        return groups, metrics

    def weights_changing(self, version: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the engines are idle between steps

    def close(self) -> None:
        async def close() -> None:
            for stage in self.stages.values():
                for client in stage.ctx.engines:
                    aclose = getattr(client, "aclose", None)
                    if aclose is not None:
                        await aclose()

        self.loop.run_until_complete(close())


def adapter_generation(
    config: MilesConfig,
    components: Components,
    ctx: RolloutContext,
    clients: Any,
    loop: asyncio.AbstractEventLoop,
    hooks: Any,
    console: Any = None,
) -> AdapterGeneration:
    """Each adapter's rollout stage: the run's context with that adapter's clients and reward.

    ``clients()`` gives a fresh engine client per engine (the fleet's); each stage's ask for its adapter.
    """
    from miles.driver.generation import RolloutStage

    stages: dict[str, RolloutStage] = {}
    for name, own in components.adapters.items():
        engines = clients()
        for client in engines:
            client.lora_path = name  # every /generate of this stage names its adapter
        # router=None: the context routes over these clients (a copied router would use the run's).
        stage_ctx = dataclasses.replace(
            ctx,
            engines=engines,
            router=None,
            reward=own.reward,
            reward_postprocess=list(own.reward_postprocess),
        )
        stages[name] = RolloutStage(
            own,
            stage_ctx,
            prompts_per_step=adapter_config(config, name).rollout.prompts_per_step,
            max_rounds=config.rollout.max_rounds,
            hooks=hooks,
            loop=loop,
        )
    return AdapterGeneration(stages, adapter_steps(config), loop, console)
