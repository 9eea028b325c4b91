"""A recording stand-in for an SGLang server, for contract tests of Miles' engine client.

This is a MOCK of a service we cannot run here: SGLang's server needs CUDA kernels,
which these CPU machines lack (DESIGN.md §5). It is not used where the real thing
runs: the embedded engine tests drive the same client against a real server.

What it checks: every request our client sends must use one of SGLang's routes
with its HTTP method, and a body whose field names exist in SGLang's request
structs (``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
``UpdateWeightsFromTensorReqInput``, ``UpdateWeightVersionReqInput``,
``PauseGenerationReqInput``, ``AbortReq``; sampling parameters from
``python/sglang/srt/sampling/sampling_params.py``) with compatible types. An
unknown field is answered with SGLang's 400 error shape, so a drift in our
client fails the test. Answers are canned in SGLang's response shapes
(``http_server.py``). Input log-probs follow SGLang's scheduler: with
``logprob_start_len`` s, one entry per input position s..n-1, the first with a null
log-prob (and a null top-K / requested-ids list); the fake's values are canned
(position p scores ``-0.01 * p``; the top-K ids at p are ``p, p+1, ...``).
"""

from __future__ import annotations

import base64
import socket
import struct
import threading
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SGLangSamplingParams(_Strict):
    """The caller-facing fields of SGLang's SamplingParams."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None


class GenerateReqInput(_Strict):
    """The text-model subset of SGLang's GenerateReqInput fields."""

    rid: str | list[str] | None = None
    session_id: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    session_params: dict[str, Any] | None = None
    lora_path: str | None = None
    routing_key: str | None = None
    priority: int | None = None
    data_parallel_rank: int | None = None


class UpdateWeightFromDiskReqInput(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class InitWeightsUpdateGroupReqInput(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupReqInput(_Strict):
    group_name: str = "weight_update_group"


class UpdateWeightsFromTensorReqInput(_Strict):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None


class UpdateWeightVersionReqInput(_Strict):
    new_version: str
    abort_all_requests: bool = False


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReq(_Strict):
    rid: str | None = None
    abort_all: bool = False


def _input_logprobs(body: GenerateReqInput, prompt: list[int]) -> dict[str, Any]:
    """SGLang's input log-prob fields (canned values, SGLang's layout)."""
    start = len(prompt) - 1 if body.logprob_start_len in (None, -1) else body.logprob_start_len
    positions = range(start, len(prompt))
    meta: dict[str, Any] = {
        "input_token_logprobs": [[None if p == start else -0.01 * p, prompt[p], None] for p in positions]
    }
    k = body.top_logprobs_num or 0
    if k > 0:
        meta["input_top_logprobs"] = [
            None if p == start else [[-0.1 * (j + 1), p + j, None] for j in range(k)] for p in positions
        ]
        meta["output_top_logprobs"] = []
    if body.token_ids_logprob is not None:
        ids = body.token_ids_logprob
        meta["input_token_ids_logprobs"] = [
            None if p == start else [[-0.2 * (j + 1), t, None] for j, t in enumerate(ids)] for p in positions
        ]
        meta["output_token_ids_logprobs"] = []
    return meta


class FakeSGLang:
    """Serves a FastAPI app on 127.0.0.1 in a thread; ``requests`` lists (method, path, body)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.weight_version = "default"
        self.num_layers, self.topk = 2, 3
        self.next_error: tuple[int, dict[str, Any]] | None = None
        self.app = self._build()
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bodies(self, path: str) -> list[Any]:
        return [body for _, p, body in self.requests if p == path]

    def _build(self) -> FastAPI:
        app = FastAPI()
        fake = self

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            raw = await request.body()
            import json

            body = json.loads(raw) if raw else None
            fake.requests.append((request.method, request.url.path, body))
            if fake.next_error is not None and request.url.path != "/health":
                code, payload = fake.next_error
                fake.next_error = None
                return JSONResponse(payload, status_code=code)
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return JSONResponse(
                {"object": "error", "message": str(exc.errors()), "type": "Bad Request", "code": 400},
                status_code=400,
            )

        @app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("")

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(body: GenerateReqInput) -> dict[str, Any]:
            prompt = body.input_ids or []
            out = [int(t) + 1 for t in prompt[-2:]]  # a deterministic "completion"
            if body.sampling_params is not None and body.sampling_params.max_new_tokens == 0:
                out = []
            meta: dict[str, Any] = {
                "id": body.rid or "r",
                "finish_reason": {"type": "length", "length": len(out)},
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "e2e_latency": 0.01,
                "weight_version": fake.weight_version,
            }
            if body.return_logprob:
                meta["output_token_logprobs"] = [[-0.5 * (i + 1), t, None] for i, t in enumerate(out)]
                meta.update(_input_logprobs(body, prompt))
            if body.return_routed_experts:
                # SGLang: int32 little-endian, (prompt + output - 1) rows x layers x topk, no shape field.
                rows = len(prompt) + len(out) - 1
                values = [
                    r * 100 + layer * 10 + k
                    for r in range(rows)
                    for layer in range(fake.num_layers)
                    for k in range(fake.topk)
                ]
                meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()
            return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}

        @app.get("/get_weight_version")
        async def get_weight_version() -> dict[str, Any]:
            return {"weight_version": fake.weight_version}

        @app.get("/get_model_info")
        async def get_model_info() -> dict[str, Any]:
            return {
                "model_path": "m",
                "tokenizer_path": "m",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": fake.weight_version,
            }

        @app.get("/get_server_info")
        async def get_server_info() -> dict[str, Any]:
            return {"version": "fake", "internal_states": []}

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache() -> PlainTextResponse:
            return PlainTextResponse("Cache flushed.\n")

        @app.post("/pause_generation")
        async def pause_generation(body: PauseGenerationReqInput) -> dict[str, Any]:
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation(body: dict[str, Any] | None = None) -> dict[str, Any]:
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.post("/abort_request")
        async def abort_request(body: AbortReq) -> PlainTextResponse:
            return PlainTextResponse("")

        @app.post("/update_weight_version")
        async def update_weight_version(body: UpdateWeightVersionReqInput) -> dict[str, Any]:
            fake.weight_version = body.new_version
            return {"success": True, "message": "ok", "new_version": body.new_version}

        def updated(version: str | None) -> dict[str, Any]:
            if version is not None:
                fake.weight_version = version
            return {"success": True, "message": "Succeeded."}

        @app.post("/update_weights_from_disk")
        async def from_disk(body: UpdateWeightFromDiskReqInput) -> dict[str, Any]:
            return {**updated(body.weight_version), "num_paused_requests": 0}

        @app.post("/init_weights_update_group")
        async def init_group(body: InitWeightsUpdateGroupReqInput) -> dict[str, Any]:
            return {"success": True, "message": "Succeeded."}

        @app.post("/update_weights_from_distributed")
        async def from_distributed(body: UpdateWeightsFromDistributedReqInput) -> dict[str, Any]:
            return updated(body.weight_version)

        @app.post("/destroy_weights_update_group")
        async def destroy_group(body: DestroyWeightsUpdateGroupReqInput) -> dict[str, Any]:
            return {"success": True, "message": "Succeeded."}

        @app.post("/update_weights_from_tensor")
        async def from_tensor(body: UpdateWeightsFromTensorReqInput) -> dict[str, Any]:
            return updated(body.weight_version)

        return app

    def __enter__(self) -> FakeSGLang:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="error", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake SGLang server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
