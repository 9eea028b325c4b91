"""The embedded engine's state: model, tokenizer, scheduler, weight updater, weight version."""

from __future__ import annotations

import base64
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from miles.engines.embedded.lora import LoraServing
from miles.engines.embedded.prefix_cache import PrefixCache
from miles.engines.embedded.routing import RoutingRecorder
from miles.engines.embedded.sampler import GenRequest, Runner, cache_is_mergeable
from miles.engines.embedded.scheduler import Scheduler
from miles.engines.embedded.weights import WeightUpdater

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import TypeIs

log = logging.getLogger("miles.engines.embedded")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHES = ("auto", "paged", "dynamic")
DEFAULT_PREFIX_CACHE_TOKENS = 65536


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
    # The installed receivers' launch options (miles.engines.embedded.receivers), e.g. disk-delta's
    # delta_root; each receiver gets its own when the server mounts it.
    receiver_options: dict[str, str | None] = field(default_factory=dict)
    update_timeout_s: float = 300.0  # a staged multi-bucket update with no bucket for this long is dropped
    # Most tokens the prefix cache keeps over all its entries (see prefix_cache, paged/radix); 0
    # disables it. None: DEFAULT_PREFIX_CACHE_TOKENS on the DynamicCache path (its entries are
    # device memory of their own); the whole pool on the paged path (cached blocks are pool blocks
    # no request uses, evicted whenever a request needs them, so they cost no capacity).
    prefix_cache_tokens: int | None = None
    # KV cache (docs/engine.md): "paged" (the fast path: paged pool, chunked prefill, CUDA graphs),
    # "dynamic" (a transformers DynamicCache per batch), "auto" (paged on CUDA for the models it
    # supports, dynamic otherwise).
    kv_cache: str = "auto"
    # paged, CUDA: share of the GPU memory free after loading that the KV pool takes. The default
    # leaves most of the GPU to a colocated trainer (the launcher does not pass this option yet); a
    # dedicated engine can take 0.85.
    mem_fraction: float = 0.3
    kv_tokens: int = 0  # paged: a pool of exactly this many token slots (needed on the CPU)
    chunk_tokens: int = 0  # paged: most prompt tokens one step prefills (0: 8192 on CUDA, 512 on CPU)
    cuda_graphs: bool = True  # paged, CUDA: replay the decode step from CUDA graphs
    overlap: bool = True  # paged: launch decode step N+1 before reading step N (host work hidden)
    block_size: int = 16  # paged: tokens per KV block
    # paged: LoRA adapters are served from this many preallocated slots, of rank at most
    # max_lora_rank (paged/lora.py: a step with adapters costs two GEMMs of width
    # max_loras * max_lora_rank per adapted linear, and each adapted linear keeps that many rows
    # of factors); an adapter beyond them is refused at load. The DynamicCache path has no limit.
    max_loras: int = 4
    max_lora_rank: int = 64


def _is_flat(token_ids: list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """One flat list of ids (rather than one id list per position)?"""
    return all(isinstance(x, int) for x in token_ids)


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

        if options.prefix_cache_tokens is not None and options.prefix_cache_tokens < 0:
            raise ValueError(
                f"prefix_cache_tokens must be >= 0 (0 disables the cache), got {options.prefix_cache_tokens}"
            )
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
        # Any: transformers' annotations of to() and get_input_embeddings() do not match what they return.
        model: Any = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype)
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
        mergeable = cache_is_mergeable(model)
        self.paged = self._paged_runner(model) if self._wants_paged(model) else None
        prefix_tokens = options.prefix_cache_tokens
        if prefix_tokens is None:
            prefix_tokens = (
                self.paged.allocator.capacity_tokens
                if self.paged is not None
                else DEFAULT_PREFIX_CACHE_TOKENS
            )
        prefix_cache = None
        if self.paged is not None:
            pass  # the paged scheduler keeps its own prefix cache over the pool's blocks (paged/radix.py)
        elif prefix_tokens > 0 and mergeable:
            prefix_cache = PrefixCache(prefix_tokens)
        elif prefix_tokens > 0:
            log.warning(
                "no prefix cache: %s has cache layers other than DynamicLayer (sliding windows, linear "
                "attention), whose rows cannot be cut out of a batch",
                type(model).__name__,
            )
        self.scheduler: Scheduler
        if self.paged is not None:
            from miles.engines.embedded.paged.scheduler import PagedScheduler

            self.scheduler = PagedScheduler(
                self.paged,
                runner,
                max_batch_size=options.max_batch_size,
                chunk_tokens=self.paged.options.chunk_tokens,
                version=self._token_version,
                seed=options.seed,
                prefix_cache_tokens=prefix_tokens,
            )
        else:
            self.scheduler = Scheduler(
                runner,
                max_batch_size=options.max_batch_size,
                mergeable=mergeable,
                version=self._token_version,
                prefix_cache=prefix_cache,
            )
        self._version = str(options.weight_version)
        self._version_lock = threading.Lock()
        self.weights = WeightUpdater(
            model,
            # A FifoLock, used through the Lock interface only (with-statements).
            step_lock=cast("threading.Lock", self.scheduler.step_lock),
            get_version=lambda: self.weight_version,
            set_version=self.set_weight_version,
            # KV computed by the old weights must never be reused: every weight change empties the cache.
            on_change=self.scheduler.flush_prefix_cache,
            handoff_dir=options.handoff_dir,
            update_timeout_s=options.update_timeout_s,
            on_commit=self._on_commit,
        )
        # LoRA adapters by name, applied per row without merging (on the paged path from slots the
        # decode graphs can read; the DynamicCache runner scoring requests there uses the same).
        self.lora: LoraServing
        if self.paged is not None:
            from miles.engines.embedded.paged.lora import PagedLoraServing
            from miles.engines.embedded.paged.scheduler import PagedScheduler

            paged_scheduler = cast("PagedScheduler", self.scheduler)
            self.lora = self.paged.lora = PagedLoraServing(
                model,
                self.weights,
                self.scheduler.step_lock,
                max_loras=options.max_loras,
                max_rank=options.max_lora_rank,
                in_use=paged_scheduler.adapter_requests,
                on_adapter=paged_scheduler.flush_adapter_cache,
                on_layout=self.paged.lora_layout_changed,
            )
        else:
            self.lora = LoraServing(model, self.weights, self.scheduler.step_lock)
        runner.lora = self.lora

    # ------------------------------------------------------------- LoRA

    def _on_commit(self, names: Sequence[str], version: str) -> None:
        # (None only while __init__ builds the updater, before any update can commit)
        lora = getattr(self, "lora", None)
        if lora is not None:
            lora.on_commit(names, version)

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        adapter = self.lora.load(name, path)
        log.info(
            "loaded LoRA adapter %r from %s (rank %d, %d modules)",
            name,
            path,
            adapter.rank,
            len(adapter.factors),
        )
        return {"name": name, "rank": adapter.rank, "modules": len(adapter.factors)}

    def unload_lora_adapter(self, name: str) -> None:
        self.lora.unload(name)

    def lora_tensor_names(self, name: str) -> list[str]:
        return self.lora.tensor_names(name)

    # ------------------------------------------------------------- KV path

    def _wants_paged(self, model: Any) -> bool:
        """Whether this engine runs the paged fast path; refuses what cannot work, one log line
        when ``auto`` keeps the DynamicCache path."""
        from miles.engines.embedded.paged.model import cuda_kernel_reason, unsupported_reason

        choice = self.options.kv_cache
        if choice not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {choice!r}")
        if choice == "dynamic" or (choice == "auto" and self.device.type != "cuda"):
            return False
        o = self.options
        if o.kv_tokens < 0 or o.chunk_tokens < 0 or o.block_size < 1 or not 0.0 < o.mem_fraction < 1.0:
            raise ValueError(
                f"paged KV options out of range: kv_tokens {o.kv_tokens} (>= 0), chunk_tokens {o.chunk_tokens} "
                f"(>= 0), block_size {o.block_size} (>= 1), mem_fraction {o.mem_fraction} (in (0, 1))"
            )
        reason = unsupported_reason(model)
        if reason is None and self.device.type == "cuda":
            reason = cuda_kernel_reason(model)
        if reason is None and self.device.type == "cuda":
            try:
                import triton  # type: ignore[import-untyped]  # noqa: F401  (the paged decode kernel)
            except ImportError:
                reason = "triton is not installed (the paged decode kernel needs it on CUDA)"
        if reason is not None:
            if choice == "paged":
                raise ValueError(f"kv_cache 'paged' cannot be used here: {reason}; use 'dynamic' or 'auto'")
            log.info("KV cache: DynamicCache path (%s)", reason)
            return False
        if self.device.type != "cuda" and self.options.kv_tokens <= 0:
            raise ValueError("kv_cache 'paged' on the CPU needs kv_tokens > 0 (the pool size in tokens)")
        return True

    def _paged_runner(self, model: Any) -> Any:
        from miles.engines.embedded.paged.runner import PagedOptions, PagedRunner

        o = self.options
        chunk = o.chunk_tokens or (8192 if self.device.type == "cuda" else 512)
        runner = PagedRunner(
            model,
            self.device,
            PagedOptions(
                block_size=o.block_size,
                mem_fraction=o.mem_fraction,
                kv_tokens=o.kv_tokens,
                chunk_tokens=chunk,
                cuda_graphs=o.cuda_graphs,
                max_batch_size=o.max_batch_size,
                overlap=o.overlap,
            ),
            self.max_context,
        )
        if runner.graphs is not None:
            with torch.inference_mode():
                runner.graphs.capture()  # at start, so no request waits for it
        return runner

    def release_memory(self) -> int:
        """Free the KV pool (running requests are retracted and wait); returns the bytes freed."""
        from miles.engines.embedded.paged.scheduler import PagedScheduler

        if not isinstance(self.scheduler, PagedScheduler):
            raise ValueError("memory release needs the paged KV cache (kv_cache 'paged', or 'auto' on CUDA)")
        return self.scheduler.release_memory()

    def resume_memory(self) -> None:
        from miles.engines.embedded.paged.scheduler import PagedScheduler

        if not isinstance(self.scheduler, PagedScheduler):
            raise ValueError("memory release needs the paged KV cache (kv_cache 'paged', or 'auto' on CUDA)")
        self.scheduler.resume_memory()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.weights.close()
        for group in list(self.weights.groups.values()):
            group.destroy()
        self.weights.groups.clear()

    # -------------------------------------------------------------- version

    @property
    def weight_version(self) -> str:
        with self._version_lock:
            return self._version

    def _token_version(self) -> int:
        version = self.weight_version
        return int(version) if version.lstrip("-").isdigit() else -1

    def set_weight_version(self, version: str) -> None:
        with self._version_lock:
            self._version = str(version)

    def flush_cache(self) -> int:
        """Drop the prefix cache (between two scheduler steps); returns how many entries it held."""
        with self.scheduler.step_lock:
            return self.scheduler.flush_prefix_cache()

    # ----------------------------------------------------------- generation

    def tokenize(self, text: str) -> list[int]:
        """``text`` as SGLang tokenizes a ``/generate`` text prompt (the tokenizer's own special tokens, e.g. BOS)."""
        if self.tokenizer is None:
            raise ValueError(
                f"text input needs a tokenizer, and the model directory {self.options.model_path} has none; "
                "send input_ids instead"
            )
        ids = list(self.tokenizer.encode(text))
        if not ids:
            raise ValueError("text tokenizes to no tokens; send a non-empty prompt")
        return ids

    def make_request(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
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
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        lora: str | None = None,
    ) -> GenRequest:
        """Validate one ``/generate`` request (ValueError: a 400 naming the problem) and build it."""
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids and text")
        if input_ids is None:
            assert text is not None  # exactly one of the two is given
            input_ids = self.tokenize(text)
        n = len(input_ids)
        self._check_ids(input_ids, "input_ids")
        if n >= self.max_context:
            raise ValueError(f"the prompt has {n} tokens; the model's context is {self.max_context}")
        if return_routed_experts and not self.recorder.is_moe:
            raise ValueError("return_routed_experts is set but the model has no MoE routers")
        if routed_experts_start_len > n:
            raise ValueError(
                f"routed_experts_start_len {routed_experts_start_len} is beyond the prompt ({n} tokens)"
            )
        scoring: dict[str, Any] = {}
        if return_logprob:  # as in SGLang, the log-prob options mean nothing without return_logprob
            scoring = self._scoring_fields(
                n, max_new_tokens, logprob_start_len, top_logprobs_num, token_ids_logprob
            )
        if lora is not None:
            self.lora.check_name(lora)
        stops = set(stop_token_ids) | (set() if ignore_eos else self.eos_ids)
        return GenRequest(
            lora=lora,
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
            **scoring,
        )

    def _check_ids(self, ids: list[int], where: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{where} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )

    def _scoring_fields(
        self,
        n: int,
        max_new_tokens: int,
        logprob_start_len: int,
        top_logprobs_num: int,
        token_ids_logprob: list[int] | list[list[int]] | None,
    ) -> dict[str, Any]:
        """The GenRequest scoring fields, SGLang's rules: ``logprob_start_len`` -1 reports the last
        input position only, and must otherwise lie inside the input."""
        start = n - 1 if logprob_start_len == -1 else logprob_start_len
        if start >= n:
            raise ValueError(
                f"logprob_start_len {logprob_start_len} is beyond the input: it must be below the number of "
                f"input tokens ({n})"
            )
        if top_logprobs_num > self.vocab_size:
            raise ValueError(
                f"top_logprobs_num {top_logprobs_num} exceeds the vocabulary size {self.vocab_size}"
            )
        fields: dict[str, Any] = {"logprob_start": start, "top_logprobs_num": top_logprobs_num}
        if token_ids_logprob is None:
            return fields
        if not token_ids_logprob:
            raise ValueError("token_ids_logprob is empty; leave it out or list token ids")
        if _is_flat(token_ids_logprob):
            self._check_ids(token_ids_logprob, "token_ids_logprob")
            fields["token_ids_logprob"] = list(token_ids_logprob)
            return fields
        # The per-position form (one id list per reported input position) is an embedded-engine extension.
        if max_new_tokens != 0:
            raise ValueError(
                "token_ids_logprob as one list per position is for scoring calls only; set max_new_tokens to 0 "
                "(or give one flat list of ids, used at every position)"
            )
        if len(token_ids_logprob) != n - start:
            raise ValueError(
                f"token_ids_logprob has {len(token_ids_logprob)} per-position lists; positions "
                f"{start}..{n - 1} (logprob_start_len to the end of the input) need {n - start}"
            )
        for ids in token_ids_logprob:
            self._check_ids(ids, "token_ids_logprob")
        fields["token_ids_per_position"] = [list(ids) for ids in token_ids_logprob]
        return fields

    def _triples(
        self, values: Sequence[float | None], ids: Sequence[int], with_text: bool
    ) -> list[list[Any]]:
        """SGLang's ``[logprob, token_id, text-or-null]`` entries."""
        pieces: list[str | None] = [None] * len(ids)
        if with_text and self.tokenizer is not None and ids:
            pieces = self.tokenizer.batch_decode([[t] for t in ids])
        return [[v, t, p] for v, t, p in zip(values, ids, pieces, strict=True)]

    def _input_logprobs(self, req: GenRequest, with_text: bool) -> dict[str, Any]:
        """``input_*`` (and ``output_*`` top / requested-id) log-prob fields of ``meta_info``.

        One entry per prompt position ``logprob_start ..``; the first is null, as in SGLang
        (the logits that would score it are not computed). A request aborted before its
        prompt was scored carries nulls for the positions it did not reach.
        """
        ids = req.prompt_ids[req.logprob_start :]
        missing = len(ids) - 1 - len(req.input_logprobs)
        meta: dict[str, Any] = {
            "input_token_logprobs": self._triples(
                [None, *req.input_logprobs] + [None] * missing, ids, with_text
            )
        }
        if req.top_logprobs_num > 0:
            tops = [self._triples(v, i, with_text) for v, i in req.input_top]
            meta["input_top_logprobs"] = [None, *tops] + [None] * (len(ids) - 1 - len(tops))
            meta["output_top_logprobs"] = [self._triples(v, i, with_text) for v, i in req.output_top]
        if req.token_ids_logprob is not None or req.token_ids_per_position is not None:
            lists = req.token_ids_per_position[1:] if req.token_ids_per_position is not None else None
            # Without per-position lists the flat ids are set (and with them there is no output to score).
            flat = req.token_ids_logprob or []
            asked = [
                self._triples(v, lists[j] if lists is not None else flat, with_text)
                for j, v in enumerate(req.input_ids_logprobs)
            ]
            meta["input_token_ids_logprobs"] = [None, *asked] + [None] * (len(ids) - 1 - len(asked))
            meta["output_token_ids_logprobs"] = [
                self._triples(v, flat, with_text) for v in req.output_ids_logprobs
            ]
        return meta

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
            # Prompt tokens whose KV the request's first prefill took from the prefix cache.
            "cached_tokens": req.cached_tokens,
            "weight_version": self.weight_version,
            # Not in SGLang: the version each output token was sampled under (a request that spans
            # a weight update carries both), so staleness is measured from the oldest token.
            "output_token_weight_versions": list(req.output_versions),
        }
        if req.lora is not None:
            meta["lora_path"] = req.lora
            meta["lora_weight_version"] = self._adapter_version(req.lora)
        if req.return_logprob:
            meta["output_token_logprobs"] = self._triples(
                list(req.output_logprobs), list(req.output_ids), return_text_in_logprobs
            )
            meta.update(self._input_logprobs(req, return_text_in_logprobs))
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

    def _adapter_version(self, name: str) -> str | None:
        adapter = self.lora.adapters.get(name)
        return adapter.version if adapter is not None else None

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

    def _pool_info(self) -> dict[str, Any] | None:
        if self.paged is None:
            return None
        alloc = self.paged.allocator
        return {
            "block_size": alloc.block_size,
            "num_blocks": alloc.num_blocks,
            "free_blocks": alloc.num_free,
            "capacity_tokens": alloc.capacity_tokens,
            "bytes": self.paged.pool.nbytes,
            "released": not self.paged.pool.allocated,
            "cuda_graphs": self.paged.graphs.sizes if self.paged.graphs is not None else None,
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
            "dp_size": 1,  # one data-parallel rank: /generate takes data_parallel_rank null or 0
            "continuous_batching": self.scheduler.mergeable,
            "kv_cache": "paged" if self.paged is not None else "dynamic",
            "kv_pool": self._pool_info(),
            # None when disabled (prefix_cache_tokens 0, or a model whose caches cannot be merged);
            # on the paged path "kind" is "radix" and an entry is one cached KV block.
            "prefix_cache": self.scheduler.prefix_cache_info(),
            "lora_adapters": self.lora.describe(),
            # Paged path: the adapter slots (max_loras, max_rank, free, modules, bytes).
            "lora_slots": self.lora.slots_info(),
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
