"""The built-in models this package adds to ``builtin:NAME`` (the ``miles.models`` entry points).

Only records: the builder runs (and imports torch and diffusers) when a model is first built.
"""

from __future__ import annotations

from miles.models.registry import BuiltinModel

TINY_FLOW_UNET = BuiltinModel(
    "tiny-flow-unet",
    "diffusion",
    "MilesTinyFlowUNet",
    "164.8K",
    "random-init class-conditioned flow-matching UNet (diffusers UNet2DModel), 16x16 RGB, 4 prompt ids; "
    "the tiny diffusion recipes' model",
    "miles_diffusion.model:build_tiny_flow_unet",
)

TINY_SD3 = BuiltinModel(
    "tiny-sd3",
    "diffusion",
    "StableDiffusion3Pipeline",
    "160.0K",
    "random-init scaled-down Stable Diffusion 3 pipeline (diffusers SD3Transformer2DModel, 2 layers; "
    "AutoencoderKL, 32x32 RGB to 8x8x4 latents; tiny CLIP-L / CLIP-G with byte-level tokenizers; no T5); "
    "the sd3_flow_grpo_proxy recipe's model",
    "miles_diffusion.sd3:build_tiny_sd3",
)

TINY_WAN = BuiltinModel(
    "tiny-wan",
    "diffusion",
    "WanPipeline",
    "21.8K",
    "random-init scaled-down Wan 2.x text-to-video pipeline (diffusers WanTransformer3DModel, 2 layers; "
    "AutoencoderKLWan, 5 frames of 16x16 RGB to 4x3x4x4 latents; a 1-layer UMT5 encoder with a "
    "character-level tokenizer); the wan_flow_grpo_proxy recipe's model",
    "miles_diffusion.wan:build_tiny_wan",
)

TINY_QWEN_IMAGE = BuiltinModel(
    "tiny-qwen-image",
    "diffusion",
    "QwenImagePipeline",
    "88.8K",
    "random-init scaled-down Qwen-Image pipeline (diffusers QwenImageTransformer2DModel, 2 layers; "
    "AutoencoderKLQwenImage, 32x32 RGB to 4x8x8 latents; a 1-layer Qwen2.5-VL text model of width 16 "
    "with the real Qwen2.5 tokenizer); the qwen_image_flow_grpo_proxy recipe's model",
    "miles_diffusion.qwen_image:build_tiny_qwen_image",
)

TINY_LTX = BuiltinModel(
    "tiny-ltx",
    "diffusion",
    "LTXPipeline",
    "31.8K",
    "random-init scaled-down LTX-Video text-to-video pipeline (diffusers LTXVideoTransformer3DModel, "
    "2 layers; AutoencoderKLLTXVideo, 5 frames of 32x32 RGB to 8x3x4x4 latents; a 1-layer T5 encoder "
    "with a character-level tokenizer); the ltx_flow_grpo_proxy recipe's model",
    "miles_diffusion.ltx:build_tiny_ltx",
)

TINY_COSMOS = BuiltinModel(
    "tiny-cosmos",
    "diffusion",
    "Cosmos2TextToImagePipeline",
    "36.9K",
    "random-init scaled-down Cosmos-Predict2 text-to-image pipeline (diffusers CosmosTransformer3DModel, "
    "2 layers; AutoencoderKLWan, 32x32 RGB to 4x8x8 latents; a 1-layer T5 encoder with a character-level "
    "tokenizer); the cosmos_flow_grpo_proxy recipe's model",
    "miles_diffusion.cosmos:build_tiny_cosmos",
)

TINY_WAN22_TI2V = BuiltinModel(
    "tiny-wan22-ti2v",
    "diffusion",
    "WanPipeline",
    "22.6K",
    "random-init scaled-down Wan 2.2 TI2V-5B text-to-video pipeline (expand_timesteps: per-token "
    "timesteps; diffusers WanTransformer3DModel, 2 layers; a patchified residual AutoencoderKLWan, 5 frames "
    "of 32x32 RGB to 8x3x4x4 latents; a 1-layer UMT5 encoder with a character-level tokenizer)",
    "miles_diffusion.wan:build_tiny_wan22_ti2v",
)

TINY_WAN22_A14B = BuiltinModel(
    "tiny-wan22-a14b",
    "diffusion",
    "WanPipeline",
    "43.6K",
    "random-init scaled-down Wan 2.2 A14B two-expert text-to-video pipeline (two diffusers "
    "WanTransformer3DModel experts of 2 layers, boundary_ratio 0.875; otherwise tiny-wan); the package "
    "driver trains both; miles run, LoRA and FSDP ranks refuse it",
    "miles_diffusion.wan:build_tiny_wan22_a14b",
)
