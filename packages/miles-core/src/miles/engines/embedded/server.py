"""HTTP surface of the embedded engine: the subset of SGLang's native API Miles uses.

Routes, request bodies and answers follow SGLang's names (see
``miles.engines.client`` for the list), so one client drives both. Bodies are
validated strictly: a field this engine does not implement is a 400 naming it,
not silently ignored. Errors look like SGLang's: generation errors are
``{"object": "error", "message", "type", "code"}``; weight and control errors are
``{"success": false, "message"}``; both with HTTP 400.

Weight updates are all-or-nothing (see ``miles.engines.embedded.weights``): the
buckets of a broadcast or hand-off update are staged until the one carrying
``weight_version`` commits them together. Miles extensions, not in SGLang:
``bucket_index`` on those two calls and our own ``/weights_checker`` (patched SGLang
builds have an endpoint of that name with other actions). The endpoints of other
transports (disk-delta, p2p, ...) come from the receivers installed with them, mounted
by :func:`create_app` (see ``miles.engines.embedded.receivers``); each receiver's launch
options are flags of this command.

The engine keeps a prefix cache (see ``miles.engines.embedded.prefix_cache``; on the
paged KV path ``miles.engines.embedded.paged.radix``, whose entries are KV blocks):
``meta_info.cached_tokens`` says how many prompt tokens a request took from it;
``/flush_cache`` empties it, and so does every weight change. It has one
data-parallel rank: ``data_parallel_rank`` on ``/generate`` may be null or 0.

With the paged KV cache (``--kv-cache``, see ``docs/engine.md``),
``/release_memory_occupation`` frees the KV pool (running requests are retracted and
wait) and ``/resume_memory_occupation`` allocates it again (SGLang's names; only the
``kv_cache`` tag: the weights stay on the device).

Run: ``python -m miles.engines.embedded --model PATH [--host 127.0.0.1] [--port P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles.engines.client import HANDOFF_LOAD_FORMAT
from miles.engines.embedded.receivers import InstalledReceivers, installed_receivers
from miles.engines.process import exit_with_parent, listen

log = logging.getLogger("miles.engines.embedded")


# ------------------------------------------------------------------ bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# SGLang sampling parameters this engine does not implement; they are accepted only at their defaults.
_DEFAULT_ONLY: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "no_stop_trim": False,
    "spaces_between_special_tokens": True,
}


class SamplingParamsBody(_Body):
    """The sampling parameters this engine implements (SGLang names and defaults)."""

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 disables top-k")
    stop_token_ids: list[int] | None = Field(None, description="generation stops after any of these")
    sampling_seed: int | None = Field(None, description="per-request seed; makes sampling deterministic")
    ignore_eos: bool = Field(False, description="do not stop on the model's EOS ids")
    skip_special_tokens: bool = Field(True, description="only affects the rendered text")
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or at least 1")
        return v

    @model_validator(mode="after")
    def _defaults_only(self) -> SamplingParamsBody:
        for name, default in _DEFAULT_ONLY.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported by the embedded engine (only {default!r})"
                )
        return self


class GenerateBody(_Body):
    """SGLang's ``GenerateReqInput`` for one prompt (token ids or text).

    Log-prob options (only with ``return_logprob``, as in SGLang): ``logprob_start_len`` s
    reports ``input_token_logprobs`` for input positions s..n-1 (the first entry is null;
    -1: the last position only); ``top_logprobs_num`` K adds ``input_top_logprobs`` and
    ``output_top_logprobs``; ``token_ids_logprob`` adds ``input_token_ids_logprobs`` and
    ``output_token_ids_logprobs``. Log-probs are taken at the request's temperature
    (``log_softmax(logits / T)``; T = 0 scores at T = 1).
    """

    input_ids: list[int] | None = Field(None, min_length=1, description="prompt token ids")
    text: str | None = Field(
        None, description="prompt text, tokenized with the engine's tokenizer (as SGLang)"
    )
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = Field(
        -1, ge=-1, description="first input position whose log-prob is returned (-1: the last one only)"
    )
    top_logprobs_num: int = Field(0, description="K: the top K log-probs at every returned position")
    token_ids_logprob: list[int] | list[list[int]] | None = Field(
        None,
        description="ids whose log-probs are returned at every position (SGLang); extension: one id list per "
        "returned input position (n - logprob_start_len lists), for scoring calls (max_new_tokens 0)",
    )
    rid: str | None = None
    lora_path: str | None = Field(
        None, description="the name of a loaded LoRA adapter to generate with (SGLang); null: the base model"
    )
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(
        0, ge=0, description="first consumed position whose routing is returned (0: the whole sequence)"
    )
    stream: bool = False
    data_parallel_rank: int | None = Field(
        None, description="SGLang's data-parallel rank to run on; this engine has one (dp_size 1): null or 0"
    )

    @field_validator("data_parallel_rank")
    @classmethod
    def _one_rank(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError(
                f"data_parallel_rank {v} does not exist: the embedded engine has one data-parallel rank "
                "(dp_size 1); send 0 or leave it out"
            )
        return v

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by the embedded engine")
        return v

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_logprobs_num must be 0 (none) or a positive number of log-probs, got {v}")
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids and text")
        return self


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortBody(_Body):
    rid: str | None = ""
    abort_all: bool = False


class WeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = False


class _UpdateBody(_Body):
    weight_version: str | None = Field(
        None, description="becomes the engine's version once the update succeeds"
    )
    flush_cache: bool = Field(
        True,
        description="accepted; the embedded engine empties its prefix cache on every weight change regardless "
        "(KV computed by old weights is never reused)",
    )
    abort_all_requests: bool = False


class _BucketBody(_UpdateBody):
    weight_version: str | None = Field(
        None,
        description="set on an update's last bucket only: commits every staged bucket plus this one, then "
        "becomes the engine's version; a bucket without it is staged, invisible to generation",
    )
    bucket_index: int | None = Field(
        None,
        ge=0,
        description="Miles extension: this bucket's position in its update (0 for the first); lets the engine "
        "tell a new update from the rest of a dropped one",
    )


class UpdateFromDiskBody(_UpdateBody):
    model_path: str
    load_format: str | None = None


class InitGroupBody(_Body):
    master_address: str
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=1, description="this engine's rank; the trainer's rank 0 sends")
    world_size: int = Field(..., ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateFromDistributedBody(_BucketBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str | None = None


class DestroyGroupBody(_Body):
    group_name: str = "weight_update_group"


class UpdateFromTensorBody(_BucketBody):
    serialized_named_tensors: list[str] = Field(
        ..., min_length=1, description="safetensors file names inside the hand-off directory"
    )
    load_format: str | None = None


class MemoryOccupationBody(_Body):
    tags: list[str] | None = Field(
        None, description="SGLang's tags; this engine frees the KV cache only: null or ['kv_cache']"
    )

    @field_validator("tags")
    @classmethod
    def _kv_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and set(v) - {"kv_cache"}:
            raise ValueError(
                f"tags {sorted(set(v) - {'kv_cache'})} are not supported: the embedded engine releases the KV "
                "cache only (tags null or ['kv_cache']); its weights stay on the device"
            )
        return v


class WeightsCheckerBody(_Body):
    action: Literal["reset_tensors", "checksum"]
    skip: list[str] = Field(default_factory=list, description="state-dict names to leave alone / leave out")
    seed: int = Field(0, description="reset_tensors: seed of the random values")
    lora_name: str | None = Field(
        None, description="Miles extension: only this loaded LoRA adapter's tensors (the base is left alone)"
    )


class LoadLoraBody(_Body):
    lora_name: str = Field(..., min_length=1, description="the name requests use (lora_path on /generate)")
    lora_path: str = Field(..., min_length=1, description="a peft adapter directory on the engine's machine")


class UnloadLoraBody(_Body):
    lora_name: str = Field(..., min_length=1)


# ------------------------------------------------------------------- app


def _gen_error(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequest", "code": code}, status_code=code
    )


def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def _fail(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=code)


def create_app(engine: Any, receivers: InstalledReceivers | None = None) -> FastAPI:
    """The FastAPI app around a started :class:`~miles.engines.embedded.engine.EmbeddedEngine`.

    ``receivers``: the transports' receivers to mount (default: every installed one).
    """
    from miles.engines.embedded.lora import LoraError
    from miles.engines.embedded.weights import WeightUpdateError

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(
        title="Miles embedded rollout engine",
        lifespan=lifespan,
        description="A Hugging Face transformers model behind the subset of SGLang's native HTTP API "
        "that Miles uses.",
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{where}: {err.get('msg')}")
        message = f"invalid request to {request.url.path}: " + "; ".join(parts)
        if request.url.path == "/generate":
            return _gen_error(message)
        return _fail(message)

    # -------------------------------------------------------- generation

    @app.post("/generate", summary="Generate from input_ids or text, or score them (SGLang /generate)")
    async def generate(body: GenerateBody) -> Any:
        sp = body.sampling_params
        if body.rid and engine.scheduler.has_rid(body.rid):
            return _gen_error(f"a request with rid {body.rid!r} is already in flight")
        try:
            req = engine.make_request(
                input_ids=body.input_ids,
                text=body.text,
                rid=body.rid,
                max_new_tokens=sp.max_new_tokens,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                stop_token_ids=sp.stop_token_ids or [],
                seed=sp.sampling_seed,
                ignore_eos=sp.ignore_eos,
                return_logprob=body.return_logprob,
                return_routed_experts=body.return_routed_experts,
                routed_experts_start_len=body.routed_experts_start_len,
                logprob_start_len=body.logprob_start_len,
                top_logprobs_num=body.top_logprobs_num,
                token_ids_logprob=body.token_ids_logprob,
                lora=body.lora_path,
            )
        except ValueError as exc:
            return _gen_error(str(exc))
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_done(r: Any) -> None:
            def settle() -> None:
                if not done.done():
                    done.set_result(r)

            loop.call_soon_threadsafe(settle)

        req.on_done = on_done
        try:
            engine.scheduler.submit(req)
        except (ValueError, RuntimeError) as exc:
            return _gen_error(str(exc))
        try:
            await done
        except asyncio.CancelledError:
            engine.scheduler.request_abort_nowait(req.rid)
            raise
        if req.error is not None:
            return _gen_error(f"generation failed: {req.error}", code=500)
        return engine.render(
            req,
            return_text_in_logprobs=body.return_text_in_logprobs,
            skip_special_tokens=sp.skip_special_tokens,
        )

    # ----------------------------------------------------------- status

    @app.get("/health", summary="200 while the scheduler runs")
    @app.get("/health_generate", summary="same as /health")
    async def health() -> PlainTextResponse:
        if engine.scheduler.is_alive():
            return PlainTextResponse("ok")
        return PlainTextResponse("scheduler stopped", status_code=503)

    @app.get("/get_model_info")
    @app.get("/model_info", include_in_schema=False)
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    @app.get("/server_info", include_in_schema=False)
    async def server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionBody) -> Any:
        if body.abort_all_requests:
            await asyncio.to_thread(engine.scheduler.abort, abort_all=True)
        engine.set_weight_version(body.new_version)
        return _ok(f"Weight version updated to {body.new_version}", new_version=body.new_version)

    # ---------------------------------------------------------- control

    @app.api_route(
        "/flush_cache",
        methods=["GET", "POST"],
        summary="Empty the prefix cache (between two scheduler steps; requests in flight go on)",
    )
    async def flush_cache() -> PlainTextResponse:
        dropped = await asyncio.to_thread(engine.flush_cache)
        return PlainTextResponse(f"Cache flushed ({dropped} prefix-cache entries dropped).\n")

    @app.post("/pause_generation", summary="Pause: mode abort | retract | in_place")
    async def pause_generation(body: Annotated[PauseBody | None, Body()] = None) -> dict[str, Any]:
        mode = body.mode if body is not None else "abort"
        await asyncio.to_thread(engine.scheduler.pause, mode)
        return {"message": f"Generation paused (mode {mode}).", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(body: Annotated[dict[str, Any] | None, Body()] = None) -> dict[str, Any]:
        engine.scheduler.resume()
        return {"message": "Generation continued.", "status": "ok"}

    @app.post(
        "/release_memory_occupation",
        summary="Free the KV pool (paged KV cache only); running requests are retracted and wait",
    )
    async def release_memory_occupation(body: Annotated[MemoryOccupationBody | None, Body()] = None) -> Any:
        try:
            freed = await asyncio.to_thread(engine.release_memory)
        except (ValueError, RuntimeError) as exc:
            return _fail(str(exc))
        return _ok(f"Released the KV cache ({freed} bytes).", freed_bytes=freed)

    @app.post("/resume_memory_occupation", summary="Allocate the KV pool again after a release")
    async def resume_memory_occupation(body: Annotated[MemoryOccupationBody | None, Body()] = None) -> Any:
        try:
            await asyncio.to_thread(engine.resume_memory)
        except (ValueError, RuntimeError) as exc:
            return _fail(str(exc))
        return _ok("Resumed the KV cache.")

    @app.post("/abort_request", summary="Abort one request by rid, or all")
    async def abort_request(body: AbortBody) -> Any:
        if not body.abort_all and not body.rid:
            return _fail("abort_request needs a rid or abort_all: true")
        n = await asyncio.to_thread(engine.scheduler.abort, body.rid, abort_all=body.abort_all)
        return {"success": True, "aborted": n}

    # ---------------------------------------------------------- weights

    async def _update(work: Any, *, abort_all_requests: bool = False) -> Any:
        """Run ``work()`` (a weight change that returns an answer) off the event loop; map refusals to 400."""
        if abort_all_requests:
            await asyncio.to_thread(engine.scheduler.abort, abort_all=True)
        try:
            return await asyncio.to_thread(work)
        except WeightUpdateError as exc:
            return _fail(f"weights not updated: {exc}")
        except Exception as exc:
            log.exception("weight update failed")
            return _fail(f"weights not updated: {type(exc).__name__}: {exc}", code=500)

    def _version_note(version: str | None) -> str:
        return f" Weight version updated to {version}." if version is not None else ""

    async def _bucket_update(body: _BucketBody, read: Any) -> Any:
        def work() -> dict[str, Any]:
            outcome = engine.weights.update_bucket(
                read, weight_version=body.weight_version, bucket_index=body.bucket_index
            )
            return _ok(
                outcome.message + _version_note(body.weight_version),
                num_paused_requests=0,
                committed=outcome.committed,
            )

        return await _update(work, abort_all_requests=body.abort_all_requests)

    @app.post("/update_weights_from_disk", summary="Load a whole checkpoint directory, all-or-nothing")
    async def update_weights_from_disk(body: UpdateFromDiskBody) -> Any:
        if body.load_format not in (None, "auto", "safetensors"):
            return _fail(f"load_format {body.load_format!r} is not supported; use 'auto' or 'safetensors'")

        def work() -> dict[str, Any]:
            n = engine.weights.update(lambda: engine.weights.read_disk(body.model_path), body.weight_version)
            return _ok(f"Updated {n} tensors.{_version_note(body.weight_version)}", num_paused_requests=0)

        return await _update(work, abort_all_requests=body.abort_all_requests)

    @app.post(
        "/update_weights_from_tensor", summary="Load one bucket from hand-off files (staged until the last)"
    )
    async def update_weights_from_tensor(body: UpdateFromTensorBody) -> Any:
        if body.load_format != HANDOFF_LOAD_FORMAT:
            return _fail(
                f"load_format {body.load_format!r} is not accepted: the embedded engine never unpickles network "
                f"payloads; send load_format {HANDOFF_LOAD_FORMAT!r} with safetensors file names in the hand-off "
                "directory"
            )
        return await _bucket_update(body, lambda: engine.weights.read_handoff(body.serialized_named_tensors))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupBody) -> Any:
        from miles.engines.weight_group import create_weight_group
        from miles.errors import EngineError

        if body.group_name in engine.weights.groups:
            return _fail(f"weight group {body.group_name!r} already exists; destroy it first")
        if body.rank_offset >= body.world_size:
            return _fail(f"rank_offset {body.rank_offset} is outside a world of size {body.world_size}")
        if body.backend == "nccl" and engine.device.type != "cuda":
            return _fail(f"backend 'nccl' needs a CUDA engine; this one runs on {engine.device}; use 'gloo'")
        device = str(engine.device) if body.backend == "nccl" else "cpu"
        try:
            group = await asyncio.to_thread(
                create_weight_group,
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                group_name=body.group_name,
                backend=body.backend,
                device=device,
            )
        except EngineError as exc:
            return _fail(str(exc))
        engine.weights.groups[body.group_name] = group
        return _ok(
            f"Joined weight group {body.group_name!r} as rank {body.rank_offset} of {body.world_size}."
        )

    @app.post(
        "/update_weights_from_distributed",
        summary="Receive one bucket over a weight group (staged until the last)",
    )
    async def update_weights_from_distributed(body: UpdateFromDistributedBody) -> Any:
        group = engine.weights.groups.get(body.group_name)
        if group is None:
            known = sorted(engine.weights.groups) or "none"
            return _fail(
                f"no weight group {body.group_name!r} (groups: {known}); call /init_weights_update_group"
            )
        from miles.engines.weight_group import FLAT_LOAD_FORMAT

        if body.load_format not in (None, FLAT_LOAD_FORMAT):
            return _fail(
                f"load_format {body.load_format!r} is not supported here; use none (a broadcast per tensor) or "
                f"{FLAT_LOAD_FORMAT!r} (one broadcast of the bucket's bytes)"
            )
        flat = body.load_format == FLAT_LOAD_FORMAT
        return await _bucket_update(
            body, lambda: engine.weights.receive(group, body.names, body.dtypes, body.shapes, flat=flat)
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyGroupBody) -> Any:
        group = engine.weights.groups.pop(body.group_name, None)
        if group is None:
            return _fail(f"no weight group {body.group_name!r}")
        await asyncio.to_thread(group.destroy)
        return _ok(f"Destroyed weight group {body.group_name!r}.")

    @app.post(
        "/weights_checker",
        summary="Miles' weight checker: reset_tensors (seeded noise) or checksum ({name: {dtype, shape, digest}})",
        description="reset_tensors fills every floating-point parameter and persistent buffer not in skip with "
        "standard-normal values from seed (the weight version is unchanged), so a later update that misses a "
        "tensor is caught. checksum answers {name: {dtype, shape, digest}} for every state-dict tensor not in "
        "skip, digest being xxh3_128 of its raw bytes (miles.engines.digest.tensor_digest). Tied tensors "
        "appear once, under their first state_dict name (e.g. model.embed_tokens.weight, not lm_head.weight).",
    )
    async def weights_checker(body: WeightsCheckerBody) -> Any:
        try:
            only = None if body.lora_name is None else engine.lora_tensor_names(body.lora_name)
            if body.action == "checksum":
                return await asyncio.to_thread(engine.weights.checksums, body.skip, only)
            reset, untouched = await asyncio.to_thread(
                engine.weights.reset_tensors, body.skip, body.seed, only
            )
        except (WeightUpdateError, LoraError) as exc:
            return _fail(f"weights_checker {body.action}: {exc}")
        return _ok(
            f"Filled {len(reset)} tensors with random values (seed {body.seed}); left {len(untouched)} alone.",
            reset=reset,
            untouched=untouched,
        )

    @app.post("/load_lora_adapter", summary="Load a peft LoRA adapter directory under a name (SGLang)")
    async def load_lora_adapter(body: LoadLoraBody) -> Any:
        try:
            info = await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path)
        except LoraError as exc:
            return _fail(f"load_lora_adapter: {exc}")
        return _ok(f"Loaded LoRA adapter {body.lora_name!r}.", adapter=info)

    @app.post("/unload_lora_adapter", summary="Forget a loaded LoRA adapter (SGLang)")
    async def unload_lora_adapter(body: UnloadLoraBody) -> Any:
        try:
            await asyncio.to_thread(engine.unload_lora_adapter, body.lora_name)
        except LoraError as exc:
            return _fail(f"unload_lora_adapter: {exc}")
        return _ok(f"Unloaded LoRA adapter {body.lora_name!r}.")

    _mount_receivers(app, engine, installed_receivers() if receivers is None else receivers)
    return app


def _mount_receivers(app: FastAPI, engine: Any, receivers: InstalledReceivers) -> None:
    """Add the routes of every installed receiver; one that failed to load is logged, not fatal."""
    for name, why in sorted(receivers.broken.items()):
        log.warning("engine receiver %r is not available: %s", name, why)
    given = engine.options.receiver_options
    for name, receiver in sorted(receivers.loaded.items()):
        receiver.mount(app, engine, {o.name: given.get(o.name) for o in receiver.options})
        log.debug("mounted engine receiver %r", name)


# ------------------------------------------------------------------ main


def _parser(receivers: InstalledReceivers | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m miles.engines.embedded",
        description="Miles embedded rollout engine (SGLang-compatible HTTP API)",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument(
        "--handoff-dir", default=None, help="directory of safetensors hand-off files (colocated updates)"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: $MILES_TORCH_THREADS, else torch's default)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for requests without sampling_seed")
    p.add_argument("--weight-version", default="0", help="initial weight version")
    p.add_argument(
        "--update-timeout-s",
        type=float,
        default=300.0,
        help="drop a staged multi-bucket weight update when no bucket comes for this many seconds",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="most tokens of finished requests' KV kept for reuse by later requests with the same prefix "
        "(a session's next turn); 0 disables the prefix cache; unset: 65536 on the DynamicCache path, the "
        "whole KV pool on the paged path (its cached blocks are evicted whenever requests need them)",
    )
    p.add_argument(
        "--kv-cache",
        default="auto",
        choices=["auto", "paged", "dynamic"],
        help="paged: the fast path (paged KV pool, chunked prefill, CUDA graphs; Qwen2/Qwen3 dense); dynamic: "
        "a transformers DynamicCache per batch; auto: paged on CUDA where the model allows (docs/engine.md)",
    )
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.3,
        help="paged, CUDA: share of the GPU memory free after the model is loaded that the KV pool takes (the "
        "default leaves room for a colocated trainer; a dedicated engine can take 0.85)",
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="paged: a KV pool of this many token slots (needed on the CPU)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="paged: most prompt tokens one step prefills (0: 8192 on CUDA, 512 on the CPU)",
    )
    p.add_argument("--block-size", type=int, default=16, help="paged: tokens per KV block")
    p.add_argument("--no-cuda-graphs", action="store_true", help="paged: run the decode step eagerly")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="paged: read each decode step before launching the next (no host/device overlap)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="paged: LoRA adapters loaded at once (preallocated slots; a step with adapters costs two GEMMs of "
        "width max-loras x max-lora-rank per adapted linear)",
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=64, help="paged: the largest LoRA rank an adapter slot holds"
    )
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    for receiver in receivers.loaded.values() if receivers is not None else ():
        group = p.add_argument_group(f"{receiver.name} receiver")
        for option in receiver.options:
            group.add_argument(option.flag, dest=option.name, default=None, help=option.help)
    return p


def main(argv: list[str] | None = None) -> None:
    receivers = installed_receivers()
    args = _parser(receivers).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.update_timeout_s <= 0:
        raise SystemExit(
            f"miles embedded engine: --update-timeout-s must be > 0, got {args.update_timeout_s}"
        )
    if args.prefix_cache_tokens is not None and args.prefix_cache_tokens < 0:
        raise SystemExit(
            f"miles embedded engine: --prefix-cache-tokens must be >= 0 (0 disables), got {args.prefix_cache_tokens}"
        )
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(
            f"miles embedded engine: {args.model!r} is not a Hugging Face model directory (no config.json)"
        )
    # Claim the port before the (slow) model load, so a clash fails at once with a clear message.
    sock = listen(args.host, args.port, "miles embedded engine")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    import torch
    import uvicorn

    threads = args.torch_threads or int(os.environ.get("MILES_TORCH_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    options = EngineOptions(
        model_path=args.model,
        host=args.host,
        port=sock.getsockname()[1],
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        handoff_dir=args.handoff_dir,
        seed=args.seed,
        weight_version=args.weight_version,
        receiver_options={name: getattr(args, name) for name in receivers.option_names},
        update_timeout_s=args.update_timeout_s,
        prefix_cache_tokens=args.prefix_cache_tokens,
        kv_cache=args.kv_cache,
        mem_fraction=args.mem_fraction,
        kv_tokens=args.kv_tokens,
        chunk_tokens=args.chunk_tokens,
        block_size=args.block_size,
        cuda_graphs=not args.no_cuda_graphs,
        overlap=not args.no_overlap,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )
    t0 = time.monotonic()
    try:
        engine = EmbeddedEngine(options)
    except ValueError as exc:  # a refused configuration (e.g. --kv-cache paged for an MoE model)
        raise SystemExit(f"miles embedded engine: {exc}") from None
    engine.start()
    log.info(
        "model %s loaded on %s (%s) in %.1fs; serving on http://%s:%d",
        args.model,
        engine.device,
        engine.dtype,
        time.monotonic() - t0,
        args.host,
        options.port,
    )
    config = uvicorn.Config(
        create_app(engine, receivers),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=120,  # longer than the client's keep-alive expiry (see client._LIMITS)
    )
    uvicorn.Server(config).run(sockets=[sock])
