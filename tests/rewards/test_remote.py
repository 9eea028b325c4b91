"""remote: rewards from an HTTP service, against a real aiohttp server on 127.0.0.1 started in each test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from miles.builtins.rewards.remote import RemoteGroupReward, RemoteReward, RemoteRewardError
from miles.builtins.rollout.default import GroupRollout
from miles.errors import ConfigError
from miles.interfaces import RolloutContext
from miles.plugins import make_component
from miles.types import Prompt, Sample, SamplingParams, Status

from .test_group_reward import CharTokenizer, fake_generate

# Replies to the n-th request (1-based) the server receives.
Handler = Callable[[int], Awaitable[web.StreamResponse]]

FAST = {"timeout_s": 0.5, "backoff_s": 0.01}  # keeps every failing case well under a second


class Service:
    """A local HTTP service on a free port; records the JSON bodies it was sent."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.received: list[Any] = []
        self.release = asyncio.Event()  # lets a hanging handler return when the test ends
        self.url = ""

    async def _route(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        return await self.handler(len(self.received))


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Service]:
    service = Service(handler)
    app = web.Application()
    app.router.add_post("/score", service._route)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one
    await web.SockSite(runner, sock).start()
    service.url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    try:
        yield service
    finally:
        service.release.set()
        await runner.cleanup()


def sample(response: str = "2 + 2 = 4, so the answer is 4.", index: int = 7) -> Sample:
    prompt = Prompt(index=index, prompt="What is 2+2?", label="4", metadata={"source": "gsm8k"})
    return Sample(prompt=prompt, response_text=response)


async def score_with(handler: Handler, **options: Any) -> tuple[float | BaseException, Service, float]:
    """Score one sample; returns the score (or the error raised), the service, and the seconds it took."""
    async with serve(handler) as service:
        reward = RemoteReward(service.url, **{**FAST, **options})
        t0 = time.perf_counter()
        try:
            result: float | BaseException = await reward(sample())
        except RemoteRewardError as exc:
            result = exc
        finally:
            await reward.aclose()
        return result, service, time.perf_counter() - t0


def json_reply(body: Any, status: int = 200) -> Handler:
    async def handler(n: int) -> web.StreamResponse:
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    return handler


def test_success_and_payload() -> None:
    result, service, _ = asyncio.run(score_with(json_reply({"score": 0.75, "detail": "ok"})))
    assert result == 0.75
    assert service.received == [
        {
            "prompt": "What is 2+2?",
            "response": "2 + 2 = 4, so the answer is 4.",
            "label": "4",
            "metadata": {"source": "gsm8k"},
        }
    ]


def test_bare_number_and_custom_key() -> None:
    assert asyncio.run(score_with(json_reply(-0.5)))[0] == -0.5
    assert asyncio.run(score_with(json_reply({"reward": 1}), key="reward"))[0] == 1.0


def test_retries_5xx_then_succeeds() -> None:
    async def flaky(n: int) -> web.StreamResponse:
        if n <= 2:
            return web.Response(status=500, text="overloaded")
        return web.json_response({"score": 1.0})

    result, service, _ = asyncio.run(score_with(flaky, retries=2))
    assert result == 1.0
    assert len(service.received) == 3  # two failures, then the answer

    result, service, _ = asyncio.run(score_with(flaky, retries=1))
    assert isinstance(result, RemoteRewardError)
    assert len(service.received) == 2
    assert "after 2 attempt(s)" in str(result)
    assert "HTTP 500: 'overloaded'" in str(result)
    assert service.url in str(result)


def test_4xx_is_not_retried() -> None:
    async def refuse(n: int) -> web.StreamResponse:
        return web.Response(status=422, text="label missing")

    result, service, _ = asyncio.run(score_with(refuse, retries=3))
    assert isinstance(result, RemoteRewardError)
    assert len(service.received) == 1
    assert "refused a sample of prompt 7 with HTTP 422 (not retried): 'label missing'" in str(result)


def test_a_hanging_service_times_out() -> None:
    service_ref: list[Service] = []

    async def hang(n: int) -> web.StreamResponse:
        await service_ref[0].release.wait()
        return web.json_response({"score": 1.0})

    async def run() -> tuple[float | BaseException, int, float]:
        async with serve(hang) as service:
            service_ref.append(service)
            reward = RemoteReward(service.url, timeout_s=0.2, retries=1, backoff_s=0.01)
            t0 = time.perf_counter()
            try:
                await reward(sample())
            except RemoteRewardError as exc:
                return exc, len(service.received), time.perf_counter() - t0
            finally:
                await reward.aclose()
        raise AssertionError("a hanging service must not produce a score")

    error, requests, seconds = asyncio.run(run())
    assert requests == 2  # the first attempt and one retry, each cut off after 0.2 s
    assert 0.4 <= seconds < 2.0
    assert "after 2 attempt(s); last error: no reply within timeout_s=0.2" in str(error)


def test_connection_refused_is_retried_then_reported() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"

    async def run() -> RemoteRewardError:
        reward = RemoteReward(url, retries=2, **FAST)
        try:
            await reward(sample())
        except RemoteRewardError as exc:
            return exc
        finally:
            await reward.aclose()
        raise AssertionError("no service: no score")

    message = str(asyncio.run(run()))
    assert url in message and "after 3 attempt(s)" in message and "ClientConnectorError" in message


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("<html>Internal proxy page</html>", "not JSON: '<html>Internal proxy page</html>'"),
        ('{"reward": 1.0}', "has no field 'score' \\(fields: reward\\); set rollout.reward_options.key"),
        ('{"score": "high"}', "returned '\"high\"' for a sample of prompt 7, not a finite number"),
        ('{"score": true}', "not a finite number"),
        ('{"score": NaN}', "not a finite number"),
        ("[0.5]", "not a finite number"),
    ],
)
def test_malformed_replies_are_errors_without_retries(body: str, match: str) -> None:
    async def reply(n: int) -> web.StreamResponse:
        return web.Response(text=body)

    result, service, _ = asyncio.run(score_with(reply, retries=3))
    assert isinstance(result, RemoteRewardError)
    assert len(service.received) == 1
    with pytest.raises(RemoteRewardError, match=match):
        raise result


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"url": "ftp://example.com/score"}, "must start with http:// or https://"),
        ({"url": "127.0.0.1:8000/score"}, "must start with http:// or https://"),
        ({"url": "http:///score"}, "has no host"),
        ({"url": "http://127.0.0.1:99999/score"}, "cannot be parsed"),
        ({"url": "http://h/", "timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"url": "http://h/", "retries": -1}, "retries must be an integer >= 0"),
        # Wrong types are refused by the options model (RemoteOptions), before the constructor.
        (
            {"url": "http://h/", "retries": 1.5},
            r"option 'retries' \(int\) of reward 'remote' must be a valid integer",
        ),
        ({"url": "http://h/", "backoff_s": -1}, "backoff_s must be a number >= 0"),
        ({"url": "http://h/", "key": ""}, "key must be a non-empty string"),
        ({"url": "http://h/", "max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        (
            {"url": "http://h/", "headers": {"X-Token": 1}},
            r"headers.X-Token: got 1; option 'headers' .* must be a valid string",
        ),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_component("reward", "remote", options)


def test_unserializable_metadata_is_a_clear_error() -> None:
    bad = sample()
    bad.prompt.metadata = {"when": object()}
    reward = RemoteReward("http://127.0.0.1:9/score")
    with pytest.raises(ValueError, match="a sample of prompt 7 cannot be sent as JSON"):
        asyncio.run(reward(bad))


def test_the_session_is_opened_lazily_and_closed() -> None:
    async def run() -> None:
        async with serve(json_reply({"score": 1.0})) as service:
            reward = RemoteReward(service.url, **FAST)
            assert reward._http is None  # nothing opened at construction
            await asyncio.gather(*(reward(sample(index=i)) for i in range(5)))
            session = reward._http
            assert session is not None and not session.closed
            await reward.aclose()
            assert session.closed and reward._http is None
            await reward.aclose()  # twice is fine

    asyncio.run(run())


# ----------------------------------------------------------------------------- group


def group_of(n: int) -> list[Sample]:
    return [sample(response=f"answer {i}") for i in range(n)]


def test_group_reward_posts_the_group() -> None:
    async def run() -> tuple[list[float], Service]:
        async with serve(json_reply({"scores": [0.0, 0.5, 1.0]})) as service:
            reward = RemoteGroupReward(service.url, **FAST)
            try:
                return await reward(group_of(3)), service
            finally:
                await reward.aclose()

    scores, service = asyncio.run(run())
    assert RemoteGroupReward.group_reward is True
    assert scores == [0.0, 0.5, 1.0]
    assert [s["response"] for s in service.received[0]["samples"]] == ["answer 0", "answer 1", "answer 2"]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([1.0, 0.0], "returned 2 scores for the group of prompt 7; expected a list of 3 scores"),
        ({"scores": 1.0}, "returned '1.0' for the group of prompt 7; expected a list of 3 scores"),
        ({"scores": [1.0, "x", 0.0]}, "not a finite number"),
    ],
)
def test_group_reward_with_a_wrong_reply(body: Any, match: str) -> None:
    async def run() -> None:
        async with serve(json_reply(body)) as service:
            reward = RemoteGroupReward(service.url, **FAST)
            try:
                await reward(group_of(3))
            finally:
                await reward.aclose()

    with pytest.raises(RemoteRewardError, match=match):
        asyncio.run(run())


# --------------------------------------------------------------------------- rollout


def test_a_dead_service_fails_the_samples_and_the_rollout_goes_on() -> None:
    async def down(n: int) -> web.StreamResponse:
        return web.Response(status=503, text="maintenance")

    plan = [["4", 2, "completed"], ["5", 3, "completed"]]

    async def run() -> list[Sample]:
        async with serve(down) as service:
            reward = RemoteReward(service.url, retries=1, **FAST)
            ctx = RolloutContext(
                engines=[],
                tokenizer=CharTokenizer(),
                sampling=SamplingParams(),
                n_samples_per_prompt=2,
                reward=reward,
            )
            rollout = GroupRollout(generate_fn=f"{fake_generate.__module__}:fake_generate")
            try:
                groups = await rollout(ctx, [Prompt(index=0, prompt="q", label="4", metadata={"plan": plan})])
            finally:
                await reward.aclose()
            return groups[0].samples

    for s in asyncio.run(run()):
        assert s.status is Status.FAILED and s.reward == 0.0
        assert s.metadata["reward_error"].startswith("RemoteRewardError: reward 'remote': http://127.0.0.1:")
        assert "after 2 attempt(s); last error: HTTP 503: 'maintenance'" in s.metadata["reward_error"]
