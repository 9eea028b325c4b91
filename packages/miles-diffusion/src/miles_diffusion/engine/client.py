"""The client of a diffusion engine: what the diffusion rollout and the core's fleet talk to it with.

Beside the calls every path that talks to engines makes (health, weight version, pause / continue,
flush, abort, ``aclose``) it has :meth:`DiffusionClient.generate_trajectories`. The token calls of the
core's ``EngineClient`` (``generate``, ``score``) are refused: these engines take prompt ids.
Trajectories arrive as safetensors bytes and are unpacked on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from miles.engines.client import EngineUnavailable, normalize_url, parse_weight_version
from miles.errors import EngineError
from miles.types import GenerateOutput, SamplingParams
from miles_diffusion.sampler import SamplerConfig
from miles_diffusion.wire import TrajectoryBatch, unpack


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

    async def generate_trajectories(
        self, prompts: list[int], seeds: list[int], sampler: SamplerConfig
    ) -> TrajectoryBatch:
        """One trajectory per prompt id, trajectory ``i`` drawn from ``seeds[i]``."""
        body = {
            "prompts": [int(p) for p in prompts],
            "seeds": [int(s) for s in seeds],
            "num_steps": sampler.num_steps,
            "noise_level": sampler.noise_level,
        }
        response = await self._request("POST", "/generate_trajectories", body)
        return await asyncio.to_thread(unpack, response.content)

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
