"""The LTX-Video text-to-video family: a local diffusers ``LTXPipeline`` directory as a
:class:`~miles_diffusion.denoiser.DiffusionModel` over video latents.

What is loaded (by the directory's ``model_index.json``): ``transformer``
(``LTXVideoTransformer3DModel``, the denoiser: the only part that trains), ``vae``
(``AutoencoderKLLTXVideo``: final latents are decoded to frames for the rewards), ``text_encoder``
(``T5EncoderModel``) with its T5 ``tokenizer``, and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``;
only the sigmas it gives for a step count are read). Text encoder and VAE are frozen, in eval mode
and kept off the module tree. Refused in one line: a transformer that patches latents
(``patch_size`` or ``patch_size_t`` above 1: LTXPipeline's rotary positions count latent voxels, so
it runs only one token per voxel) and a VAE that injects random noise while decoding
(``decoder_inject_noise``: its images, so its rewards, would not repeat).

Latents are ``[C, F, h, w]``: ``C`` the VAE's ``latent_channels``, ``F = (frames - 1) /
temporal_compression_ratio + 1``, ``h, w`` the pixel size over ``spatial_compression_ratio``; they
are the pipeline's normalised latents (its VAE ``latents_mean`` / ``latents_std`` and
``scaling_factor`` are undone only around a decode). The transformer reads them as one token per
latent voxel, a sequence ``[F h w, C]`` (frame-major, then rows, then columns): flattened before
each call, its output folded back after. This is a fixed permutation, so the sampler's
per-element Gaussian log-density is the same on either layout; keeping the video layout lets the
engine, wire and rewards treat the family as Wan. Each call also gets the pipeline's rotary
scaling ``(temporal_compression_ratio / frame_rate, spatial_ratio, spatial_ratio)``.

The conditioning is LTX's: the prompt (not cleaned: LTXPipeline does not) is tokenized with padding
to ``max_sequence_length`` tokens (the pipeline's default 128) and an attention mask; the T5
encoder reads the padded ids without the mask, as the pipeline's does; the last hidden states go
to the transformer with the mask, which turns padding into an attention bias. A prompt alone is
always padded to the same length, so its conditioning does not depend on its batch. Each distinct
prompt is encoded alone once and kept (the encoder is frozen).

The schedule is the pipeline's: sigmas ``linspace(1, 1/N, N)`` given to the scheduler with ``mu``
linear in the video's token count (LTX's own scheduler shifts dynamically and stretches the
schedule to its ``shift_terminal``; a static ``shift`` applies otherwise). The transformer reads
``t * num_train_timesteps``, as the pipeline passes the scheduler's timesteps.

Classifier-free guidance is LTXPipeline's (``guidance_rescale`` 0, its default): the unconditional
branch is the empty negative prompt through the same encoding, and the guided velocity is
``v_u + w (v_c - v_u)``, the shared :mod:`miles_diffusion.guidance` form.

How a video reaches the image rewards: :meth:`LTXFlowModel.to_images` decodes the frames (with
``decode_timestep`` 0, the pipeline's default, for a timestep-conditioned VAE) and lays them side
by side, one filmstrip image ``[B, 3, H, frames * W]`` per video, as Wan's.

The video size is LTXPipeline's default (161 frames of 512x704 at 25 frames per second, text of 128
tokens) unless the directory holds ``miles_video.json`` (``{"num_frames", "height", "width",
"frame_rate", "max_sequence_length"}``, any subset; diffusers ignores it), as ``builtin:tiny-ltx``
does.

:func:`build_tiny_ltx` writes the scaled-down proxy (random weights, a character-level T5
tokenizer, a 1-layer T5 encoder): ``builtin:tiny-ltx``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from miles_diffusion.pipeline_model import VideoLatentsFlowModel, prompted_model
from miles_diffusion.pipeline_parts import (
    TensorFields,
    TextFrozenParts,
    is_pipeline_directory,
    load_text_pipeline,
    seeded_weights,
    start_char_t5_proxy,
    tiny_t5_settings,
    video_latent_grid,
    write_proxy_files,
)
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.qwen_image import shifted_schedule

PIPELINE_CLASSES = ("LTXPipeline",)
"""``_class_name`` values of ``model_index.json`` this family loads."""

VIDEO_FILE = "miles_video.json"
"""Optional file of an LTX directory naming the video size, frame rate and text length."""

DEFAULT_VIDEO = {"num_frames": 161, "height": 512, "width": 704, "frame_rate": 25, "max_sequence_length": 128}
"""LTXPipeline's defaults, used for whatever ``VIDEO_FILE`` does not name."""

_COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformer": ("diffusers", ("LTXVideoTransformer3DModel",)),
    "vae": ("diffusers", ("AutoencoderKLLTXVideo",)),
    "scheduler": ("diffusers", ("FlowMatchEulerDiscreteScheduler",)),
    "text_encoder": ("transformers", ("T5EncoderModel",)),
    "tokenizer": ("transformers", ("T5Tokenizer", "T5TokenizerFast")),
}


@dataclass(frozen=True)
class LTXEncodings(TensorFields):
    """LTX's conditioning: ``sequence`` [B, L, D] (T5's last hidden states over the padded tokens) and
    ``mask`` [B, L] (1 for the prompt's own tokens), ``L`` the model's ``max_sequence_length``."""

    sequence: torch.Tensor
    mask: torch.Tensor


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, F, h, w] -> the transformer's sequence [B, F h w, C] (one token per latent voxel)."""
    return latents.flatten(2).transpose(1, 2)


def from_tokens(sequence: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`to_tokens` for latents of ``frames`` x ``height`` x ``width``."""
    b, _, c = sequence.shape
    return sequence.transpose(1, 2).reshape(b, c, frames, height, width)


class LTXFlowModel(VideoLatentsFlowModel):
    """LTX-Video's transformer as a rectified-flow velocity model over video latents."""

    encodings_type = LTXEncodings
    _frozen: TextFrozenParts

    @property
    def max_sequence_length(self) -> int:
        """Text tokens of the conditioning (the size file's, the pipeline's 128 by default)."""
        return int(self.video["max_sequence_length"])

    def _vae(self) -> Any:
        return self._frozen.vae

    @property
    def latent_shape(self) -> tuple[int, ...]:
        vae = self._vae()
        grid = video_latent_grid(
            self.video, int(vae.temporal_compression_ratio), int(vae.spatial_compression_ratio)
        )
        return (int(vae.config.latent_channels), *grid)

    @property
    def rope_interpolation_scale(self) -> tuple[float, float, float]:
        vae = self._vae()
        spatial = float(vae.spatial_compression_ratio)
        return (float(vae.temporal_compression_ratio) / float(self.video["frame_rate"]), spatial, spatial)

    def timestep_schedule(self, num_steps: int) -> torch.Tensor:
        _, f, h, w = self.latent_shape
        return shifted_schedule(self.scheduler, num_steps, f * h * w, "ltx")

    @torch.no_grad()
    def to_videos(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-decode final latents [B, C, F, h, w] (LTX's latent normalisation undone first) to videos
        [B, 3, frames, H, W] in [0, 1]."""
        vae = self._vae()
        shape = (1, -1, 1, 1, 1)
        mean = vae.latents_mean.to(latents.device, latents.dtype).view(shape)
        std = vae.latents_std.to(latents.device, latents.dtype).view(shape)
        z = latents * std / float(vae.config.scaling_factor) + mean
        temb = None
        if vae.config.timestep_conditioning:  # decode_timestep 0 (the pipeline's default): no decode noise
            temb = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
        decoded = vae.decode(z, temb, return_dict=False)[0]
        return ((decoded.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ internals

    def _denoise(self, x_t: torch.Tensor, timestep: torch.Tensor, enc: LTXEncodings) -> torch.Tensor:
        _, _, f, h, w = x_t.shape
        out = self.transformer(
            hidden_states=to_tokens(x_t),
            encoder_hidden_states=enc.sequence,
            timestep=timestep,
            encoder_attention_mask=enc.mask,
            num_frames=f,
            height=h,
            width=w,
            rope_interpolation_scale=self.rope_interpolation_scale,
            return_dict=False,
        )[0]
        assert isinstance(out, torch.Tensor)
        return from_tokens(out, f, h, w)

    def _encode_text(self, text: str) -> LTXEncodings:
        """One prompt's conditioning [1, L, D] and mask [1, L], autocast off (frozen FP32 encoder)."""
        device = next(self.transformer.parameters()).device
        ids, mask = self._frozen.padded_tokens(text, self.max_sequence_length, device)
        mask = mask.to(dtype=torch.long)
        with torch.autocast(device_type=device.type, enabled=False):
            states = self._frozen.text_encoder(ids).last_hidden_state  # no mask: the pipeline's reading
        return LTXEncodings(states, mask)


# ----------------------------------------------------------------------------- the directory


def is_ltx_directory(directory: Path) -> bool:
    return is_pipeline_directory(directory, PIPELINE_CLASSES)


def _check_parts(root: Path, transformer: Any, vae: Any, video: dict[str, int]) -> None:
    config = transformer.config
    if int(config.patch_size) != 1 or int(config.patch_size_t) != 1:
        raise ValueError(
            f"{root}: a transformer with patch_size {config.patch_size} / patch_size_t {config.patch_size_t}; "
            "the ltx family (as LTXPipeline) runs one token per latent voxel (patch sizes 1)"
        )
    if any(vae.config.decoder_inject_noise):
        raise ValueError(
            f"{root}: the VAE injects random noise while decoding (decoder_inject_noise); the ltx family "
            "needs a decode that repeats (its images are what the rewards score)"
        )
    if int(config.in_channels) != int(vae.config.latent_channels):
        raise ValueError(
            f"{root}: the transformer reads {config.in_channels} channels, the VAE gives "
            f"{vae.config.latent_channels}"
        )
    temporal, spatial = int(vae.temporal_compression_ratio), int(vae.spatial_compression_ratio)
    if (video["num_frames"] - 1) % temporal or video["height"] % spatial or video["width"] % spatial:
        raise ValueError(
            f"{root}: video of {video['num_frames']} frames of {video['height']}x{video['width']}; the VAE "
            f"needs 1 + a multiple of {temporal} frames and sizes that are multiples of {spatial}"
        )


def load_ltx(
    directory: str | Path, precision: PrecisionConfig | None = None, prompts: tuple[str, ...] = ()
) -> LTXFlowModel:
    """Load an LTX-Video diffusers directory in FP32 (master weights), in eval mode."""
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel
    from transformers import T5EncoderModel

    classes = (LTXVideoTransformer3DModel, AutoencoderKLLTXVideo, T5EncoderModel)
    loaded = load_text_pipeline(directory, "ltx", _COMPONENTS, VIDEO_FILE, DEFAULT_VIDEO, classes)
    _check_parts(loaded.root, loaded.transformer, loaded.frozen.vae, loaded.sizes)
    return prompted_model(LTXFlowModel, loaded, prompts, precision, video=loaded.sizes)


# ----------------------------------------------------------------------------- the proxy

LTX_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}
"""LTX-Video's scheduler settings (dynamic shifting by token count, the schedule stretched to end at
0.1), kept by the proxy so its schedule takes the real model's path."""


@dataclass(frozen=True)
class TinyLTXConfig:
    """The scaled-down LTX-Video proxy: LTX's architecture and conditioning at toy widths.

    5 frames of 32x32 RGB at 25 fps (LTXPipeline needs sizes in multiples of 32); an
    AutoencoderKLLTXVideo of widths 8 and 16 (decoder 16), patch 4 and one spatio-temporal stage (8x spatial, 2x
    temporal: latents [8, 3, 4, 4], 48 video tokens),
    timestep-conditioned as LTX 0.9.1+'s; a 2-layer LTXVideoTransformer3DModel, 2 heads of 12; a
    1-layer T5 encoder of width 32 over a character-level tokenizer, texts of 32 tokens."""

    num_frames: int = 5
    size: int = 32
    frame_rate: int = 25
    latent_channels: int = 8
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 12
    text_dim: int = 32
    text_layers: int = 1
    max_sequence_length: int = 32


def build_tiny_ltx(dest: Path, seed: int, config: TinyLTXConfig | None = None) -> None:
    """Builder of the built-in ``tiny-ltx``: the proxy as a diffusers ``LTXPipeline`` directory,
    random weights from ``seed`` (the caller's RNG is left as it was)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    c = config or TinyLTXConfig()
    dest, tokenizer = start_char_t5_proxy(dest)
    with seeded_weights(seed):
        vae = AutoencoderKLLTXVideo(
            latent_channels=c.latent_channels,
            block_out_channels=(8, 16),
            down_block_types=("LTXVideoDownBlock3D", "LTXVideoDownBlock3D"),
            decoder_block_out_channels=(16, 16),  # equal widths: no conv_in in the up blocks
            layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1),
            spatio_temporal_scaling=(True, False),
            decoder_spatio_temporal_scaling=(True, False),
            decoder_inject_noise=(False, False, False),
            downsample_type=("conv", "conv"),
            upsample_residual=(False, False),
            upsample_factor=(1, 1),
            timestep_conditioning=True,
            patch_size=4,
            patch_size_t=1,
        )
        # non-trivial latent statistics, so the proxy's decode exercises the denormalisation
        cast(Any, vae).latents_mean.copy_(torch.linspace(-0.2, 0.2, c.latent_channels))
        cast(Any, vae).latents_std.copy_(torch.linspace(0.8, 1.2, c.latent_channels))
        inner = c.num_attention_heads * c.attention_head_dim
        transformer = LTXVideoTransformer3DModel(
            in_channels=c.latent_channels,
            out_channels=c.latent_channels,
            num_attention_heads=c.num_attention_heads,
            attention_head_dim=c.attention_head_dim,
            cross_attention_dim=inner,
            num_layers=c.num_layers,
            caption_channels=c.text_dim,
        )
        encoder = T5EncoderModel(
            T5Config(**tiny_t5_settings(tokenizer, c.text_dim, c.text_layers), feed_forward_proj="gated-gelu")
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER)
    parts = {"transformer": transformer, "vae": vae, "text_encoder": encoder, "scheduler": scheduler}
    video = {
        "num_frames": c.num_frames,
        "height": c.size,
        "width": c.size,
        "frame_rate": c.frame_rate,
        "max_sequence_length": c.max_sequence_length,
    }
    write_proxy_files(dest, PIPELINE_CLASSES[0], parts, "T5TokenizerFast", VIDEO_FILE, video)
