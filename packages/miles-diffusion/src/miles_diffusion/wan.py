"""The Wan 2.x text-to-video family: a local diffusers ``WanPipeline`` directory as a
:class:`~miles_diffusion.denoiser.DiffusionModel` over video latents.

What is loaded (by the directory's ``model_index.json``): ``transformer``
(``WanTransformer3DModel``, the denoiser: the only part that trains), ``vae`` (``AutoencoderKLWan``:
final latents are decoded to frames for the rewards), ``text_encoder`` (``UMT5EncoderModel``, or a
``T5EncoderModel``) with its ``tokenizer``, and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``, or
``UniPCMultistepScheduler`` with flow sigmas, as Wan's own directories carry: only the sigmas it
gives for a step count are read). Text encoder and VAE are frozen, in eval mode and kept off the
module tree: not in ``parameters()`` nor ``state_dict()``. Wan 2.1 T2V directories load, and Wan
2.2 TI2V-5B's (``expand_timesteps: true``) for text-to-video: its transformer is given one timestep
per video token, as WanPipeline gives it (see :meth:`WanFlowModel._denoise`), and its VAE's larger
spatial factor and latent width are read from the VAE's config. Wan 2.2 A14B's two experts load
in the package driver (``transformer_2`` with ``boundary_ratio``): ``transformer``, the high-noise
expert, denoises the rows whose timestep is at least ``boundary_ratio * num_train_timesteps``, and
``transformer_2`` the others, as WanPipeline picks them; both are submodules and both train. The
core path (``miles run``), LoRA and FSDP ranks refuse a two-expert directory in one line
(:func:`two_expert_refusal`); WanPipeline's ``guidance_scale_2`` (another scale for the low-noise
stage) is not offered: one scale guides both, its default.

Latents are ``[C, F, h, w]``: ``C`` the VAE's ``z_dim``, ``F = (frames - 1) / scale_factor_temporal
+ 1``, ``h, w`` the pixel size over ``scale_factor_spatial``. The video size is WanPipeline's default
(81 frames of 480x832) unless the directory holds ``miles_video.json`` (``{"num_frames": ...,
"height": ..., "width": ...}``; diffusers ignores the file), as ``builtin:tiny-wan`` does.

The conditioning is Wan's: the prompt is cleaned (HTML entities unescaped twice, whitespace runs
collapsed, ends stripped; diffusers also applies ``ftfy`` when that package is installed, which it
is not here), tokenized with padding to ``WAN_MAX_LENGTH`` (512) tokens and an attention mask, read
by the text encoder with that mask, and its last hidden states past the prompt's real tokens are
set to zero. Written from the model's documented inputs; ``tests/diffusion/test_wan.py`` checks it
bit for bit against diffusers' ``WanPipeline.encode_prompt`` on the proxy. No classifier-free
guidance: the sampler draws from the conditional velocity alone. Each distinct prompt is encoded
alone (a batch of one) the first time it is asked for, and kept (the encoder is frozen).

The transformer reads ``t * num_train_timesteps`` (continuous; diffusers' UniPC rounds its
timesteps to integers, FlowMatchEuler does not).

How a video reaches the image rewards: :meth:`WanFlowModel.to_images` decodes the frames and lays
them side by side, one filmstrip image ``[B, 3, H, frames * W]`` per video. Every image reward then
scores a whole video as one image (brightness: the mean over all frames; JPEG compressibility: of
the frames together), and its ``[B]`` rewards stay one per trajectory.

:func:`build_tiny_wan` writes the scaled-down proxy (random weights, a character-level T5
tokenizer, a 1-layer UMT5 encoder): ``builtin:tiny-wan``.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from miles_diffusion.pipeline_model import VideoLatentsFlowModel
from miles_diffusion.pipeline_parts import (
    TensorFields,
    TextFrozenParts,
    check_components,
    decode_wan_latents,
    is_pipeline_directory,
    load_scheduler,
    load_text_parts,
    read_component_config,
    read_model_index,
    read_sizes,
    seeded_weights,
    start_char_t5_proxy,
    tiny_t5_settings,
    tiny_wan_vae,
    video_latent_grid,
    write_proxy_files,
)
from miles_diffusion.precision import PrecisionConfig, keep_fp32

if TYPE_CHECKING:
    from miles_diffusion.sequence_parallel import SequenceSplit

PIPELINE_CLASSES = ("WanPipeline",)
"""``_class_name`` values of ``model_index.json`` this family loads."""

WAN_MAX_LENGTH = 512
"""Text tokens of the conditioning (WanPipeline's ``max_sequence_length`` default)."""

VIDEO_FILE = "miles_video.json"
"""Optional file of a Wan directory naming the video size the sampler draws."""

DEFAULT_VIDEO = {"num_frames": 81, "height": 480, "width": 832}
"""WanPipeline's default video size, used when the directory has no ``VIDEO_FILE``."""

_COMPONENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformer": ("diffusers", ("WanTransformer3DModel",)),
    "vae": ("diffusers", ("AutoencoderKLWan",)),
    "scheduler": ("diffusers", ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")),
    "text_encoder": ("transformers", ("UMT5EncoderModel", "T5EncoderModel")),
    "tokenizer": ("transformers", ("T5Tokenizer", "T5TokenizerFast", "AutoTokenizer")),
}


@dataclass(frozen=True)
class WanEncodings(TensorFields):
    """Wan's conditioning for a batch of prompts: ``sequence`` [B, WAN_MAX_LENGTH, text_dim]."""

    sequence: torch.Tensor


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning, without ftfy: HTML entities unescaped twice, whitespace collapsed."""
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class WanFlowModel(VideoLatentsFlowModel):
    """Wan's transformer as a rectified-flow velocity model over video latents, prompted by id."""

    encodings_type = WanEncodings
    _frozen: TextFrozenParts

    def __init__(
        self,
        *args: Any,
        expand_timesteps: bool = False,
        transformer_2: nn.Module | None = None,
        boundary_ratio: float | None = None,
        **kwargs: Any,
    ) -> None:
        """:class:`VideoLatentsFlowModel`'s arguments, the directory's ``expand_timesteps`` (Wan 2.2
        TI2V: the transformer reads one timestep per video token), and Wan 2.2 A14B's low-noise expert
        ``transformer_2`` with its ``boundary_ratio`` (both or neither)."""
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError(
                "a second Wan expert needs a boundary_ratio, and a boundary_ratio a second expert"
            )
        super().__init__(*args, **kwargs)
        self.expand_timesteps = bool(expand_timesteps)
        self.boundary_ratio = boundary_ratio
        if transformer_2 is not None:
            # registered after the precision's FP32 modules were kept on `transformer`: keep them here too
            self.transformer_2 = transformer_2
            twins = tuple(
                "transformer_2." + p.removeprefix("transformer.") if p.startswith("transformer.") else p
                for p in self.precision.fp32_modules
            )
            self.fp32_modules = list(dict.fromkeys([*self.fp32_modules, *keep_fp32(self, twins)]))

    @property
    def boundary_timestep(self) -> float | None:
        """WanPipeline's switch between the experts, on the scheduler's timestep scale (None: one)."""
        if self.boundary_ratio is None:
            return None
        return self.boundary_ratio * self.num_train_timesteps

    @property
    def latent_shape(self) -> tuple[int, ...]:
        vae: Any = cast(Any, self._frozen.vae).config
        grid = video_latent_grid(self.video, int(vae.scale_factor_temporal), int(vae.scale_factor_spatial))
        return (int(vae.z_dim), *grid)

    def timestep_schedule(self, num_steps: int) -> torch.Tensor:
        self.scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = torch.as_tensor(self.scheduler.sigmas)
        if sigmas.shape != (num_steps + 1,) or float(sigmas[-1]) != 0.0:
            raise ValueError(
                f"the scheduler gives sigmas of shape {tuple(sigmas.shape)} ending at {float(sigmas[-1])} "
                f"for {num_steps} steps; the wan family needs {num_steps + 1} ending at 0"
            )
        return sigmas.to(torch.float32).clone()

    @torch.no_grad()
    def to_videos(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-decode final latents (Wan's per-channel latent normalisation undone first) to videos
        [B, 3, frames, H, W] in [0, 1]."""
        decoded = decode_wan_latents(self._frozen.vae, latents)
        return ((decoded.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ internals

    def _denoise(self, x_t: torch.Tensor, timestep: torch.Tensor, enc: WanEncodings) -> torch.Tensor:
        boundary = self.boundary_timestep
        if boundary is None:
            return self._expert(self.transformer, x_t, timestep, enc)
        # each row's expert as WanPipeline picks it (t >= boundary: the high-noise one); a sampler or
        # trainer call shares one t, so one expert runs, but mixed rows are split and put back
        high = timestep >= boundary
        if bool(high.all()):
            return self._expert(self.transformer, x_t, timestep, enc)
        if not bool(high.any()):
            return self._expert(self.transformer_2, x_t, timestep, enc)
        out = torch.empty_like(x_t)
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            index = rows.nonzero().squeeze(1)
            out[index] = self._expert(expert, x_t[index], timestep[index], enc[index]).to(out.dtype)
        return out

    def _expert(
        self, transformer: nn.Module, x_t: torch.Tensor, timestep: torch.Tensor, enc: WanEncodings
    ) -> torch.Tensor:
        if self.expand_timesteps:
            timestep = self._per_token(x_t, timestep)
        out = transformer(
            hidden_states=x_t, timestep=timestep, encoder_hidden_states=enc.sequence, return_dict=False
        )[0]
        assert isinstance(out, torch.Tensor)
        return out

    def _per_token(self, x_t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """TI2V's timesteps ``[B, tokens]``: each row's timestep on every video token (latent frames x
        patches, in the transformer's token order). WanPipeline's text-to-video builds the same
        numbers as a mask of ones over the latents, subsampled by the patch, times ``t``, flattened
        and expanded over the batch (its image-to-video would zero the first frame's: not served)."""
        pt, ph, pw = (int(p) for p in cast(Any, self.transformer).config.patch_size)
        _, _, frames, height, width = x_t.shape
        tokens = (frames // pt) * (height // ph) * (width // pw)
        return timestep[:, None].expand(-1, tokens)

    def _encode_text(self, text: str) -> WanEncodings:
        """One prompt's conditioning [1, WAN_MAX_LENGTH, D], autocast off (frozen FP32 encoder)."""
        device = next(self.transformer.parameters()).device
        ids, mask = self._frozen.padded_tokens(clean_prompt(text), WAN_MAX_LENGTH, device)
        with torch.autocast(device_type=device.type, enabled=False):
            states = self._frozen.text_encoder(ids, mask).last_hidden_state
        length = int(mask[0].gt(0).sum())
        keep = (torch.arange(WAN_MAX_LENGTH, device=device) < length).to(states.dtype)
        return WanEncodings(states * keep[None, :, None])


# ----------------------------------------------------------------------------- the directory


def is_wan_directory(directory: Path) -> bool:
    return is_pipeline_directory(directory, PIPELINE_CLASSES)


def _has_second_expert(index: dict[str, Any]) -> bool:
    second = index.get("transformer_2")
    return (second is not None and second != [None, None]) or index.get("boundary_ratio") is not None


def is_two_expert_directory(directory: str | Path) -> bool:
    """Whether ``directory`` is a two-expert Wan 2.2 (A14B) one: ``transformer_2`` / ``boundary_ratio``."""
    root = Path(directory)
    return is_wan_directory(root) and _has_second_expert(read_model_index(root))


def two_expert_refusal(where: str, what: str) -> str:
    """The one line refusing a two-expert Wan 2.2 directory where only one transformer is handled."""
    return (
        f"{where}: a two-expert Wan 2.2 directory (transformer_2 / boundary_ratio); {what} handles one "
        "transformer so far; train it with python -m miles_diffusion.train, one process, no LoRA "
        "(docs/diffusion.md, 'Wan 2.2')"
    )


def _check_index(index: dict[str, Any], directory: Path) -> None:
    check_components(index, directory, _COMPONENTS, "wan")
    if not _has_second_expert(index):
        return
    second, ratio = index.get("transformer_2"), index.get("boundary_ratio")
    if not (isinstance(second, list) and len(second) == 2 and second[1] == "WanTransformer3DModel"):
        raise ValueError(
            f"{directory}: model_index.json names {second!r} for 'transformer_2' with boundary_ratio "
            f"{ratio!r}; a two-expert Wan 2.2 directory needs a WanTransformer3DModel (diffusers)"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio < 1.0:
        raise ValueError(
            f"{directory}: boundary_ratio {ratio!r}; a two-expert Wan 2.2 directory needs one in (0, 1)"
        )


def load_wan(
    directory: str | Path, precision: PrecisionConfig | None = None, prompts: tuple[str, ...] = ()
) -> WanFlowModel:
    """Load a Wan 2.x text-to-video diffusers directory in FP32 (master weights), in eval mode."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import T5EncoderModel, UMT5EncoderModel

    root = Path(directory)
    index = read_model_index(root)
    _check_index(index, root)
    scheduler = load_scheduler(root, index)
    if scheduler.config.get("use_dynamic_shifting", False):
        raise ValueError(
            f"{root}: the scheduler uses dynamic shifting; the wan family samples with a fixed shift"
        )
    if index["scheduler"][1] == "UniPCMultistepScheduler" and not scheduler.config.get("use_flow_sigmas"):
        raise ValueError(
            f"{root}: a UniPCMultistepScheduler without use_flow_sigmas is not a flow-matching one"
        )
    encoder_class = UMT5EncoderModel if index["text_encoder"][1] == "UMT5EncoderModel" else T5EncoderModel
    # Wan's video file must name every size (the others' may leave some to the defaults)
    video = read_sizes(root / VIDEO_FILE, DEFAULT_VIDEO, required=True)
    transformer, frozen = load_text_parts(root, WanTransformer3DModel, AutoencoderKLWan, encoder_class)
    transformer_2 = None
    if _has_second_expert(index):
        with torch.random.fork_rng(devices=[]):
            transformer_2 = WanTransformer3DModel.from_pretrained(
                str(root), subfolder="transformer_2", dtype=torch.float32
            )
    model = WanFlowModel(
        cast(nn.Module, transformer),
        frozen,
        tuple(prompts),
        scheduler=scheduler,
        video=video,
        precision=precision,
        expand_timesteps=bool(index.get("expand_timesteps")),
        transformer_2=cast(nn.Module, transformer_2) if transformer_2 is not None else None,
        boundary_ratio=float(index["boundary_ratio"]) if transformer_2 is not None else None,
    )
    return model.eval()


# ----------------------------------------------------------------------------- the proxy


@dataclass(frozen=True)
class TinyWanConfig:
    """The scaled-down Wan proxy: Wan's architecture and conditioning at toy widths.

    5 frames of 16x16 RGB; an AutoencoderKLWan of base width 8, 3 stages (4x spatial, 2x temporal
    compression: latents [4, 3, 4, 4]); a 2-layer WanTransformer3DModel, patch (1, 2, 2) (12 video
    tokens), 2 heads of 12; a 1-layer UMT5 encoder of width 32 over a character-level tokenizer."""

    num_frames: int = 5
    size: int = 16
    z_dim: int = 4
    vae_base_dim: int = 8
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 12
    text_dim: int = 32
    text_layers: int = 1
    shift: float = 3.0
    vae_patch_size: int | None = None
    """Wan 2.2 TI2V's VAE: pixels patchified by this factor before a residual encoder (its spatial
    factor grows by it); None: Wan 2.1's."""
    expand_timesteps: bool = False
    """Wan 2.2 TI2V's per-token timesteps (``model_index.json``'s ``expand_timesteps``)."""
    boundary_ratio: float | None = None
    """Wan 2.2 A14B: a second transformer (the low-noise expert, its own random weights) below this
    fraction of the training timesteps; None: one transformer."""


TINY_WAN22_TI2V = TinyWanConfig(size=32, z_dim=8, vae_patch_size=2, expand_timesteps=True)
"""The Wan 2.2 TI2V-5B proxy (``builtin:tiny-wan22-ti2v``): ``expand_timesteps``, a patchified
residual VAE of spatial factor 8 (TI2V's 16, scaled down) and latent width 8 (TI2V's 48): 5 frames
of 32x32 to latents [8, 3, 4, 4]; the transformer as ``tiny-wan``'s (12 video tokens)."""


TINY_WAN22_A14B = TinyWanConfig(boundary_ratio=0.875)
"""The Wan 2.2 A14B proxy (``builtin:tiny-wan22-a14b``): ``tiny-wan`` (A14B keeps Wan 2.1's VAE) with
a second transformer of its own weights and A14B text-to-video's ``boundary_ratio`` 0.875 (with shift 3
and 4 steps, sigmas 1, 0.858, 0.602, 0.009: the first step on the high-noise expert, the other three
on the low-noise one)."""


def build_tiny_wan22_a14b(dest: Path, seed: int) -> None:
    """Builder of the built-in ``tiny-wan22-a14b`` (:data:`TINY_WAN22_A14B`)."""
    build_tiny_wan(dest, seed, TINY_WAN22_A14B)


def build_tiny_wan22_ti2v(dest: Path, seed: int) -> None:
    """Builder of the built-in ``tiny-wan22-ti2v`` (:data:`TINY_WAN22_TI2V`)."""
    build_tiny_wan(dest, seed, TINY_WAN22_TI2V)


def _tiny_vae(vae_class: Any, c: TinyWanConfig) -> Any:
    if c.vae_patch_size is None:
        return tiny_wan_vae(
            vae_class, c.vae_base_dim, c.z_dim, scale_factor_temporal=2, scale_factor_spatial=4
        )
    p = c.vae_patch_size
    return tiny_wan_vae(
        vae_class,
        c.vae_base_dim,
        c.z_dim,
        scale_factor_temporal=2,
        scale_factor_spatial=4 * p,
        is_residual=True,
        patch_size=p,
        in_channels=3 * p * p,
        out_channels=3 * p * p,
    )


def build_tiny_wan(dest: Path, seed: int, config: TinyWanConfig | None = None) -> None:
    """Builder of the built-in ``tiny-wan``: the proxy as a diffusers ``WanPipeline`` directory,
    random weights from ``seed`` (the caller's RNG is left as it was)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    c = config or TinyWanConfig()
    dest, tokenizer = start_char_t5_proxy(dest)
    settings: dict[str, Any] = {
        "patch_size": (1, 2, 2),
        "num_attention_heads": c.num_attention_heads,
        "attention_head_dim": c.attention_head_dim,
        "in_channels": c.z_dim,
        "out_channels": c.z_dim,
        "text_dim": c.text_dim,
        "freq_dim": 16,
        "ffn_dim": 2 * c.num_attention_heads * c.attention_head_dim,
        "num_layers": c.num_layers,
        "rope_max_seq_len": 32,
    }
    with seeded_weights(seed):
        vae = _tiny_vae(AutoencoderKLWan, c)
        transformer = WanTransformer3DModel(**settings)
        encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_settings(tokenizer, c.text_dim, c.text_layers)))
        # the low-noise expert's weights drawn last: the parts above are those of the one-expert proxy
        second = WanTransformer3DModel(**settings) if c.boundary_ratio is not None else None
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=c.shift)
    parts = {"transformer": transformer, "vae": vae, "text_encoder": encoder, "scheduler": scheduler}
    experts: dict[str, Any] = {"transformer_2": [None, None], "boundary_ratio": None}
    if second is not None:
        parts["transformer_2"] = second
        experts = {"boundary_ratio": c.boundary_ratio}
    video = {"num_frames": c.num_frames, "height": c.size, "width": c.size}
    write_proxy_files(
        dest,
        PIPELINE_CLASSES[0],
        parts,
        "T5TokenizerFast",
        VIDEO_FILE,
        video,
        # Wan 2.2's keys (a one-transformer directory writes transformer_2 [null, null])
        expand_timesteps=c.expand_timesteps,
        **experts,
    )


def wan_sequence_split(root: Path) -> SequenceSplit:
    """What a sequence-parallel forward of the Wan directory ``root`` splits, from its config files
    alone (:mod:`miles_diffusion.sequence_parallel`): the video tokens (latent frames x patches; the
    text is not split) and the attention heads."""
    from miles_diffusion.sequence_parallel import SequenceSplit

    video = read_sizes(root / VIDEO_FILE, DEFAULT_VIDEO, required=True)
    vae = read_component_config(root, "vae")
    transformer = read_component_config(root, "transformer")
    pt, ph, pw = (int(p) for p in transformer.get("patch_size", (1, 2, 2)))
    # AutoencoderKLWan's defaults for keys a config leaves out
    frames, height, width = video_latent_grid(
        video, int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))
    )
    tokens = (frames // pt) * (height // ph) * (width // pw)
    return SequenceSplit({"video tokens": tokens}, int(transformer.get("num_attention_heads", 40)))
