"""The FSDP2 backend as the driver sees it: a thin controller over its rank group.

``setup`` starts ``fsdp.num_ranks`` ranks (gloo on CPU, NCCL on one GPU per rank), each
of which loads the Hugging Face model as is and shards it (see ``rank.py``). Where they
run is the placement's choice: local processes by default (``ranks.ProcessRanks``), or
Ray actors in a placement group when ``spec.placement["launcher"]`` is ``"ray"``
(``ray_ranks.RayRanks``). Every other method sends one command to every rank and waits
for all answers. A rank that raises or dies turns into a ``RankFailedError`` carrying its
traceback, the other ranks are stopped (they may be waiting in a collective that will
never complete), and the backend refuses further work.

Local ranks start with the ``spawn`` method by default (``fsdp.start_method``), so a
script that drives the backend directly needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

import miles.lora
from miles.config.schema import TrainSection
from miles.config.sections import backend_sections
from miles.errors import ConfigError, ModelError
from miles.interfaces import BackendSpec, TransportStats
from miles.train_rows import OLD_LOGPROBS, check_batch, mini_batches, sub_batch
from miles.types import Sample, TrainBatch
from miles_fsdp.batching import split_batch, split_for_scoring
from miles_fsdp.config import FSDPOptions
from miles_fsdp.ranks import RankFailedError, RankGroup, free_port

__all__ = ["FSDPBackend", "RankFailedError", "free_port"]

log = logging.getLogger(__name__)

LAUNCHERS = ("local", "ray")
# Hugging Face model types whose routers routing replay hooks (miles_fsdp.routing.REPLAYABLE_ROUTERS).
REPLAYABLE_MODEL_TYPES = ("qwen3_moe",)
# What a backend whose state was offloaded to the CPU may still be asked to do.
_WHILE_OFFLOADED = frozenset({"offload", "onload"})


class FSDPBackend:
    """``miles.interfaces.Backend`` on PyTorch FSDP2; options come from the ``train`` and ``fsdp`` sections."""

    # Multi-LoRA (lora.adapters): one peft model holding every adapter, an optimizer per adapter,
    # each step's batch split by Sample.metadata[ADAPTER_KEY] (see miles.driver.adapters).
    trains_adapters = True

    @staticmethod
    def routing_replay_problem(model_path: str, config: Any) -> str | None:
        """Why this backend cannot replay ``model_path``'s MoE routing under ``config`` (one sentence), or
        None: it replays Qwen3-MoE through a forward hook on each router (``miles_fsdp.routing``)."""
        return routing_replay_problem(model_path, getattr(config, "fsdp", None) or FSDPOptions())

    def __init__(self) -> None:
        self._ranks: RankGroup | None = None
        self._finalizer: weakref.finalize | None = None
        self._offloaded = False
        self.spec: BackendSpec | None = None
        self.train_opts: TrainSection | None = None
        self.opts: FSDPOptions | None = None
        self._kind: str | None = None
        self._adapters: list[str] = []

    # ----------------------------------------------------------------- set-up

    def setup(self, spec: BackendSpec) -> None:
        if self._ranks is not None and self._ranks.broken is None:
            raise RuntimeError("FSDPBackend.setup called twice; shut it down first")
        self.train_opts, self.opts = _validate_options(spec.options)
        from miles.lr_schedule import decay_steps

        decay_steps(self.train_opts, spec.config)  # a schedule with nothing to span fails here, once
        launcher = spec.placement.get("launcher", "local")
        if launcher not in LAUNCHERS:
            raise ConfigError(f"fsdp: placement launcher {launcher!r} is not one of {list(LAUNCHERS)}")
        _check_model_dir(spec.model_path, "model")
        if self.train_opts.use_rollout_routing_replay:
            problem = routing_replay_problem(spec.model_path, self.opts)
            if problem is not None:
                raise ConfigError(f"train.use_rollout_routing_replay: backend 'fsdp' {problem}")
        if spec.temperature <= 0:
            raise ConfigError(
                f"fsdp: the rollout temperature must be > 0 to compute log-probs, got {spec.temperature}"
            )
        n = self.opts.num_ranks
        bundle: dict[str, float] = {}
        if launcher == "ray":
            from miles_fsdp.ray_ranks import trainer_bundle

            bundle = trainer_bundle(spec.placement, self.opts.device)
        elif self.opts.device == "cuda":
            import torch

            if torch.cuda.device_count() < n:
                raise ConfigError(
                    f"fsdp.num_ranks is {n} on device cuda but {torch.cuda.device_count()} GPU(s) are visible; "
                    "use one GPU per rank, or device: cpu"
                )
        from miles.plugins import validate_component_ref

        # Unknown names fail here, in one line, instead of as a traceback from every rank.
        validate_component_ref("loss", spec.loss)
        if spec.critic is not None:
            validate_component_ref("loss", spec.critic.loss)
            _check_model_dir(spec.critic.model_path, "critic")
        for path, role in ((spec.ref_model_path, "reference model"), (spec.teacher_model_path, "teacher")):
            if path is not None:
                _check_model_dir(path, role)
        if spec.correction:
            validate_component_ref("correction", spec.correction)
        from miles_fsdp import lora

        lora_opts = miles.lora.section(spec.config)
        if lora_opts is not None:
            for name, shape in lora_opts.named().items():  # on the meta device: nothing is loaded
                field = f"lora.adapters.{name}.target_modules" if lora_opts.multi else "lora.target_modules"
                lora.check_targets(spec.model_path, shape, field)
        if spec.engine_urls:
            from miles.plugins import make_component

            # Built (not connected) here too, so a wrong transport option is one clear error, not one per rank.
            transport = make_component("transport", spec.transport, dict(spec.transport_options))
            if lora_opts is not None and not getattr(transport, "carries_adapters", False):
                raise ConfigError(miles.lora.transport_refusal(spec.transport))
        self.spec = spec
        self._offloaded = False
        self._kind = None
        # Multi-LoRA: the adapters, in the recipe's order (each step trains those the batch has rows of).
        self._adapters = list(lora_opts.named()) if lora_opts is not None and lora_opts.multi else []
        if self._finalizer is not None:  # a group that failed earlier: already stopped
            self._finalizer.detach()
        if launcher == "ray":
            from miles_fsdp.ray_ranks import RayRanks

            ranks: RankGroup = RayRanks(
                spec,
                n,
                bundle=bundle,
                command_timeout_s=self.opts.command_timeout_s,
                startup_timeout_s=self.opts.startup_timeout_s,
            )
        else:
            from miles_fsdp.ranks import ProcessRanks

            ranks = ProcessRanks(
                spec, n, start_method=self.opts.start_method, command_timeout_s=self.opts.command_timeout_s
            )
        self._ranks = ranks
        self._finalizer = weakref.finalize(self, ranks.kill)
        ranks.wait_ready(self.opts.startup_timeout_s)
        log.info("fsdp: %d rank(s) ready on %s (%s)", n, self.opts.device, launcher)
        if self.opts.max_tokens_per_gpu is not None:
            log.info(
                "fsdp: packed micro-batches of at most %d tokens (train.micro_batch_size %d is not used)",
                self.opts.max_tokens_per_gpu,
                self.train_opts.micro_batch_size,
            )

    # ------------------------------------------------------------------ steps

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One step's batch: one optimizer step, or ``train.steps_per_rollout`` on its mini-batches.

        With several steps the policy moves between them, so the PPO "old" log-probs (the policy
        that the batch's advantages refer to) are scored once, before the first update, and every
        mini-batch's ratio is taken against them. With one step they are the current log-probs,
        detached, and no scoring pass runs (exactly as before the option existed).
        """
        assert self.opts is not None and self.train_opts is not None
        check_batch(batch, replay=self.train_opts.use_rollout_routing_replay)
        if self._adapters:
            return self._train_adapters(batch)
        parts = mini_batches(len(batch.samples), self.train_opts.steps_per_rollout)
        if len(parts) == 1:
            shares = split_batch(
                batch,
                self.opts.num_ranks,
                self.train_opts.micro_batch_size,
                max_tokens=self.opts.max_tokens_per_gpu,
            )
            return dict(self._run("train_step", shares)[0])
        if len(parts) < self.train_opts.steps_per_rollout:
            log.warning(
                "fsdp: step %d has %d samples, fewer than train.steps_per_rollout (%d); taking %d steps",
                batch.step,
                len(batch.samples),
                self.train_opts.steps_per_rollout,
                len(parts),
            )
        t0 = time.perf_counter()
        extra: dict[str, list[list[float]]] = {}
        if self._loss_kind() == "policy":
            extra[OLD_LOGPROBS] = self.score(batch.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
        old_s = time.perf_counter() - t0
        results: list[tuple[dict[str, float], int]] = []
        for indices in parts:
            part = sub_batch(batch, indices)
            if part.num_loss_tokens == 0:
                # Nothing to learn from (every token masked): no optimizer step, said in the log.
                log.warning("fsdp: step %d: a mini-batch has no loss token; skipped", batch.step)
                continue
            scores = {name: [rows[i] for i in indices] for name, rows in extra.items()}
            shares = split_batch(
                part,
                self.opts.num_ranks,
                self.train_opts.micro_batch_size,
                scores,
                max_tokens=self.opts.max_tokens_per_gpu,
            )
            results.append((self._run("train_step", shares)[0], part.num_loss_tokens))
        out = combine_step_metrics(results)
        out["time/train_step/old_logprobs_s"] = old_s
        out["train/tokens_per_s"] = out["train/num_tokens"] / max(time.perf_counter() - t0, 1e-9)
        return out

    def _train_adapters(self, batch: TrainBatch) -> dict[str, float]:
        """Multi-LoRA: each adapter's rows of the batch are one optimizer step of that adapter alone
        (its loss normalised over its own tokens and samples, its own clipping, optimizer and rate)."""
        assert self.opts is not None and self.train_opts is not None
        t0 = time.perf_counter()
        per_rank: list[list[tuple[str, Any]]] = [[] for _ in range(self.opts.num_ranks)]
        for name, indices in adapter_rows(batch.samples, self._adapters).items():
            part = sub_batch(batch, indices)
            if part.num_loss_tokens == 0:
                log.warning("fsdp: step %d: adapter %r has no loss token; it takes no step", batch.step, name)
                continue
            shares = split_batch(
                part,
                self.opts.num_ranks,
                self.train_opts.micro_batch_size,
                max_tokens=self.opts.max_tokens_per_gpu,
            )
            for rank_parts, share in zip(per_rank, shares, strict=True):
                rank_parts.append((name, share))
        out = dict(self._run("train_adapters", per_rank)[0])
        stepped = [name for name, _ in per_rank[0]]
        for name in self._adapters:
            out[f"lora/{name}/stepped"] = float(name in stepped)
        out["train/optimizer_steps"] = float(len(stepped))
        for key in ("train/loss", "train/num_loss_tokens", "train/num_tokens"):
            out[key] = sum(out.get(f"lora/{name}/{key}", 0.0) for name in stepped)
        out["train/tokens_per_s"] = out["train/num_tokens"] / max(time.perf_counter() - t0, 1e-9)
        return out

    def unsent_adapters(self) -> list[str]:
        """Multi-LoRA: the adapters the next weight update sends (trained since the last one)."""
        return list(self._run("unsent_adapters", self._same(None))[0])

    def _loss_kind(self) -> str:
        """The policy loss's kind, as the ranks built it (the driver never builds the loss itself:
        a loss may register rank-side hooks when it is made)."""
        if self._kind is None:
            self._kind = str(self._run("loss_kind", self._same(None))[0])
        return self._kind

    def score(self, samples: list[Sample], names: list[str]) -> dict[str, list[list[float]]]:
        """Forward-only passes of the frozen scorers / critic; rows come back in ``samples`` order."""
        assert self.opts is not None and self.train_opts is not None
        if not names or not samples:
            return {name: [] for name in names}
        if self._adapters:  # multi-LoRA: each adapter scores its own rows
            out: dict[str, list[list[float]]] = {name: [[] for _ in samples] for name in names}
            for adapter, indices in adapter_rows(samples, self._adapters).items():
                part = self._score([samples[i] for i in indices], names, adapter)
                for name in names:
                    for i, row in zip(indices, part[name], strict=True):
                        out[name][i] = row
            return out
        return self._score(samples, names, None)

    def _score(
        self, samples: list[Sample], names: list[str], adapter: str | None
    ) -> dict[str, list[list[float]]]:
        assert self.opts is not None and self.train_opts is not None
        shares, layout = split_for_scoring(
            samples, self.opts.num_ranks, self.train_opts.micro_batch_size, self.opts.max_tokens_per_gpu
        )
        results = self._run("score", [(share, list(names), adapter) for share in shares])
        out: dict[str, list[list[float]]] = {name: [[] for _ in samples] for name in names}
        for rank_layout, rank_result in zip(layout, results, strict=True):
            for mb_indices, mb_rows in zip(rank_layout, rank_result, strict=True):
                for index, row in zip(mb_indices, mb_rows, strict=True):
                    for name in names:
                        out[name][index] = row[name]
        return out

    def update_weights(self, version: int) -> TransportStats:
        results = self._run("update_weights", self._same(version))
        return results[0]

    def optimizer_state_bytes(self) -> int:
        """The policy optimizer's state over all ranks (after the first step; 0 before)."""
        return sum(self._run("optimizer_state_bytes", self._same(None)))

    def reconnect_transport(self) -> None:
        """Engines were restarted: every rank's transport re-forms its connections to them
        (``Transport.reconnect``), so the next update reaches the restarted ones too. Defined here,
        the driver may restart engines under this backend; a transport without ``reconnect`` is
        refused by the driver before any engine starts."""
        self._run("reconnect_transport", self._same(None))

    def save_checkpoint(self, directory: str) -> None:
        directory = os.path.abspath(directory)
        os.makedirs(directory, exist_ok=True)
        self._run("save_checkpoint", self._same(directory))

    def load_checkpoint(self, directory: str) -> None:
        from miles_fsdp.checkpoint import STATE_FILE

        directory = os.path.abspath(directory)
        if not os.path.isfile(os.path.join(directory, STATE_FILE)):
            raise FileNotFoundError(f"{directory} is not an FSDP checkpoint ({STATE_FILE} is missing)")
        assert self.spec is not None
        from miles_fsdp import lora

        lora.check_checkpoint(directory, self.spec)  # before any rank reads it
        self._run("load_checkpoint", self._same(directory))

    def export_hf(self, directory: str) -> None:
        directory = os.path.abspath(directory)
        self._run("export_hf", self._same(directory))

    # ---------------------------------------------------------------- offload

    def offload(self) -> dict[str, float]:
        """Colocated placement: move the trainer's GPU state (shards, grads, optimizer) to host memory.

        Call before the engines generate on the shared GPUs; every other command is refused
        until :meth:`onload`. A no-op on CPU (``{"offload/bytes": 0.0}``).
        """
        results = self._run("offload", self._same(None))
        self._offloaded = True
        return _offload_metrics(results, "offload")

    def onload(self) -> dict[str, float]:
        """Bring back what :meth:`offload` moved, before the next training step."""
        results = self._run("onload", self._same(None))
        self._offloaded = False
        return _offload_metrics(results, "onload")

    # --------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is None:
            return
        ranks.close()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids (for monitoring; with Ray, the actors' processes)."""
        return [] if self._ranks is None else self._ranks.pids

    # -------------------------------------------------------------- plumbing

    def _same(self, arg: Any) -> list[Any]:
        assert self.opts is not None
        return [arg] * self.opts.num_ranks

    def _run(self, command: str, args: list[Any]) -> list[Any]:
        if self._ranks is None:
            state = "shut down" if self.spec is not None else "not set up (setup() has not been called)"
            raise RuntimeError(f"the FSDP backend cannot run {command}: it is {state}")
        if self._offloaded and command not in _WHILE_OFFLOADED:
            raise RuntimeError(
                f"the FSDP backend cannot run {command}: its state is offloaded to the CPU; call onload() first"
            )
        return self._ranks.send(command, args)


# Metrics of several optimizer steps that add up rather than average.
_SUMMED = ("train/num_loss_tokens", "train/num_tokens")


def combine_step_metrics(results: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One set of metrics for several optimizer steps on one batch, each ``(metrics, loss tokens)``.

    Counts and ``time/`` entries add up; ``train/lr`` is the first step's (the rate the batch
    started at); everything else is the loss-token-weighted mean over the steps, as a single
    step weighs its micro-batches. ``train/optimizer_steps`` says how many steps were taken.
    """
    out: dict[str, float] = {"train/optimizer_steps": float(len(results))}
    if not results:
        return out
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, tokens in results:
        for key, value in metrics.items():
            if key in _SUMMED or key.startswith("time/"):
                out[key] = out.get(key, 0.0) + value
            elif key not in ("train/lr", "critic/lr"):
                sums[key] = sums.get(key, 0.0) + value * tokens
                weights[key] = weights.get(key, 0.0) + tokens
    out.update({key: sums[key] / weights[key] for key in sums if weights[key] > 0})
    first = results[0][0]
    for key in ("train/lr", "critic/lr"):
        if key in first:
            out[key] = first[key]
    return out


def adapter_rows(samples: list[Sample], adapters: list[str]) -> dict[str, list[int]]:
    """Multi-LoRA: the batch's sample indices of each adapter (``Sample.metadata[ADAPTER_KEY]``), in
    ``adapters`` order, only adapters with rows; a sample naming no adapter of the run is refused."""
    from miles.config.schema import ADAPTER_KEY
    from miles.errors import ComponentError

    rows: dict[str, list[int]] = {name: [] for name in adapters}
    for i, sample in enumerate(samples):
        name = sample.metadata.get(ADAPTER_KEY)
        if name not in rows:
            raise ComponentError(
                f"sample {i} (prompt {sample.prompt.index}) names LoRA adapter {name!r} "
                f"(metadata[{ADAPTER_KEY!r}]); this run trains {adapters}"
            )
        rows[name].append(i)
    return {name: indices for name, indices in rows.items() if indices}


def _offload_metrics(results: list[dict[str, float]], what: str) -> dict[str, float]:
    moved = sum(r["bytes"] for r in results)
    if moved == 0:
        return {f"{what}/bytes": 0.0}
    out = {f"{what}/bytes": moved, f"{what}/seconds": max(r["seconds"] for r in results)}
    for key in ("cuda_allocated_before", "cuda_allocated_after"):
        if all(key in r for r in results):
            out[f"{what}/{key}"] = sum(r[key] for r in results)  # summed over the ranks' GPUs
    return out


def routing_replay_problem(model_path: str, options: FSDPOptions) -> str | None:
    """See :meth:`FSDPBackend.routing_replay_problem`."""
    import json

    from miles.models.registry import routed_expert_count

    if routed_expert_count(model_path) == 0:
        return f"model {model_path} is dense (no routed experts): there is no MoE routing to replay"
    with open(os.path.join(model_path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in REPLAYABLE_MODEL_TYPES:
        return (
            f"replays the routers of {', '.join(REPLAYABLE_MODEL_TYPES)} models (a forward hook on "
            f"transformers' router); this model's model_type is {model_type!r}"
        )
    if options.compile:
        return (
            "fsdp.compile compiles the decoder layers the router hooks live in (they read each "
            "micro-batch's recorded routing); turn fsdp.compile off to replay routing"
        )
    return None


def _check_model_dir(path: str, role: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"fsdp: {role} path {path!r} is not a Hugging Face model directory (no config.json)")


def _validate_options(options: dict[str, Any]) -> tuple[TrainSection, FSDPOptions]:
    return backend_sections(options, "fsdp", FSDPOptions)
