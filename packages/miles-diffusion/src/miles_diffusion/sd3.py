"""The Stable Diffusion 3 / 3.5 family: a local diffusers ``StableDiffusion3Pipeline`` directory as a
:class:`~miles_diffusion.denoiser.DiffusionModel`.

What is loaded (each component with its diffusers or transformers class, by the directory's
``model_index.json``): ``transformer`` (``SD3Transformer2DModel``, the denoiser: the only part that
trains), ``vae`` (``AutoencoderKL``: final latents are decoded to images for the rewards),
``text_encoder`` / ``text_encoder_2`` (CLIP-L and CLIP-G, ``CLIPTextModelWithProjection``) with
their tokenizers, optionally ``text_encoder_3`` (T5, ``T5EncoderModel``; a directory may leave it
out: ``[null, null]``), and ``scheduler`` (``FlowMatchEulerDiscreteScheduler``: its ``shift`` and
``num_train_timesteps``). Text encoders and VAE are frozen, in eval mode and not registered as
submodules: they are not in ``parameters()`` (so not in the optimizer), not in ``state_dict()``
(so not in weight updates or checkpoints).

The conditioning is SD3's: each CLIP encoder reads its tokens (padded to the tokenizer's
``model_max_length``, 77) and gives its penultimate hidden states and its projected pooled output;
the two sequences are joined along the feature axis and zero-padded to the transformer's
``joint_attention_dim``, then followed along the sequence axis by T5's last hidden states
(``T5_MAX_LENGTH`` tokens) or, without T5, by as many zero rows; the pooled projections are the two
pooled outputs side by side. Written from the model's documented inputs (diffusers'
``StableDiffusion3Pipeline.encode_prompt`` computes the same; ``tests/diffusion/test_sd3.py``
checks ours against it bit for bit on the proxy), with no classifier-free guidance: the sampler
draws from the conditional velocity alone.

A prompt is an integer id into the recipe's ``prompts`` list. Each distinct prompt is encoded alone
(a batch of one, so its encoding does not depend on what else is in a batch) the first time it is
asked for, and kept: the text encoders are frozen, so an encoding never goes stale.

The sampler's times are the directory's scheduler's sigmas for the step count (diffusers'
``FlowMatchEulerDiscreteScheduler.set_timesteps``: evenly spaced from 1, shifted by
``shift * s / (1 + (shift - 1) s)``, then a final 0), so the SDE visits the noise levels SD3's own
sampler does; the transformer reads ``t * num_train_timesteps``.

:func:`build_tiny_sd3` writes the scaled-down proxy (random weights, byte-level CLIP tokenizers,
no T5) as such a directory: ``builtin:tiny-sd3``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.pipeline_model import PipelineFlowModel
from miles_diffusion.pipeline_parts import (
    TensorFields,
    is_pipeline_directory,
    read_model_index,
    seeded_weights,
)
from miles_diffusion.precision import PrecisionConfig

PIPELINE_CLASSES = ("StableDiffusion3Pipeline",)
"""``_class_name`` values of ``model_index.json`` this family loads."""

T5_MAX_LENGTH = 256
"""Sequence length of the T5 part of the conditioning (zeros without T5): SD3's default."""

# component -> (library, class) a directory must name for it (None: optional)
_COMPONENTS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "transformer": ("diffusers", ("SD3Transformer2DModel",), True),
    "vae": ("diffusers", ("AutoencoderKL",), True),
    "scheduler": ("diffusers", ("FlowMatchEulerDiscreteScheduler",), True),
    "text_encoder": ("transformers", ("CLIPTextModelWithProjection",), True),
    "text_encoder_2": ("transformers", ("CLIPTextModelWithProjection",), True),
    "tokenizer": ("transformers", ("CLIPTokenizer", "CLIPTokenizerFast"), True),
    "tokenizer_2": ("transformers", ("CLIPTokenizer", "CLIPTokenizerFast"), True),
    "text_encoder_3": ("transformers", ("T5EncoderModel",), False),
    "tokenizer_3": ("transformers", ("T5Tokenizer", "T5TokenizerFast"), False),
}

