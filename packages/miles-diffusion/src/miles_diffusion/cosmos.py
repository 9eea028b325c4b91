"""The Cosmos-Predict2 text-to-image family: a local diffusers ``Cosmos2TextToImagePipeline``
directory as a :class:`~miles_diffusion.denoiser.DiffusionModel` over image latents.

What is loaded (by the directory's ``model_index.json``): ``transformer``
(``CosmosTransformer3DModel``, the denoiser: the only part that trains), ``vae``
(``AutoencoderKLWan``: final latents are decoded to images for the rewards), ``text_encoder``
(``T5EncoderModel``) with its T5 ``tokenizer``, and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``
with Karras sigmas; only the sigmas it gives for a step count are read). Text encoder and VAE are
frozen, in eval mode and kept off the module tree. The directory's ``safety_checker`` entry
(``cosmos_guardrail``'s ``CosmosSafetyChecker``) is not loaded: this family never runs the guardrail
(prompts are the recipe's own; no image leaves the training loop), and the pipeline itself cannot
be built without one (it refuses ``None``; the tests hand it a pass-through stand-in). Refused in one
line: transformers of other Cosmos variants (``img_context_dim_in``: Predict2.5's image context;
``use_crossattn_projection``: Predict2.5's text projection; ``controlnet_block_every_n``: Transfer).

**The denoiser as a flow velocity.** The pipeline is EDM-preconditioned: its latent ``x = x_0 +
s n`` has noise level ``s`` (``sigma`` from 80 to 0.002), the transformer ``F`` reads ``c_in x``
at time ``t = s / (1 + s)`` and the denoised estimate is ``x_0^ = c_skip x + c_out F`` with
``c_in = c_skip = 1 - t``, ``c_out = -t``. Our latent is rectified flow's ``z = (1 - t) x_0 + t n
= x / (1 + s) = c_in x``: exactly what the transformer reads. Then ``x_0^ = z - t F``, and since
rectified flow's velocity ``v = n - x_0`` satisfies ``x_0 = z - t v``, **the transformer's output is
the velocity**: :meth:`CosmosFlowModel.forward` returns ``F(z, t)`` as it is. The pipeline's step
(Euler in ``s`` on ``x`` along its noise estimate ``(x - x_0^) / s``) lands on ``x' = x_0^ + s'
n^``, i.e. ``z' = (1 - t') x_0^ + t' n^``, which is Euler in ``t`` on ``z`` along ``v``: the same
deterministic path (tested against the pipeline, float tolerance).

**The schedule** is the pipeline's: Karras sigmas (``rho = 7``) from ``sigma_max = 80`` to
``sigma_min = 0.002`` for ``N`` steps, mapped to ``t = s / (1 + s)`` and ending at ``t = 0``. Two
consequences of the finite ``sigma_max``: the first time is ``80/81``, not 1, and the sampler starts
from noise scaled by it (``z = t_0 n``, the pipeline's ``x = 80 n``); and where the pipeline ends
on ``sigma_min`` (its last step has zero length: ``final_sigmas_type = sigma_min``), our last step
goes on to ``t = 0`` (a zero-length step would have no Gaussian for the policy gradient). The
pipeline's last latents are ours at ``t_{N-1}`` times ``1 + sigma_min`` (tested).

**The conditioning** is Cosmos's: the prompt tokenized by T5 padded to ``max_sequence_length``
tokens (the pipeline's default 512) with an attention mask, read by the T5 encoder with that mask,
its last hidden states past the prompt's tokens set to zero; the transformer attends to all ``L``
positions (the pipeline passes no text mask). Fixed length is the pipeline's own rule, so a
prompt's encoding does not depend on its batch. Each distinct prompt is encoded alone once and kept.

**Guidance**: the pipeline guides the denoised estimate, ``x_0^ = x_0^c + w (x_0^c - x_0^u)``
(``guidance_scale`` ``w > 1``; its default 7), with a long default negative prompt
(:data:`DEFAULT_NEGATIVE_PROMPT`). ``x_0^`` is affine in the velocity at fixed ``z, t``, so this is
the shared classifier-free guidance ``v_u + g (v_c - v_u)`` with ``g = w + 1``; the unconditional
branch here is that negative prompt (:meth:`CosmosFlowModel.with_unconditional`; tested).

The image size is the pipeline's default (768x1360) and the text length 512 tokens unless the
directory holds ``miles_image.json`` (``{"height", "width", "max_sequence_length"}``; diffusers
ignores it), as ``builtin:tiny-cosmos`` does (:func:`build_tiny_cosmos`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles_diffusion.pipeline_model import ImageLatentsFlowModel, prompted_model
from miles_diffusion.pipeline_parts import (
    TensorFields,
    TextFrozenParts,
    decode_wan_latents,
    is_pipeline_directory,
    load_text_pipeline,
    seeded_weights,
    start_char_t5_proxy,
    tiny_t5_settings,
    tiny_wan_vae,
    write_proxy_files,
)
from miles_diffusion.precision import PrecisionConfig

PIPELINE_CLASSES = ("Cosmos2TextToImagePipeline",)
"""``_class_name`` values of ``model_index.json`` this family loads."""

SIGMA_MAX = 80.0
SIGMA_MIN = 0.002
SIGMA_DATA = 1.0
"""The EDM noise range and data scale the pipeline sets on its scheduler (whatever the directory's
scheduler config says)."""

IMAGE_FILE = "miles_image.json"
"""Optional file of a Cosmos directory naming the image size and the text length."""

DEFAULT_IMAGE = {"height": 768, "width": 1360, "max_sequence_length": 512}
"""The pipeline's default image size and text length, used without ``IMAGE_FILE``."""

DEFAULT_NEGATIVE_PROMPT = (
    "The video captures a series of frames showing ugly scenes, static with no motion, motion blur, "
    "over-saturation, shaky footage, low resolution, grainy texture, pixelated images, poorly lit areas, "
    "underexposed and overexposed scenes, poor color balance, washed out colors, choppy sequences, "
    "jerky movements, low frame rate, artifacting, color banding, unnatural transitions, outdated special effects, "
    "fake elements, unconvincing visuals, poorly edited content, jump cuts, visual noise, and flickering. "
    "Overall, the video is of poor quality."
)
"""The negative prompt Cosmos-Predict2 guides with by default (the model's own unconditional branch)."""

_COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformer": ("diffusers", ("CosmosTransformer3DModel",)),
    "vae": ("diffusers", ("AutoencoderKLWan",)),
    "scheduler": ("diffusers", ("FlowMatchEulerDiscreteScheduler",)),
    "text_encoder": ("transformers", ("T5EncoderModel",)),
    "tokenizer": ("transformers", ("T5TokenizerFast", "T5Tokenizer")),
}

_REFUSED_TRANSFORMER_SWITCHES = {
    "img_context_dim_in": "a Cosmos-Predict2.5 transformer (img_context_dim_in)",
    "use_crossattn_projection": "a Cosmos-Predict2.5 transformer (use_crossattn_projection)",
    "controlnet_block_every_n": "a Cosmos-Transfer transformer (controlnet_block_every_n)",
}


@dataclass(frozen=True)
class CosmosEncodings(TensorFields):
    """Cosmos's conditioning: ``sequence`` [B, L, D], zeros past each prompt's tokens (``L`` the
    model's ``max_sequence_length``; the transformer reads all ``L`` positions)."""

    sequence: torch.Tensor


def velocity_times(sigmas: torch.Tensor) -> torch.Tensor:
    """EDM noise levels ``s`` to rectified-flow times ``t = s / (1 + s)`` (the pipeline's own map)."""
    return sigmas / (sigmas + 1.0)


class CosmosFlowModel(ImageLatentsFlowModel):
    """Cosmos-Predict2's transformer as a rectified-flow velocity model over image latents."""

    encodings_type = CosmosEncodings
    unconditional_text = DEFAULT_NEGATIVE_PROMPT
    """Cosmos guides against its default negative prompt, not the empty text."""
    _frozen: TextFrozenParts

    def timestep_schedule(self, num_steps: int) -> torch.Tensor:
        """``num_steps + 1`` times: the pipeline's Karras sigmas as ``t = s / (1 + s)``, then 0."""
        self.scheduler.set_timesteps(sigmas=np.linspace(0.0, 1.0, num_steps), device="cpu")
        sigmas = torch.as_tensor(self.scheduler.sigmas).to(torch.float32)
        if sigmas.shape != (num_steps + 1,) or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"the scheduler gives sigmas of shape {tuple(sigmas.shape)} for {num_steps} steps; the "
                f"cosmos family needs {num_steps + 1} ending at 0"
            )
        return velocity_times(sigmas).clone()

    @torch.no_grad()
    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-decode final latents [B, C, h, w] (the per-channel latent normalisation undone first)
        to images [B, 3, H, W] in [0, 1]."""
        decoded = decode_wan_latents(self._frozen.vae, latents[:, :, None] / SIGMA_DATA)[:, :, 0]
        return ((decoded.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ internals

    def _denoise(self, x_t: torch.Tensor, timestep: torch.Tensor, enc: CosmosEncodings) -> torch.Tensor:
        # x_t is z = c_in x (the module docstring): the transformer's input as it is, and its output
        # F is the velocity (x_0^ = z - t F). The transformer reads t in [0, 1].
        h, w = x_t.shape[-2:]
        out = self.transformer(
            hidden_states=x_t[:, :, None],
            timestep=timestep / float(self.num_train_timesteps),
            encoder_hidden_states=enc.sequence,
            padding_mask=x_t.new_zeros(1, 1, h, w),  # no padding: the whole image is real
            return_dict=False,
        )[0]
        assert isinstance(out, torch.Tensor)
        return out[:, :, 0]

    def _encode_text(self, text: str) -> CosmosEncodings:
        """One prompt's conditioning [1, L, D], autocast off (frozen FP32 encoder)."""
        device = next(self.transformer.parameters()).device
        # the tokenizer's defaults: special tokens added, the attention mask returned
        ids, mask = self._frozen.padded_tokens(text, self.max_sequence_length, device)
        with torch.autocast(device_type=device.type, enabled=False):
            states = self._frozen.text_encoder(ids, attention_mask=mask).last_hidden_state
        keep = mask.to(states.dtype)  # 1 on the prompt's tokens (right padding)
        return CosmosEncodings(states * keep[:, :, None])


# ----------------------------------------------------------------------------- the directory


def is_cosmos_directory(directory: Path) -> bool:
    return is_pipeline_directory(directory, PIPELINE_CLASSES)


def _check_parts(root: Path, transformer: Any, vae: Any, scheduler: Any, image: dict[str, int]) -> None:
    for switch, what in _REFUSED_TRANSFORMER_SWITCHES.items():
        if transformer.config.get(switch):
            raise ValueError(f"{root}: {what}; the cosmos family trains Predict2's text-to-image transformer")
    if int(transformer.config.in_channels) != int(vae.config.z_dim):
        raise ValueError(
            f"{root}: the transformer reads {transformer.config.in_channels} channels, the VAE gives "
            f"{vae.config.z_dim}"
        )
    if not scheduler.config.get("use_karras_sigmas", False):
        raise ValueError(
            f"{root}: the scheduler does not use Karras sigmas; the cosmos family samples Cosmos's "
            "Karras schedule between sigma_min and sigma_max"
        )
    step = 2 ** len(vae.config.temperal_downsample) * int(transformer.config.patch_size[-1])
    if image["height"] % step or image["width"] % step:
        raise ValueError(f"{root}: image size {image['height']}x{image['width']} is not a multiple of {step}")


def load_cosmos(
    directory: str | Path, precision: PrecisionConfig | None = None, prompts: tuple[str, ...] = ()
) -> CosmosFlowModel:
    """Load a Cosmos-Predict2 text-to-image diffusers directory in FP32 (master weights), in eval mode."""
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel
    from transformers import T5EncoderModel

    classes = (CosmosTransformer3DModel, AutoencoderKLWan, T5EncoderModel)
    loaded = load_text_pipeline(directory, "cosmos", _COMPONENTS, IMAGE_FILE, DEFAULT_IMAGE, classes)
    # the pipeline sets these on its scheduler whatever the directory holds; so do we
    loaded.scheduler.register_to_config(sigma_max=SIGMA_MAX, sigma_min=SIGMA_MIN, sigma_data=SIGMA_DATA)
    _check_parts(loaded.root, loaded.transformer, loaded.frozen.vae, loaded.scheduler, loaded.sizes)
    return prompted_model(CosmosFlowModel, loaded, prompts, precision, image=loaded.sizes)


# ----------------------------------------------------------------------------- the proxy


@dataclass(frozen=True)
class TinyCosmosConfig:
    """The scaled-down Cosmos-Predict2 proxy: Cosmos's architecture and conditioning at toy widths.

    32x32 RGB; an AutoencoderKLWan of base width 8, 3 stages (4x: latents [4, 8, 8]) with non-trivial
    per-channel latent statistics; a 2-layer CosmosTransformer3DModel, patch (1, 2, 2) (16 image
    tokens), 2 heads of 16, Predict2's RoPE scale and no learnable position embedding; a 1-layer T5
    encoder of width 32 over a character-level tokenizer, 48 text tokens."""

    size: int = 32
    z_dim: int = 4
    vae_base_dim: int = 8
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_dim: int = 32
    text_layers: int = 1
    max_sequence_length: int = 48


def build_tiny_cosmos(dest: Path, seed: int, config: TinyCosmosConfig | None = None) -> None:
    """Builder of the built-in ``tiny-cosmos``: the proxy as a diffusers ``Cosmos2TextToImagePipeline``
    directory, random weights from ``seed`` (the caller's RNG is left as it was). Its index names no
    safety checker: diffusers needs one passed to build the pipeline (see the module docstring)."""
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    c = config or TinyCosmosConfig()
    dest, tokenizer = start_char_t5_proxy(dest)
    with seeded_weights(seed):
        vae = tiny_wan_vae(
            AutoencoderKLWan,
            c.vae_base_dim,
            c.z_dim,
            latents_mean=[round(0.1 * (i - 1.5), 2) for i in range(c.z_dim)],
            latents_std=[round(0.5 + 0.25 * i, 2) for i in range(c.z_dim)],
        )
        transformer = CosmosTransformer3DModel(
            in_channels=c.z_dim,
            out_channels=c.z_dim,
            num_attention_heads=c.num_attention_heads,
            attention_head_dim=c.attention_head_dim,
            num_layers=c.num_layers,
            mlp_ratio=2.0,
            text_embed_dim=c.text_dim,
            adaln_lora_dim=8,
            max_size=(4, 32, 32),
            patch_size=(1, 2, 2),
            rope_scale=(1.0, 4.0, 4.0),
            concat_padding_mask=True,
            extra_pos_embed_type=None,
        )
        encoder = T5EncoderModel(T5Config(**tiny_t5_settings(tokenizer, c.text_dim, c.text_layers)))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_karras_sigmas=True)
    parts = {"transformer": transformer, "vae": vae, "text_encoder": encoder, "scheduler": scheduler}
    image = {"height": c.size, "width": c.size, "max_sequence_length": c.max_sequence_length}
    write_proxy_files(dest, PIPELINE_CLASSES[0], parts, "T5TokenizerFast", IMAGE_FILE, image)
