"""The embedded engine's state: model, tokenizer, scheduler, weight updater, weight version."""

from __future__ import annotations

import base64
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.engines.embedded.routing import RoutingRecorder
from miles.engines.embedded.sampler import GenRequest, Runner, cache_is_mergeable
from miles.engines.embedded.scheduler import Scheduler
from miles.engines.embedded.weights import WeightUpdater

log = logging.getLogger("miles.engines.embedded")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineOptions:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    max_batch_size: int = 64
    handoff_dir: str | None = None
    seed: int | None = None
    weight_version: str = "0"


def _eos_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _load_tokenizer(path: str) -> Any:
    """The tokenizer only renders ``text`` in answers; a model directory without one is fine."""
    if not any(
        (Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        log.warning("no tokenizer loaded from %s (%s); answers carry no text", path, exc)
        return None


class EmbeddedEngine:
    def __init__(self, options: EngineOptions) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.options = options
        self.device = torch.device(options.device)
        if self.device.type == "cuda" and self.device.index is None:
            # NCCL groups (weight updates) need an explicit index; "cuda" means the current GPU.
            self.device = torch.device("cuda", torch.cuda.current_device())
        config = AutoConfig.from_pretrained(options.model_path)
        if options.dtype == "auto":
            configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            dtype = (
                configured
                if isinstance(configured, torch.dtype)
                else DTYPES.get(str(configured), torch.float32)
            )
        else:
            dtype = DTYPES[options.dtype]
        self.dtype = dtype
        model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype)
        model.to(self.device).eval().requires_grad_(False)
        self.model = model
        self.config = (
            model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        )
        self.tokenizer = _load_tokenizer(options.model_path)
        self.eos_ids = _eos_ids(model)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.recorder = RoutingRecorder(model)
        runner = Runner(
            model, self.device, max_context=self.max_context, recorder=self.recorder, seed=options.seed
        )
        self.runner = runner
        self.scheduler = Scheduler(
            runner, max_batch_size=options.max_batch_size, mergeable=cache_is_mergeable(model)
        )
        self.weights = WeightUpdater(model, handoff_dir=options.handoff_dir)
        self._version = str(options.weight_version)
        self._version_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        for group in list(self.weights.groups.values()):
            group.destroy()
        self.weights.groups.clear()

    # -------------------------------------------------------------- version

    @property
    def weight_version(self) -> str:
        with self._version_lock:
            return self._version

    def set_weight_version(self, version: str) -> None:
        with self._version_lock:
            self._version = str(version)

    # ----------------------------------------------------------- generation

    def make_request(
        self,
        *,
        input_ids: list[int],
        rid: str | None,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_token_ids: list[int],
        seed: int | None,
        ignore_eos: bool,
        return_logprob: bool,
        return_routed_experts: bool,
        routed_experts_start_len: int = 0,
    ) -> GenRequest:
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"input_ids holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if len(input_ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the model's context is {self.max_context}"
            )
        if return_routed_experts and not self.recorder.is_moe:
            raise ValueError("return_routed_experts is set but the model has no MoE routers")
        stops = set(stop_token_ids) | (set() if ignore_eos else self.eos_ids)
        return GenRequest(
            rid=rid or uuid.uuid4().hex,
            prompt_ids=list(input_ids),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_ids=frozenset(stops),
            seed=seed,
            return_logprob=return_logprob,
            return_routed_experts=return_routed_experts,
            generator=self.runner.new_generator(seed) if seed is not None else None,
            routed_start=routed_experts_start_len,
        )

    def render(
        self, req: GenRequest, *, return_text_in_logprobs: bool = False, skip_special_tokens: bool = True
    ) -> dict[str, Any]:
        """The SGLang-shaped answer for a finished request."""
        text = ""
        if self.tokenizer is not None and req.output_ids:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=skip_special_tokens)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if req.return_logprob:
            pieces: list[str | None] = [None] * len(req.output_ids)
            if return_text_in_logprobs and self.tokenizer is not None:
                pieces = [self.tokenizer.decode([t]) for t in req.output_ids]
            meta["output_token_logprobs"] = [
                [lp, tok, piece]
                for lp, tok, piece in zip(req.output_logprobs, req.output_ids, pieces, strict=True)
            ]
        if req.return_routed_experts:
            rows = max(req.num_routed - req.routed_start, 0)
            array = (
                torch.cat(req.routed)[req.routed_start :]
                if rows
                else torch.zeros(0, self.recorder.num_layers, self.recorder.topk, dtype=torch.int32)
            )
            meta["routed_experts"] = base64.b64encode(array.numpy().astype("<i4").tobytes()).decode("ascii")
            # Not in SGLang's answer: lets a client reshape without knowing the model.
            meta["routed_experts_shape"] = [rows, self.recorder.num_layers, self.recorder.topk]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict[str, Any]:
        moe = None
        if self.recorder.is_moe:
            moe = {
                "num_layers": self.recorder.num_layers,
                "topk": self.recorder.topk,
                "num_experts": self.recorder.num_experts,
            }
        return {
            "model_path": self.options.model_path,
            "tokenizer_path": self.options.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "architecture": type(self.model).__name__,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": int(getattr(self.config, "num_hidden_layers", 0) or 0),
            "max_context_length": self.max_context,
            "eos_token_ids": sorted(self.eos_ids),
            "moe": moe,
        }

    def server_info(self) -> dict[str, Any]:
        running, waiting = self.scheduler.counts()
        stats = dict(self.scheduler.stats)
        steps = stats["decode_steps"]
        stats["mean_decode_batch"] = stats["decode_rows"] / steps if steps else 0.0
        return {
            "engine": "miles-embedded",
            "model_path": self.options.model_path,
            "host": self.options.host,
            "port": self.options.port,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_batch_size": self.options.max_batch_size,
            "continuous_batching": self.scheduler.mergeable,
            "torch_threads": torch.get_num_threads(),
            "pid": os.getpid(),
            "weight_version": self.weight_version,
            "paused": self.scheduler.paused,
            "pause_mode": self.scheduler.pause_mode,
            "num_running": running,
            "num_waiting": waiting,
            "batch_stats": stats,
            **self.weights.describe(),
        }
