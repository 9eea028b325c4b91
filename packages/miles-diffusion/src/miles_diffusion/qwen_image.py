"""The Qwen-Image text-to-image family: a local diffusers ``QwenImagePipeline`` directory as a
:class:`~miles_diffusion.denoiser.DiffusionModel` over VAE latents.

What is loaded (by the directory's ``model_index.json``): ``transformer``
(``QwenImageTransformer2DModel``, the denoiser: the only part that trains), ``vae``
(``AutoencoderKLQwenImage``: final latents are decoded to images for the rewards), ``text_encoder``
(``Qwen2_5_VLForConditionalGeneration``, read as a text model: no image goes in) with its Qwen2
``tokenizer``, and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``; only the sigmas it gives for a
step count are read). Text encoder and VAE are frozen, in eval mode and kept off the module tree.
Refused in one line: a guidance-distilled transformer (``guidance_embeds``) and the edit variants'
transformer switches (``zero_cond_t``, ``use_additional_t_cond``, ``use_layer3d_rope``).

Latents are ``[C, h, w]`` (``C`` the VAE's ``z_dim``, ``h, w`` the pixel size over the VAE's scale
factor); the VAE's single-frame axis is added only around a decode. The transformer reads them as
2x2 patches, a sequence ``[(h/2)(w/2), 4C]``: packed before each call, its output unpacked after.
Packing is a fixed permutation, so the sampler's per-element Gaussian log-density is the same on
either layout; keeping the image layout lets the engine, wire and rewards treat the family as SD3.

The conditioning is Qwen-Image's: the prompt is set in the pipeline's chat template (a system turn
asking for a detailed image description, then the prompt as the user turn, then the assistant's
opening), read by the Qwen2.5-VL text model, and the last hidden states of the template's fixed
prefix (``TEMPLATE_PREFIX_TOKENS``: the system turn and the user turn's opening) are dropped. One
difference from the pipeline, on purpose: every prompt's states are zero-padded to the same
``max_sequence_length`` tokens with a mask (the pipeline pads a batch to its longest prompt), so a
prompt's conditioning does not depend on which prompts share its batch: the engine samples a group
and the trainer re-scores a mixed batch, and both must compute the same numbers. The transformer
masks the padding out of its joint attention and gives text RoPE positions by index, so the padded
call is the pipeline's up to float rounding (tested). Each distinct prompt is encoded alone once and
kept (the encoder is frozen).

The schedule is the pipeline's: sigmas ``linspace(1, 1/N, N)`` given to the scheduler, with
``mu`` from the image's token count when the scheduler shifts dynamically (Qwen-Image's own
scheduler does: exponential time shift, ``shift_terminal``), the scheduler's static ``shift``
otherwise. The transformer reads the sigma (the pipeline passes ``timestep / 1000``).

The image size is the pipeline's default (1024x1024) and the text length 1024 tokens (the
pipeline's maximum) unless the directory holds ``miles_image.json`` (``{"height", "width",
"max_sequence_length"}``; diffusers ignores it), as ``builtin:tiny-qwen-image`` does.

Guidance is the pipeline's "true CFG" against the negative prompt ``" "``: the classifier-free
combination rescaled per token to the conditional velocity's norm (:meth:`QwenImageFlowModel.
combine_guidance`).

:func:`build_tiny_qwen_image` writes the scaled-down proxy: :mod:`miles_diffusion.qwen_image_proxy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from miles_diffusion.pipeline_model import ImageLatentsFlowModel, prompted_model
from miles_diffusion.pipeline_parts import (
    TensorFields,
    TextFrozenParts,
    decode_wan_latents,
    is_pipeline_directory,
    load_text_pipeline,
)
from miles_diffusion.precision import PrecisionConfig

PIPELINE_CLASSES = ("QwenImagePipeline",)
"""``_class_name`` values of ``model_index.json`` this family loads."""

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
    "{}<|im_end|>\n<|im_start|>assistant\n"
)
"""The prompt format Qwen-Image's transformer was trained on (the pipeline's encoding template)."""

TEMPLATE_PREFIX_TOKENS = 34
"""Tokens of the template before the prompt (the system turn and ``<|im_start|>user\\n``) under the
Qwen2 tokenizer: their states are dropped from the conditioning, as the pipeline drops them."""

TOKENIZER_MAX_PROMPT = 1024
"""Prompt tokens the tokenizer keeps after the template's prefix (the pipeline's limit)."""

NEGATIVE_PROMPT = " "
"""The unconditional branch of Qwen-Image's guidance: its pipeline guides only against a given
negative prompt (none: no guidance), and its documentation's examples give this one space."""

