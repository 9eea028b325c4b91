"""The one client Miles uses for rollout engines: SGLang's native HTTP API.

The embedded engine (``miles.engines.embedded``) implements the same endpoints,
so this code runs against it on every CPU test and unchanged against real SGLang
servers on a GPU cluster. Only the request bodies and response fields below are
relied on; they follow SGLang's ``http_server.py`` / ``io_struct.py``:

- ``POST /generate`` with ``input_ids``, ``sampling_params``, ``return_logprob``,
  ``rid``, ``return_routed_experts`` and, for an engine with several data-parallel
  ranks, ``data_parallel_rank`` (sent only when the caller picks one). The answer
  carries ``output_ids``, ``text`` and ``meta_info`` with ``finish_reason.type``
  (stop / length / abort),
  ``output_token_logprobs`` as ``[logprob, token_id, text-or-null]`` triples,
  ``weight_version`` (a string; Miles writes integers) and, for MoE models,
  ``routed_experts``: base64 of little-endian int32 with logical shape
  ``(prompt_len + output_len - 1, num_moe_layers, topk)`` covering every token
  the model consumed. Row ``j`` of the last ``output_len`` rows is the routing of
  the forward pass that produced output token ``j`` (``GenerateOutput.routed_experts``);
  the rows before them are the prompt's other positions
  (``GenerateOutput.prompt_routed_experts``, which routing replay needs too).
- Scoring (``score``): ``POST /generate`` with ``max_new_tokens`` 0,
  ``return_logprob``, ``logprob_start_len`` and optionally ``top_logprobs_num`` /
  ``token_ids_logprob``. The answer's ``meta_info.input_token_logprobs`` has one
  ``[logprob, token_id, text-or-null]`` entry per input position from
  ``logprob_start_len`` on, the first with a null log-prob (SGLang computes no
  logits for it); ``input_top_logprobs`` and ``input_token_ids_logprobs`` hold a
  list of such entries per position (null at the first). So to score tokens from
  ``start`` the client asks from ``start - 1`` and drops that first entry.
- Control: ``/health``, ``/get_weight_version``, ``/get_model_info``,
  ``/get_server_info``, ``/pause_generation {mode}``, ``/continue_generation``,
  ``/flush_cache``, ``/abort_request {rid | abort_all}``,
  ``/update_weight_version {new_version}``.
- Weights: ``/update_weights_from_disk``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
  ``/update_weights_from_tensor``. Failures come back as HTTP 400 with
  ``{"success": false, "message": ...}``. A trainer sends one update as several
  calls ("buckets") and sets ``weight_version`` on the last only; the embedded
  engine stages the others and commits them all with the last.
- Miles extensions (embedded engine): ``bucket_index`` on the two bucket calls
  (sent only when given), ``/update_weights_from_disk_delta {version,
  weight_version?}`` and ``/weights_checker {action: reset_tensors | checksum,
  skip?, seed?}``. Patched SGLang builds have a ``/weights_checker`` with other
  actions; ours answers ``checksum`` with ``{name: {dtype, shape, digest}}``.

Any failure becomes one :class:`miles.errors.EngineError` naming the engine URL,
the endpoint and the server's message; an engine that does not answer at all raises
its subclass :class:`EngineUnavailable` (a request there may be retried elsewhere).
"""

from __future__ import annotations

import array
import asyncio
import base64
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from miles.errors import EngineError, EngineRejected
from miles.types import GenerateOutput, SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PAUSE_MODES = ("abort", "retract", "in_place")
CHECKER_ACTIONS = ("reset_tensors", "checksum")
FINISH_REASONS = ("stop", "length", "abort")
#: ``load_format`` of ``/update_weights_from_tensor`` for the colocated hand-off: each entry of
#: ``serialized_named_tensors`` names a safetensors file inside the engine's hand-off directory.
HANDOFF_LOAD_FORMAT = "miles_safetensors_file"
DEFAULT_GROUP = "weight_update_group"


@dataclass(frozen=True)
class EngineCall:
    """One HTTP call to an engine: built once, sent by the async or the sync client."""

    method: str
    path: str
    body: dict[str, Any] | None = None


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise EngineError("engine URL is empty")
    if "://" not in url:
        url = "http://" + url
    return url


# ------------------------------------------------------------------ request bodies


