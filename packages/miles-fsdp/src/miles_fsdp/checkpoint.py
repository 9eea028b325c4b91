"""Resumable checkpoints (torch distributed checkpoint) and Hugging Face export, run on every rank.

Layout of a resumable checkpoint directory::

    dcp/                   model + optimizer (and the critic's, with PPO), sharded (torch.distributed.checkpoint);
                           any rank count can load it
                           (a LoRA run: only the adapter's parameters and their optimizer state)
    trainer_state.json     LR-scheduler states, whether each optimizer has stepped, the rank count that wrote it
    rng/rank{r}.pt         each rank's RNG states (torch CPU, CUDA, python)
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from miles.errors import ModelError

STATE_FILE = "trainer_state.json"

# Tokenizer and chat-template files a Hugging Face model directory may carry next to its weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass
class Trainable:
    """A model with its optimizer and LR schedule, saved and restored together under ``name``."""

    name: str  # "model" for the policy (its DCP keys are "model" and "optim"), "critic" for PPO's critic
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    # LoRA: only the trainable (adapter) parameters and their optimizer state are saved and loaded.
    trainable_only: bool = False
    # Multi-LoRA: more (name, optimizer, scheduler) over other parameters of the same model (one per
    # adapter), saved and restored with it; their scheduler states and started flags go under name.
    more: list[tuple[str, torch.optim.Optimizer, Any]] = field(default_factory=list)

    def steppers(self) -> list[tuple[str, torch.optim.Optimizer, Any]]:
        """Every (state key, optimizer, scheduler) of this part: its own first, then ``more``."""
        own = (_scheduler_key(self), self.optimizer, self.scheduler)
        return [own, *((f"{own[0]}/{n}", o, sch) for n, o, sch in self.more)]

    @property
    def all_optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        return self.optimizer if not self.more else [o for _, o, _ in self.steppers()]

    @property
    def options(self) -> StateDictOptions | None:
        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.trainable_only else None

    @property
    def keys(self) -> tuple[str, str]:
        return (self.name, "optim") if self.name == "model" else (self.name, f"{self.name}_optim")


def save(directory: str, parts: list[Trainable], extra: dict[str, Any]) -> None:
    rank = dist.get_rank()
    to_save: dict[str, Any] = {}
    state: dict[str, Any] = {"world_size": dist.get_world_size(), **extra}
    started: dict[str, bool] = {}
    for part in parts:
        # get_state_dict materialises Adam's state with a zero-lr step when none exists yet; remember
        # that, so a checkpoint taken before the first step resumes with no state, as a fresh run would.
        for key, optimizer, scheduler in part.steppers():
            started[_started_key(part, key)] = bool(optimizer.state)
            state[key] = scheduler.state_dict()
        model_key, optim_key = part.keys
        to_save[model_key], to_save[optim_key] = get_state_dict(
            part.model, part.all_optimizers, options=part.options
        )
    dcp.save(to_save, checkpoint_id=os.path.join(directory, "dcp"))
    for part in parts:
        for key, optimizer, _ in part.steppers():
            if not started[_started_key(part, key)]:
                optimizer.state.clear()
    state["optimizer_started"] = started
    os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(directory, "rng", f"rank{rank}.pt"))
    if rank == 0:
        tmp = os.path.join(directory, STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f, indent=2)
        os.replace(tmp, os.path.join(directory, STATE_FILE))
    # Nobody reports "saved" before every rank's files are complete.
    dist.barrier()


def load(directory: str, parts: list[Trainable]) -> dict[str, Any]:
    state_path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(state_path):
        raise FileNotFoundError(f"{directory} is not an FSDP checkpoint: {STATE_FILE} is missing")
    with open(state_path) as f:
        state = json.load(f)
    missing = [key for part in parts for key, _, _ in part.steppers() if key not in state]
    if missing:
        raise ModelError(
            f"checkpoint {directory} has no state for {missing} (it was written by a run without them, "
            "e.g. without a critic); resume with the same algorithm"
        )
    to_load: dict[str, Any] = {}
    for part in parts:
        model_key, optim_key = part.keys
        to_load[model_key], to_load[optim_key] = get_state_dict(
            part.model, part.all_optimizers, options=part.options
        )
    dcp.load(to_load, checkpoint_id=os.path.join(directory, "dcp"))
    started = state.get("optimizer_started", {})
    for part in parts:
        model_key, optim_key = part.keys
        set_state_dict(
            part.model,
            part.all_optimizers,
            model_state_dict=to_load[model_key],
            optim_state_dict=to_load[optim_key],
            options=part.options,
        )
        for key, optimizer, scheduler in part.steppers():
            if not started.get(_started_key(part, key), True):
                optimizer.state.clear()
            scheduler.load_state_dict(state[key])
    rng_path = os.path.join(directory, "rng", f"rank{dist.get_rank()}.pt")
    # RNG streams are per rank; with a different rank count they cannot be matched, so keep fresh ones.
    if state.get("world_size") == dist.get_world_size() and os.path.isfile(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=True))
    dist.barrier()
    return state


def apply_hyperparameters(
    part: Trainable, *, lr: float, lr_lambda: Any, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """Set the optimizer hyperparameters a loaded state brought back to the given (current) ones.

    The scheduler keeps its step count; its base learning rate and schedule become ``lr``
    and ``lr_lambda``, and each parameter group's learning rate is recomputed from them.
    """
    set_hyperparameters(
        part.optimizer,
        part.scheduler,
        lr=lr,
        lr_lambda=lr_lambda,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
    )


def set_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    lr: float,
    lr_lambda: Any,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`apply_hyperparameters` for one optimizer and its scheduler."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    scheduler.lr_lambdas = [lr_lambda for _ in optimizer.param_groups]
    factor = lr_lambda(max(scheduler.last_epoch, 0))
    for group in optimizer.param_groups:
        group.update(initial_lr=lr, lr=lr * factor, betas=betas, eps=eps, weight_decay=weight_decay)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _started_key(part: Trainable, key: str) -> str:
    """``optimizer_started``'s key: the part's name (as before), ``<name>/<sub>`` for ``more``."""
    return part.name + key[len(_scheduler_key(part)) :]


def _scheduler_key(part: Trainable) -> str:
    return "scheduler" if part.name == "model" else f"{part.name}_scheduler"


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def export_hf(
    directory: str,
    model: nn.Module,
    model_path: str,
    dtype: torch.dtype | None,
    config_overrides: dict[str, Any] | None = None,
) -> None:
    """Write a Hugging Face directory (safetensors, config, tokenizer) of the current weights; rank 0 writes.

    ``config_overrides`` are set on the config only while it is written (e.g. to undo
    training-time settings such as ``use_cache=False``).
    """
    # A model's full state dict holds only (CPU) tensors, never the other state-dict value types.
    full = cast(
        "dict[str, torch.Tensor]",
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
    )
    if dist.get_rank() == 0:
        if dtype is not None:
            full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
        os.makedirs(directory, exist_ok=True)
        config = model.config
        overrides = dict(config_overrides or {})
        if dtype is not None:
            overrides["dtype"] = dtype
        saved = {key: getattr(config, key, None) for key in overrides}
        for key, value in overrides.items():
            setattr(config, key, value)
        try:
            save_pretrained: Any = model.save_pretrained  # a transformers model (sharded in place)
            save_pretrained(directory, state_dict=full, safe_serialization=True)
        finally:
            for key, value in saved.items():
                setattr(config, key, value)
        copy_tokenizer_files(model_path, directory)
    dist.barrier()


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    if not os.path.isdir(src):
        raise ModelError(f"model path {src!r} is not a directory; cannot copy its tokenizer files")
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied
