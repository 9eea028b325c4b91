"""The client of a diffusion engine: what the diffusion rollout and the core's fleet talk to it with.

Beside the calls every path that talks to engines makes (health, weight version, pause / continue,
flush, abort, ``aclose``) it has :meth:`DiffusionClient.generate_trajectories` (one answer, unpacked
on a worker thread, off the event loop) and :meth:`DiffusionClient.stream_microgroups` (the
pipelined form: microgroups as the engine samples them, each unpacked in a decode worker process
while the next is still being sampled). The token calls of the core's ``EngineClient``
(``generate``, ``score``) are refused: these engines take prompt ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx

from miles.engines.client import EngineUnavailable, normalize_url, parse_weight_version
from miles.errors import EngineError
from miles.types import GenerateOutput, SamplingParams
from miles_diffusion.decode import DecodePool
from miles_diffusion.guidance import NO_GUIDANCE
from miles_diffusion.sampler import SamplerConfig
from miles_diffusion.wire import (
    EngineStreamError,
    FrameReader,
    Microgroup,
    TrajectoryBatch,
    WireError,
    unpack,
)


def _message(response: httpx.Response) -> str:
    try:
        data = json.loads(response.content)
    except ValueError:
        return response.text.strip()[:1000] or f"status {response.status_code}"
    if isinstance(data, dict):
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])
    return str(data)[:1000]


def _check_order(
    microgroup: Microgroup, number: int, offset: int, count: int, seeds: list[int], where: str
) -> None:
    """A frame must be the next microgroup, of the trajectories asked for, in the request's order."""
    batch_seeds = microgroup.batch.seeds
    if (
        microgroup.index != number
        or microgroup.count != count
        or microgroup.offset != offset
        or batch_seeds != [int(s) for s in seeds[offset : offset + len(batch_seeds)]]
        or not batch_seeds
    ):
        raise WireError(
            f"{where}: out-of-order or foreign frame: microgroup {microgroup.index} of {microgroup.count} at "
            f"offset {microgroup.offset} with {len(batch_seeds)} trajectories, expected microgroup {number} at "
            f"offset {offset}"
        )


