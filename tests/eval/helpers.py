"""Pieces for the evaluation tests: a config builder, user plugins (a reward, eval backends), exports,
and a fault injector in front of a real engine.

The reward and the backends are user plugins loaded by import path (``eval.helpers:...``),
exactly as a user's own would be; none of them stands in for a part of Miles.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles.config.schema import MilesConfig
from miles.interfaces import EvalRequest
from miles.types import Sample

# --------------------------------------------------------------------------- config


def write_eval_data(path: Path, n: int = 4) -> Path:
    """``n`` prompts in the word-level vocabulary of the tiny test model (``w0`` .. ``w127``)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"w{i + 1} w{i + 2} w{i + 3}", "label": f"w{i + 4}"}) + "\n")
    return path


def eval_data_section(data_file: Path) -> dict[str, Any]:
    return {"path": str(data_file), "apply_chat_template": False, "shuffle": False}


def make_config(
    tmp_path: Path,
    model_dir: Path,
    data_file: Path,
    *,
    schedule: str = "sync",
    num_steps: int = 10,
    **eval_: Any,
) -> MilesConfig:
    """A recipe whose eval section scores ``data_file`` with :class:`ProbeReward` (options in ``eval_``)."""
    section: dict[str, Any] = {
        "data": eval_data_section(data_file),
        "reward": "eval.helpers:ProbeReward",
        "max_new_tokens": 3,
        "n_samples_per_prompt": 2,
        **eval_,
    }
    return MilesConfig.model_validate(
        {
            "run": {"output_dir": str(tmp_path), "num_steps": num_steps},
            "model": {"path": str(model_dir)},
            "data": {"path": str(data_file)},
            "engine": {"options": {"torch_threads": 1}},
            "schedule": schedule,
            "eval": section,
        }
    )


# --------------------------------------------------------------------------- reward


class Probe:
    """What the test wants the reward to look at while the evaluation runs."""

    def __init__(self) -> None:
        self.lock: threading.Lock | None = None
        self.paused = False
        self.calls: list[dict[str, Any]] = []

    def reset(self, lock: threading.Lock | None = None) -> None:
        self.lock, self.paused, self.calls = lock, False, []


PROBE = Probe()


class ProbeReward:
    """A constant reward (so the expected score is known) that records the run's state at each call."""

    def __init__(self, value: float = 0.25, delay_s: float = 0.0) -> None:
        self.value = value
        self.delay_s = delay_s

    async def __call__(self, sample: Sample) -> float:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        PROBE.calls.append(
            {
                "thread": threading.current_thread().name,
                "lock_held": PROBE.lock.locked() if PROBE.lock is not None else None,
                "paused": PROBE.paused,
                "versions": list(sample.weight_versions),
                "time": time.monotonic(),
            }
        )
        return self.value


@contextlib.contextmanager
def pause_production() -> Iterator[None]:
    """What the driver passes: here it only flags that production is paused."""
    PROBE.paused = True
    try:
        yield
    finally:
        PROBE.paused = False


# --------------------------------------------------------------------------- exports


def failing_export(directory: str) -> None:
    raise OSError(28, "No space left on device")


def empty_export(directory: str) -> None:
    """Returns normally but writes no checkpoint (a backend bug the evaluator must catch)."""
    os.makedirs(directory, exist_ok=True)


class HFExport:
    """Writes a Hugging Face checkpoint the way ``backend.export_hf`` does (weights, config, tokenizer)."""

    def __init__(self, model: Any, tokenizer_dir: Path) -> None:
        self.model = model
        self.tokenizer_dir = tokenizer_dir
        self.calls: list[str] = []

    def __call__(self, directory: str) -> None:
        self.calls.append(directory)
        self.model.save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = self.tokenizer_dir / name
            if src.is_file():
                shutil.copyfile(src, os.path.join(directory, name))


# --------------------------------------------------------------------------- backends


class RaisingBackend:
    """A backend whose service is down."""

    def evaluate(self, request: EvalRequest) -> dict[str, float]:
        raise ConnectionError("judge service unreachable")


GATE = threading.Event()
SEEN: list[dict[str, Any]] = []


class GatedBackend:
    """Scores only once the test opens ``GATE``; records what it was handed."""

    def __init__(self, score: float = 0.5, mean_weight_version_offset: float | None = None) -> None:
        self.score = score
        self.offset = mean_weight_version_offset

    def evaluate(self, request: EvalRequest) -> dict[str, float]:
        SEEN.append(
            {
                "dir": request.checkpoint_dir,
                "has_config": os.path.isfile(os.path.join(request.checkpoint_dir, "config.json")),
                "step": request.step,
                "version": request.weight_version,
                "options": dict(request.options),
            }
        )
        if not GATE.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        out = {"score": self.score}
        if self.offset is not None:
            out |= {
                "mean_weight_version": request.weight_version + self.offset,
                "mixed_version_fraction": 0.0,
            }
        return out


# --------------------------------------------------------------------------- fault injection


@contextlib.contextmanager
def version_dropping_proxy(target: str) -> Iterator[str]:
    """An HTTP proxy to a real engine that drops ``weight_version`` from ``/update_weights_from_disk``.

    That is what an SGLang build whose disk-load request lacks the field does: the weights
    load, the version stays where it was. Everything else passes through unchanged.
    """
    import httpx

    client = httpx.Client(base_url=target, timeout=60.0, trust_env=False)

    class Handler(http.server.BaseHTTPRequestHandler):
        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if self.path == "/update_weights_from_disk" and body:
                payload = json.loads(body)
                payload.pop("weight_version", None)
                body = json.dumps(payload).encode()
            headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
            reply = client.request(self.command, self.path, content=body or None, headers=headers)
            self.send_response(reply.status_code)
            self.send_header("Content-Type", reply.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        do_GET = do_POST = _forward

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        client.close()
