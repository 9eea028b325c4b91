"""The diffusion engine's process: one model, one HTTP API (FastAPI), requests taken in turn.

Endpoints (JSON bodies; errors are HTTP 400 with ``{"success": false, "message": ...}``):

- ``POST /generate_trajectories`` ``{prompts: [id], seeds: [int], num_steps, noise_level,
  microgroup_size?, stream?, texts?}``: one stochastic (SDE) trajectory per prompt, trajectory ``i`` drawn
  from ``seeds[i]`` alone. A text-prompted model (SD3, Wan) needs ``texts`` (trajectory ``i``'s prompt
  text; one text per id within a request) and its answer carries the final latents decoded by the
  model's VAE (``images``), since the client has no decoder; the tiny UNet takes bare ids. The prompts are encoded once per request; the trajectories are sampled
  in microgroups of ``microgroup_size`` (default: all at once), one after another, each reusing
  those encodings. The answer is a safetensors buffer (``miles_diffusion.wire``): every latent,
  every step's log-probability, the timesteps, and the weight version in its header. Raw bytes,
  never base64 or pickle. With ``stream: true`` each microgroup is sent as soon as it is sampled,
  a length-prefixed frame of its own, while the next is sampled.
- ``POST /update_weights_from_tensor``: the colocated transport's hand-off (safetensors files by
  bare name in ``--handoff-dir``), staged per bucket; the bucket carrying ``weight_version``
  commits the whole set, which must be the model's full state dict.
- ``POST /update_weights_from_disk`` ``{model_path, weight_version}``: a whole model directory (the
  fleet's catch-up of a restarted engine, from the trainer's export).
- ``POST /load_lora_adapter`` ``{lora_name, lora_path}``: a peft LoRA directory, merged into the base
  weights at once (``miles_diffusion.engine.merge``); later updates to ``/update_weights_from_tensor``
  carry only its factors (``<module>.lora_A.<name>.weight``), each merged again from the unmerged
  base. ``POST /unload_lora_adapter`` ``{lora_name}`` restores the base exactly.
- ``GET /get_weight_version``, ``POST /update_weight_version``, ``GET /health``,
  ``GET /get_model_info``, ``GET /get_server_info``, ``POST /pause_generation`` and
  ``/continue_generation`` (new requests wait while paused), ``/flush_cache`` (nothing is cached:
  a no-op), ``/abort_request`` (a trajectory runs to its end: nothing to abort).

Generation and weight loads share one lock, held for a whole request (all its microgroups), so a
weight update lands between two requests, never inside one: every trajectory of a request is drawn
by one weight version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

import torch
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from miles.engines.client import HANDOFF_LOAD_FORMAT
from miles.engines.embedded.lora import LoraError
from miles_diffusion.denoiser import Conditioning, DiffusionModel
from miles_diffusion.engine.merge import AdapterMerger
from miles_diffusion.families import load_for_engine
from miles_diffusion.guidance import GuidanceError, check_model
from miles_diffusion.lora import adapter_prefix, split_name
from miles_diffusion.model import WEIGHTS_FILE, FlowModel, read_model_config
from miles_diffusion.pipeline_model import PipelineFlowModel
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sampler import SamplerConfig, Trajectory, sample_seeded
from miles_diffusion.wire import (
    MEDIA_TYPE,
    STREAM_MEDIA_TYPE,
    TrajectoryBatch,
    frame_prefix,
    pack,
    pack_error,
    pack_microgroup,
)

log = logging.getLogger("miles_diffusion.engine")

MAX_STEPS = 1000


class EngineRefusal(ValueError):
    """A request the engine will not serve; its message is the whole answer."""


# --------------------------------------------------------------------- requests


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateBody(_Body):
    prompts: list[int] = Field(..., min_length=1, description="prompt ids, one trajectory each")
    seeds: list[int] = Field(..., min_length=1, description="one noise seed per trajectory")
    num_steps: int = Field(..., ge=1, le=MAX_STEPS, description="denoising (SDE) steps")
    noise_level: float = Field(..., gt=0.0, description="the SDE's noise scale a (sigma_t = a sqrt(t/(1-t)))")
    guidance_scale: float = Field(
        1.0,
        ge=1.0,
        allow_inf_nan=False,
        description="classifier-free guidance scale (1: none; above 1: two branches per forward pass)",
    )
    microgroup_size: int | None = Field(
        None, ge=1, description="trajectories sampled together (default: the whole request at once)"
    )
    stream: bool = Field(False, description="send each microgroup as a length-prefixed frame once sampled")
    texts: list[str] | None = Field(
        None, min_length=1, description="each trajectory's prompt text (text-prompted models: SD3, Wan)"
    )


class WeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = False


class UpdateFromTensorBody(_Body):
    serialized_named_tensors: list[str] = Field(
        ..., min_length=1, description="file names in the hand-off dir"
    )
    load_format: str | None = None
    weight_version: str | None = Field(None, description="on an update's last bucket: commit, then serve it")
    bucket_index: int | None = Field(None, ge=0, description="0 starts a new update")
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateFromDiskBody(_Body):
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class LoadLoraBody(_Body):
    lora_name: str
    lora_path: str


class UnloadLoraBody(_Body):
    lora_name: str


class PauseBody(_Body):
    mode: str = "abort"


class AbortBody(_Body):
    rid: str | None = ""
    abort_all: bool = False


# ----------------------------------------------------------------------- engine


def _version(value: str) -> int:
    try:
        version = int(value)
    except ValueError:
        raise EngineRefusal(f"weight_version {value!r} is not an integer") from None
    if version < 0:
        raise EngineRefusal(f"weight_version must be >= 0, got {version}")
    return version


def _on_host(trajectory: Trajectory) -> Trajectory:
    """``trajectory`` with every tensor in host memory (the same tensors when they already are)."""
    return Trajectory(
        latents=trajectory.latents.cpu(),
        timesteps=trajectory.timesteps.cpu(),
        log_probs=trajectory.log_probs.cpu(),
        prompts=trajectory.prompts.cpu(),
    )


class DiffusionEngine:
    """The model and its state; every method that touches the weights holds ``lock``."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        handoff_dir: str | None = None,
        weight_version: int = 0,
        max_batch_size: int = 64,
        precision: PrecisionConfig | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.family, model = load_for_engine(model_path, precision)
        self.model: DiffusionModel = model.to(self.device)
        self.handoff_dir = Path(handoff_dir).resolve() if handoff_dir else None
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size
        self.lock = threading.Lock()
        self._staged: dict[str, torch.Tensor] = {}
        self._expected = {name: (tuple(t.shape), t.dtype) for name, t in self.model.state_dict().items()}
        self.merger = AdapterMerger(self.model, adapter_prefix(self.model))

    # ------------------------------------------------------------ generation

    def check_generate(self, body: GenerateBody) -> None:
        """Refuse a bad request before any work (one message naming what is wrong)."""
        n = len(body.prompts)
        if len(body.seeds) != n:
            raise EngineRefusal(f"{len(body.seeds)} seeds for {n} prompts; give one seed per prompt")
        if n > self.max_batch_size:
            raise EngineRefusal(
                f"{n} trajectories in one request; this engine takes at most {self.max_batch_size}"
            )
        if self.family.text_prompts:
            self._check_texts(body)
        else:
            if body.texts is not None:
                raise EngineRefusal(
                    f"this engine serves a {self.family.name} model, prompted by id only; leave texts out"
                )
            k = self.model.num_prompts
            bad = sorted({p for p in body.prompts if not 0 <= p < k})
            if bad:
                raise EngineRefusal(f"prompt ids {bad} are outside this model's 0..{k - 1}")
        if not math.isfinite(body.noise_level):
            raise EngineRefusal(f"noise_level must be finite, got {body.noise_level}")
        try:  # a model with no unconditional branch cannot guide (the tiny UNet)
            check_model(self.model, body.guidance_scale)
        except GuidanceError as exc:
            raise EngineRefusal(str(exc)) from None
        if any(not 0 <= s < 2**63 for s in body.seeds):
            raise EngineRefusal("seeds must lie in [0, 2**63)")

    def _check_texts(self, body: GenerateBody) -> None:
        if body.texts is None:
            raise EngineRefusal(
                f"this engine serves a {self.family.name} model, prompted with text: give texts (each "
                "trajectory's prompt text, one per prompt id)"
            )
        if len(body.texts) != len(body.prompts):
            raise EngineRefusal(
                f"{len(body.texts)} texts for {len(body.prompts)} prompts; give one text per prompt"
            )
        if any(p < 0 for p in body.prompts):
            raise EngineRefusal("prompt ids must be >= 0")
        text_of: dict[int, str] = {}
        for pid, text in zip(body.prompts, body.texts, strict=True):
            if text_of.setdefault(pid, text) != text:
                raise EngineRefusal(f"prompt id {pid} comes with two texts in one request")

    def sample_microgroups(
        self,
        body: GenerateBody,
        emit: Callable[[int, int, TrajectoryBatch, int, int], None],
        cancelled: threading.Event | None = None,
    ) -> None:
        """Sample the request microgroup by microgroup; ``emit(index, offset, batch, started_ns,
        finished_ns)`` gets each as soon as it is drawn (and before the next starts).

        The prompts are encoded once, their distinct ids only, and every microgroup reuses the rows.
        Noise comes from each trajectory's own seed, so microgrouping changes no trajectory's noise;
        the batch size of the forward pass does change its rounding (a few ulp, docs/diffusion.md).
        The lock is held throughout: one weight version draws the whole request."""
        sampler = SamplerConfig(
            num_steps=body.num_steps, noise_level=body.noise_level, guidance_scale=body.guidance_scale
        )
        prompts = torch.tensor(body.prompts, dtype=torch.int64, device=self.device)
        seeds = list(body.seeds)
        n = len(seeds)
        size = body.microgroup_size or n
        with self.lock, torch.no_grad():
            version = self.weight_version
            distinct, inverse = torch.unique(prompts, return_inverse=True)
            encoded: Conditioning
            if body.texts is not None:  # a text-prompted model: the request's texts, by id
                text_of = dict(zip(body.prompts, body.texts, strict=True))
                assert isinstance(self.model, PipelineFlowModel)
                encoded = self.model.encode_texts([text_of[int(i)] for i in distinct.tolist()])[inverse]
            else:
                encoded = self.model.encode_prompts(distinct)[inverse]
            for index, offset in enumerate(range(0, n, size)):
                if cancelled is not None and cancelled.is_set():
                    return  # the client went away: the rest would be sampled for nobody
                rows = slice(offset, offset + size)
                started = time.monotonic_ns()
                trajectory = sample_seeded(
                    self.model, prompts[rows], seeds[rows], sampler, encoded=encoded[rows]
                )
                # Latents that are not pixels are decoded here, by the model's own decoder (a VAE):
                # the rewards score images and the client has none. Timed as sampling.
                images = (
                    None if self.model.latents_are_pixels else self.model.to_images(trajectory.latents[:, -1])
                )
                # The wire packs host memory: a GPU engine's results come back here (which also
                # waits for the device, so the timing below is the sampling's).
                trajectory = _on_host(trajectory)
                images = None if images is None else images.cpu()
                finished = time.monotonic_ns()
                emit(
                    index,
                    offset,
                    TrajectoryBatch(trajectory, seeds[rows], sampler, version, images),
                    started,
                    finished,
                )

    def generate(self, body: GenerateBody) -> bytes:
        """The whole request as one packed buffer (microgroups sampled in turn, then joined)."""
        parts: list[TrajectoryBatch] = []
        self.sample_microgroups(body, lambda index, offset, batch, t0, t1: parts.append(batch))
        first = parts[0]
        trajectory = Trajectory(
            latents=torch.cat([p.trajectory.latents for p in parts]),
            timesteps=first.trajectory.timesteps,
            log_probs=torch.cat([p.trajectory.log_probs for p in parts]),
            prompts=torch.cat([p.trajectory.prompts for p in parts]),
        )
        images = (
            None if first.images is None else torch.cat([p.images for p in parts if p.images is not None])
        )
        return pack(
            TrajectoryBatch(trajectory, list(body.seeds), first.sampler, first.weight_version, images)
        )

    def generate_frames(
        self, body: GenerateBody, send: Callable[[bytes], None], cancelled: threading.Event
    ) -> None:
        """The request as a stream: ``send`` gets each microgroup's length prefix and buffer as soon
        as it is sampled; a failure after the first frame becomes an error frame (the HTTP status
        is already sent)."""
        count = -(-len(body.seeds) // (body.microgroup_size or len(body.seeds)))

        def emit(index: int, offset: int, batch: TrajectoryBatch, started: int, finished: int) -> None:
            data = pack_microgroup(
                batch, index=index, count=count, offset=offset, started_ns=started, finished_ns=finished
            )
            send(frame_prefix(data))
            send(data)

        try:
            self.sample_microgroups(body, emit, cancelled)
        except Exception as exc:
            log.exception("streamed generation failed")
            data = pack_error(f"generation failed: {type(exc).__name__}: {exc}")
            send(frame_prefix(data))
            send(data)

    # ------------------------------------------------------------ weights

    def _handoff_path(self, name: str) -> Path:
        if self.handoff_dir is None:
            raise EngineRefusal("this engine was started without --handoff-dir; it takes no hand-off files")
        if not name or os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
            raise EngineRefusal(
                f"hand-off file {name!r} must be a bare file name inside the hand-off directory"
            )
        path = (self.handoff_dir / name).resolve()
        if path.parent != self.handoff_dir or not path.is_file():
            raise EngineRefusal(f"hand-off file {name!r} is not in the hand-off directory")
        return path

    def _checked(self, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        factors = {name: t for name, t in tensors.items() if split_name(name) is not None}
        if factors:  # LoRA factors: the loaded adapter's, merged at the commit
            try:
                self.merger.check_update(factors, where)
            except LoraError as exc:
                raise EngineRefusal(str(exc)) from None
            if len(factors) != len(tensors):
                raise EngineRefusal(
                    f"{where}: an update carries either full weights or LoRA factors, not both"
                )
            return {name: t.float() for name, t in factors.items()}
        unknown = sorted(set(tensors) - set(self._expected))
        if unknown:
            raise EngineRefusal(f"{where}: tensors {unknown[:5]} are not in this model's state dict")
        for name, t in tensors.items():
            shape, dtype = self._expected[name]
            if tuple(t.shape) != shape:
                raise EngineRefusal(
                    f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the model's is {shape}"
                )
            if not t.dtype.is_floating_point:
                raise EngineRefusal(f"{where}: tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        return {name: t.to(dtype) for name, t in tensors.items()}

    def _commit(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        lora = [split_name(name) is not None for name in tensors]
        if any(lora):
            if not all(lora):  # buckets of one update may not mix the two kinds either
                raise EngineRefusal("an update carries either full weights or LoRA factors, not both")
            with self.lock:
                try:
                    self.merger.commit(tensors)
                except LoraError as exc:
                    raise EngineRefusal(str(exc)) from None
                self.weight_version = version
            return
        if self.merger.adapter is not None:
            raise EngineRefusal(
                f"LoRA adapter {self.merger.adapter.name!r} is merged into the weights; full weights would "
                "replace its base: POST /unload_lora_adapter first"
            )
        missing = sorted(set(self._expected) - set(tensors))
        if missing:
            raise EngineRefusal(
                f"an update must carry the full weights; {len(missing)} tensors are missing (e.g. {missing[:3]})"
            )
        with self.lock:
            self.model.load_state_dict(tensors, strict=True)
            self.weight_version = version

    def update_bucket(self, body: UpdateFromTensorBody) -> dict[str, Any]:
        from safetensors.torch import load_file

        if body.load_format != HANDOFF_LOAD_FORMAT:
            raise EngineRefusal(
                f"load_format {body.load_format!r} is not accepted: this engine loads safetensors hand-off files "
                f"only (load_format {HANDOFF_LOAD_FORMAT!r}); it never unpickles a payload"
            )
        paths = [self._handoff_path(name) for name in body.serialized_named_tensors]
        if body.bucket_index == 0:
            self._staged = {}
        try:
            tensors: dict[str, torch.Tensor] = {}
            for path in paths:
                try:
                    tensors.update(load_file(str(path)))
                except Exception as exc:
                    raise EngineRefusal(
                        f"hand-off file {path.name!r} is not a readable safetensors file: {exc}"
                    ) from None
            self._staged.update(self._checked(tensors, "weight update"))
            if body.weight_version is None:
                return {"success": True, "message": f"staged {len(tensors)} tensors", "committed": False}
            version = _version(body.weight_version)
            staged, self._staged = self._staged, {}
            self._commit(staged, version)
        except EngineRefusal:
            self._staged = {}  # a refused bucket voids its update: the next one starts afresh
            raise
        return {"success": True, "message": f"weight version {version}", "committed": True}

    def update_from_disk(self, body: UpdateFromDiskBody) -> dict[str, Any]:
        from safetensors.torch import load_file

        if body.load_format not in (None, "auto", "safetensors"):
            raise EngineRefusal(
                f"load_format {body.load_format!r} is not supported; use 'auto' or 'safetensors'"
            )
        if not isinstance(self.model, FlowModel):
            return self._update_pipeline_from_disk(body)
        try:
            config = read_model_config(body.model_path)
        except ValueError as exc:
            raise EngineRefusal(str(exc)) from None
        if config != self.model.config:
            raise EngineRefusal(f"{body.model_path} holds a model of another shape ({config})")
        try:
            tensors = load_file(str(Path(body.model_path) / WEIGHTS_FILE))
        except Exception as exc:
            raise EngineRefusal(f"{body.model_path}: cannot read {WEIGHTS_FILE}: {exc}") from None
        version = self.weight_version if body.weight_version is None else _version(body.weight_version)
        if any(split_name(name) is not None for name in tensors):
            raise EngineRefusal(
                f"{body.model_path}: {WEIGHTS_FILE} holds LoRA factors; load an adapter with /load_lora_adapter"
            )
        self._commit(self._checked(tensors, body.model_path), version)
        return {"success": True, "message": f"loaded {body.model_path} as weight version {version}"}

    def _update_pipeline_from_disk(self, body: UpdateFromDiskBody) -> dict[str, Any]:
        """A pipeline directory (the trainer's export of an SD3 model): its transformer's weights."""
        from miles_diffusion.families import family_for
        from miles_diffusion.sd3 import read_transformer_state

        try:
            family = family_for(body.model_path)
            if family.name != self.family.name:
                raise ValueError(
                    f"{body.model_path} holds a {family.name} model; this engine serves {self.family.name}"
                )
            tensors = read_transformer_state(body.model_path)
        except ValueError as exc:
            raise EngineRefusal(str(exc)) from None
        version = self.weight_version if body.weight_version is None else _version(body.weight_version)
        self._commit(self._checked(tensors, body.model_path), version)
        return {"success": True, "message": f"loaded {body.model_path} as weight version {version}"}

    def load_lora(self, body: LoadLoraBody) -> dict[str, Any]:
        """Merge the peft adapter directory into the base (replacing any adapter merged before)."""
        try:
            adapter = self.merger.read(body.lora_name, body.lora_path)
        except LoraError as exc:
            raise EngineRefusal(str(exc)) from None
        with self.lock:
            self._staged = {}  # an update half-staged for the previous adapter no longer applies
            self.merger.install(adapter)
        return {
            "success": True,
            "message": f"adapter {adapter.name!r} merged ({len(adapter.factors)} modules) at weight version "
            f"{self.weight_version}",
        }

    def unload_lora(self, body: UnloadLoraBody) -> dict[str, Any]:
        loaded = self.merger.adapter
        if loaded is None or loaded.name != body.lora_name:
            raise EngineRefusal(
                f"no LoRA adapter {body.lora_name!r} is merged (merged: {loaded.name if loaded else None})"
            )
        with self.lock:
            self._staged = {}
            self.merger.unload()
        return {"success": True, "message": f"adapter {body.lora_name!r} unmerged: the base weights are back"}

    def model_info(self) -> dict[str, Any]:
        from dataclasses import asdict

        config = (
            asdict(self.model.config)
            if isinstance(self.model, FlowModel)
            else {"family": self.family.name, "latent_shape": list(self.model.latent_shape)}
        )
        return {
            "model_path": self.model_path,
            "kind": "diffusion",
            "config": config,
            "weight_version": str(self.weight_version),
        }


# --------------------------------------------------------------------------- app


def _refused(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=code)


def create_app(engine: DiffusionEngine) -> FastAPI:
    app = FastAPI(title="Miles diffusion engine", description="Denoising trajectories for prompt ids.")
    running = asyncio.Event()
    running.set()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{where}: {err.get('msg')}")
        return _refused(f"invalid request to {request.url.path}: " + "; ".join(parts))

    @app.exception_handler(EngineRefusal)
    async def _refusal(request: Request, exc: EngineRefusal) -> JSONResponse:
        return _refused(f"{request.url.path}: {exc}")

    @app.post("/generate_trajectories", summary="One SDE trajectory per prompt id (safetensors answer)")
    async def generate_trajectories(body: GenerateBody) -> Response:
        engine.check_generate(body)
        await running.wait()
        if body.stream:
            return StreamingResponse(_stream(body), media_type=STREAM_MEDIA_TYPE)
        data = await asyncio.to_thread(engine.generate, body)
        return Response(content=data, media_type=MEDIA_TYPE)

    async def _stream(body: GenerateBody) -> AsyncIterator[bytes]:
        """Frames from the sampling thread, sent as they come (the thread never waits for the socket)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        cancelled = threading.Event()

        def send(data: bytes | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us: the server is stopping
                loop.call_soon_threadsafe(queue.put_nowait, data)

        def produce() -> None:
            try:
                engine.generate_frames(body, send, cancelled)
            finally:
                send(None)

        worker = loop.run_in_executor(None, produce)
        try:
            while (data := await queue.get()) is not None:
                yield data
            await worker
        finally:
            cancelled.set()  # a client that left stops the sampling at the next microgroup

    @app.post("/generate", summary="Not served: this engine takes prompt ids, not token ids")
    async def generate(body: Annotated[dict[str, Any] | None, Body()] = None) -> JSONResponse:
        return _refused(
            "/generate takes token ids; the diffusion engine generates images from prompt ids: "
            "POST /generate_trajectories"
        )

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": str(engine.weight_version)}

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionBody) -> dict[str, Any]:
        version = _version(body.new_version)
        with engine.lock:
            engine.weight_version = version
        return {"success": True, "message": f"weight version {version}", "new_version": str(version)}

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {
            "dp_size": 1,
            "max_batch_size": engine.max_batch_size,
            "device": str(engine.device),
            "lora_adapter": engine.merger.describe(),
        }

    @app.post(
        "/update_weights_from_tensor", summary="Load hand-off files (staged until the versioned bucket)"
    )
    async def update_weights_from_tensor(body: UpdateFromTensorBody) -> dict[str, Any]:
        return await asyncio.to_thread(engine.update_bucket, body)

    @app.post("/update_weights_from_disk", summary="Load a whole model directory")
    async def update_weights_from_disk(body: UpdateFromDiskBody) -> dict[str, Any]:
        return await asyncio.to_thread(engine.update_from_disk, body)

    @app.post("/load_lora_adapter", summary="Merge a peft LoRA directory into the base weights")
    async def load_lora_adapter(body: LoadLoraBody) -> dict[str, Any]:
        return await asyncio.to_thread(engine.load_lora, body)

    @app.post("/unload_lora_adapter", summary="Restore the base weights (unmerge the adapter)")
    async def unload_lora_adapter(body: UnloadLoraBody) -> dict[str, Any]:
        return await asyncio.to_thread(engine.unload_lora, body)

    @app.post("/pause_generation", summary="New requests wait until /continue_generation")
    async def pause_generation(body: Annotated[PauseBody | None, Body()] = None) -> dict[str, Any]:
        running.clear()
        return {"status": "ok", "message": "generation paused"}

    @app.post("/continue_generation")
    async def continue_generation(body: Annotated[dict[str, Any] | None, Body()] = None) -> dict[str, Any]:
        running.set()
        return {"status": "ok", "message": "generation continued"}

    @app.api_route("/flush_cache", methods=["GET", "POST"], summary="Nothing is cached: a no-op")
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Cache flushed (the diffusion engine keeps none).\n")

    @app.post("/abort_request", summary="A trajectory runs to its end: nothing is aborted")
    async def abort_request(body: AbortBody) -> dict[str, Any]:
        return {"success": True, "aborted": 0}

    return app


# ---------------------------------------------------------------------- process


def serve(engine: DiffusionEngine, sock: Any) -> None:
    import uvicorn

    config = uvicorn.Config(create_app(engine), log_level="warning", access_log=False, timeout_keep_alive=120)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[sock])