def generate_call(
    input_ids: Sequence[int],
    params: SamplingParams,
    *,
    rid: str | None = None,
    return_routed_experts: bool = False,
    data_parallel_rank: int | None = None,
    lora_path: str | None = None,
) -> EngineCall:
    """The ``/generate`` body for one prompt of token ids.

    ``lora_path`` names a LoRA adapter the engine has loaded (``/load_lora_adapter``); the request
    is generated with it applied to the base (SGLang's field of the same name). Sent only when given.

    ``data_parallel_rank`` pins the request to one data-parallel rank of an engine that has
    several (SGLang's ``GenerateReqInput.data_parallel_rank``; a router picks it so that a
    session's turns reach the rank holding its prefix). It is sent only when given.
    """
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": params.to_sglang(),
        "return_logprob": True,
    }
    if rid is not None:
        body["rid"] = rid
    if return_routed_experts:
        body["return_routed_experts"] = True
    if lora_path is not None:
        body["lora_path"] = str(lora_path)
    if data_parallel_rank is not None:
        if (
            isinstance(data_parallel_rank, bool)
            or not isinstance(data_parallel_rank, int)
            or data_parallel_rank < 0
        ):
            raise EngineError(
                f"generate: data_parallel_rank must be an integer >= 0, got {data_parallel_rank!r}"
            )
        body["data_parallel_rank"] = data_parallel_rank
    return EngineCall("POST", "/generate", body)


def score_call(
    input_ids: Sequence[int],
    *,
    start: int,
    temperature: float = 1.0,
    top_k: int = 0,
    token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> EngineCall:
    """A pure scoring ``/generate`` (no new tokens) for the log-probs of ``input_ids[start:]``.

    ``token_ids`` is one flat list (the same ids at every scored position, as SGLang takes
    it) or one list per scored position (``len(input_ids) - start`` lists: an
    embedded-engine extension that real SGLang lacks).
    """
    n = len(input_ids)
    if not 1 <= start <= n:
        raise EngineError(
            f"score: start {start} is outside 1..{n} (the first token has no log-prob: nothing precedes it)"
        )
    if top_k < 0:
        raise EngineError(f"score: top_k must be >= 0, got {top_k}")
    if temperature < 0:
        raise EngineError(f"score: temperature must be >= 0 (0 scores at temperature 1), got {temperature}")
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_new_tokens": 0, "temperature": float(temperature)},
        "return_logprob": True,
        "logprob_start_len": start - 1,
    }
    if top_k:
        body["top_logprobs_num"] = int(top_k)
    if token_ids is not None:
        if _per_position(token_ids):
            if len(token_ids) != n - start:
                raise EngineError(
                    f"score: token_ids has {len(token_ids)} per-position lists for {n - start} scored positions"
                )
            # The position before `start` is reported too (without a value): its list is empty.
            body["token_ids_logprob"] = [[], *([int(t) for t in ids] for ids in token_ids)]
        else:
            body["token_ids_logprob"] = [int(t) for t in token_ids]
    return EngineCall("POST", "/generate", body)


def _per_position(
    token_ids: Sequence[int] | Sequence[Sequence[int]],
) -> TypeIs[Sequence[Sequence[int]]]:
    """One id list per position (rather than one flat list of ids)?"""
    return bool(token_ids) and isinstance(token_ids[0], list | tuple)


def pause_call(mode: str = "abort") -> EngineCall:
    if mode not in PAUSE_MODES:
        raise EngineError(f"pause_generation: mode {mode!r} is not one of {PAUSE_MODES}")
    return EngineCall("POST", "/pause_generation", {"mode": mode})


def _with_version(body: dict[str, Any], weight_version: int | str | None) -> dict[str, Any]:
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def _with_bucket_index(body: dict[str, Any], bucket_index: int | None, what: str) -> None:
    if bucket_index is None:
        return  # plain SGLang body
    if isinstance(bucket_index, bool) or not isinstance(bucket_index, int) or bucket_index < 0:
        raise EngineError(f"{what}: bucket_index must be an integer >= 0, got {bucket_index!r}")
    body["bucket_index"] = bucket_index


def update_from_disk_call(
    model_path: str, weight_version: int | str | None = None, *, flush_cache: bool = True
) -> EngineCall:
    body = {"model_path": str(model_path), "flush_cache": flush_cache}
    return EngineCall("POST", "/update_weights_from_disk", _with_version(body, weight_version))


def init_group_call(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
) -> EngineCall:
    body = {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }
    return EngineCall("POST", "/init_weights_update_group", body)


