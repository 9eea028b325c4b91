"""The plumbing the diffusers-pipeline families (SD3, Wan, Qwen-Image, LTX-Video, Cosmos-Predict2)
share, kept here so that each family module holds only what is its own (its encodings' fields, text
encoder call, latent layout, transformer call, schedule, decode and refusals):

- :class:`TensorFields`: the base of a family's encodings, a frozen dataclass of [B, ...] tensors
  whose batch operations (``len``, indexing, ``cat``) act on every field alike;
- :class:`TextFrozenParts`: the frozen VAE, tokenizer and text encoder of a one-encoder family;
- the loader's common steps (:func:`is_pipeline_directory`, :func:`check_components`,
  :func:`read_sizes`, :func:`load_scheduler`, :func:`load_text_parts`), and
  :func:`load_text_pipeline`, all of them in the order the one-encoder families read a directory;
- the proxy builders' common steps (:func:`start_char_t5_proxy`, :func:`seeded_weights`,
  :func:`tiny_t5_settings`, :func:`tiny_wan_vae`,
  :func:`save_parts`, :func:`write_model_index`, :func:`write_json`, :func:`write_proxy_files`);
- :func:`decode_wan_latents`, the decode of the Wan-style VAE (Wan, Qwen-Image, Cosmos);
- :func:`filmstrip`, how a video family's videos reach the image rewards.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
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

    def padded_tokens(
        self, text: str, max_length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One text's token ids and attention mask ``[1, max_length]`` on ``device``: padded to
        ``max_length`` (truncated past it), as Wan, LTX-Video and Cosmos tokenize, so a prompt's
        encoding never depends on the prompts beside it."""
        tokens = self.tokenizer(
            [text],
            padding="max_length",
            max_length=max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return cast(torch.Tensor, tokens.input_ids).to(device), cast(torch.Tensor, tokens.attention_mask).to(
            device
        )


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


def read_component_config(root: Path, component: str) -> dict[str, Any]:
    """``component/config.json`` of a diffusers directory (no weights read); one ValueError if it is
    missing, unreadable or not a JSON object."""
    path = root / component / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the {component} config ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the {component} config is not a JSON object")
    return data


def video_latent_grid(video: dict[str, int], temporal: int, spatial: int) -> tuple[int, int, int]:
    """Latent frames, height and width of a video of ``video``'s ``num_frames``, ``height`` and
    ``width`` under a VAE that compresses ``temporal``x in time (the first frame alone) and
    ``spatial``x in space: the one arithmetic the video families and their sequence split share."""
    frames = (video["num_frames"] - 1) // temporal + 1
    return frames, video["height"] // spatial, video["width"] // spatial


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


@dataclass(frozen=True)
class TextPipeline:
    """A one-text-encoder directory as :func:`load_text_pipeline` reads it, before its family checks
    the parts against each other and builds its model from them."""

    root: Path
    sizes: dict[str, int]
    """The size file's numbers (:func:`read_sizes`), the family's defaults where it is absent."""
    scheduler: Any
    transformer: nn.Module
    frozen: TextFrozenParts


def load_text_pipeline(
    directory: str | Path,
    family: str,
    components: dict[str, tuple[str, tuple[str, ...]]],
    size_file: str,
    default_sizes: dict[str, int],
    part_classes: tuple[Any, Any, Any],
) -> TextPipeline:
    """Read a one-text-encoder directory as Qwen-Image, LTX-Video and Cosmos do, in one order (so a
    directory with several faults is refused for the same one whichever family reads it): the index
    checked against ``components``, the size file, the scheduler, then the weights of
    ``part_classes`` (transformer, VAE, text encoder; see :func:`load_text_parts`)."""
    root = Path(directory)
    index = read_model_index(root)
    check_components(index, root, components, family)
    sizes = read_sizes(root / size_file, default_sizes)
    scheduler = load_scheduler(root, index)
    transformer, frozen = load_text_parts(root, *part_classes)
    return TextPipeline(root, sizes, scheduler, cast(nn.Module, transformer), frozen)


# ----------------------------------------------------------------------------- the proxies


def start_char_t5_proxy(dest: Path) -> tuple[Path, Any]:
    """A new proxy directory ``dest`` holding the character-level T5 tokenizer the Wan, LTX-Video and
    Cosmos proxies read their prompts with (:func:`~miles_diffusion.sd3.write_char_t5_tokenizer`):
    the directory and the tokenizer."""
    from miles_diffusion.sd3 import write_char_t5_tokenizer

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return dest, write_char_t5_tokenizer(dest / "tokenizer")


@contextmanager
def seeded_weights(seed: int) -> Iterator[None]:
    """Random initial weights drawn under it come from ``seed`` alone, under a forked RNG: a proxy
    is the same whatever ran before it is built, and its builder leaves the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


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


def tiny_wan_vae(
    vae_class: Any,
    base_dim: int,
    z_dim: int,
    latents_mean: list[float] | None = None,
    latents_std: list[float] | None = None,
    **settings: Any,
) -> Any:
    """The proxies' toy Wan-style VAE (``AutoencoderKLWan`` or Qwen-Image's copy of it): base width
    ``base_dim``, 3 stages of widths (1, 2, 2) with one residual block each, one temporal downsample
    (4x spatial compression); per-channel latent statistics ``latents_mean`` / ``latents_std``
    (plain ones, 0 and 1, unless given); ``settings`` add the rest."""
    return vae_class(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * z_dim if latents_mean is None else latents_mean,
        latents_std=[1.0] * z_dim if latents_std is None else latents_std,
        **settings,
    )


def write_model_index(dest: Path, pipeline_class: str, components: dict[str, Any]) -> None:
    """``model_index.json`` of a proxy: its pipeline class, the diffusers version, ``components``."""
    import diffusers

    write_json(
        dest / "model_index.json",
        {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__, **components},
    )


def write_proxy_files(
    dest: Path,
    pipeline_class: str,
    parts: dict[str, Any],
    tokenizer_class: str,
    size_file: str,
    sizes: dict[str, int],
    **more_index: Any,
) -> None:
    """Everything of a proxy directory but its tokenizer: each of ``parts`` saved under its component
    name (:func:`save_parts`); ``model_index.json`` of ``pipeline_class`` naming each part's class
    and library (the top package of the class's module, as diffusers names them), the tokenizer's
    ``tokenizer_class`` and ``more_index``; the size file the family reads the sampled size from."""
    save_parts(dest, **parts)
    index = {name: [type(part).__module__.split(".")[0], type(part).__name__] for name, part in parts.items()}
    index["tokenizer"] = ["transformers", tokenizer_class]
    write_model_index(dest, pipeline_class, {**index, **more_index})
    write_json(dest / size_file, sizes)


# ----------------------------------------------------------------------------- decoding


def decode_wan_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """A Wan-style VAE's raw decode (``[-1, 1]``, not yet clamped) of normalised video latents
    ``[B, C, F, h, w]``: the per-channel ``latents_mean`` / ``latents_std`` of its config undone
    first. Wan decodes its videos so; Qwen-Image and Cosmos their images as one-frame videos."""
    config = vae.config
    shape = (1, int(config.z_dim), 1, 1, 1)
    mean = torch.tensor(config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
    std = torch.tensor(config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
    return cast(torch.Tensor, vae.decode(latents * std + mean, return_dict=False)[0])


# ----------------------------------------------------------------------------- videos


def filmstrip(video: torch.Tensor) -> torch.Tensor:
    """Videos [B, 3, frames, H, W] as one image each, the frames side by side: [B, 3, H, frames * W]
    (how a video family's videos reach the image rewards)."""
    b, c, f, h, w = video.shape
    return video.permute(0, 1, 3, 2, 4).reshape(b, c, h, f * w).contiguous()