# transformers attention implementations that compute attention with torch ops whose CPU kernels
# repeat bit for bit (the eager matmul-softmax path, and scaled_dot_product_attention)
DETERMINISTIC_TEXT_ATTENTION = frozenset({"eager", "sdpa"})


@dataclass(frozen=True)
class SD3Encodings(TensorFields):
    """SD3's conditioning for a batch of prompts: ``sequence`` [B, L, joint_attention_dim] (CLIP-L
    and CLIP-G penultimate states, then T5's) and ``pooled`` [B, pooled_projection_dim]."""

    sequence: torch.Tensor
    pooled: torch.Tensor


@dataclass
class _Frozen:
    """The parts that never train (kept off the module tree on purpose, see the module docstring)."""

    vae: nn.Module
    clip: Sequence[tuple[Any, nn.Module]]
    """(tokenizer, CLIPTextModelWithProjection) for CLIP-L, CLIP-G."""
    t5: tuple[Any, nn.Module] | None

    def modules(self) -> dict[str, nn.Module]:
        named = {"vae": self.vae, "text_encoder": self.clip[0][1], "text_encoder_2": self.clip[1][1]}
        if self.t5 is not None:
            named["text_encoder_3"] = self.t5[1]
        return named


class SD3FlowModel(PipelineFlowModel):
    """SD3's transformer as a rectified-flow velocity model over VAE latents, prompted by id."""

    encodings_type = SD3Encodings
    _frozen: _Frozen

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        config = self._transformer_config
        return (int(config.in_channels), int(config.sample_size), int(config.sample_size))

    def timestep_schedule(self, num_steps: int) -> torch.Tensor:
        self.scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = self.scheduler.sigmas
        assert isinstance(sigmas, torch.Tensor) and sigmas.shape == (num_steps + 1,)
        return sigmas.to(torch.float32).clone()

    @torch.no_grad()
    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-decode final latents (SD3's scaling and shift undone first) to images in [0, 1]."""
        config: Any = cast(Any, self._frozen.vae).config
        shift = float(getattr(config, "shift_factor", None) or 0.0)
        scaled = latents / float(config.scaling_factor) + shift
        decoded = cast(Any, self._frozen.vae).decode(scaled, return_dict=False)[0]
        return ((decoded.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    # ------------------------------------------------------------------ internals

    @property
    def _transformer_config(self) -> Any:
        return cast(Any, self.transformer).config

    def _denoise(self, x_t: torch.Tensor, timestep: torch.Tensor, enc: SD3Encodings) -> torch.Tensor:
        out = self.transformer(
            hidden_states=x_t,
            encoder_hidden_states=enc.sequence,
            pooled_projections=enc.pooled,
            timestep=timestep,
            return_dict=False,
        )[0]
        assert isinstance(out, torch.Tensor)
        return out

    def _encode_text(self, text: str) -> SD3Encodings:
        """One prompt's conditioning, [1, L, D] and [1, P], with autocast off (frozen FP32 encoders)."""
        device = next(self.transformer.parameters()).device
        width = int(self._transformer_config.joint_attention_dim)
        with torch.autocast(device_type=device.type, enabled=False):
            states, pooled = [], []
            for tokenizer, encoder in self._frozen.clip:
                ids = _token_ids(tokenizer, text, int(tokenizer.model_max_length), device)
                out = encoder(ids, output_hidden_states=True)
                states.append(out.hidden_states[-2])  # the penultimate layer, as SD3 reads CLIP
                pooled.append(out.text_embeds)  # the projected pooled output
            clip = torch.cat(states, dim=-1)
            if clip.shape[-1] > width:
                raise ValueError(
                    f"CLIP hidden sizes add up to {clip.shape[-1]}, wider than the transformer's "
                    f"joint_attention_dim {width}"
                )
            clip = nn.functional.pad(clip, (0, width - clip.shape[-1]))
            if self._frozen.t5 is not None:
                tokenizer, encoder = self._frozen.t5
                t5 = encoder(_token_ids(tokenizer, text, T5_MAX_LENGTH, device))[0]
            else:
                t5 = torch.zeros((1, T5_MAX_LENGTH, width), dtype=clip.dtype, device=device)
            return SD3Encodings(torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1))


def _token_ids(tokenizer: Any, text: str, length: int, device: torch.device) -> torch.Tensor:
    ids = tokenizer([text], padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return cast(torch.Tensor, ids.input_ids).to(device)


# ----------------------------------------------------------------------------- the directory

TRANSFORMER_DIR = "transformer"
"""The trained component's subfolder: what checkpoints hold and what an export replaces."""
_WEIGHTS = "diffusion_pytorch_model.safetensors"
_WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def save_transformer(model: DiffusionModel, directory: str | Path) -> Path:
    """The trainable part alone (``directory/transformer``: diffusers' ``save_pretrained``): a
    checkpoint's weights. The frozen text encoders and VAE are the base directory's, never copied.
    Any pipeline family whose model trains a diffusers ``transformer`` alone (sd3, wan)."""
    dest = Path(directory) / TRANSFORMER_DIR
    cast(Any, model).transformer.save_pretrained(str(dest), safe_serialization=True)
    return dest


def read_transformer_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The transformer's weights under ``directory/transformer`` (one file or an index of shards),
    keyed as the model's ``state_dict`` (``transformer.<name>``); one ValueError if unreadable."""
    from safetensors.torch import load_file

    root = Path(directory) / TRANSFORMER_DIR
    index = root / _WEIGHTS_INDEX
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        else:
            files = [_WEIGHTS]
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(str(root / name)))
    except Exception as exc:
        raise ValueError(
            f"{directory}: cannot read the transformer's weights ({type(exc).__name__}: {exc})"
        ) from None
    return {f"{TRANSFORMER_DIR}.{name}": t for name, t in state.items()}


def load_transformer(model: DiffusionModel, directory: str | Path) -> None:
    """Load ``directory/transformer``'s weights into ``model`` (every tensor must be there)."""
    model.load_state_dict(read_transformer_state(directory), strict=True)


def export_pipeline(model: DiffusionModel, base: str | Path, dest: str | Path) -> Path:
    """A whole pipeline directory of ``base``'s class (``StableDiffusion3Pipeline``, ``WanPipeline``): copies of every component of ``base`` but the
    transformer, and the trained transformer. Copies, not links: a later in-place write to the export
    (diffusers' ``save_pretrained`` truncates files it rewrites) must never reach the base."""
    import shutil

    base, out = Path(base), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(base.iterdir()):
        if entry.name == TRANSFORMER_DIR:
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name, dirs_exist_ok=True)
        else:
            shutil.copy2(entry, out / entry.name)
    if (out / TRANSFORMER_DIR).exists():
        shutil.rmtree(out / TRANSFORMER_DIR)
    save_transformer(model, out)
    return out


def is_sd3_directory(directory: Path) -> bool:
    return is_pipeline_directory(directory, PIPELINE_CLASSES)


def _component(index: dict[str, Any], name: str, directory: Path) -> bool:
    """Whether the directory carries component ``name``, checked against the classes this family loads."""
    library, classes, required = _COMPONENTS[name]
    entry = index.get(name)
    if entry is None or entry == [None, None]:
        if required:
            raise ValueError(f"{directory}: model_index.json has no {name!r}; SD3 needs it")
        return False
    if not (isinstance(entry, list) and len(entry) == 2 and entry[1] in classes):
        raise ValueError(
            f"{directory}: model_index.json names {entry!r} for {name!r}; the sd3 family loads "
            f"{' or '.join(classes)} ({library})"
        )
    return True


def load_sd3(
    directory: str | Path, precision: PrecisionConfig | None = None, prompts: tuple[str, ...] = ()
) -> SD3FlowModel:
    """Load an SD3 / SD3.5 diffusers directory in FP32 (master weights), in eval mode."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    root = Path(directory)
    index = read_model_index(root)
    present = {name: _component(index, name, root) for name in _COMPONENTS}
    if present["text_encoder_3"] != present["tokenizer_3"]:
        raise ValueError(f"{root}: text_encoder_3 and tokenizer_3 must both be present or both be null")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(root), subfolder="scheduler")
    if scheduler.config.get("use_dynamic_shifting", False):
        raise ValueError(
            f"{root}: the scheduler uses dynamic (resolution-dependent) shifting; the sd3 family "
            "samples with its fixed `shift`"
        )
    with torch.random.fork_rng(devices=[]):  # loading must not move the caller's RNG
        transformer = SD3Transformer2DModel.from_pretrained(
            str(root), subfolder="transformer", dtype=torch.float32
        )
        vae = AutoencoderKL.from_pretrained(str(root), subfolder="vae", dtype=torch.float32)
        clip = [
            (
                AutoTokenizer.from_pretrained(str(root / tok)),
                CLIPTextModelWithProjection.from_pretrained(str(root / enc), dtype=torch.float32),
            )
            for tok, enc in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
        ]
        t5 = None
        if present["text_encoder_3"]:
            t5 = (
                AutoTokenizer.from_pretrained(str(root / "tokenizer_3")),
                T5EncoderModel.from_pretrained(str(root / "text_encoder_3"), dtype=torch.float32),
            )
    model = SD3FlowModel(
        cast(nn.Module, transformer),
        _Frozen(cast(nn.Module, vae), clip, t5),
        tuple(prompts),
        scheduler=scheduler,
        precision=precision,
    )
    return model.eval()


# ----------------------------------------------------------------------------- the proxy


@dataclass(frozen=True)
class TinySD3Config:
    """The scaled-down SD3 proxy: SD3's architecture and conditioning at toy widths.

    32x32 RGB images; a VAE with 3 blocks (8x downsampling would leave too few tokens: 4x, so 8x8x4
    latents); a 2-layer joint-attention transformer, patch 2 (16 image tokens), 4 heads of 8;
    CLIP-L / CLIP-G stand-ins of hidden width 8 and 16 (their 24 features zero-padded to the
    transformer's 32, as CLIP's 2048 are to T5's 4096) over byte-level tokenizers; no T5."""

    image_size: int = 32
    latent_channels: int = 4
    vae_channels: tuple[int, ...] = (8, 16, 16)
    num_layers: int = 2
    attention_head_dim: int = 8
    num_attention_heads: int = 4
    joint_attention_dim: int = 32
    clip_widths: tuple[int, int] = (8, 16)
    clip_layers: int = 2
    shift: float = 3.0
    scaling_factor: float = 1.5305
    shift_factor: float = 0.0609
    t5_layers: int = 0
    """0: no T5 (``builtin:tiny-sd3``); else a T5 encoder of this depth, width ``joint_attention_dim``,
    over a character-level tokenizer (the layout of SD3.5 directories, which carry T5)."""
    # What a real-shaped build (benchmarks/diffusion_gpu.py: SD3.5-medium's transformer and VAE)
    # sets beside the widths above; the defaults are the proxy's.
    vae_layers_per_block: int = 1
    vae_norm_groups: int = 4
    clip_heads: int = 2
    qk_norm: str | None = None
    """``rms_norm`` in SD3.5 (query / key normalisation in every attention)."""
    dual_attention_layers: tuple[int, ...] = ()
    """The blocks with SD3.5's second, image-only attention (MMDiT-X)."""
    pos_embed_max_size: int | None = None
    """The positional-embedding grid's side (None: the latent side; SD3.5-medium: 384)."""


def _byte_characters() -> list[str]:
    """The printable character each byte value stands for in byte-level BPE vocabularies: printable
    Latin-1 bytes stand for themselves, the others for code points from 256 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, spare = [], 256
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(spare))
            spare += 1
    return chars


def write_byte_clip_tokenizer(directory: Path, max_length: int = 77) -> Any:
    """A valid CLIP tokenizer with no merges: every byte is a token (and again with CLIP's
    end-of-word mark ``</w>``), plus ``<|startoftext|>`` and ``<|endoftext|>`` (also the padding)."""
    from transformers import CLIPTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    chars = _byte_characters()
    tokens = [*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    tokenizer = CLIPTokenizer(
        vocab=str(directory / "vocab.json"),
        merges=str(directory / "merges.txt"),
        model_max_length=max_length,
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def write_char_t5_tokenizer(directory: Path) -> Any:
    """A valid T5 (unigram) tokenizer over printable ASCII: each character a piece, alone and after
    the word-start mark; ``<pad>``, ``</s>`` and ``<unk>`` first, as T5's are."""
    from transformers import T5Tokenizer

    chars = [chr(c) for c in range(0x21, 0x7F)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + c, -4.0) for c in chars] + [(c, -5.0) for c in chars]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def build_tiny_sd3(dest: Path, seed: int, config: TinySD3Config | None = None) -> None:
    """Builder of the built-in ``tiny-sd3``: the proxy as a diffusers ``StableDiffusion3Pipeline``
    directory, random weights from ``seed`` (the caller's RNG is left as it was)."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    c = config or TinySD3Config()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = write_byte_clip_tokenizer(dest / "tokenizer")
    write_byte_clip_tokenizer(dest / "tokenizer_2")
    factor = 2 ** (len(c.vae_channels) - 1)
    with seeded_weights(seed):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(c.vae_channels),
            up_block_types=("UpDecoderBlock2D",) * len(c.vae_channels),
            block_out_channels=c.vae_channels,
            layers_per_block=c.vae_layers_per_block,
            latent_channels=c.latent_channels,
            norm_num_groups=c.vae_norm_groups,
            sample_size=c.image_size,
            scaling_factor=c.scaling_factor,
            shift_factor=c.shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        transformer = SD3Transformer2DModel(
            sample_size=c.image_size // factor,
            patch_size=2,
            in_channels=c.latent_channels,
            out_channels=c.latent_channels,
            num_layers=c.num_layers,
            attention_head_dim=c.attention_head_dim,
            num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.joint_attention_dim,
            caption_projection_dim=c.attention_head_dim * c.num_attention_heads,
            pooled_projection_dim=sum(c.clip_widths),
            pos_embed_max_size=c.pos_embed_max_size or c.image_size // factor,
            qk_norm=c.qk_norm,
            dual_attention_layers=tuple(c.dual_attention_layers),
        )
        encoders = [
            CLIPTextModelWithProjection(
                CLIPTextConfig(
                    vocab_size=len(tokenizer),
                    hidden_size=width,
                    intermediate_size=2 * width,
                    num_hidden_layers=c.clip_layers,
                    num_attention_heads=c.clip_heads,
                    max_position_embeddings=int(tokenizer.model_max_length),
                    projection_dim=width,
                    bos_token_id=int(tokenizer.bos_token_id),
                    eos_token_id=int(tokenizer.eos_token_id),
                    pad_token_id=int(tokenizer.pad_token_id),
                )
            )
            for width in c.clip_widths
        ]
        t5: Any = None
        if c.t5_layers:
            t5_tokenizer = write_char_t5_tokenizer(dest / "tokenizer_3")
            t5 = T5EncoderModel(
                T5Config(
                    vocab_size=len(t5_tokenizer),
                    d_model=c.joint_attention_dim,
                    d_kv=8,
                    d_ff=2 * c.joint_attention_dim,
                    num_layers=c.t5_layers,
                    num_heads=2,
                    pad_token_id=int(t5_tokenizer.pad_token_id),
                    eos_token_id=int(t5_tokenizer.eos_token_id),
                )
            )
    cast(Any, transformer).save_pretrained(str(dest / "transformer"))
    cast(Any, vae).save_pretrained(str(dest / "vae"))
    encoders[0].save_pretrained(str(dest / "text_encoder"))
    encoders[1].save_pretrained(str(dest / "text_encoder_2"))
    if t5 is not None:
        t5.save_pretrained(str(dest / "text_encoder_3"))
    scheduler: Any = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=c.shift)
    scheduler.save_pretrained(str(dest / "scheduler"))
    index = {
        "_class_name": PIPELINE_CLASSES[0],
        "_diffusers_version": diffusers.__version__,
        **{
            name: [library, classes[0]]
            for name, (library, classes, required) in _COMPONENTS.items()
            if required
        },
        "text_encoder_3": ["transformers", "T5EncoderModel"] if t5 is not None else [None, None],
        "tokenizer_3": ["transformers", "T5TokenizerFast"] if t5 is not None else [None, None],
        "image_encoder": [None, None],
        "feature_extractor": [None, None],
    }
    (dest / "model_index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
