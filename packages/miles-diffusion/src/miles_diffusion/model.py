"""Tiny flow-matching image models built from config with random weights (no downloads).

The model predicts the rectified-flow velocity ``v = noise - image`` for a noisy image
``x_t = (1 - t) * image + t * noise`` at time ``t`` in ``[0, 1]`` (``t = 1`` is pure noise). It
is a diffusers ``UNet2DModel`` whose class-embedding table stands in for a text encoder: a prompt is
an integer id, and every image of one prompt shares one embedding row.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import cast

import torch
from diffusers import UNet2DModel
from torch import nn

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.precision import PrecisionConfig, keep_fp32

# UNet2DModel expects timesteps on the scale diffusion schedulers use (0..1000).
TIMESTEP_SCALE = 1000.0


@dataclass(frozen=True)
class TinyFlowModelConfig:
    """Shape of the tiny model: pixel space, ``channels`` x ``image_size`` x ``image_size``."""

    image_size: int = 16
    channels: int = 3
    num_prompts: int = 4
    block_out_channels: tuple[int, ...] = (16, 32)
    layers_per_block: int = 1
    norm_num_groups: int = 8


class PromptTable(nn.Embedding):
    """The UNet's class-embedding table, with a seam for encodings computed ahead.

    A prompt id is looked up as usual; a float input is taken as rows already looked up
    (:meth:`FlowModel.encode_prompts`) and passed through. So an engine encodes a request's prompts
    once and reuses the result at every denoising step of every microgroup, as a text-to-image
    engine reuses its text encoder's hidden states, and the values are the lookup's, bit for bit.
    Parameter names and values are nn.Embedding's: checkpoints and standards are unchanged.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_floating_point():
            return input
        return super().forward(input)


class FlowModel(DiffusionModel):
    """Velocity predictor ``v(x_t, t, prompt)`` over a diffusers UNet with a prompt-embedding table.

    Pixel space: its "latents" are the images in [-1, 1]."""

    latents_are_pixels = True

    def __init__(self, config: TinyFlowModelConfig, precision: PrecisionConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.precision = precision or PrecisionConfig()
        depth = len(config.block_out_channels)
        # cast: diffusers' ModelMixin is not seen as an nn.Module by mypy.
        self.unet = cast(
            nn.Module,
            UNet2DModel(
                sample_size=config.image_size,
                in_channels=config.channels,
                out_channels=config.channels,
                block_out_channels=config.block_out_channels,
                layers_per_block=config.layers_per_block,
                down_block_types=("DownBlock2D",) * depth,
                up_block_types=("UpBlock2D",) * depth,
                norm_num_groups=config.norm_num_groups,
                num_class_embeds=config.num_prompts,
            ),
        )
        table = self.unet.class_embedding
        assert isinstance(table, nn.Embedding)
        # The same Parameter (no new initialisation: the model's random weights stay what they were).
        self.unet.class_embedding = PromptTable(
            table.num_embeddings, table.embedding_dim, _weight=table.weight
        )
        self.fp32_modules = keep_fp32(self, self.precision.fp32_modules)
        """Modules computed in FP32 while the rest runs at ``precision.compute_dtype``."""

    @property
    def num_prompts(self) -> int:
        return self.config.num_prompts

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        c = self.config
        return (c.channels, c.image_size, c.image_size)

    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """The model's [-1, 1] range mapped to [0, 1] (as ``Trajectory.images``)."""
        return ((latents + 1.0) / 2.0).clamp(0.0, 1.0)

    @property
    def encoding_dim(self) -> int:
        """Width of one prompt encoding (:meth:`encode_prompts`)."""
        table = self.unet.class_embedding
        assert isinstance(table, nn.Embedding)
        return int(table.embedding_dim)

    def encode_prompts(self, prompts: torch.Tensor) -> torch.Tensor:
        """The conditioning the denoiser reads for ``prompts`` ([B] int ids): [B, encoding_dim].

        This model's "text encoder" is its prompt-embedding table; the engine calls this once per
        request and hands the rows to :meth:`forward` in place of the ids at every step."""
        if prompts.is_floating_point() or prompts.ndim != 1:
            raise ValueError(
                f"encode_prompts takes [B] integer prompt ids, got {prompts.dtype} {tuple(prompts.shape)}"
            )
        table = self.unet.class_embedding
        assert isinstance(table, PromptTable)
        return nn.Embedding.forward(table, prompts)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """``x_t``: [B, C, H, W]; ``t``: [B] in [0, 1]; ``prompts``: [B] int ids, or their encodings
        [B, encoding_dim] from :meth:`encode_prompts`. Returns v, [B, C, H, W].

        Under a BF16/FP16 ``precision`` the UNet runs under autocast (FP32 parameters, the named FP32
        modules outside it) and v comes back as FP32."""
        if prompts.is_floating_point() and tuple(prompts.shape) != (x_t.shape[0], self.encoding_dim):
            raise ValueError(
                f"prompt encodings of shape {tuple(prompts.shape)}; expected ({x_t.shape[0]}, {self.encoding_dim})"
            )
        if self.precision.dtype is torch.float32:
            out = self.unet(x_t, t * TIMESTEP_SCALE, class_labels=prompts, return_dict=False)[0]
        else:
            with torch.autocast(device_type=x_t.device.type, dtype=self.precision.dtype):
                out = self.unet(x_t, t * TIMESTEP_SCALE, class_labels=prompts, return_dict=False)[0]
            out = out.float()
        assert isinstance(out, torch.Tensor)
        return out


def build_tiny_model(
    config: TinyFlowModelConfig, seed: int, precision: PrecisionConfig | None = None
) -> FlowModel:
    """Random weights, reproducible from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FlowModel(config, precision)


def forward_noise(images: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward (noising) process ``x_t = (1 - t) * images + t * noise``; ``t``: [B] in [0, 1]."""
    tb = t.to(images.dtype).view(-1, *([1] * (images.ndim - 1)))
    return (1.0 - tb) * images + tb * noise


def velocity_target(images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow velocity ``d x_t / d t = noise - images`` the model is trained to predict."""
    return noise - images


def flow_matching_error(
    model: DiffusionModel, images: torch.Tensor, prompts: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """Per-sample mean squared error of the model's velocity at ``x_t`` against the target, [B]."""
    v = model(forward_noise(images, noise, t), t, prompts)
    return ((v - velocity_target(images, noise)) ** 2).flatten(1).mean(dim=1)


# ----------------------------------------------------------------------------- on disk
#
# A model directory holds ``config.json`` (the shape, under ``ARCHITECTURE``) and ``model.safetensors``
# (the FlowModel's state dict). The engine loads it, the backend loads and exports it, and the core
# sees an ordinary model directory (``model.path: builtin:tiny-flow-unet`` builds one into its cache).

ARCHITECTURE = "MilesTinyFlowUNet"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_pretrained(model: FlowModel, directory: str | Path) -> Path:
    """Write ``model`` as a model directory (config.json + model.safetensors); returns the directory."""
    from safetensors.torch import save_file

    dest = Path(directory)
    dest.mkdir(parents=True, exist_ok=True)
    config = {"architecture": ARCHITECTURE, **asdict(model.config)}
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(dest / WEIGHTS_FILE), metadata={"format": "pt"})
    return dest


def read_model_config(directory: str | Path) -> TinyFlowModelConfig:
    """The shape a model directory declares; one clear ValueError if it is not this package's model."""
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory}: no readable {CONFIG_FILE} ({exc})") from None
    if not isinstance(data, dict) or data.get("architecture") != ARCHITECTURE:
        got = data.get("architecture") if isinstance(data, dict) else None
        raise ValueError(
            f"{directory}: {CONFIG_FILE} says architecture {got!r}; the diffusion engine and backend load "
            f"{ARCHITECTURE!r} directories (e.g. model.path: builtin:tiny-flow-unet)"
        )
    known = {f.name for f in fields(TinyFlowModelConfig)}
    values = {k: v for k, v in data.items() if k in known}
    unknown = sorted(set(data) - known - {"architecture"})
    if unknown:
        raise ValueError(f"{directory}: {CONFIG_FILE} has unknown keys {unknown}")
    if "block_out_channels" in values:
        values["block_out_channels"] = tuple(values["block_out_channels"])
    return TinyFlowModelConfig(**values)


def load_pretrained(directory: str | Path, precision: PrecisionConfig | None = None) -> FlowModel:
    """The model a directory holds, in eval mode; every tensor of the state dict must be there."""
    from safetensors.torch import load_file

    config = read_model_config(directory)
    model = FlowModel(config, precision)
    state = load_file(str(Path(directory) / WEIGHTS_FILE))
    model.load_state_dict(state, strict=True)
    return model.eval()


def build_tiny_flow_unet(dest: Path, seed: int) -> None:
    """Builder of the built-in ``tiny-flow-unet`` (``miles models build tiny-flow-unet``): the default
    :class:`TinyFlowModelConfig` with random weights from ``seed`` (the package driver's model)."""
    save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed), dest)