def update_from_distributed_call(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str = DEFAULT_GROUP,
    weight_version: int | str | None = None,
    flush_cache: bool = True,
    bucket_index: int | None = None,
    load_format: str | None = None,
) -> EngineCall:
    if not len(names) == len(dtypes) == len(shapes):
        raise EngineError(
            f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; "
            "they must have one entry per tensor"
        )
    body = {
        "names": list(names),
        # SGLang spells dtypes without the "torch." prefix.
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "shapes": [[int(s) for s in shape] for shape in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }
    if load_format is not None:
        body["load_format"] = load_format
    _with_bucket_index(body, bucket_index, "update_weights_from_distributed")
    return EngineCall("POST", "/update_weights_from_distributed", _with_version(body, weight_version))


def destroy_group_call(group_name: str = DEFAULT_GROUP) -> EngineCall:
    return EngineCall("POST", "/destroy_weights_update_group", {"group_name": group_name})


def update_from_tensor_call(
    files: Sequence[str],
    weight_version: int | str | None = None,
    *,
    load_format: str = HANDOFF_LOAD_FORMAT,
    flush_cache: bool = True,
    bucket_index: int | None = None,
) -> EngineCall:
    body: dict[str, Any] = {
        "serialized_named_tensors": [str(f) for f in files],
        "load_format": load_format,
        "flush_cache": flush_cache,
    }
    _with_bucket_index(body, bucket_index, "update_weights_from_tensor")
    return EngineCall("POST", "/update_weights_from_tensor", _with_version(body, weight_version))


def update_from_disk_delta_call(version: int, weight_version: int | str | None = None) -> EngineCall:
    """Apply disk-delta ``version`` from the engine's own ``--delta-root`` (embedded engine)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise EngineError(f"update_weights_from_disk_delta: version must be an integer >= 0, got {version!r}")
    body: dict[str, Any] = {"version": version}
    return EngineCall("POST", "/update_weights_from_disk_delta", _with_version(body, weight_version))


def load_lora_adapter_call(lora_name: str, lora_path: str) -> EngineCall:
    """SGLang's ``/load_lora_adapter``: load the peft adapter directory ``lora_path`` as ``lora_name``."""
    return EngineCall(
        "POST", "/load_lora_adapter", {"lora_name": str(lora_name), "lora_path": str(lora_path)}
    )


def unload_lora_adapter_call(lora_name: str) -> EngineCall:
    return EngineCall("POST", "/unload_lora_adapter", {"lora_name": str(lora_name)})


def weights_checker_call(
    action: str, skip: Sequence[str] | None = None, seed: int | None = None, lora_name: str | None = None
) -> EngineCall:
    if action not in CHECKER_ACTIONS:
        raise EngineError(f"weights_checker: action {action!r} is not one of {CHECKER_ACTIONS}")
    body: dict[str, Any] = {"action": action}
    if skip:
        body["skip"] = [str(n) for n in skip]
    if seed is not None:
        body["seed"] = int(seed)
    if lora_name is not None:
        body["lora_name"] = str(lora_name)  # a Miles extension: only that adapter's tensors
    return EngineCall("POST", "/weights_checker", body)


def update_version_call(version: int | str) -> EngineCall:
    return EngineCall(
        "POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
    )


CONTINUE = EngineCall("POST", "/continue_generation", {})
FLUSH = EngineCall("POST", "/flush_cache")
WEIGHT_VERSION = EngineCall("GET", "/get_weight_version")
MODEL_INFO = EngineCall("GET", "/get_model_info")
SERVER_INFO = EngineCall("GET", "/get_server_info")
HEALTH = EngineCall("GET", "/health")
# SGLang's names; the embedded engine frees (and re-allocates) its paged KV pool.
RELEASE_MEMORY = EngineCall("POST", "/release_memory_occupation", {})
RESUME_MEMORY = EngineCall("POST", "/resume_memory_occupation", {})


def abort_call(rid: str | None = None, *, abort_all: bool = False) -> EngineCall:
    if not abort_all and not rid:
        raise EngineError("abort_request needs a request id (or abort_all=True)")
    return EngineCall("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})


# --------------------------------------------------------------- response parsing


def parse_weight_version(value: Any, *, where: str = "engine") -> int:
    """SGLang reports versions as strings; Miles writes integers. A fresh SGLang says "default" (= 0)."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(
            f"{where}: weight_version {value!r} is not an integer; Miles sets integer versions "
            "(via update_weight_version / the weight-update calls)"
        ) from None


def decode_routed_experts(
    payload: str | list,
    *,
    shape: Sequence[int] | None = None,
    rows: int | None = None,
    num_layers: int | None = None,
    topk: int | None = None,
) -> list[list[list[int]]]:
    """Decode SGLang's routed-experts payload into ``[token][layer][k]`` expert ids.

    ``payload`` is base64 of little-endian int32 (or, leniently, an already nested list).
    The layout is taken from ``shape`` when the engine sends it (the embedded engine
    does, as ``routed_experts_shape``), else from ``rows`` and ``num_layers`` or ``topk``.
    """
    if isinstance(payload, list):
        return [[[int(e) for e in layer] for layer in row] for row in payload]
    values = array.array("i")
    if values.itemsize != 4:  # pragma: no cover - exotic platform
        raise EngineError("routed experts: this platform has no 4-byte C int")
    try:
        values.frombytes(base64.b64decode(payload))
    except (ValueError, TypeError) as exc:
        raise EngineError(f"routed experts: payload is not base64 of int32 values: {exc}") from exc
    if sys.byteorder == "big":  # pragma: no cover
        values.byteswap()
    n = len(values)
    if shape is not None:
        rows, num_layers, topk = (int(s) for s in shape)
    else:
        if rows is None:
            raise EngineError("routed experts: cannot reshape without the number of token rows")
        if rows == 0:
            return []
        cols, rem = divmod(n, rows)
        if rem:
            raise EngineError(f"routed experts: {n} values do not split into {rows} token rows")
        if num_layers is None and topk is None:
            raise EngineError(
                "routed experts: the engine did not send their shape; give the client moe_num_layers or moe_topk"
            )
        if num_layers is None:
            num_layers = cols // topk if topk else 0
        topk = cols // num_layers if num_layers else 0
    if rows * num_layers * topk != n:
        raise EngineError(f"routed experts: {n} values do not fit the shape ({rows}, {num_layers}, {topk})")
    flat = values.tolist()
    per_row = num_layers * topk
    return [
        [flat[r * per_row + layer * topk : r * per_row + (layer + 1) * topk] for layer in range(num_layers)]
        for r in range(rows)
    ]


def parse_generate_response(
    data: Any,
    *,
    prompt_len: int,
    url: str = "engine",
    moe_num_layers: int | None = None,
    moe_topk: int | None = None,
) -> GenerateOutput:
    """Turn SGLang's ``/generate`` answer into a :class:`GenerateOutput` (aligned on output tokens)."""
    where = f"engine {url}/generate"
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise EngineError(f"{where}: answer has no meta_info (got {str(data)[:200]!r})")
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    ftype = finish.get("type") if isinstance(finish, dict) else finish
    if ftype not in FINISH_REASONS:
        message = finish.get("message") if isinstance(finish, dict) else None
        raise EngineError(
            f"{where}: unexpected finish_reason {finish!r}" + (f": {message}" if message else "")
        )
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineError(
            f"{where}: answer has no meta_info.output_token_logprobs (was return_logprob dropped?)"
        )
    logprobs = [float(t[0]) for t in triples]
    ids_from_logprobs = [int(t[1]) for t in triples]
    output_ids = data.get("output_ids")
    if output_ids is None:
        output_ids = ids_from_logprobs
    else:
        output_ids = [int(t) for t in output_ids]
        if output_ids != ids_from_logprobs:
            raise EngineError(
                f"{where}: output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs "
                f"({len(ids_from_logprobs)} tokens)"
            )
    routed = prompt_routed = None
    if meta.get("routed_experts") is not None:
        prompt_tokens = int(meta.get("prompt_tokens", prompt_len))
        all_rows = decode_routed_experts(
            meta["routed_experts"],
            shape=meta.get("routed_experts_shape"),
            rows=max(prompt_tokens + len(output_ids) - 1, 0),
            num_layers=moe_num_layers,
            topk=moe_topk,
        )
        # Row i is the routing of consumed token i; the forward that produced output j consumed token P-1+j.
        routed = all_rows[prompt_tokens - 1 : prompt_tokens - 1 + len(output_ids)] if prompt_tokens else []
        if len(routed) != len(output_ids):
            raise EngineError(
                f"{where}: routed experts cover {len(all_rows)} tokens, expected {prompt_tokens + len(output_ids) - 1}"
            )
        prompt_routed = all_rows[: max(prompt_tokens - 1, 0)]
    version = parse_weight_version(meta.get("weight_version"), where=where)
    token_versions = meta.get("output_token_weight_versions")
    if token_versions is None:
        # SGLang reports one version per request (the one it finished under); without the embedded
        # engine's per-token field, every token is attributed to it.
        token_versions = [version] * len(output_ids)
    else:
        token_versions = [parse_weight_version(v, where=where) for v in token_versions]
        if len(token_versions) != len(output_ids):
            raise EngineError(
                f"{where}: output_token_weight_versions has {len(token_versions)} entries for "
                f"{len(output_ids)} output tokens"
            )
    return GenerateOutput(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=ftype,
        weight_version=version,
        text=data.get("text") or "",
        routed_experts=routed,
        prompt_routed_experts=prompt_routed,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        output_weight_versions=token_versions,
    )


@dataclass
class ScoreOutput:
    """One engine's log-probs of ``input_ids[start:]``, one row per scored token.

    ``logprobs[j]`` is ``log π(input_ids[start + j] | input_ids[: start + j])`` at the
    requested temperature. With ``top_k`` > 0, ``top_ids[j]`` / ``top_logprobs[j]`` are the
    K most likely tokens at that position, most likely first. With ``token_ids``,
    ``token_ids_logprobs[j][i]`` is the log-prob of the i-th requested id at that position.
    """

    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    token_ids_logprobs: list[list[float]] | None = None


def _entries(meta: dict[str, Any], key: str, expected: int, where: str) -> list[Any]:
    value = meta.get(key)
    if not isinstance(value, list):
        raise EngineError(f"{where}: answer has no meta_info.{key} (does the engine support scoring?)")
    if len(value) != expected:
        raise EngineError(f"{where}: meta_info.{key} has {len(value)} entries, expected {expected}")
    return value


def _logprob(entry: Any, where: str) -> float:
    if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[0] is None:
        raise EngineError(f"{where}: expected a [logprob, token_id, text] entry, got {entry!r}")
    return float(entry[0])


def parse_score_response(
    data: Any,
    input_ids: Sequence[int],
    *,
    start: int,
    top_k: int = 0,
    token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    url: str = "engine",
) -> ScoreOutput:
    """Check and unpack the answer to :func:`score_call` (the same arguments).

    Every list must cover positions ``start - 1 .. n - 1`` and name the tokens that were
    sent, else EngineError naming the engine: a mismatch means the engine scored
    something else than asked, which must not reach training silently.
    """
    where = f"engine {url}/generate (score)"
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise EngineError(f"{where}: answer has no meta_info (got {str(data)[:200]!r})")
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise EngineError(f"{where}: scoring was aborted: {finish.get('message') or 'no reason given'}")
    expected = len(input_ids) - start + 1
    entries = _entries(meta, "input_token_logprobs", expected, where)
    sent = [int(t) for t in input_ids[start - 1 :]]
    got = [int(e[1]) if isinstance(e, list | tuple) and len(e) >= 2 else None for e in entries]
    if got != sent:
        pos = next(i for i, (a, b) in enumerate(zip(got, sent, strict=True)) if a != b)
        raise EngineError(
            f"{where}: input_token_logprobs names token {got[pos]} at position {start - 1 + pos}; "
            f"the request sent {sent[pos]} there"
        )
    out = ScoreOutput(logprobs=[_logprob(e, where) for e in entries[1:]])
    if top_k:
        out.top_ids, out.top_logprobs = [], []
        for j, row in enumerate(_entries(meta, "input_top_logprobs", expected, where)[1:]):
            if not isinstance(row, list) or len(row) != top_k:
                raise EngineError(
                    f"{where}: input_top_logprobs at position {start + j} has "
                    f"{len(row) if isinstance(row, list) else row!r} entries, expected {top_k}"
                )
            out.top_logprobs.append([_logprob(e, where) for e in row])
            out.top_ids.append([int(e[1]) for e in row])
    if token_ids is not None:
        out.token_ids_logprobs = []
        for j, row in enumerate(_entries(meta, "input_token_ids_logprobs", expected, where)[1:]):
            asked = [int(t) for t in (token_ids[j] if _per_position(token_ids) else token_ids)]
            if not isinstance(row, list) or [int(e[1]) for e in row] != asked:
                raise EngineError(
                    f"{where}: input_token_ids_logprobs at position {start + j} does not answer the ids "
                    f"asked for ({asked[:5]}{'...' if len(asked) > 5 else ''})"
                )
            out.token_ids_logprobs.append([_logprob(e, where) for e in row])
    return out


def _error_message_from(status: int, content: bytes) -> str:
    text = content.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:1000] or f"status {status}"
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)
    return str(data)[:1000]


