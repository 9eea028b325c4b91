"""Rewards computed by an HTTP service: a reward model, a code sandbox, an LLM judge.

``RemoteReward`` POSTs one finished sample as JSON::

    {"prompt": <str or chat messages>, "response": <str>, "label": <str or null>, "metadata": {...}}

and reads its score from the reply: a bare JSON number (``0.5``) or the ``key`` field of
a JSON object (``{"score": 0.5}``). ``RemoteGroupReward`` POSTs a whole group as
``{"samples": [<one object as above per sample>]}`` and reads one score per sample, in
order: a JSON list, or a list in the ``key`` field (``{"scores": [...]}``).
``prompt``, ``label`` and ``metadata`` are the prompt's, as the data source produced them.

Failures. Each attempt may take at most ``timeout_s``. Connection errors, timeouts, HTTP
5xx and HTTP 429 (rate limited) are retried up to ``retries`` more times, waiting
``backoff_s * 2**k`` seconds before retry ``k`` (0.5, 1, 2... by default). Other HTTP
errors (4xx: the service refused this request) and replies that hold no valid score
are not retried, since sending the same request again would get the same answer.
When no score can be had, ``RemoteRewardError`` says the URL, the attempts made and the
last cause; the rollout then marks the sample FAILED with reward 0 and goes on. So a
dead or hung service costs a sample at most ``(retries + 1) * timeout_s`` plus the
backoff, never the run.

The HTTP session is opened on first use, in the event loop that runs the rollout, and
reused for every request there (keep-alive connections); at most ``max_concurrency``
requests are in flight at once. Call ``await reward.aclose()`` in that loop when done.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.types import Sample

if TYPE_CHECKING:
    import aiohttp


class RemoteRewardError(RuntimeError):
    """The reward service gave no usable score for a request."""


def sample_payload(sample: Sample) -> dict[str, Any]:
    """The JSON object that describes one sample to the service."""
    return {
        "prompt": sample.prompt.prompt,
        "response": sample.response_text,
        "label": sample.prompt.label,
        "metadata": sample.prompt.metadata,
    }


class _RemoteScorer:
    """What both remote rewards share: options, the session, the retry loop and reply checks."""

    name = "remote"

    def __init__(
        self,
        url: str,
        key: str,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        max_concurrency: int,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.url = _check_url(self.name, url)
        checks = [
            ("key", key, isinstance(key, str) and bool(key), "a non-empty string"),
            ("timeout_s", timeout_s, _is_number(timeout_s) and timeout_s > 0, "a number > 0"),
            ("retries", retries, _is_int(retries) and retries >= 0, "an integer >= 0"),
            ("backoff_s", backoff_s, _is_number(backoff_s) and backoff_s >= 0, "a number >= 0"),
            (
                "max_concurrency",
                max_concurrency,
                _is_int(max_concurrency) and max_concurrency >= 1,
                "an integer >= 1",
            ),
            (
                "headers",
                headers,
                headers is None or _is_str_mapping(headers),
                "a mapping of strings to strings",
            ),
        ]
        for option, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"reward {self.name!r}: option {option} must be {allowed}, got {value!r}")
        self.key = key
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_concurrency = max_concurrency
        self.headers = dict(headers or {})
        self._http: aiohttp.ClientSession | None = None
        self._gate: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def aclose(self) -> None:
        """Close the HTTP session (call it in the event loop that used the reward; safe to call twice)."""
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = self._gate = self._loop = None

    # -- transport

    def _session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._loop is not loop:
            # A session (and its connections) belongs to the loop that opened it; one from an
            # earlier loop cannot be used or awaited here, so it is replaced.
            connector = aiohttp.TCPConnector(limit=0)  # the semaphore below bounds concurrency
            self._http = aiohttp.ClientSession(connector=connector, headers=self.headers)
            self._gate = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        assert self._gate is not None
        return self._http, self._gate

    async def _post(self, payload: dict[str, Any], where: str) -> Any:
        """POST ``payload`` with retries; the decoded JSON reply of the first attempt that gets one."""
        import aiohttp

        try:
            body = json.dumps(payload, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward {self.name!r}: {where} cannot be sent as JSON: {exc}") from None
        session, gate = self._session()
        headers = {"Content-Type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        attempts = self.retries + 1
        cause = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                # The timeout starts once a slot is free: a queue on our side is not the service's fault.
                async with gate, session.post(self.url, data=body, headers=headers, timeout=timeout) as reply:
                    status, content = reply.status, await reply.read()
            except TimeoutError:
                cause = f"no reply within timeout_s={self.timeout_s:g}"
                continue
            except aiohttp.ClientError as exc:
                cause = f"{type(exc).__name__}: {exc}"
                continue
            if status == 429 or status >= 500:
                cause = f"HTTP {status}: {_snippet(content)}"
                continue
            if not 200 <= status < 300:
                raise RemoteRewardError(
                    f"reward {self.name!r}: {self.url} refused {where} with HTTP {status} (not retried): "
                    f"{_snippet(content)}"
                )
            return self._decode(content, where)
        raise RemoteRewardError(
            f"reward {self.name!r}: {self.url} gave no score for {where} after {attempts} attempt(s); "
            f"last error: {cause}"
        )

    # -- replies

    def _decode(self, content: bytes, where: str) -> Any:
        try:
            return json.loads(content)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RemoteRewardError(
                f"reward {self.name!r}: {self.url} answered {where} with a body that is not JSON: "
                f"{_snippet(content)}"
            ) from None

    def _field(self, reply: Any, where: str) -> Any:
        """``reply[key]`` for an object reply; any other reply is returned as is."""
        if not isinstance(reply, dict):
            return reply
        if self.key not in reply:
            raise RemoteRewardError(
                f"reward {self.name!r}: the reply of {self.url} for {where} has no field {self.key!r} "
                f"(fields: {', '.join(map(str, reply)) or 'none'}); set rollout.reward_options.key"
            )
        return reply[self.key]

    def _score(self, value: Any, where: str) -> float:
        if not _is_number(value):
            raise RemoteRewardError(
                f"reward {self.name!r}: {self.url} returned {_snippet(json.dumps(value).encode())} "
                f"for {where}, not a finite number"
            )
        return float(value)


class RemoteOptions(ComponentOptions):
    url: str = Field(description="the reward service's endpoint (http or https)")
    key: str = Field("score", description="the field of the reply that holds the score")
    timeout_s: float = Field(30.0, description="seconds one request may take")
    retries: int = Field(3, description="retries of a failed request (>= 0)")
    backoff_s: float = Field(0.5, description="first wait between retries, doubled each time")
    max_concurrency: int = Field(64, description="requests in flight at once")
    headers: dict[str, str] | None = Field(None, description="extra HTTP headers (e.g. Authorization)")


class RemoteGroupOptions(RemoteOptions):
    key: str = Field("scores", description="the field of the reply that holds the list of scores")
    timeout_s: float = Field(60.0, description="seconds one request may take")
    max_concurrency: int = Field(16, description="requests in flight at once")


class RemoteReward(_RemoteScorer):
    """Scores each sample with one POST to ``url`` (see the module docstring for the protocol)."""

    name = "remote"
    Options = RemoteOptions

    def __init__(
        self,
        url: str,
        key: str = "score",
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 64,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(url, key, timeout_s, retries, backoff_s, max_concurrency, headers)

    async def __call__(self, sample: Sample) -> float:
        where = f"a sample of prompt {sample.prompt.index}"
        reply = await self._post(sample_payload(sample), where)
        return self._score(self._field(reply, where), where)


class RemoteGroupReward(_RemoteScorer):
    """Scores a whole group with one POST of ``{"samples": [...]}``; the reply holds one score per sample."""

    name = "remote_group"
    Options = RemoteGroupOptions
    group_reward = True  # the rollout calls it once per group with the group's finished samples

    def __init__(
        self,
        url: str,
        key: str = "scores",
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 16,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(url, key, timeout_s, retries, backoff_s, max_concurrency, headers)

    async def __call__(self, samples: list[Sample]) -> list[float]:
        where = f"the group of prompt {samples[0].prompt.index}" if samples else "an empty group"
        reply = await self._post({"samples": [sample_payload(s) for s in samples]}, where)
        scores = self._field(reply, where)
        if not isinstance(scores, list) or len(scores) != len(samples):
            got = (
                f"{len(scores)} scores" if isinstance(scores, list) else _snippet(json.dumps(scores).encode())
            )
            raise RemoteRewardError(
                f"reward {self.name!r}: {self.url} returned {got} for {where}; "
                f"expected a list of {len(samples)} scores, one per sample in the order sent"
            )
        return [self._score(value, where) for value in scores]


# ------------------------------------------------------------------------------ helpers


def _snippet(content: bytes, limit: int = 200) -> str:
    text = content.decode(errors="replace").strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _check_url(reward: str, url: Any) -> str:
    problem = None
    if not isinstance(url, str):
        problem = "is not a string"
    else:
        try:
            parts = urlsplit(url.strip())
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as exc:
            problem = f"cannot be parsed ({exc})"
        else:
            if parts.scheme not in ("http", "https"):
                problem = "must start with http:// or https://"
            elif not parts.hostname:
                problem = "has no host"
    if problem is not None:
        raise ConfigError(
            f"reward {reward!r}: option url {url!r} {problem}; give the service's address, "
            "e.g. url: http://127.0.0.1:8000/score"
        )
    return url.strip()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )
