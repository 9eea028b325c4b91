"""The plumbing the diffusers-pipeline families (SD3, Wan, Qwen-Image, LTX-Video, Cosmos-Predict2)
share, kept here so that each family module holds only what is its own (its encodings' fields, text
encoder call, latent layout, transformer call, schedule, decode and refusals):

- :class:`TensorFields`: the base of a family's encodings, a frozen dataclass of [B, ...] tensors
  whose batch operations (``len``, indexing, ``cat``) act on every field alike;
- :class:`TextFrozenParts`: the frozen VAE, tokenizer and text encoder of a one-encoder family;
- the loader's common steps (:func:`is_pipeline_directory`, :func:`check_components`,
  :func:`read_sizes`, :func:`load_scheduler`, :func:`load_text_parts`);
- the proxy builders' common steps (:func:`tiny_t5_settings`, :func:`save_parts`,
  :func:`write_model_index`, :func:`write_json`);
- :func:`filmstrip`, how a video family's videos reach the image rewards.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, cast

import torch
from torch import nn


@dataclass(frozen=True)
class TensorFields:
    """A batch of per-prompt tensors, one dataclass field each, all [B, ...] on the batch axis.

    A family's encodings subclass this as a frozen dataclass naming its fields; the shared model
    code only takes its length, indexes it and concatenates batches of it, which act field by field
    (in field order, so the tensors are exactly those a hand-written copy would give)."""

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def __len__(self) -> int:
        return int(self._tensors()[0].shape[0])

    def __getitem__(self, index: torch.Tensor | slice) -> Self:
        return type(self)(*(t[index] for t in self._tensors()))

    @classmethod
    def cat(cls, parts: list[Self]) -> Self:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in names))


@dataclass
class TextFrozenParts:
    """The parts of a one-text-encoder family that never train (Wan, Qwen-Image, LTX-Video, Cosmos):
    kept off the module tree (see :class:`~miles_diffusion.pipeline_model.FrozenParts`)."""

    vae: nn.Module
    tokenizer: Any
    text_encoder: nn.Module

    def modules(self) -> dict[str, nn.Module]:
        return {"vae": self.vae, "text_encoder": self.text_encoder}


# ----------------------------------------------------------------------------- loading


def read_model_index(directory: str | Path) -> dict[str, Any]:
    """``model_index.json`` of a diffusers directory; one ValueError if it is missing or unreadable."""
    path = Path(directory) / "model_index.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory}: no readable model_index.json ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{directory}: model_index.json must hold a JSON object")
    return data


def is_pipeline_directory(directory: Path, pipeline_classes: tuple[str, ...]) -> bool:
    """Whether ``directory`` is a diffusers pipeline directory of one of ``pipeline_classes``."""
    if not (directory / "model_index.json").is_file():
        return False
    return read_model_index(directory).get("_class_name") in pipeline_classes


def check_components(
    index: dict[str, Any], directory: Path, components: dict[str, tuple[str, tuple[str, ...]]], family: str
) -> None:
    """Every component ``model_index.json`` must name, by ``name: (library, accepted classes)``:
    one ValueError naming the first one that is missing or of another class."""
    for name, (library, classes) in components.items():
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1] in classes):
            raise ValueError(
                f"{directory}: model_index.json names {entry!r} for {name!r}; the {family} family loads "
                f"{' or '.join(classes)} ({library})"
            )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def read_sizes(path: Path, defaults: dict[str, int], *, required: bool = False) -> dict[str, int]:
    """The positive integers a family's optional size file (``miles_video.json``, ``miles_image.json``;
    diffusers ignores it) names, ``defaults`` for the file's absence, and for a key it leaves out
    unless ``required`` (then the file must name every key)."""
    if not path.is_file():
        return dict(defaults)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if required:
            sizes = {key: int(data[key]) for key in defaults}
        else:
            sizes = {key: int(data.get(key, default)) for key, default in defaults.items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ValueError(f"{path}: needs integer {', '.join(defaults)} ({exc})") from None
    if min(sizes.values()) <= 0:
        raise ValueError(f"{path}: {_listed(list(defaults))} must be positive")
    return sizes


def load_scheduler(root: Path, index: dict[str, Any]) -> Any:
    """The directory's scheduler, of the diffusers class its (checked) ``model_index.json`` names."""
    import diffusers

    return getattr(diffusers, index["scheduler"][1]).from_pretrained(str(root), subfolder="scheduler")


def load_text_parts(
    root: Path, transformer_class: Any, vae_class: Any, encoder_class: Any
) -> tuple[Any, TextFrozenParts]:
    """The transformer and the frozen parts of a one-text-encoder directory, in FP32 (master weights).

    Loading runs under a forked RNG: a model's construction draws random initial weights before
    the checkpoint's replace them, and loading must not move the caller's RNG."""
    from transformers import AutoTokenizer

    with torch.random.fork_rng(devices=[]):
        transformer = transformer_class.from_pretrained(
            str(root), subfolder="transformer", dtype=torch.float32
        )
        vae = vae_class.from_pretrained(str(root), subfolder="vae", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
        encoder = encoder_class.from_pretrained(str(root / "text_encoder"), dtype=torch.float32)
    return transformer, TextFrozenParts(cast(nn.Module, vae), tokenizer, cast(nn.Module, encoder))


# ----------------------------------------------------------------------------- the proxies


def tiny_t5_settings(tokenizer: Any, text_dim: int, num_layers: int) -> dict[str, Any]:
    """The proxies' toy (UM)T5 encoder settings: width ``text_dim``, 2 heads of 8, FFN twice the width,
    over the character-level tokenizer (:func:`~miles_diffusion.sd3.write_char_t5_tokenizer`)."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": text_dim,
        "d_kv": 8,
        "d_ff": 2 * text_dim,
        "num_layers": num_layers,
        "num_heads": 2,
        "pad_token_id": int(tokenizer.pad_token_id),
        "eos_token_id": int(tokenizer.eos_token_id),
    }


def save_parts(dest: Path, **parts: Any) -> None:
    """Each part's ``save_pretrained`` into the subdirectory of its component name."""
    for name, part in parts.items():
        part.save_pretrained(str(dest / name))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The proxies' JSON files: sorted keys and a final newline, so a rebuild is byte-identical."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_model_index(dest: Path, pipeline_class: str, components: dict[str, Any]) -> None:
    """``model_index.json`` of a proxy: its pipeline class, the diffusers version, ``components``."""
    import diffusers

    write_json(
        dest / "model_index.json",
        {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__, **components},
    )


# ----------------------------------------------------------------------------- videos


def filmstrip(video: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, frames, H, W] as one image each, the frames side by side: [B, 3, H, frames * W]
    (how a video family's videos reach the image rewards)."""
    b, c, f, h, w = video.shape
    return video.permute(0, 1, 3, 2, 4).reshape(b, c, h, f * w).contiguous()