def _decode_body(status: int, content: bytes, url: str, call: EngineCall) -> Any:
    if status >= 400:
        kind = EngineRejected if status == 400 else EngineError
        raise kind(f"engine {url}{call.path}: HTTP {status}: {_error_message_from(status, content)}")
    if not content:
        return None
    text = content.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict) and data.get("success") is False:
        raise EngineError(f"engine {url}{call.path}: {data.get('message') or 'failed'}")
    return data


def _decode(response: httpx.Response, url: str, call: EngineCall) -> Any:
    return _decode_body(response.status_code, response.content, url, call)


class EngineUnavailable(EngineError):
    """The engine did not answer at all (refused, disconnected, timed out), as opposed to answering
    with an error: the request was not at fault, so it may be retried on another engine."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


def _transport_error(url: str, call: EngineCall, exc: Exception, timeout: float | None) -> EngineError:
    if isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError):
        return EngineUnavailable(f"engine {url}{call.path}: no answer within {timeout} s", url=url)
    return EngineUnavailable(
        f"engine {url}{call.path}: cannot reach the engine (did it die? see its log): {exc!r}", url=url
    )


# Idle connections expire on the client well before the server drops them (the embedded
# engine keeps them 120 s): reusing a connection the server is closing fails the request.
_KEEPALIVE_S = 30.0
_LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=16, keepalive_expiry=_KEEPALIVE_S)


# --------------------------------------------------------------------- clients


class SGLangClient:
    """Async client for one engine (implements :class:`miles.interfaces.EngineClient`).

    ``moe_num_layers`` / ``moe_topk`` are only needed to decode routed experts from a
    real SGLang server (which does not send their shape); the embedded engine sends it.
    The client may be used from several event loops in turn: it keeps one connection
    pool per loop.
    """

    def __init__(
        self,
        url: str,
        timeout: float = 600.0,
        *,
        moe_num_layers: int | None = None,
        moe_topk: int | None = None,
        lora_path: str | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.timeout = timeout
        self.moe_num_layers = moe_num_layers
        self.moe_topk = moe_topk
        # The LoRA adapter every generate request of this client asks for (None: the base model).
        self.lora_path = lora_path
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    def _session(self) -> aiohttp.ClientSession:
        # aiohttp, not httpx, for the async side: a rollout keeps hundreds of requests in flight
        # per engine, and httpx's connection pool does work quadratic in that number per event.
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop or self._http.closed:
            # A session belongs to the loop that opened its connections; the old one is dropped.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
            self._http = aiohttp.ClientSession(connector=connector, trust_env=False)
            self._loop = loop
        return self._http

    async def _request(self, call: EngineCall, timeout: float) -> tuple[int, bytes]:
        async with self._session().request(
            call.method, self.url + call.path, json=call.body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            return response.status, await response.read()

    async def call(self, call: EngineCall, *, timeout: float | None = None) -> Any:
        """Send one call; returns the decoded JSON (or text, or None for an empty body)."""
        timeout = self.timeout if timeout is None else timeout
        try:
            status, content = await self._request(call, timeout)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _transport_error(self.url, call, exc, timeout) from exc
        return _decode_body(status, content, self.url, call)

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = self._loop = None

    # -- generation

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_routed_experts: bool = False,
        data_parallel_rank: int | None = None,
    ) -> GenerateOutput:
        """Generate from ``input_ids``; ``data_parallel_rank`` pins the request to one DP rank."""
        call = generate_call(
            input_ids,
            params,
            rid=rid,
            return_routed_experts=return_routed_experts,
            data_parallel_rank=data_parallel_rank,
            lora_path=self.lora_path,
        )
        data = await self.call(call)
        return parse_generate_response(
            data,
            prompt_len=len(input_ids),
            url=self.url,
            moe_num_layers=self.moe_num_layers,
            moe_topk=self.moe_topk,
        )

    async def score(
        self,
        input_ids: Sequence[int],
        *,
        start: int,
        temperature: float = 1.0,
        top_k: int = 0,
        token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> ScoreOutput:
        """Log-probs of ``input_ids[start:]`` (one forward pass, nothing generated); see :class:`ScoreOutput`.

        ``temperature`` divides the logits as when sampling (0 scores at 1). ``token_ids``: one
        flat list asked at every position, or one list per scored position (embedded engine only).
        """
        call = score_call(input_ids, start=start, temperature=temperature, top_k=top_k, token_ids=token_ids)
        data = await self.call(call)
        return parse_score_response(
            data, input_ids, start=start, top_k=top_k, token_ids=token_ids, url=self.url
        )

    async def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        """The ids the engine tokenizes ``text`` into (``/generate`` with ``max_new_tokens`` 0 and the
        prompt's log-probs: nothing is generated). A served teacher's tokenizer check uses it."""
        body = {
            "text": text,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        data = await self.call(EngineCall("POST", "/generate", body), timeout=timeout)
        entries = (
            (data.get("meta_info") or {}).get("input_token_logprobs") if isinstance(data, dict) else None
        )
        if not isinstance(entries, list):
            raise EngineError(
                f"engine {self.url}: the tokenizer check got no meta_info.input_token_logprobs from /generate"
            )
        return [int(e[1]) for e in entries]

    async def health(self, timeout: float = 5.0) -> bool:
        try:
            status, _ = await self._request(HEALTH, timeout)
        except (TimeoutError, aiohttp.ClientError):
            return False
        return status == 200

    async def weight_version(self) -> int:
        data = await self.call(WEIGHT_VERSION)
        return parse_weight_version((data or {}).get("weight_version"), where=f"engine {self.url}")

    async def get_model_info(self) -> dict[str, Any]:
        return await self.call(MODEL_INFO)

    async def get_server_info(self) -> dict[str, Any]:
        return await self.call(SERVER_INFO)

    # -- control

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.call(pause_call(mode))

    async def continue_generation(self) -> None:
        await self.call(CONTINUE)

    async def release_memory_occupation(self) -> None:
        """Free the engine's KV cache (requests in flight are retracted and wait for the resume)."""
        await self.call(RELEASE_MEMORY)

    async def resume_memory_occupation(self) -> None:
        await self.call(RESUME_MEMORY)

    async def flush_cache(self, *, retries: int = 60, interval_s: float = 1.0) -> None:
        """SGLang refuses (HTTP 400) to flush while requests are in flight; retry until it is idle."""
        for attempt in range(retries + 1):
            try:
                await self.call(FLUSH)
                return
            except EngineError as exc:
                if "HTTP 400" not in str(exc) or attempt == retries:
                    raise
            await asyncio.sleep(interval_s)

    async def abort_request(self, rid: str) -> None:
        await self.call(abort_call(rid))

    async def abort_all(self) -> None:
        await self.call(abort_call(abort_all=True))

    async def update_weight_version(self, version: int | str) -> None:
        await self.call(update_version_call(version))

    # -- weights

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | str | None = None, *, flush_cache: bool = True
    ) -> dict[str, Any]:
        return await self.call(update_from_disk_call(model_path, weight_version, flush_cache=flush_cache))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "gloo",
    ) -> dict[str, Any]:
        return await self.call(
            init_group_call(master_address, master_port, rank_offset, world_size, group_name, backend)
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP,
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        *,
        bucket_index: int | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """One bucket; the embedded engine stages it unless ``weight_version`` is set (the last bucket)."""
        return await self.call(
            update_from_distributed_call(
                names,
                dtypes,
                shapes,
                group_name,
                weight_version,
                flush_cache,
                bucket_index=bucket_index,
                load_format=load_format,
            )
        )

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        return await self.call(destroy_group_call(group_name))

    async def update_weights_from_tensor(
        self,
        files: Sequence[str],
        weight_version: int | str | None = None,
        *,
        load_format: str = HANDOFF_LOAD_FORMAT,
        flush_cache: bool = True,
        bucket_index: int | None = None,
    ) -> dict[str, Any]:
        """One bucket; the embedded engine stages it unless ``weight_version`` is set (the last bucket)."""
        return await self.call(
            update_from_tensor_call(
                files,
                weight_version,
                load_format=load_format,
                flush_cache=flush_cache,
                bucket_index=bucket_index,
            )
        )

    async def update_weights_from_disk_delta(
        self, version: int, weight_version: int | str | None = None
    ) -> dict[str, Any]:
        """Apply disk-delta ``version`` from the engine's ``--delta-root`` (verified before anything changes)."""
        return await self.call(update_from_disk_delta_call(version, weight_version))

    async def weights_checker(
        self,
        action: str,
        skip: Sequence[str] | None = None,
        *,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> dict[str, Any]:
        """``reset_tensors`` (answer lists ``reset`` / ``untouched``) or ``checksum`` ({name: {dtype, shape, digest}})."""
        return await self.call(weights_checker_call(action, skip, seed, lora_name))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        return await self.call(load_lora_adapter_call(lora_name, lora_path))

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self.call(unload_lora_adapter_call(lora_name))


class SyncEngineClient:
    """Blocking twin of :class:`SGLangClient` for processes without an event loop (trainer rank 0)."""

    def __init__(
        self,
        url: str,
        timeout: float = 600.0,
        *,
        moe_num_layers: int | None = None,
        moe_topk: int | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.timeout = timeout
        self.moe_num_layers = moe_num_layers
        self.moe_topk = moe_topk
        self._http = httpx.Client(base_url=self.url, timeout=timeout, trust_env=False)

    def __repr__(self) -> str:
        return f"SyncEngineClient({self.url!r})"

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def call(self, call: EngineCall, *, timeout: float | None = None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        try:
            response = self._http.request(call.method, call.path, json=call.body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise _transport_error(self.url, call, exc, timeout) from exc
        return _decode(response, self.url, call)

    def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_routed_experts: bool = False,
        data_parallel_rank: int | None = None,
        lora_path: str | None = None,
    ) -> GenerateOutput:
        """Blocking :meth:`SGLangClient.generate`."""
        data = self.call(
            generate_call(
                input_ids,
                params,
                rid=rid,
                return_routed_experts=return_routed_experts,
                data_parallel_rank=data_parallel_rank,
                lora_path=lora_path,
            )
        )
        return parse_generate_response(
            data,
            prompt_len=len(input_ids),
            url=self.url,
            moe_num_layers=self.moe_num_layers,
            moe_topk=self.moe_topk,
        )

    def score(
        self,
        input_ids: Sequence[int],
        *,
        start: int,
        temperature: float = 1.0,
        top_k: int = 0,
        token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> ScoreOutput:
        """Blocking :meth:`SGLangClient.score`."""
        call = score_call(input_ids, start=start, temperature=temperature, top_k=top_k, token_ids=token_ids)
        data = self.call(call)
        return parse_score_response(
            data, input_ids, start=start, top_k=top_k, token_ids=token_ids, url=self.url
        )

    def health(self, timeout: float = 5.0) -> bool:
        try:
            return self._http.get(HEALTH.path, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def weight_version(self) -> int:
        data = self.call(WEIGHT_VERSION)
        return parse_weight_version((data or {}).get("weight_version"), where=f"engine {self.url}")

    def get_model_info(self) -> dict[str, Any]:
        return self.call(MODEL_INFO)

    def get_server_info(self) -> dict[str, Any]:
        return self.call(SERVER_INFO)

    def pause_generation(self, mode: str = "abort") -> None:
        self.call(pause_call(mode))

    def continue_generation(self) -> None:
        self.call(CONTINUE)

    def flush_cache(self, *, retries: int = 60, interval_s: float = 1.0) -> None:
        """SGLang refuses (HTTP 400) to flush while requests are in flight; retry until it is idle."""
        for attempt in range(retries + 1):
            try:
                self.call(FLUSH)
                return
            except EngineError as exc:
                if "HTTP 400" not in str(exc) or attempt == retries:
                    raise
            time.sleep(interval_s)

    def abort_request(self, rid: str) -> None:
        self.call(abort_call(rid))

    def abort_all(self) -> None:
        self.call(abort_call(abort_all=True))

    def update_weight_version(self, version: int | str) -> None:
        self.call(update_version_call(version))

    def update_weights_from_disk(
        self, model_path: str, weight_version: int | str | None = None, *, flush_cache: bool = True
    ) -> dict[str, Any]:
        return self.call(update_from_disk_call(model_path, weight_version, flush_cache=flush_cache))

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str = "gloo",
    ) -> dict[str, Any]:
        return self.call(
            init_group_call(master_address, master_port, rank_offset, world_size, group_name, backend)
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP,
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        *,
        bucket_index: int | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        return self.call(
            update_from_distributed_call(
                names,
                dtypes,
                shapes,
                group_name,
                weight_version,
                flush_cache,
                bucket_index=bucket_index,
                load_format=load_format,
            )
        )

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        return self.call(destroy_group_call(group_name))

    def update_weights_from_tensor(
        self,
        files: Sequence[str],
        weight_version: int | str | None = None,
        *,
        load_format: str = HANDOFF_LOAD_FORMAT,
        flush_cache: bool = True,
        bucket_index: int | None = None,
    ) -> dict[str, Any]:
        return self.call(
            update_from_tensor_call(
                files,
                weight_version,
                load_format=load_format,
                flush_cache=flush_cache,
                bucket_index=bucket_index,
            )
        )

    def update_weights_from_disk_delta(
        self, version: int, weight_version: int | str | None = None
    ) -> dict[str, Any]:
        return self.call(update_from_disk_delta_call(version, weight_version))

    def weights_checker(
        self,
        action: str,
        skip: Sequence[str] | None = None,
        *,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> dict[str, Any]:
        return self.call(weights_checker_call(action, skip, seed, lora_name))

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load the peft adapter directory ``lora_path`` as ``lora_name`` (SGLang's /load_lora_adapter)."""
        return self.call(load_lora_adapter_call(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self.call(unload_lora_adapter_call(lora_name))


def call_engine(
    url: str,
    endpoint: str,
    json: dict[str, Any] | None = None,
    *,
    method: str = "POST",
    timeout: float = 600.0,
) -> Any:
    """One blocking call to ``url + endpoint``; returns the decoded answer or raises EngineError."""
    with SyncEngineClient(url, timeout=timeout) as client:
        return client.call(EngineCall(method, endpoint if endpoint.startswith("/") else "/" + endpoint, json))