class DiffusionClient:
    """Talks to one engine of the ``diffusion`` kind."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = normalize_url(url)
        self.timeout = timeout
        self._http: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"DiffusionClient({self.url!r})"

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:  # made on first use, on the loop that uses it
            self._http = httpx.AsyncClient(base_url=self.url, timeout=self.timeout, trust_env=False)
        return self._http

    async def _request(self, method: str, path: str, body: Any = None) -> httpx.Response:
        try:
            response = await self._client().request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(
                f"engine {self.url}{path}: cannot reach the engine: {exc!r}", url=self.url
            ) from exc
        if response.status_code >= 400:
            raise EngineError(f"engine {self.url}{path}: HTTP {response.status_code}: {_message(response)}")
        return response

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        response = await self._request(method, path, body)
        try:
            return response.json()
        except ValueError:
            return response.text

    # ------------------------------------------------------------ trajectories

    @staticmethod
    def _body(
        prompts: list[int],
        seeds: list[int],
        sampler: SamplerConfig,
        microgroup_size: int | None,
        stream: bool,
        texts: list[str] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompts": [int(p) for p in prompts],
            "seeds": [int(s) for s in seeds],
            "num_steps": sampler.num_steps,
            "noise_level": sampler.noise_level,
        }
        if sampler.guidance_scale != NO_GUIDANCE:  # an unguided request stays as it always was
            body["guidance_scale"] = sampler.guidance_scale
        if texts is not None:
            body["texts"] = [str(t) for t in texts]
        if microgroup_size is not None:
            body["microgroup_size"] = int(microgroup_size)
        if stream:
            body["stream"] = True
        return body

    async def generate_trajectories(
        self,
        prompts: list[int],
        seeds: list[int],
        sampler: SamplerConfig,
        microgroup_size: int | None = None,
        texts: list[str] | None = None,
    ) -> TrajectoryBatch:
        """One trajectory per prompt id, trajectory ``i`` drawn from ``seeds[i]``; the engine samples
        them ``microgroup_size`` at a time (default: all at once) and answers once all are drawn.
        ``texts``: each trajectory's prompt text, for an engine serving a text-prompted family (SD3)."""
        body = self._body(prompts, seeds, sampler, microgroup_size, stream=False, texts=texts)
        response = await self._request("POST", "/generate_trajectories", body)
        return await asyncio.to_thread(unpack, response.content)

    async def stream_microgroups(
        self,
        prompts: list[int],
        seeds: list[int],
        sampler: SamplerConfig,
        microgroup_size: int | None,
        decoder: DecodePool,
        texts: list[str] | None = None,
    ) -> AsyncIterator[Microgroup]:
        """The same trajectories as :meth:`generate_trajectories` with the same ``microgroup_size``,
        bit for bit, yielded microgroup by microgroup in order as soon as each is unpacked.

        A reader task takes frames off the socket as they arrive and hands each to ``decoder`` at
        once, so frame ``k + 1`` is read and unpacked while the caller works on ``k`` (and the
        engine samples ``k + 2``). Close the iterator (``contextlib.aclosing``) to stop early: the
        connection is dropped and the engine stops at its next microgroup."""
        body = self._body(prompts, seeds, sampler, microgroup_size, stream=True, texts=texts)
        where = f"engine {self.url}/generate_trajectories"
        pending: asyncio.Queue[Awaitable[Microgroup] | BaseException | None] = asyncio.Queue()

        async def read() -> None:
            reader = FrameReader(shared=True)
            try:
                async with self._client().stream("POST", "/generate_trajectories", json=body) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        raise EngineError(f"{where}: HTTP {response.status_code}: {_message(response)}")
                    async for chunk in response.aiter_raw():
                        for frame in reader.feed(chunk):
                            pending.put_nowait(asyncio.ensure_future(decoder.decode(frame)))
                reader.finish()
            except httpx.HTTPError as exc:
                pending.put_nowait(EngineUnavailable(f"{where}: the stream broke: {exc!r}", url=self.url))
            except WireError as exc:
                pending.put_nowait(WireError(f"{where}: {exc}"))
            except Exception as exc:
                pending.put_nowait(exc)
            finally:
                pending.put_nowait(None)

        reading = asyncio.create_task(read())
        expected = len(seeds)
        received = 0
        number = 0
        count: int | None = None
        try:
            while (item := await pending.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                index = f"{number}" if count is None else f"{number} of {count}"
                try:
                    microgroup = await item
                except EngineStreamError as exc:
                    raise EngineError(f"{where}: microgroup {index}: {exc}") from None
                except WireError as exc:
                    raise WireError(f"{where}: microgroup {index}: {exc}") from None
                count = microgroup.count if count is None else count
                _check_order(microgroup, number, received, count, seeds, where)
                received += len(microgroup.batch.seeds)
                number += 1
                yield microgroup
            if received != expected:
                raise WireError(f"{where}: the stream ended after {received} of {expected} trajectories")
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            while not pending.empty():  # frames decoded for nobody: stop them, and read their errors
                item = pending.get_nowait()
                if isinstance(item, asyncio.Future):
                    if item.done() and not item.cancelled():
                        item.exception()
                    item.cancel()

    # ------------------------------------------------------------ what the loop calls

    async def health(self, timeout: float = 5.0) -> bool:
        try:
            response = await self._client().get("/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def weight_version(self) -> int:
        data = await self._json("GET", "/get_weight_version")
        return parse_weight_version((data or {}).get("weight_version"), where=f"engine {self.url}")

    async def update_weight_version(self, version: int | str) -> None:
        await self._json("POST", "/update_weight_version", {"new_version": str(version)})

    async def get_model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await self._json("GET", "/get_model_info")
        return info

    async def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await self._json("GET", "/get_server_info")
        return info

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._json("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def abort_request(self, rid: str) -> None:
        await self._json("POST", "/abort_request", {"rid": rid})

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_routed_experts: bool = False,
        data_parallel_rank: int | None = None,
    ) -> GenerateOutput:
        raise EngineError(
            f"engine {self.url} is a diffusion engine: it takes prompt ids, not token ids "
            "(use the diffusion rollout, rollout.fn: diffusion)"
        )

    async def score(
        self,
        input_ids: list[int],
        *,
        start: int,
        temperature: float = 1.0,
        top_k: int = 0,
        token_ids: list[int] | list[list[int]] | None = None,
    ) -> Any:
        raise EngineError(f"engine {self.url} is a diffusion engine: it scores no token ids")

    async def aclose(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()
