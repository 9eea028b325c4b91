"""Optimizer-state streaming: AdamW whose state lives on disk, one bucket of parameters at a time.

The parameters are cut, in model order, into buckets of bounded state bytes. Each bucket's Adam
state (FP32 master weights, ``exp_avg``, ``exp_avg_sq`` -- the moments optionally in BF16 --
and torch's per-parameter step counts) is one safetensors file. A step loads a bucket's file
onto the parameters' device, runs torch's own Adam update with decoupled weight decay (the
functional ``torch.optim.adam.adam`` that ``torch.optim.AdamW`` calls) on the FP32 masters,
copies the masters into the model's parameters (BF16 or FP32), writes the file back and frees
it, so only that bucket's state is resident (two with ``prefetch``: the next file is read on a
thread while this one updates). The model's parameters are always their master cast to their
dtype, so a checkpoint needs only the bucket files: loading them restores the model too.

Counters (:attr:`StreamingAdamW.loads`, :attr:`StreamingAdamW.peak_resident_bytes`) are
exposed so tests and benchmarks can see what was resident.

Resuming on the same layout: :meth:`StreamingAdamW.save` writes a manifest with the parallel
layout, this rank, the moments' dtype and every bucket's parameter names and shapes, and
:meth:`StreamingAdamW.load` refuses, in one sentence, any difference. Under another TP / DP layout
:meth:`StreamingAdamW.load_resharded` rebuilds this rank's buckets from the saved ranks' files, one
parameter at a time (``miles_megatron.reshard``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam

from miles.errors import ComponentError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "miles-megatron-streamed-adamw/1"
STATE_PREFIX = "miles-megatron-optstate-"
_FIELDS = ("master", "exp_avg", "exp_avg_sq")
_MOMENTS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StreamedParam:
    """One trainable parameter: its name (the layout's, for the manifest) and its weight decay."""

    name: str
    param: torch.nn.Parameter
    weight_decay: float


@dataclass(frozen=True)
class StreamingConfig:
    """How the state is cut and kept; ``moments`` is the stored dtype of ``exp_avg`` / ``exp_avg_sq``."""

    bucket_bytes: int
    betas: tuple[float, float]
    eps: float
    moments: str = "float32"
    prefetch: bool = True
    grad_attr: str = "grad"  # megatron's DDP accumulates into ``main_grad``

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.moments not in _MOMENTS:
            raise ValueError(f"moments must be one of {sorted(_MOMENTS)}, got {self.moments!r}")


def state_bytes(numel: int, moments: str) -> int:
    """Bytes of one parameter's stored state: FP32 master + two moments (+ its step, negligible)."""
    return numel * (4 + 2 * _MOMENTS[moments].itemsize)


def plan_buckets(numels: Sequence[int], bucket_bytes: int, moments: str) -> list[list[int]]:
    """Consecutive parameter indices, each bucket at most ``bucket_bytes`` of state (a larger
    parameter gets a bucket of its own)."""
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        b = state_bytes(n, moments)
        if buckets and size + b <= bucket_bytes:
            buckets[-1].append(i)
            size += b
        else:
            buckets.append([i])
            size = b
    return buckets


class StreamingAdamW:
    """AdamW (torch's update, decoupled weight decay) over ``params`` with the state streamed from files.

    ``directory``: where the working files go (a fresh subdirectory is created there and only it
    is removed by :meth:`close`); None: the system temp directory. ``layout``: what a checkpoint
    must match to be resumed (the parallel sizes and this rank).
    """

    def __init__(
        self,
        params: Sequence[StreamedParam],
        config: StreamingConfig,
        layout: Mapping[str, Any],
        directory: str | None = None,
    ) -> None:
        if not params:
            raise ValueError("StreamingAdamW needs at least one parameter")
        self.params = list(params)
        self.config = config
        self.layout = dict(layout)
        self.moments = _MOMENTS[config.moments]
        self.device = self.params[0].param.device
        self.buckets = plan_buckets(
            [p.param.numel() for p in self.params], config.bucket_bytes, config.moments
        )
        self.directory = tempfile.mkdtemp(prefix=STATE_PREFIX, dir=directory)
        self._files: list[str] = []
        self.loads = 0  # bucket files read, over the optimizer's life
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self._lock = threading.Lock()
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-optstate")
            if config.prefetch
            else None
        )
        for index, bucket in enumerate(self.buckets):
            state: dict[str, torch.Tensor] = {}
            for i in bucket:
                p = self.params[i]
                master = p.param.detach().to("cpu", torch.float32).clone()
                state[f"{p.name}.master"] = master
                state[f"{p.name}.exp_avg"] = torch.zeros_like(master, dtype=self.moments)
                state[f"{p.name}.exp_avg_sq"] = torch.zeros_like(master, dtype=self.moments)
                state[f"{p.name}.step"] = torch.zeros((), dtype=torch.float32)
            self._files.append(os.path.join(self.directory, f"bucket-{index:05d}.safetensors"))
            self._write(index, state)

    # ------------------------------------------------------------------ state files

    def _write(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self._files[index]
        tmp = path + ".tmp"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, path)  # a crash mid-write leaves the previous file whole

    def _read(self, index: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        state = load_file(self._files[index], device=str(self.device))
        nbytes = sum(t.numel() * t.element_size() for k, t in state.items() if not k.endswith(".step"))
        with self._lock:
            self.loads += 1
            self.resident_bytes += nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return state

    def _release(self, state: dict[str, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for k, t in state.items() if not k.endswith(".step"))
        state.clear()
        with self._lock:
            self.resident_bytes -= nbytes

    def _states(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Every bucket's state in order, the next one read ahead on the thread when prefetching."""
        if self._pool is None:
            for index in range(len(self.buckets)):
                yield index, self._read(index)
            return
        ahead: Future[dict[str, torch.Tensor]] = self._pool.submit(self._read, 0)
        for index in range(len(self.buckets)):
            state = ahead.result()
            if index + 1 < len(self.buckets):
                ahead = self._pool.submit(self._read, index + 1)
            yield index, state

    def disk_bytes(self) -> int:
        """The bytes of the bucket files (the whole state, as stored)."""
        return sum(os.path.getsize(f) for f in self._files)

    # ------------------------------------------------------------------ the update

    def zero_grad(self) -> None:
        """Drop the gradients (``grad``; megatron's DDP zeroes its own ``main_grad`` buffers)."""
        for p in self.params:
            p.param.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW step at ``lr`` from the parameters' current gradients (already clipped)."""
        beta1, beta2 = self.config.betas
        foreach = self.device.type == "cuda"  # as torch.optim.AdamW picks by default
        for index, state in self._states():
            by_decay: dict[float, list[StreamedParam]] = {}
            for i in self.buckets[index]:
                p = self.params[i]
                if getattr(p.param, self.config.grad_attr, None) is not None:  # as torch: no grad, no update
                    by_decay.setdefault(p.weight_decay, []).append(p)
            for weight_decay, members in by_decay.items():
                masters = [state[f"{p.name}.master"] for p in members]
                grads = [getattr(p.param, self.config.grad_attr).float() for p in members]
                # The math in FP32 whatever the stored dtype (BF16 moments are rounded when written back).
                exp_avgs = [state[f"{p.name}.exp_avg"].float() for p in members]
                exp_avg_sqs = [state[f"{p.name}.exp_avg_sq"].float() for p in members]
                steps = [state[f"{p.name}.step"].cpu() for p in members]
                adam(
                    masters,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    [],
                    steps,
                    foreach=foreach,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=lr,
                    weight_decay=weight_decay,
                    eps=self.config.eps,
                    maximize=False,
                )
                for p, master, m, v, s in zip(members, masters, exp_avgs, exp_avg_sqs, steps, strict=True):
                    p.param.data.copy_(master)
                    state[f"{p.name}.exp_avg"] = m.to(self.moments)
                    state[f"{p.name}.exp_avg_sq"] = v.to(self.moments)
                    state[f"{p.name}.step"] = s
            self._write(index, state)
            self._release(state)

    # ------------------------------------------------------------------ checkpoints

    def manifest(self) -> dict[str, Any]:
        """What a checkpoint of this state must match to be resumed."""
        return {
            "format": FORMAT,
            "layout": self.layout,
            "moments": self.config.moments,
            "buckets": [
                [[self.params[i].name, list(self.params[i].param.shape)] for i in bucket]
                for bucket in self.buckets
            ],
        }

    def save(self, directory: str) -> None:
        """The bucket files and the manifest into ``directory`` (created)."""
        os.makedirs(directory, exist_ok=True)
        for path in self._files:
            shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(self.manifest(), f, indent=1)

    def load(self, directory: str) -> None:
        """The state saved in ``directory``, after checking its manifest; the parameters become its masters."""
        path = os.path.join(directory, MANIFEST)
        if not os.path.isfile(path):
            raise ComponentError(f"{directory} holds no streamed optimizer state ({MANIFEST} is missing)")
        with open(path) as f:
            saved = json.load(f)
        self.check_manifest(saved, directory)
        for index, own in enumerate(self._files):
            shutil.copyfile(os.path.join(directory, os.path.basename(own)), own)
            state = self._read(index)
            with torch.no_grad():
                for i in self.buckets[index]:
                    p = self.params[i]
                    p.param.data.copy_(state[f"{p.name}.master"])
            self._release(state)

    def load_resharded(
        self,
        sources: Sequence[str],
        reshard: Callable[[str, list[torch.Tensor]], torch.Tensor],
        where: str,
    ) -> None:
        """This rank's state rebuilt from state saved under another layout (``miles_megatron.reshard``).

        ``sources``: the saved ranks' directories whose shards this rank's are made of (in TP order);
        ``reshard(name, shards)``: this rank's shard of parameter ``name`` from theirs. Every field but
        the step count (the masters and both moments, in their stored dtype) goes through it, one
        parameter at a time, read from the saved bucket files as needed (``safe_open``), so what is
        resident is one bucket of this rank's and one parameter's saved shards. The buckets are this
        run's own; the parameters become their masters."""
        from safetensors import safe_open

        manifests = []
        for source in sources:
            path = os.path.join(source, MANIFEST)
            if not os.path.isfile(path):
                raise ComponentError(f"{source} holds no streamed optimizer state ({MANIFEST} is missing)")
            with open(path) as f:
                manifests.append(json.load(f))
        own = self.manifest()
        names = sorted(name for bucket in own["buckets"] for name, _ in bucket)
        for source, saved in zip(sources, manifests, strict=True):
            if saved.get("format") != FORMAT:
                raise ComponentError(
                    f"{where}: streamed optimizer state of format {saved.get('format')!r}, expected {FORMAT!r}"
                )
            if saved["moments"] != own["moments"]:
                raise ComponentError(
                    f"{where}: the streamed optimizer state keeps its moments in {saved['moments']}, this run in "
                    f"{own['moments']} (megatron.optimizer_streaming_moments); resume it with the same moments"
                )
            if sorted(name for bucket in saved["buckets"] for name, _ in bucket) != names:
                raise ComponentError(f"{where}: the streamed optimizer state in {source} is of another model")
        with contextlib.ExitStack() as stack:
            files: list[dict[str, Any]] = []  # per source: parameter name -> its open bucket file
            for source, saved in zip(sources, manifests, strict=True):
                by_name = {}
                for index, bucket in enumerate(saved["buckets"]):
                    f = stack.enter_context(
                        safe_open(os.path.join(source, f"bucket-{index:05d}.safetensors"), "pt")
                    )
                    by_name.update({name: f for name, _ in bucket})
                files.append(by_name)
            for index, bucket in enumerate(self.buckets):
                state: dict[str, torch.Tensor] = {}
                for i in bucket:
                    p = self.params[i]
                    for field in _FIELDS:
                        key = f"{p.name}.{field}"
                        t = reshard(p.name, [by_name[p.name].get_tensor(key) for by_name in files])
                        if t.shape != p.param.shape:
                            raise ComponentError(
                                f"{where}: {p.name}'s {field} resharded to {tuple(t.shape)}, the parameter is "
                                f"{tuple(p.param.shape)}"
                            )
                        state[key] = t
                    state[f"{p.name}.step"] = files[0][p.name].get_tensor(f"{p.name}.step")
                self._write(index, state)
                with torch.no_grad():
                    for i in bucket:
                        p = self.params[i]
                        p.param.data.copy_(state[f"{p.name}.master"])

    def check_manifest(self, saved: Mapping[str, Any], where: str) -> None:
        """Refuse, in one sentence, a saved state that is not this optimizer's layout."""
        own = self.manifest()
        if saved.get("format") != FORMAT:
            raise ComponentError(
                f"{where}: streamed optimizer state of format {saved.get('format')!r}, expected {FORMAT!r}"
            )
        if saved["layout"] != own["layout"]:
            diff = {
                k: (saved["layout"].get(k), own["layout"].get(k))
                for k in own["layout"]
                if saved["layout"].get(k) != own["layout"].get(k)
            }
            raise ComponentError(
                f"{where}: the streamed optimizer state was written under another parallel layout "
                f"(checkpoint, this run: {diff}); streamed state resumes only on the same layout"
            )
        if saved["moments"] != own["moments"]:
            raise ComponentError(
                f"{where}: the streamed optimizer state keeps its moments in {saved['moments']}, this run in "
                f"{own['moments']} (megatron.optimizer_streaming_moments); streamed state resumes only on the same layout"
            )
        if saved["buckets"] != own["buckets"]:
            raise ComponentError(
                f"{where}: the streamed optimizer state's buckets ({len(saved['buckets'])}) differ from this run's "
                f"({len(own['buckets'])}) in their parameters, shapes or boundaries (the model or "
                "megatron.optimizer_streaming_bucket_mb changed); streamed state resumes only on the same layout"
            )

    def close(self) -> None:
        """Stop the reader thread and remove the working files and the directory this optimizer created."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for path in self._files:
            for p in (path, path + ".tmp"):
                if os.path.exists(p):
                    os.remove(p)
        self._files = []
        try:
            os.rmdir(self.directory)
        except OSError as exc:  # a file we did not write: leave it
            log.warning("optimizer streaming: could not remove %s: %s", self.directory, exc)
