"""An engine kind that speaks no HTTP at all: ``echo``, an in-process "engine" and its own client.

It shows what a third-party engine kind (a vLLM plugin, say) brings: a launcher that starts
(or attaches to) its engines and a ``client(url)`` that talks to them; Miles asks the kind for
its client wherever it talks to an engine (rollout, evaluation, served teachers, the session
server). The echo engine answers every request by repeating the prompt's last token, with
log-prob -1.0 per token, and tokenizes text with the tokenizer of the model it was started on.

Every client it makes is kept in ``CLIENTS`` (with the calls it served), so a test can see
which paths used the kind's own client.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from miles.capabilities import ComponentOptions, EngineCapabilities
from miles.interfaces import EngineSpec
from miles.types import GenerateOutput, SamplingParams

CLIENTS: list[EchoClient] = []
MODELS: dict[str, str] = {}  # URL -> the model directory its engine was started on (for the tokenizer)
VERSIONS: dict[str, int] = {}  # URL -> the weight version the engine serves


class EchoOptions(ComponentOptions):
    """``engine.options`` of the echo kind (the driver adds device, dtype, ... to each spec itself)."""

    url: str | None = Field(None, description="the echo:// address to attach to")
    weight_version: int | None = Field(None, ge=0, description="the weight version it starts at")


class EchoEngines:
    """The ``echo`` engine kind: ``launch`` gives each spec an ``echo://`` address; nothing is spawned."""

    capabilities = EngineCapabilities()
    Options = EchoOptions

    def launch(self, specs: list[EngineSpec], log_dir: str) -> list[str]:
        urls = []
        for i, spec in enumerate(specs):
            url = str(spec.options.get("url") or f"echo://{len(MODELS) + i}")
            MODELS[url] = str(spec.model_path)
            VERSIONS.setdefault(url, int(spec.options.get("weight_version") or 0))
            urls.append(url)
        return urls

    def client(self, url: str) -> EchoClient:
        client = EchoClient(url)
        CLIENTS.append(client)
        return client

    def shutdown(self) -> None:
        pass


class EchoClient:
    """Talks to one echo engine (in this process): generate, score, tokenize, versions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[str] = []
        self._tokenizer: Any = None

    def __repr__(self) -> str:
        return f"EchoClient({self.url!r})"

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_routed_experts: bool = False,
        data_parallel_rank: int | None = None,
    ) -> GenerateOutput:
        self.calls.append("generate")
        n = params.max_new_tokens
        version = VERSIONS.get(self.url, 0)
        return GenerateOutput(
            output_ids=[input_ids[-1]] * n,
            output_logprobs=[-1.0] * n,
            finish_reason="length",
            weight_version=version,
            prompt_tokens=len(input_ids),
            output_weight_versions=[version] * n,
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
        from miles.engines.client import ScoreOutput

        self.calls.append("score")
        return ScoreOutput(logprobs=[-1.0] * (len(input_ids) - start))

    async def tokenize(self, text: str) -> list[int]:
        self.calls.append("tokenize")
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(MODELS[self.url])
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    async def get_server_info(self) -> dict[str, Any]:
        self.calls.append("get_server_info")
        return {"dp_size": 1}

    async def health(self) -> bool:
        return True

    async def weight_version(self) -> int:
        self.calls.append("weight_version")
        return VERSIONS.get(self.url, 0)

    async def update_weight_version(self, version: int) -> None:
        VERSIONS[self.url] = int(version)

    async def pause_generation(self) -> None:
        self.calls.append("pause_generation")

    async def continue_generation(self) -> None:
        self.calls.append("continue_generation")

    async def flush_cache(self) -> None:
        pass

    async def abort_request(self, rid: str) -> None:
        pass

    async def aclose(self) -> None:
        self.calls.append("aclose")