IMAGE_FILE = "miles_image.json"
"""Optional file of a Qwen-Image directory naming the image size and the text length."""

DEFAULT_IMAGE = {"height": 1024, "width": 1024, "max_sequence_length": 1024}
"""The pipeline's default image size and its maximum text length, used without ``IMAGE_FILE``."""

_COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformer": ("diffusers", ("QwenImageTransformer2DModel",)),
    "vae": ("diffusers", ("AutoencoderKLQwenImage",)),
    "scheduler": ("diffusers", ("FlowMatchEulerDiscreteScheduler",)),
    "text_encoder": ("transformers", ("Qwen2_5_VLForConditionalGeneration",)),
    "tokenizer": ("transformers", ("Qwen2Tokenizer", "Qwen2TokenizerFast")),
}

_REFUSED_TRANSFORMER_SWITCHES = {
    "guidance_embeds": "a guidance-distilled transformer (guidance_embeds)",
    "zero_cond_t": "an edit-variant transformer (zero_cond_t)",
    "use_additional_t_cond": "an edit-variant transformer (use_additional_t_cond)",
    "use_layer3d_rope": "a layered-variant transformer (use_layer3d_rope)",
}


@dataclass(frozen=True)
class QwenImageEncodings(TensorFields):
    """Qwen-Image's conditioning: ``sequence`` [B, L, D] (zeros past each prompt) and ``mask`` [B, L]
    (1 for the prompt's own tokens), ``L`` the model's ``max_sequence_length``."""

    sequence: torch.Tensor
    mask: torch.Tensor


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> the transformer's sequence of 2x2 patches [B, (h/2)(w/2), 4C] (channel-major
    within a patch, patches in row-major order)."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(sequence: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_latents` for latents of ``height`` x ``width``."""
    b, _, channels = sequence.shape
    c = channels // 4
    patches = sequence.reshape(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


def dynamic_shift_mu(image_tokens: int, config: Any) -> float:
    """The resolution-dependent shift of a dynamically shifting scheduler: linear in the image's
    token count between (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    base_len = float(config.get("base_image_seq_len", 256))
    max_len = float(config.get("max_image_seq_len", 4096))
    base_shift = float(config.get("base_shift", 0.5))
    max_shift = float(config.get("max_shift", 1.15))
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_tokens * slope + (base_shift - slope * base_len)


def shifted_schedule(scheduler: Any, num_steps: int, image_tokens: int, family: str) -> torch.Tensor:
    """The pipeline's schedule (Qwen-Image's and LTX-Video's alike): sigmas ``linspace(1, 1/N, N)``
    given to the scheduler, shifted by ``mu`` from the token count if it shifts dynamically."""
    mu = dynamic_shift_mu(image_tokens, scheduler.config)
    sigmas = np.linspace(1.0, 1.0 / num_steps, num_steps)
    scheduler.set_timesteps(sigmas=sigmas, mu=mu, device="cpu")  # mu is read only if dynamic
    out = torch.as_tensor(scheduler.sigmas)
    if out.shape != (num_steps + 1,) or float(out[-1]) != 0.0:
        raise ValueError(
            f"the scheduler gives sigmas of shape {tuple(out.shape)} ending at {float(out[-1])} "
            f"for {num_steps} steps; the {family} family needs {num_steps + 1} ending at 0"
        )
    return out.to(torch.float32).clone()


class QwenImageFlowModel(ImageLatentsFlowModel):
    """Qwen-Image's transformer as a rectified-flow velocity model over image latents."""

    encodings_type = QwenImageEncodings
    _frozen: TextFrozenParts

    unconditional_text = NEGATIVE_PROMPT

    def combine_guidance(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image's "true CFG": the classifier-free combination, then rescaled token by token
        (each 2x2 patch's ``4C`` values, the transformer's token) to the conditional velocity's norm,
        so guidance turns the velocity without lengthening it."""
        h, w = v_cond.shape[-2:]
        cond = pack_latents(v_cond)
        combined = pack_latents(v_uncond + scale * (v_cond - v_uncond))
        rescaled = combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return unpack_latents(rescaled, h, w)

    def timestep_schedule(self, num_steps: int) -> torch.Tensor:
        _, h, w = self.latent_shape
        return shifted_schedule(self.scheduler, num_steps, (h // 2) * (w // 2), "qwen-image")

    @torch.no_grad()
    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-decode final latents [B, C, h, w] (the per-channel latent normalisation undone first)
        to images [B, 3, H, W] in [0, 1]."""
        decoded = decode_wan_latents(self._frozen.vae, latents[:, :, None])[:, :, 0]
        return ((decoded.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ internals

    def _denoise(self, x_t: torch.Tensor, timestep: torch.Tensor, enc: QwenImageEncodings) -> torch.Tensor:
        b, _, h, w = x_t.shape
        out = self.transformer(
            hidden_states=pack_latents(x_t),
            timestep=timestep / 1000.0,  # the transformer reads the sigma; the pipeline divides by 1000
            encoder_hidden_states=enc.sequence,
            encoder_hidden_states_mask=enc.mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        assert isinstance(out, torch.Tensor)
        return unpack_latents(out, h, w)

    def _encode_text(self, text: str) -> QwenImageEncodings:
        """One prompt's conditioning [1, L, D] and mask [1, L], autocast off (frozen FP32 encoder)."""
        device = next(self.transformer.parameters()).device
        tokens = self._frozen.tokenizer(
            [PROMPT_TEMPLATE.format(text)],
            max_length=TOKENIZER_MAX_PROMPT + TEMPLATE_PREFIX_TOKENS,
            truncation=True,
            return_tensors="pt",
        )
        ids = cast(torch.Tensor, tokens.input_ids).to(device)
        mask = cast(torch.Tensor, tokens.attention_mask).to(device)
        with torch.autocast(device_type=device.type, enabled=False):
            # logits_to_keep=1: the language-model head is not needed, only the last hidden states
            out = self._frozen.text_encoder(
                input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1
            )
        states = out.hidden_states[-1][0, TEMPLATE_PREFIX_TOKENS:][: self.max_sequence_length]
        length = int(states.shape[0])
        sequence = states.new_zeros(1, self.max_sequence_length, states.shape[-1])
        sequence[0, :length] = states
        keep = torch.zeros(1, self.max_sequence_length, dtype=torch.long, device=device)
        keep[0, :length] = 1
        return QwenImageEncodings(sequence, keep)


# ----------------------------------------------------------------------------- the directory


def is_qwen_image_directory(directory: Path) -> bool:
    return is_pipeline_directory(directory, PIPELINE_CLASSES)


def _check_parts(root: Path, transformer: Any, tokenizer: Any, image: dict[str, int], vae: Any) -> None:
    for switch, what in _REFUSED_TRANSFORMER_SWITCHES.items():
        if transformer.config.get(switch, False):
            raise ValueError(f"{root}: {what}; the qwen-image family trains the text-to-image transformer")
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    count = len(tokenizer(prefix).input_ids)
    if count != TEMPLATE_PREFIX_TOKENS:
        raise ValueError(
            f"{root}: the tokenizer reads the prompt template's prefix as {count} tokens, not the "
            f"{TEMPLATE_PREFIX_TOKENS} Qwen-Image drops; not a Qwen2 tokenizer"
        )
    step = 2 * 2 ** len(vae.config.temperal_downsample)  # VAE scale x the 2x2 patch
    if image["height"] % step or image["width"] % step:
        raise ValueError(f"{root}: image size {image['height']}x{image['width']} is not a multiple of {step}")


def load_qwen_image(
    directory: str | Path, precision: PrecisionConfig | None = None, prompts: tuple[str, ...] = ()
) -> QwenImageFlowModel:
    """Load a Qwen-Image diffusers directory in FP32 (master weights), in eval mode."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    classes = (QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2_5_VLForConditionalGeneration)
    loaded = load_text_pipeline(directory, "qwen-image", _COMPONENTS, IMAGE_FILE, DEFAULT_IMAGE, classes)
    _check_parts(loaded.root, loaded.transformer, loaded.frozen.tokenizer, loaded.sizes, loaded.frozen.vae)
    return prompted_model(QwenImageFlowModel, loaded, prompts, precision, image=loaded.sizes)


def build_tiny_qwen_image(dest: Path, seed: int) -> None:
    """Builder of the built-in ``tiny-qwen-image`` (see :mod:`miles_diffusion.qwen_image_proxy`)."""
    from miles_diffusion.qwen_image_proxy import build

    build(Path(dest), seed)
